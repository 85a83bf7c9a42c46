"""Probe for an integer-accumulating conv GEMM (issue 20, QDQ int8 ResNet-18): one exact
int8 × int8 → int32 micro-kernel per ISA, written as TIR, built for a target, checked against
numpy where the host can run it, and timed.

    python scripts/int8_gemm_probe.py [--target JSON] [--shape M,N,K] [--runs 50]

The shape defaults to a ResNet-18 layer-1 3×3 conv as a weights-as-A GEMM: M = 64 output
channels, N = 56·56 positions, K = 64·3·3. The forms (chosen from the target's features,
never from this machine; the register tile is the float32 GEMM's, ``CpuParams.gemm_tile``,
whose accumulators are int32 lanes of the same width):

* ``vnni`` (AVX512-VNNI): ``vpdpbusd``, u8 × s8 in groups of 4 k summed into int32 lanes.
  B panels ``[N/NR, K/4, NR·4]`` u8 (an activation ``x`` as ``x + 128``), A a broadcast of
  4 s8 weights. No intermediate saturation: exact.
* ``pmaddwd`` (AVX2, SSE2): ``vpmaddwd``, s16 × s16 in pairs of k summed into int32 (exact),
  then ``vpaddd`` (its product takes a register: AVX2's 4×24 float32 tile becomes 3×24, 4×24
  moved 4 vectors to or from the stack per 2 k steps); B panels ``[N/NR, K/2, NR·2]`` s16 (an
  activation minus its zero point, -255..255), A a broadcast of 2 s16 weights.
  ``vpmaddubsw`` (u8 × s8 into *saturated* int16 pairs, TVM's ``dot_16x4_avx512``) is not
  exact: 255·127·2 > 32767.
* ``sdot`` (AArch64 ``+dotprod``): ``sdot``, s8 × s8 in groups of 4 k into int32 lanes.

An int8 activation ``q`` with zero point ``z`` reaches the u8/s8 forms as ``q + 128`` / ``q``:
``Σ w·(q − z) = Σ w·(q + 128) − (128 + z)·Σ w``, the last a constant per output channel (the
weight's row sum, known at compile time), all in int32 (|sum| < 2^31 for K < 65,793). The
padding of a conv reads ``z`` (the dequantized 0). TVM 0.27's own ``dot_16x4_vnni`` intrinsic
does not build with its LLVM: ``llvm.x86.avx512.vpdpbusd.512`` now takes ``<64 x i8>``
operands, not ``<16 x i32>``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tvm  # noqa: E402
from tvm.script import tirx as T  # noqa: E402

from tvm_fusion.target import to_target  # noqa: E402
from tvm_fusion.tir_schedules.cpu_target import cpu_params, has_feature  # noqa: E402

# per form: (k values per int32 lane, B element dtype, LLVM intrinsic)
FORMS = {
    "vnni": (4, "uint8", "llvm.x86.avx512.vpdpbusd.512"),
    "pmaddwd": (2, "int16", None),  # intrinsic by vector width, see _pmaddwd
    "sdot": (4, "int8", "llvm.aarch64.neon.sdot.v4i32.v16i8"),
}


def form_of(target: tvm.target.Target) -> str | None:
    """The exact integer dot product ``target`` has, or None."""
    params = cpu_params(target)
    if params.isa == "avx512" and has_feature(target, "avx512vnni"):
        return "vnni"
    if params.isa == "neon":
        return "sdot" if has_feature(target, "dotprod") else None
    if params.isa in ("avx512", "avx2", "avx", "sse"):
        return "pmaddwd"
    return None


def _pmaddwd(lanes: int) -> str:
    return {16: "llvm.x86.avx512.pmaddw.d.512", 8: "llvm.x86.avx2.pmadd.wd",
            4: "llvm.x86.sse2.pmadd.wd"}[lanes]


def build_gemm(target: tvm.target.Target, m: int, n: int, k: int):
    """(PrimFunc, form, (MR, NR), group): ``C[m, n_padded] = Σ_k A[m, k] · B[k, n]`` in int32,
    A packed as int32 groups of ``group`` k (``[M, K/group]``), B in ``[⌈N/NR⌉, K/group,
    NR·group]`` panels, C's columns padded to whole panels."""
    form = form_of(target)
    if form is None:
        raise ValueError(f"no exact integer dot product on {target}")
    params = cpu_params(target)
    lanes = params.lanes  # int32 lanes of one register = float32 lanes
    group, b_dtype, intrin = FORMS[form]
    if form == "pmaddwd":
        intrin = _pmaddwd(lanes)
    mr, nr = params.gemm_tile()
    nv = nr // lanes
    # pmaddwd's product needs a register of its own before the add (an FMA, vpdpbusd and
    # sdot accumulate in place): rows that fit beside the B vectors, the A broadcast and it
    temps = 1 if form == "pmaddwd" else 0
    mr = max(1, min(mr, (params.vector_registers - nv - 1 - temps) // nv))
    if m % mr:
        mr = next(r for r in range(mr, 0, -1) if m % r == 0)
    if k % group:
        raise ValueError(f"K={k} is not a multiple of {group} (pad K with zero weights)")
    kg, panels = k // group, -(-n // nr)
    b_lanes = lanes * group  # B elements in one register

    def dot(acc, b_vec, a_word):
        a_vec = T.reinterpret(f"{b_dtype if form != 'vnni' else 'int8'}x{b_lanes}",
                              T.broadcast(a_word, lanes))
        if form == "pmaddwd":
            return acc + T.call_llvm_pure_intrin(f"int32x{lanes}", intrin, b_vec, a_vec)
        return T.call_llvm_pure_intrin(f"int32x{lanes}", intrin, acc, b_vec, a_vec)

    @T.prim_func
    def gemm(a: T.Buffer((m, kg), "int32"), b: T.Buffer((panels, kg, nr * group), b_dtype),
             c: T.Buffer((m, panels * nr), "int32")):
        T.func_attr({"tirx.noalias": True, "global_symbol": "gemm"})
        for jp in range(panels):
            for ir in range(m // mr):
                acc = T.alloc_buffer((mr, nr), "int32", scope="local")
                for r in T.unroll(mr):
                    for v in T.unroll(nv):
                        acc[r, T.ramp(v * lanes, 1, lanes)] = T.broadcast(T.int32(0), lanes)
                for kk in range(kg):
                    for r in T.unroll(mr):
                        for v in T.unroll(nv):
                            acc[r, T.ramp(v * lanes, 1, lanes)] = dot(
                                acc[r, T.ramp(v * lanes, 1, lanes)],
                                b[jp, kk, T.ramp(v * b_lanes, 1, b_lanes)],
                                a[ir * mr + r, kk])
                for r in T.unroll(mr):
                    for v in T.unroll(nv):
                        c[ir * mr + r, T.ramp(jp * nr + v * lanes, 1, lanes)] = \
                            acc[r, T.ramp(v * lanes, 1, lanes)]

    return gemm, form, (mr, nr), group


def operands(form: str, m: int, n: int, k: int, nr: int, group: int, seed: int = 0):
    """Random operands in each form's ranges, packed, and the exact int64 reference."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-128, 128, (m, k))
    lo, hi = {"vnni": (0, 256), "pmaddwd": (-255, 256), "sdot": (-128, 128)}[form]
    x = rng.integers(lo, hi, (k, n))
    _, b_dtype, _ = FORMS[form]
    panels = -(-n // nr)
    xp = np.zeros((k, panels * nr), np.int64)
    xp[:, :n] = x
    b = (xp.reshape(k // group, group, panels, nr).transpose(2, 0, 3, 1)
         .reshape(panels, k // group, nr * group).astype(b_dtype))
    a_dtype = "int16" if form == "pmaddwd" else "int8"
    a = np.ascontiguousarray(w.astype(a_dtype)).view(np.int32).reshape(m, k // group)
    return a, b, w @ x


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default='{"kind": "llvm", "mcpu": "znver4", "num-cores": 1}')
    parser.add_argument("--shape", default="64,3136,576", help="M,N,K")
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args(argv)
    target = to_target(args.target)
    m, n, k = (int(v) for v in args.shape.split(","))
    func, form, (mr, nr), group = build_gemm(target, m, n, k)
    lib = tvm.compile(tvm.IRModule({"gemm": func}), target=target)
    print(f"{form}: tile {mr}×{nr} int32, k in groups of {group}")
    if "mtriple" in target.attrs and not str(target.attrs["mtriple"]).startswith("x86"):
        print("built (not run: another architecture)")
        return 0
    a, b, ref = operands(form, m, n, k, nr, group)
    dev = tvm.cpu()
    args_ = [tvm.runtime.tensor(v, dev) for v in (a, b, np.zeros((m, b.shape[0] * nr), "int32"))]
    lib["gemm"](*args_)
    exact = np.array_equal(args_[2].numpy()[:, :n], ref)
    times = []
    for _ in range(args.runs):
        start = time.thread_time()
        lib["gemm"](*args_)
        times.append(time.thread_time() - start)
    best = min(times)
    print(f"exact: {exact}; {best * 1e3:.3f} ms, {2 * m * n * k / best / 1e9:.1f} GOP/s "
          f"(thread CPU time, fastest of {args.runs})")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())

"""Weight-only int8 GEMMs (issue 21, item 4): ``x[M, K] · dq(W_q)`` with W_q int8 per output
channel, compiled by tvm_fusion (the int8 weight packed as int8, widened in the micro-kernel),
against the float32 packed GEMM of the same shape (W the dequantized float32 values) and ONNX
Runtime on the int8 model, in one process, calls alternating, one thread each.

    TVM_NUM_THREADS=1 taskset -c 1 python scripts/bench_weight_only.py [--seconds 3]
        [--peak-gflops 100.5] [--bandwidth 15.7] [--target '{"kind":"llvm","mcpu":"znver3"}']
        [--only 1x2048x5632] [--block 32] [--mlp --only 1x2048x5632,32x2048x5632]

Prints a Markdown table: ms of each, the int8 kernel's share of the FMA peak (or, for M = 1,
of the read bandwidth: it streams K·N bytes of weight once), and the speed of the int8 GEMM
relative to the float32 one and to ONNX Runtime (their time over ours, > 1 is faster).
``--block B`` quantizes in blocks of B along K instead (opset 21's ``block_size``; the scale
is then applied in the k loop). ``--mlp``: Llama's MLP (SwiGLU; ``MxKxN``: M rows, hidden
K, intermediate N), three such weights.

ONNX Runtime 1.2x rewrites ``DequantizeLinear → MatMul`` of an int8 weight into its contrib
``MatMulNBits`` (8 bits, accuracy level 4: the activations quantized to int8 per block), so
its result differs from the float32 computation by ~0.5 % (``err_vs_ort``); ours is the
float32 computation's to ~1e-6.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

os.environ.setdefault("TVM_NUM_THREADS", "1")  # before TVM's runtime starts its pool

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from tvm_fusion.compile import compile_model, import_onnx  # noqa: E402
from tvm_fusion.models.weight_only import weight_only_matmul, weight_only_mlp  # noqa: E402
from tvm_fusion.target import host_target_dict  # noqa: E402

SHAPES = [(m, k, n) for k, n in ((2048, 5632), (5632, 2048)) for m in (1, 32, 128)]


def _ort(model):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _tvm(model, target):
    vm = relax.VirtualMachine(compile_model(import_onnx(model), target), tvm.cpu())
    return vm["main"]


def run_shape(m: int, k: int, n: int, target, seconds: float, block: int | None = None,
              mlp: bool = False) -> dict:
    if mlp:  # Llama's MLP: hidden k, intermediate n (gate, up, down: 3·k·n weights)
        quantized = weight_only_mlp(m, k, n, block=block)
        fp32 = weight_only_mlp(m, k, n, block=block, float_weights=True)
    else:
        quantized = weight_only_matmul(m, k, n, block=block)
        fp32 = weight_only_matmul(m, k, n, block=block, float_weights=True)
    x = np.random.default_rng(1).standard_normal((m, k)).astype("float32")
    xt = tvm.runtime.tensor(x)
    int8_f, fp32_f, session = _tvm(quantized, target), _tvm(fp32, target), _ort(quantized)
    expected = session.run(None, {"x": x})[0]
    got, ref32 = int8_f(xt).numpy(), fp32_f(xt).numpy()
    scale = max(float(np.abs(expected).max()), 1e-30)
    calls = {"int8": lambda: int8_f(xt), "fp32": lambda: fp32_f(xt),
             "ort": lambda: session.run(None, {"x": x})}
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times["int8"]) < 5:
        for name, call in calls.items():  # alternating: a busy neighbour slows all three
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"m": m, "k": k, "n": n, "block": block, "mlp": mlp,
            **{f"{k_}_ms": v * 1e3 for k_, v in med.items()},
            "err_vs_ort": float(np.abs(got - expected).max()) / scale,
            "err_vs_fp32": float(np.abs(got - ref32).max()) / scale, "calls": len(times["int8"])}


def table(rows: list[dict], peak: float, bandwidth: float) -> str:
    lines = ["| M×K×N | fp32 packed ms | int8 ms | ORT (int8 model) ms | int8 share | "
             "fp32 / int8 | ORT / int8 |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["int8_ms"] / 1e3
        weights = 3 if r.get("mlp") else 1
        if r["m"] == 1:
            share = f"{100 * weights * r['k'] * r['n'] / t / 1e9 / bandwidth:.0f} % of bw"
        else:
            flop = 2 * weights * r["m"] * r["k"] * r["n"]
            share = f"{100 * flop / t / 1e9 / peak:.0f} % of peak"
        block = f" (blocks of {r['block']})" if r.get("block") else ""
        name = f"MLP {r['m']}×{r['k']}→{r['n']}" if r.get("mlp") else \
            f"{r['m']}×{r['k']}×{r['n']}"
        lines.append(f"| {name}{block} | {r['fp32_ms']:.3f} | "
                     f"{r['int8_ms']:.3f} | "
                     f"{r['ort_ms']:.3f} | {share} | {r['fp32_ms'] / r['int8_ms']:.2f} | "
                     f"{r['ort_ms'] / r['int8_ms']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--peak-gflops", type=float, default=100.5)
    parser.add_argument("--bandwidth", type=float, default=15.7, help="GB/s")
    parser.add_argument("--target", default=None, help="a JSON target (default: the host)")
    parser.add_argument("--only", default=None, help="MxKxN[,MxKxN...]")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--block", type=int, default=None, help="block size along K")
    parser.add_argument("--mlp", action="store_true",
                        help="Llama's MLP (hidden K, intermediate N) instead of one MatMul")
    args = parser.parse_args(argv)
    target = tvm.target.Target(json.loads(args.target) if args.target else host_target_dict())
    shapes = SHAPES if not args.only else [
        tuple(int(v) for v in s.split("x")) for s in args.only.split(",")]
    rows = []
    for m, k, n in shapes:
        rows.append(run_shape(m, k, n, target, args.seconds, args.block, args.mlp))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{datetime.date.today()}, target {target}, TVM_NUM_THREADS="
          f"{os.environ.get('TVM_NUM_THREADS')}\n")
    print(table(rows, args.peak_gflops, args.bandwidth))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

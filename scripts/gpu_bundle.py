#!/usr/bin/env python
"""Build what ``scripts/gpu_run.py`` needs to time tvm_fusion on a GPU machine without TVM.

    python scripts/gpu_bundle.py --out /path/to/bundle                  # CUDA (sm_90)
    python scripts/gpu_bundle.py --out /tmp/cpu_bundle --device cpu \\
        --seqs 64,128 --decode-kv 256 --models mobilenet_v2             # the same, on llvm

Everything is compiled here (``export_library``; CUDA through NVRTC or nvcc) for the device
target (``--arch``, host target plain ``llvm`` so that any x86-64 CPU runs the host code); the
device machine needs only TVM's *runtime*: this script copies the ``tvm`` Python package
without ``libtvm_compiler.so`` (``TVM_USE_RUNTIME_LIB=1`` loads ``libtvm_runtime.so`` alone),
``libtvm_runtime_cuda.so`` (``gpu_run.py`` loads it with ctypes: runtime-only mode autoloads
no backend) and apache-tvm-ffi's wheel for the device's Python (``--python``).

What the bundle holds (``manifest.json`` lists it):

* ``attention``: the Llama-style attention of :mod:`tvm_fusion.models.attention` (32 query
  heads, 4 key/value heads, head 64, causal ``triu`` mask, GQA) with a symbolic sequence
  bounded by the longest of ``--seqs``, built by tvm_fusion (attention fused) and by stock
  ``tvm.compile`` (TVM's default pipeline for the target: FuseOps + DLight on CUDA); the
  decode shape (one query against a symbolic key/value cache, ``--decode-kv``) likewise;
  inputs and ONNX Runtime's output at the first sequence length;
* ``models``: zoo models (``--models`` from ``$TVM_FUSION_MODELS``) whose large float
  initializers are replaced by :func:`tile_initializers` (each tensor's own leading block
  repeated along every axis its consumer does not sum over: the compiled library embeds the
  constants, and periodic ones compress well, while kernels and timings do not depend on the
  values), built
  both ways, with inputs and ONNX Runtime's outputs on the very same weights.

Libraries and the runtime travel xz-compressed (``*.xz``; ``gpu_run.py`` unpacks them).
TVM 0.27 keeps the CUDA *source* in a library and compiles it when the library is loaded; each
CUDA build's source is therefore also compiled here by ``nvcc`` (``*.fatbin``, see
:func:`cuda_binary`) and ``gpu_run.py`` hands those binaries to TVM's loader.
Kernel counts are recorded here: PrimFunc calls in the lowered ``main`` and ``__global__``
kernels in the CUDA source.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TVM_FFI = "apache-tvm-ffi==0.1.14.post0"
RUNTIME_LIBS = ("libtvm_runtime.so", "libtvm_runtime_cuda.so", "libtvm_runtime_extra.so")
SKIP_DIRS = {"3rdparty", "src", "include", "web", "__pycache__", "lib64", "licenses", "cmake"}
ATTENTION = dict(heads=32, kv_heads=4, head_dim=64)


def reduction_axes(model: onnx.ModelProto) -> dict[str, set[int]]:
    """Axes of each initializer that its consumer sums over: a Conv weight's input channels
    and kernel (1, 2, …), a MatMul right operand's rows, a Gemm ``B``'s ``K``."""
    axes: dict[str, set[int]] = {}
    for node in model.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        for pos, name in enumerate(node.input):
            if node.op_type in ("Conv", "ConvTranspose") and pos == 1:
                found = {1, 2, 3, 4, 5}
            elif node.op_type == "MatMul" and pos == 1:
                found = {-2}
            elif node.op_type == "MatMul" and pos == 0:
                found = {-1}
            elif node.op_type == "Gemm" and pos in (0, 1):
                trans = attrs.get("transA" if pos == 0 else "transB", 0)
                found = {(1 if trans else 0) if pos == 1 else (0 if trans else 1)}
            else:
                continue
            axes.setdefault(name, set()).update(found)
    return axes


def tile_initializers(model: onnx.ModelProto, min_size: int = 1024,
                      period: int = 8) -> onnx.ModelProto:
    """``model`` whose float initializers of at least ``min_size`` elements are their own
    leading block repeated: ``period`` along each axis (or the axis if shorter) except the
    axes their consumer sums over (:func:`reduction_axes`), kept whole; shapes, dtypes and the
    other initializers unchanged.

    A per-axis period survives the transposes and packings a compiler applies to constants,
    so the compiled library still compresses well. Reduction axes stay whole: a weight
    periodic along them, fed by the previous layer's periodic channels, adds ``C / period``
    equal terms per output, and ResNet-50's activations overflowed to NaN."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    summed = reduction_axes(model)
    for init in out.graph.initializer:
        if init.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            continue
        value = numpy_helper.to_array(init)
        if value.size < min_size:
            continue
        keep = {a % value.ndim for a in summed.get(init.name, ()) if -value.ndim <= a < value.ndim}
        index = np.ix_(*[np.arange(d) % (d if axis in keep else min(d, period))
                         for axis, d in enumerate(value.shape)])
        tiled = np.ascontiguousarray(value[index])
        init.CopyFrom(numpy_helper.from_array(tiled, init.name))
    return out


# --------------------------------------------------------------------------------- build


def device_target(device: str, arch: str):
    import tvm

    if device == "cuda":
        return tvm.target.Target({"kind": "cuda", "arch": arch}, host="llvm")
    return tvm.target.Target("llvm")


def kernel_counts(mod, target, strategy: str | None) -> dict:
    """PrimFunc calls in the lowered ``main`` (launches per run; stock: TVM's default
    pipeline for the target, as ``compile_model(strategy="tvm")`` builds it)."""
    import tvm
    from tvm import relax

    from tvm_fusion.transform import get_pipeline

    pipeline = (relax.get_default_pipeline(target) if strategy == "tvm"
                else get_pipeline(target))
    with target, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = pipeline(mod)
    prim = {gv for gv, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    calls = 0

    def visit(node):
        nonlocal calls
        if isinstance(node, relax.Call) and isinstance(node.op, tvm.ir.GlobalVar) and (
                node.op in prim):
            calls += 1
        if isinstance(node, relax.Call) and isinstance(node.op, tvm.ir.Op) and (
                node.op.name == "relax.call_tir"):
            calls += 1

    relax.analysis.post_order_visit(lowered["main"], visit)
    return {"primfunc_calls_in_main": calls, "primfuncs": len(prim)}


def _device_source(module):
    if module.kind in ("cuda", "opencl", "vulkan"):
        return module.inspect_source()
    for imported in module.imports:
        found = _device_source(imported)
        if found is not None:
            return found
    return None


def cuda_binary(source: str, target, stem: Path) -> dict:
    """``stem``.fatbin: ``source`` compiled for ``target``'s arch now, with the flags of
    TVM's nvcc mode less ``--use_fast_math`` (TVM's default, NVRTC, uses none).

    TVM 0.27 keeps CUDA *source* in the library and compiles it when the library is loaded
    (``tvm_callback_cuda_compile``); ``gpu_run.py`` answers that callback from these files,
    keyed by the source's SHA-256, so the device compiles nothing."""
    from tvm.support import nvcc

    os.environ["TVM_CUDA_NVCC_NO_FAST_MATH"] = "1"
    with target:
        binary = nvcc.compile_cuda(source, target_format="fatbin", compiler="nvcc")
    stem.with_suffix(".fatbin").write_bytes(bytes(binary))
    with lzma.open(stem.with_suffix(".cu.xz"), "wt") as f:
        f.write(source)
    return {"fatbin": stem.name + ".fatbin", "cuda_source": stem.name + ".cu.xz",
            "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
            "fatbin_bytes": len(binary)}


def build(mod, target, strategy: str | None, path: Path) -> dict:
    """Compile ``mod`` (tvm_fusion, or stock with ``strategy="tvm"``), export it to
    ``path``.xz; its build time and kernel counts."""
    from tvm_fusion.compile import compile_model

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        executable = compile_model(mod, target, **({"strategy": strategy} if strategy else {}))
    build_s = time.perf_counter() - t0
    info = {"file": path.name + ".xz", "build_s": round(build_s, 1)}
    source = _device_source(executable.mod)
    if source is not None:
        info["device_kernels"] = len(set(re.findall(
            r"__global__ void(?: __launch_bounds__\(\d+\))? (\w+)\(", source)))
    if source is not None and target.kind.name == "cuda":
        info.update(cuda_binary(source, target, path.with_suffix("")))
    executable.export_library(str(path))
    info["so_bytes"] = path.stat().st_size
    subprocess.run(["xz", "-T2", "-6", "-f", str(path)], check=True)
    info["xz_bytes"] = (path.parent / info["file"]).stat().st_size
    try:
        info.update(kernel_counts(mod, target, strategy))
    except Exception as err:  # counting is a report, not a reason to lose the build
        info["count_error"] = str(err).splitlines()[0][:200]
    return info


def build_both(mod, target, stem: str, out: Path) -> dict:
    builds = {}
    for name, strategy in (("fused", None), ("stock", "tvm")):
        try:
            builds[name] = build(mod, target, strategy, out / f"{stem}_{name}.so")
        except Exception as err:  # recorded: the runner skips it and the report says why
            lines = [ln for ln in str(err).splitlines() if "error" in ln.lower()]
            builds[name] = {"error": (lines[-1] if lines else str(err).splitlines()[0])[:400]}
        print(f"  {stem} {name}: {builds[name]}", flush=True)
    return builds


def save_npz(path: Path, arrays: dict) -> str:
    np.savez(path, **arrays)
    return path.name


def attention_entries(target, seqs: list[int], decode_kv: list[int], out: Path) -> list[dict]:
    from bench_attention import with_upper_bound

    from tvm_fusion.compile import graph_input_names, import_onnx
    from tvm_fusion.feeds import random_inputs
    from tvm_fusion.models.attention import llama_attention
    from tvm_fusion.numerics import onnx_reference

    entries = []
    model = llama_attention(seq="seq", **ATTENTION)
    mod = with_upper_bound(import_onnx(model), {"seq": max(seqs)})
    feeds = random_inputs(model, seed=0, shape_overrides={"seq": seqs[0]})
    names = graph_input_names(model)
    ref = onnx_reference(model, feeds)
    check = save_npz(out / "attention_check.npz",
                     {f"in{i}": feeds[n] for i, n in enumerate(names)} | {"out0": ref[0]})
    entries.append({"name": "attention_prefill", "kind": "attention", "causal": True,
                    "inputs": [[n, list(feeds[n].shape[:1]) + ["seq"] + list(
                        feeds[n].shape[2:])] for n in names],
                    "sizes": seqs, "check": check, "check_size": seqs[0], **ATTENTION,
                    "builds": build_both(mod, target, "attention_prefill", out)})
    if decode_kv:
        model = llama_attention(seq=1, kv_seq="kv", mask="none", **ATTENTION)
        mod = with_upper_bound(import_onnx(model), {"kv": max(decode_kv)})
        entries.append({"name": "attention_decode", "kind": "attention", "causal": False,
                        "inputs": [["q", [1, 1, 2048]], ["k", [1, "kv", 256]],
                                   ["v", [1, "kv", 256]]],
                        "sizes": decode_kv, **ATTENTION,
                        "builds": build_both(mod, target, "attention_decode", out)})
    return entries


def model_entries(target, names: list[str], models_dir: Path, out: Path) -> list[dict]:
    from tvm_fusion.compile import graph_input_names, import_onnx
    from tvm_fusion.feeds import random_inputs
    from tvm_fusion.numerics import onnx_reference

    entries = []
    for name in names:
        path = models_dir / f"{name}.onnx"
        if not path.is_file():
            print(f"  {name}: {path} not found, skipped", flush=True)
            continue
        model = tile_initializers(onnx.load(path))
        feeds = random_inputs(model, seed=0)
        inputs = graph_input_names(model)
        ref = onnx_reference(model, feeds)
        check = save_npz(out / f"{name}_check.npz",
                         {f"in{i}": feeds[n] for i, n in enumerate(inputs)}
                         | {f"out{i}": r for i, r in enumerate(ref)})
        mod = import_onnx(model)
        entries.append({"name": name, "kind": "model", "check": check,
                        "inputs": [[n, list(feeds[n].shape), str(feeds[n].dtype)]
                                   for n in inputs],
                        "builds": build_both(mod, target, name, out)})
        print(f"  {name}: done", flush=True)
    return entries


# ------------------------------------------------------------------------------- runtime


def copy_runtime(out: Path, python: str, wheel_dir: Path | None) -> dict:
    """``runtime.tar.xz``: ``site/tvm`` (Python files and the runtime libraries, no
    compiler) and ``site/tvm_ffi`` from apache-tvm-ffi's wheel for CPython ``python``."""
    import tvm

    src = Path(tvm.__file__).parent
    site = out / "runtime" / "site"
    shutil.rmtree(out / "runtime", ignore_errors=True)

    def ignore(folder, names):
        return [n for n in names if (n in SKIP_DIRS if os.path.isdir(os.path.join(folder, n))
                                     else not n.endswith(".py"))]

    shutil.copytree(src, site / "tvm", ignore=ignore)
    (site / "tvm" / "lib").mkdir(exist_ok=True)
    for lib in RUNTIME_LIBS:
        shutil.copy(src / "lib" / lib, site / "tvm" / "lib" / lib)
    if wheel_dir is None:
        wheel_dir = out / "wheels"
        tag = python.replace(".", "")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", python,
                        "--implementation", "cp", "--abi", f"cp{tag}",
                        "--platform", "manylinux_2_28_x86_64", "-d", str(wheel_dir), TVM_FFI],
                       check=True)
    wheels = glob.glob(str(wheel_dir / "apache_tvm_ffi-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one apache_tvm_ffi wheel in {wheel_dir}, found {wheels}")
    shutil.unpack_archive(wheels[0], site, format="zip")
    with tarfile.open(out / "runtime.tar.xz", "w:xz") as tar:
        tar.add(out / "runtime", arcname="runtime")
    shutil.rmtree(out / "runtime")
    return {"file": "runtime.tar.xz", "tvm_ffi_wheel": Path(wheels[0]).name,
            "bytes": (out / "runtime.tar.xz").stat().st_size}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--arch", default="sm_90", help="CUDA arch (default sm_90: H100/H200)")
    parser.add_argument("--seqs", default="512,1024,2048,4096")
    parser.add_argument("--decode-kv", default="1024,4096",
                        help="key/value cache lengths of the decode shape ('' for none)")
    parser.add_argument("--models", default="mobilenet_v2,resnet50,bert_base,gpt2")
    parser.add_argument("--models-dir", type=Path,
                        default=Path(os.environ.get("TVM_FUSION_MODELS", ROOT / "models")))
    parser.add_argument("--python", default="3.12", help="the device's CPython version")
    parser.add_argument("--wheel-dir", type=Path, help="folder holding apache-tvm-ffi's wheel")
    parser.add_argument("--skip", default="", help="parts to skip: runtime,attention,models")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "scripts"))
    import tvm

    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    target = device_target(args.device, args.arch)
    manifest_path = args.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest.update({"device": args.device, "target": str(target), "tvm": tvm.__version__,
                     "built_on": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    manifest.setdefault("entries", [])

    def save():
        manifest_path.write_text(json.dumps(manifest, indent=1))

    def replace(entries):
        names = {e["name"] for e in entries}
        manifest["entries"] = [e for e in manifest["entries"] if e["name"] not in names]
        manifest["entries"] += entries
        save()

    if "runtime" not in skip:
        manifest["runtime"] = copy_runtime(args.out, args.python, args.wheel_dir)
        save()
        print(f"runtime: {manifest['runtime']}", flush=True)
    if "attention" not in skip:
        seqs = [int(s) for s in args.seqs.split(",")]
        kv = [int(s) for s in args.decode_kv.split(",") if s]
        replace(attention_entries(target, seqs, kv, args.out))
    if "models" not in skip:
        for name in filter(None, args.models.split(",")):
            replace(model_entries(target, [name], args.models_dir, args.out))
    print(f"bundle in {args.out}: {sum(f.stat().st_size for f in args.out.iterdir())} bytes",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Run a bundle of ``scripts/gpu_bundle.py`` on a GPU machine that has no TVM: numerics and
timings of tvm_fusion's build, stock TVM's build and PyTorch, side by side.

    PYTHONUNBUFFERED=1 python3 scripts/gpu_run.py --bundle .gpu_bundle --out $OUT
    python scripts/gpu_run.py --bundle /tmp/cpu_bundle --out /tmp/res --device cpu  # the check

Needs numpy, and PyTorch for its side (skipped, and said so, without it); TVM comes from the
bundle (``runtime.tar.xz``: the runtime alone, ``TVM_USE_RUNTIME_LIB=1``). ``libcudart.so.13``
is looked for in the Python's ``nvidia`` packages and ``/usr/local/cuda*`` and loaded first.

For every entry of ``manifest.json`` and every size: inputs (the bundle's for the checked
size, else seeded normal draws), the outputs of the builds (and of PyTorch's
``scaled_dot_product_attention`` for attention) compared, then the variants called in turns
(fused, stock, torch, fused …) in batches of about 20 ms, each batch closed by a device
synchronisation, for ``--seconds`` each; medians of the per-call time. Results are written
after every section to ``--out`` (``gpu_results.json``, ``gpu_results.md``); each section
runs in its own ``try`` so that one failure loses only itself.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import lzma
import os
import shutil
import sys
import tarfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

RESULTS: dict = {"sections": {}, "errors": {}}


# ------------------------------------------------------------------------------- set-up


def _unxz(args):
    src, dst = args
    with lzma.open(src) as f, open(dst, "wb") as g:
        shutil.copyfileobj(f, g, 1 << 24)
    return dst


def unpack(bundle: Path, work: Path) -> dict:
    """The runtime under ``work/runtime``, every ``*.so.xz`` as ``work/*.so``."""
    t0 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    with tarfile.open(bundle / "runtime.tar.xz") as tar:
        tar.extractall(work, filter="data") if sys.version_info >= (3, 12) else tar.extractall(
            work)
    jobs = [(str(p), str(work / p.name[:-3])) for p in sorted(bundle.glob("*.so.xz"))]
    with ProcessPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        list(pool.map(_unxz, jobs))
    return {"unpack_s": round(time.perf_counter() - t0, 1), "libraries": len(jobs)}


def load_tvm(work: Path, device: str):
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    sys.path.insert(0, str(work / "runtime" / "site"))
    loaded = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    if device == "cuda" and "libcudart.so" not in loaded:  # PyTorch, imported first, has one
        for pattern in (f"{sys.prefix}/lib/python3*/site-packages/nvidia/**/libcudart.so.1*",
                        "/usr/local/cuda*/lib*/libcudart.so.1*"):
            found = sorted(glob.glob(pattern, recursive=True))
            if found:
                ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
                RESULTS["libcudart"] = found[0]
                break
    import tvm

    if device == "cuda":
        # runtime-only mode autoloads no backend: the CUDA runtime registers itself on load
        lib = work / "runtime" / "site" / "tvm" / "lib" / "libtvm_runtime_cuda.so"
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    return tvm


NVCC_FLAGS = ["-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
              "--expt-relaxed-constexpr", "--expt-extended-lambda"]


def install_cuda_binaries(bundle: Path, manifest: dict) -> dict:
    """Answer TVM's ``tvm_callback_cuda_compile`` (called when a library's CUDA source is
    loaded) with the bundle's fatbins, keyed by the source's SHA-256; a source not in the
    bundle is compiled by ``nvcc`` here (counted in ``RESULTS["cuda_compile"]``)."""
    import hashlib
    import subprocess
    import tempfile

    import tvm_ffi

    binaries = {}
    for entry in manifest["entries"]:
        for build in entry["builds"].values():
            if "fatbin" in build:
                binaries[build["source_sha256"]] = (bundle / build["fatbin"]).read_bytes()
    arch = json.loads(manifest["target"]).get("arch", "sm_90")[3:] if manifest[
        "target"].startswith("{") else "90"
    stats = {"bundled": len(binaries), "hits": 0, "compiled": 0}

    def compile_cuda(code):
        key = hashlib.sha256(code.encode()).hexdigest()
        if key in binaries:
            stats["hits"] += 1
            return bytearray(binaries[key])
        stats["compiled"] += 1
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp) / "k.cu", Path(tmp) / "k.fatbin"
            src.write_text(code)
            subprocess.run(["nvcc", "--fatbin", *NVCC_FLAGS, "-gencode",
                            f"arch=compute_{arch},code=sm_{arch}", "-o", str(out), str(src)],
                           check=True, capture_output=True)
            return bytearray(out.read_bytes())

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)
    return stats


# ------------------------------------------------------------------------------- timing


class Variant:
    """A callable on device data, its synchronisation, and how to read its output."""

    def __init__(self, call, sync, output):
        self.call, self.sync, self.output = call, sync, output


def alternate(variants: dict, seconds: float, batch_s: float = 0.02) -> dict:
    """Median seconds per call of each variant, called in turns in batches of ~``batch_s``."""
    sizes = {}
    for name, v in variants.items():  # warm-up and batch size
        v.call()
        v.sync()
        t0 = time.perf_counter()
        v.call()
        v.sync()
        one = max(time.perf_counter() - t0, 1e-6)
        sizes[name] = max(1, min(1000, int(batch_s / one)))
    per_call = {k: [] for k in variants}
    spent = {k: 0.0 for k in variants}
    while any(spent[k] < seconds or len(per_call[k]) < 5 for k in variants):
        for name, v in variants.items():
            v.sync()
            t0 = time.perf_counter()
            for _ in range(sizes[name]):
                v.call()
            v.sync()
            dt = time.perf_counter() - t0
            spent[name] += dt
            per_call[name].append(dt / sizes[name])
    return {k: {"ms": float(np.median(v)) * 1e3, "batches": len(v), "batch": sizes[k],
                "spread": float((np.percentile(v, 90) - np.percentile(v, 10)) / np.median(v))}
            for k, v in per_call.items()}


def errors(a: np.ndarray, b: np.ndarray) -> dict:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return {"shape": [list(a.shape), list(b.shape)]}
    return {"max_abs": float(np.abs(a - b).max()),
            "rel_l2": float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
            "finite": bool(np.isfinite(a).all())}


# ------------------------------------------------------------------------------- TVM side


def tvm_variant(tvm, path: Path, dev, arrays: list[np.ndarray]) -> Variant:
    from tvm.runtime.vm import VirtualMachine

    vm = VirtualMachine(tvm.runtime.load_module(str(path)), dev)
    main = vm["main"]
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    box = {}

    def call():
        box["out"] = main(*args)

    def output():
        out = box["out"]
        return [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]

    return Variant(call, dev.sync, output)


# ----------------------------------------------------------------------------- torch side


def torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch


def torch_attention(torch, arrays, heads, kv_heads, head_dim, causal, device) -> Variant:
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(a).to(device) for a in arrays)
    box = {}

    def call():
        with torch.inference_mode():
            b, s, _ = q.shape
            kv = k.shape[1]
            qh = q.view(b, s, heads, head_dim).transpose(1, 2)
            kh = k.view(b, kv, kv_heads, head_dim).transpose(1, 2)
            vh = v.view(b, kv, kv_heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True)
            box["out"] = o.transpose(1, 2).reshape(b, s, heads * head_dim)

    return Variant(call, lambda: torch.cuda.synchronize() if device == "cuda" else None,
                   lambda: [box["out"].float().cpu().numpy()])


TORCHVISION = {"mobilenet_v2": "mobilenet_v2", "resnet50": "resnet50", "vgg16": "vgg16",
               "efficientnet_b0": "efficientnet_b0", "vit_b16": "vit_b_16", "swin_t": "swin_t",
               "convnext_t": "convnext_tiny"}
# tvm_fusion.export_models.LLAMA (this script imports nothing of tvm_fusion)
LLAMA = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
             max_position_embeddings=2048, rms_norm_eps=1e-5, use_cache=False)


def torch_model(torch, name: str):
    """The zoo model's architecture (``tvm_fusion.export_models``' constructors), random
    weights, eval mode; None for a name it does not know."""
    if name in TORCHVISION:
        import torchvision

        return getattr(torchvision.models, TORCHVISION[name])(weights=None).eval()
    if name == "llama_decoder":
        from transformers import LlamaConfig, LlamaModel

        return LlamaModel(LlamaConfig(**LLAMA)).eval()
    if name == "bert_base":
        from transformers import BertConfig, BertModel

        return BertModel(BertConfig(), add_pooling_layer=False).eval()
    if name == "gpt2":
        from transformers import GPT2Config, GPT2Model

        return GPT2Model(GPT2Config(use_cache=False)).eval()
    return None


def torch_model_variant(torch, name, arrays, input_names, device) -> Variant | None:
    model = torch_model(torch, name)
    if model is None:
        return None
    model = model.to(device)
    tensors = [torch.from_numpy(a).to(device) for a in arrays]
    kwargs = dict(zip(input_names, tensors))
    positional = name in TORCHVISION

    def call():
        with torch.inference_mode():
            model(*tensors) if positional else model(**kwargs)

    return Variant(call, lambda: torch.cuda.synchronize() if device == "cuda" else None,
                   lambda: [])


def launched_kernels(torch, variants: dict) -> dict:
    """GPU kernels one call of each variant launches, read by PyTorch's profiler (CUPTI sees
    every launch in the process, TVM's too): their number, the sum of their durations (the
    device's busy time, against the wall-clock time of the call) and the longest five."""
    from torch.profiler import ProfilerActivity, profile

    counts = {}
    for name, v in variants.items():
        v.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            v.call()
            v.sync()
        kernels = [e for e in prof.events() if str(e.device_type).endswith("CUDA")
                   and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
        per_name: dict = {}
        for e in kernels:
            per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us()
        top = sorted(per_name.items(), key=lambda kv: -kv[1])[:5]
        counts[name] = {"kernels": len(kernels),
                        "kernel_us": round(sum(per_name.values()), 1),
                        "top": [[k[:90], round(us, 1)] for k, us in top]}
    return counts


# ------------------------------------------------------------------------------- sections


def seeded(shape, seed) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def run_attention(entry, bundle, work, tvm, dev, torch, device, seconds, count_kernels):
    rows = []
    check = np.load(bundle / entry["check"]) if "check" in entry else None
    for size in entry["sizes"]:
        if check is not None and size == entry["check_size"]:
            arrays = [check[f"in{i}"] for i in range(len(entry["inputs"]))]
        else:
            arrays = [seeded([size if d in ("seq", "kv") else d for d in shape], size + i)
                      for i, (_, shape) in enumerate(entry["inputs"])]
        variants = {name: tvm_variant(tvm, work / b["file"][:-3], dev, arrays)
                    for name, b in entry["builds"].items() if "error" not in b}
        if torch is not None:
            variants["torch"] = torch_attention(torch, arrays, entry["heads"],
                                                entry["kv_heads"], entry["head_dim"],
                                                entry["causal"], device)
        outs = {}
        for name, v in variants.items():
            v.call()
            v.sync()
            outs[name] = v.output()[0]
        row = {"size": size, "err": {}}
        for name in outs:
            if name != "stock" and "stock" in outs:
                row["err"][f"{name}_vs_stock"] = errors(outs[name], outs["stock"])
        if "torch" in outs and "fused" in outs:
            row["err"]["fused_vs_torch"] = errors(outs["fused"], outs["torch"])
        if "torch" in outs and "stock" in outs:
            row["err"]["stock_vs_torch"] = errors(outs["stock"], outs["torch"])
        if check is not None and size == entry["check_size"]:
            for name in set(entry["builds"]) & set(outs):
                row["err"][f"{name}_vs_onnxruntime"] = errors(outs[name], check["out0"])
        row["time"] = alternate(variants, seconds)
        if count_kernels and torch is not None and device == "cuda" and size == entry["sizes"][0]:
            try:
                row["launched_kernels"] = launched_kernels(torch, variants)
            except Exception as err:
                row["launched_kernels"] = f"failed: {str(err).splitlines()[0][:200]}"
        rows.append(row)
        print(f"  {entry['name']} {size}: " + ", ".join(
            f"{k} {t['ms']:.3f} ms" for k, t in row["time"].items())
            + f"; errors {json.dumps(row['err'])}", flush=True)
        del variants
    return rows


def run_model(entry, bundle, work, tvm, dev, torch, device, seconds, count_kernels):
    check = np.load(bundle / entry["check"])
    arrays = [check[f"in{i}"] for i in range(len(entry["inputs"]))]
    expected = [check[k] for k in sorted(check.files) if k.startswith("out")]
    variants = {name: tvm_variant(tvm, work / b["file"][:-3], dev, arrays)
                for name, b in entry["builds"].items() if "error" not in b}
    row = {"err": {}}
    outs = {}
    for name, v in variants.items():
        v.call()
        v.sync()
        outs[name] = v.output()
        row["err"][f"{name}_vs_onnxruntime"] = errors(outs[name][0], expected[0])
    if "fused" in outs and "stock" in outs:
        row["err"]["fused_vs_stock"] = errors(outs["fused"][0], outs["stock"][0])
    row["build_errors"] = {k: b["error"] for k, b in entry["builds"].items() if "error" in b}
    if torch is not None:
        try:
            tv = torch_model_variant(torch, entry["name"], arrays,
                                     [n for n, *_ in entry["inputs"]], device)
            if tv is not None:
                variants["torch"] = tv
        except Exception as err:
            row["torch_error"] = str(err).splitlines()[0][:300]
    row["time"] = alternate(variants, seconds)
    if count_kernels and torch is not None and device == "cuda":
        try:
            row["launched_kernels"] = launched_kernels(torch, variants)
        except Exception as err:
            row["launched_kernels"] = f"failed: {str(err).splitlines()[0][:200]}"
    print(f"  {entry['name']}: " + ", ".join(
        f"{k} {t['ms']:.3f} ms" for k, t in row["time"].items())
        + f"; errors {json.dumps(row['err'])}", flush=True)
    return row


# ------------------------------------------------------------------------------- report


def _num(x, digits=3) -> str:
    if x is None:
        return ""
    return f"{x:.2e}" if digits == "e" else f"{x:.{digits}f}"


def markdown(results: dict) -> str:
    lines = [f"# tvm_fusion on {results.get('device_name', '?')}", ""]
    for name, sec in results["sections"].items():
        entry = sec["entry"]
        lines.append(f"## {name}")
        lines.append("")
        lines.append("| size | fused ms | stock ms | torch ms | stock/fused | torch/fused | "
                     "kernels fused/stock (calls in main) | max err fused vs stock | "
                     "vs torch | vs ORT |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        b = entry["builds"]
        kern = (f"{b['fused'].get('primfunc_calls_in_main', '?')}/"
                f"{b['stock'].get('primfunc_calls_in_main', '?')}")
        for row in sec["rows"]:
            t = row["time"]
            f, s, tt = (t.get(k, {}).get("ms") for k in ("fused", "stock", "torch"))
            err = row["err"]
            ort = err.get("fused_vs_onnxruntime", {})
            ort = "" if "max_abs" not in ort else f"{ort['max_abs']:.2e} (rel {ort['rel_l2']:.1e})"
            lines.append(
                f"| {row.get('size', '')} | {_num(f)} | {_num(s)} | {_num(tt)} | "
                f"{_num(s and f and s / f, 2)} | {_num(tt and f and tt / f, 2)} | {kern} | "
                f"{_num(err.get('fused_vs_stock', {}).get('max_abs'), 'e')} | "
                f"{_num(err.get('fused_vs_torch', {}).get('max_abs'), 'e')} | {ort} |")
            for k, why in row.get("build_errors", {}).items():
                lines.append(f"\n{k} build failed: `{why}`\n")
        for row in sec["rows"]:
            launched = row.get("launched_kernels")
            if isinstance(launched, dict):
                lines.append(f"Kernels launched by one call ({row.get('size', '')}, PyTorch "
                             "profiler): " + ", ".join(
                                 f"{k} {c['kernels']} kernels, {c['kernel_us']:.0f} us busy"
                                 for k, c in launched.items()))
            elif launched:
                lines.append(f"Kernel count: {launched}")
        lines.append("")
    for name, err in results["errors"].items():
        lines.append(f"- **{name} failed**: `{err.splitlines()[-1][:300]}`")
    return "\n".join(lines) + "\n"


def save(out: Path):
    (out / "gpu_results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    (out / "gpu_results.md").write_text(markdown(RESULTS))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_bundle_work"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--only", default="", help="entries to run (default all)")
    parser.add_argument("--no-kernel-count", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    if manifest["device"] != args.device:
        raise SystemExit(f"the bundle was built for {manifest['device']}, not {args.device}")
    RESULTS["manifest"] = manifest
    RESULTS["unpack"] = unpack(args.bundle, args.work)
    print(f"unpacked: {RESULTS['unpack']}", flush=True)
    torch = torch_or_none()
    tvm = load_tvm(args.work, args.device)
    dev = tvm.cuda(0) if args.device == "cuda" else tvm.cpu(0)
    if args.device == "cuda":
        RESULTS["cuda_compile"] = install_cuda_binaries(args.bundle, manifest)
    RESULTS["device_name"] = (torch.cuda.get_device_name(0) if torch is not None
                              and args.device == "cuda" else args.device)
    RESULTS["versions"] = {"python": sys.version.split()[0], "numpy": np.__version__,
                           "torch": getattr(torch, "__version__", None),
                           "tvm": getattr(tvm, "__version__", None)}
    if torch is not None and args.device == "cuda":
        RESULTS["versions"]["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    print(f"device {RESULTS['device_name']}, {RESULTS['versions']}", flush=True)
    only = set(filter(None, args.only.split(",")))
    for entry in manifest["entries"]:
        name = entry["name"]
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            run = run_attention if entry["kind"] == "attention" else run_model
            rows = run(entry, args.bundle, args.work, tvm, dev, torch, args.device,
                       args.seconds, not args.no_kernel_count)
            RESULTS["sections"][name] = {"entry": entry, "rows": rows if isinstance(
                rows, list) else [rows], "seconds": round(time.perf_counter() - t0, 1)}
        except Exception:
            RESULTS["errors"][name] = traceback.format_exc()
            print(f"  {name} FAILED:\n{RESULTS['errors'][name]}", flush=True)
        save(args.out)
    RESULTS["total_s"] = round(time.perf_counter() - t_start, 1)
    print(f"CUDA binaries: {RESULTS.get('cuda_compile')}", flush=True)
    save(args.out)
    print(markdown(RESULTS), flush=True)
    print(f"total {RESULTS['total_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

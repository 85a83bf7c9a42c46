"""Fused attention: the figures of docs/attention.md.

Two parts, both on the CPU target of this machine (``--target`` to name another):

``llama``
    The attention of a Llama-style layer (32 query heads, 4 key/value heads, head size 64,
    causal ``triu`` mask, GQA ``repeat_kv``) built with a symbolic sequence length
    (``tvm_fusion/models/attention.py``) whose upper bound is the longest length measured
    (``tir_var_upper_bound``, so that TVM plans the memory of symbolic tensors), compiled once
    by tvm_fusion (attention fused) and once by stock FuseOps with the same schedules
    (``compile_model(strategy="tvm", schedule=True)``). For every length: the two outputs
    compared, then calls alternated (ours, stock, ours, …) for at least ``--seconds`` each
    (at least 3 calls), medians.
    At ``--memory-seq`` the activation memory of both builds: what Relax's
    ``StaticPlanBlockMemory`` allocates at that length (storages plus unplanned tensors) plus
    the largest workspace a kernel allocates inside itself (a stock kernel keeps its score
    buffers there; the fused kernel its packed K and V per task). ``--static-seqs`` also
    compares static-length builds; ``--fused-only-seqs`` times the fused build alone where the
    stock build cannot run here.

``zoo``
    Whole models (``--models``, from ``--models-dir``): built with attention fusion on and off
    (``attention=False``, everything else equal), both compared with ONNX Runtime, then calls
    alternated for ``--seconds`` each.

Timings are only comparable inside one run. On a shared machine pin the process and use one
thread: ``TVM_NUM_THREADS=1 taskset -c 1 python scripts/bench_attention.py all``. Results go
to ``--out`` (``attention.json``, ``attention.md``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tvm  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.relax.backend.cpu_generic import pipeline as cpu_backend  # noqa: E402

from tvm_fusion.bench import write_results  # noqa: E402
from tvm_fusion.compile import (  # noqa: E402
    compile_model,
    graph_input_names,
    import_onnx,
    load_onnx,
)
from tvm_fusion.feeds import random_inputs  # noqa: E402
from tvm_fusion.models.attention import llama_attention  # noqa: E402
from tvm_fusion.numerics import max_abs_error, onnx_reference  # noqa: E402
from tvm_fusion.target import host_target_dict, to_target  # noqa: E402
from tvm_fusion.tir_schedules.attention_match import substitute  # noqa: E402
from tvm_fusion.tir_utils import find_all  # noqa: E402
from tvm_fusion.transform import Sequential  # noqa: E402

STOCK = {"strategy": "tvm", "schedule": True}  # FuseOps groups, tvm_fusion's schedules


def with_upper_bound(mod: tvm.IRModule, sizes: dict) -> tvm.IRModule:
    """``mod`` whose ``main`` declares upper bounds of its symbolic sizes
    (``tir_var_upper_bound``): TVM's StaticPlanBlockMemory then plans (and reuses) storage for
    symbolic tensors too, as LLM deployments compile them; without it every intermediate is
    allocated at run time, all alive at once (stock FuseOps at 4,096 needed 18.9 GB)."""
    mod = mod.clone()
    mod["main"] = mod["main"].with_attr("tir_var_upper_bound", dict(sizes))
    return mod


def planned_memory(mod: tvm.IRModule, target, **options) -> dict:
    """Activation memory of ``mod``'s build: what the Relax VM allocates after TVM's memory
    planning (every ``alloc_storage`` StaticPlanBlockMemory leaves in ``main`` plus tensors it
    could not plan; symbolic sizes at their ``tir_var_upper_bound``), and the largest
    workspace one kernel allocates inside itself (buffers a fused kernel keeps; allocations
    inside a parallel loop times the target's cores); their sum is the peak."""
    attrs = mod["main"].attrs
    bounds = {str(k): int(v) for k, v in (attrs["tir_var_upper_bound"].items()
                                          if attrs is not None and "tir_var_upper_bound" in attrs
                                          else [])}

    def size(dim) -> int:
        """A (symbolic) extent at the declared upper bounds."""
        names = {v.name: v for v in find_all(dim, tvm.ir.Var)}
        dim = substitute(dim, {v: tvm.tirx.const(bounds[n], "int64") for n, v in names.items()})
        return int(tvm.sym.Analyzer().simplify(dim))

    def nbytes(buf) -> int:
        count = 1
        for d in buf.ty.shape:
            count *= size(d)
        return count * tvm.runtime.DataType(str(buf.ty.dtype)).bits // 8

    with target:
        graph = Sequential(target, **options)(mod)
        passes = cpu_backend.dataflow_lower_passes(target) + [
            relax.transform.StaticPlanBlockMemory()]
        lowered = tvm.transform.Sequential(passes)(graph)
    sizes = []

    def visit(node):
        if not (isinstance(node, relax.Call) and isinstance(node.op, tvm.ir.Op)):
            return
        if node.op.name == "relax.memory.alloc_storage":
            sizes.append(size(node.args[0].values[0]))
        elif node.op.name == "relax.builtin.alloc_tensor":
            shape = [size(d) for d in node.args[0].values]
            dtype = node.args[1].value
            sizes.append(int(np.prod(shape)) * tvm.runtime.DataType(str(dtype)).bits // 8)

    relax.analysis.post_order_visit(lowered["main"], visit)
    cores = int(target.attrs["num-cores"]) if "num-cores" in target.attrs else 1
    workspace = 0
    for func in graph.functions.values():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        root = getattr(func.body, "block", None)
        total = sum(nbytes(b) for b in (root.alloc_buffers if root is not None else [])
                    if b.scope() != "local")
        total += cores * sum(nbytes(a.buffer) for a in find_all(func.body, tvm.tirx.AllocBuffer)
                             if a.buffer.scope() != "local")
        workspace = max(workspace, total)
    relax_bytes = int(sum(sizes))
    return {"bytes": relax_bytes + workspace, "relax": relax_bytes,
            "kernel_workspace": workspace, "largest": int(max(sizes + [workspace])),
            "buffers": len(sizes)}


def alternate(calls: dict, seconds: float, minimum: int = 3) -> dict:
    """Median seconds per call of each entry of ``calls``, called in turn (A, B, A, B …)
    until every one has run ``seconds`` in total and at least ``minimum`` times."""
    for fn in calls.values():
        fn()
    times = {k: [] for k in calls}
    while any(sum(t) < seconds or len(t) < minimum for t in times.values()):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: float(np.median(v)) for k, v in times.items()} | {
        f"{k}_calls": len(v) for k, v in times.items()}


def vm_call(executable, inputs):
    dev = tvm.cpu()
    vm = relax.VirtualMachine(executable, dev)
    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    main = vm["main"]
    return lambda: main(*args)


def run_once(executable, inputs) -> list[np.ndarray]:
    out = vm_call(executable, inputs)()
    items = [out] if hasattr(out, "numpy") else list(out)
    return [o.numpy() for o in items]


# --------------------------------------------------------------------------------- llama


def bench_llama(target, seqs, seconds, memory_seq, static_seqs=(), fused_only=(), heads=32,
                kv_heads=4, head_dim=64):
    model = llama_attention(seq="seq", heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    symbolic = import_onnx(model)
    mod = with_upper_bound(symbolic, {"seq": max(list(seqs) + list(fused_only))})
    t0 = time.perf_counter()
    ours = compile_model(mod, target)
    stock = compile_model(mod, target, **STOCK)
    print(f"llama: compiled both builds in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for seq in seqs:
        feeds = random_inputs(model, seed=0, shape_overrides={"seq": seq})
        inputs = [feeds[n] for n in graph_input_names(model)]
        err = max_abs_error(run_once(ours, inputs), run_once(stock, inputs))
        t = alternate({"fused": vm_call(ours, inputs), "stock": vm_call(stock, inputs)},
                      seconds)
        dense = 4.0 * heads * seq * seq * head_dim
        row = {"seq": seq, "fused_ms": t["fused"] * 1e3, "stock_ms": t["stock"] * 1e3,
               "speedup": t["stock"] / t["fused"], "max_abs_err_vs_stock": err,
               "calls": [t["fused_calls"], t["stock_calls"]],
               "dense_gflops_fused": dense / t["fused"] / 1e9}
        rows.append(row)
        print(f"  seq {seq}: fused {row['fused_ms']:.1f} ms, stock {row['stock_ms']:.1f} ms, "
              f"{row['speedup']:.2f}x, max |fused - stock| {err:.2e}", flush=True)
    static_rows = []
    for seq in static_seqs:
        fixed = llama_attention(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
        fmod = import_onnx(fixed)
        fused_s, stock_s = compile_model(fmod, target), compile_model(fmod, target, **STOCK)
        feeds = random_inputs(fixed, seed=0)
        inputs = [feeds[n] for n in graph_input_names(fixed)]
        err = max_abs_error(run_once(fused_s, inputs), run_once(stock_s, inputs))
        t = alternate({"fused": vm_call(fused_s, inputs), "stock": vm_call(stock_s, inputs)},
                      seconds)
        static_rows.append({"seq": seq, "fused_ms": t["fused"] * 1e3,
                            "stock_ms": t["stock"] * 1e3, "speedup": t["stock"] / t["fused"],
                            "max_abs_err_vs_stock": err})
        print(f"  static {seq}: fused {t['fused'] * 1e3:.1f} ms, stock {t['stock'] * 1e3:.1f} "
              f"ms, {t['stock'] / t['fused']:.2f}x, max |fused - stock| {err:.2e}", flush=True)
    alone = []
    for seq in fused_only:
        feeds = random_inputs(model, seed=0, shape_overrides={"seq": seq})
        inputs = [feeds[n] for n in graph_input_names(model)]
        t = alternate({"fused": vm_call(ours, inputs)}, seconds)
        alone.append({"seq": seq, "fused_ms": t["fused"] * 1e3,
                      "why": "its build needs more memory than this machine has"})
        print(f"  seq {seq}: fused alone {t['fused'] * 1e3:.1f} ms", flush=True)
    memory = None
    if memory_seq:
        bounded = with_upper_bound(symbolic, {"seq": memory_seq})
        ours_mem = planned_memory(bounded, target)
        stock_mem = planned_memory(bounded, target, **STOCK)
        memory = {"seq": memory_seq, "fused": ours_mem, "stock": stock_mem,
                  "ratio": ours_mem["bytes"] / max(stock_mem["bytes"], 1),
                  "score_matrix_bytes": 4 * heads * memory_seq * memory_seq}
        print(f"  activation memory at {memory_seq}: fused {ours_mem}, stock {stock_mem}; ratio "
              f"{memory['ratio']:.4f}", flush=True)
    return {"model": "llama attention (32 q heads, 4 kv heads, head 64, causal, symbolic seq)",
            "rows": rows, "memory": memory, "static": static_rows, "fused_only": alone}


# ----------------------------------------------------------------------------------- zoo


def bench_zoo(target, names, models_dir, seconds):
    rows = []
    for name in names:
        path = Path(models_dir) / f"{name}.onnx"
        if not path.is_file():
            print(f"  {name}: {path} not found, skipped", flush=True)
            continue
        model = load_onnx(path)
        mod = import_onnx(model)
        t0 = time.perf_counter()
        on = compile_model(mod, target)
        off = compile_model(mod, target, attention=False)
        build = time.perf_counter() - t0
        feeds = random_inputs(model, seed=0)
        inputs = [feeds[n] for n in graph_input_names(model)]
        ref = onnx_reference(model, feeds)
        out_on, out_off = run_once(on, inputs), run_once(off, inputs)
        t = alternate({"on": vm_call(on, inputs), "off": vm_call(off, inputs)}, seconds)
        row = {"model": name, "on_ms": t["on"] * 1e3, "off_ms": t["off"] * 1e3,
               "speedup": t["off"] / t["on"], "err_on_vs_onnx": max_abs_error(out_on, ref),
               "err_off_vs_onnx": max_abs_error(out_off, ref),
               "err_on_vs_off": max_abs_error(out_on, out_off), "build_s": build,
               "calls": [t["on_calls"], t["off_calls"]]}
        rows.append(row)
        print(f"  {name}: attention on {row['on_ms']:.1f} ms, off {row['off_ms']:.1f} ms "
              f"({row['speedup']:.2f}x); max err vs ORT on {row['err_on_vs_onnx']:.2e}, off "
              f"{row['err_off_vs_onnx']:.2e}", flush=True)
    return rows


# ---------------------------------------------------------------------------------- main


def markdown(result: dict) -> str:
    lines = [f"Machine: {result['machine']}; target {result['target']}; "
             f"TVM_NUM_THREADS={result['threads']}.", ""]
    llama = result.get("llama")
    if llama:
        lines += [f"**{llama['model']}**", "",
                  "| sequence | fused (ms) | stock FuseOps, same schedules (ms) | speed-up |",
                  "|---|---|---|---|"]
        for r in llama["rows"]:
            lines.append(f"| {r['seq']} | {r['fused_ms']:.1f} | {r['stock_ms']:.1f} | "
                         f"**{r['speedup']:.2f}×** |")
        mem = llama.get("memory")
        if mem:
            mib = 2 ** 20
            lines += ["", f"Activation memory at {mem['seq']} (Relax after StaticPlanBlockMemory"
                      " + the largest workspace a kernel allocates inside itself):", "",
                      "| build | Relax planned (MiB) | kernel workspace (MiB) | peak (MiB) |",
                      "|---|---|---|---|"]
            for name in ("fused", "stock"):
                m = mem[name]
                lines.append(f"| {name} | {m['relax'] / mib:.1f} | "
                             f"{m['kernel_workspace'] / mib:.1f} | {m['bytes'] / mib:.1f} |")
            lines += ["", f"Fused / stock: **{mem['ratio']:.4f}**; one score matrix is "
                          f"{mem['score_matrix_bytes'] / mib:.0f} MiB."]
        static = llama.get("static")
        if static:
            lines += ["", "Static-length builds (one module per length; the causal mask is "
                          "then a folded constant, so the fused kernel skips nothing):", "",
                      "| sequence | fused (ms) | stock (ms) | speed-up |", "|---|---|---|---|"]
            for r in static:
                lines.append(f"| {r['seq']} | {r['fused_ms']:.1f} | {r['stock_ms']:.1f} | "
                             f"**{r['speedup']:.2f}×** |")
        alone = llama.get("fused_only")
        if alone:
            lines += [""] + [f"Fused alone at {r['seq']}: {r['fused_ms']:.1f} ms (stock not run:"
                             f" {r['why']})." for r in alone]
    zoo = result.get("zoo")
    if zoo:
        lines += ["", "| model | attention on (ms) | off (ms) | off / on | max err vs ORT "
                      "(on) | (off) |", "|---|---|---|---|---|---|"]
        for r in zoo:
            lines.append(f"| {r['model']} | {r['on_ms']:.1f} | {r['off_ms']:.1f} | "
                         f"{r['speedup']:.2f} | {r['err_on_vs_onnx']:.2e} | "
                         f"{r['err_off_vs_onnx']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["llama", "zoo", "all"])
    parser.add_argument("--target", default=None, help="JSON target (default: this CPU)")
    parser.add_argument("--seqs", default="512,1024,2048,4096")
    parser.add_argument("--static-seqs", default="",
                        help="also compare static-length builds at these lengths")
    parser.add_argument("--fused-only-seqs", default="",
                        help="time the fused build alone at these lengths (stock cannot run)")
    parser.add_argument("--memory-seq", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--models", default="bert_base,gpt2,vit_b16,swin_t")
    parser.add_argument("--models-dir", default=os.environ.get("TVM_FUSION_MODELS",
                                                               str(ROOT / "models")))
    parser.add_argument("--out", default=str(ROOT / "out" / "attention"))
    args = parser.parse_args(argv)
    threads = os.environ.get("TVM_NUM_THREADS", "")
    if args.target:
        target = to_target(args.target)
    else:
        spec = host_target_dict()
        if threads:
            spec["num-cores"] = int(threads)
        target = to_target(spec)
    result = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "target": str(target.export() if hasattr(target, "export") else target),
              "threads": threads or "default", "when": time.strftime("%Y-%m-%d %H:%M")}
    if args.part in ("llama", "all"):
        ints = [[int(x) for x in text.split(",") if x]
                for text in (args.seqs, args.static_seqs, args.fused_only_seqs)]
        result["llama"] = bench_llama(target, ints[0], args.seconds, args.memory_seq, ints[1],
                                      ints[2])
    if args.part in ("zoo", "all"):
        result["zoo"] = bench_zoo(target, [m for m in args.models.split(",") if m],
                                  args.models_dir, args.seconds)
    write_results(args.out, "attention", result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A Llama-style decoder layer against ONNX Runtime: issue 21's second "must show".

    TVM_NUM_THREADS=1 taskset -c 1 python scripts/bench_decoder.py [--seqs 128,2048]
        [--past 2048] [--seconds 3] [--out out/decoder] [--small]

The layer (``tvm_fusion.models.attention.llama_decoder_layer``: hidden 2048, 32 query heads,
4 key/value heads, head size 64, RoPE, RMSNorm, SwiGLU 5632; ``--small``: a tiny one) is
exported twice:

* **prefill**, a symbolic sequence length ``seq`` (causal mask): compiled once by tvm_fusion,
  run at every ``--seqs`` length;
* **decode**, one query against a key/value cache of symbolic length ``past`` (inputs
  ``past_k``/``past_v``, outputs the new cache): compiled once, run at ``--past``.

At each size the outputs are compared with ONNX Runtime's unoptimised session (the reference)
and the two are timed against ONNX Runtime with its default session options (graph
optimisations on) and one intra-op thread, calls alternated (``medians_in_turns``), medians
over at least ``--seconds`` per side. ``--stock`` adds stock FuseOps with tvm_fusion's
schedules (``compile_model(strategy="tvm", schedule=True)``) to the same loop. ``--seqs ''``
skips the prefill export. ``--breakdown`` adds, per size, tvm_fusion's time per kernel (the
VM's instrument hook, by ``--clock``, the fastest of five runs). Writes ``--out/decoder.json``
and ``decoder.md``.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

from tvm_fusion.bench import CLOCKS, check_clock, medians_in_turns, write_results  # noqa: E402
from tvm_fusion.compile import compile_model, graph_input_names, import_onnx, run  # noqa: E402
from tvm_fusion.feeds import random_inputs  # noqa: E402
from tvm_fusion.models.attention import llama_decoder_layer  # noqa: E402
from tvm_fusion.numerics import max_abs_error, onnx_reference  # noqa: E402
from tvm_fusion.target import host_target_dict, to_target  # noqa: E402

LLAMA = {"hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 64, "intermediate": 5632}
SMALL = {"hidden": 256, "heads": 8, "kv_heads": 2, "head_dim": 32, "intermediate": 688}


def ort_session(model) -> ort.InferenceSession:
    """ONNX Runtime as a user gets it: default session options, one intra-op thread."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


STOCK = {"strategy": "tvm", "schedule": True}  # FuseOps groups, tvm_fusion's schedules


def measure(model, executable, sizes: dict, seconds: float, name: str, stock=None,
            clock: str = "wall", breakdown: bool = False) -> dict:
    """Outputs against the reference, then tvm_fusion and ORT (and ``stock``, an executable)
    timed in turns."""
    import tvm

    feeds = random_inputs(model, seed=0, shape_overrides=sizes)
    names = graph_input_names(model)
    inputs = [feeds[n] for n in names]
    ref = onnx_reference(model, feeds)
    err = max_abs_error(run(executable, inputs), ref)
    sess = ort_session(model)
    err_ort = max_abs_error(sess.run(None, feeds), ref)
    vm = tvm.relax.VirtualMachine(executable, tvm.cpu())
    args = [tvm.runtime.tensor(x) for x in inputs]
    main = vm["main"]
    calls = {"tvm_fusion": lambda: main(*args), "onnxruntime": lambda: sess.run(None, feeds)}
    if stock is not None:
        err_stock = max_abs_error(run(stock, inputs), ref)
        stock_main = tvm.relax.VirtualMachine(stock, tvm.cpu())["main"]
        calls["stock"] = lambda: stock_main(*args)
    start = time.perf_counter()
    calls["tvm_fusion"]()
    once = max(time.perf_counter() - start, 1e-4)
    repeat = max(3, math.ceil(seconds / once))
    t = medians_in_turns(calls, warmup=1, repeat=repeat, clock=CLOCKS[clock])
    row = {"case": name, "sizes": sizes, "tvm_fusion_ms": t["tvm_fusion"],
           "onnxruntime_ms": t["onnxruntime"], "speedup": t["onnxruntime"] / t["tvm_fusion"],
           "max_abs_err": err, "ort_optimised_err": err_ort,
           "scale": float(max(np.abs(r).max() for r in ref)), "calls": repeat}
    if stock is not None:
        row.update(stock_ms=t["stock"], stock_speedup=t["stock"] / t["tvm_fusion"],
                   stock_err=err_stock)
        print(f"    stock FuseOps {row['stock_ms']:.1f} ms, stock / tvm_fusion "
              f"{row['stock_speedup']:.2f}x; max err {err_stock:.1e}", flush=True)
    if breakdown:
        row["kernels_ms"] = kernel_times(executable, args, clock)
        for kernel, ms in row["kernels_ms"].items():
            print(f"    {ms:9.1f} ms  {kernel}", flush=True)
    print(f"  {name} {sizes}: tvm_fusion {row['tvm_fusion_ms']:.1f} ms, ORT "
          f"{row['onnxruntime_ms']:.1f} ms, {row['speedup']:.2f}x; max err {err:.1e} "
          f"(ORT optimised {err_ort:.1e})", flush=True)
    return row


def kernel_times(executable, args, clock: str, runs: int = 5) -> dict[str, float]:
    """ms per kernel (summed over its calls) of one call of ``main``, the fastest of ``runs``
    per kernel: where the time goes, for the report."""
    import tvm

    vm = tvm.relax.VirtualMachine(executable, tvm.cpu())
    now, started = CLOCKS[clock], {}
    current: collections.Counter = collections.Counter()

    def instrument(_func, name, before, _ret, *_args):
        if before:
            started[name] = now()
        else:
            current[name] += now() - started.pop(name)
        return 0

    vm["main"](*args)
    vm.set_instrument(instrument)
    best: dict[str, float] = {}
    for _ in range(runs):
        current.clear()
        vm["main"](*args)
        for name, seconds in current.items():
            best[name] = min(best.get(name, seconds * 1e3), seconds * 1e3)
    return dict(sorted(((k, v) for k, v in best.items() if not k.startswith("vm.")),
                       key=lambda kv: -kv[1]))


def markdown(result: dict) -> str:
    lines = [f"Machine: {result['machine']}; target {result['target']}; "
             f"TVM_NUM_THREADS={result['threads']}; {result['when']}.", "",
             "| case | size | tvm_fusion (ms) | ONNX Runtime (ms) | ORT / tvm_fusion | "
             "max abs err vs ORT |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        size = ", ".join(f"{k} {v}" for k, v in r["sizes"].items())
        lines.append(f"| {r['case']} | {size} | {r['tvm_fusion_ms']:.1f} | "
                     f"{r['onnxruntime_ms']:.1f} | **{r['speedup']:.2f}×** | "
                     f"{r['max_abs_err']:.1e} |")
    stock = [r for r in result["rows"] if "stock_ms" in r]
    if stock:
        lines += ["", "| case | size | stock FuseOps, same schedules (ms) | stock / tvm_fusion | "
                  "max abs err vs ORT |", "|---|---|---|---|---|"]
        for r in stock:
            size = ", ".join(f"{k} {v}" for k, v in r["sizes"].items())
            lines.append(f"| {r['case']} | {size} | {r['stock_ms']:.1f} | "
                         f"**{r['stock_speedup']:.2f}×** | {r['stock_err']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="128,2048")
    parser.add_argument("--past", default="2048", help="cache lengths of the decode step")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--small", action="store_true", help="a tiny layer (a smoke test)")
    parser.add_argument("--stock", action="store_true",
                        help="also time stock FuseOps with tvm_fusion's schedules")
    parser.add_argument("--out", default=str(ROOT / "out" / "decoder"))
    parser.add_argument("--breakdown", action="store_true",
                        help="also time tvm_fusion's kernels one by one (fastest of five)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="cpu: each call's thread CPU time (TVM_NUM_THREADS=1)")
    args = parser.parse_args(argv)
    try:
        check_clock(args.clock)
    except ValueError as err:
        parser.error(str(err))
    config = SMALL if args.small else LLAMA
    threads = os.environ.get("TVM_NUM_THREADS", "")
    spec = host_target_dict()
    if threads:
        spec["num-cores"] = int(threads)
    target = to_target(spec)
    result = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "target": json.dumps(spec), "threads": threads or "default",
              "clock": args.clock,
              "when": time.strftime("%Y-%m-%d %H:%M"), "config": config, "rows": []}
    cases = [("prefill", llama_decoder_layer(seq="seq", **config), "seq", args.seqs),
             ("decode", llama_decoder_layer(seq=1, past="past", **config), "past", args.past)]
    for name, model, dim, sizes in cases:
        if not sizes:
            continue
        start = time.perf_counter()
        executable = compile_model(import_onnx(model), target)
        result[f"{name}_build_s"] = round(time.perf_counter() - start, 1)
        print(f"{name}: one module built in {result[f'{name}_build_s']} s", flush=True)
        stock = compile_model(import_onnx(model), target, **STOCK) if args.stock else None
        for size in (int(s) for s in sizes.split(",") if s):
            result["rows"].append(measure(model, executable, {dim: size}, args.seconds, name,
                                          stock, args.clock, args.breakdown))
    write_results(args.out, "decoder", result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How evenly each kernel's work splits over threads, tvm_fusion against FuseOps + our schedules.

    TVM_NUM_THREADS=1 taskset -c 1 python scripts/parallel_balance.py models/mobilenet_v2.onnx \
        [--cores 2] [--runs 5] [--top 12]

TVM runs a parallel loop of extent E on T threads in T contiguous shares of ceil(E/T)
iterations, so the loop takes ``ceil(E/T)·T/E`` times its ideal 1/T share (the *imbalance*:
7 row bands on 2 threads 1.14, 3 N blocks 1.33). Wall-clock timing on 2 shared cores is noisy;
this check is static: both builds for the same target (``num-cores`` = ``--cores``), and for
every kernel its outermost parallel loop (extent, how often it is launched), the share of the
kernel's executed work inside it (:func:`tvm_fusion.tir_schedules.work.executed_work`'s
counts), and the imbalance on ``--cores`` threads. Each kernel's one-thread time (thread CPU
time, fastest of ``--runs``, as ``kernel_breakdown.py --clock cpu``) then gives its predicted
time on T threads, ``t1 · ((1 - p) + p · imbalance / T)`` for a parallel share ``p`` (a
kernel with no parallel loop: ``t1``). The sums per build bound what thread balance alone
costs: ``predicted ratio`` is tvm_fusion / FuseOps+sched on T threads, against the measured
one-thread ratio. Kernels listed: those whose predicted T-thread time exceeds the ideal
``t1 / T`` the most (``lost``), with their loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tvm_fusion.tir_schedules.thread_balance import kernel_balance  # noqa: E402

BUILDS = {"tvm-fuseops-sched": {"strategy": "tvm", "schedule": True}, "tvm_fusion": {}}


def predicted(t1: float, fact: dict | None, threads: int) -> float:
    if fact is None:
        return t1  # not a kernel of ours (a VM builtin): as on one thread
    p = fact["share"]
    return t1 * ((1 - p) + p * fact["imbalance"] / threads)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--cores", type=int, default=2, help="threads the target is built for")
    parser.add_argument("--mcpu", default="znver4")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", help="write the per-kernel table here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", "1")
    import tvm
    from tvm import relax

    from tvm_fusion.compile import graph_input_names, import_onnx, load_onnx
    from tvm_fusion.feeds import random_inputs
    from tvm_fusion.target import to_target
    from tvm_fusion.transform import get_pipeline

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernel_breakdown import breakdown

    target = to_target({"kind": "llvm", "mcpu": args.mcpu, "num-cores": args.cores})
    dump = {}
    for path in args.models:
        model = load_onnx(path)
        feeds = random_inputs(model)
        dev = tvm.cpu()
        inputs = [tvm.runtime.tensor(feeds[n], dev) for n in graph_input_names(model)]
        vms, facts = {}, {}
        for build, options in BUILDS.items():
            with target:
                mod = get_pipeline(target, **options)(import_onnx(model))
            facts[build] = kernel_balance(mod, args.cores)
            exe = tvm.compile(mod, target, relax_pipeline=tvm.transform.Sequential([]))
            vms[build] = relax.VirtualMachine(exe, dev)
        times = breakdown(vms, inputs, args.runs, time.thread_time, kernel_min=True)
        calls = {}
        for build, vm in vms.items():  # calls per run, for the parallel launches
            counted: dict = {}

            def count(_func, name, before, _ret, *_args, counted=counted):
                if before:
                    counted[name] = counted.get(name, 0) + 1
                return 0

            vm.set_instrument(count)
            vm["main"](*inputs)
            calls[build] = counted
        stem = Path(path).stem
        totals = {}
        rows = {}
        for build in BUILDS:
            _, _, kernels = times[build]
            t1 = sum(kernels.values())
            tp = 0.0
            ideal = 0.0
            rows[build] = []
            serial = 0.0
            for name, seconds in kernels.items():
                fact = facts[build].get(name)
                pt = predicted(seconds, fact, args.cores)
                tp += pt
                ideal += seconds / args.cores if fact is not None else seconds
                if fact is not None and not fact["loops"]:
                    serial += seconds
                rows[build].append((pt - (seconds / args.cores if fact else seconds), name,
                                    seconds, fact))
            totals[build] = (t1, tp, ideal, serial)
            kernels_run = sum(n for k, n in calls[build].items() if k in facts[build])
            launches = sum(n * sum(trips for _, trips in facts[build][k]["loops"])
                           for k, n in calls[build].items() if k in facts[build])
            print(f"{stem} {build}: one thread {t1 * 1e3:.2f} ms, predicted on {args.cores} "
                  f"{tp * 1e3:.2f} ms (ideal {ideal * 1e3:.2f}, lost {(tp - ideal) * 1e3:.2f}; "
                  f"kernels without a parallel loop {serial * 1e3:.2f} ms one-thread); "
                  f"{kernels_run} kernel calls, {launches} parallel launches per run")
            for lost, name, seconds, fact in sorted(rows[build], key=lambda r: -r[0])[:args.top]:
                if fact is None:
                    continue
                loops = ", ".join(f"{e}" + (f"x{n} launches" if n > 1 else "")
                                  for e, n in fact["loops"][:3]) or "none"
                print(f"    lost {lost * 1e3:6.3f} ms  t1 {seconds * 1e3:6.3f}  parallel "
                      f"{loops:24s} share {fact['share']:.2f} imb {fact['imbalance']:.2f}  {name}")
        a, b = totals["tvm_fusion"], totals["tvm-fuseops-sched"]
        print(f"{stem}: tvm_fusion / FuseOps+sched one thread {a[0] / b[0]:.3f}, predicted on "
              f"{args.cores} threads {a[1] / b[1]:.3f}")
        dump[stem] = {build: [(name, seconds, fact) for _, name, seconds, fact in rows[build]]
                      for build in rows}
        sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(dump, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

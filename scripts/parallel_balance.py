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

BUILDS = {"tvm-fuseops-sched": {"strategy": "tvm", "schedule": True}, "tvm_fusion": {}}


def parallel_loops(func) -> list[tuple[int, int, int, int]]:
    """``(extent, launches, ops inside, loop)`` of every outermost parallel loop of
    ``func`` (a parallel loop under serial loops is launched once per their iteration)."""
    from tvm import s_tir, tirx

    from tvm_fusion.tir_schedules.work import _extent

    found = []

    def visit(stmt, trips: int) -> None:
        if stmt is None:
            return
        if isinstance(stmt, tirx.SeqStmt):
            for s in stmt.seq:
                visit(s, trips)
        elif isinstance(stmt, tirx.For):
            if stmt.kind == tirx.ForKind.PARALLEL:
                ops = stmt_ops(stmt)
                found.append((_extent(stmt.extent), trips, trips * ops, stmt))
                return
            visit(stmt.body, trips * _extent(stmt.extent))
        elif isinstance(stmt, tirx.IfThenElse):
            visit(stmt.then_case, trips)
        elif isinstance(stmt, s_tir.SBlockRealize):
            visit(stmt.block, trips)
        else:  # SBlock, LetStmt, AttrStmt, DeclBuffer, Allocate...
            body = getattr(stmt, "body", None)
            if isinstance(body, tirx.Stmt):
                visit(body, trips)

    visit(func.body, 1)
    return found


def stmt_ops(stmt, env: dict | None = None, analyzer=None) -> int:
    """Executed operations under ``stmt``, as :func:`tvm_fusion.tir_schedules.work` counts
    them, through every statement kind (a let, an attribute, an allocation: the packed GEMM's
    nest has them). ``env`` binds loop variables to constants (one iteration of a parallel
    loop): extents and ``if`` conditions that depend on them are evaluated, so a short last
    block or a guarded tail counts as what it executes."""
    from tvm import s_tir, sym, tirx

    from tvm_fusion import symbolic
    from tvm_fusion.tir_schedules.attention_match import substitute
    from tvm_fusion.tir_schedules.work import _stmt_ops

    env = env or {}
    analyzer = analyzer or sym.Analyzer()

    def value(expr):
        if env:
            expr = analyzer.simplify(substitute(expr, env))
        return expr

    def extent(expr) -> int:
        expr = value(expr)
        if isinstance(expr, tirx.IntImm):
            return max(int(expr.value), 0)
        return max(symbolic.extent(expr), 0)

    def count(stmt) -> int:
        if isinstance(stmt, tirx.SeqStmt):
            return sum(count(s) for s in stmt.seq)
        if isinstance(stmt, tirx.For):
            return extent(stmt.extent) * count(stmt.body)
        if isinstance(stmt, s_tir.SBlockRealize):
            return count(stmt.block)
        if isinstance(stmt, tirx.IfThenElse):
            cond = value(stmt.condition)
            if isinstance(cond, tirx.IntImm) and not cond.value:
                return count(stmt.else_case) if stmt.else_case is not None else 0
            return count(stmt.then_case)
        if isinstance(stmt, tirx.BufferStore):
            return _stmt_ops(stmt)
        if isinstance(stmt, tirx.Evaluate):
            return 1
        body = getattr(stmt, "body", None)
        return count(body) if isinstance(body, tirx.Stmt) else 0

    return count(stmt)


def thread_shares(loop, threads: int, limit: int = 4096) -> list[int]:
    """Ops each of ``threads`` threads executes of parallel ``loop`` (TVM gives thread t the
    iterations [t·c, (t+1)·c), c = ceil(extent / threads)); iterations counted one by one up
    to ``limit`` of them, else taken as equal."""
    import tvm
    from tvm import sym, tirx

    from tvm_fusion.tir_schedules.work import _extent

    total_extent = _extent(loop.extent)
    if total_extent <= 0:
        return [0] * threads
    chunk = -(-total_extent // threads)
    if total_extent > limit:
        per = stmt_ops(loop.body)
        return [per * max(0, min(chunk, total_extent - t * chunk)) for t in range(threads)]
    analyzer = sym.Analyzer()
    per_iter = [stmt_ops(loop.body, {loop.loop_var: tirx.const(i, loop.extent.ty.dtype)}, analyzer)
                for i in range(total_extent)]
    return [sum(per_iter[t * chunk:(t + 1) * chunk]) for t in range(threads)]


def imbalance(extent: int, threads: int) -> float:
    if extent <= 0 or threads <= 1:
        return 1.0
    return -(-extent // threads) * threads / extent


def kernel_facts(mod, threads: int) -> dict[str, dict]:
    """Per PrimFunc of a scheduled module: its parallel loops, parallel share, imbalance."""
    from tvm import tirx

    facts = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        loops = parallel_loops(func)
        imb = inside = outside_estimate = 0
        for _, trips, ops, loop in loops:
            shares = thread_shares(loop, threads)
            outside_estimate += ops  # as the whole-function count below has it
            inside += trips * sum(shares)
            imb += trips * max(shares) * threads
        imb = imb / inside if inside else 1.0
        total = max(stmt_ops(func.body) - outside_estimate + inside, 1)
        share = min(inside / total, 1.0)
        facts[gv.name_hint] = {"loops": [(e, n) for e, n, _, _ in loops], "share": share,
                               "imbalance": imb, "ops": total}
    return facts


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
            facts[build] = kernel_facts(mod, args.cores)
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

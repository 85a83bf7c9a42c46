"""How a scheduled PrimFunc's work splits over threads, counted from its loop nests.

TVM runs a parallel loop of extent E on T threads in T contiguous shares of ceil(E/T)
iterations (thread t: [t·c, (t+1)·c)), so the loop takes as long as its largest share: 7 row
bands on 2 threads 8/7 of the ideal, 3 N blocks 4/3, and a loop outside any parallel one runs
on one thread while the others wait. Work is counted as :mod:`.work` counts it (value
arithmetic, loads, stores), one iteration of a parallel loop at a time, so a short last block
or a guarded tail counts as what it executes. ``scripts/parallel_balance.py`` weighs these by
each kernel's measured one-thread time; the tests check the schedules with them.
"""

from __future__ import annotations

from tvm import sym, tirx

from ..tir_utils import stmt_children, substitute
from .gemm_template import thread_shares
from .work import executed_ops, extent_of

__all__ = ["kernel_balance", "loop_shares", "parallel_loops", "stmt_ops"]


def parallel_loops(func) -> list[tuple[int, int, int, int]]:
    """``(extent, launches, ops inside, loop)`` of every outermost parallel loop of
    ``func`` (a parallel loop under serial loops is launched once per their iteration)."""
    found = []

    def visit(stmt, trips: int) -> None:
        if isinstance(stmt, tirx.For):
            if stmt.kind == tirx.ForKind.PARALLEL:
                ops = stmt_ops(stmt)
                found.append((extent_of(stmt.extent), trips, trips * ops, stmt))
                return
            trips *= extent_of(stmt.extent)
        for child in stmt_children(stmt):
            visit(child, trips)

    visit(func.body, 1)
    return found


def stmt_ops(stmt, env: dict | None = None, analyzer=None) -> int:
    """Executed operations under ``stmt``, as :func:`tvm_fusion.tir_schedules.work` counts
    them, through every statement kind (a let, an attribute, an allocation: the packed GEMM's
    nest has them). ``env`` binds loop variables to constants (one iteration of a parallel
    loop): extents and ``if`` conditions that depend on them are evaluated, so a short last
    block or a guarded tail counts as what it executes."""
    env = env or {}
    analyzer = analyzer or sym.Analyzer()

    def value(expr):
        if env:
            expr = analyzer.simplify(substitute(expr, env))
        return expr

    def count(stmt) -> int:
        if isinstance(stmt, tirx.IfThenElse):
            cond = value(stmt.condition)
            if isinstance(cond, tirx.IntImm) and not cond.value:
                return count(stmt.else_case) if stmt.else_case is not None else 0
            return count(stmt.then_case)
        if isinstance(stmt, tirx.BufferStore):
            return executed_ops(stmt)
        if isinstance(stmt, tirx.Evaluate):
            return 1
        trips = extent_of(value(stmt.extent)) if isinstance(stmt, tirx.For) else 1
        return trips * sum(count(child) for child in stmt_children(stmt))

    return count(stmt)


def loop_shares(loop, threads: int, limit: int = 4096) -> list[int]:
    """Ops each of ``threads`` threads executes of parallel ``loop`` (TVM gives thread t the
    iterations [t·c, (t+1)·c), c = ceil(extent / threads)); iterations counted one by one up
    to ``limit`` of them, else taken as equal."""
    total_extent = extent_of(loop.extent)
    if total_extent <= 0:
        return [0] * threads
    chunk = -(-total_extent // threads)
    if total_extent > limit:
        per = stmt_ops(loop.body)
        return [per * max(0, min(chunk, total_extent - t * chunk)) for t in range(threads)]
    analyzer = sym.Analyzer()
    per_iter = [stmt_ops(loop.body, {loop.loop_var: tirx.const(i, loop.extent.ty.dtype)}, analyzer)
                for i in range(total_extent)]
    return thread_shares(per_iter, threads)


def kernel_balance(mod, threads: int) -> dict[str, dict]:
    """Per PrimFunc of a scheduled module: its parallel loops, parallel share, imbalance."""
    facts = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        loops = parallel_loops(func)
        imb = inside = outside_estimate = 0
        for _, trips, ops, loop in loops:
            shares = loop_shares(loop, threads)
            outside_estimate += ops  # as the whole-function count below has it
            inside += trips * sum(shares)
            imb += trips * max(shares) * threads
        imb = imb / inside if inside else 1.0
        total = max(stmt_ops(func.body) - outside_estimate + inside, 1)
        share = min(inside / total, 1.0)
        facts[gv.name_hint] = {"loops": [(e, n) for e, n, _, _ in loops], "share": share,
                               "imbalance": imb, "ops": total}
    return facts

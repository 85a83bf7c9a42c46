"""What a PrimFunc executes, counted from its loop nests: the fusion guard's estimate.

A fused kernel can do more than its operators did apart: a row statistic attached under a
loop whose iterations share a row (``mean[i // 2]``, a gather of repeated rows) is computed
once per iteration, a producer inlined into a broadcast once per output element. Such costs
are visible only in the loop nest, so they are counted there: every block body executes once
per iteration of the loops around it (a symbolic extent at its representative size,
:mod:`tvm_fusion.symbolic`), and costs its value arithmetic (:func:`.analysis.expr_cost`'s
units: an add 1, an ``exp`` 8) plus one per load and one per store. Data crossing the
function's boundary (its parameters, read or written once) is counted in bytes, which a
caller weighs against arithmetic with a flops-per-byte ridge.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir, sym, tirx

from .. import symbolic
from ..tir_utils import buffer_loads, stmt_children, substitute
from .analysis import expr_cost
from .cpu_target import CACHE_LINE_BYTES

__all__ = ["Work", "executed_ops", "executed_work", "extent_of", "recomputed_blocks",
           "scattered_stores"]


@dataclass(frozen=True)
class Work:
    """What one call of a PrimFunc does."""

    ops: int  # value arithmetic, loads and stores executed (analysis.expr_cost units)
    boundary_bytes: int  # its parameters' bytes: what it reads from and writes to memory

    def cost(self, flops_per_byte: float) -> float:
        """Arithmetic plus boundary traffic at ``flops_per_byte`` (the roofline's ridge)."""
        return self.ops + flops_per_byte * self.boundary_bytes

    def __add__(self, other: Work) -> Work:
        return Work(self.ops + other.ops, self.boundary_bytes + other.boundary_bytes)


def executed_work(func: tirx.PrimFunc) -> Work:
    """The work of one call of ``func`` (scheduled or not: loop splits keep the product of
    their extents, so a schedule changes the count only where it changes what executes)."""
    return Work(executed_ops(func.body), _boundary_bytes(func))


def _boundary_bytes(func: tirx.PrimFunc) -> int:
    total = 0
    for param in func.params:
        shape = getattr(param.ty, "shape", None)
        if shape is None:  # a scalar parameter (a symbolic size)
            continue
        dtype = tvm.DataType(str(param.ty.dtype))
        total += (symbolic.numel(shape) or 0) * max(dtype.bits * dtype.lanes // 8, 1)
    return total


def extent_of(expr) -> int:
    return max(symbolic.extent(expr), 0) if not isinstance(expr, int) else expr


def executed_ops(stmt) -> int:
    """Executed operations of ``stmt`` (recursive over TIR's statement kinds; an ``if`` is
    counted as taken: a bound check around a remainder is nearly always true)."""
    if isinstance(stmt, tirx.BufferStore):
        return expr_cost(stmt.value) + len(buffer_loads(stmt.value)) + 1
    trips = extent_of(stmt.extent) if isinstance(stmt, tirx.For) else 1
    return trips * sum(executed_ops(s) for s in stmt_children(stmt))


def recomputed_blocks(func: tirx.PrimFunc) -> list[tuple[str, float]]:
    """``(block, factor)`` for every block that executes ``factor`` > 1 times its own
    iteration space: a stage attached under loops that revisit its region (a row statistic
    computed again for every element of a slice or gather reading that row)."""
    found: list[tuple[str, float]] = []

    def visit(stmt, trips: int) -> None:
        if isinstance(stmt, s_tir.SBlockRealize):
            block = stmt.block
            if block.iter_vars:
                space = 1
                for iv in block.iter_vars:
                    space *= extent_of(iv.dom.extent)
                if trips > space:
                    found.append((block.name_hint, trips / max(space, 1)))
            visit(block.body, 1 if block.iter_vars and trips > 0 else trips)
            return
        if isinstance(stmt, tirx.For):
            trips *= extent_of(stmt.extent)
        for child in stmt_children(stmt):
            visit(child, trips)

    visit(func.body, 1)
    return found


def scattered_stores(func: tirx.PrimFunc, line_bytes: int = CACHE_LINE_BYTES
                     ) -> tuple[int, int]:
    """``(stores, elements)``: executed stores into ``func``'s parameters (its outputs) whose
    innermost enclosing loop steps the stored address by a cache line or more, and the elements
    of the buffers they store to. A layout copy composed into a tile's write-back (a GEMM tile
    of NHWC rows stored to NCHW) writes one element per line; a K-blocked GEMM tile does so
    once per K block, reading and writing each line again (stores > elements). Static strides
    only (a symbolic one is not counted)."""
    # TVM 0.27: a buffer is its own variable; a scalar parameter (a symbolic size) is not one
    params = {p for p in func.params if getattr(p.ty, "shape", None) is not None}
    analyzer = sym.Analyzer()
    total = 0
    scattered: set = set()

    def visit(stmt, loops, binds) -> None:
        if isinstance(stmt, s_tir.SBlockRealize):
            block = stmt.block
            inner = dict(binds)
            inner.update({iv.var: substitute(value, binds)
                          for iv, value in zip(block.iter_vars, stmt.iter_values)})
            visit(block.body, loops, inner)
            return
        if isinstance(stmt, tirx.BufferStore):
            check(stmt, loops, binds)
            return
        if isinstance(stmt, tirx.For):
            loops = loops + [stmt]
        for child in stmt_children(stmt, else_case=True):
            visit(child, loops, binds)

    def check(store, loops, binds) -> None:
        nonlocal total
        if store.buffer not in params or not loops or extent_of(loops[-1].extent) < 2:
            return
        loop = loops[-1]
        flat = 0
        for index, dim in zip(store.indices, store.buffer.shape):
            flat = flat * dim + index
        flat = substitute(flat, binds)
        step = analyzer.simplify(substitute(flat, {loop.loop_var: loop.loop_var + 1}) - flat)
        if not isinstance(step, tirx.IntImm):
            return
        elem = max(tvm.DataType(str(store.buffer.dtype)).bits // 8, 1)
        if abs(int(step.value)) * elem >= line_bytes:
            count = 1
            for f in loops:
                count *= extent_of(f.extent)
            total += count
            scattered.add(store.buffer)

    visit(func.body, [], {})
    return total, sum(symbolic.numel(b.shape) or 0 for b in scattered)

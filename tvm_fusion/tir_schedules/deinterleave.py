"""A strided conv's padding written as column phases, copied without a gather.

A conv GEMM with column stride ``S > 1`` pads its input into ``S`` phases
(``layout/gemm_pack.py``: ``P[..., ih, ph, q] = x[..., ih - top, q·S + ph - left]`` under the
padding's bounds test), so that an im2col panel reads consecutive columns of one phase. As a
plain elementwise nest (``ph`` outer, ``q`` inner) each phase's inner loop reads every S-th
float under a test that changes along the row: LLVM vectorises that with masked gathers
where the target has them (``vgatherdps`` on AVX-512: a quarter of YOLOv8n's 3×3/2 16→32 conv
at 160×160 on Zen 4, a tenth of ResNet-50's 3×3/2 128→128), and one float at a time where
it has not.

:func:`deinterleave_phase_paddings` rewrites such a nest (read from the TIR: a block storing
``if_then_else(cond, X[..., q·S + ph + c], pad)`` over its innermost loops ``ph`` (extent S)
and ``q``) as: the clauses of ``cond`` that do not depend on ``ph`` or ``q`` (the row's)
tested once per row, the columns where every phase reads inside ``X`` copied by one loop over
``q`` with the ``S`` phases unrolled in its body, no test (LLVM's loop vectoriser makes the
``S`` loads one interleaved group: contiguous vector loads and shuffles), and the few columns
at either end under the original test. The values stored are the same.
"""

from __future__ import annotations

import tvm
from tvm import sym, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir import SBlockRealize

from ..tir_utils import const_int, substitute, with_root_body
from .analysis import uses_any


def _i64(value) -> tirx.PrimExpr:
    return tirx.const(value, "int64") if isinstance(value, int) else value


def _clauses(cond) -> list:
    if isinstance(cond, tirx.And):
        return _clauses(cond.a) + _clauses(cond.b)
    return [cond]


def _conjunction(clauses: list):
    if not clauses:
        return None
    out = clauses[0]
    for clause in clauses[1:]:
        out = tirx.And(out, clause)
    return out


def _phase_nest(loop: tirx.For):
    """(ph loop, q loop, realize) when ``loop`` is ``for ph: for q: <one block>``."""
    inner = loop.body
    if not isinstance(inner, tirx.For):
        return None
    realize = inner.body
    if not isinstance(realize, SBlockRealize):
        return None
    return loop, inner, realize


def _rewrite(loop: tirx.For, min_interior: int = 1) -> tirx.Stmt | None:
    nest = _phase_nest(loop)
    if nest is None:
        return None
    ph_loop, q_loop, realize = nest
    block = realize.block
    store = block.body
    if (block.init is not None or not isinstance(store, tirx.BufferStore)
            or not isinstance(store.value, tvm.ir.Call)
            or not isinstance(store.value.op, tvm.ir.Op)
            or store.value.op.name.rsplit(".", 1)[-1] != "if_then_else"):
        return None
    cond, load, pad = store.value.args
    if not isinstance(load, TensorLoad) or const_int(realize.predicate) != 1 \
            or not isinstance(pad, (tirx.FloatImm, tirx.IntImm)):
        return None
    ivs = [iv.var for iv in block.iter_vars]
    # a layout given by transform_layout + transform_block_layout (a depthwise conv's
    # even/odd padding) stores at (q·S + ph) % S, (q·S + ph) // S: ph and q in their ranges
    bounded = sym.Analyzer()
    for iv in block.iter_vars[-2:]:
        bounded.bind(iv.var, iv.dom)
    indices = [bounded.simplify(i) for i in store.indices]
    if len(indices) != len(ivs) or len(ivs) < 2 or \
            not all(isinstance(i, tvm.ir.Var) and i.same_as(v) for i, v in zip(indices, ivs)):
        return None
    v_ph, v_q = ivs[-2], ivs[-1]
    values = list(realize.iter_values)
    if not (values[-2].same_as(ph_loop.loop_var) and values[-1].same_as(q_loop.loop_var)):
        return None
    stride = const_int(ph_loop.extent)
    count = const_int(q_loop.extent)
    if stride is None or count is None or stride < 2 or const_int(ph_loop.min) != 0 \
            or const_int(q_loop.min) != 0:
        return None
    # the column index of X: q·S + ph + c; every other index free of ph and q
    analyzer = sym.Analyzer()
    column = load.indices[-1]
    offset = analyzer.simplify(column - v_q * _i64(stride) - v_ph)
    c = const_int(offset)
    width = const_int(load.source.shape[-1])
    if c is None or width is None or any(uses_any(i, [v_ph, v_q]) for i in load.indices[:-1]):
        return None
    row = [cl for cl in _clauses(cond) if not uses_any(cl, [v_ph, v_q])]
    cols = [cl for cl in _clauses(cond) if uses_any(cl, [v_ph, v_q])]
    # q where every phase reads inside X: 0 <= q·S + c and q·S + S - 1 + c < width
    lo = max(0, -(c // stride))
    hi = min(count, (width - stride - c) // stride + 1)
    if hi - lo < max(min_interior, 1):
        return None
    analyzer.bind(v_q, tvm.ir.Range(_i64(lo), _i64(hi)))
    analyzer.bind(v_ph, tvm.ir.Range(_i64(0), _i64(stride)))
    if not all(analyzer.can_prove(cl) for cl in cols):
        return None
    if not all(analyzer.can_prove(tirx.And(i >= _i64(0), i < _i64(int(n))))
               for i, n in zip(load.indices[-1:], load.source.shape[-1:])):
        return None

    lead = {v: val for v, val in zip(ivs[:-2], values[:-2])}

    def at(ph, q):
        mapping = {**lead, v_ph: ph, v_q: q}

        def sub(expr):
            return substitute(expr, mapping)
        return sub, [sub(i) for i in indices]

    def tested(ph, q):
        sub, idx = at(ph, q)
        value = tirx.if_then_else(sub(cond), sub(load), pad)
        return tirx.BufferStore(store.buffer, value, idx)

    def plain(ph, q, value=None):
        sub, idx = at(ph, q)
        return tirx.BufferStore(store.buffer, sub(load) if value is None else value, idx)

    def loop(name, start, stop, body_of, kind=tirx.ForKind.SERIAL):
        var = tirx.Var(name, "int64")
        return tirx.For(var, _i64(start), _i64(stop - start), kind, body_of(var))

    def edge(start, stop):
        if stop <= start:
            return None
        return loop("ph", 0, stride, lambda ph: loop("q", start, stop, lambda q: tested(ph, q)))

    interior = loop("q", lo, hi, lambda q: tirx.SeqStmt(
        [plain(_i64(ph), q) for ph in range(stride)]))
    parts = [s for s in (edge(0, lo), interior, edge(hi, count)) if s is not None]
    copy = parts[0] if len(parts) == 1 else tirx.SeqStmt(parts)
    row_cond = _conjunction(row)
    if row_cond is None:
        return copy
    sub, _ = at(_i64(0), _i64(0))
    zeros = loop("ph", 0, stride, lambda ph: loop("q", 0, count, lambda q: plain(ph, q, pad)))
    return tirx.IfThenElse(sub(row_cond), copy, zeros)


def deinterleave_phase_paddings(stmt: tirx.Stmt, min_interior: int = 1
                                ) -> tuple[tirx.Stmt, list[str]]:
    """``stmt`` with every phase padding's ``ph``/``q`` loops rewritten (module docstring)
    where at least ``min_interior`` columns of each phase read inside the row; one note per
    rewritten block."""
    notes = []

    def visit(node):
        if isinstance(node, tirx.SeqStmt):  # a channel's padding beside its tile nest
            seq = [visit(child) for child in node.seq]
            if all(a.same_as(b) for a, b in zip(seq, node.seq)):
                return node
            return tirx.SeqStmt(seq)
        if not isinstance(node, tirx.For):
            return node
        nest = _phase_nest(node)
        if nest is not None:
            new = _rewrite(node, min_interior)
            if new is not None:
                notes.append(f"{nest[2].block.name_hint}: {const_int(node.extent)} column "
                             "phases copied deinterleaved (interior columns without a test, "
                             "edges apart)")
                return new
            return node
        body = visit(node.body)
        if body.same_as(node.body):
            return node
        return tirx.For(node.loop_var, node.min, node.extent, node.kind, body,
                        node.thread_binding, node.annotations)
    return visit(stmt), notes


def deinterleave_in_func(func: tirx.PrimFunc, lanes: int) -> tuple[tirx.PrimFunc, list[str]]:
    """``func`` (scheduled: one root block) with its phase paddings rewritten
    (:func:`deinterleave_phase_paddings`), wherever they sit under its loops: a stride-2
    depthwise conv or pool pads each channel inside its parallel channel loop. Only where
    each phase has at least ``lanes`` interior columns: LLVM vectorises the interleaved copy
    by whole vectors of the phase, so a shorter row (EfficientNet-B0's 5×5/2 at 28×28: 13
    columns a phase) was copied one float at a time, slower (0.083 → 0.090 ms on Zen 4) than
    the masked gathers it replaced; MobileNetV2's 56- and 112-wide rows (27 and 55 columns)
    gained (0.125 → 0.081, 0.525 → 0.399 ms)."""
    realize = func.body
    if not isinstance(realize, SBlockRealize):
        return func, []
    body, notes = deinterleave_phase_paddings(realize.block.body, lanes)
    if not notes:
        return func, []
    return with_root_body(func, body), notes

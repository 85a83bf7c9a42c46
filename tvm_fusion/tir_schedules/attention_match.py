"""Attention read from the TIR of one fused PrimFunc: what the attention templates generate from.

FuseTIR leaves a planned attention block as one PrimFunc whose blocks are the legalised
operators: data movement (reshape, transpose, broadcast, gather), ``Q·Kᵀ`` (a contraction),
element-wise score arithmetic (scale, masks, biases), softmax (a max reduction, ``exp``, a sum
reduction, a division), ``·V`` (a contraction) and the head merge. This module recognises that
structure from the blocks alone — reductions and their combiners, which buffers they read,
index maps — never from names, and returns every piece as an expression over canonical index
variables, so that a template can evaluate any of them at any point:

* rows ``(batch..., i)`` and the output vector ``d`` are the ``·V`` contraction's output axes,
  ``j`` its reduction axis (keys), ``k`` the ``Q·Kᵀ`` reduction axis (head dimension);
* ``query(batch, i, k)``, ``key(batch, j, k)``, ``value(batch, j, d)``: the operands, every
  producer in front of them inlined (a transpose becomes an index change, a GQA broadcast a
  ``h // rep``, a scale on Q an arithmetic prologue);
* ``score(s, batch, i, j)``: what the softmax sees for the product ``s = q·k`` (scale, additive
  masks, ``Where`` selections, biases), with its own reads of mask and bias buffers;
* the output store: the buffer, its index for ``(batch, i, d)`` (the inverse of the head-merge
  reshape/transpose) and the value for the result ``o``.

The match is checked, not assumed: the max and sum reductions must reduce exactly the scores
``·V`` normalises (the same expression, the same row), and the contractions must be over the
axes their roles say. Anything else raises :class:`NotAttention` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import sym, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir import SBlockRealize

from ..tir_utils import buffer_loads, find_all, iter_sblocks, substitute

_SPATIAL, _REDUCE = 0, 2
F32 = "float32"

__all__ = ["AttentionPattern", "Contraction", "NotAttention", "contraction_roles", "free_vars",
           "is_pure_cast", "is_row_softmax", "loads_of", "match_attention", "promote_f32",
           "simplify_index", "simplify_loads"]


class NotAttention(ValueError):
    """The function is not an attention the templates take; the message says why."""


@dataclass
class AttentionPattern:
    """An attention, every piece over canonical variables (see the module docstring)."""

    func: tirx.PrimFunc
    batch: list  # canonical batch Vars (heads, batch, windows...), the ·V output's leading axes
    batch_extents: list
    i: tirx.Var
    sq: object  # query rows (PrimExpr; symbolic for a symbolic sequence)
    j: tirx.Var
    sk: object  # keys
    k: tirx.Var
    dk: int  # Q·Kᵀ reduction extent (head dimension)
    d: tirx.Var
    dv: int  # value head dimension
    s: tirx.Var  # float32: the product q·k inside ``score``
    query: object  # float32, over (batch, i, k)
    key: object  # float32, over (batch, j, k)
    value: object  # float32, over (batch, j, d)
    score: object  # float32, over (s, batch, i, j)
    m_init: object  # the max reduction's initial value (TOPI: the lowest finite float)
    out: tirx.Var  # the output buffer (a parameter)
    out_index: list  # over (batch, i, d)
    o: tirx.Var  # float32: the normalised result inside ``out_value``
    out_value: object  # over (o, batch, i, d), in the output's dtype
    in_dtype: str  # the dtype of Q·Kᵀ's operands (float32, float16)
    notes: list = field(default_factory=list)
    zero_empty_rows: bool = False  # a *safe* softmax: a row of only -inf scores gives 0

    def normalise(self, acc, total):
        """``acc / total``, the softmax's division; 0 where a safe softmax's row sum is 0
        (every score ``-inf``, relay_passes/safe_softmax.py), not ``0/0``."""
        if not self.zero_empty_rows:
            return acc / total
        zero = tirx.const(0.0, F32)
        return tirx.Select(tirx.EQ(total, zero), zero, acc / total)

    def ranges(self) -> dict:
        """Every canonical index variable and its extent."""
        ranges = dict(zip(self.batch, self.batch_extents))
        ranges.update({self.i: self.sq, self.j: self.sk, self.k: self.dk, self.d: self.dv})
        return ranges

    def analyzer(self) -> sym.Analyzer:
        ana = sym.Analyzer()
        for var, extent in self.ranges().items():
            ana.bind(var, tvm.ir.Range(0, extent))
        return ana

    def rows(self) -> object:
        """The number of independent rows (batch × query positions)."""
        total = self.sq
        for ext in self.batch_extents:
            total = total * ext
        return total

    def score_elements(self):
        """Elements of one score matrix (what the unfused softmax reads)."""
        return self.rows() * self.sk


# ------------------------------------------------------------------------- expression helpers


def free_vars(expr) -> list:
    """The index/scalar variables ``expr`` uses (buffer variables of loads excluded)."""
    found: list = []
    for var in find_all(expr, tvm.ir.Var):
        if isinstance(getattr(var, "ty", None), tirx.BufferType):
            continue
        if not any(var.same_as(f) for f in found):
            found.append(var)
    return found


def uses(expr, var) -> bool:
    return any(v.same_as(var) for v in free_vars(expr))


def loads_of(expr, buffer) -> list:
    return [ld for ld in buffer_loads(expr) if ld.source.same_as(buffer)]


def simplify_loads(expr, ana: sym.Analyzer, ranges: dict | None = None):
    """``expr`` with every load index simplified (the value arithmetic is left alone); with
    ``ranges`` (variable → extent) a reshape's flatten-then-split is cancelled too
    (:func:`simplify_index`), in load indices and in the integer divisions of iterators a
    mask compares (``i < j`` read through a batch reshape of the scores)."""

    def simplify(ld):
        return tirx.BufferLoad(ld.source, [simplify_index(ix, ana, ranges) for ix in ld.indices])

    def index_arith(e):
        return simplify_index(e, ana, ranges) if str(e.ty).startswith("int") else e

    def branches(e):
        # each branch of a choice simplified knowing which way the condition went: RoPE's
        # rotate-half reads ``x[(kd - 16) // 128 + i) % seq, …]`` only where ``kd >= 16``,
        # so the division is 0 and the row is ``i`` (else a division by ``seq`` per element)
        cond, yes, no = ((e.condition, e.true_value, e.false_value)
                         if isinstance(e, tirx.Select) else tuple(e.args))
        if buffer_loads(cond):
            return e
        with ana.constraint_scope(cond):
            yes = simplify_loads(yes, ana, ranges)
        with ana.constraint_scope(ana.simplify(tirx.Not(cond))):
            no = simplify_loads(no, ana, ranges)
        if isinstance(e, tirx.Select):
            return tirx.Select(cond, yes, no)
        return tirx.if_then_else(cond, yes, no)

    def choice(e):
        if isinstance(e, tirx.Select) or (isinstance(e.op, tvm.ir.Op)
                                          and e.op.name.endswith("if_then_else")):
            return branches(e)
        return e

    rules = [(TensorLoad, simplify)]
    if ranges:
        rules.append(((tirx.FloorDiv, tirx.FloorMod), index_arith))
    expr = tvm_ffi.structural_map(expr, rules)
    return tvm_ffi.structural_map(expr, [((tirx.Select, tvm.ir.Call), choice)])


def simplify_index(expr, ana: sym.Analyzer, ranges: dict | None = None):
    """An index expression simplified, including what TVM's simplifier leaves for symbolic
    extents: ``(h·seq + j) % seq`` is ``j`` and ``(h·seq + j) // seq`` is ``h`` when ``j <
    seq`` (a reshape composed with its inverse). The expression is read as an affine map of
    the iterators of ``ranges`` (``detect_iter_map``); a split of a fused iterator that takes
    whole iterators, or a part of one, is rewritten from them. Anything else: the analyzer's
    simplification."""
    expr = ana.simplify(expr)
    if not ranges:
        return expr
    used = [v for v in free_vars(expr) if any(v.same_as(r) for r in ranges)]
    if not used:
        return expr
    dom = {v: tvm.ir.Range(0, ext) for v, ext in ranges.items()
           if any(v.same_as(u) for u in used)}
    try:
        found = sym.detect_iter_map([expr], dom, check_level="surjective",
                                    simplify_trivial_iterators=True)
    except Exception:  # noqa: BLE001 (a map it cannot read: keep the simplified form)
        return expr
    if len(found.indices) != 1:
        return expr
    rebuilt = _iter_sum(found.indices[0], ana)
    return ana.simplify(rebuilt) if rebuilt is not None else expr


def _iter_sum(node, ana):
    total = node.base
    for arg in node.args:
        part = _iter_split(arg, ana)
        if part is None:
            return None
        total = total + part
    return total


def _iter_split(split, ana):
    """``(source // lower_factor) % extent * scale`` with a fused source read digit by digit."""
    source = split.source.source
    lower, extent, scale = split.lower_factor, split.extent, split.scale
    if isinstance(source, tvm.ir.Var):
        value = source if _is_one(lower) else tirx.floordiv(source, lower)
        if not ana.can_prove_equal(lower * extent, split.source.extent):
            value = tirx.floormod(value, extent)
        return value * scale
    if not isinstance(source, sym.IterSumExpr) or not _is_zero(source.base):
        return None
    # a fused iterator: digits (args) in mixed radix; take the ones [lower, lower·extent)
    selected = 0
    for arg in source.args:
        inner = _iter_split(arg, ana)
        if inner is None:
            return None
        digit = inner if _is_one(arg.scale) else tirx.floordiv(inner, arg.scale)
        top = arg.scale * arg.extent
        if _divides(lower, arg.scale, ana) and _divides(arg.scale * arg.extent,
                                                        lower * extent, ana):
            selected = selected + digit * ana.simplify(tirx.floordiv(arg.scale, lower))
        elif _divides(arg.scale, lower, ana) and _divides(lower * extent, top, ana):
            # the split lies inside this digit: (digit // (lower / scale)) % extent
            sub = ana.simplify(tirx.floordiv(lower, arg.scale))
            part = digit if _is_one(sub) else tirx.floordiv(digit, sub)
            if not ana.can_prove_equal(sub * extent, arg.extent):
                part = tirx.floormod(part, extent)
            return part * scale
        elif not (_divides(top, lower, ana) or _divides(lower * extent, arg.scale, ana)):
            return None  # a digit cut in two: leave it to TVM
    return selected * scale


def _divides(a, b, ana) -> bool:
    """``a`` divides ``b`` (symbolic products of extents)."""
    return ana.can_prove_equal(tirx.floormod(b, a), 0)


def _is_one(expr) -> bool:
    return isinstance(expr, tirx.IntImm) and int(expr.value) == 1


def strip_float_casts(expr):
    """Float-to-float casts removed from the top of ``expr`` (a precision change only)."""
    while isinstance(expr, tirx.Cast) and _is_float(str(expr.ty)) and _is_float(
            str(expr.value.ty)):
        expr = expr.value
    return expr


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def promote_f32(expr):
    """``expr`` computed in float32: narrower float loads are widened, narrower float constants
    and arithmetic become float32, float-to-float casts disappear (the templates accumulate in
    float32; the inputs and the output keep their dtype)."""

    def is_narrow(e) -> bool:
        dtype = str(e.ty)
        return _is_float(dtype) and dtype != F32 and dtype != "float64"

    def widen(e):
        if isinstance(e, TensorLoad):
            return tirx.Cast(F32, e) if is_narrow(e) else e
        if isinstance(e, tirx.FloatImm):
            return tirx.FloatImm(F32, float(e.value)) if is_narrow(e) else e
        if isinstance(e, tirx.Cast):
            inner = e.value
            if _is_float(str(e.ty)) and _is_float(str(inner.ty)):
                return inner if str(inner.ty) == F32 else tirx.Cast(F32, inner)
            if _is_float(str(e.ty)) and str(e.ty) != F32:
                return tirx.Cast(F32, inner)
            return e
        if isinstance(e, tirx.Var) and is_narrow(e):
            return tirx.Cast(F32, e)
        return e

    def rebuild(e):
        # post-order: children are already float32; re-create nodes whose dtype is stale
        if isinstance(e, (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Max, tirx.Min)):
            if str(e.a.ty) != str(e.ty) or str(e.b.ty) != str(e.ty):
                return type(e)(e.a, e.b)
            return e
        if isinstance(e, tirx.Select):
            if str(e.true_value.ty) != str(e.ty):
                return tirx.Select(e.condition, e.true_value, e.false_value)
            return e
        if isinstance(e, tvm.ir.Call) and e.args and _is_float(str(e.ty)) and str(e.ty) != F32:
            if isinstance(e.op, tvm.ir.Op) and e.op.name.endswith("if_then_else"):
                return tirx.if_then_else(*e.args)
            return tvm.ir.Call(F32, e.op, list(e.args))
        return widen(e)

    widened = tvm_ffi.structural_map(expr, [((TensorLoad, tirx.FloatImm, tirx.Cast), widen)])
    return tvm_ffi.structural_map(
        widened, [((tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Max, tirx.Min, tirx.Select,
                    tvm.ir.Call), rebuild)])


def fold_selections(expr, ana: sym.Analyzer):
    """Boolean masks as exporters write them, folded to their condition: ``Cast(bool,
    Select(c, 1.0, 0.0))`` is ``c``, ``0 < Cast(int, c)`` is ``c``, ``Select(c, True,
    False)`` is ``c`` (a causal ``Where(Cast(bool, Trilu(ones)), s, -inf)`` becomes
    ``Select(j <= i, s, -inf)``: one compare per score instead of a chain of conversions)."""

    def const(e):
        e = ana.simplify(e)
        return float(e.value) if isinstance(e, (tirx.FloatImm, tirx.IntImm)) else None

    def fold(e):
        if isinstance(e, tirx.Cast):
            inner = e.value
            target = str(e.ty)
            if isinstance(inner, tirx.Select):
                a, b = const(inner.true_value), const(inner.false_value)
                if a is not None and b is not None:
                    if target == "bool":
                        if a != 0 and b == 0:
                            return inner.condition
                        if a == 0 and b != 0:
                            return tirx.Not(inner.condition)
                    return tirx.Select(inner.condition, tirx.const(a, target),
                                       tirx.const(b, target))
            if str(inner.ty) == "bool" and target.startswith(("int", "uint")):
                return tirx.Select(inner, tirx.const(1, target), tirx.const(0, target))
            return e
        if isinstance(e, (tirx.LT, tirx.GT, tirx.NE, tirx.GE, tirx.LE, tirx.EQ)):
            for sel, other, flip in ((e.b, e.a, False), (e.a, e.b, True)):
                if isinstance(sel, tirx.Select) and const(other) is not None:
                    a, b = const(sel.true_value), const(sel.false_value)
                    if a is None or b is None:
                        continue
                    cmp = type(e)
                    pick = [bool(ana.simplify(cmp(tirx.const(v, str(sel.ty)), other) if flip
                                              else cmp(other, tirx.const(v, str(sel.ty)))))
                            for v in (a, b)]
                    if pick == [True, False]:
                        return sel.condition
                    if pick == [False, True]:
                        return tirx.Not(sel.condition)
            return e
        if isinstance(e, tirx.Select) and str(e.ty) == "bool":
            a, b = const(e.true_value), const(e.false_value)
            if a is not None and b is not None and bool(a) != bool(b):
                return e.condition if a else tirx.Not(e.condition)
        return e

    return tvm_ffi.structural_map(
        expr, [((tirx.Cast, tirx.LT, tirx.GT, tirx.NE, tirx.GE, tirx.LE, tirx.EQ,
                 tirx.Select), fold)])


# ----------------------------------------------------------------------------- definitions


@dataclass
class _Def:
    """The block that writes one buffer."""

    block: object
    buffer: tirx.Var
    spatial: list  # iter Vars in the order the store indexes them
    reduce: list
    value: object  # the stored value (for a reduction: the update)
    init: object | None

    @property
    def is_reduction(self) -> bool:
        return bool(self.reduce)


def _definitions(func: tirx.PrimFunc) -> dict:
    """Buffer variable → its defining block, for blocks of one store at their own iterators."""
    for realize in find_all(func.body, SBlockRealize):
        if realize.block.name_hint != "root" and not _is_true(realize.predicate):
            raise NotAttention(f"block {realize.block.name_hint!r} has a predicate")
    defs = {}
    for block in iter_sblocks(func):
        body = block.body
        if not isinstance(body, tirx.BufferStore):
            raise NotAttention(f"block {block.name_hint!r} is not one store")
        iters = list(block.iter_vars)
        if any(int(iv.iter_type) not in (_SPATIAL, _REDUCE) for iv in iters):
            raise NotAttention(f"block {block.name_hint!r} has an iterator of another kind")
        indices = list(body.indices)
        # a unit spatial iterator the store does not index (TOPI's scalar ``take`` of a
        # shape value, TorchScript's mask offset, stores ``T[()]`` under ``vi`` of extent 1)
        # takes its one value
        unit = {iv.var: iv.dom.min for iv in iters if int(iv.iter_type) == _SPATIAL
                and _is_one(iv.dom.extent) and not any(ix.same_as(iv.var) for ix in indices)}
        spatial = [iv.var for iv in iters
                   if int(iv.iter_type) == _SPATIAL and not any(iv.var.same_as(u) for u in unit)]
        reduce = [iv.var for iv in iters if int(iv.iter_type) == _REDUCE]
        if len(indices) != len(spatial) or not all(
                isinstance(ix, tvm.ir.Var) and any(ix.same_as(v) for v in spatial)
                for ix in indices) or len({id(ix) for ix in indices}) != len(indices):
            raise NotAttention(f"block {block.name_hint!r} does not store at its own iterators")
        order = [next(v for v in spatial if v.same_as(ix)) for ix in indices]
        init = block.init.value if block.init is not None and isinstance(
            block.init, tirx.BufferStore) else None
        value = substitute(body.value, unit)
        init = None if init is None else substitute(init, unit)
        if any(buf.same_as(body.buffer) for buf in defs):
            raise NotAttention(f"buffer {body.buffer.name!r} is written by two blocks")
        defs[body.buffer] = _Def(block, body.buffer, order, reduce, value, init)
    return defs


def _is_true(expr) -> bool:
    return isinstance(expr, tirx.IntImm) and int(expr.value) == 1


def _lookup(defs: dict, buffer):
    for buf, d in defs.items():
        if buf.same_as(buffer):
            return d
    return None


def _expand(expr, defs: dict, depth: int = 0):
    """Loads of buffers written by spatial blocks replaced by what those blocks compute at the
    loaded index, recursively: the expression in terms of parameters and reduction results."""
    if depth > 64:
        raise NotAttention("producer chain too deep")

    def inline(ld):
        d = _lookup(defs, ld.source)
        if d is None or d.is_reduction:
            return ld
        value = substitute(d.value, dict(zip(d.spatial, ld.indices)))
        return _expand(value, defs, depth + 1)

    return tvm_ffi.structural_map(expr, [(TensorLoad, inline)])


def _reduction(d: _Def) -> tuple[str, object]:
    """(combiner, operand) of a reduction block: ``acc + x`` is ``("sum", x)``, ``max(acc, x)``
    is ``("max", x)``."""
    value = d.value
    for kind, cls in (("sum", tirx.Add), ("max", tirx.Max)):
        if isinstance(value, cls):
            for acc, other in ((value.a, value.b), (value.b, value.a)):
                if _is_self_load(acc, d):
                    return kind, other
    raise NotAttention(f"reduction {d.block.name_hint!r} is neither a sum nor a max")


def _is_self_load(expr, d: _Def) -> bool:
    return (isinstance(expr, TensorLoad) and expr.source.same_as(d.buffer)
            and all(ix.same_as(v) for ix, v in zip(expr.indices, d.spatial)))


def _outputs(func: tirx.PrimFunc, defs: dict) -> list:
    """The trailing parameters some block writes (destination-passing outputs)."""
    outs = []
    for param in reversed(list(func.params)):
        if _lookup(defs, param) is None:
            break
        outs.append(param)
    return outs[::-1]


def _equal(a, b) -> bool:
    return bool(tvm_ffi.structural_equal(a, b))


# ---------------------------------------------------------------------------------- the match


def match_attention(func: tirx.PrimFunc) -> AttentionPattern:
    """The attention in ``func`` (FuseTIR's output of one planned block), or
    :class:`NotAttention` naming what does not fit."""
    defs = _definitions(func)
    outputs = _outputs(func, defs)
    if len(outputs) != 1:
        raise NotAttention(f"{len(outputs)} outputs (the scores or probabilities are read "
                           "outside the block)")
    reductions = [d for d in defs.values() if d.is_reduction]
    if len(reductions) != 4:
        raise NotAttention(f"{len(reductions)} reductions, not 4 (Q·Kᵀ, max, sum, ·V)")
    kinds = {id(d): _reduction(d) for d in reductions}
    maxes = [d for d in reductions if kinds[id(d)][0] == "max"]
    if len(maxes) != 1:
        raise NotAttention("no single max reduction (softmax's row maximum)")
    mx = maxes[0]
    sums = [d for d in reductions if d is not mx]
    expanded = {id(d): _expand(kinds[id(d)][1], defs) for d in reductions}

    def reads_reduction(expr) -> bool:
        return any((dd := _lookup(defs, ld.source)) is not None and dd.is_reduction
                   for ld in buffer_loads(expr))

    qk = [d for d in sums if isinstance(expanded[id(d)], tirx.Mul)
          and not reads_reduction(expanded[id(d)])]
    pv = [d for d in sums if isinstance(strip_float_casts(expanded[id(d)]), tirx.Mul)
          and reads_reduction(expanded[id(d)])]
    if len(qk) != 1 or len(pv) != 1:
        raise NotAttention("no Q·Kᵀ and ·V contractions around the softmax")
    qk, pv = qk[0], pv[0]
    sm = next(d for d in sums if d is not qk and d is not pv)
    if len(qk.reduce) != 1 or len(pv.reduce) != 1 or len(mx.reduce) != 1 or len(sm.reduce) != 1:
        raise NotAttention("a reduction over several axes")

    # canonical variables, named after their roles; the ·V contraction fixes them
    if len(pv.spatial) < 2:
        raise NotAttention("·V has fewer than two output axes")
    itype = str(pv.spatial[-1].ty)
    batch = [tirx.Var(f"b{n}", itype) for n in range(len(pv.spatial) - 2)]
    i, d_var = tirx.Var("i", itype), tirx.Var("d", itype)
    j, k = tirx.Var("j", itype), tirx.Var("kd", str(qk.reduce[0].ty))
    s, o = tirx.Var("s", F32), tirx.Var("o", F32)
    to_canon = dict(zip(pv.spatial, batch + [i, d_var]))
    to_canon[pv.reduce[0]] = j
    extents = {v: iv.dom.extent for iv in pv.block.iter_vars for v in [iv.var]}
    pv_ext = [extents[v] for v in pv.spatial]
    sk = next(iv.dom.extent for iv in pv.block.iter_vars if iv.var.same_as(pv.reduce[0]))
    dk = next(iv.dom.extent for iv in qk.block.iter_vars if iv.var.same_as(qk.reduce[0]))
    dv = pv_ext[-1]
    if not isinstance(dk, tirx.IntImm) or not isinstance(dv, tirx.IntImm):
        raise NotAttention("the head dimension is symbolic")
    ana = sym.Analyzer()
    ranges = dict(zip(batch, pv_ext[:-2]))
    ranges.update({i: pv_ext[-2], j: sk, k: dk, d_var: dv})
    for var, ext in ranges.items():
        ana.bind(var, tvm.ir.Range(0, ext))

    def canon(expr):
        return simplify_loads(substitute(expr, to_canon), ana, ranges)

    # ·V: probability factor p (over batch, i, j) times value factor (over batch, j, d)
    prod = strip_float_casts(expanded[id(pv)])
    factors = [canon(prod.a), canon(prod.b)]
    p_idx = [n for n, f in enumerate(factors) if reads_reduction(f)]
    if len(p_idx) != 1:
        raise NotAttention("·V multiplies no (or two) softmax outputs")
    prob, value = factors[p_idx[0]], factors[1 - p_idx[0]]
    if uses(prob, d_var) or uses(value, i) or not uses(value, d_var) or not uses(value, j):
        raise NotAttention("·V's operands are not (rows × keys) · (keys × values)")
    prob = strip_float_casts(prob)
    guard = _empty_row_guard(prob, sm)
    if guard is not None:
        prob = strip_float_casts(prob.false_value)
    if not (isinstance(prob, tirx.Div) and isinstance(prob.b, TensorLoad)
            and prob.b.source.same_as(sm.buffer)):
        raise NotAttention("the probabilities are not exp(·) divided by the row sum")
    exp_term = strip_float_casts(prob.a)
    if not _is_exp(exp_term) or not isinstance(exp_term.args[0], tirx.Sub):
        raise NotAttention("the probabilities are not exp(scores - row max)")
    diff = exp_term.args[0]
    m_load, l_load = diff.b, prob.b
    if not (isinstance(m_load, TensorLoad) and m_load.source.same_as(mx.buffer)):
        raise NotAttention("exp(scores - x): x is not the row max")
    if not all(ana.can_prove_equal(a, b) for a, b in zip(m_load.indices, l_load.indices)):
        raise NotAttention("the row max and the row sum are of different rows")
    if guard is not None and not all(
            ana.can_prove_equal(a, b) for a, b in zip(guard.indices, l_load.indices)):
        raise NotAttention("the empty-row guard tests another row's sum")
    score = diff.a

    # the max and the sum reduce exactly these scores, row by row
    for red, what in ((mx, "max"), (sm, "sum")):
        row = m_load.indices if red is mx else l_load.indices
        sub = dict(zip(red.spatial, row))
        sub[red.reduce[0]] = j
        theirs = simplify_loads(substitute(expanded[id(red)], sub), ana, ranges)
        ours = score if red is mx else exp_term
        if not _equal(theirs, ours):
            raise NotAttention(f"the softmax {what} reduces other values than ·V normalises")
    if mx.init is None:
        raise NotAttention("the max reduction has no initial value")
    m_init = mx.init
    if sm.init is None or not _is_zero(sm.init) or qk.init is None or not _is_zero(
            qk.init) or pv.init is None or not _is_zero(pv.init):
        raise NotAttention("a sum reduction does not start at zero")

    # Q·Kᵀ, read by the scores at one index: substitute it into the contraction
    s_loads = loads_of(score, qk.buffer)
    if not s_loads:
        raise NotAttention("the scores do not read Q·Kᵀ")
    first = s_loads[0]
    if not all(all(ana.can_prove_equal(a, b) for a, b in zip(ld.indices, first.indices))
               for ld in s_loads):
        raise NotAttention("the scores read Q·Kᵀ at two indices")
    sub = dict(zip(qk.spatial, first.indices))
    sub[qk.reduce[0]] = k
    mul = substitute(expanded[id(qk)], sub)
    a, b = simplify_loads(mul.a, ana, ranges), simplify_loads(mul.b, ana, ranges)
    # one query row (a decode step) or one key: that axis may be folded away in the loads
    one_row, one_key = _is_one(ana.simplify(pv_ext[-2])), _is_one(ana.simplify(sk))
    q_first = (uses(a, i) or (one_row and uses(b, j))) and not uses(a, j)
    query, key = (a, b) if q_first else (b, a)
    if uses(query, j) or uses(key, i) or not (uses(query, i) or one_row) or not (
            uses(key, j) or one_key) or not (uses(query, k) and uses(key, k)):
        raise NotAttention("Q·Kᵀ's operands are not (rows × head) · (keys × head)")
    in_dtype = str(first.ty)

    def replace_scores(ld):
        return tirx.Cast(str(ld.ty), s) if ld.source.same_as(qk.buffer) else ld

    score_fn = tvm_ffi.structural_map(score, [(TensorLoad, replace_scores)])
    score_fn = fold_selections(promote_f32(score_fn), ana)
    for expr, what in ((query, "Q"), (key, "K"), (value, "V"), (score_fn, "the scores")):
        if reads_reduction(expr):
            raise NotAttention(f"{what} reads a reduction result")

    out, out_index, out_value = _output_store(func, defs, outputs[0], pv, batch + [i, d_var],
                                              o, ana, ranges)
    return AttentionPattern(
        func=func, batch=batch, batch_extents=pv_ext[:-2], i=i, sq=pv_ext[-2], j=j, sk=sk,
        k=k, dk=int(dk), d=d_var, dv=int(dv), s=s, query=promote_f32(query),
        key=promote_f32(key), value=promote_f32(value), score=score_fn,
        m_init=promote_f32(m_init), out=out, out_index=out_index, o=o, out_value=out_value,
        in_dtype=in_dtype, zero_empty_rows=guard is not None)


def _empty_row_guard(prob, sm: _Def):
    """The load of the row sum in ``select(sum == 0, 0, p)`` (a safe softmax), else None."""
    if not isinstance(prob, tirx.Select) or not _is_zero(strip_float_casts(prob.true_value)):
        return None
    cond = prob.condition
    if not isinstance(cond, tirx.EQ):
        return None
    load, zero = (cond.a, cond.b) if isinstance(cond.a, TensorLoad) else (cond.b, cond.a)
    if isinstance(load, TensorLoad) and load.source.same_as(sm.buffer) and _is_zero(zero):
        return load
    return None


def _is_exp(expr) -> bool:
    return isinstance(expr, tvm.ir.Call) and isinstance(expr.op, tvm.ir.Op) and (
        expr.op.name == "tirx.exp")


def _is_zero(expr) -> bool:
    return isinstance(expr, (tirx.FloatImm, tirx.IntImm)) and float(expr.value) == 0.0


def _output_store(func, defs, out, pv: _Def, canon: list, o, ana: sym.Analyzer, ranges: dict):
    """(buffer, index over the canonical variables, value over ``o``) of the final store: the
    ·V result itself, or a chain of copies, casts and element-wise epilogues after it, whose
    index map (the head merge: transpose, reshape) is inverted."""
    pv_index = list(canon)  # the ·V result's index, in its store (= dimension) order
    o_native = tirx.Cast(str(pv.value.ty), o) if str(pv.value.ty) != F32 else o
    if out.same_as(pv.buffer):
        return out, pv_index, _cast(o_native, str(pv.value.ty))
    final = _lookup(defs, out)
    if final is None or final.is_reduction:
        raise NotAttention("the output is not written after ·V")
    value = _expand(final.value, defs)
    o_loads = loads_of(value, pv.buffer)
    if not o_loads:
        raise NotAttention("the output does not read ·V's result")
    for ld in buffer_loads(value):
        dd = _lookup(defs, ld.source)
        if dd is not None and dd is not pv:
            raise NotAttention("the output reads another intermediate result")
    first = o_loads[0]
    y_ext = {iv.var: iv.dom.extent for iv in final.block.iter_vars}
    y_ana = sym.Analyzer()
    for var in final.spatial:
        y_ana.bind(var, tvm.ir.Range(0, y_ext[var]))
    h = [y_ana.simplify(ix) for ix in first.indices]
    if not all(all(y_ana.can_prove_equal(a, b) for a, b in zip(ld.indices, first.indices))
               for ld in o_loads):
        raise NotAttention("the output reads ·V's result at two indices")
    try:
        index_map = tirx.IndexMap(list(final.spatial), h, None)
        inverse = index_map.inverse([y_ext[v] for v in final.spatial])
        y_of_o = inverse.map_indices(pv_index)
    except Exception as err:  # noqa: BLE001 (TVM raises several types for a non-bijective map)
        raise NotAttention(f"the head merge is not invertible ({type(err).__name__})") from None
    y_of_o = [simplify_index(ix, ana, ranges) for ix in y_of_o]
    sub = dict(zip(final.spatial, y_of_o))

    def put_o(ld):
        return o_native if ld.source.same_as(pv.buffer) else ld

    value = tvm_ffi.structural_map(value, [(TensorLoad, put_o)])
    value = simplify_loads(substitute(value, sub), ana, ranges)
    return out, y_of_o, _cast(value, str(out.ty.dtype) if hasattr(out.ty, "dtype") else F32)


def _cast(value, dtype: str):
    return value if str(value.ty) == dtype else tirx.Cast(dtype, value)


# ------------------------------------------------------------- one operator (for planning)


@dataclass(frozen=True)
class Contraction:
    """A batched contraction ``C[..., i, j] = Σ_k A[.., i, .., k] · B[.., k, .., j]``: which
    input is the row operand (indexed by ``i``) and which the column operand (by ``j``)."""

    row_input: int  # position among the PrimFunc's inputs
    col_input: int


def contraction_roles(func: tirx.PrimFunc) -> Contraction | None:
    """The roles of a matmul-like PrimFunc — one reduction, summing a product of two operands
    over one axis, whatever data movement or element-wise epilogue surrounds it (SmartMem's
    copies, a rewritten scale) — or None. Each operand must read exactly one input."""
    try:
        defs = _definitions(func)
    except NotAttention:
        return None
    reductions = [d for d in defs.values() if d.is_reduction]
    if len(reductions) != 1:
        return None
    d = reductions[0]
    if len(d.reduce) != 1 or len(d.spatial) < 2:
        return None
    try:
        kind, operand = _reduction(d)
        operand = strip_float_casts(_expand(operand, defs))
    except NotAttention:
        return None
    if kind != "sum" or not isinstance(operand, tirx.Mul):
        return None
    params = list(func.params)
    i, j, k = d.spatial[-2], d.spatial[-1], d.reduce[0]
    positions, roles = [], []
    for factor in (operand.a, operand.b):
        sources = []
        for ld in buffer_loads(factor):
            if not any(ld.source.same_as(x) for x in sources) and ld.indices:
                sources.append(ld.source)
        inputs = [n for n, p in enumerate(params) if any(p.same_as(x) for x in sources)]
        if len(inputs) != 1:
            return None
        positions.append(inputs[0])
        vs = free_vars(factor)
        roles.append({name: any(v.same_as(x) for v in vs)
                      for name, x in (("i", i), ("j", j), ("k", k))})
    if not all(r["k"] for r in roles):
        return None
    # an axis of extent 1 may be folded away (one query row of a decode step: SmartMem's
    # copy composed into the load reads ``q[0, 0, h·d + k]``, without ``i``)
    extents = {iv.var: iv.dom.extent for iv in d.block.iter_vars}
    unit = {name: _is_one(extents.get(x)) for name, x in (("i", i), ("j", j))}

    def fits(row: dict, col: dict) -> bool:
        return ((row["i"] or unit["i"]) and not row["j"] and (col["j"] or unit["j"])
                and not col["i"] and (row["i"] or col["j"]))

    if fits(roles[0], roles[1]):
        row, col = 0, 1
    elif fits(roles[1], roles[0]):
        row, col = 1, 0
    else:
        return None
    return Contraction(positions[row], positions[col])


def is_row_softmax(func: tirx.PrimFunc) -> bool:
    """A softmax-like PrimFunc: exactly one max and one sum reduction (what surrounds them, a
    layout copy, is free). The planner's filter; the fused function is matched exactly."""
    try:
        defs = _definitions(func)
        kinds = sorted(_reduction(d)[0] for d in defs.values() if d.is_reduction)
    except NotAttention:
        return False
    return kinds == ["max", "sum"]


def is_pure_cast(func: tirx.PrimFunc) -> bool:
    """One block that stores a float-to-float cast of its input at the same index, or a copy
    of it (``astype`` to its own dtype: TorchScript's GPT-2 export casts the probabilities to
    float32 before P·V, and TVM legalizes that to a copy)."""
    try:
        defs = _definitions(func)
    except NotAttention:
        return False
    if len(defs) != 1:
        return False
    (d,) = defs.values()
    value = d.value
    load = value.value if isinstance(value, tirx.Cast) else value
    return (not d.is_reduction and isinstance(load, TensorLoad) and _is_float(str(value.ty))
            and _is_float(str(load.ty))
            and all(isinstance(ix, tvm.ir.Var) and ix.same_as(v)
                    for ix, v in zip(load.indices, d.spatial)))

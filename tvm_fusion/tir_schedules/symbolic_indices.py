"""Index expressions over symbolic sizes, simplified back to the iterators they decompose.

A chain of reshapes and transposes over a symbolic ``seq`` (an attention's head split and merge,
``view``/``permute`` in torch.export programs, GQA's ``expand`` + ``reshape``) leaves, once
inlined, indices such as ``((i * seq + j) * seq + k) // seq // seq % 4``. With ``seq`` a
constant TVM's simplifier reduces that to ``i``; with it symbolic it cannot (it does not know
``seq > 0``, nor that ``j`` and ``k`` stay below it), and every element then pays a chain of
run-time divisions — BERT's attention output through torch.export took 0.4 s at seq 200 instead
of a few ms — and the CPU tile rules, which read the indices, see no GEMM in it.

:func:`simplify_symbolic_indices` rewrites every buffer index of every block: TVM's iterator
map detection (``detect_iter_map``) finds the mixed-radix structure (the index is a split of a
fused iterator ``i * seq * seq + j * seq + k``), and a split that selects whole digits of it is
replaced by those digits (``i``). An index it cannot rewrite exactly is left as it is.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import sym, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir import SBlock
from tvm.tirx.stmt import BufferStore

from ..tir_utils import find_all, refresh_access_regions

# a symbolic size is at least 1 and below this
SIZE_UPPER = 2**40

__all__ = ["simplify_symbolic_indices"]


def simplify_symbolic_indices(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with indices that divide by a symbolic size reduced where they select whole
    iterators (see the module docstring); a function without symbolic sizes is returned as is."""
    sizes = _symbolic_sizes(func)
    if not sizes:
        return func

    def per_block(block: SBlock):
        if not block.iter_vars:
            return block
        iters = {iv.var: iv.dom for iv in block.iter_vars}
        analyzer = sym.Analyzer()
        for var in sizes:
            analyzer.update(var, sym.ConstIntBound(1, SIZE_UPPER))
        for var, dom in iters.items():
            analyzer.bind(var, dom)
        cache: dict = {}

        def index(expr):
            key = expr
            if key not in cache:
                cache[key] = _rewrite(expr, iters, analyzer) if _divides_by_size(expr) else expr
                cache[key] = _fewer_divisions(cache[key], analyzer)
            return cache[key]

        def load(node):  # TVM 0.27: a buffer load is an ir TensorLoad of ``source``
            new = [index(i) for i in node.indices]
            if all(a.same_as(b) for a, b in zip(new, node.indices)):
                return node
            return tirx.BufferLoad(node.source, new)

        def store(node):
            new = [index(i) for i in node.indices]
            if all(a.same_as(b) for a, b in zip(new, node.indices)):
                return node
            return BufferStore(node.buffer, node.value, new)

        rules = [(TensorLoad, load), (BufferStore, store)]
        body = tvm_ffi.structural_map(block.body, rules)
        init = None if block.init is None else tvm_ffi.structural_map(block.init, rules)
        if body.same_as(block.body) and (init is None or init.same_as(block.init)):
            return block
        return SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body, init,
                      block.alloc_buffers, block.match_buffers, block.annotations, block.span)

    out = tvm_ffi.structural_map(func, [(SBlock, per_block)])
    return func if out.same_as(func) else refresh_access_regions(out)


def _symbolic_sizes(func: tirx.PrimFunc) -> list:
    found = {}
    for param in func.params:
        for dim in getattr(param.ty, "shape", None) or []:
            for var in tirx.analysis.undefined_vars(dim, []):
                found.setdefault(var.name, var)
    return list(found.values())


def _fewer_divisions(expr, analyzer):
    """``expr`` simplified with the iterators' ranges where that removes divisions: the
    constant ones left beside symbolic sizes (``(i * 32 + j % 32) % 128`` with i < 4 and
    j < 32, from a head merge inlined through reshapes over ``seq``) hide a GEMM's operand
    from the tile rules as much as the symbolic ones do."""
    if not find_all(expr, (tirx.FloorDiv, tirx.FloorMod)):
        return expr
    simplified = analyzer.simplify(expr)
    count = len(find_all(simplified, (tirx.FloorDiv, tirx.FloorMod)))
    return simplified if count < len(find_all(expr, (tirx.FloorDiv, tirx.FloorMod))) else expr


def _divides_by_size(expr) -> bool:
    """Whether ``expr`` divides (or takes a remainder) by something that is not a constant."""
    return any(not isinstance(node.b, tirx.IntImm)
               for node in find_all(expr, (tirx.FloorDiv, tirx.FloorMod)))


def _rewrite(expr, iters: dict, analyzer):
    """``expr`` as a sum of whole iterators where the iterator map says it is one, else
    ``expr`` unchanged."""
    try:
        result = sym.detect_iter_map([expr], iters, True, check_level=1,
                                     simplify_trivial_iterators=False, analyzer=analyzer)
    except Exception:  # noqa: BLE001 (an index the detector does not take)
        return expr
    if result.errors or not result.indices:
        return expr
    value = _sum_value(result.indices[0], analyzer)
    if value is None:
        return expr
    value = analyzer.simplify(value)
    # accept only what is exact: the rewrite must agree with the original (checked symbolically)
    return value if analyzer.can_prove_equal(value, expr) or _is_plain(value) else expr


def _is_plain(expr) -> bool:
    return not _divides_by_size(expr)


def _sum_value(iter_sum, analyzer):
    total = iter_sum.base
    for split in iter_sum.args:
        part = _split_value(split, analyzer)
        if part is None:
            return None
        total = total + part * split.scale
    return total


def _split_value(split, analyzer):
    """The value of ``(source // lower_factor) % extent`` with whole digits taken out of a
    fused source."""
    source = split.source.source
    lower, extent = split.lower_factor, split.extent
    if isinstance(source, tirx.Var):
        value = source
        if not _is(analyzer, lower, 1):
            value = tirx.floordiv(value, lower)
        if not analyzer.can_prove_equal(extent * lower, split.source.extent):
            value = tirx.floormod(value, extent)
        return value
    if not hasattr(source, "args"):  # not an IterSumExpr
        return None
    digits = []  # (value, scale, extent) of each digit of the fused iterator, lowest first
    for arg in source.args:
        if _is(analyzer, arg.extent, 1):
            # a split of extent 1 is always 0 (``(i * 32 + j) // 128`` with i < 4, j < 32:
            # torch.export's bmm reshapes leave one beside the real digit, of the same scale)
            continue
        value = _split_value(arg, analyzer)
        if value is None:
            return None
        digits.append((value, arg.scale, arg.extent))
    digits.sort(key=lambda d: _order_key(analyzer, d[1]))
    # the digits the split selects: from the one whose scale is lower_factor, up to the one
    # whose scale * extent is lower_factor * extent
    start = next((i for i, d in enumerate(digits) if analyzer.can_prove_equal(d[1], lower)),
                 None)
    if start is None:
        return None
    top = lower * extent
    total, expected = 0, lower
    for value, scale, dextent in digits[start:]:
        if not analyzer.can_prove_equal(scale, expected):
            return None
        total = total + value * tirx.floordiv(scale, lower)
        expected = scale * dextent
        if analyzer.can_prove_equal(expected, top):
            return total
    return None


def _order_key(analyzer, scale):
    """Scales sort by size at the representative sizes; symbolic ones compare through the
    analyzer's bounds (a digit's scale is the product of the extents below it)."""
    bound = analyzer.const_int_bound(scale)
    return (int(bound.min_value), str(scale))


def _is(analyzer, expr, number: int) -> bool:
    return analyzer.can_prove_equal(expr, tvm.tirx.IntImm(expr.ty if hasattr(expr, "ty")
                                                          else "int64", number))

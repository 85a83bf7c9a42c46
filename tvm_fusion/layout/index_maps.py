"""Index comprehension (SmartMem §3.2.1): read a data-movement operator's index map from its
TIR, compose chains of them, simplify with TVM's arithmetic analyzer, and find which dimension
of a tensor a consumer's loop walks.

A *load map* says, for every output element of a pure copy, which element of its one source it
copies: ``out[v] = src[g(v)]``. Reshape, transpose, squeeze, expand_dims, strided slice,
broadcast and gather with a constant index are all load maps once the constant is substituted.
Composing ``g1 ∘ g2`` is substitution; what makes the result usable is simplification with the
iterators' ranges bound: the paper's strength reduction (``i % 12 % 4 → i % 4``) and the
identity/split/merge classification are both inside ``tvm.sym.Analyzer`` and
``tvm.sym.detect_iter_map``; without the ranges a Swin window partition stays a tower of
linearise/de-linearise terms that no schedule can vectorise.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir, sym, tirx

from ..tir_utils import (
    buffer_loads,
    buffer_stores,
    const_int,
    find_all,
    iter_sblocks,
    shape_numel,
)

_ITER_SPATIAL = 0
_ITER_REDUCE = 2


class Unsupported(ValueError):
    """An expression or function outside what the index analysis understands."""


@dataclass(frozen=True)
class LoadMap:
    """``out[vars] = src[indices(vars)]``: one pure copy from input ``src`` (a position among
    the operator's inputs). ``vars`` range over ``out_shape``."""

    src: int
    vars: tuple[tirx.Var, ...]
    indices: tuple  # PrimExprs over ``vars``, one per source dimension
    out_shape: tuple[int, ...]
    in_shape: tuple[int, ...]
    dtype: str

    def ranges(self) -> dict:
        return {v: tvm.ir.Range(tirx.const(0, _dtype(v)), tirx.const(n, _dtype(v)))
                for v, n in zip(self.vars, self.out_shape)}

    def apply(self, values) -> list:
        """``indices`` with ``vars`` replaced by ``values`` (index composition)."""
        return list(tirx.IndexMap(list(self.vars), list(self.indices), None).map_indices(
            list(values)))

    def then(self, outer: LoadMap) -> LoadMap:
        """This map followed by ``outer`` (which copies from this map's output): the composed
        map from ``outer``'s output straight into this map's source, simplified."""
        composed = simplify(self.apply(outer.indices), outer.ranges())
        return LoadMap(self.src, outer.vars, tuple(composed), outer.out_shape, self.in_shape,
                       outer.dtype)

    def is_bijection(self) -> bool:
        """Every source element is copied exactly once: only then can the producer write this
        view instead of its own layout (Table 5's *eliminate 2nd*). A slice or a gather drops
        elements and a broadcast repeats them; written by the producer's loop, every dropped
        element would still be stored somewhere (the last write wins)."""
        size = shape_numel(self.out_shape)
        if size is None or size != shape_numel(self.in_shape):
            return False
        result = sym.detect_iter_map(list(self.indices), self.ranges(),
                                     check_level="bijective")
        return len(result.indices) == len(self.indices)

    def is_identity(self) -> bool:
        if self.out_shape != self.in_shape:
            return False
        return all(isinstance(ix, tirx.Var) and ix.same_as(v)
                   for ix, v in zip(self.indices, self.vars))

    def describe(self) -> str:
        names = ", ".join(v.name for v in self.vars)
        body = ", ".join(str(ix) for ix in self.indices)
        return f"({names}) -> ({body})"


def _dtype(var: tirx.Var) -> str:
    """A scalar Var's dtype (0.27: ``Var.dtype`` is only for buffer-typed Vars)."""
    return str(var.ty)


def simplify(indices, ranges: dict) -> list:
    """``Analyzer.simplify`` of each index with every iterator's range bound."""
    analyzer = sym.Analyzer()
    for var, rng in ranges.items():
        analyzer.bind(var, rng)
    return [analyzer.simplify(ix) for ix in indices]


# ------------------------------------------------------------------------- reading the TIR


def pure_copy_value(value) -> bool:
    """True when a stored value moves data without computing: a load, a constant, or a
    conditional choice among those (pad, concat)."""
    if isinstance(value, tvm.ir.expr.TensorLoad | tirx.IntImm | tirx.FloatImm):
        return True
    if isinstance(value, tirx.Select):
        return pure_copy_value(value.true_value) and pure_copy_value(value.false_value)
    if isinstance(value, tvm.ir.expr.Call) and value.op.name.endswith("if_then_else"):
        return pure_copy_value(value.args[1]) and pure_copy_value(value.args[2])
    return False


def is_pure_copy(func: tirx.PrimFunc) -> bool:
    """Every block stores a pure copy (:func:`pure_copy_value`); such a function only moves
    data, whatever its index maps are."""
    blocks = list(iter_sblocks(func))
    if not blocks:
        return False
    for block in blocks:
        stores = buffer_stores(block.body)
        if not stores or block.init is not None:
            return False
        if not all(pure_copy_value(s.value) for s in stores):
            return False
    return True


def extract_load_map(func: tirx.PrimFunc, scalar_args: dict[int, int] | None = None) -> LoadMap:
    """The load map of a single-block pure copy.

    ``scalar_args`` maps input positions of 0-d integer arguments bound to constants at the call
    site (a Gather's index) to their values; loads of them are replaced by the value, which turns
    a gather into an affine map. Raises :class:`Unsupported` for anything else (several blocks,
    several sources, conditional copies).
    """
    params = list(func.params)
    blocks = list(iter_sblocks(func))
    if len(blocks) != 1:
        raise Unsupported(f"{len(blocks)} blocks")
    block = blocks[0]
    if any(int(iv.iter_type) != _ITER_SPATIAL for iv in block.iter_vars):
        raise Unsupported("non-spatial iterator")
    stores = buffer_stores(block.body)
    if len(stores) != 1 or not isinstance(stores[0].value, tvm.ir.expr.TensorLoad):
        raise Unsupported("not a single load-and-store")
    store, load = stores[0], stores[0].value
    out_param = params[-1]
    if store.buffer.name != out_param.name:
        raise Unsupported("does not write its output parameter")
    block_vars = [iv.var for iv in block.iter_vars]
    if len(store.indices) != len(block_vars) or not all(
            isinstance(ix, tirx.Var) and ix.same_as(v) for ix, v in zip(store.indices, block_vars)):
        raise Unsupported("output not written in iteration order")
    names = [p.name for p in params[:-1]]
    if load.source.name not in names:
        raise Unsupported("reads an intermediate")
    src = names.index(load.source.name)
    scalars = {names[i]: v for i, v in (scalar_args or {}).items() if i < len(names)}
    indices = [_substitute_scalar_loads(ix, scalars) for ix in load.indices]
    if any(buffer_loads(ix) for ix in indices):
        raise Unsupported("data-dependent index")
    out_shape = tuple(_static(d) for d in out_param.shape)
    in_shape = tuple(_static(d) for d in params[src].shape)
    # Fresh variables, so that maps of different functions never share a Var.
    fresh = tuple(tirx.Var(f"i{k}", _dtype(v)) for k, v in enumerate(block_vars))
    renamed = tirx.IndexMap(block_vars, indices, None).map_indices(list(fresh))
    ranges = {v: tvm.ir.Range(tirx.const(0, _dtype(v)), tirx.const(n, _dtype(v)))
              for v, n in zip(fresh, out_shape)}
    return LoadMap(src, fresh, tuple(simplify(renamed, ranges)), out_shape, in_shape,
                   str(out_param.dtype))


def _static(dim) -> int:
    value = const_int(dim)
    if value is None:
        raise Unsupported(f"symbolic dimension {dim}")
    return value


_BINARY = ("Add", "Sub", "Mul", "FloorDiv", "FloorMod", "Div", "Mod", "Min", "Max",
           "EQ", "NE", "LT", "LE", "GT", "GE", "And", "Or")


def _substitute_scalar_loads(expr, scalars: dict[str, int]):
    """``expr`` with loads of 0-d buffers named in ``scalars`` replaced by their values.

    0.27 has no Python expression mutator; index expressions use few node types, so they are
    rebuilt here and anything else raises :class:`Unsupported`."""
    if isinstance(expr, tirx.Var | tirx.IntImm | tirx.FloatImm):
        return expr
    if isinstance(expr, tvm.ir.expr.TensorLoad):
        if len(expr.indices) == 0 and expr.source.name in scalars:
            return tirx.const(scalars[expr.source.name], str(expr.ty))
        return expr  # left in place: the caller rejects data-dependent indices
    kind = type(expr).__name__
    if kind in _BINARY:
        return type(expr)(_substitute_scalar_loads(expr.a, scalars),
                          _substitute_scalar_loads(expr.b, scalars))
    if kind == "Not":
        return tirx.Not(_substitute_scalar_loads(expr.a, scalars))
    if kind == "Cast":
        return tirx.Cast(str(expr.ty), _substitute_scalar_loads(expr.value, scalars))
    if kind == "Select":
        return tirx.Select(*(_substitute_scalar_loads(e, scalars)
                             for e in (expr.condition, expr.true_value, expr.false_value)))
    if isinstance(expr, tvm.ir.expr.Call) and expr.op.name.endswith("if_then_else"):
        return tirx.if_then_else(*(_substitute_scalar_loads(a, scalars) for a in expr.args))
    raise Unsupported(f"index expression of kind {kind}")


# ----------------------------------------------------------------- how a consumer walks data


@dataclass(frozen=True)
class Access:
    """One read of an input by one block: the block's iterators (spatial first as the block
    declares them) and the read's indices over them."""

    block: str
    spatial: tuple[tirx.Var, ...]
    reduce: tuple[tirx.Var, ...]
    extents: dict
    indices: tuple

    def ranges(self) -> dict:
        return {v: tvm.ir.Range(tirx.const(0, _dtype(v)), tirx.const(self.extents[v], _dtype(v)))
                for v in (*self.spatial, *self.reduce)}


def input_accesses(func: tirx.PrimFunc, position: int, inline: bool = True) -> list[Access]:
    """Every read of input ``position`` of ``func``, block by block.

    With ``inline`` the function's spatial intermediates (a convolution's padding, an
    elementwise prologue) are first inlined into their readers, so that the read seen is the
    one the reduction does, not the copy in between."""
    if inline:
        func = inline_spatial(func)
    params = list(func.params)
    name = params[position].name
    found = []
    for block in iter_sblocks(func):
        spatial = tuple(iv.var for iv in block.iter_vars if int(iv.iter_type) == _ITER_SPATIAL)
        reduce = tuple(iv.var for iv in block.iter_vars if int(iv.iter_type) == _ITER_REDUCE)
        extents = {iv.var: const_int(iv.dom.extent) or 1 for iv in block.iter_vars}
        seen = []
        for load in buffer_loads(block.body):
            if load.source.name != name:
                continue
            key = str(list(load.indices))
            if key in seen:
                continue
            seen.append(key)
            found.append(Access(block.name_hint, spatial, reduce, extents, tuple(load.indices)))
    return found


def inline_spatial(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every spatial block that writes an intermediate inlined where possible."""
    sch = s_tir.Schedule(func.with_attr("global_symbol", "main"))
    inline_spatial_blocks(sch)
    return sch.mod["main"]


def inline_spatial_blocks(sch) -> None:
    """Inline, to a fixed point, every spatial block of ``sch`` that writes an intermediate."""
    params = {p.name for p in sch.mod["main"].params}
    changed = True
    while changed:
        changed = False
        for block in list(iter_sblocks(sch.mod["main"])):
            if any(int(iv.iter_type) == _ITER_REDUCE for iv in block.iter_vars):
                continue
            if {w.source.name for w in block.writes} & params:
                continue
            try:
                sch.compute_inline(sch.get_sblock(block.name_hint))
                changed = True
            except Exception:  # noqa: BLE001 (TVM raises ScheduleError subclasses)
                continue


def walked_var(access: Access, policy: str) -> tirx.Var | None:
    """The iterator along which a consumer's innermost loop walks this input.

    ``"reduction"`` is the paper's rule: the innermost reduction iterator the read depends on
    (a dot product walks its reduction dimension). ``"vector"`` is what a CPU schedule that
    vectorises along the output's innermost axis walks: that axis when the read depends on it,
    else the innermost reduction iterator.
    """
    used = {v.name for ix in access.indices for v in _vars_of(ix)}
    reduce = [v for v in access.reduce if v.name in used and access.extents[v] > 1]
    if policy == "vector":
        live = [v for v in access.spatial if access.extents[v] > 1]
        if live and live[-1].name in used:
            return live[-1]
    elif policy != "reduction":
        raise ValueError(f"unknown preference policy {policy!r}; expected reduction or vector")
    return reduce[-1] if reduce else None


def _vars_of(expr) -> list[tirx.Var]:
    return [v for v in find_all(expr, tirx.Var)]


@dataclass(frozen=True)
class Term:
    """One piece of an iterator inside one tensor dimension: ``(var // lower) % extent``
    contributes ``scale`` per step to dimension ``dim``."""

    dim: int
    var: str
    lower: int
    extent: int
    scale: int


def iter_terms(indices, ranges: dict) -> list[Term] | None:
    """Split every index into its iterator pieces with ``detect_iter_map`` (identity, split
    and merge, the paper's three index dependencies). None when the map is not affine."""
    used = {v.name for ix in indices for v in _vars_of(ix)}
    live = {v: r for v, r in ranges.items() if v.name in used}
    result = sym.detect_iter_map(list(indices), live, check_level="surjective")
    if len(result.indices) != len(indices):
        return None
    terms: list[Term] = []
    for dim, expr in enumerate(result.indices):
        for split in expr.args:
            terms.extend(_split_terms(dim, split, 1, 1))
    return terms


def _split_terms(dim: int, split, outer_lower: int, outer_scale: int) -> list[Term]:
    source = split.source.source
    lower = int(split.lower_factor) * outer_lower
    scale = int(split.scale) * outer_scale
    if isinstance(source, tirx.Var):
        return [Term(dim, source.name, lower, int(split.extent), scale)]
    found = []
    for inner in source.args:  # a fused mark: pieces of several iterators
        if int(split.lower_factor) == 1:
            found.extend(_split_terms(dim, inner, outer_lower, scale))
        else:  # a split of a fused iterator: keep the pieces, their stride is mixed
            found.extend(Term(dim, t.var, t.lower, t.extent, 0)
                         for t in _split_terms(dim, inner, outer_lower, 1))
    return found


def contiguous_along(indices, shape, ranges: dict, var: tirx.Var) -> bool:
    """Does stepping ``var`` by one step through memory by one element, in a row-major tensor of
    ``shape`` read at ``indices``? That is the paper's "reduction dimension stored
    continuously", decided on the refined (split) dimensions rather than whole ones."""
    terms = iter_terms(indices, ranges)
    if terms is None:
        return False
    live_dims = [d for d, n in enumerate(shape) if n > 1]
    if not live_dims:
        return False
    inner = live_dims[-1]
    return any(t.var == var.name and t.lower == 1 and t.scale == 1 and t.dim == inner
               for t in terms)


def refined_dims(indices, ranges: dict, var: tirx.Var) -> list[tuple[int, int, int]]:
    """Where ``var`` lands in the tensor: ``(dim, lower, extent)`` per piece. A reduction over a
    merged dimension lands in several (``c = h·32 + d`` reads heads ``h`` and the inner ``d``):
    these are the paper's refined reduction dimensions (Fig. 4's D0 → D2, D3)."""
    terms = iter_terms(indices, ranges) or []
    return sorted({(t.dim, t.lower, t.extent) for t in terms if t.var == var.name})

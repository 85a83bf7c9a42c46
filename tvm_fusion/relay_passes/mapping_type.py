"""DNNFusion mapping types (PLDI'21 §3.1, Table 2), derived from each PrimFunc's TIR.

An operator is classified by how its output elements map to its input elements, read off the
legalized TIR rather than looked up by op name, so that operators we have never seen are
classified too:

* a block with a reduction iterator, or that reads several elements of one input per output
  (a stencil, a scan over its own output), is **Many-to-Many**;
* a spatial block whose read indices are the write indices up to offsets and strides is
  **One-to-One** (elementwise, Slice, Concat, Split, Pad, Where);
* the same indices in another order is **Shuffle** (Transpose);
* a bijective index map that mixes iterators (div/mod of a linearised index) is **Reorganize**
  (Reshape, Flatten, Squeeze);
* an index map that drops an iterator (broadcast), depends on data (Gather) or is not affine
  (Resize) replicates input elements: **One-to-Many**;
* code that calls out of TIR, or that the analysis cannot read, is **Opaque** and never fused.

Elementwise with broadcast is where the paper is ambiguous (``docs/design.md``): Table 2 calls
it One-to-Many, yet calls BatchNormalization and PRelu, whose parameters are broadcast,
One-to-One, and its own TinyBERT example fuses ``Sub(x, mean)`` into a reduction, which Table 3
forbids for One-to-Many. ``broadcast_policy="expanding_only"`` (default) makes an elementwise
op One-to-Many only when no non-constant, non-scalar input already spans the output, i.e. a
true expansion such as ``a[m,1] + b[1,n]``; ``"strict"`` is the paper's literal reading.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import tvm
from tvm import relax, sym, tirx

from ..module_update import with_functions
from ..tir_utils import (
    buffer_loads,
    buffer_stores,
    const_int,
    find_all,
    has_extern_call,
    iter_sblocks,
    shape_numel,
)

MAPPING_TYPE_ATTR = "tvm_fusion.mapping_type"
BROADCAST_POLICIES = ("expanding_only", "strict")

_ITER_SPATIAL = 0
_ITER_REDUCE = 2


class MappingType(enum.IntEnum):
    """The five DNNFusion mapping types, in the paper's order of complexity, plus Opaque.

    The integer order is footnote 1 of the paper (One-to-One < Reorganize < Shuffle <
    One-to-Many < Many-to-Many); an operator with several inputs takes the most complex one.
    """

    ONE_TO_ONE = 0
    REORGANIZE = 1
    SHUFFLE = 2
    ONE_TO_MANY = 3
    MANY_TO_MANY = 4
    OPAQUE = 5

    @property
    def short(self) -> str:
        return _SHORT[self]

    @classmethod
    def parse(cls, value: str | MappingType) -> MappingType:
        """Accept an enum member, its name, or its short form (``"O2O"``)."""
        if isinstance(value, MappingType):
            return value
        text = str(value).strip().upper().replace("-", "_")
        for member in cls:
            if text in (member.name, member.short.upper()):
                return member
        valid = ", ".join(m.name for m in cls)
        raise ValueError(f"unknown mapping type {value!r}; expected one of {valid}")


_SHORT = {
    MappingType.ONE_TO_ONE: "O2O",
    MappingType.REORGANIZE: "Reorg",
    MappingType.SHUFFLE: "Shuffle",
    MappingType.ONE_TO_MANY: "O2M",
    MappingType.MANY_TO_MANY: "M2M",
    MappingType.OPAQUE: "Opaque",
}


@dataclass(frozen=True)
class ReadAccess:
    """How one read of one buffer in a block maps output elements to input elements."""

    buffer: str
    param_index: int | None  # position among the PrimFunc's inputs; None for an intermediate
    kind: MappingType
    broadcast: bool  # One-to-Many only because iterators are missing (a policy may ignore it)
    numel: int | None
    reason: str


@dataclass(frozen=True)
class BlockAccess:
    """The reads of one TIR block; ``reduction`` blocks are Many-to-Many whatever they read."""

    name: str
    reduction: bool
    reads: tuple[ReadAccess, ...]
    reason: str
    scan: bool = False  # a recurrence over its own output (cumsum): M2M, and left unfused


@dataclass(frozen=True)
class FuncAccess:
    """Everything the classification needs from a PrimFunc, computed once per function."""

    blocks: tuple[BlockAccess, ...]
    num_inputs: int
    opaque_reason: str | None = None
    fusible: bool = True  # False for code FuseTIR/scheduling must not touch (scans, externs)


@dataclass(frozen=True)
class Classification:
    mapping_type: MappingType
    reason: str


def analyze_primfunc(func: tirx.PrimFunc, num_outputs: int = 1) -> FuncAccess:
    """Read the access pattern of every block of ``func``.

    ``num_outputs`` is the number of trailing parameters that are outputs (destination-passing
    style, as ``call_tir`` uses).
    """
    params = list(func.params)
    num_inputs = max(len(params) - num_outputs, 0)
    input_index = {p.name: i for i, p in enumerate(params[:num_inputs])}

    if has_extern_call(func.body):
        return FuncAccess((), num_inputs, "calls a packed/extern function", fusible=False)
    blocks = list(iter_sblocks(func))
    if not blocks:
        return FuncAccess((), num_inputs, "no schedulable TIR block", fusible=False)

    analysed = []
    for block in blocks:
        result = _analyze_block(block, input_index)
        if isinstance(result, str):
            return FuncAccess((), num_inputs, f"block {block.name_hint!r}: {result}", fusible=False)
        analysed.append(result)
    fusible = not any(b.scan for b in analysed)
    return FuncAccess(tuple(analysed), num_inputs, None, fusible)


def classify(
    access: FuncAccess,
    const_inputs: frozenset[int] | set[int] = frozenset(),
    broadcast_policy: str = "expanding_only",
) -> Classification:
    """The mapping type of an analysed PrimFunc at one call site.

    ``const_inputs`` are the input positions bound to constants (weights) at the call site; the
    ``"expanding_only"`` policy ignores broadcasts of those.
    """
    if broadcast_policy not in BROADCAST_POLICIES:
        raise ValueError(
            f"unknown broadcast_policy {broadcast_policy!r}; expected one of {BROADCAST_POLICIES}"
        )
    if access.opaque_reason is not None:
        return Classification(MappingType.OPAQUE, access.opaque_reason)
    best = Classification(MappingType.ONE_TO_ONE, "no reads")
    for block in access.blocks:
        found = _classify_block(block, const_inputs, broadcast_policy)
        if found.mapping_type > best.mapping_type or best.reason == "no reads":
            best = found
    return best


def classify_primfunc(
    func: tirx.PrimFunc,
    num_outputs: int = 1,
    const_inputs: frozenset[int] | set[int] = frozenset(),
    broadcast_policy: str = "expanding_only",
) -> Classification:
    """Analyse and classify ``func`` in one call."""
    return classify(analyze_primfunc(func, num_outputs), const_inputs, broadcast_policy)


def num_primfunc_outputs(func: tirx.PrimFunc) -> int:
    """Outputs of a legalized PrimFunc: the trailing params that some block writes and none reads
    before writing. Legalized functions write only their outputs and intermediates."""
    params = list(func.params)
    written = set()
    for block in iter_sblocks(func):
        for store in buffer_stores(block.body):
            written.add(store.buffer.name)
    count = 0
    for param in reversed(params):
        if param.name in written:
            count += 1
        else:
            break
    return max(count, 1)


# ----------------------------------------------------------------------------- block analysis


def _analyze_block(block, input_index: dict[str, int]) -> BlockAccess | str:
    iter_vars = list(block.iter_vars)
    stores = buffer_stores(block.body)
    if not stores:
        return "writes nothing"
    written = {s.buffer.name for s in stores}
    loads = buffer_loads(block.body)
    if block.init is not None:
        loads += buffer_loads(block.init)

    if not iter_vars:  # an opaque block: legal TIR, but no iteration domain to reason about
        if any(ld.source.name in written for ld in loads):
            reads = tuple(_read(ld, input_index, MappingType.MANY_TO_MANY, "scan") for ld in loads)
            return BlockAccess(block.name_hint, False, reads, "scan: reads its own output",
                               scan=True)
        return "opaque block without iteration domain"

    reduction = any(int(iv.iter_type) == _ITER_REDUCE for iv in iter_vars)
    other = [iv for iv in iter_vars if int(iv.iter_type) not in (_ITER_SPATIAL, _ITER_REDUCE)]
    if other:
        return f"iterator {other[0].var} of unsupported kind {int(other[0].iter_type)}"
    if reduction:
        reads = tuple(
            _read(ld, input_index, MappingType.MANY_TO_MANY, "read under a reduction")
            for ld in loads if ld.source.name not in written
        )
        return BlockAccess(block.name_hint, True, reads, "reduction iterator")

    extents = {iv.var.name: const_int(iv.dom.extent) for iv in iter_vars}
    ranges = {iv.var: tvm.ir.Range(iv.dom.min, iv.dom.extent) for iv in iter_vars}
    store_vars = _store_order(stores[0], iter_vars)
    # Reorganize is a re-indexing with no function applied (y = x[f(d)]): a pure copy.
    pure_copy = len(stores) == 1 and isinstance(stores[0].value, tvm.ir.expr.TensorLoad)
    out_rank = len(stores[0].indices)
    reads = []
    by_buffer: dict[str, list] = {}
    for ld in loads:
        if ld.source.name in written:
            return "reads a buffer it writes without a reduction iterator"
        by_buffer.setdefault(ld.source.name, []).append(ld)
    for group in by_buffer.values():
        distinct = _distinct_index_tuples(group)
        if len(distinct) > 1 and all(_is_affine(ix, ranges) for ix in distinct):
            reads.append(_read(group[0], input_index, MappingType.MANY_TO_MANY,
                               f"reads {len(distinct)} elements per output (stencil)"))
            continue
        for ix in distinct:
            kind, broadcast, reason = _classify_indices(ix, store_vars, extents, ranges,
                                                        group[0].source)
            if kind is MappingType.ONE_TO_ONE and pure_copy and len(ix) != out_rank:
                kind, reason = MappingType.REORGANIZE, "copy that changes the rank"
            reads.append(_read(group[0], input_index, kind, reason, broadcast))
    return BlockAccess(block.name_hint, False, tuple(reads), "spatial")


def _read(load, input_index, kind, reason, broadcast=False) -> ReadAccess:
    buf = load.source
    return ReadAccess(buf.name, input_index.get(buf.name), kind, broadcast,
                      shape_numel(buf.ty.shape), reason)


def _store_order(store, iter_vars) -> list[str]:
    """Iterator names in the order the write indexes them (normally the block order)."""
    names = [iv.var.name for iv in iter_vars]
    order = []
    for index in store.indices:
        if isinstance(index, tvm.ir.Var) and index.name in names and index.name not in order:
            order.append(index.name)
    order += [n for n in names if n not in order]
    return order


def _distinct_index_tuples(loads) -> list[list]:
    distinct: list[list] = []
    for ld in loads:
        indices = list(ld.indices)
        if not any(_same_indices(indices, other) for other in distinct):
            distinct.append(indices)
    return distinct


def _same_indices(a, b) -> bool:
    if len(a) != len(b):
        return False
    analyzer = sym.Analyzer()
    return all(analyzer.can_prove_equal(x, y) for x, y in zip(a, b))


def _is_affine(indices, ranges) -> bool:
    result = sym.detect_iter_map(indices, ranges, check_level="surjective")
    if len(result.indices) == len(indices):
        return True
    return all(_single_var_affine(ix) is not None for ix in indices)


def _single_var_affine(index) -> tuple[str | None, int] | None:
    """(var name, coefficient) when ``index`` is ``c*v + base`` with constant c and base."""
    if _has_load(index):
        return None
    variables = {v.name: v for v in find_all(index, tvm.ir.Var)}
    if not variables:
        return (None, 0)
    if len(variables) > 1:
        return None
    var = next(iter(variables.values()))
    coeffs = sym.detect_linear_equation(index, [var])
    if len(coeffs) != 2 or const_int(coeffs[0]) is None or const_int(coeffs[1]) is None:
        return None
    return (var.name, const_int(coeffs[0]))


def _has_load(expr) -> bool:
    return bool(buffer_loads(expr))


def _classify_indices(indices, store_vars, extents, ranges, buffer):
    """(kind, broadcast, reason) for one read index tuple of a spatial block."""
    if any(_has_load(ix) for ix in indices):
        return MappingType.ONE_TO_MANY, False, "data-dependent index (gather)"
    live = [v for v in store_vars if extents.get(v) != 1]
    simple = [_single_var_affine(ix) for ix in indices]
    if all(s is not None for s in simple):
        used = [s[0] for s in simple if s[0] is not None and extents.get(s[0]) != 1]
        if len(used) == len(set(used)):
            missing = [v for v in live if v not in used]
            if missing:
                return MappingType.ONE_TO_MANY, True, f"broadcast along {', '.join(missing)}"
            if used == [v for v in live if v in used]:
                return MappingType.ONE_TO_ONE, False, "same indices (offset/stride allowed)"
            return MappingType.SHUFFLE, False, "permuted indices"
    result = sym.detect_iter_map(indices, ranges, check_level="bijective")
    if len(result.indices) == len(indices):
        return MappingType.REORGANIZE, False, "bijective re-indexing (reshape)"
    out_numel = 1
    for v in live:
        out_numel *= extents[v] or 1
    in_numel = shape_numel(buffer.ty.shape)
    affine = len(sym.detect_iter_map(indices, ranges, check_level="surjective").indices) == len(
        indices
    )
    if affine and in_numel is not None and in_numel >= out_numel:
        return MappingType.REORGANIZE, False, "injective affine re-indexing"
    return MappingType.ONE_TO_MANY, False, "irregular (non-affine) index map"


def _classify_block(block: BlockAccess, const_inputs, policy: str) -> Classification:
    if block.reduction:
        return Classification(MappingType.MANY_TO_MANY, f"{block.name}: reduction")
    if block.scan:
        return Classification(MappingType.MANY_TO_MANY, f"{block.name}: {block.reason}")
    reads = list(block.reads)
    if policy == "expanding_only":
        live = [r for r in reads if r.param_index not in const_inputs and (r.numel or 2) > 1]
        if any(not r.broadcast and r.kind <= MappingType.SHUFFLE for r in live):
            reads = [r for r in live if not r.broadcast]
        elif live:
            reads = live
    best = None
    for r in reads:
        if best is None or r.kind > best.kind:
            best = r
    if best is None:
        return Classification(MappingType.ONE_TO_ONE, f"{block.name}: reads only constants")
    return Classification(best.kind, f"{block.name}: {best.buffer} {best.reason}")


# ------------------------------------------------------------------------------ the pass


@tvm.transform.module_pass(opt_level=0, name="AnnotateMappingType")
class AnnotateMappingType:
    """Record ``tvm_fusion.mapping_type`` (the enum's name) and its reason on every PrimFunc.

    This is the call-site-free classification (no input treated as constant); the ECG refines
    it per call, where it knows which arguments are weights.
    """

    def __init__(self, broadcast_policy: str = "expanding_only"):
        if broadcast_policy not in BROADCAST_POLICIES:
            raise ValueError(
                f"unknown broadcast_policy {broadcast_policy!r}; "
                f"expected one of {BROADCAST_POLICIES}"
            )
        self.broadcast_policy = broadcast_policy

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            found = classify_primfunc(func, num_primfunc_outputs(func),
                                      broadcast_policy=self.broadcast_policy)
            updates[gvar] = func.with_attrs(
                {MAPPING_TYPE_ATTR: found.mapping_type.name, "tvm_fusion.mapping_reason":
                 found.reason}
            )
        return with_functions(mod, updates)


def relax_mapping_type(call: relax.Call) -> Classification:
    """Mapping type of a Relax call that is not a ``call_tir`` (left for the VM or a library)."""
    name = call.op.name if isinstance(call.op, tvm.ir.Op) else str(call.op)
    return Classification(MappingType.OPAQUE, f"not lowered to TIR ({name})")

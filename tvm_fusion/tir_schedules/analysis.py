"""What the schedule rules need to know about one block of a fused PrimFunc.

Rules are chosen from the TIR itself, never from operator names, so that blocks FuseTIR built
from operators nobody listed are scheduled too. The facts here are cheap (one walk of the block)
and read from a live :class:`tvm.s_tir.Schedule`, so they stay right while the schedule changes
the function (inlining rewrites a consumer's body; facts are recomputed after each step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import s_tir, sym, tirx

from .. import symbolic
from ..tir_utils import buffer_loads, const_int, find_all
from .fast_math import APPROXIMATED
from .rounding import is_fence

_ITER_SPATIAL = 0
_ITER_REDUCE = 2

# Relative cost of one evaluation of an operation on values (index arithmetic is free: it is
# what inlining turns data movement into). Transcendentals are what make recomputation dear.
_CALL_COST = {"exp": 8, "exp2": 8, "exp10": 8, "erf": 8, "tanh": 8, "sigmoid": 8, "log": 8,
              "log2": 8, "log10": 8, "log1p": 8, "pow": 12, "sin": 8, "cos": 8, "tan": 8,
              "asin": 8, "acos": 8, "atan": 8, "atan2": 10, "sinh": 8, "cosh": 8, "asinh": 8,
              "acosh": 8, "atanh": 8, "sqrt": 4, "rsqrt": 4, "fabs": 1, "floor": 1, "ceil": 1,
              "round": 1, "nearbyint": 1, "trunc": 1, "fmod": 4, "if_then_else": 1}
_BINARY_COST = {tirx.Add: 1, tirx.Sub: 1, tirx.Mul: 1, tirx.Min: 1, tirx.Max: 1,
                tirx.Div: 4, tirx.FloorDiv: 4, tirx.FloorMod: 4, tirx.Mod: 4,
                tirx.EQ: 1, tirx.NE: 1, tirx.LT: 1, tirx.LE: 1, tirx.GT: 1, tirx.GE: 1,
                tirx.And: 1, tirx.Or: 1, tirx.Not: 1, tirx.Select: 1}


# What a schedule primitive raises when it cannot apply: its own ScheduleError, or, from checks
# deeper in TVM 0.27, an InternalError (compute_at without a bound for the region, the inliner on
# a fenced quantize, rfactor of a 0-d sum: fuzzer seeds 2, 683, 1222).
PRIMITIVE_ERRORS = (s_tir.ScheduleError, tvm.error.InternalError)

@dataclass
class Read:
    """One read of a buffer inside a block: its buffer name and index expressions."""

    buffer: str
    indices: list


@dataclass
class BlockFacts:
    """The access pattern and arithmetic of one block, as the rules need them."""

    name: str
    spatial: list  # iter Vars, in block order
    reduce: list
    extents: dict  # iter var name -> int extent (a symbolic one at its representative size)
    write: str  # the buffer written (blocks here write one buffer)
    write_indices: list
    reads: list[Read] = field(default_factory=list)
    cost: int = 0  # value arithmetic per output element (loads and index math are free)
    padding: bool = False  # the value is a bounds-checked select of a load (pad)
    nested: int = 0  # fast-math approximable calls nested in the value, at most (exp(tanh(x)): 2)
    symbolic_iters: frozenset = frozenset()  # iter var names whose extent is symbolic (seq, batch)
    dtype: str = "float32"  # of the value stored: what the block computes in (its lanes)

    @property
    def is_reduction(self) -> bool:
        return bool(self.reduce)

    def reads_of(self, buffer: str) -> list[Read]:
        return [r for r in self.reads if r.buffer == buffer]

    def volume(self) -> int:
        total = 1
        for var in self.spatial + self.reduce:
            total *= self.extents.get(var.name) or 1
        return total

    def spatial_volume(self) -> int:
        total = 1
        for var in self.spatial:
            total *= self.extents.get(var.name) or 1
        return total


def block_facts(sch: s_tir.Schedule, block_rv) -> BlockFacts | None:
    """Facts of a block, or None for a block the rules do not understand (opaque, several
    writes, iterators of other kinds). A symbolic extent (an ONNX ``seq``) is recorded at its
    representative size (:mod:`tvm_fusion.symbolic`) and named in ``symbolic_iters``: a rule may
    split it (TVM guards the remainder) but must not assume a tile divides it."""
    block = sch.get(block_rv)
    if len(block.writes) != 1 or not block.iter_vars:
        return None
    spatial, reduce, extents, dynamic = [], [], {}, set()
    for iv in block.iter_vars:
        kind = int(iv.iter_type)
        if kind == _ITER_SPATIAL:
            spatial.append(iv.var)
        elif kind == _ITER_REDUCE:
            reduce.append(iv.var)
        else:
            return None
        if const_int(iv.dom.min) != 0:
            return None
        extent = const_int(iv.dom.extent)
        if extent is None:
            extent = symbolic.extent(iv.dom.extent)
            dynamic.add(iv.var.name)
        extents[iv.var.name] = extent
    body = block.body
    if not isinstance(body, tirx.BufferStore):
        return None
    write = block.writes[0].source.name
    reads = [Read(ld.source.name, list(ld.indices)) for ld in buffer_loads(body.value)
             if not (reduce and ld.source.name == write)]
    value = body.value
    return BlockFacts(
        name=block.name_hint, spatial=spatial, reduce=reduce, extents=extents, write=write,
        write_indices=list(body.indices), reads=reads, cost=expr_cost(value),
        padding=_is_padding(value), nested=nested_calls(value, APPROXIMATED),
        symbolic_iters=frozenset(dynamic), dtype=str(body.value.ty.dtype),
    )


def nested_calls(expr, names: frozenset) -> int:
    """The most calls to ``names`` on one path from the root of ``expr`` to a leaf."""
    memo: dict = {}

    def depth(node) -> int:
        key = node.__chandle__()  # shared sub-expressions are visited once
        if key not in memo:
            own = int(isinstance(node, tvm.ir.Call) and isinstance(node.op, tvm.ir.Op)
                      and node.op.name in names)
            memo[key] = own + max((depth(c) for c in _operands(node)), default=0)
        return memo[key]

    return depth(expr)


def _operands(node) -> list:
    """The value sub-expressions of ``node`` (a load's indices are address arithmetic)."""
    if isinstance(node, tvm.ir.expr.TensorLoad):
        return []
    found = [getattr(node, a, None) for a in
             ("a", "b", "value", "body", "condition", "true_value", "false_value")]
    found = [c for c in found if c is not None and not isinstance(c, (int, float, str))]
    if isinstance(node, tvm.ir.Call):
        found.extend(node.args)
    return found


def expr_cost(expr) -> int:
    """Arithmetic on values in ``expr``; loads (and the index math inside them) cost nothing."""
    total = 0
    stack = [expr]
    while stack:
        node = stack.pop()
        cost = _BINARY_COST.get(type(node))
        if cost is not None:
            total += cost
        elif isinstance(node, tvm.ir.Call) and not is_fence(node):  # a fence costs nothing
            name = node.op.name.rsplit(".", 1)[-1] if isinstance(node.op, tvm.ir.Op) else ""
            total += _CALL_COST.get(name, 2)
        stack.extend(_operands(node))
    return total


def _is_padding(value) -> bool:
    """``if_then_else(in_bounds, x[...], pad_value)``: what pad legalizes to."""
    if isinstance(value, tvm.ir.Call) and isinstance(value.op, tvm.ir.Op):
        if value.op.name.endswith("if_then_else"):
            return bool(buffer_loads(value.args[1]))
    if isinstance(value, tirx.Select):
        return bool(buffer_loads(value.true_value))
    return False


def uses_var(expr, var) -> bool:
    """True when ``expr`` mentions ``var`` (by identity, then by name)."""
    for found in find_all(expr, tvm.ir.Var):
        if found.same_as(var) or found.name == var.name:
            return True
    return False


def uses_any(expr, variables) -> bool:
    """True when ``expr`` mentions one of ``variables`` (by identity only)."""
    variables = tuple(variables) if isinstance(variables, (list, tuple)) else (variables,)
    return any(any(found.same_as(v) for v in variables) for found in find_all(expr, tvm.ir.Var))


def index_uses(indices, var) -> bool:
    return any(uses_var(ix, var) for ix in indices)


def is_bijective_read(facts: BlockFacts, indices, shape) -> bool:
    """Whether the block's iterators map one-to-one onto every element of a buffer of
    ``shape`` through ``indices``: only then can the block be stored from where that buffer is
    produced (``reverse_compute_inline``). A slice or a gather reads part of it, and TVM 0.27
    inlines such a consumer anyway, storing every produced element to the selected place (the
    last write wins)."""
    if facts.volume() != numel(shape) or numel(shape) == 0:
        return False
    ranges = {v: tvm.ir.Range.from_min_extent(0, facts.extents[v.name])
              for v in facts.spatial + facts.reduce if facts.extents.get(v.name)}
    if len(ranges) != len(facts.spatial) + len(facts.reduce):
        return False  # a symbolic extent: not provable here
    result = sym.detect_iter_map(list(indices), ranges, check_level="bijective")
    return len(result.indices) == len(indices)


def stride_in_last_dim(indices, var) -> int | None:
    """The coefficient of ``var`` in the last index when ``var`` appears nowhere else, else
    None: 1 means contiguous lanes, 2 a stride-2 (strided) load."""
    if not indices or any(uses_var(ix, var) for ix in indices[:-1]):
        return None
    last = indices[-1]
    if not uses_var(last, var):
        return 0
    coeffs = sym.detect_linear_equation(last, [var])
    if len(coeffs) != 2:
        return None
    return const_int(coeffs[0])


def numel(shape) -> int:
    """Elements of a buffer shape; symbolic extents at their representative size, so that
    sizes compare with :meth:`BlockFacts.volume`."""
    return symbolic.numel(shape) or 0


def root_block(sch: s_tir.Schedule):
    """The implicit root block of the schedule's only function."""
    func = sch.mod[sch.func_working_on] if sch.func_working_on is not None else None
    if func is None:
        func = next(iter(sch.mod.functions.values()))
    return sch.get_sblock(func.body.block.name_hint)


def main_func(sch: s_tir.Schedule) -> tirx.PrimFunc:
    return next(f for f in sch.mod.functions.values() if isinstance(f, tirx.PrimFunc))


def param_names(sch: s_tir.Schedule) -> set[str]:
    return {p.name for p in main_func(sch).params}


def written_only_before(sch: s_tir.Schedule, block_rv) -> set[str]:
    """Buffers the top-level stages before ``block_rv`` write and none after it writes."""
    before, after, seen = set(), set(), False
    anchor = sch.get(block_rv)
    for child in sch.get_child_blocks(root_block(sch)):
        block = sch.get(child)
        if block.same_as(anchor):
            seen = True
            continue
        (after if seen else before).update(w.source.name for w in block.writes)
    return before - after


def alloc_buffers(sch: s_tir.Schedule) -> dict:
    """Intermediate buffers allocated in the root block, by name."""
    return {b.name: b for b in main_func(sch).body.block.alloc_buffers}

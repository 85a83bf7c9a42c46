"""Small TIR helpers that TVM 0.27 no longer exposes to Python.

`tirx.stmt_functor.post_order_visit` is gone from the 0.27 Python API, so we walk TIR objects
through tvm-ffi reflection: every node type lists its fields, which is enough for a generic,
read-only traversal. Buffers, vars and spans are leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import SBlock, analysis

_LEAF_KEYS = frozenset({"ir.Var", "ir.GlobalVar", "ir.Span", "ir.SourceName", "ir.Op"})
# Type annotations carry shapes, not accesses: never descend into them.
_SKIP_FIELDS = frozenset({"span", "ty"})
_FIELDS_CACHE: dict[type, tuple[str, ...]] = {}


def _fields(obj) -> tuple[str, ...]:
    cls = type(obj)
    names = _FIELDS_CACHE.get(cls)
    if names is None:
        collected: list[str] = []
        info = getattr(cls, "__tvm_ffi_type_info__", None)
        while info is not None:
            collected.extend(f.name for f in info.fields if f.name not in _SKIP_FIELDS)
            info = info.parent_type_info
        names = tuple(collected)
        _FIELDS_CACHE[cls] = names
    return names


def _is_leaf(obj) -> bool:
    info = getattr(type(obj), "__tvm_ffi_type_info__", None)
    return info is None or info.type_key in _LEAF_KEYS


def walk(node, visit: Callable[[object], bool | None]) -> None:
    """Pre-order walk over a TIR statement or expression.

    ``visit(obj)`` returning False prunes the sub-tree below ``obj``.
    """
    stack = [node]
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, (int, float, str, bool)):
            continue
        if isinstance(obj, (list, tuple)) or type(obj).__name__ == "Array":
            stack.extend(reversed(list(obj)))
            continue
        if type(obj).__name__ == "Map":
            stack.extend(list(obj.values()))
            continue
        if visit(obj) is False or _is_leaf(obj):
            continue
        for name in reversed(_fields(obj)):
            try:
                stack.append(getattr(obj, name))
            except Exception:  # a field without a Python getter: nothing to visit
                continue


def find_all(node, cls) -> list:
    """All sub-objects of ``node`` that are instances of ``cls``, in pre-order."""
    found: list = []
    walk(node, lambda obj: found.append(obj) if isinstance(obj, cls) else None)
    return found


def iter_sblocks(func: tirx.PrimFunc) -> Iterator[SBlock]:
    """The schedulable blocks of a PrimFunc, excluding the implicit root block."""
    for block in find_all(func.body, SBlock):
        if block.name_hint != "root":
            yield block


def has_extern_call(node) -> bool:
    """True when the code calls out of TIR (packed/extern functions): such code is opaque."""
    opaque_ops = {"tvm_call_packed", "tvm_call_cpacked", "tvm_call_packed_lowered",
                  "tvm_call_cpacked_lowered", "call_extern", "call_pure_extern"}
    for call in find_all(node, tvm.ir.Call):
        op = call.op
        if isinstance(op, tvm.ir.Op) and op.name.rsplit(".", 1)[-1] in opaque_ops:
            return True
    return False


def substitute(expr, mapping: dict):
    """``expr`` with the variables of ``mapping`` (keys: the ``Var`` objects) replaced."""
    if not mapping:
        return expr
    handles = {var.__chandle__(): value for var, value in mapping.items()}
    return tvm_ffi.structural_map(
        expr, [(tvm.ir.Var, lambda var: handles.get(var.__chandle__(), var))])


def stmt_children(stmt, else_case: bool = False) -> list:
    """The statements directly under ``stmt`` that the walkers of executed work descend into:
    a sequence's items, the body of a loop, block, let, attribute or allocation, a block
    realize's block, an ``if``'s then-branch (and its else-branch with ``else_case``). A
    block's init is left out (it runs once per output: far less than its body)."""
    if stmt is None:
        return []
    if isinstance(stmt, tirx.SeqStmt):
        return list(stmt.seq)
    if isinstance(stmt, tirx.IfThenElse):
        return [s for s in (stmt.then_case, stmt.else_case if else_case else None)
                if s is not None]
    if isinstance(stmt, s_tir.SBlockRealize):
        return [stmt.block]
    body = getattr(stmt, "body", None)
    return [body] if isinstance(body, tirx.Stmt) else []


def buffer_loads(node) -> list:
    """Every buffer load (``ir.TensorLoad`` in 0.27; its buffer is ``.source``) under ``node``."""
    return find_all(node, tvm.ir.expr.TensorLoad)


def buffer_stores(node) -> list:
    """Every ``BufferStore`` under ``node``."""
    return find_all(node, tirx.stmt.BufferStore)


def const_int(expr) -> int | None:
    """The value of an integer constant expression, else None."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    return None


def is_reduction_block(block) -> bool:
    """Whether an ``SBlock`` has a reduction iterator."""
    return any(int(iv.iter_type) == 2 for iv in block.iter_vars)


def shape_numel(shape) -> int | None:
    """Number of elements of a static shape, None when a dimension is symbolic or the shape
    is unknown (a data-dependent result: NonZero's)."""
    if shape is None:
        return None
    total = 1
    for dim in shape:
        value = const_int(dim)
        if value is None:
            return None
        total *= value
    return total


def with_root_body(func: tirx.PrimFunc, body: tirx.Stmt,
                   alloc_buffers: list | None = None) -> tirx.PrimFunc:
    """``func`` (one root block) with the root block's body replaced, everything else of the
    block kept (its allocations too, unless ``alloc_buffers`` is given)."""
    realize = func.body
    root = realize.block
    allocs = root.alloc_buffers if alloc_buffers is None else alloc_buffers
    block = SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body, root.init,
                   allocs, root.match_buffers, root.annotations, root.span)
    return func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, block))


def refresh_access_regions(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every block's read/write regions recomputed from its body.

    FuseTIR merges the regions of a block whose inputs became one buffer (``concat(t, t)``)
    and can keep only one of them; ``compute_at`` trusts the annotation, so a producer
    attached there would compute only the rows that one region names."""
    # TVM 0.27: a buffer is its own variable; a scalar parameter (a symbolic size) is not one
    buffers = {p: p for p in func.params if getattr(p.ty, "shape", None) is not None}
    root = getattr(func.body, "block", None)
    for block in ([root] if root is not None else []) + list(iter_sblocks(func)):
        buffers.update({b: b for b in block.alloc_buffers})

    def refresh(block: SBlock):
        if not block.iter_vars:  # the root block has no regions of its own
            return block
        reads, writes = analysis.get_sblock_read_write_region(block, buffers)
        return SBlock(block.iter_vars, reads, writes, block.name_hint, block.body, block.init,
                      block.alloc_buffers, block.match_buffers, block.annotations, block.span)

    return tvm_ffi.structural_map(func, [(SBlock, refresh)])


def compact_buffers(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """TVM's own buffer compaction (the steps of its TIR lowering that move each allocation
    under the loop it is used in and shrink it to the region used there)."""
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    for step in (s_tir.transform.LowerInitBlock(),
                 s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
                 s_tir.transform.ConvertBlocksToOpaque(),
                 s_tir.transform.CompactBufferAllocation()):
        mod = step(mod)
    return mod["main"]

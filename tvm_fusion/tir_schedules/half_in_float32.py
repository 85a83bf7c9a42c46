"""fp16 arithmetic of a fused kernel in float32, rounded once where a value is stored, on a CPU
without fp16 arithmetic.

Without fp16 arithmetic (x86 without AVX512-FP16, aarch64 without ``+fullfp16``) LLVM computes
every fp16 operation by converting its operands to float32 and rounding the result back to 16
bits: a conv's epilogue of bias and hard-swish (``(x + b) * clip(x + b + 3, 0, 6) / 6``) stored
from a float32 accumulator converts and rounds five times per element, which is most of what
an fp16 MobileNetV3's 1×1 convs spent beyond their float32 build. ONNX Runtime on such a CPU
runs an fp16 graph in float32 between the Casts it inserts, rounding where its fp16 tensors
are stored. Here, inside one fused kernel:

* :func:`evaluate_in_float32`: every stored fp16 value whose expression does fp16 arithmetic is
  computed in float32 from its fp16 loads and constants (exactly widened) and rounded once, at
  the store; a cast to fp16 of a float32 value inside the expression (the cast back after a
  conv summed in float32, ``relay_passes/accumulate.py``) no longer rounds: the float32 value
  flows on. A float32 value computed from fp16 arithmetic (``Cast(float32, a * b)``) likewise.
  The result differs from the fp16-per-operator program only in roundings skipped, each
  within half an fp16 ulp: the values the kernel stores are those of the float32 program
  rounded to fp16, ONNX Runtime's on x86.
* :func:`widen_upcast_buffers`: an fp16 buffer allocated inside the kernel that every reader
  casts to float32 (a depthwise conv's padded input, read once per tap, 25 times per element
  for a 5×5 window) is allocated in float32 and widened once where it is written.

Both are for targets without fp16 arithmetic only (``CpuParams.accumulates("float16")`` is
float32): where the vector unit computes in fp16 the kernels keep their fp16 operations.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir import SBlock

from ..tir_utils import find_all

HALF, WIDE = "float16", "float32"
_BINARY = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Min, tirx.Max)


def _base(dtype) -> str:
    return str(tvm.DataType(str(dtype)).with_lanes(1)) if dtype is not None else ""


def _with_base(dtype, base: str) -> str:
    lanes = tvm.DataType(str(dtype)).lanes
    return base if lanes == 1 else f"{base}x{lanes}"


def _is_half(expr) -> bool:
    return _base(expr.ty) == HALF


def _is_if_then_else(expr) -> bool:
    return (isinstance(expr, tvm.ir.Call) and isinstance(expr.op, tvm.ir.Op)
            and expr.op.name.rsplit(".", 1)[-1] == "if_then_else")


def _does_half_math(expr) -> bool:
    """Whether ``expr`` has an fp16 arithmetic node. One operation alone gives the same value
    either way (float32's 24 bits are at least 2·11 + 2: an fp16 sum, product or quotient
    computed in float32 and rounded once is the correctly rounded fp16 one); a chain of them
    rounds once instead of once per operation."""
    return any(_is_half(node) for node in find_all(expr, _BINARY))


def _widen(expr):
    """``expr`` (fp16) as a float32 expression of the same lanes: arithmetic, selections and
    broadcasts of fp16 operands become float32 ones, loads and other leaves are converted,
    a cast to fp16 of a float32 value is that value."""
    wide = _with_base(expr.ty, WIDE)
    if isinstance(expr, tirx.Cast) and _base(expr.value.ty) == WIDE:
        return expr.value
    if isinstance(expr, _BINARY):
        return type(expr)(_widen(expr.a), _widen(expr.b))
    if isinstance(expr, tirx.FloatImm):
        return tirx.FloatImm(wide, float(np.float16(expr.value)))
    if isinstance(expr, tirx.Select):
        return tirx.Select(expr.condition, _widen(expr.true_value), _widen(expr.false_value))
    if _is_if_then_else(expr):
        cond, then, other = expr.args
        return tirx.if_then_else(cond, _widen(then), _widen(other))
    if isinstance(expr, tirx.Broadcast):
        return tirx.Broadcast(_widen(expr.value), expr.lanes)
    return tirx.Cast(wide, expr)


def _exact_cast(expr, dtype):
    """``expr`` (fp16) converted to ``dtype``: a constant as a constant."""
    if isinstance(expr, tirx.FloatImm):
        return tirx.FloatImm(dtype, float(np.float16(expr.value)))
    return tirx.Cast(dtype, expr)


def evaluate_in_float32(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, list[str]]:
    """``func`` with its fp16 arithmetic computed in float32 and rounded at the stores (module
    docstring), and the buffers whose stores were rewritten; ``func`` itself and ``[]`` when
    it does no fp16 arithmetic."""
    rounded: list[str] = []

    def store(node):
        value = node.value
        if not _is_half(value) or not _does_half_math(value):
            return node
        if node.buffer.name not in rounded:
            rounded.append(node.buffer.name)
        return tirx.BufferStore(node.buffer, tirx.Cast(str(value.ty), _widen(value)),
                                node.indices)

    def cast(node):  # a float32 value of fp16 arithmetic: computed in float32
        if _base(node.ty) != WIDE or not _is_half(node.value):
            return node
        if not _does_half_math(node.value):
            return node
        return _widen(node.value)

    out = tvm_ffi.structural_map(func, [(tirx.BufferStore, store), (tirx.Cast, cast)])
    return (func, []) if out.same_as(func) else (out, rounded)


def widen_upcast_buffers(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, list[str]]:
    """``func`` with every fp16 buffer allocated in one of its blocks, and read only through a
    cast to float32, allocated in float32 (module docstring), and those buffers' names.

    A padding written into such a buffer (``if_then_else(in_bounds, x[..], 0)``) is split into
    a fill of the pad value and an unconditional copy of the interior
    (``decompose_padding``): the conditional store of a converted fp16 value does not
    vectorise (AVX2 has no masked 16-bit load) and converted one lane at a time cost more
    than the conversions saved. A padding that does not split (a stride-2 conv's even/odd
    columns) keeps its fp16 buffer."""
    widened = []
    for name in _upcast_only(func):
        wide = _widen_buffer(func, name)
        wide = _split_padding(wide, name)
        if wide is not None:
            func = wide
            widened.append(name)
    return func, widened


def _upcast_only(func: tirx.PrimFunc) -> list[str]:
    """The fp16 buffers allocated in ``func``'s blocks whose every load is cast to float32."""
    loads = find_all(func.body, TensorLoad)
    upcast = [c.value.source for c in find_all(func.body, tirx.Cast)
              if isinstance(c.value, TensorLoad) and _base(c.ty) == WIDE]
    names = []
    for block in find_all(func.body, SBlock):
        for buf in block.alloc_buffers:
            if _base(buf.dtype) != HALF:
                continue
            reads = sum(ld.source.same_as(buf) for ld in loads)
            if reads and reads == sum(src.same_as(buf) for src in upcast):
                names.append(buf.name)
    return names


def _widen_buffer(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc:
    """``func`` with the allocated buffer ``name`` in float32: its stores convert, its casted
    loads read it as it is."""
    old = next(buf for block in find_all(func.body, SBlock) for buf in block.alloc_buffers
               if buf.name == name)
    t = old.ty
    new = tirx.decl_buffer(old.shape, _with_base(old.dtype, WIDE), old.name,
                           strides=list(t.strides) or None, elem_offset=t.elem_offset,
                           scope=old.scope(), data_alignment=t.data_alignment,
                           offset_factor=t.offset_factor, layout=t.layout)

    def cast(node):
        if isinstance(node.value, TensorLoad) and node.value.source.same_as(old) and (
                _base(node.ty) == WIDE):
            return tirx.BufferLoad(new, node.value.indices)
        return node

    def store(node):
        if not node.buffer.same_as(old):
            return node
        value = node.value
        if _is_if_then_else(value):  # a padding keeps its form: the cast in each branch
            cond, then, other = value.args
            value = tirx.if_then_else(cond, _exact_cast(then, new.dtype),
                                      _exact_cast(other, new.dtype))
        else:
            value = _exact_cast(value, new.dtype)
        return tirx.BufferStore(new, value, node.indices)

    def region(node):
        return tirx.BufferRegion(new, node.region) if node.source.same_as(old) else node

    def block(node):
        if not any(buf.same_as(old) for buf in node.alloc_buffers):
            return node
        allocs = [new if buf.same_as(old) else buf for buf in node.alloc_buffers]
        return SBlock(node.iter_vars, node.reads, node.writes, node.name_hint, node.body,
                      node.init, allocs, node.match_buffers, node.annotations, node.span)

    return tvm_ffi.structural_map(func, [(tirx.Cast, cast), (tirx.BufferStore, store),
                                         (tvm.ir.expr.TensorRegion, region), (SBlock, block)])


def _split_padding(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc | None:
    """``func`` with each padding written into ``name`` split into a fill and an interior
    copy; ``func`` when no writer is a padding; ``None`` when a padding does not split."""
    writers = [b.name_hint for b in find_all(func.body, SBlock)
               if isinstance(b.body, tirx.BufferStore) and b.body.buffer.name == name
               and _is_if_then_else(b.body.value)]
    if not writers:
        return func
    sch = s_tir.Schedule(func)
    try:
        for writer in writers:
            block_rv = sch.get_sblock(writer)
            consumer_loops = [sch.get(lp) for c in sch.get_consumers(block_rv)
                              for lp in sch.get_loops(c)]
            loops = sch.get_loops(block_rv)
            own = [lp for lp in loops if not any(sch.get(lp).same_as(c) for c in consumer_loops)]
            sch.decompose_padding(block_rv, (own or loops)[0])
    except (s_tir.ScheduleError, ValueError):
        return None
    return sch.mod["main"]


def _has_half_buffer(func: tirx.PrimFunc) -> bool:
    buffers = [p for p in func.params if hasattr(p, "dtype")]
    buffers += [b for block in find_all(func.body, SBlock) for b in block.alloc_buffers]
    return any(_base(b.dtype) == HALF for b in buffers)


def half_in_float32(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, list[str]]:
    """:func:`evaluate_in_float32` then :func:`widen_upcast_buffers`, with one schedule note
    for each that changed ``func``."""
    if not _has_half_buffer(func):  # nothing to do: no walk of a float32 kernel
        return func, []
    func, rounded = evaluate_in_float32(func)
    func, widened = widen_upcast_buffers(func)
    notes = []
    if rounded:
        notes.append(f"{', '.join(rounded)}: fp16 arithmetic computed in float32, rounded once "
                     f"at the store (no fp16 arithmetic on the target)")
    if widened:
        notes.append(f"{', '.join(widened)}: fp16, read only through casts to float32: "
                     f"allocated in float32, widened once where written")
    return func, notes


__all__ = ["HALF", "WIDE", "evaluate_in_float32", "half_in_float32", "widen_upcast_buffers"]

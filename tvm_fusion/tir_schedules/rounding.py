"""Float rounding kept where the unfused program rounds, in functions that convert floats to
integers (QuantizeLinear, a float-to-int Cast).

TVM's LLVM code generator lets LLVM contract a multiply feeding an add into one fused
multiply-add (on targets with FMA), which skips the rounding of the product. Unfused, a
producer's value is stored to a buffer and rounded there; inlined into its consumer, LLVM
contracts across what used to be the buffer: ``DequantizeLinear(a) + DequantizeLinear(b)``
becomes ``fma(a - za, s, (b - zb) * s)``. For float outputs that is a last-bit difference,
inside every tolerance; before a ``round`` to int8 it moves values off the half-way ties that
QDQ graphs are full of (a sum of two multiples of a scale, halved), and a twelfth of a small
QDQ conv net's int8 outputs came out one off stock TVM's and ONNX Runtime's.

:func:`fence_producers` wraps the stored value of every spatial producer of such a function in
``llvm.arithmetic.fence``: inlining then substitutes the fenced value, a loop vectorised in TIR
still vectorises it (LLVM's loop vectoriser does not take the intrinsic, so
:func:`.loops.vectorize_inner` vectorises such loops in TIR), and no contraction crosses it,
so the fused kernel rounds exactly where stock TVM's unfused stages do. Reductions are left
alone (the multiply-add inside a matmul or conv accumulates the same way in both), and so is
every function with no float-to-int conversion.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import codegen

from ..tir_utils import find_all, is_reduction_block

FENCE = "llvm.arithmetic.fence"


def _fence_id() -> int:
    return int(codegen.llvm_lookup_intrinsic_id(FENCE))


def is_fence(node) -> bool:
    """Whether ``node`` is a call of ``llvm.arithmetic.fence``."""
    return (isinstance(node, tvm.ir.Call) and isinstance(node.op, tvm.ir.Op)
            and node.op.name == "tirx.call_llvm_pure_intrin" and len(node.args) == 2
            and isinstance(node.args[0], tirx.IntImm) and int(node.args[0]) == _fence_id())


def _is_float(dtype) -> bool:
    return str(dtype).startswith(("float", "bfloat"))


def converts_to_int(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` casts a float value to an integer type (a quantize, a float index)."""
    for cast in find_all(func.body, tirx.Cast):
        if _is_float(cast.value.ty.dtype) and not _is_float(cast.ty.dtype) and (
                str(cast.ty.dtype) != "bool"):
            return True
    return False


def _fenced(value):
    if is_fence(value) or not _is_float(value.ty.dtype) or int(value.ty.dtype.lanes) != 1:
        return value
    if isinstance(value, (tvm.ir.expr.TensorLoad, tirx.FloatImm, tvm.ir.Var)):
        return value  # nothing computed: nothing to contract
    return tirx.call_llvm_pure_intrin(value.ty.dtype, FENCE, value)


def fence_producers(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with each spatial block's float store fenced, when ``func`` converts floats to
    integers (see the module docstring); otherwise ``func`` itself."""
    if not converts_to_int(func):
        return func

    def block(node):
        if is_reduction_block(node) or not isinstance(node.body, tirx.BufferStore):
            return node
        store = node.body
        value = _fenced(store.value)
        if value.same_as(store.value):
            return node
        body = tirx.BufferStore(store.buffer, value, store.indices)
        return tvm.s_tir.stmt.SBlock(node.iter_vars, node.reads, node.writes, node.name_hint,
                                     body, node.init, node.alloc_buffers, node.match_buffers,
                                     node.annotations)

    return tvm_ffi.structural_map(func, [(tvm.s_tir.stmt.SBlock, block)])

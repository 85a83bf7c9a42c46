"""FLOPs of high-level Relax operators, from shapes: the metric that drives rewriting.

DNNFusion (§4.2) drives rewriting by #FLOPS and counts every element-wise operator, reciprocal,
square and square root included, as one operation per output element (Table 4). We keep that
convention, so Table 4's numbers come out exactly:

* element-wise (``add`` … ``exp``, ``log``, ``power``, shifts, and unmodelled ones such as
  ``tanh``, ``erf``, ``where``): one per output element;
* reductions (``sum``, ``mean``, ``max``, ``min``, ``prod``): one per input element, plus one per
  output element for ``mean``'s division;
* ``matmul``: 2·M·N·K per batch (a multiply and an add per term);
* convolutions: 2 · output elements · (input channels per group · kernel volume);
* ``softmax`` 5, ``layer_norm``/``group_norm`` 7, ``rms_norm`` 4, ``batch_norm`` 2 per element;
  pooling: output elements · window;
* data movement (reshape, permute_dims, split, concat, take, strided_slice, broadcast_to, astype,
  ...): zero, because fusion turns it into index arithmetic;
* any other operator: one per output element.

The driver compares costs lexicographically as ``(flops, loads, ops)``: FLOPs first, as the
paper says; then elements read by compute operators (the paper's § rows, "A is loaded once
instead of twice"); then the operator count (a cancelled transpose). All three are non-negative
integers, so a strictly decreasing sequence of costs is finite: the rewriting terminates.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax

from ...symbolic import concrete_shape
from .ir import ELEMENTWISE_BINARY, ELEMENTWISE_UNARY, REDUCTIONS, Node, SymDim

Cost = tuple[int, int, int]
ZERO: Cost = (0, 0, 0)

_DATA_MOVEMENT = frozenset({
    "reshape", "permute_dims", "split", "concat", "take", "strided_slice", "broadcast_to",
    "expand_dims", "squeeze", "astype", "flatten", "tile", "repeat", "flip", "gather_elements",
    "gather_nd", "scatter_elements", "scatter_nd", "layout_transform", "shape_of",
    "shape_to_tensor", "tensor_to_shape", "dynamic_strided_slice", "one_hot", "arange", "full",
    "full_like", "zeros", "zeros_like", "ones", "ones_like", "nn.pad", "image.resize2d",
    "collapse_sum_like", "collapse_sum_to", "wrap_param", "call_pure_packed", "null_value",
    "tril", "triu", "index_tensor",
})
_PER_ELEMENT = {"nn.softmax": 5, "nn.log_softmax": 5, "nn.layer_norm": 7, "nn.group_norm": 7,
                "nn.rms_norm": 4, "nn.batch_norm": 2}
_POOLS = frozenset({"nn.max_pool1d", "nn.max_pool2d", "nn.max_pool3d", "nn.avg_pool1d",
                    "nn.avg_pool2d", "nn.avg_pool3d"})
_CONVS = frozenset({"nn.conv1d", "nn.conv2d", "nn.conv3d"})
_CONV_T = frozenset({"nn.conv1d_transpose", "nn.conv2d_transpose"})


# ---------------------------------------------------------------------------------------------
# Nodes of the rewrite graph
# ---------------------------------------------------------------------------------------------
def node_cost(node: Node) -> Cost:
    """(FLOPs, elements loaded, operators) of one node; constants cost nothing (folded)."""
    op = node.op
    if op in ("get_item", "alias"):
        return ZERO
    if op in ("reshape", "permute_dims", "split"):
        return (0, 0, 1)
    loads = sum(a.size for a in node.args)
    if op in ELEMENTWISE_BINARY or op in ELEMENTWISE_UNARY:
        return (node.size, loads, 1)
    if op in REDUCTIONS:
        extra = node.size if op == "mean" else 0
        return (node.args[0].size + extra, loads, 1)
    if op == "matmul":
        k = node.args[0].shape[-1]
        return (2 * node.size * (k.rep if isinstance(k, SymDim) else k), loads, 1)
    raise ValueError(f"no cost for modelled op {op}")


def add_costs(a: Cost, b: Cost) -> Cost:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def sub_costs(a: Cost, b: Cost) -> Cost:
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2])


# ---------------------------------------------------------------------------------------------
# Whole modules (for the before/after statistics)
# ---------------------------------------------------------------------------------------------
def _size(ty) -> int:
    shape = _shape(ty)
    if shape is not None:
        return math.prod(shape)
    if isinstance(ty, relax.TupleType):
        return sum(_size(f) for f in ty.fields)
    return 0


def _shape(ty) -> tuple[int, ...] | None:
    """A tensor's shape; symbolic extents at their representative size (statistics only)."""
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return concrete_shape(ty.shape.values)
    return None


def call_flops(call: relax.Call, out_ty) -> int:
    """FLOPs of one high-level Relax call, by the conventions in the module docstring."""
    name = call.op.name[6:] if call.op.name.startswith("relax.") else call.op.name
    out = _size(out_ty)
    arg_tys = [getattr(a, "ty", None) for a in call.args]
    if name in _DATA_MOVEMENT:
        return 0
    if name in REDUCTIONS or name in ("variance", "std", "cumsum", "cumprod", "argmax",
                                      "argmin"):
        return _size(arg_tys[0]) + (out if name == "mean" else 0)
    if name == "matmul":
        shape = _shape(arg_tys[0])
        return 2 * out * (shape[-1] if shape else 1)
    if name in _CONVS or name in _CONV_T:
        w = _shape(arg_tys[1])
        if not w:
            return out
        per_out = math.prod(w[1:])
        if name in _CONV_T:
            return 2 * _size(arg_tys[0]) * per_out
        return 2 * out * per_out
    if name in _PER_ELEMENT:
        return _PER_ELEMENT[name] * out
    if name in _POOLS:
        return out * math.prod(int(k) for k in call.attrs.pool_size)
    if name.startswith("nn.adaptive_avg_pool"):
        return _size(arg_tys[0])
    return out


def function_flops(func: relax.Function) -> int:
    total = 0

    def visit(expr):
        nonlocal total
        if isinstance(expr, relax.SeqExpr):
            for block in expr.blocks:
                for binding in block.bindings:
                    value = binding.value
                    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                        total += call_flops(value, binding.var.ty)

    visit(func.body)
    return total


def module_flops(mod: tvm.IRModule) -> int:
    """FLOPs of every high-level call in the module's Relax functions (primitive ones too)."""
    return sum(function_flops(f) for f in mod.functions.values()
               if isinstance(f, relax.Function))

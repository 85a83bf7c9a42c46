"""Converters that replace TVM 0.27's where a symbolic export defeats them.

Each repair names the TVM behaviour it works around. A converter returns None where it does
not apply (its inputs are not the values it needs), and TVM's own converter runs instead, so a
repair never makes an import that worked fail. ``ctx`` is the importer
(:class:`.onnx_import.RepairingImporter`): its block builder, analyzer and values.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from tvm import relax, tirx

from .shape_values import is_concrete

__all__ = ["CONVERTERS", "REPAIRS", "widen_int4_initializers"]

CONVERTERS: dict[str, Callable] = {}


def _converter(op_type: str, repair: str):
    def register(fn):
        fn.repair = repair
        CONVERTERS[op_type] = fn
        return fn
    return register


def _dims(ctx, expr) -> list | None:
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    return [ctx.analyzer.simplify(d) for d in ty.shape]


def _is(ctx, dim, number: int) -> bool:
    return ctx.analyzer.equal(dim, number)


def _prim(value):
    return tirx.IntImm("int64", value) if isinstance(value, int) else value


def _shape_expr(dims) -> relax.ShapeExpr:
    return relax.ShapeExpr([_prim(d) for d in dims])


# --------------------------------------------------------------------------------------------
# Expand
# --------------------------------------------------------------------------------------------


def _prefer(ctx, a, b):
    """Of two dimensions that must be equal (neither is 1), the one to keep: a plain graph
    dimension over an expression (``seq`` over ``min(seq, 512)``), else the shorter."""
    def rank(dim):
        if isinstance(dim, int):
            return (0, 0)
        free = tirx.analysis.undefined_vars(dim, [])
        known = all(v.name in ctx.analyzer.dims for v in free)
        return (1 if known else 2, len(str(dim)))
    return a if rank(a) <= rank(b) else b


def _cast_dims(ctx, expr, dims):
    """``expr`` match-cast to ``dims``: a run-time check that the dimensions agree. The shape
    is forgotten first: TVM 0.27 segfaults compiling a match_cast from one shape expression to
    another (``(1, max(s, 0))`` to ``(1, s)``, in KillAfterLastUse)."""
    dtype = expr.ty.dtype
    if expr.ty.shape is not None:
        expr = ctx.bb.match_cast(expr, relax.TensorType(ndim=len(dims), dtype=dtype))
    return ctx.bb.match_cast(expr, relax.TensorType([_prim(d) for d in dims], dtype))


@_converter("Expand", "expand")
def expand(ctx, node, attr, inputs, values):
    """Broadcast to a target known as (symbolic) values, by ONNX's rules per dimension.

    TVM's Expand, given a symbolic target (a ``ShapeExpr``), pads only the *input's* shape to
    the target's rank and asserts they match (``AssertionError``): ONNX's broadcast is
    bidirectional, and a target shorter than the input (``Expand(x, Shape(x)[1:])``) is
    valid. It also reads the input's shape as a list (``'NoneType' object is not iterable``
    when unknown). Here both sides are padded; each dimension is the input's where the
    target's is 1 (or ``-1``, which torch writes), the target's where the input's is 1, and
    where both are symbolic and unequal the simpler one, the input match-cast to it
    (checked at run time)."""
    data, target = inputs[0], values[1]
    data_dims = _dims(ctx, data)
    if target is None or target.ndim != 1 or data_dims is None:
        return None
    if is_concrete(target) and all(isinstance(d, int) for d in data_dims):
        return None  # all static: TVM's converter does it
    want = list(target.flat)
    rank = max(len(data_dims), len(want))
    have = [1] * (rank - len(data_dims)) + data_dims
    want = [1] * (rank - len(want)) + want
    out, cast = [], list(have)
    for i, (a, b) in enumerate(zip(have, want)):
        if _is(ctx, b, 1) or _is(ctx, b, -1) or ctx.analyzer.equal(a, b):
            out.append(a)
        elif _is(ctx, a, 1):
            out.append(b)
        else:
            keep = _prefer(ctx, a, b)
            out.append(keep)
            cast[i] = keep
    if cast != have:
        data = _cast_dims(ctx, data, cast[rank - len(data_dims):])
    if len(out) == len(data_dims) and all(ctx.analyzer.equal(a, b) for a, b in zip(have, out)):
        return data
    return relax.op.broadcast_to(data, _shape_expr(out))


# --------------------------------------------------------------------------------------------
# ConstantOfShape
# --------------------------------------------------------------------------------------------


@_converter("ConstantOfShape", "constant_of_shape")
def constant_of_shape(ctx, node, attr, inputs, values):
    """A tensor of the ``value`` attribute's element, of a (symbolic) shape.

    TVM's ConstantOfShape broadcasts the attribute's one-element 1-D tensor, which fails for
    an empty shape (a scalar: "broadcast_to expects the input shape to have the number of
    ndim at least as the input tensor's", written by the TorchScript exporter for
    ``torch.full((), …)``), and gives a run-time shape ``tensor_to_shape`` variables."""
    shape = values[0]
    if shape is None or shape.ndim != 1:
        return None
    fill = attr.get("value")
    array = onnx.numpy_helper.to_array(fill) if fill is not None else np.zeros(1, np.float32)
    dtype = str(array.dtype)
    scalar = array.reshape(-1)[0]
    dims = list(shape.flat)
    if is_concrete(shape):
        if dims:
            return None  # a static shape: TVM's converter does it
        return relax.const(np.asarray(scalar, dtype=dtype), dtype)
    return relax.op.full(_shape_expr(dims), relax.const(scalar, dtype), dtype)


# --------------------------------------------------------------------------------------------
# Range
# --------------------------------------------------------------------------------------------


def _scalar(values):
    if values is None or values.size != 1:
        return None
    return values.reshape(-1)[0]


@_converter("Range", "range")
def range_(ctx, node, attr, inputs, values):
    """``arange`` with a length computed symbolically from (symbolic) bounds.

    TVM's Range computes the count as a tensor and reads it back with ``tensor_to_shape``: the
    result's length is a fresh variable (``range_len_0``) unrelated to the ``seq`` it counts
    to, so a causal mask or position ids built from it broadcast against ``seq`` to an
    unknown shape, and every tensor after that is opaque."""
    bounds = [_scalar(v) for v in values[:3]]
    if any(b is None for b in bounds) or all(isinstance(b, int) for b in bounds):
        return None  # unknown, or all constant (TVM folds those)
    dtype = str(inputs[0].ty.dtype) if hasattr(inputs[0], "ty") and hasattr(
        inputs[0].ty, "dtype") else "int64"
    if not dtype.startswith("int"):
        return None
    start, limit, delta = bounds
    if not isinstance(delta, int) or delta == 0:
        return None
    length = ctx.analyzer.simplify(tirx.max(
        tirx.floordiv(_prim(limit) - _prim(start) + (delta - 1 if delta > 0 else delta + 1),
                      delta), 0))
    out = ctx.bb.normalize(relax.op.arange(_prim(start), _prim(limit), _prim(delta), dtype))
    if not ctx.analyzer.equal(out.ty.shape[0], length):
        out = _cast_dims(ctx, out, [length])
    return out


# --------------------------------------------------------------------------------------------
# Gather at constant indices
# --------------------------------------------------------------------------------------------


@_converter("Gather", "gather_constant_indices")
def gather_constant_indices(ctx, node, attr, inputs, values):
    """A tensor gathered at constant indices: a take at those indices, negative ones made
    positive here from the axis's extent.

    TVM's Gather normalises negative indices at run time whatever they are
    (``where(i < 0, i + shape_to_tensor(shape_of(data))[axis], i)``), which only folds when
    the data's whole shape is static: with a symbolic dimension elsewhere (ViT's batch in
    ``nn.MultiheadAttention``'s ``q, k, v = qkv[0], qkv[1], qkv[2]``) every constant index
    became a tensor computed per run (three shape_to_tensor kernels a layer) and the take a
    gather at a run-time index, which no layout or fusion pass sees through."""
    data = inputs[0]
    index = values[1] if len(values) > 1 else None
    if values[0] is not None or index is None or not is_concrete(index):
        return None  # a value's own gather (shape_values), or indices known only at run time
    dims = _dims(ctx, data)
    if dims is None:
        return None
    axis = attr.get("axis", 0) % len(dims)
    # the importer hands int64 values over as a PrimValue or ShapeExpr, others as tensors
    dtype = str(getattr(inputs[1].ty, "dtype", "int64"))
    if dtype not in ("int32", "int64"):
        return None
    indices = np.array(index.tolist(), dtype=dtype)
    if (indices < 0).any():
        extent = dims[axis]
        if not isinstance(extent, (int, tirx.IntImm)):
            return None  # x[-1] of a symbolic axis: TVM's run-time normalisation stays
        indices = np.where(indices < 0, indices + int(extent), indices)
    return relax.op.take(data, relax.const(indices, dtype), axis)


# --------------------------------------------------------------------------------------------
# DequantizeLinear with blocks
# --------------------------------------------------------------------------------------------


@_converter("DequantizeLinear", "blocked_dequantize")
def blocked_dequantize(ctx, node, attr, inputs, values):
    """Opset 21's block-wise DequantizeLinear (``block_size``: one scale, and zero point, per
    ``block_size`` consecutive elements along ``axis``), which TVM 0.27's converter refuses
    ("blocked quantization is not supported yet"): ``(x − zp) · scale`` with the scale and zero
    point repeated ``block_size`` times along the axis (cut to its length). A constant weight
    in this form is kept as integers by the packed GEMM (``layout/weight_quant.py``)."""
    block = int(attr.get("block_size", 0))
    if block <= 0:
        return None  # per tensor or per axis: TVM's converter
    x, scale = inputs[0], inputs[1]
    zp = inputs[2] if len(inputs) > 2 else None
    dims = _dims(ctx, x)
    if dims is None or _dims(ctx, scale) is None:
        return None
    axis = int(attr.get("axis", 1)) % len(dims)
    if not isinstance(dims[axis], (int, tirx.IntImm)):
        return None
    length = int(dims[axis])
    out_dtype = str(scale.ty.dtype)

    def spread(t):
        out = ctx.bb.emit(relax.op.repeat(t, block, axis))
        if int(out.ty.shape[axis]) != length:
            out = ctx.bb.emit(relax.op.strided_slice(out, [axis], [0], [length]))
        return out

    value = ctx.bb.emit(relax.op.astype(x, out_dtype))
    if zp is not None:
        value = ctx.bb.emit(relax.op.subtract(
            value, ctx.bb.emit(relax.op.astype(spread(zp), out_dtype))))
    return relax.op.multiply(value, spread(scale))


# --------------------------------------------------------------------------------------------
# MeanVarianceNormalization
# --------------------------------------------------------------------------------------------


@_converter("MeanVarianceNormalization", "two_pass_variance")
def mean_variance_normalization(ctx, node, attr, inputs, values):
    """ONNX's formula, ``(X − E[X]) / sqrt(E[(X − E[X])²])``, where TVM 0.27's converter takes
    the variance as ``E[X²] − E[X]²``: that difference cancels (a row of mean 1000 and spread
    0.1 has no correct digit left in float32), and once fused into one loop nest, LLVM's FMA
    contraction turns the exact 0 of a constant row into a rounding error, so ``0/0`` (NaN, as
    ONNX Runtime gives) became 0 on AVX2/AVX-512 targets (fuzzer seed 46 on a znver4 target).
    Also keeps a float16 input in float16 (TVM's squares it by a float32 constant)."""
    data = inputs[0]
    axes = [int(a) for a in attr.get("axes", (0, 2, 3))]
    centered = ctx.bb.emit(relax.op.subtract(
        data, ctx.bb.emit(relax.op.mean(data, axis=axes, keepdims=True))))
    variance = ctx.bb.emit(relax.op.mean(relax.op.multiply(centered, centered), axis=axes,
                                         keepdims=True))
    return relax.op.divide(centered, relax.op.sqrt(variance))


# --------------------------------------------------------------------------------------------
# 4-bit initializers
# --------------------------------------------------------------------------------------------

_WIDER = {onnx.TensorProto.INT4: (onnx.TensorProto.INT8, np.int8),
          onnx.TensorProto.UINT4: (onnx.TensorProto.UINT8, np.uint8)}


def widen_int4_initializers(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """The model with its int4/uint4 initializers as int8/uint8 of the same values, and how
    many there were. TVM 0.27's importer fails on a 4-bit initializer (``TensorCopyFromBytes:
    size mismatch``: ONNX packs two per byte, TVM's ``int4`` tensor is read as one per byte);
    DequantizeLinear, their usual reader, gives the same result from the wider type, and the
    packed GEMM keeps them as 8-bit integers (not two per byte)."""
    found = [t for t in model.graph.initializer if t.data_type in _WIDER]
    if not found:
        return model, 0
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for tensor in out.graph.initializer:
        if tensor.data_type in _WIDER:
            values = np.asarray(onnx.numpy_helper.to_array(tensor)).astype(
                _WIDER[tensor.data_type][1])
            tensor.CopyFrom(onnx.numpy_helper.from_array(values, tensor.name))
    return out, len(found)


REPAIRS = frozenset(fn.repair for fn in CONVERTERS.values())


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
import tvm
from tvm import relax, tirx

from .shape_values import is_concrete, to_numpy

__all__ = ["BROADCASTING", "CONVERTERS", "REPAIRS", "align_broadcast"]

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


def _product(ctx, dims):
    total = 1
    for d in dims:
        total = total * d
    return ctx.analyzer.simplify(total)


def _infer_minus_one(ctx, data_dims: list, known: list):
    """The size a ``-1`` stands for: the data's elements over the known target dimensions.
    Equal factors cancel first (``seq * 12 * 64`` over ``seq * 12`` is 64, which a division
    of the two products does not always simplify to)."""
    numerator = list(data_dims)
    denominator = []
    for dim in known:
        match = next((i for i, d in enumerate(numerator) if ctx.analyzer.equal(d, dim)), None)
        if match is None:
            denominator.append(dim)
        else:
            numerator.pop(match)
    num, den = _product(ctx, numerator), _product(ctx, denominator)
    if isinstance(num, int) and isinstance(den, int):
        return num // den
    return ctx.analyzer.simplify(tirx.floordiv(_prim(num), _prim(den)))


def _prim(value):
    return tirx.IntImm("int64", value) if isinstance(value, int) else value


def _shape_expr(dims) -> relax.ShapeExpr:
    return relax.ShapeExpr([_prim(d) for d in dims])


def _const_or_none(values):
    return None if values is None or not is_concrete(values) else [int(v) for v in values.flat]


# --------------------------------------------------------------------------------------------
# Reshape
# --------------------------------------------------------------------------------------------


@_converter("Reshape", "reshape")
def reshape(ctx, node, attr, inputs, values):
    """A target shape known as (symbolic) values, ``0`` and ``-1`` resolved here.

    TVM's Reshape passes a ``-1`` to ``relax.op.reshape``, whose shape inference needs the
    input's shape ("Reshape expects the input tensor to have known shape when there is some
    dimension length to infer"), and turns a target computed at run time into
    ``tensor_to_shape`` with fresh variables, so everything downstream loses its shape. With
    the target's values known, ``0`` copies the input's dimension and ``-1`` is the quotient of
    the element counts (symbolic where they are)."""
    data, target = inputs[0], values[1]
    if target is None or target.ndim != 1:
        return None
    dims = list(target.flat)
    data_dims = _dims(ctx, data)
    if is_concrete(target) and data_dims is not None and all(
            isinstance(d, int) for d in data_dims):
        return None  # all static: TVM's converter does it
    if not attr.get("allowzero", 0) and any(_is(ctx, d, 0) for d in dims):
        if data_dims is None:
            return None
        dims = [data_dims[i] if _is(ctx, d, 0) else d for i, d in enumerate(dims)]
    minus = [i for i, d in enumerate(dims) if _is(ctx, d, -1)]
    if len(minus) > 1:
        return None
    if minus:
        if data_dims is None:
            return None
        known = [d for i, d in enumerate(dims) if i != minus[0]]
        dims[minus[0]] = _infer_minus_one(ctx, data_dims, known)
    if data_dims is not None and len(data_dims) == len(dims) and all(
            ctx.analyzer.equal(a, b) for a, b in zip(data_dims, dims)):
        return data
    return relax.op.reshape(data, _shape_expr(dims))


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
    """``expr`` match-cast to ``dims``: a run-time check that the dimensions agree."""
    return ctx.bb.match_cast(expr, relax.TensorType([_prim(d) for d in dims], expr.ty.dtype))


@_converter("Expand", "expand")
def expand(ctx, node, attr, inputs, values):
    """Broadcast to a target known as (symbolic) values, by ONNX's rules per dimension.

    TVM's Expand reads the input's shape as a list (``'NoneType' object is not iterable``
    when it is unknown) and, for a target computed at run time, gives ``tensor_to_shape``
    variables. Here each dimension is the input's where the target's is 1 (or ``-1``, which
    torch writes), the target's where the input's is 1, and where both are symbolic and
    unequal the simpler one, the input match-cast to it (checked at run time)."""
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
        return relax.const(np.full([int(d) for d in dims], scalar, dtype=dtype), dtype)
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
# Broadcasting operators
# --------------------------------------------------------------------------------------------

BROADCASTING = {"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Where",
                "And", "Or", "Xor", "Equal", "Less", "LessOrEqual", "Greater",
                "GreaterOrEqual", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "PRelu"}


def align_broadcast(ctx, node, inputs):
    """Operands whose dimensions must agree but are different symbolic expressions, match-cast
    to one of them.

    Relax infers no shape for a broadcast of ``seq`` against ``min(seq, 512)`` (position ids
    sliced from a 512-row table) or against any other expression it cannot prove equal, and
    everything downstream is opaque. ONNX broadcasting allows only equal dimensions or 1, so
    when neither is 1 they are equal: the operand with the more complicated one is cast to the
    simpler one, a check at run time (a size out of the model's range fails there, as it does
    in PyTorch). Only dimensions over the graph's own symbolic dimensions are aligned; a
    data-dependent size (NonZero's count) may be 1 at run time and is left alone."""
    if "broadcast" not in ctx.repairs:
        return inputs
    shapes = [_dims(ctx, x) if isinstance(x, relax.Expr) and isinstance(
        getattr(x, "ty", None), relax.TensorType) else None for x in inputs]
    present = [s for s in shapes if s is not None]
    if len(present) < 2:
        return inputs
    rank = max(len(s) for s in present)
    padded = [None if s is None else [1] * (rank - len(s)) + s for s in shapes]
    targets = []
    changed = False
    for axis in range(rank):
        dims = [p[axis] for p in padded if p is not None and not _is(ctx, p[axis], 1)]
        keep = dims[0] if dims else 1
        for dim in dims[1:]:
            if not ctx.analyzer.equal(keep, dim):
                if not (_over_graph_dims(ctx, keep) and _over_graph_dims(ctx, dim)):
                    return inputs
                keep = _prefer(ctx, keep, dim)
                changed = True
        targets.append(keep)
    if not changed:
        return inputs
    out = list(inputs)
    for i, (expr, dims) in enumerate(zip(inputs, padded)):
        if dims is None:
            continue
        new = [d if _is(ctx, d, 1) else t for d, t in zip(dims, targets)]
        if any(not ctx.analyzer.equal(a, b) for a, b in zip(dims, new)):
            out[i] = _cast_dims(ctx, expr, new[rank - len(shapes[i]):])
    ctx.report.repairs["broadcast"] += 1
    return type(inputs)(out)


def _over_graph_dims(ctx, dim) -> bool:
    if isinstance(dim, int):
        return True
    return all(v.name in ctx.analyzer.dims for v in tirx.analysis.undefined_vars(dim, []))


REPAIRS = frozenset({fn.repair for fn in CONVERTERS.values()} | {"broadcast"})


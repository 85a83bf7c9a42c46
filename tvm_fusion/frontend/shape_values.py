"""Shape arithmetic on values: an exporter's shape subgraphs folded into symbolic expressions.

Exporters compute shapes at run time: ``Shape → Gather → Unsqueeze → Concat → Reshape`` (the
TorchScript exporter writes one such chain per ``view``), ``Shape → Slice → Concat → Expand``,
``Where(Equal(shape, -1), 1, shape)``. TVM 0.27's ONNX importer folds a few of these (a
``Shape`` of a known shape is a ``ShapeExpr``, ``Gather`` of one is a ``PrimValue``) and turns
the rest into tensors (``shape_to_tensor``, ``tensor_to_shape``), after which every shape
downstream is opaque or a fresh variable. Here the small integer tensors of such chains are
evaluated as values: numpy object arrays whose elements are Python ints, bools or TIR
expressions over the graph's symbolic dimensions (``seq``, ``batch``), simplified with an
analyzer that knows those dimensions are at least 1. A chain that ends in a shape
(``Reshape``'s target, ``Expand``'s, ``ConstantOfShape``'s, ``Range``'s bounds) then gives that
consumer a symbolic shape, and nothing of it runs at run time.

:func:`evaluate` computes one node's output values from its inputs' values, or returns None
when it cannot (an operator it does not know, an input it has no value for, a tensor too big
to be a shape): the node is then converted as usual.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from tvm import sym, tirx

# Integer tensors larger than this are data, not shapes: never evaluated as values.
MAX_ELEMENTS = 64
# A symbolic dimension is at least 1 (a size-0 input is no use case) and below this.
DIM_UPPER = 2**40

INT_TYPES = ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64")

__all__ = ["MAX_ELEMENTS", "VALUE_OPS", "ShapeAnalyzer", "as_values", "evaluate", "is_concrete",
           "to_numpy"]


class ShapeAnalyzer:
    """An arithmetic analyzer over the graph's symbolic dimensions (each >= 1)."""

    def __init__(self, dims: Sequence[tirx.Var] = ()):
        self.analyzer = sym.Analyzer()
        self.dims: dict[str, tirx.Var] = {}
        for var in dims:
            self.add_dim(var)

    def add_dim(self, var: tirx.Var) -> None:
        if var.name not in self.dims:
            self.dims[var.name] = var
            self.analyzer.update(var, sym.ConstIntBound(1, DIM_UPPER))

    def simplify(self, value):
        """``value`` simplified; an integer or boolean constant comes back as a Python one."""
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        if isinstance(value, (int, np.integer)):
            return int(value)
        expr = self.analyzer.simplify(value)
        if isinstance(expr, tirx.IntImm):
            return bool(expr.value) if str(expr.ty) == "bool" else int(expr.value)
        return expr

    def equal(self, a, b) -> bool:
        """True when ``a == b`` is provable."""
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return bool(self.analyzer.can_prove_equal(_expr(a), _expr(b)))

    def decide(self, cond):
        """A boolean PrimExpr decided (True/False) where provable, else the expression."""
        if isinstance(cond, (bool, np.bool_)):
            return bool(cond)
        if self.analyzer.can_prove(cond):
            return True
        if self.analyzer.can_prove(tirx.Not(cond)):
            return False
        return self.simplify(cond)


def _expr(value):
    """A TIR expression of an int, bool or expression element."""
    if isinstance(value, (bool, np.bool_)):
        return tirx.IntImm("bool", int(value))
    if isinstance(value, (int, np.integer)):
        return tirx.IntImm("int64", int(value))
    if str(value.ty) != "bool" and str(value.ty) != "int64":
        return tirx.Cast("int64", value)
    return value


def is_concrete(values: np.ndarray) -> bool:
    """True when every element is a Python number (nothing symbolic)."""
    return all(isinstance(v, (int, bool, float, np.integer, np.bool_, np.floating))
               for v in values.flat)


def to_numpy(values: np.ndarray, dtype: str) -> np.ndarray:
    """A concrete value array as a numpy array of ``dtype``."""
    return np.array(values.tolist(), dtype=dtype).reshape(values.shape)


def _elementwise(fn: Callable, *arrays: np.ndarray) -> np.ndarray:
    out = as_values(np.frompyfunc(fn, len(arrays), 1)(*arrays))
    return out.reshape(np.broadcast_shapes(*(a.shape for a in arrays)))


def _int_attr_list(attr: dict, name: str):
    value = attr.get(name)
    return None if value is None else [int(v) for v in np.atleast_1d(value)]


def _concrete_ints(values: np.ndarray | None) -> list[int] | None:
    if values is None or not is_concrete(values):
        return None
    return [int(v) for v in values.flat]


class _Evaluator:
    """Per-operator value rules; each returns a list of output arrays (object dtype) or None."""

    def __init__(self, analyzer: ShapeAnalyzer):
        self.an = analyzer

    # -- helpers -----------------------------------------------------------------------------

    def s(self, value):
        return self.an.simplify(value)

    def arith(self, fn):
        def apply(a, b):
            if isinstance(a, (int, bool)) and isinstance(b, (int, bool)):
                return fn(a, b, True)
            return self.s(fn(_expr(a), _expr(b), False))
        return apply

    # -- operators ---------------------------------------------------------------------------

    def Identity(self, attr, x):  # noqa: N802 (ONNX operator names)
        return [x]

    def Gather(self, attr, data, indices):  # noqa: N802
        axis = int(attr.get("axis", 0))
        idx = _concrete_ints(indices)
        if idx is None:
            return None
        extent = data.shape[axis]
        idx_arr = np.array([i + extent if i < 0 else i for i in idx]).reshape(indices.shape)
        return [np.take(data, idx_arr, axis=axis)]

    def Slice(self, attr, data, starts=None, ends=None, axes=None, steps=None):  # noqa: N802
        if starts is None:  # opset < 10: attributes
            starts_l, ends_l = _int_attr_list(attr, "starts"), _int_attr_list(attr, "ends")
            axes_l = _int_attr_list(attr, "axes")
            steps_l = None
        else:
            starts_l, ends_l = _concrete_ints(starts), _concrete_ints(ends)
            axes_l = _concrete_ints(axes) if axes is not None else None
            steps_l = _concrete_ints(steps) if steps is not None else None
            if starts_l is None or ends_l is None or (axes is not None and axes_l is None) or (
                    steps is not None and steps_l is None):
                return None
        axes_l = axes_l if axes_l is not None else list(range(len(starts_l)))
        steps_l = steps_l if steps_l is not None else [1] * len(starts_l)
        index = [slice(None)] * data.ndim
        for start, end, axis, step in zip(starts_l, ends_l, axes_l, steps_l, strict=True):
            # numpy's slice clamps as ONNX does; INT64_MIN/MAX bounds are fine for it
            index[axis % data.ndim] = slice(start, end, step)
        return [data[tuple(index)]]

    def Concat(self, attr, *inputs):  # noqa: N802
        axis = int(attr.get("axis", 0))
        return [np.concatenate(inputs, axis=axis)]

    def Unsqueeze(self, attr, data, axes=None):  # noqa: N802
        axes_l = _int_attr_list(attr, "axes") if axes is None else _concrete_ints(axes)
        if axes_l is None:
            return None
        rank = data.ndim + len(axes_l)
        out = data
        for axis in sorted(a % rank for a in axes_l):
            out = np.expand_dims(out, axis)
        return [out]

    def Squeeze(self, attr, data, axes=None):  # noqa: N802
        axes_l = _int_attr_list(attr, "axes") if axes is None else _concrete_ints(axes)
        if axes is not None and axes_l is None:
            return None
        if axes_l is None:
            return [np.squeeze(data)]
        return [np.squeeze(data, axis=tuple(a % data.ndim for a in axes_l))]

    def Reshape(self, attr, data, shape):  # noqa: N802
        target = _concrete_ints(shape)
        if target is None:
            return None
        if not attr.get("allowzero", 0):
            target = [data.shape[i] if d == 0 else d for i, d in enumerate(target)]
        return [data.reshape(target)]

    def Flatten(self, attr, data):  # noqa: N802
        axis = int(attr.get("axis", 1)) % max(data.ndim, 1)
        return [data.reshape(math.prod(data.shape[:axis]), -1)]

    def Cast(self, attr, data):  # noqa: N802
        to = int(attr["to"])
        from onnx import TensorProto
        if to in (TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8,
                  TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64):
            return [_elementwise(lambda v: int(v) if isinstance(v, (bool, int)) else (
                self.s(tirx.Cast("int64", v)) if str(v.ty) == "bool" else v), data)]
        if to == TensorProto.BOOL:
            return [_elementwise(lambda v: bool(v) if isinstance(v, (bool, int)) else (
                v if str(v.ty) == "bool" else self.an.decide(v != 0)), data)]
        if is_concrete(data):  # to a float type: only constants (a symbolic float is data)
            return [_elementwise(float, data)]
        return None

    def _binary(self, fn):
        def rule(attr, a, b):
            return [_elementwise(self.arith(fn), a, b)]
        return rule

    def Add(self, attr, a, b):  # noqa: N802
        return self._binary(lambda x, y, c: x + y)(attr, a, b)

    def Sub(self, attr, a, b):  # noqa: N802
        return self._binary(lambda x, y, c: x - y)(attr, a, b)

    def Mul(self, attr, a, b):  # noqa: N802
        return self._binary(lambda x, y, c: x * y)(attr, a, b)

    def Div(self, attr, a, b):  # noqa: N802
        # integer Div truncates toward zero; shapes are non-negative, where that is floordiv
        def div(x, y, concrete):
            if concrete:
                return int(x / y) if y else None
            return tirx.floordiv(x, y) if self._nonneg(x) and self._nonneg(y) else \
                tirx.truncdiv(x, y)
        out = _elementwise(self.arith(div), a, b)
        return None if any(v is None for v in out.flat) else [out]

    def Mod(self, attr, a, b):  # noqa: N802
        if attr.get("fmod", 0):
            return None
        return self._binary(lambda x, y, c: x % y if c else tirx.floormod(x, y))(attr, a, b)

    def Max(self, attr, *inputs):  # noqa: N802
        fn = self.arith(lambda x, y, c: max(x, y) if c else tirx.max(x, y))
        out = inputs[0]
        for other in inputs[1:]:
            out = _elementwise(fn, out, other)
        return [out]

    def Min(self, attr, *inputs):  # noqa: N802
        fn = self.arith(lambda x, y, c: min(x, y) if c else tirx.min(x, y))
        out = inputs[0]
        for other in inputs[1:]:
            out = _elementwise(fn, out, other)
        return [out]

    def Neg(self, attr, a):  # noqa: N802
        return [_elementwise(lambda v: -v if isinstance(v, int) else self.s(-v), a)]

    def Abs(self, attr, a):  # noqa: N802
        return [_elementwise(lambda v: abs(v) if isinstance(v, int) else self.s(
            tirx.max(v, -v)), a)]

    def _compare(self, fn):
        def apply(x, y):
            if isinstance(x, (int, bool)) and isinstance(y, (int, bool)):
                return bool(fn(x, y))
            return self.an.decide(fn(_expr(x), _expr(y)))

        def rule(attr, a, b):
            return [_elementwise(apply, a, b)]
        return rule

    def Equal(self, attr, a, b):  # noqa: N802
        return self._compare(lambda x, y: x == y)(attr, a, b)

    def Less(self, attr, a, b):  # noqa: N802
        return self._compare(lambda x, y: x < y)(attr, a, b)

    def LessOrEqual(self, attr, a, b):  # noqa: N802
        return self._compare(lambda x, y: x <= y)(attr, a, b)

    def Greater(self, attr, a, b):  # noqa: N802
        return self._compare(lambda x, y: x > y)(attr, a, b)

    def GreaterOrEqual(self, attr, a, b):  # noqa: N802
        return self._compare(lambda x, y: x >= y)(attr, a, b)

    def Not(self, attr, a):  # noqa: N802
        return [_elementwise(lambda v: (not v) if isinstance(v, bool) else self.an.decide(
            tirx.Not(v)), a)]

    def And(self, attr, a, b):  # noqa: N802
        return [_elementwise(lambda x, y: (x and y) if isinstance(x, bool) and isinstance(
            y, bool) else self.an.decide(tirx.And(_expr(x), _expr(y))), a, b)]

    def Or(self, attr, a, b):  # noqa: N802
        return [_elementwise(lambda x, y: (x or y) if isinstance(x, bool) and isinstance(
            y, bool) else self.an.decide(tirx.Or(_expr(x), _expr(y))), a, b)]

    def Where(self, attr, cond, x, y):  # noqa: N802
        def pick(c, a, b):
            if isinstance(c, bool):
                return a if c else b
            return self.s(tirx.Select(c, _expr(a), _expr(b)))
        return [_elementwise(pick, cond, x, y)]

    def Expand(self, attr, data, shape):  # noqa: N802
        target = _concrete_ints(shape)
        if target is None:
            return None
        out_shape = np.broadcast_shapes(data.shape, tuple(target))
        return [np.broadcast_to(data, out_shape).copy()]

    def ConstantOfShape(self, attr, shape, value=None):  # noqa: N802
        dims = _concrete_ints(shape)
        if dims is None or math.prod(dims) > MAX_ELEMENTS:
            return None
        fill = attr.get("value")
        if fill is None:
            return None  # a float zero: data
        from onnx import numpy_helper
        array = numpy_helper.to_array(fill)
        if array.dtype.kind not in "iub":
            return None
        item = array.reshape(-1)[0].item()
        return [np.full(dims, item, dtype=object)]

    def Range(self, attr, start, limit, delta):  # noqa: N802
        bounds = [_concrete_ints(v) for v in (start, limit, delta)]
        if any(b is None for b in bounds):
            return None
        (a,), (b,), (d,) = bounds
        values = list(range(a, b, d))
        return [np.array(values, dtype=object)] if len(values) <= MAX_ELEMENTS else None

    def _reduce(self, fn, attr, data, axes=None):
        axes_l = _int_attr_list(attr, "axes") if axes is None else _concrete_ints(axes)
        if axes is not None and axes_l is None:
            return None
        if data.ndim != 1 or (axes_l not in (None, [0], [-1])):
            return None
        if not data.size:
            return None
        out = data[0]
        for v in data[1:]:
            out = self.arith(fn)(out, v)
        keep = attr.get("keepdims", 1)
        return [np.array([out] if keep else out, dtype=object)]

    def ReduceProd(self, attr, data, axes=None):  # noqa: N802
        return self._reduce(lambda x, y, c: x * y, attr, data, axes)

    def ReduceSum(self, attr, data, axes=None):  # noqa: N802
        return self._reduce(lambda x, y, c: x + y, attr, data, axes)

    def ReduceMax(self, attr, data, axes=None):  # noqa: N802
        return self._reduce(lambda x, y, c: max(x, y) if c else tirx.max(x, y), attr, data,
                            axes)

    def ReduceMin(self, attr, data, axes=None):  # noqa: N802
        return self._reduce(lambda x, y, c: min(x, y) if c else tirx.min(x, y), attr, data,
                            axes)

    def Tile(self, attr, data, repeats):  # noqa: N802
        reps = _concrete_ints(repeats)
        return None if reps is None else [np.tile(data, reps)]

    def _nonneg(self, value) -> bool:
        if isinstance(value, int):
            return value >= 0
        return bool(self.an.analyzer.can_prove(value >= 0))


# Operators whose outputs can be values; the inputs they need as values (None: all given).
VALUE_OPS = {name for name in dir(_Evaluator) if name[:1].isupper()}


def evaluate(op_type: str, attr: dict, inputs: Sequence[np.ndarray | None],
             analyzer: ShapeAnalyzer) -> list[np.ndarray] | None:
    """Output values of one node from its inputs' values; None when they cannot be computed.

    ``inputs`` holds one object array per ONNX input (None for an absent optional input or an
    input without a value: the latter makes the whole node unevaluable unless it is an
    optional input of the operator)."""
    if op_type not in VALUE_OPS:
        return None
    given = list(inputs)
    while given and given[-1] is None:  # trailing optional inputs left out
        given.pop()
    if any(v is None for v in given) or not given:
        return None
    try:
        outputs = getattr(_Evaluator(analyzer), op_type)(attr, *given)
    except (ValueError, TypeError, IndexError, ZeroDivisionError, KeyError):
        return None  # a rule that does not apply to these values: convert the node as usual
    if outputs is None:
        return None
    outputs = [as_values(o) for o in outputs]
    return None if any(o.size > MAX_ELEMENTS for o in outputs) else outputs


def as_values(value) -> np.ndarray:
    """An object array of ``value``: an array, or one element (a 0-d array)."""
    if isinstance(value, np.ndarray):
        return value.astype(object)
    out = np.empty((), dtype=object)
    out[()] = value
    return out

"""The graph the rewriter works on: one dataflow block as mutable nodes with use lists.

Relax IR is immutable, and rebuilding a function after each of hundreds of rewrites would be
quadratic. The rewriter therefore lifts each dataflow block into light Python objects once,
rewrites those (use lists make "is this intermediate used anywhere else?" an O(1) question), and
lowers the block back to Relax once (:mod:`.emit`).

Only operators that have an associative, distributive or commutative property
(:data:`MODELLED_OPS`) become :class:`Node` objects. Every other value (graph inputs, constants,
results of softmax, layer_norm, take, ...) is a :class:`Leaf`. That is how DNNFusion's partition
(§4.2: cut at operators with none of the properties) falls out: a rule only ever looks through
nodes, so no match crosses a cut.

Constants a rewrite creates are folded on the spot with numpy, lazily (:class:`Leaf` holds a
thunk), so a candidate that is never applied never pays for ``concat`` of three weight matrices.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from fractions import Fraction

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.ir.expr import GenericConst

from ...symbolic import extent

ELEMENTWISE_BINARY = ("add", "subtract", "multiply", "divide", "power", "left_shift", "right_shift")
ELEMENTWISE_UNARY = ("negative", "abs", "sqrt", "rsqrt", "square", "exp", "log")
REDUCTIONS = ("sum", "mean", "max", "min", "prod")
LAYOUT = ("permute_dims", "reshape", "split", "get_item")
MODELLED_OPS = ELEMENTWISE_BINARY + ELEMENTWISE_UNARY + REDUCTIONS + ("matmul",) + LAYOUT[:3]

# Unmodelled producers whose results are never negative (used by the range facts).
NONNEG_PRODUCERS = frozenset({
    "relax.nn.relu", "relax.nn.relu6", "relax.sigmoid", "relax.nn.softmax", "relax.exp",
    "relax.abs", "relax.sqrt", "relax.square", "relax.nn.gelu", "relax.nn.silu",
})
_NONNEG_UNARY = frozenset({"abs", "square", "exp", "sqrt", "rsqrt"})

_SMALL_CONST = 64  # constants up to this size are compared by value, larger ones by identity


class Refuse(Exception):
    """A rule cannot build its replacement here (shape, dtype or a precondition fails)."""


def is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def is_int(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


class SymDim:
    """A symbolic extent of a lifted shape (``seq``, ``batch``): equal to the same extent only,
    never to a number, and no arithmetic (a rule that needs any refuses); ``rep`` is its
    representative size, for costs. Rules whose shape work is comparing and copying extents
    (a matmul's rows, a bias broadcast over them, a split of the last axis) thus take
    symbolic shapes; the rest refuse."""

    __slots__ = ("expr", "rep", "_hash")

    def __init__(self, expr):
        self.expr = expr
        self.rep = extent(expr)
        self._hash = hash(str(expr))

    def __eq__(self, other):
        return isinstance(other, SymDim) and tvm_ffi.structural_equal(self.expr, other.expr)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return str(self.expr)

    def _refuse(self, *_args):
        raise Refuse(f"arithmetic on the symbolic extent {self.expr}")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __neg__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __int__ = __index__ = __float__ = _refuse


def _rep(d) -> int:
    return d.rep if isinstance(d, SymDim) else d


def broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    if any(isinstance(d, SymDim) for shape in shapes for d in shape):
        return _broadcast_symbolic(shapes)
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*shapes))
    except ValueError:
        raise Refuse(f"shapes {shapes} do not broadcast") from None


def _broadcast_symbolic(shapes) -> tuple:
    """Broadcasting with symbolic extents: a symbolic extent meets only itself or 1."""
    rank = max(len(s) for s in shapes)
    out = []
    for dims in zip(*(aligned(s, rank) for s in shapes)):
        sized = {d for d in dims if isinstance(d, SymDim) or d != 1}
        if len(sized) > 1:
            raise Refuse(f"shapes {shapes} do not broadcast (symbolic)")
        out.append(sized.pop() if sized else 1)
    return tuple(out)


def aligned(shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """``shape`` padded with leading ones to ``rank`` (numpy broadcasting's alignment)."""
    return (1,) * (rank - len(shape)) + tuple(shape)


class Value:
    """A tensor (or, for ``split``, a tuple of tensors) in the block."""

    __slots__ = ("shape", "dtype", "users", "key_")

    def __init__(self, shape, dtype):
        self.shape = shape
        self.dtype = dtype
        self.users: list[Node] = []
        self.key_: int | None = None

    @property
    def size(self) -> int:
        """Elements; a symbolic extent at its representative size (for costs)."""
        return 0 if self.shape is None else math.prod(_rep(d) for d in self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)


class Leaf(Value):
    """A value the rewriter never looks into: an input, a constant, an unmodelled op's result."""

    __slots__ = ("expr", "producer", "is_const", "_value", "_thunk", "_facts")

    def __init__(self, shape, dtype, expr=None, producer=None, is_const=False, value=None,
                 thunk=None):
        super().__init__(shape, dtype)
        self.expr = expr
        self.producer = producer
        self.is_const = is_const
        self._value = value
        self._thunk = thunk
        self._facts: dict[str, bool] = {}

    def value(self) -> np.ndarray:
        if self._value is None:
            if self._thunk is not None:
                self._value = np.asarray(self._thunk(), dtype=self.dtype)
                self._thunk = None
            else:
                self._value = self.expr.value.numpy()
        return self._value

    def to_relax(self):
        if self.expr is None:
            self.expr = relax.const(self.value(), self.dtype)
        return self.expr


class Node(Value):
    """A modelled operator application; ``var`` is None for nodes a rewrite created."""

    __slots__ = ("op", "args", "attrs", "var", "call", "ext_uses", "alive", "attached",
                 "modified", "order", "part", "fields", "alias")

    def __init__(self, op, args, attrs, shape, dtype, fields=None):
        super().__init__(shape, dtype)
        self.op: str = op
        self.args: list[Value] = list(args)
        self.attrs: dict = attrs
        self.var = None
        self.call = None
        self.ext_uses = 0
        self.alive = True
        self.attached = False
        self.modified = True
        self.order = 0.0
        self.part = -1
        self.fields = fields  # [(shape, dtype)] for split
        self.alias: Value | None = None

    def __repr__(self) -> str:
        name = self.var.name if self.var is not None else "new"
        return f"<{self.op} {name} {self.shape}>"

    @property
    def n_uses(self) -> int:
        return len(self.users) + self.ext_uses

    def single_use(self) -> bool:
        return self.n_uses == 1


# ---------------------------------------------------------------------------------------------
# Shape inference and numpy evaluation for the ops rules build
# ---------------------------------------------------------------------------------------------
def _reduce_shape(shape, axis, keepdims):
    if keepdims:
        return tuple(1 if i in axis else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axis)


def _matmul_shape(a, b):
    if len(a) < 2 or len(b) < 2:
        raise Refuse("matmul rules need operands of rank >= 2")
    if a[-1] != b[-2]:
        raise Refuse(f"matmul reduction dims differ: {a} x {b}")
    return broadcast(a[:-2], b[:-2]) + (a[-2], b[-1])


def infer(op: str, args: list[Value], attrs: dict):
    """(shape, dtype, fields) of ``op`` applied to ``args``; raises Refuse when invalid."""
    if op in ELEMENTWISE_BINARY:
        a, b = args
        if a.dtype != b.dtype:
            raise Refuse(f"{op}: dtypes {a.dtype} and {b.dtype} differ")
        return broadcast(a.shape, b.shape), a.dtype, None
    if op in ELEMENTWISE_UNARY:
        return args[0].shape, args[0].dtype, None
    if op in REDUCTIONS:
        return _reduce_shape(args[0].shape, attrs["axis"], attrs["keepdims"]), args[0].dtype, None
    if op == "matmul":
        a, b = args
        if a.dtype != b.dtype:
            raise Refuse("matmul: operand dtypes differ")
        return _matmul_shape(a.shape, b.shape), a.dtype, None
    if op == "permute_dims":
        return tuple(args[0].shape[i] for i in attrs["axes"]), args[0].dtype, None
    if op == "reshape":
        if math.prod(attrs["shape"]) != args[0].size:
            raise Refuse("reshape changes the element count")
        return tuple(attrs["shape"]), args[0].dtype, None
    if op == "split":
        x = args[0]
        bounds = (0, *attrs["indices"], x.shape[attrs["axis"]])
        fields = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            shape = list(x.shape)
            shape[attrs["axis"]] = hi - lo
            fields.append((tuple(shape), x.dtype))
        return None, None, fields
    if op == "get_item":
        shape, dtype = args[0].fields[attrs["index"]]
        return shape, dtype, None
    raise Refuse(f"no shape rule for {op}")


def _np_binary(op):
    return {
        "add": np.add, "subtract": np.subtract, "multiply": np.multiply,
        "divide": np.divide, "power": np.power, "left_shift": np.left_shift,
        "right_shift": np.right_shift,
    }[op]


def evaluate(op: str, values: list[np.ndarray], attrs: dict, dtype: str):
    """numpy semantics of ``op`` (the same as Relax's for the ops modelled here)."""
    with np.errstate(all="ignore"):
        if op in ELEMENTWISE_BINARY:
            if op == "divide" and is_int(dtype):
                raise Refuse("integer division is not folded")
            return _np_binary(op)(values[0], values[1]).astype(dtype)
        x = values[0]
        unary = {"negative": np.negative, "abs": np.abs, "sqrt": np.sqrt, "square": np.square,
                 "exp": np.exp, "log": np.log, "rsqrt": lambda v: 1 / np.sqrt(v)}
        if op in unary:
            return unary[op](x).astype(dtype)
        if op in REDUCTIONS:
            fn = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min,
                  "prod": np.prod}[op]
            return fn(x, axis=attrs["axis"], keepdims=attrs["keepdims"]).astype(dtype)
        if op == "matmul":
            return np.matmul(values[0], values[1]).astype(dtype)
        if op == "permute_dims":
            return np.transpose(x, attrs["axes"])
        if op == "reshape":
            return np.reshape(x, attrs["shape"])
        if op == "concat":
            return np.concatenate(values, axis=attrs["axis"])
    raise Refuse(f"cannot fold {op}")


# ---------------------------------------------------------------------------------------------
# Lifting a dataflow block
# ---------------------------------------------------------------------------------------------
def _static_shape(ty) -> tuple | None:
    """The shape of a tensor type: ints, and a :class:`SymDim` per symbolic extent."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    shape = ty.shape
    if not isinstance(shape, relax.ShapeExpr):
        return None
    return tuple(int(d.value) if isinstance(d, tvm.tirx.IntImm) else SymDim(d)
                 for d in shape.values)


def _int_list(arr) -> tuple[int, ...]:
    return tuple(int(v) for v in arr)


def _norm_axes(axis, ndim) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    return tuple(sorted({int(a) % ndim for a in axis}))


class BlockGraph:
    """One dataflow block: nodes in binding order, leaves by Relax expression."""

    def __init__(self, block: relax.DataflowBlock):
        self.block = block
        self.nodes: list[Node] = []
        self.node_of_var: dict = {}
        self.leaves: dict = {}
        # modelled operators left out because a shape is symbolic: the rules' shape algebra
        # (broadcasting, reshape sizes, constant evaluation) is over concrete shapes
        self.symbolic_skipped = 0
        self._lift(block)

    # -- values ------------------------------------------------------------------------------
    def value_of(self, expr) -> Value | None:
        node = self.node_of_var.get(expr) if isinstance(expr, relax.Var) else None
        if node is not None:
            return node
        leaf = self.leaves.get(expr)
        if leaf is not None:
            return leaf
        shape = _static_shape(getattr(expr, "ty", None))
        if shape is None:
            return None
        is_const = isinstance(expr, GenericConst)
        leaf = Leaf(shape, str(expr.ty.dtype), expr=expr, is_const=is_const,
                    producer=self._producers.get(expr))
        self.leaves[expr] = leaf
        return leaf

    # -- lifting -----------------------------------------------------------------------------
    def _lift(self, block) -> None:
        self._producers: dict = {}
        for pos, binding in enumerate(block.bindings):
            try:
                node = (self._lift_binding(binding) if isinstance(binding, relax.VarBinding)
                        else None)
            except Refuse:  # shape work on a symbolic extent (a split of a symbolic axis)
                node = None
            if node is None:
                self._note_unmodelled(binding)
                continue
            node.var = binding.var
            node.call = binding.value
            node.order = float(pos)
            node.attached = True
            node.modified = False
            if not isinstance(binding.var, relax.DataflowVar):
                node.ext_uses += 1
            for arg in node.args:
                arg.users.append(node)
            self.node_of_var[binding.var] = node
            self.nodes.append(node)
        self._drop_dead()

    def _drop_dead(self) -> None:
        """Forget results nothing uses, so they do not count as "used elsewhere"."""
        stack = [n for n in self.nodes if n.n_uses == 0]
        while stack:
            node = stack.pop()
            if not node.alive:
                continue
            node.alive = False
            for arg in node.args:
                arg.users.remove(node)
                if isinstance(arg, Node) and arg.alive and arg.n_uses == 0:
                    stack.append(arg)

    def _note_unmodelled(self, binding) -> None:
        value = binding.value
        if (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op.name[6:] in MODELLED_OPS
                and relax.analysis.tir_vars_in_type(binding.var.ty)):
            self.symbolic_skipped += 1
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            self._producers[binding.var] = value.op.name
        for var in _referenced_vars(value):
            node = self.node_of_var.get(var)
            if node is not None:
                node.ext_uses += 1

    def _lift_binding(self, binding) -> Node | None:
        value, var = binding.value, binding.var
        if isinstance(value, relax.TupleGetItem):
            src = self.node_of_var.get(value.tuple_value)
            if src is None or src.op != "split":
                return None
            shape, dtype = src.fields[value.index]
            return Node("get_item", [src], {"index": int(value.index)}, shape, dtype)
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)):
            return None
        name = value.op.name
        if not name.startswith("relax.") or name[6:] not in MODELLED_OPS:
            return None
        op = name[6:]
        tensor_args = value.args[:1] if op in ("reshape",) else value.args
        args = [self.value_of(a) for a in tensor_args]
        if any(a is None for a in args):
            return None
        if op == "split":
            return self._lift_split(value, args[0], var)
        shape = _static_shape(var.ty)
        if shape is None:
            return None
        attrs = self._attrs(op, value, args, shape)
        if attrs is None:
            return None
        return Node(op, args, attrs, shape, str(var.ty.dtype))

    def _lift_split(self, call, x, var) -> Node | None:
        fields_ty = var.ty.fields
        fields = [(_static_shape(t), str(getattr(t, "dtype", ""))) for t in fields_ty]
        if any(s is None for s, _ in fields):
            return None
        axis = int(call.attrs.axis) % x.ndim
        indices, acc = [], 0
        for shape, _ in fields[:-1]:
            acc += shape[axis]
            indices.append(acc)
        return Node("split", [x], {"axis": axis, "indices": tuple(indices)}, None, None,
                    fields=fields)

    @staticmethod
    def _attrs(op, call, args, shape) -> dict | None:
        if op in REDUCTIONS:
            return {"axis": _norm_axes(call.attrs.axis, args[0].ndim),
                    "keepdims": bool(call.attrs.keepdims)}
        if op == "permute_dims":
            axes = call.attrs.axes
            ndim = args[0].ndim
            return {"axes": tuple(reversed(range(ndim))) if axes is None
                    else tuple(int(a) % ndim for a in axes)}
        if op == "reshape":
            return {"shape": shape}
        if op == "matmul":
            out_dtype = call.attrs.out_dtype
            if out_dtype not in (None, "", "void") and str(out_dtype) != args[0].dtype:
                return None
            if args[0].ndim < 2 or args[1].ndim < 2:
                return None
            return {}
        if op in ELEMENTWISE_BINARY and args[0].dtype != args[1].dtype:
            return None
        return {}

    # -- queries -----------------------------------------------------------------------------
    def alive_nodes(self) -> Iterable[Node]:
        return (n for n in self.nodes if n.alive)


def _referenced_vars(expr) -> list:
    """Vars an (ANF) binding value refers to, with multiplicity; falls back to free_vars."""
    if isinstance(expr, relax.Var):
        return [expr]
    if isinstance(expr, relax.Call):
        out = []
        for a in expr.args:
            out.extend(_referenced_vars(a))
        return out
    if isinstance(expr, relax.Tuple):
        out = []
        for f in expr.fields:
            out.extend(_referenced_vars(f))
        return out
    if isinstance(expr, relax.TupleGetItem):
        return _referenced_vars(expr.tuple_value)
    if isinstance(expr, (GenericConst, relax.ShapeExpr, tvm.ir.Op, relax.ExternFunc,
                         tvm.ir.GlobalVar)):
        return []
    return list(relax.analysis.free_vars(expr))


# ---------------------------------------------------------------------------------------------
# Building replacement values
# ---------------------------------------------------------------------------------------------
class Builder:
    """Makes detached nodes for a candidate replacement; constant-only ops fold (lazily).

    Folds are memoised on their inputs, so twelve layers that share one weight (ALBERT) and
    get the same rewrite share one folded constant instead of holding twelve copies.
    """

    def __init__(self):
        self._memo: dict = {}

    def const(self, value, dtype: str) -> Leaf:
        arr = np.asarray(value, dtype=dtype)
        return Leaf(tuple(arr.shape), dtype, is_const=True, value=arr)

    def op(self, op: str, *args: Value, **attrs) -> Value:
        shape, dtype, fields = infer(op, list(args), attrs)
        if op != "get_item" and all(isinstance(a, Leaf) and a.is_const for a in args):
            if op == "split" or (op == "divide" and is_int(dtype)):
                raise Refuse(f"{op} of constants is not folded")
            return self.fold(
                (op, repr(sorted(attrs.items()))), args, shape, dtype,
                lambda: evaluate(op, [a.value() for a in args], attrs, dtype))
        return Node(op, args, attrs, shape, dtype, fields=fields)

    def concat_const(self, parts: list[Leaf], axis: int) -> Leaf:
        shape = list(parts[0].shape)
        shape[axis] = sum(p.shape[axis] for p in parts)
        return self.fold(("concat", axis), parts, shape, parts[0].dtype,
                         lambda: np.concatenate([p.value() for p in parts], axis=axis))

    def fold(self, tag, inputs, shape, dtype, thunk: Callable[[], np.ndarray]) -> Leaf:
        """A constant computed by ``thunk`` from ``inputs``; one Leaf per (tag, inputs)."""
        if any(isinstance(d, SymDim) for d in shape):
            raise Refuse("a constant of a symbolic shape")
        memo_key = (tag, tuple(id(v) for v in inputs), tuple(shape), dtype)
        hit = self._memo.get(memo_key)
        if hit is not None:
            return hit[1]
        leaf = Leaf(tuple(shape), dtype, is_const=True, thunk=thunk)
        self._memo[memo_key] = (tuple(inputs), leaf)  # inputs kept alive: ids stay unique
        return leaf


# ---------------------------------------------------------------------------------------------
# Structural keys and value-range facts
# ---------------------------------------------------------------------------------------------
_INTERN: dict = {}
_SERIAL = itertools.count()


def reset_keys() -> None:
    """Forget interned keys (each block's nodes are keyed afresh)."""
    _INTERN.clear()


def key(v: Value) -> int:
    """An integer equal for values that compute the same thing structurally (hash-consing).

    Keys are interned flat tuples of operand keys, so a deep DAG with shared subgraphs (a
    residual stream) is keyed in linear time, not expanded as a tree. Leaves other than small
    constants get a serial number that is never reused. A node rewritten later keeps its key,
    which stays sound because every rewrite preserves the node's value.
    """
    if v.key_ is not None:
        return v.key_
    stack = [v]
    while stack:
        top = stack[-1]
        if top.key_ is not None:
            stack.pop()
            continue
        if isinstance(top, Leaf):
            if top.is_const and top.size <= _SMALL_CONST:
                raw = ("c", top.dtype, top.shape, top.value().tobytes())
            else:
                raw = ("l", next(_SERIAL))
        else:
            pending = [a for a in top.args if a.key_ is None]
            if pending:
                stack.extend(pending)
                continue
            raw = (top.op, tuple(sorted(top.attrs.items())), tuple(a.key_ for a in top.args))
        top.key_ = _INTERN.setdefault(raw, len(_INTERN))
        stack.pop()
    return v.key_


def is_const(v: Value) -> bool:
    return isinstance(v, Leaf) and v.is_const


def const_check(v: Leaf, name: str, pred: Callable[[np.ndarray], bool]) -> bool:
    if name not in v._facts:
        with np.errstate(all="ignore"):
            v._facts[name] = bool(pred(v.value()))
    return v._facts[name]


def nonneg(v: Value, depth: int = 6) -> bool:
    """Every element is >= 0 or NaN (never negative): sqrt(v)**2 == v then holds."""
    if isinstance(v, Leaf):
        if v.is_const:
            return const_check(v, "nonneg", lambda a: np.all(a >= 0))
        return v.producer in NONNEG_PRODUCERS
    if depth == 0:
        return False
    op, args = v.op, v.args
    if op in _NONNEG_UNARY:
        return True
    if op == "multiply":
        return key(args[0]) == key(args[1]) or all(nonneg(a, depth - 1) for a in args)
    if op in ("add", "divide", "matmul"):
        return all(nonneg(a, depth - 1) for a in args)
    if op == "power":
        p = args[1]
        if is_const(p) and p.size == 1:
            e = float(p.value().reshape(()))
            if e == int(e) and int(e) % 2 == 0:
                return True
        return nonneg(args[0], depth - 1)
    if op in REDUCTIONS or op in LAYOUT:
        return nonneg(args[0], depth - 1)
    return False


def positive(v: Value) -> bool:
    """Every element is > 0 and finite: x * (1/x) == 1 then holds."""
    if isinstance(v, Leaf) and v.is_const:
        return const_check(v, "positive", lambda a: np.all((a > 0) & np.isfinite(a)))
    return False


def exponent_of_const(v: Value) -> Fraction | None:
    """A scalar constant exponent as a small fraction (halves allowed), else None."""
    if not (is_const(v) and v.size == 1):
        return None
    e = float(v.value().reshape(()))
    if not math.isfinite(e):
        return None
    frac = Fraction(e).limit_denominator(2)
    return frac if float(frac) == e else None

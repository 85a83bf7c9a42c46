"""Symbolic extents (an ONNX ``dim_param`` batch or sequence) at a representative size.

Planning and cost models need numbers: the bytes an intermediate result takes, the FLOPs a
block recomputes, how many rows a schedule parallelises. A module with a symbolic ``seq`` keeps
its symbolic shapes everywhere it is *transformed* (grouping, FuseTIR and the schedules stay
valid at every size); only where a number is needed is an extent evaluated, here and only here:

* a user hint (the ``symbolic_hint`` option, e.g. ``{"seq": 128}``) names the variable's size;
* else a variable named like a batch (``batch``, ``batch_size``, ``bs``, ``n``, ``N``…) is
  :data:`DEFAULT_BATCH` (1: the latency-bound case every deployment has);
* else (sequence length, image side, box count, …) it is :data:`DEFAULT_EXTENT` (128).

Hints are read from a context (:func:`symbolic_hints`), set by ``Sequential`` around its passes,
because the numbers are needed deep inside analyses (ECG, oracles, tile rules) that have no
options argument; outside ``Sequential`` the defaults apply.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from collections.abc import Iterator, Mapping

import tvm
from tvm import relax, sym, tirx

from .options import check_option

DEFAULT_BATCH = 1
DEFAULT_EXTENT = 128
# dim_param names taken as a batch dimension (case-insensitive, whole name)
BATCH_NAME = re.compile(r"(batch(_?size)?|bs|n|b|num_batches|unk__\d+_batch)", re.IGNORECASE)

_HINTS: contextvars.ContextVar[Mapping[str, int] | None] = contextvars.ContextVar(
    "tvm_fusion_symbolic_hints", default=None)

__all__ = ["DEFAULT_BATCH", "DEFAULT_EXTENT", "check_hints", "concrete_shape", "extent",
           "is_static", "numel", "symbolic_hints", "takes_sizes", "var_size"]


def check_hints(hints) -> dict[str, int]:
    """A ``symbolic_hint`` value checked as the option is (:mod:`tvm_fusion.options`)."""
    return check_option("symbolic_hint", hints) or {}


@contextlib.contextmanager
def symbolic_hints(hints: Mapping[str, int] | None) -> Iterator[None]:
    """Within the block, symbolic variables named in ``hints`` evaluate to the given sizes."""
    token = _HINTS.set({**(_HINTS.get() or {}), **check_hints(hints)})
    try:
        yield
    finally:
        _HINTS.reset(token)


def var_size(name: str) -> int:
    """The representative size of the symbolic variable ``name`` (see the module docstring)."""
    hints = _HINTS.get() or {}
    if name in hints:
        return int(hints[name])
    return DEFAULT_BATCH if BATCH_NAME.fullmatch(name) else DEFAULT_EXTENT


def is_static(expr) -> bool:
    """True for a Python int or an integer constant."""
    return isinstance(expr, int) or isinstance(expr, tirx.IntImm)


def extent(expr) -> int:
    """An integer extent; a symbolic one (``seq * 4``) is evaluated at the representative sizes
    of its variables (never below 1: a cost model divides by it)."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    analyzer = sym.Analyzer()
    for var in tirx.analysis.undefined_vars(expr, []):
        analyzer.bind(var, var_size(var.name))
    value = analyzer.simplify(expr)
    if isinstance(value, tirx.IntImm):
        return max(int(value.value), 1)
    return DEFAULT_EXTENT  # something no binding resolves (a data-dependent size)


def concrete_shape(shape) -> tuple[int, ...] | None:
    """A shape (ints or PrimExprs) with every extent evaluated; None stays None."""
    if shape is None:
        return None
    return tuple(extent(d) for d in shape)


def numel(shape) -> int | None:
    """Elements of a shape at the representative size; None for an unknown shape."""
    concrete = concrete_shape(shape)
    return None if concrete is None else math.prod(concrete)


def symbolic_vars(func: tirx.PrimFunc) -> list:
    """The symbolic shape variables of a PrimFunc's parameters (buffer shapes, scalar params)."""
    found: dict[str, object] = {}
    for param in func.params:
        shape = getattr(param.ty, "shape", None)
        exprs = list(shape) if shape is not None else [param]
        for expr in exprs:
            if not is_static(expr):
                for var in tirx.analysis.undefined_vars(expr, []):
                    found.setdefault(var.name, var)
    return list(found.values())


def specialize(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every symbolic parameter extent fixed at its representative size, for
    analyses that count (FLOPs, bytes); never used for code that runs."""
    if not symbolic_vars(func):
        return func
    mapping = {}
    bound: set[str] = set()
    for param in func.params:
        shape = getattr(param.ty, "shape", None)
        if shape is None:  # a scalar parameter (a shape variable passed explicitly)
            if not is_static(param) and param.name not in bound:
                mapping[param] = tirx.IntImm(str(param.ty), var_size(param.name))
                bound.add(param.name)
            continue
        # only dims that are a bare variable can be bound (Specialize's rule); compound
        # extents (seq * 4) follow from the variables bound elsewhere
        dims = [tirx.IntImm("int64" if str(d.ty) == "int64" else "int32", var_size(d.name))
                if isinstance(d, tirx.Var) and d.name not in bound else d for d in shape]
        if any(not d.same_as(s) for d, s in zip(dims, shape)):
            bound.update(d.name for d in shape if isinstance(d, tirx.Var))
            mapping[param] = tirx.decl_buffer(dims, param.ty.dtype, param.name)
    try:
        return func.specialize(mapping)
    except Exception:  # noqa: BLE001 (an exotic signature: count at size 1 rather than fail)
        return func


def takes_sizes(call) -> bool:
    """A ``call_tir`` that takes sizes as arguments: ``tir_vars``, or a non-tensor argument (in
    TVM 0.27 a symbolic size travels as a ``PrimType`` variable). FuseTIR loses a fused call's
    result shape, or the size itself, when such a call joins a group (stock FuseOps keeps it
    alone), so no fusion groups one."""
    if not (isinstance(call, relax.Call) and call.op.same_as(_CALL_TIR)):
        return False
    if len(call.args) > 2 and call.args[2] is not None:
        return True
    args = call.args[1]
    args = list(args.fields) if isinstance(args, relax.Tuple) else [args]
    return any(not isinstance(a.ty, (relax.TensorType, relax.TupleType)) for a in args)


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")

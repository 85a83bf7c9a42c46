"""A tensor whose extent is a compound of a symbolic size (``past + 1``) gets a size of its own.

A decode step concatenates the key/value cache (``past`` keys) with the new token's: every
operator after it works on ``past + 1`` keys. TIR binds a size only from a buffer dimension
that *is* a variable, so TVM's legalisation passes ``past`` to each of those kernels as an
extra argument (``call_tir(..., tir_vars=[past])``), and such a call is never fused (FuseTIR
loses the fused call's result shape; docs/symbolic.md): the decode step's attention stayed
four kernels, with the repeated K transposed and written in full.

This pass, run on high-level Relax before legalisation, gives each extent ``v + c`` (a
symbolic size plus a constant) a variable of its own: right after the tensor that introduces
it, a ``match_cast`` to the same shape with ``v + c`` named ``n``; later operators read the
cast tensor and their shape arguments say ``n``, so legalisation writes kernels that bind
``n`` from their buffers. (TVM's ``CanonicalizeBindings`` later folds the cast away again,
``n`` being ``v + c``; the kernels keep their own ``n``.) The graph's outputs keep the
original tensors. If the result is not well formed, or an operator lost its result's shape
(one that cannot prove ``n == v + c``), the function is left as it was.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ..tir_utils import find_all

__all__ = ["BindCompoundExtents", "compound_extent"]

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def BindCompoundExtents() -> tvm.transform.Pass:  # noqa: N802 (a pass constructor)
    """``v + c`` extents of intermediate tensors renamed by a ``match_cast``."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.BindCompoundExtents")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = mod.clone()  # a pass leaves the module it was given as it was
        for gvar, func in mod.functions.items():
            if not isinstance(func, relax.Function) or not _has_compound(func):
                continue
            rename = _Rename(mod)
            try:
                renamed = rename.visit_expr(func)
            except Exception:  # noqa: BLE001 (an operator that will not take the renamed shape)
                continue
            trial = out.clone()
            trial[gvar] = renamed
            # well formed, and no shape lost: an output binding reads the original tensor
            # (``v + c``) beside one that reads the cast (``n``), and an operator that cannot
            # prove ``n == v + c`` (a matmul's batch) infers no shape at all
            if relax.analysis.check_well_formed(trial) and (
                    _shapeless(renamed) <= _shapeless(func)) and not _computes_with(
                    renamed, [n for _, _, n in rename.names]):
                out = trial
        return out

    return _pass


def compound_extent(dim) -> tuple | None:
    """``(v, c)`` when ``dim`` is ``v + c`` with ``v`` a variable and ``c`` a constant ≠ 0."""
    dim = tvm.sym.Analyzer().simplify(dim)
    if isinstance(dim, tirx.Add):
        for a, b in ((dim.a, dim.b), (dim.b, dim.a)):
            if isinstance(a, tvm.ir.Var) and isinstance(b, tirx.IntImm) and int(b.value):
                return a, int(b.value)
    return None


def _shapeless(func: relax.Function) -> int:
    """Bindings of a tensor whose shape is unknown (``R.Tensor(ndim=3)``)."""
    return sum(isinstance(b.var.ty, relax.TensorType) and b.var.ty.shape is None
               for block in func.body.blocks for b in block.bindings)


def _computes_with(func: relax.Function, names: list) -> bool:
    """Whether a shape computes with a new size (a split's ``n - 3``) instead of being it.
    The kernel keeps ``n - 3`` while ``CanonicalizeBindings`` turns Relax's into ``v - 1``
    (``n`` = ``v + 2``), and FuseTIR, matching its parameters' shapes term by term, fails on
    ``3`` against ``1`` (fuzzer seed 259: Pad, Slice, Split over a symbolic batch)."""
    def dims(ty):
        if isinstance(ty, relax.TupleType):
            return [d for field in ty.fields for d in dims(field)]
        return _shape(ty) or []

    for block in func.body.blocks:
        for binding in block.bindings:
            for dim in dims(binding.var.ty):
                if isinstance(dim, tvm.ir.Var):
                    continue
                used = find_all(dim, tvm.ir.Var)
                if any(u.same_as(n) for u in used for n in names):
                    return True
    return False


def _shape(ty):
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return list(ty.shape.values)
    return None


def _has_compound(func: relax.Function) -> bool:
    for block in func.body.blocks if isinstance(func.body, relax.SeqExpr) else ():
        for binding in block.bindings:
            shape = _shape(binding.var.ty)
            if shape and any(compound_extent(d) for d in shape):
                return True
    return False


@relax.expr_functor.mutator
class _Rename(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule | None = None):
        super().__init__()
        self.mod = mod  # for the kernels of legalised calls
        self.names: list = []  # [(v, c, n)]
        self.cast: dict = {}  # original var -> its match_cast (read by dataflow bindings)
        self.output = False  # visiting a binding of the block's outputs

    def _rename_dim(self, dim):
        key = compound_extent(dim)
        if key is None:
            return dim
        for v, c, n in self.names:
            if v.same_as(key[0]) and c == key[1]:
                return n
        return dim

    def visit_shape_expr_(self, op: relax.ShapeExpr):
        return relax.ShapeExpr([self._rename_dim(d) for d in op.values])

    def _rename_ty(self, ty, buffers: list):
        """``ty`` renamed where the kernel's output buffer (``buffers``, in order) binds the
        extent itself (a plain variable); a kernel computing ``v + c`` (the concat) keeps it."""
        if isinstance(ty, relax.TupleType):
            return relax.TupleType([self._rename_ty(f, [b]) for f, b in zip(ty.fields, buffers)])
        shape = _shape(ty)
        theirs = getattr(buffers[0].ty, "shape", None) if buffers else None
        if shape is None or theirs is None or len(theirs) != len(shape):
            return ty
        return relax.TensorType([self._rename_dim(d) if isinstance(b, tvm.ir.Var) else d
                                 for d, b in zip(shape, theirs)], ty.dtype)

    def visit_call_(self, op: relax.Call):
        call = super().visit_call_(op)
        if not (self.names and call.op.same_as(_CALL_TIR) and self.mod is not None):
            return call
        # legalised: the result type is spelled out in ty_args, checked against the kernel's
        func = self.mod[call.args[0]] if call.args[0] in self.mod.functions else None
        if not isinstance(func, tirx.PrimFunc) or len(op.ty_args) != 1:
            return call
        ty = op.ty_args[0]  # as written: the mutator renamed every shape of call.ty_args
        count = len(ty.fields) if isinstance(ty, relax.TupleType) else 1
        outputs = list(func.params)[-count:]
        return relax.Call(call.op, call.args, call.attrs, [self._rename_ty(ty, outputs)],
                          call.span)

    def visit_dataflow_var_(self, op):
        if not self.output and op in self.cast:
            return self.cast[op]
        return super().visit_dataflow_var_(op)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.output = not isinstance(binding.var, relax.DataflowVar)
        super().visit_var_binding_(binding)
        self.output = False
        if not isinstance(binding.var, relax.DataflowVar):
            return
        new_var = self.get_var_remap(binding.var)
        new_var = binding.var if new_var is None else new_var
        shape = _shape(new_var.ty)
        if not shape:
            return
        renamed, fresh = [], False
        for dim in shape:
            key = compound_extent(dim)
            if key is None:
                renamed.append(dim)
                continue
            match = self._rename_dim(dim)
            if match is dim:
                v, c = key
                match = tirx.Var(f"{v.name}_{'plus' if c > 0 else 'minus'}_{abs(c)}", v.ty)
                self.names.append((v, c, match))
            fresh = True
            renamed.append(match)
        if fresh:
            ty = relax.TensorType(renamed, new_var.ty.dtype)
            self.cast[binding.var] = self.builder_.match_cast(new_var, ty)

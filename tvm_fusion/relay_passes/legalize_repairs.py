"""``full``/``full_like`` with an infinite or NaN fill, legalised before TVM's passes see it.

TVM 0.27's legalisation hands ``topi.full`` the result's dtype as a ``PrimType``, whose
``"float" in dtype`` test (the check that a non-finite fill has a float type) raises
``TypeError``; ``FoldConstant`` legalises a constant ``full`` the same way. So
``torch.full((s, s), float("-inf")).triu(1)``, the usual causal mask, did not build from a
torch.export program, stock or ours. This pass emits such a call as TVM would, with the dtype
as text: ``call_tir`` of ``topi.full``, which ``FoldConstant`` folds where the shape is static.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, topi

from .mutate import rewrite_functions

__all__ = ["LegalizeNonFiniteFull"]

_FULL = (tvm.ir.Op.get("relax.full"), tvm.ir.Op.get("relax.full_like"))


def LegalizeNonFiniteFull() -> tvm.transform.Pass:  # noqa: N802 (a pass constructor)
    """``full(shape, ±inf or NaN)`` and ``full_like`` → ``call_tir`` of ``topi.full``."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.LegalizeNonFiniteFull")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Legalize(mod))

    return _pass


def _non_finite_fill(call: relax.Call) -> float | None:
    fill = call.args[1]
    if not isinstance(fill, tvm.ir.expr.Constant):
        return None
    value = fill.value.numpy()
    if value.size != 1 or math.isfinite(float(value.reshape(()))):
        return None
    return float(value.reshape(()))


@relax.expr_functor.mutator
class _Legalize(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.rewritten = 0

    def visit_call_(self, call: relax.Call):
        call = super().visit_call_(call)
        if not (isinstance(call, relax.Call) and any(call.op.same_as(op) for op in _FULL)):
            return call
        value = _non_finite_fill(call)
        shape = call.args[0].ty.shape if call.op.same_as(_FULL[1]) else call.args[0]
        if value is None or not isinstance(shape, relax.ShapeExpr):
            return call
        self.rewritten += 1
        return self.builder_.call_te(topi.full, list(shape.values), str(call.ty.dtype), value,
                                     primfunc_name_hint="full")

"""Gather (``relax.take``) indices that come from the model's inputs are clamped into range.

TVM's ONNX importer maps Gather to ``take(..., mode="fast")`` after normalising negative
indices (``i < 0 ? i + n : i``), and ``fast`` indexes without a bounds check: an index outside
``[-n, n)`` in the data reads outside the tensor, silently or with a crash (TVM's own warning,
"Fast mode segfaults when there are out-of-bounds indices"). ONNX Runtime rejects such an
index. Indices computed from constants are checked once, on the ONNX graph, before import
(:func:`tvm_fusion.compile.import_onnx` names the Gather); indices that depend on the
function's parameters (token ids, say) are only known when the model runs, so this pass gives
those takes ``mode="clip"``: an out-of-range index then reads the nearest row, inside memory,
instead of anything at all. In-range indices, negative ones included, are unaffected, and the
clamp is two integer comparisons per index.
"""

from __future__ import annotations

import tvm
from tvm import relax

__all__ = ["ClampTakeIndices"]

_TAKE = tvm.ir.Op.get("relax.take")


def ClampTakeIndices() -> tvm.transform.Pass:  # noqa: N802 (a pass constructor)
    """``take(mode="fast")`` whose indices depend on a function parameter → ``mode="clip"``."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.ClampTakeIndices")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()  # a pass leaves the module it was given as it was
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                mod[gvar] = _Clamp(mod).visit_expr(func)
        return mod

    return _pass


@relax.expr_functor.mutator
class _Clamp(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.runtime: set = set()  # variables whose value depends on a parameter

    def visit_function_(self, func: relax.Function):
        self.runtime = set(func.params)
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if any(v in self.runtime for v in relax.analysis.free_vars(value)):
            self.runtime.add(binding.var)
        if (isinstance(value, relax.Call) and value.op.same_as(_TAKE)
                and str(value.attrs.mode) == "fast"
                and any(v in self.runtime for v in relax.analysis.free_vars(value.args[1]))):
            axis = value.attrs.axis
            clipped = relax.op.take(self.visit_expr(value.args[0]),
                                    self.visit_expr(value.args[1]),
                                    None if axis is None else int(axis), mode="clip")
            self.builder_.emit_normalized(
                relax.VarBinding(binding.var, self.builder_.normalize(clipped)))
            return
        super().visit_var_binding_(binding)

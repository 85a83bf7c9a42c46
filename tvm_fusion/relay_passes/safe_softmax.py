"""PyTorch's *safe* softmax, decomposed into nine operators, computed as one softmax again.

``torch.export`` decomposes ``scaled_dot_product_attention`` (``nn.MultiheadAttention``,
Hugging Face's default ``sdpa`` attention) with ``aten._safe_softmax``: a row whose scores are
all ``-inf`` (a fully masked query) gives zeros instead of softmax's ``0/0 = NaN``. Imported,
that is the softmax beside a reduction of its own over the same scores::

    where(not(any(x != -inf, axis=-1)), 0, softmax(x, axis=-1))

(``any`` as ``astype(max(astype(·, int8)), bool)``). The attention planner
(:mod:`.attention`) looks for a softmax feeding ``·V`` and found the ``where`` and a fifth
reduction instead, so such attention stayed three kernels with its score matrix in memory
(torch.export's ViT-B ran 1.55× the time of the ONNX exports of the same model).

The pattern is replaced by one PrimFunc, TOPI's softmax with its normalisation guarded:
``exp(x - max) / sum`` where ``sum != 0``, else 0. The two agree on every input: the running
max starts at the lowest finite float, so ``sum`` is exactly 0 iff every score is ``-inf``
(a finite score contributes ``exp(0) = 1`` at the max, a NaN or ``+inf`` makes the sum NaN,
and those rows are NaN in both). The attention template reads the guard
(``AttentionPattern.zero_empty_rows``) and applies it to its running sum.

Only float32 softmaxes are replaced: a 16-bit softmax keeps the operators (its float32 sums
are :mod:`.accumulate`'s).
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, te, tirx

from .mutate import BindingRewriter, rewrite_functions

__all__ = ["FoldSafeSoftmax", "safe_softmax"]

_OP = {name: tvm.ir.Op.get(f"relax.{name}") for name in (
    "where", "nn.softmax", "logical_not", "equal", "not_equal", "astype", "max", "full_like",
    "zeros_like")}


def safe_softmax(x: te.Tensor) -> te.Tensor:
    """Softmax over the last axis with rows of only ``-inf`` giving 0 (TOPI's stages and names,
    the normalisation guarded)."""
    shape, last = x.shape, len(x.shape) - 1
    k1 = te.reduce_axis((0, shape[last]), name="k")
    k2 = te.reduce_axis((0, shape[last]), name="k")
    rows = tuple(shape[:last])
    max_elem = te.compute(rows, lambda *r: te.max(x[r + (k1,)], axis=k1),
                          name="T_softmax_maxelem")
    exp = te.compute(shape, lambda *i: te.exp(x[i] - max_elem[i[:last]]), name="T_softmax_exp")
    expsum = te.compute(rows, lambda *r: te.sum(exp[r + (k2,)], axis=k2),
                        name="T_softmax_expsum")
    zero = tirx.const(0.0, x.dtype)
    return te.compute(
        shape, lambda *i: tirx.Select(expsum[i[:last]] == zero, zero,
                                      exp[i] / expsum[i[:last]]),
        name="T_softmax_norm", attrs={"axis": last})


def FoldSafeSoftmax() -> tvm.transform.Pass:  # noqa: N802 (a pass constructor)
    """``where(no score above -inf in the row, 0, softmax(scores))`` → one guarded softmax."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.FoldSafeSoftmax")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Fold(mod))

    return _pass


def _is_call(expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and expr.op.same_as(_OP[name])


def _is_const(expr, value: float) -> bool:
    if not isinstance(expr, tvm.ir.expr.Constant):
        return False
    data = expr.value.numpy()
    return data.size == 1 and float(data.reshape(())) == value


def _last_axis(axis, ndim: int) -> bool:
    return int(axis) in (-1, ndim - 1)


@relax.expr_functor.mutator
class _Fold(BindingRewriter):
    def _skip_casts(self, expr):
        expr = self.bound(expr)
        while _is_call(expr, "astype"):
            expr = self.bound(expr.args[0])
        return expr

    def _no_finite_score(self, cond, scores, ndim: int) -> bool:
        """``cond`` is ``not(any(scores != -inf))`` over the last axis, kept as a column."""
        cond = self._skip_casts(cond)
        if not _is_call(cond, "logical_not"):
            return False
        red = self._skip_casts(cond.args[0])
        if not (_is_call(red, "max") and red.attrs.keepdims and red.attrs.axis is not None
                and len(red.attrs.axis) == 1 and _last_axis(red.attrs.axis[0], ndim)):
            return False
        test = self._skip_casts(red.args[0])
        if _is_call(test, "logical_not"):
            test = self.bound(test.args[0])
            if not _is_call(test, "equal"):
                return False
        elif not _is_call(test, "not_equal"):
            return False
        a, b = test.args
        if self.bound(b).same_as(self.bound(scores)):
            a, b = b, a
        return self.bound(a).same_as(self.bound(scores)) and _is_const(
            self.bound(b), -math.inf)

    def _is_zero(self, expr) -> bool:
        expr = self.bound(expr)
        return _is_const(expr, 0.0) or _is_call(expr, "zeros_like") or (
            _is_call(expr, "full_like") and _is_const(self.bound(expr.args[1]), 0.0))

    def _match(self, value):
        """The scores of a safe softmax bound to ``value``, or None."""
        if not _is_call(value, "where"):
            return None
        cond, zero, probs = value.args
        sm = self.bound(probs)
        if not _is_call(sm, "nn.softmax"):
            return None
        scores = sm.args[0]
        sinfo = scores.ty
        if not (isinstance(sinfo, relax.TensorType) and sinfo.ndim > 0
                and sinfo.dtype == "float32" and _last_axis(sm.attrs.axis, sinfo.ndim)):
            return None
        if not (self._is_zero(zero) and self._no_finite_score(
                cond, scores, sinfo.ndim)):
            return None
        if value.ty.ndim != sinfo.ndim:  # a broadcast by the where
            return None
        return scores

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.values[binding.var] = binding.value
        scores = self._match(binding.value)
        if scores is None:
            super().visit_var_binding_(binding)
            return
        call = self.builder_.call_te(safe_softmax, self.visit_expr(scores),
                                     primfunc_name_hint="safe_softmax")
        self.rewritten += 1
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(call)))

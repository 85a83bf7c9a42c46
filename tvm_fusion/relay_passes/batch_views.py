"""A batched matmul over flattened batch axes computed over the axes themselves.

torch decomposes ``q @ k.transpose(-1, -2)`` on ``(batch, heads, n, d)`` tensors into
``bmm`` of 3-D views: ``reshape(q, (batch·heads, n, d))``, the ``bmm``, and a view of its result
back to ``(batch, heads, n, n)`` (``torch.export``'s attention; an ``expand`` to the same shape
sits between as well). With a symbolic batch the flattened extent ``batch·heads`` does not
name ``batch``, so TVM passes ``batch`` to the ``bmm``'s kernel as a size argument, and a kernel
taking sizes cannot be fused (FuseTIR loses its result's shape: ``ecg.takes_sizes``): the
attention of such a program stayed three kernels with its score matrix in memory.

Two exact rewrites undo the flattening:

* ``matmul(reshape(a, (B₁⋯Bₜ, m, k)), reshape(b, (B₁⋯Bₜ, k, n)))`` with ``a`` of shape
  ``(B₁, …, Bₜ, m, k)`` and ``b`` of ``(B₁, …, Bₜ, k, n)`` (each seen through a
  ``broadcast_to`` of its own shape) → ``reshape(matmul(a, b), (B₁⋯Bₜ, m, n))``;
* ``reshape(reshape(x, s), shape(x))`` → ``x``.

The matmul computes the same sums in the same order; only its indexing changes.
"""

from __future__ import annotations

import tvm
from tvm import relax, sym

from .mutate import BindingRewriter, rewrite_functions

__all__ = ["UnflattenBatchMatmul"]

_RESHAPE = tvm.ir.Op.get("relax.reshape")
_MATMUL = tvm.ir.Op.get("relax.matmul")
_BROADCAST_TO = tvm.ir.Op.get("relax.broadcast_to")


def UnflattenBatchMatmul() -> tvm.transform.Pass:  # noqa: N802 (a pass constructor)
    """Batched matmuls over flattened batch axes → over the axes; reshape round trips → none."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.UnflattenBatchMatmul")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Unflatten(mod))

    return _pass


def _shape(expr) -> list | None:
    ty = expr.ty
    shape = getattr(ty, "shape", None)
    if not isinstance(ty, relax.TensorType) or shape is None or not hasattr(shape, "values"):
        return None
    return list(shape.values)


def _same(ana: sym.Analyzer, a: list, b: list) -> bool:
    return len(a) == len(b) and all(ana.can_prove_equal(x, y) for x, y in zip(a, b))


@relax.expr_functor.mutator
class _Unflatten(BindingRewriter):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.ana = sym.Analyzer()

    def _bound(self, expr, op):
        """The call of ``op`` bound to variable ``expr``, else None."""
        value = self.values.get(expr) if isinstance(expr, relax.Var) else None
        return value if isinstance(value, relax.Call) and value.op.same_as(op) else None

    def _unflattened(self, arg, batch: list | None):
        """(source, its batch extents) when ``arg`` is a reshape of a tensor whose leading
        axes the reshape's first axis flattens (its last two kept); ``batch`` the extents the
        other operand had, which these must equal."""
        call = self._bound(arg, _RESHAPE)
        out = _shape(arg)
        if call is None or out is None or len(out) != 3:
            return None
        src = call.args[0]
        while (wide := self._bound(src, _BROADCAST_TO)) is not None and _shape(
                wide.args[0]) is not None and _same(self.ana, _shape(wide.args[0]), _shape(src)):
            src = wide.args[0]  # a broadcast to its own shape: a copy
        shape = _shape(src)
        if shape is None or len(shape) < 4 or not _same(self.ana, shape[-2:], out[-2:]):
            return None
        flat = shape[0]
        for ext in shape[1:-2]:
            flat = flat * ext
        if not self.ana.can_prove_equal(flat, out[0]):
            return None
        if batch is not None and not _same(self.ana, shape[:-2], batch):
            return None
        return src, shape[:-2]

    def _rewrite(self, value):
        if value.op.same_as(_RESHAPE):  # reshape(reshape(x, s), shape(x)) -> x
            inner = self._bound(value.args[0], _RESHAPE)
            if inner is not None and _shape(inner.args[0]) is not None and _shape(
                    value) is not None and _same(self.ana, _shape(inner.args[0]), _shape(value)):
                return self.visit_expr(inner.args[0])
            return None
        if not value.op.same_as(_MATMUL):
            return None
        lhs = self._unflattened(value.args[0], None)
        rhs = lhs and self._unflattened(value.args[1], lhs[1])
        if not rhs or _shape(value) is None:
            return None
        product = self.builder_.emit(relax.op.matmul(
            self.visit_expr(lhs[0]), self.visit_expr(rhs[0]), out_dtype=value.attrs.out_dtype))
        return relax.op.reshape(product, _shape(value))

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        self.values[binding.var] = value
        new = self._rewrite(value) if isinstance(value, relax.Call) else None
        if new is None:
            super().visit_var_binding_(binding)
            return
        self.rewritten += 1
        new = self.builder_.normalize(new)
        self.values[binding.var] = new  # over the new variables (the reshape test reads it)
        if isinstance(new, relax.Var) and isinstance(binding.var, relax.DataflowVar):
            self.set_var_remap(binding.var, new)
        else:
            self.builder_.emit_normalized(relax.VarBinding(binding.var, new))

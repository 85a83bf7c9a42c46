"""Running a Relax ``PyExprMutator`` over every Relax function of a module, as a module pass
of its own would: the graph rewrites before planning (batch_views, safe_softmax,
legalize_repairs) share it."""

from __future__ import annotations

import tvm
from tvm import relax

__all__ = ["BindingRewriter", "rewrite_functions"]


class BindingRewriter(relax.PyExprMutator):
    """Base of a rewrite that reads what variables are bound to: ``values`` maps each variable
    visited so far to its expression (a subclass's ``visit_var_binding_`` records it),
    ``rewritten`` counts the bindings replaced (:func:`rewrite_functions` reads it)."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.values: dict = {}
        self.rewritten = 0

    def bound(self, expr):
        """The expression behind ``expr``, through variable bindings."""
        while isinstance(expr, relax.Var) and expr in self.values:
            expr = self.values[expr]
        return expr


def rewrite_functions(mod: tvm.IRModule, mutator: relax.PyExprMutator) -> tvm.IRModule:
    """``mod`` with each Relax function visited by ``mutator``, whose ``rewritten`` counts the
    bindings it replaced; what the replacements left unused is removed. ``mod`` itself when
    nothing was replaced (a pass leaves the module it was given as it was)."""
    changed = False
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            new = mutator.visit_expr(func)
            if mutator.rewritten:
                mutator.builder_.update_func(gvar, relax.analysis.remove_all_unused(new))
                changed, mutator.rewritten = True, 0
    return mutator.builder_.finalize() if changed else mod

"""Running a Relax ``PyExprMutator`` over every Relax function of a module, as a module pass
of its own would: the graph rewrites before planning (batch_views, safe_softmax,
legalize_repairs) share it."""

from __future__ import annotations

import tvm
from tvm import relax

__all__ = ["rewrite_functions"]


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

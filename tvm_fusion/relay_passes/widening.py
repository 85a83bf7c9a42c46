"""One copy of a widening operator per consumer, before planning.

A ``DequantizeLinear`` (int8 → float32) or a cast up (float16 → float32) read by several
operators can be the prologue of only one of their kernels; the others would read its float32
result, which that kernel must then write (four times the bytes of the int8 tensor). Recomputing
it is an elementwise pass over a tensor every reader loads anyway, so each reader gets its own
copy: every kernel of a QDQ graph reads int8 (a residual's second reader, the Q/K/V matmuls
reading one LayerNorm output). Stock FuseOps (strategy ``"tvm"``) never sees this.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from .grouping import is_primitive

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def widens(call: relax.Expr, result: relax.Var) -> bool:
    """``call`` is a ``call_tir`` whose one result has the shape of its largest non-constant
    argument in a wider dtype."""
    if not (isinstance(call, relax.Call) and call.op.same_as(_CALL_TIR)):
        return False
    out = result.ty
    if not isinstance(out, relax.TensorType) or out.shape is None:
        return False
    args = call.args[1]
    args = list(args.fields) if isinstance(args, relax.Tuple) else [args]
    data = [a for a in args if isinstance(a, relax.Var) and isinstance(a.ty, relax.TensorType)]
    if len(data) != 1 or data[0].ty.shape is None:
        return False
    src = data[0].ty
    return (tvm_ffi.structural_equal(src.shape, out.shape)
            and tvm.DataType(str(out.dtype)).bits > tvm.DataType(str(src.dtype)).bits)


def duplicate_widening(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with each widening ``call_tir`` read by several bindings of its dataflow block
    emitted once per reader (see the module docstring); nothing else changes."""
    rewriter = _Duplicate(mod)
    changed = False
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and not is_primitive(func):
            new_func = rewriter.visit_expr(func)
            if not new_func.same_as(func):
                rewriter.builder_.update_func(gvar, new_func)
                changed = True
    return rewriter.builder_.get() if changed else mod


@relax.expr_functor.mutator
class _Duplicate(relax.PyExprMutator):
    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        bindings = list(block.bindings)
        readers: dict = {}
        for pos, b in enumerate(bindings):
            for var in relax.analysis.free_vars(b.value):
                readers.setdefault(var, []).append(pos)
        copies = {b.var: readers[b.var] for b in bindings
                  if isinstance(b.var, relax.DataflowVar) and len(readers.get(b.var, [])) > 1
                  and widens(b.value, b.var)
                  and all(isinstance(bindings[r].value, relax.Call) for r in readers[b.var])}
        if not copies:
            return super().visit_dataflow_block_(block)
        own: dict[int, dict] = {}  # reader position -> {widening var: its copy}
        self.builder_._begin_dataflow_block()
        for pos, b in enumerate(bindings):
            for var, copy in own.get(pos, {}).items():
                self.set_var_remap(var.vid if hasattr(var, "vid") else var, copy)
            if b.var in copies:
                value = self.visit_expr(b.value)
                for reader in dict.fromkeys(copies[b.var]):
                    copy = self.builder_.emit(relax.Call(value.op, value.args, value.attrs,
                                                         value.ty_args), b.var.name)
                    own.setdefault(reader, {})[b.var] = copy
                continue
            self.visit_binding(b)
        return self.builder_._end_block()


__all__ = ["duplicate_widening", "widens"]

"""ONNX node names on the Relax bindings they became, carried as the binding variables' spans.

TVM 0.27's ONNX importer (``relax.frontend.onnx``) keeps no node names: every binding is an
``lv``. To say which ONNX node an operator of a fusion plan came from (the plan's picture, issue
25), the project's importer (:mod:`tvm_fusion.frontend`, a subclass of TVM's) records the
expressions each node converts to, and :func:`name_bindings` gives every binding of ``main`` a
``Span`` whose source name is that node's name (``frontend.from_onnx(..., node_names=True)``):

* a binding whose value (or variable) *is* a node's result object is that node's;
* a binding the importer emitted inside a node's conversion (a Conv's bias reshape, the steps
  of a decomposed operator) is read by that node's result and by nothing else, so it takes
  the name of the first named binding that reads it (bindings are walked backwards).

Spans travel with the variables: ``ExprMutator`` keeps a binding's variable (or re-creates it
with the same span) when it rewrites the value, so legalisation and planning keep them and the
ECG's ``node.var`` still carries its ONNX name. An operator that a pass made from several
(rewriting, SmartMem's copies) keeps the span of the binding it replaced, or none.
"""

from __future__ import annotations

import tvm
from tvm import relax

__all__ = ["SOURCE_SEPARATOR", "bind_like", "joined_span", "name_bindings", "node_name",
           "node_names"]

SOURCE_SEPARATOR = " + "  # between the names of a binding that merged several (a fused group)


def name_bindings(mod: tvm.IRModule, results) -> tvm.IRModule:
    """``mod`` with every binding of ``main`` spanned by the name of the ONNX node it came
    from; ``results`` lists, per converted node in order, ``(name, expressions)``: the node's
    name and the expressions its conversion produced (what an importer records,
    :class:`tvm_fusion.frontend.onnx_import.RepairingImporter`)."""
    origin: dict = {}
    for name, exprs in results:
        for expr in exprs:
            origin.setdefault(expr, name)
    mod["main"] = _Spanner(origin).visit_expr(mod["main"])
    return mod


def node_name(var: relax.Var) -> str | None:
    """The ONNX node ``var``'s binding came from (:func:`name_bindings`), or None;
    several joined by :data:`SOURCE_SEPARATOR` when a pass merged their bindings."""
    span = getattr(var, "span", None)
    source = getattr(span, "source_name", None) if span is not None else None
    return str(source.name) if source is not None else None


def node_names(var: relax.Var) -> list[str]:
    """:func:`node_name` as a list (empty when the binding has no ONNX name)."""
    name = node_name(var)
    return name.split(SOURCE_SEPARATOR) if name else []


def joined_span(names) -> tvm.ir.Span | None:
    """One span naming ``names`` (ONNX nodes, in order, without repeats), or None if empty."""
    unique = list(dict.fromkeys(n for n in names if n))
    if not unique:
        return None
    return tvm.ir.Span(tvm.ir.SourceName(SOURCE_SEPARATOR.join(unique)), 0, 0, 0, 0)


def bind_like(builder: relax.BlockBuilder, old: relax.Var, value: relax.Expr,
              span: tvm.ir.Span | None = None) -> relax.Var:
    """Emit ``value`` into ``builder`` bound to a new variable like ``old`` (its name, and a
    ``DataflowVar`` or an output as ``old`` is) with ``old``'s span, or ``span``: for passes
    that re-emit a binding, so that its ONNX name travels with it."""
    value = builder.normalize(value)
    kind = relax.DataflowVar if isinstance(old, relax.DataflowVar) else relax.Var
    new = kind(old.name, value.ty, span if span is not None else getattr(old, "span", None))
    builder.emit_normalized(relax.VarBinding(new, value))
    return new


def _names_of_bindings(func: relax.Function, origin: dict) -> dict:
    """Binding variable -> ONNX node name, by identity of the result, else by first reader."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    readers: dict = {}
    for b in bindings:
        for used in relax.analysis.free_vars(b.value):
            readers.setdefault(used, []).append(b.var)
    names: dict = {}
    for b in reversed(bindings):
        name = origin.get(b.value) or origin.get(b.var)
        if name is None:
            name = next((names[r] for r in readers.get(b.var, []) if r in names), None)
        if name is not None:
            names[b.var] = name
    return names


@relax.expr_functor.mutator
class _Spanner(relax.PyExprMutator):
    def __init__(self, origin: dict):
        super().__init__()
        self.origin = origin
        self.names: dict = {}

    def visit_function_(self, func: relax.Function):
        self.names = _names_of_bindings(func, self.origin)
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        old = binding.var
        name = self.names.get(old)
        if name is None:
            self.builder_.emit_normalized(relax.VarBinding(old, value))
            return
        span = tvm.ir.Span(tvm.ir.SourceName(name), 0, 0, 0, 0)
        kind = relax.DataflowVar if isinstance(old, relax.DataflowVar) else relax.Var
        new = kind(old.name, old.ty, span)
        self.builder_.emit_normalized(relax.VarBinding(new, value))
        self.set_var_remap(old, new)

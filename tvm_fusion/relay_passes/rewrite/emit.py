"""Lowering a rewritten :class:`~.ir.BlockGraph` back to a Relax dataflow block.

Bindings keep their original order and variables. A node a rewrite left untouched is re-emitted
from its original binding; a node whose operands changed, and every node a rewrite created, is
rebuilt from its op and attributes; created nodes are emitted just before their first use. A
replaced node that something outside the graph still names (a graph output, an unmodelled op)
becomes a plain alias binding, which ``CanonicalizeBindings`` removes afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import relax

from ...onnx_names import bind_like, joined_span, node_names
from .ir import (
    ELEMENTWISE_BINARY,
    ELEMENTWISE_UNARY,
    REDUCTIONS,
    BlockGraph,
    Leaf,
    Node,
    SymDim,
)


def relax_call(node: Node, args: list) -> relax.Expr:
    """The Relax expression for one node, its operands already lowered."""
    op, attrs = node.op, node.attrs
    if op in ELEMENTWISE_BINARY or op in ELEMENTWISE_UNARY:
        return getattr(relax.op, op)(*args)
    if op in REDUCTIONS:
        return getattr(relax.op, op)(args[0], axis=list(attrs["axis"]), keepdims=attrs["keepdims"])
    if op == "matmul":
        return relax.op.matmul(args[0], args[1])
    if op == "permute_dims":
        return relax.op.permute_dims(args[0], list(attrs["axes"]))
    if op == "reshape":
        return relax.op.reshape(args[0], [d.expr if isinstance(d, SymDim) else d
                                          for d in attrs["shape"]])
    if op == "split":
        return relax.op.split(args[0], list(attrs["indices"]), axis=attrs["axis"])
    if op == "get_item":
        return relax.TupleGetItem(args[0], attrs["index"])
    raise ValueError(f"cannot lower {op}")


@relax.expr_functor.mutator
class BlockRewriter(relax.PyExprMutator):
    """Lift every dataflow block, let ``rewrite_graph`` rewrite it, lower it back."""

    def __init__(self, mod, rewrite_graph: Callable[[BlockGraph], None]):
        super().__init__(mod)
        self.rewrite_graph = rewrite_graph
        self._emitted: dict = {}
        self._aliased_by: dict = {}  # created node -> the original nodes that became it

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        graph = BlockGraph(block)
        self.rewrite_graph(graph)
        self._aliased_by = {}
        for n in graph.nodes:
            if isinstance(n.alias, Node):
                self._aliased_by.setdefault(n.alias, []).append(n)
        self._emitted = {}
        self.builder_._begin_dataflow_block()
        for binding in block.bindings:
            node = graph.node_of_var.get(binding.var)
            if node is None:
                self.visit_binding(binding)
            elif node.alive:
                self._ensure(node)
        self._emitted = {}
        return self.builder_._end_block()

    # -- values ------------------------------------------------------------------------------
    def _lowered(self, value) -> relax.Expr:
        if isinstance(value, Leaf):
            expr = value.to_relax()
            return self.visit_expr(expr) if isinstance(expr, relax.Var) else expr
        return self._ensure(value)

    def _ensure(self, node: Node) -> relax.Expr:
        """Emit ``node`` after whatever it needs (iteratively: chains can be thousands deep)."""
        stack = [node]
        while stack:
            top = stack[-1]
            if top in self._emitted:
                stack.pop()
                continue
            operands = [top.alias] if top.alias is not None else top.args
            pending = [a for a in operands if isinstance(a, Node) and a not in self._emitted]
            if pending:
                stack.extend(pending)
                continue
            self._emitted[top] = self._emit(top)
            stack.pop()
        return self._emitted[node]

    def _emit(self, node: Node) -> relax.Var:
        if node.alias is not None:
            value = self._lowered(node.alias)
        elif node.var is not None and not node.modified:
            value = self.visit_expr(node.call)
        else:
            value = relax_call(node, [self._lowered(a) for a in node.args])
        return self._bind(node, value)

    def _created_span(self, node: Node):
        """A created node computes (part of) the results of the original nodes that became
        it or the created nodes it feeds (their ``alias``): their ONNX names
        (tvm_fusion.onnx_names); None when it replaces no named original."""
        names: list[str] = []
        seen, stack = {node}, [node]
        while stack:
            current = stack.pop()
            for original in self._aliased_by.get(current, []):
                names += [n for n in node_names(original.var) if n not in names]
            for user in current.users:
                if user not in seen and getattr(user, "var", None) is None:
                    seen.add(user)
                    stack.append(user)
        return joined_span(names)

    def _bind(self, node: Node, value) -> relax.Var:
        old = node.var
        if old is None:
            span = self._created_span(node)
            if span is None:
                return self.builder_.emit(value, "rw")
            value = self.builder_.normalize(value)
            new = relax.DataflowVar(self.builder_.get_unique_name("rw"), value.ty, span)
            self.builder_.emit_normalized(relax.VarBinding(new, value))
            return new
        new = bind_like(self.builder_, old, value)  # its name, kind and ONNX name (span)
        self.set_var_remap(old, new)
        return new

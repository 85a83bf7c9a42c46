"""Turn a fusion plan into ``Primitive`` Relax functions, exactly as ``FuseOps`` would.

TVM's own ``FuseTIR`` then merges each such function into one PrimFunc; we never reimplement
it. A group need not be contiguous in the binding order, so the dataflow block is re-emitted in
a topological order of the groups (every plan is acyclic by construction). Constants are lifted
to parameters (``FuseTIR`` rejects tensor constants inside primitive functions); a value used
outside its group, including a graph output inside a block, becomes an extra output and the
function returns a tuple.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import tvm
from tvm import relax
from tvm.ir.expr import GenericConst

from ..onnx_names import bind_like, joined_span, node_names

GroupFn = Callable[[str, int, relax.DataflowBlock], list[list[int]]]

_MAX_NAME = 64


def group_bindings(mod: tvm.IRModule, group_fn: GroupFn) -> tvm.IRModule:
    """Outline the groups chosen by ``group_fn`` in every non-primitive Relax function.

    ``group_fn(function_name, block_index, block)`` returns groups of binding positions;
    groups of one binding are left as they are. Returns a new module; run ``FuseTIR`` on it next.
    """
    rewriter = _GroupRewriter(mod, group_fn)
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and not is_primitive(func):
            rewriter.current_name = gvar.name_hint
            rewriter.block_index = 0
            new_func = rewriter.visit_expr(func)
            rewriter.builder_.update_func(gvar, new_func)
    return relax.transform.DeadCodeElimination()(rewriter.builder_.get())


def is_primitive(func: relax.Function) -> bool:
    """A function FuseOps (or we) outlined for FuseTIR: never planned again."""
    return func.attrs is not None and "Primitive" in func.attrs and bool(func.attrs["Primitive"])


def primitive_callees(mod: tvm.IRModule) -> dict[str, tuple[str, ...]]:
    """Name of each ``Primitive`` function → the sorted PrimFunc names it calls (FuseTIR names
    the fused PrimFunc after the primitive function)."""
    found = {}
    for gvar, func in mod.functions.items():
        if not (isinstance(func, relax.Function) and is_primitive(func)):
            continue
        names = []

        def visit(node, names=names):
            if isinstance(node, relax.Call) and isinstance(node.op, tvm.ir.Op) and (
                    node.op.name == "relax.call_tir"):
                names.append(node.args[0].name_hint)

        relax.analysis.post_order_visit(func, visit)
        found[gvar.name_hint] = tuple(sorted(names))
    return found


@relax.expr_functor.mutator
class _GroupRewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, group_fn: GroupFn):
        super().__init__(mod)
        self.group_fn = group_fn
        self.current_name = ""
        self.block_index = 0

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        groups = [sorted(g) for g in self.group_fn(self.current_name, self.block_index, block)
                  if len(g) > 1]
        self.block_index += 1
        bindings = list(block.bindings)
        unit_of = _assign_units(bindings, groups)
        self.builder_._begin_dataflow_block()
        for unit in _unit_order(bindings, unit_of, len(groups)):
            if unit < len(groups):
                self._emit_group(bindings, groups[unit], unit_of, unit)
            else:
                self.visit_binding(bindings[unit - len(groups)])
        return self.builder_._end_block()

    # ------------------------------------------------------------------------------ a group

    def _emit_group(self, bindings, members: list[int], unit_of: list[int], unit: int) -> None:
        group = [bindings[i] for i in sorted(p for p, u in enumerate(unit_of) if u == unit)]
        defined = {b.var for b in group}  # Var objects: Relax names need not be unique
        inputs: list[relax.Var] = []
        consts: list[GenericConst] = []
        for b in group:
            for var in relax.analysis.free_vars(b.value):
                if var not in defined and var not in inputs:
                    inputs.append(var)
            for const in _constants(b.value):
                if not any(const.same_as(c) for c in consts):
                    consts.append(const)
        used_outside = set()
        for pos, b in enumerate(bindings):
            if unit_of[pos] != unit:
                used_outside |= set(relax.analysis.free_vars(b.value))
        outputs = [b.var for b in group
                   if b.var in used_outside or not isinstance(b.var, relax.DataflowVar)]

        name = _function_name(group)
        params = [relax.Var(v.name, v.ty) for v in inputs]
        cparams = [relax.Var(f"param_{i}", c.ty) for i, c in enumerate(consts)]
        sizes = _sizes_not_in_params(group, params)
        if sizes:  # passed as a shape, which FuseTIR turns into the PrimFunc's size arguments
            cparams.append(relax.Var("sizes", relax.ShapeType(sizes)))
        inner = relax.BlockBuilder()
        subst = _Substitute(dict(zip(inputs, params)), list(zip(consts, cparams)))
        with inner.function(name, params + cparams, attrs={"Primitive": True}, private=True):
            with inner.dataflow():
                for b in group:
                    new_var = inner.emit(subst.visit_expr(b.value), b.var.name)
                    subst.var_map[b.var] = new_var
                results = [subst.var_map[o] for o in outputs]
                ret = inner.emit_output(results[0] if len(results) == 1 else relax.Tuple(results))
            inner.emit_func_output(ret)
        gvar = self.builder_.add_func(inner.get()[name], name)

        call = relax.Call(gvar, [self.visit_expr(v) for v in inputs] + consts + (
            [relax.ShapeExpr(sizes)] if sizes else []))
        span = _joined_span(group)
        if len(outputs) == 1:
            self._bind(outputs[0], call, span)
            return
        packed = self.builder_.emit(call, "fused")
        for i, out in enumerate(outputs):
            self._bind(out, relax.TupleGetItem(packed, i), span)

    def _bind(self, old_var: relax.Var, value, span) -> None:
        """Bind ``value`` to a fresh variable named and typed as ``old_var``, spanned by
        ``span`` (where the group's bindings came from: tvm_fusion.onnx_names)."""
        new_var = bind_like(self.builder_, old_var, value, span)
        self.set_var_remap(old_var.vid if hasattr(old_var, "vid") else old_var, new_var)


def _sizes_not_in_params(group, params) -> list:
    """Symbolic sizes the group's operators use that no parameter's shape defines.

    A parameter of shape ``(batch * 4, 17)`` does not define ``batch``, so a group that
    reshapes it to ``(batch, 4, 17)`` would return a tensor of unknown shape (and fail in
    ``call_tir`` lowering). Stock FuseOps avoids such groups by keeping a reshape like that
    alone (its pattern is opaque); the group passes these sizes as a shape argument instead."""
    defined = set()
    for param in params:
        defined |= set(relax.analysis.definable_tir_vars_in_type(param.ty))
    missing = []
    for binding in group:
        used = list(relax.analysis.tir_vars_in_type(binding.var.ty)) + list(
            relax.analysis.free_symbolic_vars(binding.value))
        for var in used:
            if var not in defined and not any(var.same_as(m) for m in missing):
                missing.append(var)
    return missing


def _joined_span(group) -> tvm.ir.Span | None:
    """One span naming the sources of every binding of ``group`` (tvm_fusion.onnx_names)."""
    return joined_span(name for b in group for name in node_names(b.var))


@relax.expr_functor.mutator
class _Substitute(relax.PyExprMutator):
    """Rename free vars to the group's parameters and constants to the lifted ones."""

    def __init__(self, var_map: dict, const_map: list):
        super().__init__()
        self.var_map = var_map
        self.const_map = const_map

    def visit_var_(self, var):
        return self.var_map.get(var, var)

    def visit_dataflow_var_(self, var):
        return self.var_map.get(var, var)

    def visit_generic_const_(self, const):
        for old, new in self.const_map:
            if const.same_as(old):
                return new
        return const


def _constants(expr) -> list[GenericConst]:
    found: list[GenericConst] = []

    def visit(node):
        if isinstance(node, GenericConst):
            found.append(node)

    relax.analysis.post_order_visit(expr, visit)
    return found


def _assign_units(bindings, groups: list[list[int]]) -> list[int]:
    """Unit of each binding: its group, or ``len(groups) + position`` for a lone binding.

    A ``TupleGetItem`` of a grouped value joins that group (it is an alias, not an operator).
    """
    unit_of = [len(groups) + pos for pos in range(len(bindings))]
    for g, members in enumerate(groups):
        for pos in members:
            unit_of[pos] = g
    owner = {b.var: unit_of[pos] for pos, b in enumerate(bindings)}
    for pos, b in enumerate(bindings):
        value = b.value
        if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
            src = owner.get(value.tuple_value)
            if src is not None and src < len(groups):
                unit_of[pos] = src
                owner[b.var] = src
    return unit_of


def _unit_order(bindings, unit_of: list[int], num_groups: int) -> list[int]:
    """Units in a topological order, earliest original binding first among ready ones."""
    defined_in = {b.var: unit_of[pos] for pos, b in enumerate(bindings)}
    first_pos: dict[int, int] = {}
    deps: dict[int, set[int]] = {}
    for pos, b in enumerate(bindings):
        unit = unit_of[pos]
        first_pos.setdefault(unit, pos)
        deps.setdefault(unit, set())
        for var in relax.analysis.free_vars(b.value):
            src = defined_in.get(var)
            if src is not None and src != unit:
                deps[unit].add(src)
    users: dict[int, list[int]] = {u: [] for u in deps}
    missing = {u: len(d) for u, d in deps.items()}
    for unit, d in deps.items():
        for src in d:
            users[src].append(unit)
    ready = [(first_pos[u], u) for u, n in missing.items() if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, unit = heapq.heappop(ready)
        order.append(unit)
        for user in users[unit]:
            missing[user] -= 1
            if missing[user] == 0:
                heapq.heappush(ready, (first_pos[user], user))
    if len(order) != len(deps):
        raise ValueError("fusion plan has a cycle between groups; this is a planner bug")
    return order


def _function_name(group) -> str:
    parts = []
    for b in group:
        value = b.value
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and (
            value.op.name == "relax.call_tir"
        ):
            parts.append(value.args[0].name_hint)
    name = "fused_" + "_".join(parts or ["group"])
    return name if len(name) <= _MAX_NAME else name[: _MAX_NAME - 5] + f"_{len(parts)}ops"

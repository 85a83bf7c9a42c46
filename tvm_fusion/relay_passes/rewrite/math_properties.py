"""DNNFusion's mathematical-property graph rewriting (PLDI'21 §4.2) on high-level Relax.

``RewriteByMathProperties`` runs before legalisation, on the module ``from_onnx`` produces
(weights are constants). It does what §4.2 describes:

1. partition each dataflow block at operators with none of the associative, distributive or
   commutative properties (softmax, layer_norm, take, tanh, ... are cut points);
2. in each partition, evaluate every matching rule (:data:`RULES`) and apply the one with the
   largest FLOPs reduction;
3. repeat until no rule matches, then fold constants (§8.3 item 14 of the notes: Figure 2's
   ``Recip(C)`` and ``C + D`` only pay once folded).

Only strict improvements are applied. The cost is ``(FLOPs, elements loaded, operators)``
compared lexicographically (:mod:`.rewrite_cost`), so the paper's § rows ("no FLOPs gain, A is
loaded once instead of twice") apply, a zero-gain swap never does, and every step decreases a
well-founded order: the loop terminates. Commutative operand swaps (Table 4 row 8) are never
steps at all: chains are matched as multisets.

Soundness comes first: a rule fires only when its preconditions are proven from static shapes,
dtypes, constness and a small range analysis (``abs``, ``exp``, ``square``, ``relu``, ... are
non-negative). Rules that change rounding or overflow are switched off by
``allow_fp_reassociation=False``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import tvm
from tvm import relax

from ...instrument import emit
from ..grouping import is_primitive
from .cost import ZERO, add_costs, module_flops, node_cost, sub_costs
from .emit import BlockRewriter
from .ir import BlockGraph, Leaf, Node, Refuse, Value, reset_keys
from .rules import RULES, Ctx, Rule, RuleMatch, generators_by_op, rules_by_property

__all__ = ["RULES", "Rule", "RewriteByMathProperties", "RewriteStats", "module_flops",
           "rules_by_property", "rewrite_graph"]

_DIRTY_DEPTH = 6
_MAX_STEPS = 1_000_000  # a guard against a bug in a cost function, never reached in practice


@dataclass
class RewriteStats:
    """What one run of the pass did.

    Attributes
    ----------
    flops_before, flops_after
        FLOPs of the module's high-level calls (:func:`module_flops`) before the pass and after
        it (rewriting plus constant folding).
    flops_folded
        FLOPs after the initial ``FoldConstant`` alone, so rewriting's share is
        ``flops_folded - flops_after``.
    fired
        Rule name → how many applied rewrites it took part in.
    rewrites, partitions, seconds
        Applied rewrites, partitions visited, wall time of the whole pass.
    symbolic_skipped
        Operators not rewritten because a shape is symbolic (an ONNX ``dim_param``): the
        rules' shape algebra is over concrete shapes, so such operators are left as they are.
    """

    flops_before: int = 0
    flops_after: int = 0
    flops_folded: int = 0
    fired: Counter = field(default_factory=Counter)
    rewrites: int = 0
    partitions: int = 0
    seconds: float = 0.0
    symbolic_skipped: int = 0

    @property
    def flops_saved(self) -> int:
        return self.flops_before - self.flops_after


def RewriteByMathProperties(  # noqa: N802 (a pass constructor, named as TVM names them)
    rules=None, allow_fp_reassociation: bool = True
) -> tvm.transform.Pass:
    """Rewrite Relax graphs by associative, distributive and commutative properties.

    Parameters
    ----------
    rules
        Rule names or :class:`Rule` objects to use; ``None`` means all of :data:`RULES`.
        An unknown name raises ``ValueError`` naming it.
    allow_fp_reassociation
        When False only rules that are exact in IEEE arithmetic run (``Rule.exact``):
        reassociation changes rounding, and ``Exp``/``Recip`` merges change overflow.

    Returns
    -------
    tvm.transform.Pass
        A module pass; run it on high-level Relax, before ``LegalizeOps``. Each run's
        :class:`RewriteStats` goes to the active :class:`tvm_fusion.instrument.Collector`.
    """
    enabled = _resolve_rules(rules, allow_fp_reassociation)

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.RewriteByMathProperties")
    def _rewrite(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        start = time.perf_counter()
        stats = RewriteStats(flops_before=module_flops(mod))
        if _constant_calls(mod):
            mod = relax.transform.FoldConstant()(mod)
        stats.flops_folded = module_flops(mod)
        unfoldable = _constant_calls(mod)  # what FoldConstant left (it refuses some ops)
        mod = _rewrite_functions(mod, lambda graph: rewrite_graph(graph, enabled, stats))
        if _constant_calls(mod) > unfoldable:
            mod = relax.transform.FoldConstant()(mod)
        mod = tvm.transform.Sequential([
            relax.transform.CanonicalizeBindings(),
            relax.transform.DeadCodeElimination(),
        ])(mod)
        stats.flops_after = module_flops(mod)
        stats.seconds = time.perf_counter() - start
        emit("rewrite_stats", stats)
        return mod

    return _rewrite


def _resolve_rules(rules, allow_fp_reassociation: bool) -> frozenset[str]:
    if rules is None:
        names = list(RULES)
    else:
        names = []
        for rule in rules:
            name = rule.name if isinstance(rule, Rule) else rule
            if name not in RULES:
                raise ValueError(f"unknown rewrite rule {name!r}; known rules: {', '.join(RULES)}")
            names.append(name)
    if not allow_fp_reassociation:
        names = [n for n in names if RULES[n].exact]
    return frozenset(names)


def _constant_calls(mod: tvm.IRModule) -> int:
    """Calls whose operands are all constants: what ``FoldConstant`` would try to fold.

    ``FoldConstant`` legalises every call it visits (about a millisecond each), so it only runs
    when there is something to fold; the rules fold what they create themselves.
    """
    count = 0

    def visit(expr) -> None:
        nonlocal count
        if (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.args
                and not any(_has_var(a) for a in expr.args)):
            count += 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return count


def _has_var(expr) -> bool:
    if isinstance(expr, relax.Var):
        return True
    if isinstance(expr, relax.Tuple):
        return any(_has_var(f) for f in expr.fields)
    return bool(relax.analysis.free_vars(expr)) if isinstance(expr, relax.Call) else False


def _rewrite_functions(mod: tvm.IRModule, rewrite) -> tvm.IRModule:
    mutator = BlockRewriter(mod, rewrite)
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and not is_primitive(func):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()


def rewrite_graph(graph: BlockGraph, enabled: frozenset[str], stats: RewriteStats) -> None:
    """Rewrite one lifted dataflow block in place, partition by partition."""
    reset_keys()
    stats.symbolic_skipped += graph.symbolic_skipped
    driver = _Driver(enabled, stats)
    for part in partitions(graph):
        stats.partitions += 1
        driver.run(graph, part)


def partitions(graph: BlockGraph) -> list[list[Node]]:
    """Connected groups of modelled nodes; shared non-constant inputs connect them too.

    Unmodelled operators are leaves, so they cut the graph (DNNFusion's partition points);
    two matmuls reading one layer_norm output stay together (``A·W1, A·W2`` share ``A``).
    """
    parent: dict[int, int] = {}

    def find(i: int) -> int:
        while parent.setdefault(i, i) != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for node in graph.nodes:
        for arg in node.args:
            if isinstance(arg, Node) or not arg.is_const:
                parent[find(id(arg))] = find(id(node))
    groups: dict[int, list[Node]] = {}
    for node in graph.nodes:
        groups.setdefault(find(id(node)), []).append(node)
    return list(groups.values())


class _Driver:
    def __init__(self, enabled: frozenset[str], stats: RewriteStats):
        self.ctx = Ctx(enabled)
        self.generators = generators_by_op(enabled)
        self.stats = stats

    def run(self, graph: BlockGraph, members: list[Node]) -> None:
        best: dict[Node, tuple] = {}
        dirty = list(members)
        rescanned = False
        for _ in range(_MAX_STEPS):
            for node in dirty:
                self._refresh(node, best)
            dirty = []
            if not best:
                if rescanned:
                    return
                dirty, rescanned = [n for n in members if n.alive], True
                continue
            node = max(best, key=lambda n: (best[n][0], -n.order))
            gain = best[node][0]
            self._refresh(node, best)
            if node not in best or best[node][0] != gain:
                continue
            new_nodes, touched = self._apply(graph, best[node][1])
            members.extend(new_nodes)
            dirty = _near(touched)
            rescanned = False
        raise RuntimeError("rewriting did not reach a fixed point; a rule's cost is wrong")

    # -- candidates --------------------------------------------------------------------------
    def _refresh(self, node: Node, best: dict) -> None:
        best.pop(node, None)
        if not (node.alive and node.attached) or node.alias is not None:
            return
        top = None
        for generate in self.generators.get(node.op, ()):
            try:
                for cand in generate(self.ctx, node):
                    gain = _gain(cand)
                    if gain is not None and gain > ZERO and (top is None or gain > top[0]):
                        top = (gain, cand)
            except (Refuse, RecursionError):  # a chain too deep to flatten is left alone
                continue
        if top is not None:
            best[node] = top

    # -- applying ----------------------------------------------------------------------------
    def _apply(self, graph: BlockGraph, cand: RuleMatch):
        new_nodes = _detached_nodes(cand)
        dying = _dying(cand, new_nodes)
        order = min(r.order for r in cand.roots) - 0.5
        for node in new_nodes:
            node.attached = True
            node.order = order
            for arg in node.args:
                arg.users.append(node)
            graph.nodes.append(node)
        touched: set = set(new_nodes)
        for root, rep in cand.roots.items():
            touched |= _redirect(root, rep)
        for node in dying:
            if node in cand.roots:
                continue
            node.alive = False
            for arg in node.args:
                arg.users.remove(node)
                touched.add(arg)
        self.stats.rewrites += 1
        for name in cand.fired:
            self.stats.fired[name] += 1
        return new_nodes, touched


def _redirect(root: Node, rep: Value) -> set:
    """Make every use of ``root`` a use of ``rep``; ``root`` dies or becomes an alias."""
    touched = set()
    for user in list(root.users):
        user.args = [rep if a is root else a for a in user.args]
        user.modified = True
        touched.add(user)
    rep.users.extend(root.users)
    root.users = []
    for arg in root.args:
        arg.users.remove(root)
        touched.add(arg)
    if root.ext_uses:
        root.alias = rep
        root.args = []
        if isinstance(rep, Node):
            rep.ext_uses += 1
    else:
        root.alive = False
    touched.add(rep)
    return touched


def _near(touched: set) -> list[Node]:
    """Nodes whose candidates may have changed: the touched ones and their users, a few levels
    up (a match looks down through its operands), plus matmuls sharing a touched input."""
    out: dict[Node, None] = {}
    frontier = [v for v in touched if isinstance(v, Node)]
    for v in touched:
        if isinstance(v, Leaf) and not v.is_const:
            frontier.extend(u for u in v.users if u.op == "matmul")
    for _ in range(_DIRTY_DEPTH):
        nxt = []
        for node in frontier:
            if node not in out:
                out[node] = None
                nxt.extend(node.users)
        frontier = nxt
    return sorted((n for n in out if n.alive), key=lambda n: n.order)


def _detached_nodes(cand: RuleMatch) -> list[Node]:
    """Nodes the candidate creates, operands first."""
    out: list[Node] = []
    seen: set = set()

    def visit(v: Value) -> None:
        if not isinstance(v, Node) or v.attached or id(v) in seen:
            return
        seen.add(id(v))
        for arg in v.args:
            visit(arg)
        out.append(v)

    for rep in cand.roots.values():
        visit(rep)
    return out


def _dying(cand: RuleMatch, new_nodes: list[Node]) -> set:
    """The roots and every node only they (transitively) use, minus what the result reuses."""
    kept = {id(a) for n in new_nodes for a in n.args}
    kept |= {id(rep) for rep in cand.roots.values()}
    dying = set(cand.roots)
    stack = list(cand.roots)
    while stack:
        node = stack.pop()
        for arg in node.args:
            if (isinstance(arg, Node) and arg.attached and arg.alive and arg not in dying
                    and id(arg) not in kept and arg.ext_uses == 0
                    and all(u in dying for u in arg.users)):
                dying.add(arg)
                stack.append(arg)
    return dying


def _gain(cand: RuleMatch):
    """Cost saved by applying ``cand``, or None when it is not a valid replacement."""
    for root, rep in cand.roots.items():
        if not (root.alive and root.attached) or root.alias is not None:
            return None
        if rep.shape != root.shape or rep.dtype != root.dtype or rep is root:
            return None
    new_nodes = _detached_nodes(cand)
    reused = {id(a) for n in new_nodes for a in n.args} | {id(r) for r in cand.roots.values()}
    if any(id(root) in reused for root in cand.roots):
        return None
    before = ZERO
    for node in _dying(cand, new_nodes):
        before = add_costs(before, node_cost(node))
    after = ZERO
    for node in new_nodes:
        after = add_costs(after, node_cost(node))
    return sub_costs(before, after)

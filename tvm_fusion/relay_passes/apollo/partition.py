"""Apollo (MLSys'22): partition-based fusion, layer by layer, on one ECG per dataflow block.

``plan_apollo(ecg, options, blocklist)`` returns a :class:`~.fusion_plan.FusionPlan` (so
``apply_plan``, the report and kernel counting work unchanged); every block remembers the merges
that built it, which the feedback loop (:mod:`.feedback`) undoes when a schedule fails.

1. **Classification** (§3.3, Definitions 1-4) from each operator's access functions, never from
   its name (:func:`apollo_type`): element-wise, broadcast (an input lacks an output iterator and
   is not a scalar), reduction, transpose, reshape, matmul, conv (reductions accumulating a
   product of two different buffers; conv when a read window overlaps), other (gather, stencils,
   overlapping pooling: eligible, no rule) and ineligible (opaque code, library calls: §3.1).
2. **Layer I, Algorithm 1**: rule groups in priority order, each to a fixed point; a merge must
   keep the quotient graph acyclic and must not be on the feedback blocklist. Reductions never
   absorb their consumers here (no rule has a reduction as producer); matmul/conv absorb
   element-wise epilogues and prologues; two compute-bound operators never merge.
3. **Layer II, memory stitching (Algorithm 2)**: rule ⑦ (reduction → element-wise/broadcast) and
   ⑧ (reduction → reduction) join a reduction and its consumers in one kernel when both iterate
   over the same rows (``consist_dim_and_param``: equal product of the leading dimensions; ⑧ also
   needs the same reduced-row shape). On CPU the fused function is scheduled by
   ``ScheduleFusedBlocks``, which computes the row statistics per row tile next to their consumers
   (the cache-resident tile of the paper's shared memory); see docs/apollo.md for what stays a
   buffer.
4. **Layer III, parallelism stitching (Algorithm 3)**: independent micro-graphs from the branches
   of a multi-tail (fan-out) head, a multi-head (fan-in) tail, and independent sources (a virtual
   head) are packed into one kernel, heaviest first, by the prefix search of Algorithm 3 with a
   resource-aware Eq. (3) (:func:`parallel_gain`) and at most ``max_branches`` (7) branches.
   Compute-bound operators are excluded (§4.3) except branches that read the same head tensor
   (horizontal packing: Q/K/V projections), which is what the issue asks for.

Rule profiles: ``"paper"`` is Table 1 exactly; ``"practical"`` (default) adds element-wise →
broadcast (MindSpore has it; the extracted table does not), broadcast epilogues of matmul/conv
(a bias add is *broadcast* under Def. 2) and the reshape rules the paper removed after feedback
from its polyhedral scheduler: our Layer I is TIR inlining, for which a reshape is an index
change, and a failing schedule still splits the partition through feedback.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from tvm import relax

from ..ecg import ECG
from ..fusion_plan import FusionBlock, FusionPlan
from ..rejection import Rejection, RejectReason
from .classify import (  # noqa: F401 (re-exported)
    BC,
    COMPUTE_BOUND,
    CONV,
    EW,
    INELIGIBLE,
    MATMUL,
    OTHER,
    RED,
    RESHAPE,
    TRANSPOSE,
    apollo_type,
)
from .stitch import CPU_BYTES_PER_S, CPU_FLOPS_PER_S, parallel_gain  # noqa: F401

PROFILES = ("practical", "paper")

# Algorithm 1, line 4: rule groups in priority order; (producer, consumer, result).
_TABLE1 = [
    ("①", [(EW, EW, EW)]),
    ("②", [(BC, EW, BC)]),
    ("③", [(BC, BC, BC)]),
    ("④", [(EW, RED, RED)]),
    ("⑤", [(BC, RED, RED)]),
    ("⑥-transpose", [(EW, TRANSPOSE, TRANSPOSE), (BC, TRANSPOSE, TRANSPOSE)]),
    ("⑥-matmul", [(MATMUL, EW, MATMUL), (EW, MATMUL, MATMUL)]),
    ("⑥-conv", [(CONV, EW, CONV), (EW, CONV, CONV)]),
]
_PRACTICAL = {
    "②": [(EW, BC, BC)],
    "⑥-transpose": [(RESHAPE, TRANSPOSE, TRANSPOSE), (RESHAPE, RESHAPE, RESHAPE),
                    (RESHAPE, EW, EW), (RESHAPE, BC, BC), (TRANSPOSE, RESHAPE, TRANSPOSE)],
    "⑥-matmul": [(MATMUL, BC, MATMUL), (TRANSPOSE, MATMUL, MATMUL), (RESHAPE, MATMUL, MATMUL),
                 (MATMUL, TRANSPOSE, MATMUL), (MATMUL, RESHAPE, MATMUL)],
    "⑥-conv": [(CONV, BC, CONV)],
}
_TABLE2 = [("⑦", [(RED, EW, RED), (RED, BC, RED)]), ("⑧", [(RED, RED, RED)])]


def rule_groups(profile: str = "practical") -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Table 1 as data, in Algorithm 1's priority order, for a rule profile."""
    if profile not in PROFILES:
        raise ValueError(f"unknown apollo rule profile {profile!r}; expected one of {PROFILES}")
    groups = []
    for name, rules in _TABLE1:
        extra = _PRACTICAL.get(name, []) if profile == "practical" else []
        groups.append((name, list(rules) + extra))
    return groups


@dataclass
class ApolloOptions:
    """Apollo knobs (``Sequential`` options ``apollo_*``)."""

    rules: str = "practical"  # "practical" | "paper" (Table 1 exactly)
    layers: int = 3  # 1: Layer I only, 2: + memory stitching, 3: + parallelism stitching
    max_branches: int = 7  # Layer III: at most 7 branches per stitched kernel (Appendix A)
    stitch_bytes: int = 32 << 20  # Layer III resource check: working set of a packed kernel
    cores: int = 0  # Layer III occupancy; 0: the machine's
    max_ops: int = 200  # MindSpore's area size limit; the paper has none

    def __post_init__(self):
        if self.rules not in PROFILES:
            raise ValueError(f"apollo_rules={self.rules!r} is not one of {PROFILES}")
        if int(self.layers) not in (1, 2, 3):
            raise ValueError(f"apollo_layers must be 1, 2 or 3, got {self.layers}")
        if not 2 <= int(self.max_branches) <= 7:
            raise ValueError(f"apollo_max_branches must be in 2..7, got {self.max_branches}")


# ----------------------------------------------------------------------------- the planner

@dataclass(frozen=True)
class Merge:
    """One merge of two micro-graphs: what the feedback loop undoes, and its blocklist key."""

    layer: int
    rule: str
    left: tuple[int, ...]
    right: tuple[int, ...]
    signature: str


@dataclass
class MicroGraph:
    members: set[int]
    type: str
    trace: list[Merge] = field(default_factory=list)


@dataclass
class ApolloPlan(FusionPlan):
    """A :class:`FusionPlan` plus the Apollo types and the merge trace of every block."""

    types: list[str] = field(default_factory=list)  # per ECG node
    traces: list[list[Merge]] = field(default_factory=list)  # per block, in merge order
    block_types: list[str] = field(default_factory=list)
    parallel: list[dict] = field(default_factory=list)  # Layer III decisions
    blocked: list[str] = field(default_factory=list)  # merges the blocklist refused


def plan_apollo(ecg: ECG, types: list[str], options: ApolloOptions | None = None,
                blocklist=None) -> ApolloPlan:
    """Layers I-III on one ECG; ``types[i]`` is :func:`apollo_type` of node ``i``."""
    return _Apollo(ecg, types, options or ApolloOptions(), blocklist).run()


class _Apollo:
    def __init__(self, ecg: ECG, types: list[str], opt: ApolloOptions, blocklist):
        self.ecg, self.opt = ecg, opt
        self.forbids = (lambda sig: blocklist.forbids(sig)) if blocklist is not None else (
            lambda sig: False)
        self.mgs: dict[int, MicroGraph] = {
            n.index: MicroGraph({n.index}, types[n.index]) for n in ecg.nodes}
        self.mg_of = {n.index: n.index for n in ecg.nodes}
        self.types = types
        self.rejections: dict[tuple[int, int], tuple[RejectReason, str]] = {}
        self.blocked: list[str] = []
        self.parallel: list[dict] = []

    # ---- quotient graph
    def preds(self, g: int) -> set[int]:
        return {self.mg_of[p] for m in self.mgs[g].members for p in self.ecg.nodes[m].preds} - {g}

    def succs(self, g: int) -> set[int]:
        return {self.mg_of[s] for m in self.mgs[g].members for s in self.ecg.nodes[m].succs} - {g}

    def reaches(self, src: int, dst: int, skip_direct: bool) -> bool:
        """Is there a path src → … → dst (through a third micro-graph when ``skip_direct``)?"""
        bound = max(self.mgs[dst].members)
        todo = [s for s in self.succs(src) if not (skip_direct and s == dst)]
        seen = set()
        while todo:
            cur = todo.pop()
            if cur == dst:
                return True
            if cur in seen or min(self.mgs[cur].members) >= bound:
                continue
            seen.add(cur)
            todo.extend(self.succs(cur))
        return False

    def merge(self, a: int, b: int, typ: str, merge: Merge) -> int:
        ga, gb = self.mgs[a], self.mgs.pop(b)
        ga.members |= gb.members
        ga.type = typ
        ga.trace = ga.trace + gb.trace + [merge]
        for m in gb.members:
            self.mg_of[m] = a
        return a

    def signature(self, rule: str, u: int, v: int) -> str:
        nu, nv = self.ecg.nodes[u], self.ecg.nodes[v]
        return (f"{rule}|{self.types[u]}:{nu.op_name}{list(nu.out_shapes)}"
                f"->{self.types[v]}:{nv.op_name}{list(nv.out_shapes)}")

    # ---- driver
    def run(self) -> ApolloPlan:
        for name, rules in rule_groups(self.opt.rules):
            self.apply_group(1, name, rules)
        if self.opt.layers >= 2:
            for name, rules in _TABLE2:
                self.apply_group(2, name, rules)
        if self.opt.layers >= 3:
            self.layer3()
        return self.result()

    def apply_group(self, layer: int, name: str, rules) -> None:
        """Algorithm 1 lines 5-9 (Algorithm 2 for Layer II) for one rule group, to a fixed
        point, scanning producer-consumer edges in topological order."""
        table = {(p, c): r for p, c, r in rules}
        changed = True
        while changed:
            changed = False
            for node in self.ecg.nodes:
                for v in node.succs:
                    u = node.index
                    gp, gc = self.mg_of[u], self.mg_of[v]
                    if gp == gc:
                        continue
                    tp, tc = self.mgs[gp].type, self.mgs[gc].type
                    result = table.get((tp, tc))
                    if result is None:
                        self.rejections.setdefault((u, v), (
                            RejectReason.NO_RULE, f"Apollo: no rule {tp} → {tc}"))
                        continue
                    if len(self.mgs[gp].members) + len(self.mgs[gc].members) > self.opt.max_ops:
                        self.rejections[(u, v)] = (RejectReason.BLOCK_LIMIT,
                                                   f"constraint: more than {self.opt.max_ops} ops")
                        continue
                    if layer == 2 and not self.consistent(gp, gc, u, v, name):
                        self.rejections[(u, v)] = (
                            RejectReason.DIMENSIONS, f"Apollo {name}: loop dimensions or row "
                            "tiles differ (consist_dim_and_param)")
                        continue
                    if self.reaches(gp, gc, skip_direct=True):
                        self.rejections[(u, v)] = (
                            RejectReason.CYCLE, "would form a cycle through another micro-graph")
                        continue
                    sig = self.signature(name, u, v)
                    if self.forbids(sig):
                        self.rejections[(u, v)] = (
                            RejectReason.SCHEDULE_FAILURE, f"feedback blocklist: {sig}")
                        self.blocked.append(sig)
                        continue
                    merge = Merge(layer, name, tuple(sorted(self.mgs[gp].members)),
                                  tuple(sorted(self.mgs[gc].members)), sig)
                    self.rejections.pop((u, v), None)
                    self.merge(gp, gc, result, merge)
                    changed = True

    def rows(self, shape) -> int | None:
        if shape is None or len(shape) == 0:
            return None
        return math.prod(shape[:-1]) if len(shape) > 1 else 1

    def consistent(self, gp: int, gc: int, u: int, v: int, rule: str) -> bool:
        """``consist_dim_and_param`` on CPU: producer and consumer iterate over the same rows
        (the leading dimensions, the parallel row tiles of our reduction schedule)."""
        pu = self.ecg.nodes[u].out_shapes
        pv = self.ecg.nodes[v].out_shapes
        if not pu or not pv or pu[0] is None or pv[0] is None:
            return False
        if self.rows(pu[0]) != self.rows(pv[0]):
            return False
        if rule == "⑧":  # the same canonical form: the same reduced row length
            return pu[0][-1:] == pv[0][-1:] or pu[0][-1:] == (1,) or pv[0][-1:] == (1,)
        return True

    # ---- Layer III
    def parallelizable(self, g: int, head_tensor_reader: bool) -> bool:
        typ = self.mgs[g].type
        if typ == INELIGIBLE:
            return False
        if typ in COMPUTE_BOUND:
            return head_tensor_reader
        return True

    def branches(self, start: list[int], forward: bool, head: int | None) -> list[list[int]]:
        out = []
        for s in start:
            path, g = [], s
            while True:
                fan_in, fan_out = len(self.preds(g)), len(self.succs(g))
                if (forward and fan_in > 1 and not (head is None and not path)) or (
                        not forward and fan_out > 1):
                    break  # an excluded terminator
                reader = forward and not path and head is not None
                if self.parallelizable(g, reader):
                    path.append(g)
                nxt = self.succs(g) if forward else self.preds(g)
                if len(nxt) != 1 or (forward and fan_out > 1) or (not forward and fan_in > 1):
                    break  # an included terminator, or the end
                g = next(iter(nxt))
            if path:
                out.append(path)
        return out

    def candidate_sets(self) -> list[tuple[str, list[list[int]]]]:
        sets = []
        for g in sorted(self.mgs):
            preds = sorted(self.preds(g))
            if len(preds) >= 2:
                sets.append(("multi-head", self.branches(preds, False, None)))
        for g in sorted(self.mgs):
            succs = sorted(self.succs(g))
            if len(succs) >= 2:
                sets.append(("multi-tail", self.branches(succs, True, g)))
        # A graph input read by several micro-graphs is a multi-tail head too (the Q/K/V
        # projections of a first layer read the function parameter, not an operator).
        for readers in self.input_readers():
            if len(readers) >= 2:
                sets.append(("multi-tail", self.branches(readers, True, -1)))
        sources = sorted(g for g in self.mgs if not self.preds(g))
        for i in range(0, len(sources), self.opt.max_branches):
            chunk = sources[i:i + self.opt.max_branches]
            if len(chunk) >= 2:
                sets.append(("independent", self.branches(chunk, True, None)))
        return [(p, s) for p, s in sets if len(s) >= 2]

    def input_readers(self) -> list[list[int]]:
        readers: dict = {}
        bindings = list(self.ecg.block.bindings)
        for node in self.ecg.nodes:
            for var in relax.analysis.free_vars(bindings[node.binding_index].value):
                if var not in self.ecg.var_to_node:
                    readers.setdefault(var, set()).add(self.mg_of[node.index])
        return [sorted(r) for r in readers.values()]

    def layer3(self) -> None:
        """Algorithm 3: one operator from each branch per round, heaviest first, prefix search
        over (m, k) with the resource-aware gain of Eq. (3)."""
        cores = self.opt.cores or os.cpu_count() or 2
        for pattern, branches in self.candidate_sets():
            depth = 0
            while True:
                group = [b[depth] for b in branches if depth < len(b)]
                group = [g for g in group if g in self.mgs]  # merged away earlier
                group = list(dict.fromkeys(group))
                if len(group) < 2:
                    break
                depth += 1
                costs = {g: self.cost(g, cores) for g in group}
                group.sort(key=lambda g: -costs[g]["time"])
                n, m = len(group), 0
                k = min(n, self.opt.max_branches)
                while m < n and k >= 2:
                    chosen = group[m:m + k]
                    verdict = parallel_gain([costs[g] for g in chosen], self.opt.stitch_bytes,
                                            self.opt.max_branches)
                    ok = verdict["fuse"] and self.independent(chosen)
                    sig = "L3|" + ",".join(sorted(
                        self.ecg.nodes[min(self.mgs[g].members)].op_name for g in chosen))
                    if ok and self.forbids(sig):
                        self.blocked.append(sig)
                        ok = False
                    self.parallel.append({"pattern": pattern, "kernels": len(chosen),
                                          "fused": ok, **{k2: verdict[k2] for k2 in (
                                              "gain", "bytes", "rejected", "reason")}})
                    if ok:
                        first = chosen[0]
                        for other in chosen[1:]:
                            merge = Merge(3, "parallel", tuple(sorted(self.mgs[first].members)),
                                          tuple(sorted(self.mgs[other].members)), sig)
                            self.merge(first, other, self.mgs[first].type, merge)
                        m += k
                        k = min(n - m, self.opt.max_branches)
                    else:
                        k -= 1
                        if m != n and k == 1:
                            m += 1
                            k = min(n - m, self.opt.max_branches)

    def independent(self, group: list[int]) -> bool:
        for a in group:
            for b in group:
                if a != b and self.reaches(a, b, skip_direct=False):
                    return False
        return True

    def cost(self, g: int, cores: int) -> dict:
        nodes = [self.ecg.nodes[i] for i in self.mgs[g].members]
        nbytes = sum(n.irs_bytes + 4 * n.in_elements for n in nodes)
        flops = sum(n.flops for n in nodes)
        rows = max((self.rows(s) or 1) for n in nodes for s in n.out_shapes if s is not None) \
            if any(s is not None for n in nodes for s in n.out_shapes) else 1
        return {"bytes": nbytes, "flops": flops, "occupancy": min(1.0, rows / max(cores, 1)),
                "time": max(nbytes / CPU_BYTES_PER_S, flops / CPU_FLOPS_PER_S)}

    # ---- result
    def result(self) -> ApolloPlan:
        groups = sorted(self.mgs.values(), key=lambda g: min(g.members))
        blocks, traces, btypes = [], [], []
        for g in groups:
            members = sorted(g.members)
            mt = max(self.ecg.nodes[i].mapping_type for i in members)
            blocks.append(FusionBlock(members, mt, members[0]))
            traces.append(g.trace)
            btypes.append(g.type)
        rejections = [Rejection(self.ecg.nodes[a].describe(), self.ecg.nodes[b].describe(),
                                reason, detail)
                      for (a, b), (reason, detail) in sorted(self.rejections.items())
                      if self.mg_of[a] != self.mg_of[b]]
        return ApolloPlan(self.ecg, blocks, rejections, [], types=list(self.types),
                          traces=traces, block_types=btypes, parallel=self.parallel,
                          blocked=sorted(set(self.blocked)))



"""DNNFusion's fusion-plan generation (PLDI'21 §4.3, Listing 1), with the listing's bugs fixed.

Seeds are unfused One-to-One operators, smallest intermediate result first (ties by topological
order). From a seed the block grows along successors, then predecessors; every step checks the
block's *accumulated* mapping type against Table 3: red stops, green fuses, yellow asks a
profitability oracle. Deviations from the listing, each a knob or a documented fix:

* the listing only explores the seed's predecessors; we explore predecessors and successors of
  every member until nothing more fuses, or transposes feeding a matmul could never join any
  block (they are never seeds);
* ``seed_policy="o2o_then_rest"`` (default) keeps seeding from leftover fusible operators once
  no One-to-One operator is left (Reorganize/Shuffle first, then One-to-Many, then
  Many-to-Many), so a ``transpose → matmul`` pair with no elementwise neighbour still fuses;
  ``"paper"`` stops when no One-to-One operator is left;
* a step that would make the block's kernel depend on itself through an outside operator (a
  cycle) is rejected; the paper does not mention cycles, TVM's FuseOps avoids them with
  post-dominators.

Every rejected pair is recorded with its typed reason (:class:`~.rejection.RejectReason`)
and a detail text, for ``tvm-fusion report --why``.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from .ecg import ECG, ECGNode
from .fusion_table import Colour, FusionTable
from .mapping_type import MappingType
from .rejection import Rejection, RejectReason

SEED_POLICIES = ("o2o_then_rest", "paper")


@dataclass(frozen=True)
class Decision:
    """A yellow-cell verdict and what decided it (``analytic``, ``db``, ``measure``, ``model``)."""

    fuse: bool
    source: str
    detail: str


class ProfitabilityOracle(Protocol):
    """Decides yellow (fuse_depend) cells: is ``block + node`` faster than the two apart?"""

    def decide(self, ecg: ECG, block: list[int], node: int, producer_first: bool) -> Decision:
        ...


@dataclass
class AnalyticOracle:
    """Default oracle until a profiling database exists: bytes saved vs recomputation.

    Fusing removes the intermediate's write and read (2 × its bytes) when no consumer outside the
    block needs it, and recomputes the producer once per extra read when the consumer replicates
    (One-to-Many: ``out/in`` elements). It fuses when the saved bytes, weighted by
    ``flops_per_byte`` (about the ridge point of a CPU roofline), pay for the recomputed FLOPs.
    """

    flops_per_byte: float = 10.0

    def decide(self, ecg: ECG, block: list[int], node: int, producer_first: bool) -> Decision:
        new = ecg.nodes[node]
        members = set(block)
        if producer_first:  # the block produces, ``new`` consumes
            producers = [ecg.nodes[p] for p in new.preds if p in members]
            consumer = new
        else:
            producers = [new]
            consumer = None
        saved = 0
        recompute = 0
        for prod in producers:
            cons = consumer or next(
                (ecg.nodes[s] for s in prod.succs if s in members), None)
            inside = members | {node}
            if all(s in inside for s in prod.succs) and not prod.is_graph_output:
                saved += 2 * prod.irs_bytes
            factor = _replication(prod, cons)
            recompute += int(max(factor - 1.0, 0.0) * prod.flops)
        fuse = saved * self.flops_per_byte >= recompute
        detail = f"saves {saved} B, recomputes {recompute} FLOPs"
        return Decision(fuse, "analytic", detail)


def _replication(producer: ECGNode, consumer: ECGNode | None) -> float:
    """How many times the consumer reads each producer element (1 unless it expands)."""
    if consumer is None or consumer.mapping_type is not MappingType.ONE_TO_MANY:
        return 1.0
    out = sum(_numel(s) for s in consumer.out_shapes)
    inp = sum(_numel(s) for s in producer.out_shapes) or 1
    return max(out / inp, 1.0)


def _numel(shape) -> int:
    total = 1
    for d in shape or ():
        total *= d
    return total


@dataclass
class PlanOptions:
    """Planner knobs; defaults are the paper's where it gives one (it gives few)."""

    table: FusionTable = field(default_factory=FusionTable)
    oracle: ProfitabilityOracle = field(default_factory=AnalyticOracle)
    max_ops_per_block: int = 64  # the paper's "empirical threshold"; TVM's max_depth is 256
    seed_policy: str = "o2o_then_rest"
    prefer_epilogues: bool = True  # False: the listing's order (Figure 3's prologue Add)
    conv_chains: str = "off"  # OptiFX conv→conv chains: "cost_model"|"paper_1.05"|"off"
    attention: bool = True  # Q·Kᵀ → softmax → ·V as one block (relay_passes/attention.py)

    def __post_init__(self):
        if self.seed_policy not in SEED_POLICIES:
            raise ValueError(
                f"unknown seed_policy {self.seed_policy!r}; expected one of {SEED_POLICIES}")
        if int(self.max_ops_per_block) < 1:
            raise ValueError(f"max_ops_per_block must be >= 1, got {self.max_ops_per_block}")


@dataclass(frozen=True)
class YellowDecision:
    first: str
    second: str
    decision: Decision


@dataclass
class FusionBlock:
    members: list[int]  # ECG node indices, in topological order
    mapping_type: MappingType
    seed: int
    kind: str = ""  # "attention" for a planned attention block; "" for DNNFusion's blocks

    def __len__(self) -> int:
        return len(self.members)


@dataclass
class FusionPlan:
    ecg: ECG
    blocks: list[FusionBlock]
    rejections: list[Rejection]
    yellow: list[YellowDecision]
    attention: list = field(default_factory=list)  # AttentionDecision per candidate

    @property
    def num_kernels(self) -> int:
        return len(self.blocks)

    def groups(self) -> list[list[int]]:
        return [b.members for b in self.blocks]


def plan_dnnfusion(ecg: ECG, options: PlanOptions | None = None,
                   fixed: list[FusionBlock] = ()) -> FusionPlan:
    """Run the DNNFusion planner on one ECG; ``fixed`` blocks (planned attention) are taken as
    they are and the planner grows its own blocks around them."""
    return _Planner(ecg, options or PlanOptions(), fixed).run()


class _Planner:
    def __init__(self, ecg: ECG, options: PlanOptions, fixed: list[FusionBlock] = ()):
        self.ecg = ecg
        self.opt = options
        self.block_of: dict[int, int] = {}
        self.blocks: list[FusionBlock] = []
        self.spans: list[tuple[int, int]] = []  # (min, max) index of each finished block
        self.rejections: dict[tuple[int, int], tuple[RejectReason, str]] = {}
        self.yellow: list[YellowDecision] = []
        for block in fixed:
            self.current = block
            self.members = set(block.members)
            for m in block.members:
                self.block_of[m] = len(self.blocks)
            self._close()

    # -------------------------------------------------------------------------------- driver

    def run(self) -> FusionPlan:
        ecg = self.ecg
        heap = [(n.irs_bytes, n.index) for n in ecg.nodes
                if n.fusible and n.mapping_type is MappingType.ONE_TO_ONE]
        heapq.heapify(heap)
        while heap:
            _, idx = heapq.heappop(heap)
            if idx not in self.block_of:
                self._grow(idx)
        if self.opt.seed_policy == "o2o_then_rest":
            rest = sorted((n for n in ecg.nodes if n.fusible and n.index not in self.block_of),
                          key=lambda n: (n.mapping_type, n.irs_bytes, n.index))
            for node in rest:
                if node.index not in self.block_of:
                    self._grow(node.index)
        for node in ecg.nodes:
            if node.index not in self.block_of:
                self._open(node.index)
                self._close()
        blocks = sorted(self.blocks, key=lambda b: b.members[0])
        rejections = [
            Rejection(ecg.nodes[a].describe(), ecg.nodes[b].describe(), reason, detail)
            for (a, b), (reason, detail) in sorted(self.rejections.items())
            if self.block_of.get(a) != self.block_of.get(b)
        ]
        return FusionPlan(ecg, blocks, rejections, self.yellow)

    def _open(self, seed: int) -> None:
        self.current = FusionBlock([seed], self.ecg.nodes[seed].mapping_type, seed)
        self.members = {seed}
        self.block_of[seed] = len(self.blocks)

    def _close(self) -> None:
        self.current.members.sort()
        self.blocks.append(self.current)
        m = self.current.members
        bisect.insort(self.spans, (m[0], m[-1]))

    def _grow(self, seed: int) -> None:
        """Listing 1 steps 2 and 3 from one seed, repeated over every member to a fixed point.

        A Many-to-Many consumer is taken only after every producer had its chance: an
        elementwise chain between two GEMMs then becomes the first one's epilogue (applied to
        each output element once, from the accumulator) rather than the second one's prologue
        (re-read per output tile, so kept materialised). Successors-first order alone makes it
        a prologue whenever the seed sits downstream."""
        self._open(seed)
        frontier = deque([seed])
        deferred: list[tuple[int, int]] = []
        while frontier or deferred:
            if not frontier:  # every producer tried: now the deferred anchors, in order
                succ, via = deferred.pop(0)
                if self._try_add(succ, producer_first=True, via=via):
                    frontier.append(succ)
                continue
            idx = frontier.popleft()
            node = self.ecg.nodes[idx]
            for succ in node.succs:
                if self._leave_for_consumers(succ):
                    self.rejections.setdefault((idx, succ), (
                        RejectReason.PROLOGUE,
                        f"widens its input ({self.ecg.nodes[succ].out_dtypes[0]}): left to be "
                        f"the prologue of its consumers, so the kernels exchange the narrower "
                        f"tensor"))
                elif (self.opt.prefer_epilogues and node.flops > 0
                        and self.ecg.nodes[succ].mapping_type is MappingType.MANY_TO_MANY
                        and self.current.mapping_type is not MappingType.MANY_TO_MANY):
                    deferred.append((succ, idx))
                elif self._try_add(succ, producer_first=True, via=idx):
                    frontier.append(succ)
            for pred in node.preds:
                if self._reads_for_consumers(idx):
                    self.rejections.setdefault((pred, idx), (
                        RejectReason.PROLOGUE,
                        f"{node.op_name} widens its input: it starts its consumers' kernel, "
                        f"which reads the narrower tensor"))
                elif self._leave_for_producer(pred, via=idx):
                    self.rejections.setdefault((pred, idx), (
                        RejectReason.EPILOGUE,
                        "left to be the epilogue of its own Many-to-Many producer"))
                elif self._try_add(pred, producer_first=False, via=idx):
                    frontier.append(pred)
        self._close()

    def _leave_for_consumers(self, idx: int) -> bool:
        """Would ``idx``, a widening operator (DequantizeLinear, a cast up), join the current
        block as an epilogue although every consumer, each a free Many-to-Many anchor, could
        take it as a prologue? Then the
        kernel would write the wide tensor (float32) where it could write the narrow one
        (int8): it is left for the consumers, as QDQ kernels read int8 and write int8. Only
        when the block has (or will take, through free operators upstream) a Many-to-Many
        anchor: a lone QuantizeLinear of a graph input keeps its DequantizeLinear and goes on
        into the consumer itself."""
        return (idx not in self.block_of and self._reads_for_consumers(idx)
                and self._anchor_upstream())

    def _reads_for_consumers(self, idx: int) -> bool:
        """``idx`` widens and every consumer is a fusible Many-to-Many anchor, free or in the
        current block: its kernel is theirs, and its producer's kernel ends before it (an
        elementwise reader such as a residual add would cost a kernel of its own)."""
        nodes = self.ecg.nodes
        node = nodes[idx]
        if (not self.opt.prefer_epilogues or not node.widens or node.is_graph_output
                or not node.succs):
            return False
        return all(nodes[s].fusible and nodes[s].mapping_type is MappingType.MANY_TO_MANY
                   and (s not in self.block_of or s in self.members) for s in node.succs)

    def _anchor_upstream(self, depth: int = 16) -> bool:
        """The current block is Many-to-Many, or a free Many-to-Many operator feeds it through
        free operators (it will be taken as the block's producer)."""
        if self.current.mapping_type is MappingType.MANY_TO_MANY:
            return True
        nodes = self.ecg.nodes
        todo = [p for m in self.current.members for p in nodes[m].preds]
        seen: set[int] = set()
        while todo and len(seen) < depth:
            cur = todo.pop()
            if cur in seen or cur in self.members or cur in self.block_of or (
                    not nodes[cur].fusible):
                continue
            seen.add(cur)
            if nodes[cur].mapping_type is MappingType.MANY_TO_MANY:
                return True
            todo.extend(nodes[cur].preds)
        return False

    def _leave_for_producer(self, idx: int, via: int, depth: int = 16) -> bool:
        """Would ``idx`` join the current block as the prologue of a compute-intensive
        operator (which re-reads it per output tile), or would a narrowing ``idx`` (a
        QuantizeLinear) join as any prologue, although a free Many-to-Many operator
        upstream (through free operators) could take it as an epilogue? Then it is left for a
        later seed. Row reductions re-read nothing, so their prologues stay (TinyBERT's
        layer-norm chain); data movement stays too (it costs nothing as a prologue)."""
        nodes = self.ecg.nodes
        if (not self.opt.prefer_epilogues or nodes[idx].flops == 0  # data movement: free
                or nodes[idx].widens):  # a dequantize: the consumer reads the narrow tensor
            return False
        if not (nodes[via].compute_intensive or nodes[idx].narrows):  # (a quantize: the
            return False  # producer writes the narrow tensor, whatever reads it)
        todo, seen = [idx], set()
        while todo and len(seen) < depth:
            cur = todo.pop()
            if cur in seen or cur in self.block_of or not nodes[cur].fusible:
                continue
            seen.add(cur)
            if nodes[cur].mapping_type is MappingType.MANY_TO_MANY:
                return cur != idx
            todo.extend(nodes[cur].preds)
        return False

    # ------------------------------------------------------------------------------ one step

    def _try_add(self, idx: int, producer_first: bool, via: int) -> bool:
        if idx in self.members:
            return False
        ecg, blk = self.ecg, self.current
        new = ecg.nodes[idx]
        pair = (via, idx) if producer_first else (idx, via)

        def reject(reason: RejectReason, detail: str) -> bool:
            self.rejections.setdefault(pair, (reason, detail))
            return False

        if idx in self.block_of:
            return reject(RejectReason.ALREADY_FUSED, "already in another block")
        if not new.fusible:
            return reject(RejectReason.OPAQUE, f"{new.op_name} is opaque: {new.reason}")
        first, second = (blk.mapping_type, new.mapping_type) if producer_first else (
            new.mapping_type, blk.mapping_type)
        cell = self.opt.table.lookup(first, second)
        if cell.colour is Colour.RED:
            return reject(RejectReason.RED_CELL,
                          f"Table 3 red: block {first.short} then {second.short}")
        if len(blk.members) >= self.opt.max_ops_per_block:
            return reject(RejectReason.BLOCK_LIMIT,
                          f"constraint: block already has {self.opt.max_ops_per_block} ops")
        if self._creates_cycle(idx):
            return reject(RejectReason.CYCLE,
                          "would form a cycle through an operator outside the block")
        if cell.colour is Colour.YELLOW:
            decision = self.opt.oracle.decide(ecg, blk.members, idx, producer_first)
            self.yellow.append(YellowDecision(
                ecg.nodes[pair[0]].describe(), ecg.nodes[pair[1]].describe(), decision))
            if not decision.fuse:
                return reject(RejectReason.PROFITABILITY,
                              f"yellow, {decision.source} says slower: {decision.detail}")
        blk.members.append(idx)
        blk.mapping_type = cell.fused
        self.members.add(idx)
        self.block_of[idx] = len(self.blocks)
        return True

    def _creates_cycle(self, idx: int) -> bool:
        """Would block ∪ {idx} reach itself through an outside operator or finished block?

        Finished blocks are single kernels, so entering one at any member lets a path leave
        from any other member. Paths only move to higher indices except through such jumps,
        so nodes above ``limit`` (closed over the spans of blocks that start below it) cannot
        come back and are pruned.
        """
        inside = self.members | {idx}
        return path_reenters(self.ecg, inside, self.block_of, self.blocks,
                             self._limit(max(inside)))

    def _limit(self, start: int) -> int:
        limit = start
        for lo, hi in self.spans:
            if lo > limit:
                break
            limit = max(limit, hi)
        return limit


def path_reenters(ecg, inside: set[int], block_of: dict, blocks, limit: float = float("inf"),
                  ) -> bool:
    """Whether a path leaving ``inside`` comes back into it, each planned block taken as one
    node (entering it at any member lets the path leave from any other): merging ``inside``
    into one kernel would then form a cycle. Nodes above ``limit`` are not followed (the
    planner's pruning: paths only move to higher indices except through block jumps)."""
    seen: set[int] = set()
    todo = [s for m in inside for s in ecg.nodes[m].succs if s not in inside]
    while todo:
        cur = todo.pop()
        if cur in seen or cur > limit:
            continue
        seen.add(cur)
        nxt = list(ecg.nodes[cur].succs)
        owner = block_of.get(cur)
        if owner is not None and owner < len(blocks):
            for member in blocks[owner].members:
                if member not in seen and member not in inside:
                    seen.add(member)
                    nxt.extend(ecg.nodes[member].succs)
        for s in nxt:
            if s in inside:
                return True
            if s not in seen:
                todo.append(s)
    return False

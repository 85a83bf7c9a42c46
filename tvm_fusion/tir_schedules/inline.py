"""One loop nest per fusion block: which intermediates are inlined and which survive.

After ``FuseTIR`` a fused PrimFunc still has one loop nest and one intermediate buffer per
operator. Inlining a producer into its consumers composes their index maps (DNNFusion §4.4's
per-mapping-type rules reduce to this in TIR): a One-to-One producer is evaluated at the
consumer's index, a Shuffle/Reorganize producer becomes a permuted or div/mod index, a
transpose/reshape/slice with one consumer disappears (Figure 5's data-movement elimination).

Inlining is not free when a consumer reads each produced element more than once: a GELU in
front of a matmul would be recomputed once per output column, an ``exp`` shared by softmax's
sum and its division twice. A producer therefore survives when recomputing it costs more than
storing it once (:func:`inline_decision`); the reason is recorded per buffer.
"""

from __future__ import annotations

from tvm import s_tir, tirx

from .analysis import BlockFacts, block_facts, numel, param_names, root_block, uses_var
from .fast_math import MAX_NESTED
from .records import first_line

# Storing an element and loading it back while it is still in cache, in the units of
# analysis.expr_cost (one add = 1): what keeping an intermediate costs per element.
MEMORY_COST = 2
# Arithmetic this heavy (a sigmoid, a GELU) is not inlined into a padding block: LLVM does not
# vectorise it under the pad's bounds check, so it stays an elementwise stage of its own.
PADDED_COST = 4
# Arithmetic one expression may grow to by inlining. TVM's simplifier re-walks the whole
# expression on every inline and on every lowering pass, so a chain of a thousand operators
# inlined into one store took minutes to compile; split, each stage is one vector loop.
MAX_INLINED_COST = 256


def fits_one_expression(nested: int, cost: int) -> bool:
    """Within both budgets: at most ``MAX_NESTED`` approximations nested, ``MAX_INLINED_COST``
    operations."""
    return nested <= MAX_NESTED and cost <= MAX_INLINED_COST


def inline_decision(sch: s_tir.Schedule, block_rv, facts: BlockFacts) -> tuple[bool, str]:
    """Whether to inline a spatial producer into its consumers, and why (or why not).

    ``reuse`` is how often the consumers evaluate each produced element in total (their
    iteration volume times the reads of the buffer, over the buffer's size): inlining multiplies
    the producer's arithmetic by it.
    """
    consumers = sch.get_consumers(block_rv)
    if not consumers:
        return False, "no consumer in the function"
    size = numel(sch.get(block_rv).writes[0].source.shape) or 1
    reuse = 0.0
    names, reducers, nested, cost = [], [], 0, 0
    for consumer in consumers:
        cf = block_facts(sch, consumer)
        if cf is None:
            return False, f"consumer {sch.get(consumer).name_hint!r} is opaque to the analysis"
        reads = _distinct_reads(cf, facts.write)
        reuse += cf.volume() * max(reads, 1) / size
        names.append(cf.name)
        nested, cost = max(nested, cf.nested), max(cost, cf.cost)
        if cf.is_reduction:
            reducers.append(cf.name)
    where = ", ".join(repr(n) for n in names)
    if facts.nested and facts.nested + nested > MAX_NESTED:
        return False, (f"{facts.nested + nested} exp/erf/tanh/sigmoid nested in {where}: more "
                       f"than {MAX_NESTED} in one expression compile exponentially in TVM")
    if facts.cost and facts.cost + cost > MAX_INLINED_COST:
        return False, (f"{facts.cost + cost} ops in one expression of {where}: more than "
                       f"{MAX_INLINED_COST} make TVM's simplifier the bottleneck of the build")
    if facts.padding and reducers and reuse > 1.0 + 1e-9:
        return False, (f"padding read {reuse:.0f}x per element by reduction {where}: inlining "
                       f"puts a bounds check in its inner loop; padded once instead")
    if facts.cost == 0:
        for consumer in consumers:
            cf = block_facts(sch, consumer)
            if _read_as_panels(cf, facts.write):
                return False, (f"packed into the GEMM panels {cf.name!r} reads (a conv's im2col "
                               f"matrix): packed once, read {reuse:.0f}x")
            if _read_across_output_axis(cf, facts.write) and cf.volume() >= 8 * size:
                return False, (f"operand of Many-to-Many {cf.name!r} read across its output "
                               f"axis: kept to be written with that axis innermost")
        return True, f"data movement: becomes an index change in {where}"
    if facts.cost >= PADDED_COST and any(_is_padding(sch, c) for c in consumers):
        return False, (f"{facts.cost} ops kept out of the padding {where}: under its bounds "
                       f"check they would not vectorise")
    if reuse <= 1.0 + 1e-9:
        return True, f"read once per element by {where}"
    if reuse * facts.cost <= facts.cost + MEMORY_COST:
        return True, f"cheap ({facts.cost} ops) to recompute {reuse:.1f}x in {where}"
    kind = "prologue of Many-to-Many " if reducers else ""
    shared = f"common sub-tree of {len(names)} consumers, " if len(names) > 1 else ""
    return False, (f"{shared}{kind}{where} reads it {reuse:.0f}x per element: recomputing "
                   f"{facts.cost} ops each time costs more than computing it once")


def _read_across_output_axis(cf: BlockFacts | None, buffer: str) -> bool:
    """``B[j, k]`` in a matmul over ``j``: the output's innermost axis indexes a dimension other
    than the last, which a reduction iterator indexes (SmartMem's reduction-innermost layout).
    The tile rule needs such an operand re-laid out, which is free if its producer stays."""
    if cf is None or not cf.is_reduction:
        return False
    live = [v for v in cf.spatial if cf.extents[v.name] > 1]
    if not live:
        return False
    v = live[-1]
    for read in cf.reads_of(buffer):
        dims = [i for i, ix in enumerate(read.indices) if uses_var(ix, v)]
        if (len(dims) == 1 and dims[0] != len(read.indices) - 1
                and any(uses_var(read.indices[-1], k) for k in cf.reduce)):
            return True
    return False


def _read_as_panels(cf: BlockFacts | None, buffer: str) -> bool:
    """A reduction reads ``buffer`` as packed GEMM panels, ``Bp[j // NR, k, j % NR]`` (or
    ``Bp[b, j // NR, k, j % NR]``, per image: ``layout/gemm_pack.py``): inlined, the packed
    GEMM kernel would not recognise it."""
    if cf is None or not cf.is_reduction or not cf.spatial or len(cf.reduce) != 1:
        return False
    j, k = cf.spatial[-1], cf.reduce[0]
    for read in cf.reads_of(buffer):
        if len(read.indices) < 3:
            continue
        panel, kk, lane = read.indices[-3:]
        if (isinstance(panel, tirx.FloorDiv) and isinstance(lane, tirx.FloorMod)
                and panel.a.same_as(j) and lane.a.same_as(j) and kk.same_as(k)):
            return True
    return False


def _is_padding(sch: s_tir.Schedule, block_rv) -> bool:
    facts = block_facts(sch, block_rv)
    return facts is not None and facts.padding


def _distinct_reads(facts: BlockFacts, buffer: str) -> int:
    seen: list[str] = []
    for read in facts.reads_of(buffer):
        key = str(read.indices)
        if key not in seen:
            seen.append(key)
    return len(seen)


def inline_producers(sch: s_tir.Schedule) -> tuple[dict[str, str], list[str]]:
    """Inline every spatial intermediate that :func:`inline_decision` allows, to a fixed point.

    Producers are visited in program order, so a chain folds forward: an elementwise epilogue
    ends up inside the block that writes the function's output, a prologue inside the last
    block before the anchor. Returns ``(kept, inlined)``: the surviving spatial intermediates
    with the reason each survives, and the names of the inlined blocks with why.
    """
    params = param_names(sch)
    inlined: list[str] = []
    while True:  # sweeps in program order until one inlines nothing (linear per sweep)
        kept: dict[str, str] = {}
        progress = False
        for block_rv in sch.get_child_blocks(root_block(sch)):
            facts = block_facts(sch, block_rv)
            if facts is None or facts.is_reduction or facts.write in params:
                continue
            ok, reason = inline_decision(sch, block_rv, facts)
            if ok:
                try:
                    sch.compute_inline(block_rv)
                except s_tir.ScheduleError as err:
                    kept[facts.write] = f"compute_inline failed: {first_line(err)}"
                    continue
                inlined.append(f"{facts.name}: {reason}")
                progress = True
                continue
            kept[facts.write] = reason
        if not progress:
            return kept, inlined

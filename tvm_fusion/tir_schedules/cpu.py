"""CPU schedules for a fused PrimFunc whose producers are already inlined (``inline.py``).

What is left at the root after inlining is a short list of *stages*, scheduled in this order:

1. **Tiles** (``cpu_tile.py``): every reduction that vectorises along its innermost output axis
   (matmul, batch matmul, dense, conv incl. depthwise/grouped/1×1, pooling windows), with its
   epilogue stored from the accumulator.
2. **Sinks**, last first. A spatial sink (the block writing an output, or a kept prologue)
   gathers the reductions and kept intermediates that only it consumes (softmax's max, exp and
   sum; layer norm's mean and variance) and computes them per *row*: under the outermost loops
   of the sink whose iterators index every such intermediate it reads, so each row's statistics
   are computed once, stay in cache and are parallel across rows. The sink's inner loops and
   each attached spatial stage are vectorised along their contiguous innermost axes.
   A reduction sink that cannot be tiled (a global pool) is parallel over its outputs.

Every stage records a one-line note (``tvm_fusion.schedule`` on the function).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import s_tir
from tvm.s_tir import SBlockRealize

from ..tir_utils import buffer_loads, const_int, find_all
from .analysis import (
    PRIMITIVE_ERRORS,
    BlockFacts,
    block_facts,
    index_uses,
    param_names,
    root_block,
)
from .cpu_target import CpuParams
from .cpu_tile import (
    deinterleave_strided,
    plan_tile,
    schedule_tile,
    split_channel_groups,
    tile_shapes,
    transpose_to_vector_axis,
)
from .loops import loop_extent, loop_size, loops_by_var, parallelize, vectorize_inner


def schedule_cpu(sch: s_tir.Schedule, params: CpuParams, tile: bool = True,
                 kept: dict[str, str] | None = None, skip: set[str] | None = None) -> list[str]:
    """Schedule every stage of the function in ``sch``; returns one note per stage.

    ``tile=False`` is the fallback: no register tiles, every stage a plain parallel (and where
    possible vectorised) loop nest. Copies made for vector-friendly layouts are added to
    ``kept`` (buffer -> reason). Blocks named in ``skip`` are left as they are (the packed
    GEMM's, which ``cpu_gemm.py`` replaces by its own nest)."""
    kept = {} if kept is None else kept
    outputs = param_names(sch)
    shapes = tile_shapes(sch)
    done: set[str] = set(skip or ())
    notes: list[str] = []
    skipped: set[str] = set()
    while tile:
        todo = [b for b in sch.get_child_blocks(root_block(sch))
                if sch.get(b).name_hint not in done | skipped]
        facts = plan = None
        for block_rv in todo:
            facts = block_facts(sch, block_rv)
            plan = plan_tile(facts, shapes, params) if facts is not None else None
            if plan is None and facts is not None and facts.is_reduction:
                staged = transpose_to_vector_axis(sch, block_rv, facts, kept)
                if staged:
                    notes.extend(staged)
                    shapes = tile_shapes(sch)
                    facts = block_facts(sch, block_rv)
                    plan = plan_tile(facts, shapes, params) if facts is not None else None
            if plan is not None and (plan.u is None or plan.u_window) and _reuses_groups(
                    sch, block_rv, facts, shapes, params):
                notes.extend(split_channel_groups(sch, block_rv, facts))
                facts = block_facts(sch, block_rv)  # the block's iterators changed: plan again
                plan = plan_tile(facts, shapes, params) if facts is not None else None
            if plan is not None:
                staged = deinterleave_strided(sch, block_rv, facts, kept)
                if staged:  # the layout changed: plan again on the new indices
                    notes.extend(staged)
                    shapes = tile_shapes(sch)
                    facts = block_facts(sch, block_rv)
                    plan = plan_tile(facts, shapes, params) if facts is not None else None
            if plan is not None:
                break
            skipped.add(sch.get(block_rv).name_hint)
        if plan is None:
            break
        names, tile_notes = schedule_tile(sch, block_rv, plan, params)
        done.update(names)
        notes.append(f"{facts.name}: tile {'; '.join(tile_notes)}")
    while True:
        pending = [b for b in sch.get_child_blocks(root_block(sch))
                   if sch.get(b).name_hint not in done]
        if not pending:
            return notes
        sink = pending[-1]
        facts = block_facts(sch, sink)
        if facts is None:
            name = sch.get(sink).name_hint
            done.add(name)
            notes.append(f"{name}: not analysable, left as is")
            continue
        if facts.is_reduction:
            notes.append(_schedule_reduction_sink(sch, sink, facts, params))
            done.add(facts.name)
            continue
        group = _row_group(sch, pending, facts, outputs)
        notes.append(_schedule_spatial_sink(sch, sink, facts, group, params, done))
        done.add(facts.name)


def _reuses_groups(sch: s_tir.Schedule, block_rv, facts: BlockFacts, shapes: dict,
                   params: CpuParams) -> bool:
    """Whether splitting a grouped conv's channels (on a copy of the schedule) gives a tile
    with a register reuse axis: a group of 13 channels does not (no divisor fits the
    registers), and its depthwise-like plan then stays."""
    trial = sch.copy()
    if not split_channel_groups(trial, block_rv, facts):
        return False
    replanned = block_facts(trial, block_rv)
    plan = plan_tile(replanned, shapes, params) if replanned is not None else None
    return plan is not None and plan.u is not None and not plan.u_window


def _row_group(sch: s_tir.Schedule, pending: list, sink: BlockFacts, outputs: set[str]) -> list:
    """Pending blocks before the sink whose every consumer is the sink or another member:
    what the sink alone needs (reductions and kept intermediates), in program order."""
    members = {sink.name}
    group = []
    for block_rv in reversed(pending[:-1]):
        block = sch.get(block_rv)
        if block.writes[0].source.name in outputs:
            continue
        consumers = [sch.get(c).name_hint for c in sch.get_consumers(block_rv)]
        if consumers and all(c in members for c in consumers):
            members.add(block.name_hint)
            group.insert(0, block_rv)
    return group


def _attach_depth(sch: s_tir.Schedule, sink: BlockFacts, group: list) -> int:
    """The deepest loop of the sink above which every iterator indexes each group buffer the
    sink reads: attaching there computes a row's statistics once per row, never per element."""
    written = {sch.get(b).writes[0].source.name for b in group}
    reads = [r for r in sink.reads if r.buffer in written]
    depth = -1
    for position, var in enumerate(sink.spatial[:-1]):
        if sink.extents[var.name] != 1 and not all(index_uses(r.indices, var) for r in reads):
            break
        depth = position
    return depth


def _schedule_spatial_sink(sch, sink, facts: BlockFacts, group: list, params: CpuParams,
                           done: set[str]) -> str:
    params = params.for_dtype(facts.dtype)
    by_var = loops_by_var(sch, sink)
    if by_var is None:
        return f"{facts.name}: loops already transformed, left as is"
    loops = sch.get_loops(sink)
    depth = _attach_depth(sch, facts, group) if group else -1
    attached = []
    partials: set[str] = set()
    if depth >= 0:
        group, partials = _split_lanes(sch, group, params)
        for block_rv in reversed(group):
            name = sch.get(block_rv).name_hint
            at = _shallowest_same_work(sch, block_rv, loops, depth)
            if _recomputes(sch, block_rv, loops[at]):
                continue  # stays at the root; scheduled as a sink of its own later
            try:
                sch.compute_at(block_rv, loops[at], preserve_unit_loops=True)
            except s_tir.ScheduleError:
                continue  # stays at the root; scheduled as a sink of its own later
            attached.insert(0, (block_rv, name))
    if not attached:
        vec = vectorize_inner(sch, sch.get_loops(sink), params)
        par = parallelize(sch, sch.get_loops(sink)[:-1],
                          facts.volume() * max(facts.cost, 1), params)
        return f"{facts.name}: elementwise/injective, {vec}, {par}"
    vec = vectorize_inner(sch, sch.get_loops(sink)[depth + 1:], params)
    parts = []
    for block_rv, name in attached:
        done.add(name)
        part = block_facts(sch, block_rv)
        if name in partials:
            parts.append(f"{name} per row, {_vectorize_partials(sch, block_rv, part, params)}")
            continue
        if part is None or part.is_reduction:
            parts.append(f"{name} per row")
            continue
        own = sch.get_loops(block_rv)[depth + 1:]
        parts.append(f"{name} per row, {vectorize_inner(sch, own, params)}")
    # the attached stages' own work counts: a global average pool's sink is one divide per
    # channel, its sum over every pixel (EfficientNet's 1152×7×7 pool ran on one of 2 cores)
    work = facts.volume() * (2 + facts.cost)
    for block_rv, _ in attached:
        part = block_facts(sch, block_rv)
        work += (part.volume() if part is not None else facts.volume()) * (
            2 + (part.cost if part is not None else facts.cost))
    par = parallelize(sch, sch.get_loops(sink)[: depth + 1], work, params)
    return f"{facts.name}: rows of {', '.join(parts)}; {vec}; {par}"


# A stage attached per row may do at most this much more work than at the root (halos of a
# window, rounding of a split); more means TVM bounded its region per row by (nearly) all of it.
RECOMPUTE_LIMIT = 1.5


def _recomputes(sch: s_tir.Schedule, block_rv, loop) -> bool:
    """True when ``compute_at(block_rv, loop)`` would redo most of the stage for every row.

    TVM bounds the region a row needs from the sink's index expressions; where a symbolic
    reshape left them as ``(i * seq + j) // seq % 4`` (no analyzer proves ``seq > 0`` in the
    PrimFunc), the bound is the whole tensor, and a GEMM attached per row ran once per row:
    GPT-2's attention scores at seq 64 took 6 s instead of 0.1 ms."""
    def work(s, rv) -> int:
        return int(np.prod([loop_size(s, lp) for lp in s.get_loops(rv)], dtype=np.int64))

    before = work(sch, block_rv)
    trial = sch.copy()
    try:
        trial.compute_at(block_rv, loop, preserve_unit_loops=True)
    except s_tir.ScheduleError:
        return False  # the real attempt fails the same way and handles it
    except tvm.error.InternalError:
        return True  # no bound for the region (a data-dependent index, take's): stays at the root
    if _region_reads_buffers(trial, block_rv):
        return True
    return work(trial, block_rv) > RECOMPUTE_LIMIT * max(before, 1)


def _region_reads_buffers(sch: s_tir.Schedule, block_rv) -> bool:
    """True when the attached block's iterations are bound by loads (a reduction feeding a
    take per row: ``in1_red[min(max(0, where[i]), 2)]``): TVM places it first in the row,
    before the stage that writes those indices (the build fails: "used before its
    definition"), and the region's size is data, not a row's share."""
    name = sch.get(block_rv).name_hint
    for realize in find_all(sch.mod["main"].body, SBlockRealize):
        if realize.block.name_hint == name:
            return any(buffer_loads(value) for value in realize.iter_values)
    return False


def _shallowest_same_work(sch: s_tir.Schedule, block_rv, loops: list, depth: int) -> int:
    """Where a spatial producer of a row group goes: the row loop ``depth``, or a shallower
    loop when its region there is no larger (a whole-operand copy such as a re-laid-out GEMM
    operand needs the same rows for every output row: per row it would be copied once per
    row instead of once). Reductions stay per row."""
    facts = block_facts(sch, block_rv)
    if facts is None or facts.is_reduction or depth <= 0:
        return depth

    def work(at: int) -> int | None:
        trial = sch.copy()
        try:
            trial.compute_at(block_rv, loops[at], preserve_unit_loops=True)
        except PRIMITIVE_ERRORS:
            return None
        extents = [loop_extent(trial, lp) for lp in trial.get_loops(block_rv)[at + 1:]]
        return None if None in extents else int(np.prod(extents, dtype=np.int64))

    per_row = work(depth)
    if per_row is None:
        return depth
    for at in range(depth):
        if work(at) == per_row:
            return at
    return depth


def _split_lanes(sch: s_tir.Schedule, group: list, params: CpuParams) -> tuple[list, set[str]]:
    """Give each row reduction over one long contiguous run of elements ``lanes`` partial
    results (``rfactor``), so the reduction runs as vector adds/maxes and only ``lanes``
    values are combined serially: a serial float sum waits on each add's latency (a global
    average pool over 144 channels of 56×56 took 0.42 ms one add at a time, at Zen 3's
    3-cycle add latency). The run is the reduction's one axis, or its several innermost axes
    fused when every operand stores them as its last dimensions (a pool over (h, w)); a run
    that whole vectors do not divide takes half or quarter vectors (14×14 = 4·49), else stays
    serial. Done before the blocks are attached (``rfactor`` needs the reduction alone under
    its loops)."""
    result, partials = [], set()
    for block_rv in group:
        facts = block_facts(sch, block_rv)
        run = _contiguous_reduction_loops(sch, block_rv, facts)
        extents = [loop_extent(sch, lp) for lp in run]
        extent = int(np.prod(extents)) if run and None not in extents else None
        lanes = params.for_dtype(facts.dtype).lanes if facts is not None else params.lanes
        step = next((s for s in (lanes, lanes // 2, lanes // 4)
                     if s > 1 and extent is not None and extent % s == 0
                     and extent >= 2 * lanes), None)
        if step is not None:
            axis = len(facts.write_indices)
            try:  # on a copy first: TVM's rfactor of a 0-d sum fails with an InternalError
                _rfactor_lanes(sch.copy(), run, step, axis)  # (fuzzer seed 1222)
            except PRIMITIVE_ERRORS:
                pass  # not a recognised reducer: stays a serial reduction
            else:
                rf = _rfactor_lanes(sch, run, step, axis)
                result.append(rf)
                partials.add(sch.get(rf).name_hint)
        result.append(block_rv)
    return result, partials


def _rfactor_lanes(sch: s_tir.Schedule, run: list, step: int, axis: int):
    loop = sch.fuse(*run) if len(run) > 1 else run[0]
    _, lane = sch.split(loop, factors=[None, step])
    return sch.rfactor(lane, factor_axis=axis)


def _contiguous_reduction_loops(sch: s_tir.Schedule, block_rv,
                                facts: BlockFacts | None) -> list:
    """The loops running over the reduction's contiguous elements, to be fused into one run:
    the loop of its only reduction iterator, or its innermost loops when those are all its
    reduction iterators and every read indexes its last dimensions with them, in order and
    whole (so the fused index walks memory contiguously). Empty otherwise."""
    loops = sch.get_loops(block_rv)
    if facts is None or not facts.reduce or not loops:
        return []
    if len(facts.reduce) == 1:
        extent = loop_extent(sch, loops[-1])
        return [loops[-1]] if extent == facts.extents[facts.reduce[0].name] else []
    count = len(facts.reduce)
    by_var = loops_by_var(sch, block_rv)
    names = [k.name for k in facts.reduce]
    if by_var is None or len(loops) < count or any(n not in by_var for n in names):
        return []
    inner = loops[-count:]
    if [sch.get(lp) for lp in inner] != [sch.get(by_var[n]) for n in names]:
        return []
    for read in facts.reads:
        if not index_uses(read.indices, facts.reduce[0]):
            continue
        tail = [getattr(ix, "name", None) for ix in read.indices[-count:]]
        shape = tile_shapes(sch).get(read.buffer)
        if tail != names or shape is None or any(
                loop_extent(sch, lp) != const_int(dim) for lp, dim in zip(inner, shape[-count:])):
            return []
    return inner


def _vectorize_partials(sch: s_tir.Schedule, rf_rv, facts: BlockFacts | None,
                        params: CpuParams) -> str:
    """Put the partial-result block's lane loop innermost and vectorise it."""
    by_var = loops_by_var(sch, rf_rv)
    # (a unit reduction iterator, left by fusing a unit axis into the run, runs once)
    reduce = [k for k in facts.reduce if facts.extents[k.name] != 1] if facts else []
    if facts is None or by_var is None or len(reduce) != 1:
        return "serial"
    lane = getattr(facts.write_indices[-1], "name", None)  # rfactor's axis: the last index
    if lane not in by_var or reduce[0].name not in by_var:
        return "serial"
    lane_loop, outer = by_var[lane], by_var[reduce[0].name]
    try:
        sch.reorder(outer, lane_loop)
        sch.vectorize(lane_loop)
    except s_tir.ScheduleError:
        return "serial"
    return f"{loop_extent(sch, lane_loop)} partial sums"


def _schedule_reduction_sink(sch, block_rv, facts: BlockFacts, params: CpuParams) -> str:
    """A reduction that does not vectorise along its outputs: parallel over its outputs,
    reduction loops serial inside."""
    params = params.for_dtype(facts.dtype)
    by_var = loops_by_var(sch, block_rv)
    if by_var is None:
        return f"{facts.name}: loops already transformed, left as is"
    outer = [by_var[v.name] for v in facts.spatial if v.name in by_var]
    reduce = [by_var[k.name] for k in facts.reduce if k.name in by_var]
    if outer and reduce:
        sch.reorder(*outer, *reduce)
    extent = 1
    for loop in outer:
        extent *= loop_extent(sch, loop) or 1
    par = parallelize(sch, outer, facts.volume(), params)
    return f"{facts.name}: row reduction over {extent} outputs, {par}"

"""Register-tiled reductions on CPU: matmul, batch matmul, dense, conv2d (1×1, grouped,
depthwise) and pooling windows, with their epilogues written from the accumulator tile.

The anchor's accumulator is a ``local`` ``cache_write`` of RT × VT elements: VT lanes of the
output's innermost axis ``v`` (vector loads of the operand that moves with ``v``, such as B's
row in a matmul or an input row in a conv) times RT values of a *reuse axis* ``u`` that this
operand does not depend on (the matmul's row, the conv's output channel), so that each vector
loaded feeds RT fused multiply-adds. All reduction loops run outside that tile, the tile is
zeroed once (``decompose_reduction``) and written back once, and the elementwise/Shuffle
epilogue is inlined into the write-back (``reverse_compute_inline``): a transpose after a GEMM
becomes a store to permuted indices (DNNFusion §4.4). Outer tiles are fused and parallel.

Which operand stays in cache across the outer tiles is chosen from the shapes: the one that
would otherwise be streamed from memory more times.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, sym
from tvm.ir.expr import TensorLoad
from tvm.s_tir import SBlock
from tvm.tirx.stmt import BufferStore

from ..tir_utils import buffer_loads, const_int, find_all, is_reduction_block
from .analysis import (
    PRIMITIVE_ERRORS,
    BlockFacts,
    alloc_buffers,
    block_facts,
    index_uses,
    is_bijective_read,
    main_func,
    numel,
    param_names,
    stride_in_last_dim,
    written_only_before,
)
from .cpu_target import CpuParams
from .inline import fits_one_expression
from .loops import (
    lane_use,
    largest_divisor,
    loop_extent,
    loops_by_var,
    parallelize,
    pick_vector_tile,
    vectorize_inner,
)

# Copying an operand into a vector-friendly layout pays when each element is reused this often.
_MIN_REUSE = 8
# Accumulator vectors of a depthwise/pool row tile: enough independent chains to cover the
# multiply-add latency (4 cycles x 2 ports), leaving registers for the loaded rows. Half of a
# 16-register file (AVX2, SSE); :func:`window_registers` gives every target's.
WINDOW_REGISTERS = 8
# A depthwise/pool tile's window loops are unrolled whole when the tile does at most this many
# vector multiply-adds per channel row: the input vectors that overlapping window rows share
# are then loaded once (LLVM merges the loads), in the same order of taps.
WINDOW_UNROLL_FMAS = 1024
# A vector operand larger than this (a transformer FFN weight) is streamed past a cached tile
# of the other operand rather than cached itself. Measured in whole models on a 1 MiB-L2,
# 32 MiB-L3 Zen core: BERT's 9.4 MB FFN weights stream faster (768x3072 GEMM 1.52 vs 2.01 ms),
# its packed 7 MB Q/K/V weight (768x2304) does not: with a 4 MiB threshold BERT-base ran 75.2
# ms and GPT-2 82.8 ms, with 8 MiB 71.4 and 78.7 ms (stock FuseOps' three 768x768 GEMMs: 71.4
# and 82.0 ms), ResNet-50 unchanged.
STREAM_BYTES = 8 << 20
# On a packed GEMM's write-back (``cpu_gemm.py``): its nest is replaced by the GEMM template
# later, so no rule may move it under another stage's loops.
PACKED_GEMM_STAGE = "tvm_fusion.packed_gemm"


@dataclass
class TilePlan:
    """How one reduction is tiled: the vector axis, the reuse axis and their tile sizes."""

    kind: str  # matmul | conv | depthwise | pool (for the record)
    v: str  # vector axis (iter var name)
    vt: int
    v_fused: tuple[str, ...]  # iterators fused with v into one vector axis (outer first)
    u: str | None  # register (reuse) axis
    rt: int
    u_stationary: bool  # outer order: u tiles outermost (its operand tile stays in cache)
    u_window: bool = False  # u is an output row of a sliding window (depthwise conv, pool)
    piece: int = 0  # lanes of each register of a window row (vt split and unrolled); 0: one
    unroll_window: bool = False  # the window's loops unrolled under the tile (shared loads)

    def describe(self) -> str:
        reg = f", {self.u}×{self.rt} {'window rows' if self.u_window else 'registers'}" \
            if self.u else ""
        order = "u-outer" if self.u_stationary else "v-outer"
        axis = "·".join(self.v_fused) if len(self.v_fused) > 1 else self.v
        lanes = f"{self.vt} lanes" if not self.piece or self.piece == self.vt else \
            f"{self.vt} lanes ({self.vt // self.piece}×{self.piece})"
        window = ", window unrolled" if self.unroll_window else ""
        return f"{self.kind}: {axis}×{lanes}{reg}, {order}{window}"


def plan_tile(facts: BlockFacts, shapes: dict, params: CpuParams) -> TilePlan | None:
    """A tile plan when the reduction can be vectorised along its innermost output axis: that
    axis must index the last dimension of every operand that depends on it, with stride 1 or 2
    (a stride-2 conv loads every other element). Otherwise (softmax's row sum, a global pool
    over the innermost axes) it is a row reduction, not a tile."""
    if not facts.is_reduction or not facts.spatial:
        return None
    params = params.for_dtype(facts.dtype)  # lanes of the accumulator's type
    live = [v for v in facts.spatial if facts.extents[v.name] > 1]
    if not live:
        return None
    v = live[-1]
    if facts.write_indices and not index_uses(facts.write_indices[-1:], v):
        return None  # the output is not contiguous along v
    if v.name in facts.symbolic_iters:
        return None  # lanes must divide the vector axis; a symbolic one is a row reduction
    movers, others = [], []
    for read in facts.reads:
        if index_uses(read.indices, v):
            if stride_in_last_dim(read.indices, v) not in (1, 2):
                return None
            movers.append(read)
        else:
            others.append(read)
    if not movers:
        return None
    v_fused, v_extent = (v.name,), facts.extents[v.name]
    vt = pick_vector_tile(v_extent, params.lanes, max_vectors=2)
    if v_extent % params.lanes:
        w = _row_major_neighbour(facts, v, movers, shapes)
        if w is not None:  # a 1×1 conv's (h, w): one contiguous axis of h·w elements
            extent = v_extent * facts.extents[w.name]
            size = pick_vector_tile(extent, params.lanes, max_vectors=2)
            if lane_use(size, params.lanes) > lane_use(vt, params.lanes):
                v_fused, v_extent, vt = (w.name, v.name), extent, size
    if vt is None:
        return None
    # The reuse axis: a live spatial iterator that no vector operand depends on but another
    # operand does (so unrolling it reuses each loaded vector RT times).
    # The most registers wins, then the longer axis: an axis of 49 (7 x 7) gets no register
    # tile under 7 registers, its neighbour of 4 does (Swin's windows x rows output).
    vectors = -(-vt // params.lanes)
    u, rt, best = None, 1, 0
    for cand in live[:-1]:
        if cand.name in v_fused or any(index_uses(r.indices, cand) for r in movers):
            continue
        if not any(index_uses(r.indices, cand) for r in others):
            continue
        extent = facts.extents[cand.name]
        regs = largest_divisor(extent, max(1, params.registers // vectors))
        if regs > 1 and (regs, extent) > (rt, best):
            u, rt, best = cand, regs, extent
    kind = _kind(facts, movers, u)
    if u is None and kind in ("depthwise", "pool") and len(v_fused) == 1:
        wvt = window_vector_tile(v_extent, params.lanes) or vt
        piece = window_piece(wvt, params.lanes)
        piece = piece if piece < wvt else 0
        registers = wvt // piece if piece else -(-wvt // params.lanes)
        row, rows = _window_rows(facts, live, movers, registers, params, whole=bool(piece))
        if piece and row is None:  # pieces that leave one row: one vector, several rows
            piece, registers = 0, -(-wvt // params.lanes)
            row, rows = _window_rows(facts, live, movers, registers, params)
        if row is not None:
            taps = 1
            for k in facts.reduce:
                taps *= facts.extents[k.name]
            accumulators = rows * registers
            unroll = (2 * accumulators < params.vector_registers
                      and taps * accumulators <= WINDOW_UNROLL_FMAS
                      and not _pieces_apart(facts, row, movers, wvt, params))
            return TilePlan(kind, v.name, wvt, v_fused, row.name, rows, False, u_window=True,
                            piece=piece, unroll_window=unroll)
    u_stationary = _u_stationary(facts, v_fused, v_extent, u, vt, rt, movers, others, shapes)
    return TilePlan(kind, v.name, vt, v_fused, u.name if u is not None else None, rt,
                    u_stationary)


def window_vector_tile(extent: int, lanes: int, max_vectors: int = 4) -> int | None:
    """Lanes for a depthwise/pool row: whole registers, else whole half or quarter registers
    (56 = 3×16 + 8, 28 = 16 + 8 + 4 on AVX-512). A 14-lane vector is loaded as 8 + 4 + 2 and
    shuffled into one register for each of the k·k window loads, and those shuffles bounded
    the kernel: a 96-channel 56×56 depthwise conv took 0.095 ms with 14 lanes, 0.065 ms with
    56 (one thread); 28 lanes beat 14 by 1.25–1.4× on 28×28 maps."""
    for step in (lanes, lanes // 2, lanes // 4):
        for count in range(max_vectors * lanes // step, 0, -1):
            if step and extent % (count * step) == 0:
                return count * step
    return None


def window_piece(vt: int, lanes: int) -> int:
    """Lanes of each register a window row of ``vt`` lanes is computed in: a whole or half
    register that divides it (0: neither does, as 28 on AVX-512 or 7). The row is split
    into such pieces, unrolled. Left as one vector of ``vt`` lanes, LLVM legalises a length
    that is no power of two (56 = 3×16 + 8 on AVX-512) by moving each accumulator through
    the stack lane by lane between loop iterations (210 ``vinsertps`` in the kernel): a
    96-channel 56×56 7×7 depthwise conv ran at 21 % of the FMA peak on Zen 4 with
    <56 x float>, at 48 % with 7 × 8 lanes. Quarter registers measured slower than one
    vector (AVX2's 28 lanes as 7 × 4 leave room for one row only)."""
    for step in (lanes, lanes // 2):
        if step > 1 and vt % step == 0:
            return step
    return 0


def window_registers(params: CpuParams) -> int:
    """Accumulator registers of a depthwise/pool row tile: half the register file (8 of
    AVX2's 16, 16 of AVX-512's 32), the rest for the input vectors the unrolled window
    shares between rows."""
    return max(WINDOW_REGISTERS, params.vector_registers // 2)


def _window_rows(facts: BlockFacts, live, movers, vectors: int, params: CpuParams,
                 whole: bool = False):
    """A depthwise conv or a pool has no operand to reuse across registers, so a tile of one
    row is a single chain of dependent multiply-adds (k·k per vector, each waiting for the
    last). Tiling ``rows`` output rows gives that many independent chains; the window's rows
    overlap, so most of the input rows they load are shared in cache. The row iterator must
    index the moving operand as ``row·s + r`` with a reduction ``r`` (a window row).
    Returns (row iterator, rows) or (None, 1)."""
    if len(live) < 2:
        return None, 1
    row = live[-2]
    window = [k for k in facts.reduce if facts.extents[k.name] > 1]
    # (a weight vector that does not move with the row, as a channels-in-lanes depthwise
    # conv's ``w[block, kh, kw, lane]``, is the same for every row of the tile)
    sliding = [r for r in movers if index_uses(r.indices, row)]
    if not sliding or not all(any(index_uses([ix], row) and any(index_uses([ix], k)
                                                               for k in window)
                                  for ix in r.indices) for r in sliding):
        return None, 1
    budget = window_registers(params) if whole else WINDOW_REGISTERS
    rows = largest_divisor(facts.extents[row.name], max(1, budget // vectors))
    return (row, rows) if rows > 1 else (None, 1)


def _pieces_apart(facts: BlockFacts, row, movers, vt: int, params: CpuParams) -> bool:
    """Whether unrolling the window would keep many input vectors live that are each put
    together from pieces: the row is one partly used register loaded in three or more pieces
    (14 of AVX-512's 16 lanes: 8 + 4 + 2, inserted into one register) and consecutive output
    rows read input rows ``stride`` ≥ 2 apart, so the window rows that unrolling shares are
    few. Unrolled, LLVM hoisted every assembled vector of the
    7-row tile and spilled them (176 stack accesses beside 175 FMAs): EfficientNet-B0's 5×5/2
    depthwise conv over 240 channels at 28×28 ran 0.69× ONNX Runtime's speed on Zen 4, rolled
    0.83×. Stride 1 keeps the unrolled window (ConvNeXt's 7×7 at 7×7, 7 lanes: 0.70× unrolled,
    0.38× rolled), and so do rows of more than one register (AVX2's 14 lanes: 0.56× unrolled,
    0.53× rolled) or of two pieces (AVX2's 5 = 4 + 1 lanes of a 15-wide row: 3.9× against
    3.3×)."""
    if vt >= params.lanes or bin(vt).count("1") < 3:  # loads of 3+ pieces (8 + 4 + 2)
        return False
    for read in movers:
        for ix in read.indices:
            if not index_uses([ix], row):
                continue
            coeffs = sym.detect_linear_equation(ix, [row])
            if len(coeffs) == 2 and (const_int(coeffs[0]) or 0) >= 2:
                return True
    return False


def _row_major_neighbour(facts: BlockFacts, v, movers, shapes):
    """The iterator ``w`` just outside ``v`` when (w, v) can be one axis: the output and every
    vector operand index their last two dimensions with exactly (w, v) (plus unit reduction
    iterators, as a 1×1 conv's kernel offsets) and their rows hold exactly ``v``'s extent,
    so w·V + v walks contiguous memory."""
    position = [x.name for x in facts.spatial].index(v.name)
    if position == 0:
        return None
    w = facts.spatial[position - 1]
    if facts.extents[w.name] <= 1 or w.name in facts.symbolic_iters:
        return None  # (a symbolic w: the fused axis' vector tile might not divide it)
    units = [k for k in facts.reduce if facts.extents[k.name] == 1]
    checks = [(facts.write_indices, shapes.get(facts.write))]
    checks += [(r.indices, shapes.get(r.buffer)) for r in movers]
    for indices, shape in checks:
        if shape is None or len(indices) < 2 or const_int(shape[-1]) != facts.extents[v.name]:
            return None
        if not (_is_var_plus_units(indices[-1], v, units)
                and _is_var_plus_units(indices[-2], w, units)):
            return None
        if any(index_uses([ix], w) or index_uses([ix], v) for ix in indices[:-2]):
            return None
    return w


def _is_var_plus_units(index, var, units) -> bool:
    analyzer = sym.Analyzer()
    for unit in units:
        analyzer.bind(unit, tvm.tirx.const(0, str(unit.ty.dtype)))
    return const_int(analyzer.simplify(index - var)) == 0


def _kind(facts: BlockFacts, movers, u) -> str:
    """A name for the record: pool (one operand), conv/depthwise (a stencil operand, with or
    without a reuse axis), matmul (everything else: dense, batch matmul, 1×1 conv)."""
    if len(facts.reads) == 1:
        return "pool"
    stencil = any(index_uses([ix], s) and index_uses([ix], k) for r in movers
                  for ix in r.indices for s in facts.spatial for k in facts.reduce
                  if facts.extents[k.name] > 1)
    if stencil:
        return "conv" if u is not None else "depthwise"
    return "matmul"


def _u_stationary(facts, v_fused, v_extent, u, vt, rt, movers, others, shapes) -> bool:
    """Keep the u-operand tile (a matmul's A rows, a conv's filters) in cache across the
    outer v tiles when streaming the v-operand again per u tile moves fewer bytes than
    streaming the u-operand again per v tile (and per the other outer axes it ignores)."""
    if u is None:
        return False
    v_bytes = sum(numel(shapes[r.buffer]) for r in movers if r.buffer in shapes)
    if v_bytes * 4 > STREAM_BYTES:  # measured on BERT's FFN: keep A rows hot, stream B
        return True
    u_reads = [r for r in others if index_uses(r.indices, u)]
    u_bytes = sum(numel(shapes[r.buffer]) for r in u_reads if r.buffer in shapes)
    restream_v = v_bytes * (facts.extents[u.name] // rt)
    v_tiles = v_extent // vt
    for s in facts.spatial:
        if s.name != u.name and s.name not in v_fused and not any(
                index_uses(r.indices, s) for r in u_reads):
            v_tiles *= facts.extents[s.name]
    restream_u = u_bytes * v_tiles
    return restream_v <= restream_u


def schedule_tile(sch: s_tir.Schedule, block_rv, plan: TilePlan, params: CpuParams,
                  ) -> tuple[list[str], list[str]]:
    """Apply ``plan``. Returns the names of the blocks now scheduled and notes.

    Order matters: vectorize/parallel need the update to still be a reduction block, which
    ``decompose_reduction`` (last) ends."""
    facts = block_facts(sch, block_rv)
    params = params.for_dtype(facts.dtype)
    name = facts.name
    notes = [plan.describe()]
    if plan.u is not None and plan.u in facts.symbolic_iters and not plan.u_window \
            and len(plan.v_fused) == 1:
        notes += _pad_symbolic_rows(sch, block_rv, plan)
        facts = block_facts(sch, block_rv)
    ready = _written_before(sch, block_rv)
    wb = sch.cache_write(block_rv, 0, "local")
    done = [name, sch.get(wb).name_hint]
    v_name, u_name, v_fused = plan.v, plan.u, plan.v_fused
    if len(plan.v_fused) > 1:
        v_name, u_name = fuse_vector_axis(sch, block_rv, wb, plan)
        v_fused = (v_name,)
        facts = block_facts(sch, block_rv)
    by_var = loops_by_var(sch, block_rv)
    if by_var is None or facts is None:
        raise ValueError(f"{name}: loops do not map to its iterators")
    spatial = [by_var[v.name] for v in facts.spatial if v.name in by_var]
    reduce = [by_var[k.name] for k in facts.reduce if k.name in by_var]
    v_o, v_i = sch.split(by_var[v_name], factors=[None, plan.vt])
    u_o = u_i = None
    if u_name is not None:
        u_o, u_i = sch.split(by_var[u_name], factors=[None, plan.rt])
    others = [lp for var, lp in zip([v.name for v in facts.spatial], spatial)
              if var not in v_fused and var != u_name]
    others_vars = [v for v in facts.spatial if v.name not in v_fused and v.name != u_name]
    if u_name is None:
        outer = others + [v_o]
    elif plan.u_window:  # row-major through the input: consecutive tiles share window rows
        outer = others + [u_o, v_o]
    elif plan.u_stationary or plan.u in facts.symbolic_iters:
        # a symbolic u outermost: inner to a fused parallel loop it would be taken modulo the
        # symbolic tile count, which keeps TVM from bounding the accumulator to one tile (it
        # stayed (seq, 256) in memory: 13 ms instead of 1 ms on a 200 x 128 x 256 GEMM)
        outer = [u_o] + others + [v_o]
    else:
        outer = others + [v_o, u_o]
    inner = ([u_i] if u_i is not None else []) + [v_i]
    sch.reorder(*outer, *reduce, *inner)
    sch.reverse_compute_at(wb, outer[-1], preserve_unit_loops=True)
    # Fold the epilogue chain into the write-back, now under the tile loop: it stores the
    # epilogue's value at the epilogue's (possibly permuted) index from the accumulator.
    fused_epilogue, leftover = fold_epilogue_chain(sch, wb, ready)
    if fused_epilogue:
        notes.append("epilogue " + "+".join(fused_epilogue) + " stored from the accumulator")
    for consumer in leftover:  # epilogues that could not be inlined: computed per tile
        if len(plan.v_fused) > 1 or not _reads_tile_exactly(
                sch, consumer, sch.get(wb).writes[0].source.name):
            continue  # its region of a tile would be a bounding box: a separate stage
        if is_reduction_block(sch.get(consumer)):
            continue  # per tile it would reduce (and re-initialise) over one tile only
        try:
            _hide_reads(sch, consumer, ready)
            sch.reverse_compute_at(consumer, outer[-1], preserve_unit_loops=True)
            done.append(sch.get(consumer).name_hint)
            notes.append(f"epilogue {sch.get(consumer).name_hint} per tile")
        except s_tir.ScheduleError:
            pass
    if plan.piece:  # the row in whole registers (window_piece), unrolled
        v_p, v_i = sch.split(v_i, factors=[None, plan.piece])
        sch.unroll(v_p)
    if plan.unroll_window:  # in tap order: overlapping rows' input vectors loaded once
        for loop in reduce:
            sch.unroll(loop)
    sch.vectorize(v_i)
    if u_i is not None:
        sch.unroll(u_i)
    _vectorize_last(sch, wb, params)
    slab = _stage_producers_per_slab(sch, block_rv, facts, others_vars, outer, done, notes,
                                     params, plan.u_window)
    notes.append(parallelize(sch, outer[:slab] if slab else outer, facts.volume(), params))
    if reduce:  # after vectorize: a decomposed update is no longer a "reduction block"
        init = sch.decompose_reduction(block_rv, reduce[0])
        done += [sch.get(init).name_hint, sch.get(block_rv).name_hint]
        _vectorize_last(sch, init, params)
    return done, notes


def fold_epilogue_chain(sch: s_tir.Schedule, wb, ready: set[str], trial: bool = False,
                        stop: set[str] | None = None) -> tuple[list[str], list]:
    """Inline each sole spatial consumer of what the write-back ``wb`` writes into it, while
    it reads each element once and the expression stays within inline.py's budgets. Reads of
    the ``ready`` buffers (finished before the anchor) are hidden from the dependence check.
    ``trial``: try each step on a copy first, so that a refused step leaves nothing hidden;
    consumers named in ``stop`` are never folded. Returns the names folded and the consumers
    left over."""
    fused: list[str] = []
    nested = cost = 0  # of the epilogue folded so far (one expression: inline.py's budgets)
    while True:
        consumers = sch.get_consumers(wb)
        if len(consumers) != 1:
            return fused, list(consumers)
        cf = block_facts(sch, consumers[0])
        written = sch.get(wb).writes[0].source.name
        if (cf is None or cf.is_reduction or cf.name in (stop or ())
                or _read_under_condition(sch, consumers[0], written)
                or not _reads_each_element_once(cf, written, shapes_of(sch))
                or not fits_one_expression(nested + cf.nested, cost + cf.cost)):
            return fused, [consumers[0]]
        nested, cost = nested + cf.nested, cost + cf.cost
        for step in ([sch.copy()] if trial else []) + [sch]:
            try:
                _hide_reads(step, consumers[0], ready)
                step.reverse_compute_inline(consumers[0])
            except PRIMITIVE_ERRORS:
                return fused, [consumers[0]]
        fused.append(cf.name)


def _pad_symbolic_rows(sch: s_tir.Schedule, block_rv, plan: TilePlan) -> list[str]:
    """Pad a symbolic register axis to a multiple of the register tile (``pad_einsum``: the
    operand copied once with zero rows, the result copied back): the tile then divides it, so
    the accumulator needs no remainder guard, which would keep TVM from shrinking it to the
    tile (it stayed ``(1, seq, 32)`` in memory instead of ``(1, 8, 32)`` in registers)."""
    block = sch.get(block_rv)
    pads = [plan.rt if iv.var.name == plan.u else 1 for iv in block.iter_vars]
    try:
        sch.pad_einsum(block_rv, pads)
    except s_tir.ScheduleError:
        return []
    return [f"{plan.u} padded to a multiple of {plan.rt} rows"]


def deinterleave_strided(sch: s_tir.Schedule, block_rv, facts: BlockFacts,
                         kept: dict[str, str]) -> list[str]:
    """Give a stride-2 conv/pool input an even/odd-split innermost layout, (.., w) →
    (.., w % 2, w // 2), so the window reads ``x[.., rx % 2, ow + rx // 2]``: contiguous in
    the output column instead of a gather of every other element. A kept producer (the
    padding) simply writes that layout; a function input is copied once (``cache_read``).
    Returns notes (empty when nothing applied)."""
    live = [v for v in facts.spatial if facts.extents[v.name] > 1]
    if not live:
        return []
    v = live[-1]
    strided = {r.buffer for r in facts.reads if stride_in_last_dim(r.indices, v) == 2}
    if not strided:
        return []
    block = sch.get(block_rv)
    intermediates = alloc_buffers(sch)
    notes = []
    for index, region in enumerate(block.reads):
        name = region.source.name
        if name not in strided or const_int(region.source.shape[-1]) is None:
            continue
        if const_int(region.source.shape[-1]) % 2:
            continue
        producers = [p for p in sch.get_producers(block_rv)
                     if sch.get(p).writes[0].source.name == name]
        try:
            if name in intermediates and len(producers) == 1 and [
                    sch.get(c).name_hint for c in sch.get_consumers(producers[0])] == [
                    facts.name]:
                target = producers[0]
            elif name not in intermediates:  # only this block reads the copy
                target = sch.cache_read(block_rv, index, "global", consumer_blocks=[block_rv])
            else:
                continue
            rank = len(region.source.shape)
            split = tvm.tirx.IndexMap.from_func(
                lambda *i: (*i[:-1], i[-1] % 2, i[-1] // 2), ndim=rank)
            sch.transform_layout(target, ("write", 0), split)
        except s_tir.ScheduleError:
            continue
        try:  # iterate the copy in the new layout: contiguous stores, no % and // per element
            sch.transform_block_layout(target, split)
        except s_tir.ScheduleError:
            pass
        notes.append(f"{sch.get(target).name_hint}: stride-2 input split into even/odd "
                     f"columns for contiguous vector loads")
        buffer = sch.get(target).writes[0].source.name
        kept[buffer] = ((kept[buffer] + "; ") if buffer in kept else "") + (
            f"laid out as even/odd columns for stride-2 {facts.name!r} (contiguous vectors)")
    return notes


def split_channel_groups(sch: s_tir.Schedule, block_rv, facts: BlockFacts) -> list[str]:
    """A grouped conv reads its input at ``ff // G · C + rc`` (G output channels per group):
    no iterator of it is free of the input, so it tiles like a depthwise conv and loads every
    input vector once per output channel. Splitting ``ff`` into (group, channel in group)
    makes the channel in its group an iterator the input does not depend on: the tile's reuse
    axis, each input vector feeding up to G multiply-adds (ResNeXt's and RegNet's 3×3 convs
    of 8-16 channels a group). Returns notes (empty when nothing applied)."""
    if not facts.is_reduction:
        return []
    live = [v for v in facts.spatial if facts.extents[v.name] > 1]
    reads = [r for r in facts.reads if live and index_uses(r.indices, live[-1])]
    for var in live[:-1]:
        sizes = {size for r in reads for ix in r.indices
                 for size in _floordiv_sizes(ix, var)}
        extent = facts.extents[var.name]
        if len(sizes) != 1 or var.name in facts.symbolic_iters:
            continue
        size = sizes.pop()
        if size <= 1 or extent % size or size == extent:
            continue
        names = [iv.var.name for iv in sch.get(block_rv).iter_vars]
        pos = names.index(var.name)

        try:
            sch.transform_block_layout(block_rv, tvm.tirx.IndexMap.from_func(
                _split_at(pos, size), ndim=len(names)))
        except s_tir.ScheduleError:
            return []
        _simplify_indices(sch, block_rv)
        return [f"{facts.name}: {var.name} split into {extent // size} groups × {size} "
                f"channels (the channel in its group reuses each input vector)"]
    return []


def _simplify_indices(sch: s_tir.Schedule, block_rv) -> None:
    """Simplify the block's buffer indices with its iterators' ranges: the substitution of
    ``transform_block_layout`` leaves ``(g · G + c) // G``, which is ``g`` for c < G."""
    block = sch.get(block_rv)
    analyzer = sym.Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)

    def load(node):
        return tvm.tirx.BufferLoad(node.source, [analyzer.simplify(i) for i in node.indices])

    def store(node):
        return BufferStore(node.buffer, node.value, [analyzer.simplify(i) for i in node.indices])

    rules = [(TensorLoad, load), (BufferStore, store)]
    body = tvm_ffi.structural_map(block.body, rules)
    init = None if block.init is None else tvm_ffi.structural_map(block.init, rules)
    func = main_func(sch)
    buffers = {p: p for p in func.params if getattr(p.ty, "shape", None) is not None}
    buffers.update({b: b for b in alloc_buffers(sch).values()})
    draft = SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body, init,
                   block.alloc_buffers, block.match_buffers, block.annotations, block.span)
    reads, writes = s_tir.analysis.get_sblock_read_write_region(draft, buffers)
    new = SBlock(block.iter_vars, reads, writes, block.name_hint, body, init,
                 block.alloc_buffers, block.match_buffers, block.annotations, block.span)
    sch.state.replace(sch.get_sref(block_rv), new, {block: new})


def _split_at(pos: int, size: int):
    def index_map(*idx):
        return (*idx[:pos], idx[pos] // size, idx[pos] % size, *idx[pos + 1:])

    return index_map


def _floordiv_sizes(index, var) -> list[int]:
    """The constant divisors d of every ``var // d`` in ``index``."""
    found = []
    for node in find_all(index, (tvm.tirx.FloorDiv,)):
        if isinstance(node.a, tvm.tirx.Var) and node.a.same_as(var):
            d = const_int(node.b)
            if d is not None:
                found.append(d)
    return found


def transpose_to_vector_axis(sch: s_tir.Schedule, block_rv, facts: BlockFacts,
                             kept: dict[str, str]) -> list[str]:
    """A matmul whose second operand is stored row by row of the *output* axis (``B[j, k]``,
    what SmartMem's reduction-innermost layout and a transposed-B GEMM give) cannot load a
    vector along ``j``. When each element is reused at least ``_MIN_REUSE`` times, copy the
    operand once with ``j`` moved innermost (``cache_read`` + ``transform_layout``; a kept
    producer writes that layout directly) so the tile rule applies. Returns notes."""
    live = [v for v in facts.spatial if facts.extents[v.name] > 1]
    if not facts.is_reduction or not live:
        return []
    v = live[-1]
    block = sch.get(block_rv)
    intermediates = alloc_buffers(sch)
    notes = []
    for read in facts.reads:
        dims = [i for i, ix in enumerate(read.indices) if index_uses([ix], v)]
        if len(dims) != 1 or dims[0] == len(read.indices) - 1:
            continue
        if not any(index_uses(read.indices[-1:], k) for k in facts.reduce):
            continue
        index = next((i for i, r in enumerate(block.reads) if r.source.name == read.buffer),
                     None)
        shape = block.reads[index].source.shape if index is not None else None
        size = numel(shape) if shape is not None else 0
        if not size or facts.volume() < _MIN_REUSE * size:
            continue
        producers = [p for p in sch.get_producers(block_rv)
                     if sch.get(p).writes[0].source.name == read.buffer]
        try:
            if read.buffer in intermediates and len(producers) == 1 and [
                    sch.get(c).name_hint for c in sch.get_consumers(producers[0])] == [
                    facts.name]:
                target = producers[0]
            elif read.buffer not in intermediates:  # only this block reads the copy
                target = sch.cache_read(block_rv, index, "global", consumer_blocks=[block_rv])
            else:
                continue
            sch.transform_layout(target, ("write", 0), tvm.tirx.IndexMap.from_func(
                _move_last(dims[0]), ndim=len(shape)))
            loops = sch.get_loops(target)
            if len(loops) == len(shape):  # write rows of the new layout contiguously
                sch.reorder(*loops[:dims[0]], *loops[dims[0] + 1:], loops[dims[0]])
        except s_tir.ScheduleError:
            continue
        notes.append(f"{sch.get(target).name_hint}: operand copied once with the output axis "
                     f"innermost (B[j, k] → B[k, j]) for vector loads")
        kept[sch.get(target).writes[0].source.name] = (
            f"operand of Many-to-Many {facts.name!r} re-laid out with its output axis "
            f"innermost (copied once, each element reused "
            f"{facts.volume() // max(size, 1)}x) so the tile can load vectors")
        break
    return notes


def _move_last(dim: int):
    def index_map(*idx):
        return (*idx[:dim], *idx[dim + 1:], idx[dim])

    return index_map


def _stage_producers_per_slab(sch, block_rv, facts, others_vars, outer, done, notes,
                              params: CpuParams, window_rows: bool = False) -> int:
    """A depthwise conv or a pooling window reads its padded input one channel at a time:
    compute the kept padding per channel, under the channel loop, so it is still in cache
    when the window reads it, instead of one pass over the whole tensor; so is an elementwise
    prologue kept in front of the padding (a swish), vectorised. Returns how many outer loops
    form the slab (0: nothing staged)."""
    if len(outer) != len(others_vars) + 1 + window_rows:
        return 0  # a reuse axis: every tile reads every channel
    producers = [p for p in sch.get_producers(block_rv)
                 if (pf := block_facts(sch, p)) is not None and not pf.is_reduction
                 and PACKED_GEMM_STAGE not in sch.get(p).annotations]
    if not producers:
        return 0
    buffers = {sch.get(p).writes[0].source.name for p in producers}
    reads = [r for r in facts.reads if r.buffer in buffers]
    units = [k for k in facts.reduce if facts.extents[k.name] == 1]
    slab = 0
    for var in others_vars:
        dims = [[ix for ix in r.indices if index_uses([ix], var)] for r in reads]
        if not all(len(d) == 1 and _is_var_plus_units(d[0], var, units) for d in dims):
            break
        slab += 1
    if slab == 0:
        return 0
    while producers:
        producer = producers.pop(0)
        name = sch.get(producer).name_hint
        try:
            sch.compute_at(producer, outer[slab - 1], preserve_unit_loops=True)
        except s_tir.ScheduleError:
            continue
        done.append(name)
        pf = block_facts(sch, producer)
        vec = ""
        if pf is not None and not pf.padding:
            vec = ", " + vectorize_inner(sch, sch.get_loops(producer)[slab:], params)
        notes.append(f"{name} staged per slab{vec}")
        for up in sch.get_producers(producer):  # its own kept elementwise producers
            uf = block_facts(sch, up)
            if uf is not None and not uf.is_reduction and [
                    sch.get(c).name_hint for c in sch.get_consumers(up)] == [name] \
                    and PACKED_GEMM_STAGE not in sch.get(up).annotations:
                producers.append(up)
    return slab


def fuse_vector_axis(sch: s_tir.Schedule, block_rv, wb, plan: TilePlan) -> tuple[str, str]:
    """Make (w, v) one iterator of the anchor, of its accumulator and of its write-back.

    Fusing only the loops would let a tile cross a row, and ``reverse_compute_at`` then covers
    the bounding box of the rows touched: the write-back would store accumulator lanes this
    tile never computed. With the accumulator flattened and both blocks iterating the fused
    axis, each tile's region is exact. Returns the new names of v and u."""
    block = sch.get(block_rv)
    names = [iv.var.name for iv in block.iter_vars]
    pos = names.index(plan.v_fused[0])
    u_pos = names.index(plan.u) if plan.u is not None else None
    row = const_int(block.iter_vars[pos + 1].dom.extent)
    rank = len(sch.get(wb).iter_vars)

    def flatten_last_two(*idx):
        return (*idx[:-2], idx[-2] * row + idx[-1])

    def fuse_at(*idx):
        return (*idx[:pos], idx[pos] * row + idx[pos + 1], *idx[pos + 2:])

    sch.transform_layout(block_rv, ("write", 0),
                         tvm.tirx.IndexMap.from_func(flatten_last_two, ndim=rank))
    sch.transform_block_layout(block_rv, tvm.tirx.IndexMap.from_func(fuse_at, ndim=len(names)))
    sch.transform_block_layout(wb, tvm.tirx.IndexMap.from_func(flatten_last_two, ndim=rank))
    new = [iv.var.name for iv in sch.get(block_rv).iter_vars]
    u_new = None
    if u_pos is not None:
        u_new = new[u_pos if u_pos < pos else u_pos - 1]
    return new[pos], u_new


def shapes_of(sch: s_tir.Schedule) -> dict:
    return tile_shapes(sch)


def _reads_each_element_once(cf: BlockFacts, buffer: str, shapes: dict) -> bool:
    """Whether ``reverse_compute_inline`` can express the consumer per produced element: its
    iterators must map one-to-one onto the elements of ``buffer`` (a permutation or reshape).
    A broadcast reads an element several times (TVM 0.27 crashes on it instead of refusing);
    a slice or gather skips elements, and TVM 0.27 inlines it without its selection."""
    reads = cf.reads_of(buffer)
    if not reads or buffer not in shapes or len({str(r.indices) for r in reads}) != 1:
        return False  # x * sigmoid(x) reads one element twice: fine; two elements: not
    return is_bijective_read(cf, reads[0].indices, shapes[buffer])


def _reads_tile_exactly(sch: s_tir.Schedule, block_rv, buffer: str) -> bool:
    """The block reads ``buffer`` only at plain, distinct iterators (a copy, a permutation, a
    broadcast) or at index 0 of a unit dimension, never in a select branch: then the part of it
    that reads one rectangular tile is exactly that tile. A reshape's div/mod index would make
    ``reverse_compute_at`` cover a bounding box, reading elements other tiles have not written
    yet."""
    block = sch.get(block_rv)
    if not isinstance(block.body, tvm.tirx.BufferStore) or _read_under_condition(
            sch, block_rv, buffer):
        return False
    names = {iv.var.name for iv in block.iter_vars}
    for load in buffer_loads(block.body.value):
        if load.source.name != buffer:
            continue
        seen = [getattr(ix, "name", None) for ix in load.indices if const_int(ix) is None]
        if any(n not in names for n in seen) or len(set(seen)) != len(seen):
            return False
        # A fixed index into a dimension of several elements selects one of them: the
        # consumer would run at every tile and read an element of another tile (or, once the
        # buffer is compacted to a tile, past its end).
        if any(const_int(ix) is not None and const_int(dim) != 1
               for ix, dim in zip(load.indices, load.source.shape)):
            return False
    return True


def _read_under_condition(sch: s_tir.Schedule, block_rv, buffer: str) -> bool:
    """The block reads ``buffer`` only in a branch of a select (concat, stack, pad)."""
    value = sch.get(block_rv).body.value if hasattr(sch.get(block_rv).body, "value") else None
    if value is None:
        return True
    for node in find_all(value, (tvm.ir.Call, tvm.tirx.Select)):
        if isinstance(node, tvm.ir.Call) and not (
                isinstance(node.op, tvm.ir.Op) and node.op.name.endswith("if_then_else")):
            continue
        branches = node.args[1:] if isinstance(node, tvm.ir.Call) else [
            node.true_value, node.false_value]
        if any(ld.source.name == buffer for br in branches for ld in buffer_loads(br)):
            return True
    return False


def _written_before(sch: s_tir.Schedule, block_rv) -> set[str]:
    """Output buffers completely written by top-level stages that run before the anchor's nest
    (and by nothing after it): for the anchor's epilogue they are inputs, not producers.
    Only function parameters qualify: hiding a read of an intermediate would also hide it from
    TVM's allocation planning."""
    return written_only_before(sch, block_rv) & param_names(sch)


def _hide_reads(sch: s_tir.Schedule, block_rv, ready: set[str]) -> None:
    """Hide an epilogue's reads of buffers finished before the anchor (a mask computed by an
    earlier stage) from the dependence checks of reverse_compute_inline/at, which otherwise
    refuse a consumer with a second producer block. Safe: the order of the top-level stages
    is fixed from here on and those writers all run before the anchor's nest."""
    reads = sch.get(block_rv).reads
    hidden = [i for i, r in enumerate(reads) if r.source.name in ready]
    if hidden:
        sch.unsafe_hide_buffer_access(block_rv, "read", hidden)


def _vectorize_last(sch: s_tir.Schedule, block_rv, params: CpuParams) -> None:
    """Vectorise a tile-level block's innermost loop when it has more than one lane."""
    loops = sch.get_loops(block_rv)
    if not loops:
        return
    last = sch.get(loops[-1])
    extent = loop_extent(sch, loops[-1]) or 1
    if extent > 1 and extent <= 16 * params.lanes and int(last.kind) == 0:
        sch.vectorize(loops[-1])


def tile_shapes(sch: s_tir.Schedule) -> dict:
    """Buffer name -> shape for every buffer the function reads (params and intermediates)."""

    shapes = {p.name: list(p.shape) for p in main_func(sch).params if hasattr(p, "shape")}
    shapes.update({n: list(b.shape) for n, b in alloc_buffers(sch).items()})
    return shapes

"""Overlapped-tile (halo) templates for fused chains of region-based operators (OptiFX AFUSION).

A fused PrimFunc holding two or three region-based reductions (conv, depthwise conv, pooling)
chained through element-wise epilogues — SISO ``pad1→C1→epi→pad2→C2→epi``, MISO
``C1, C2 → add`` and SIMO ``C1 → {C2a, C2b} → concat`` — is scheduled as one loop nest over
tiles of the *last* stage's output:

* every element-wise stage between the reductions is inlined into the staged (padded) input of
  the next reduction, so an epilogue is applied before padding (border zeros stay zeros; a
  max-pool's ``-inf`` padding is TOPI's own value);
* the output is split into spatial tiles ``(th, tw)`` (all output channels per tile: splitting
  the channels would recompute the whole intermediate per slice, pitfall 10 of the notes);
* every earlier stage is ``compute_at`` the tile loop, last first: TVM derives each stage's
  region backwards from the tile (Eq. 4 of the paper, padding included: the staged intermediate
  is the *padded* one, so its region never clips and its buffer compacts to the tile + halo);
  the halo rows/columns are recomputed by neighbouring tiles (the paper's ``T_red``);
* CPU: tiles run in parallel, the innermost spatial axis is vectorised, a reduction with an
  output-channel reuse axis accumulates a register tile.

GPU (CUDA/OpenCL) variant: the tile loop is bound to ``blockIdx.x``, the intermediate goes to
``shared`` (``shared.dyn`` above 48 KB), and each stage's spatial loops are spread over the same
``threadIdx.x`` extent; ``verify_gpu_code`` filters the tile sizes.

The tile space is the paper's ``{2,4,8,16}`` per spatial axis plus whole rows, filtered by the
hardware (cache or shared memory, threads) and ranked by redundancy and parallelism; a tile can
be forced with ``tile=(th, tw)`` (tunable).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx

from ..tir_utils import find_all, iter_sblocks
from .analysis import PRIMITIVE_ERRORS, BlockFacts, block_facts, root_block, uses_var
from .cpu_target import CpuParams
from .cpu_tile import (
    WINDOW_REGISTERS,
    TilePlan,
    deinterleave_strided,
    fuse_vector_axis,
    window_vector_tile,
)
from .fast_math import fast_math
from .ieee import protect_negations
from .loops import largest_divisor, loop_extent, pick_vector_tile
from .records import (
    DONE_ATTR,
    KEPT_ATTR,
    SCHEDULE_ATTR,
    ScheduleFailedWarning,
    kept_reasons,
    restore_symbol,
)

TILE_SPACE = (2, 4, 8, 16)
CACHE_BYTES = 512 << 10  # working set of one tile: about a quarter of a 2 MiB L2
SHARED_STATIC = 48 << 10
CHAIN_ATTR = "tvm_fusion.conv_chain"


@dataclass
class ChainStages:
    """The stages of a fused chain, in program order."""

    blocks: list  # every block name, program order
    reductions: list[str]  # region-based reductions, program order
    output: str  # the block that writes the (last) function output
    facts: dict


def chain_stages(sch: s_tir.Schedule) -> ChainStages | None:
    """The chain's stages, or None when the function is not a chain of 2–3 region reductions."""
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(root_block(sch))]
    facts = {n: block_facts(sch, sch.get_sblock(n)) for n in names}
    if any(f is None for f in facts.values()):
        return None
    reductions = [n for n in names if facts[n].is_reduction and _is_region(facts[n])]
    if not 2 <= len(reductions) <= 3 or sum(f.is_reduction for f in facts.values()) != len(
            reductions):
        return None
    return ChainStages(names, reductions, names[-1], facts)


def _is_region(f: BlockFacts) -> bool:
    """A 4-D NCHW window reduction (conv, depthwise conv, pool): some read slides a window,
    an index of an output position plus a reduction offset (``h * s + kh``). A mean or
    variance over H and W (instance norm) has the same loop shape but no window."""
    if len(f.spatial) != 4 or len(f.write_indices) != 4 or len(f.reduce) not in (2, 3):
        return False
    return any(uses_var(ix, s) and uses_var(ix, r)
               for read in f.reads for ix in read.indices for s in f.spatial for r in f.reduce)


def is_conv_chain(func: tirx.PrimFunc) -> bool:
    try:
        return chain_stages(s_tir.Schedule(func.with_attr("global_symbol", "main"))) is not None
    except Exception:  # noqa: BLE001
        return False


# ----------------------------------------------------------------------------- tile choice


def halo_extent(tile: int, chain: list[tuple[int, int]]) -> list[int]:
    """Eq. 4 applied backwards: the extent of each stage's input for an output ``tile``;
    ``chain`` is ``[(kernel, stride), ...]`` first op first. Returns extents first op first
    (index 0 is the first op's input window)."""
    out = [tile]
    for k, s in reversed(chain):
        out.append((out[-1] - 1) * s + k)
    return list(reversed(out))


def choose_tile(out_h: int, out_w: int, channels: list[int], chain: list[tuple[int, int]],
                cores: int, lanes: int = 16, budget: int = CACHE_BYTES,
                space=TILE_SPACE) -> tuple[int, int]:
    """Tile ``(th, tw)`` of the last output. ``tw`` divides the row and fits one SIMD register
    (measured: a 28- or 56-lane row tile spills and runs 10x slower than a 14-lane one);
    ``th`` from the paper's space ``{2,4,8,16}`` (or the whole height). The working set (every
    stage's tile + halo, all channels) must fit ``budget``; then fewest redundant (halo)
    elements per useful one, enough tiles for every core, larger tiles."""
    widths = [d for d in range(min(out_w, lanes), 0, -1) if out_w % d == 0]
    heights = sorted({t for t in space if t <= out_h} | {out_h}, reverse=True)
    best, best_key = (1, widths[-1]), None
    for tw in widths:
        for th in heights:
            hs, ws = halo_extent(th, chain), halo_extent(tw, chain)
            ws_bytes = 4 * sum(c * h * w for c, h, w in zip(channels, hs, ws))
            if ws_bytes > budget:
                continue
            tiles = -(-out_h // th) * -(-out_w // tw)
            computed = sum(c * h * w for c, h, w in zip(channels[1:-1], hs[1:-1], ws[1:-1]))
            useful = sum(c * th * tw for c in channels[1:-1]) or 1
            waste = (-(-out_h // th) * th) / out_h
            key = (tiles < 2 * cores, round(computed / useful * waste, 1), -tw, -th)
            if best_key is None or key < best_key:
                best, best_key = (th, tw), key
    return best


# --------------------------------------------------------------------------------- CPU


class ChainDeclined(ValueError):
    """The template does not apply to this chain, for a reason known before anything fails
    to build: the per-operator rules take it, the reason in their notes (no warning)."""


def schedule_conv_chain_cpu(sch: s_tir.Schedule, params: CpuParams,
                            tile: tuple[int, int] | None = None) -> list[str]:
    """Schedule a fused chain in place; returns one note per step. Raises when the function
    is not a chain this template handles (the caller falls back)."""
    stages = chain_stages(sch)
    if stages is None:
        raise ValueError("not a chain of 2-3 region-based operators")
    staged = _inline_elementwise(sch, stages)
    chain, chans = _chain_geometry(sch, stages)
    if _pointwise_tail(sch, stages, chain, staged):
        return _schedule_pointwise_band(sch, stages, staged, params,
                                        rows=tile[0] if tile else None)
    out_name = stages.output
    out = sch.get_sblock(out_name)
    of = block_facts(sch, out)
    n, c, h, w = (of.extents[v.name] for v in of.spatial)
    th, tw = tile or choose_tile(h, w, chans, chain, params.cores, params.lanes)
    notes = [f"conv chain ({len(stages.reductions)} region ops: {', '.join(stages.reductions)}); "
             f"tile {th}x{tw} of {h}x{w}, all {c} channels per tile"]
    anchor = stages.reductions[-1]
    producers = [sch.get(b).name_hint for b in sch.get_producers(out)]
    direct = out_name == anchor or (_feeds_only(sch, anchor, out_name)
                                    and producers == [anchor])
    if direct and out_name != anchor:
        tile_loop, wi_anchor = _tile_anchor(sch, anchor, out_name, th, tw, params, notes)
    else:
        tile_loop = _tile_output(sch, out_name, th, tw, params)
        wi_anchor = None
    done = {anchor, out_name}
    for name in reversed(stages.blocks):
        if name in done or name not in _live(sch):
            continue
        sch.compute_at(sch.get_sblock(name), tile_loop, preserve_unit_loops=True)
    trial = sch.copy()
    try:
        trial.parallel(tile_loop)
    except PRIMITIVE_ERRORS as err:
        # TVM's check of the stages in a parallel loop: a stage computed per tile whose halo
        # leaves the map is clipped by a predicate, and a predicated reduction (a 1×1 conv
        # from one channel over a 9-wide map, tiles 1 wide: fuzz seed 6141) is neither a
        # complete nor a reduction block to it
        detail = next((line.strip() for line in str(err).splitlines()
                       if line.startswith("Error message:")), "")
        raise ChainDeclined("TVM does not run its tile loop in parallel"
                            + (f" ({detail[len('Error message: '):][:160]})" if detail else "")
                            ) from None
    sch.parallel(tile_loop)  # before decompose_reduction: it needs reduction blocks
    decompose = []
    for name in stages.blocks:
        if name in done or name not in _live(sch):
            continue
        f = block_facts(sch, sch.get_sblock(name))
        if f.is_reduction:
            note, red_loop = _schedule_inner_reduction(sch, name, params)
            notes.append(note)
            decompose.append((name, red_loop))
        else:
            _vectorize_spatial(sch, name, params)
    if wi_anchor is not None:
        note, red_loop = wi_anchor
        notes.append(note)
        decompose.append((anchor, red_loop))
    for name, red_loop in decompose:
        init = sch.decompose_reduction(sch.get_sblock(name), red_loop)
        sch.vectorize(sch.get_loops(init)[-1])
    notes.append(f"staged per tile: {', '.join(n for n in staged)}")
    return notes


# ------------------------------------------------------- CPU: pointwise tail, row bands


def _pointwise_tail(sch, stages: ChainStages, chain, staged: list[str]) -> bool:
    """A SISO chain of two whose second op is a 1×1, stride-1 conv reading the first one's
    output unpadded (MobileNetV2's depthwise→pointwise): the second op needs no halo, so a
    band of whole rows of the first op's output is exactly what a band of the output needs."""
    if len(stages.reductions) != 2 or chain[-1] != (1, 1):
        return False
    first, second = stages.reductions
    between = _consumer_names(sch, first)
    if between == [second]:
        return True
    if len(between) != 1 or between[0] not in staged or _consumer_names(
            sch, between[0]) != [second]:
        return False
    # an unpadded staging: the same shape as what it stages (buffer names can repeat)
    return _written_shape(sch, first) == _written_shape(sch, between[0])


def _consumer_names(sch, name: str) -> list[str]:
    return [sch.get(b).name_hint for b in sch.get_consumers(sch.get_sblock(name))]


def _written_shape(sch, name: str) -> tuple[int, ...]:
    return tuple(int(d) for d in sch.get(sch.get_sblock(name)).writes[0].source.shape)


def choose_band(height: int, width: int, channels: int, cores: int, lanes: int,
                budget: int = CACHE_BYTES) -> int:
    """Rows per band for a pointwise tail: the band of the first op's output (``channels``
    × ``rows`` × ``width``) stays in cache (``budget``), every core gets a band, then the
    largest band: each band restarts the first op's per-channel staging, and small
    bands were measured slower (MobileNetV2's 384-channel 14×14 pair: 2-row bands 0.75× of
    the separate kernels, whole-image 1.25×, one thread)."""
    best, best_key = 1, None
    for rows in range(1, height + 1):
        if height % rows:
            continue
        fits = 4 * channels * rows * width <= budget
        key = (fits, height // rows >= cores, rows)
        if best_key is None or key > best_key:
            best, best_key = rows, key
    return best


def _schedule_pointwise_band(sch: s_tir.Schedule, stages: ChainStages, staged: list[str],
                             params: CpuParams, rows: int | None = None) -> list[str]:
    """Depthwise (or any region op) → 1×1 conv, one band of whole rows per parallel task.

    Per band: the first op computes its rows of every channel into a band buffer (its
    epilogue stored from a one-row register accumulator, its padded input staged per
    channel), then the 1×1 conv runs over the band as the separate 1×1 conv does over the
    whole image: the band's rows are one contiguous vector axis (``rows·width`` lanes), RT
    output channels in registers, its epilogue stored from the accumulator. The intermediate
    is band-sized and the 1×1 conv's inner loop is the separate kernel's."""
    first, second = stages.reductions
    out_name = stages.output
    # a stride-2 first op reads its padding as even/odd columns (contiguous vectors), as the
    # separate kernel does: strided loads made MobileNetV2's 96@112 pair 0.38x
    split = deinterleave_strided(sch, sch.get_sblock(first), stages.facts[first], {})
    # the first op accumulates in registers; its epilogue (the staged input of the 1×1
    # conv) is stored from that accumulator into the band buffer
    first_wb = sch.cache_write(sch.get_sblock(first), 0, "local")
    for block in sch.get_consumers(first_wb):
        if sch.get(block).name_hint in staged:
            sch.reverse_compute_inline(block)
    pw = sch.get_sblock(second)
    f = block_facts(sch, pw)
    _, co, h, w = (f.extents[v.name] for v in f.spatial)
    c1 = f.extents[f.reduce[0].name]
    rows = rows or choose_band(h, w, c1, params.cores, params.lanes)
    band = rows * w
    vt = pick_vector_tile(band, params.lanes, max_vectors=2) or 1
    rt = largest_divisor(co, max(1, params.registers // -(-vt // params.lanes)))
    plan = TilePlan("conv", f.spatial[3].name, vt, (f.spatial[2].name, f.spatial[3].name),
                    f.spatial[1].name, rt, True)
    wb = sch.cache_write(pw, 0, "local")
    fuse_vector_axis(sch, pw, wb, plan)
    n_loop, co_loop, flat, *reds = sch.get_loops(pw)
    band_loop, chunk, lanes = sch.split(flat, [None, band // vt, vt])
    co_out, co_in = sch.split(co_loop, [None, rt])
    sch.reorder(n_loop, band_loop, co_out, chunk, *reds, co_in, lanes)
    sch.reverse_compute_at(wb, chunk, preserve_unit_loops=True)
    if out_name != second:
        sch.reverse_compute_inline(sch.get_sblock(out_name))
    sch.vectorize(lanes)
    sch.unroll(co_in)
    sch.vectorize(sch.get_loops(wb)[-1])
    tile_loop = sch.fuse(n_loop, band_loop)
    # the first op at the band: one output row at a time in registers
    sch.compute_at(first_wb, tile_loop, preserve_unit_loops=True)
    first_block = sch.get_sblock(first)
    sch.compute_at(first_block, tile_loop, preserve_unit_loops=True)
    _, n1, c1_loop, h1, w1, *reds1 = sch.get_loops(first_block)
    f1 = block_facts(sch, first_block)
    dense = len(f1.reduce) == 3 and f1.extents[f1.reduce[0].name] > 1  # reads all channels
    dvt = (None if dense else window_vector_tile(w, params.lanes)) or pick_vector_tile(
        w, params.lanes, max_vectors=2) or 1
    w_out, w_in = sch.split(w1, [None, dvt])
    vectors = -(-dvt // params.lanes)
    if dense:  # RT output channels per pass over the inputs: each loaded row feeds RT FMAs
        rt1 = largest_divisor(f1.extents[f1.spatial[1].name],
                              max(1, params.registers // vectors))
        c1_out, reg = sch.split(c1_loop, [None, rt1])
        sch.reorder(n1, c1_out, h1, w_out, *reds1, reg, w_in)
    else:  # window rows in registers: independent multiply-add chains (cpu_tile._window_rows)
        rt1 = largest_divisor(rows, max(1, WINDOW_REGISTERS // vectors))
        h_out, reg = sch.split(h1, [None, rt1])
        sch.reorder(n1, c1_loop, h_out, w_out, *reds1, reg, w_in)
    sch.reverse_compute_at(first_wb, w_out, preserve_unit_loops=True)
    sch.vectorize(w_in)
    sch.unroll(reg)
    sch.vectorize(sch.get_loops(first_wb)[-1])
    padded = []
    for block in sch.get_producers(first_block):
        name = sch.get(block).name_hint
        if name in staged:  # the padded input, rows of the band + halo: per channel for a
            # depthwise/pool first op, once per band (every channel) for a dense conv
            sch.compute_at(block, tile_loop if dense else c1_loop, preserve_unit_loops=True)
            _vectorize_spatial(sch, name, params)
            padded.append(name)
    sch.parallel(tile_loop)
    for block, red in ((pw, reds[0]), (first_block, reds1[0])):
        init = sch.decompose_reduction(block, red)
        sch.vectorize(sch.get_loops(init)[-1])
    return [f"conv chain ({first} → 1x1 {second}): bands of {rows} rows of {h}, all "
            f"channels per band, band buffer {c1}x{rows}x{w}", *split,
            f"{first}: per band, "
            + (f"{rt1} {'channels' if dense else 'rows'} x {dvt} lanes in registers")
            + (f", {', '.join(padded)} staged per {'band' if dense else 'channel'}"
               if padded else ""),
            f"{second}: the band's {band} positions as one vector axis, {rt} output channels "
            f"x {vt} lanes in registers, epilogue stored from the accumulator"]


def _live(sch) -> set[str]:
    return {b.name_hint for b in iter_sblocks(sch.mod["main"])}


def _inline_elementwise(sch: s_tir.Schedule, stages: ChainStages) -> list[str]:
    """Inline every element-wise stage except the direct inputs of reductions (the staged,
    padded intermediates) and the output writer. Returns the kept stages."""
    reductions = set(stages.reductions)
    kept = []
    for name in stages.blocks:
        if name in reductions or name == stages.output:
            continue
        block = sch.get_sblock(name)
        consumers = [sch.get(b).name_hint for b in sch.get_consumers(block)]
        if any(cn in reductions for cn in consumers):
            kept.append(name)
            continue
        sch.compute_inline(block)
    return kept


def _feeds_only(sch, anchor: str, out_name: str) -> bool:
    """The anchor's sole consumer chain ends in the output writer (a SISO/MISO epilogue)."""
    consumers = [sch.get(b).name_hint for b in sch.get_consumers(sch.get_sblock(anchor))]
    return consumers == [out_name]


def _chain_geometry(sch, stages: ChainStages):
    """``[(kernel, stride)]`` along the main path and channels of each stage's input+output."""
    chain, chans = [], []
    for name in stages.reductions:
        f = stages.facts[name]
        red = [f.extents[v.name] for v in f.reduce]
        k = red[-1]
        read = max(f.reads, key=lambda r: len(r.indices))
        stride = _coefficient(read.indices[2], f.spatial[2])
        chain.append((k, max(stride, 1)))
        in_c = _input_channels(sch, name)
        if not chans:
            chans.append(in_c)
        chans.append(f.extents[f.spatial[1].name])
    return chain, chans


def _input_channels(sch, reduction: str) -> int:
    """Channels of the staged (padded) input a reduction reads: from the block that writes it
    (buffer names repeat in a fused function: two convs' pads are both ``pad_temp``)."""
    for block in sch.get_producers(sch.get_sblock(reduction)):
        shape = sch.get(block).writes[0].source.shape
        if len(shape) == 4:
            return int(shape[1])
    return 1


def _coefficient(expr, var) -> int:
    """d expr / d var for an affine index expression (1 when it cannot tell)."""
    try:
        return _eval(expr, {var.name: 1}) - _eval(expr, {})
    except (TypeError, ValueError):
        return 1


def _eval(expr, env: dict) -> int:
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        return env.get(expr.name, 0)
    if isinstance(expr, tirx.Cast):
        return _eval(expr.value, env)
    ops = {tirx.Add: lambda a, b: a + b, tirx.Sub: lambda a, b: a - b,
           tirx.Mul: lambda a, b: a * b, tirx.FloorDiv: lambda a, b: a // b}
    for cls, fn in ops.items():
        if isinstance(expr, cls):
            return fn(_eval(expr.a, env), _eval(expr.b, env))
    raise ValueError(f"not affine: {expr}")


def _tile_anchor(sch, anchor: str, out_name: str, th: int, tw: int, params: CpuParams,
                 notes: list[str]):
    """The last reduction accumulates a register tile (RT output channels × the tile row) and
    its epilogue (the output writer) is stored from the accumulator."""
    out = sch.get_sblock(out_name)
    block = sch.get_sblock(anchor)
    wb = sch.cache_write(block, 0, "local")
    sch.reverse_compute_inline(out)
    f = block_facts(sch, block)
    loops = sch.get_loops(block)
    n, k, h, w = loops[:4]
    reds = loops[4:]
    kext = f.extents[f.spatial[1].name]
    vectors = -(-tw // params.lanes)
    rt = largest_divisor(kext, max(1, min(8, params.registers // vectors)))
    ho, hi = sch.split(h, [None, th])
    wo, wi = sch.split(w, [None, tw])
    ko, ki = sch.split(k, [None, rt])
    sch.reorder(n, ho, wo, ko, hi, *reds, ki, wi)
    tile_loop = sch.fuse(n, ho, wo)
    sch.reverse_compute_at(wb, hi, preserve_unit_loops=True)
    sch.vectorize(wi)
    sch.unroll(ki)
    wl = sch.get_loops(wb)
    sch.vectorize(wl[-1])
    return tile_loop, (f"{anchor}: {rt} output channels x {tw} lanes in registers, epilogue "
                       f"stored from the accumulator", reds[0])


def _tile_output(sch, out_name: str, th: int, tw: int, params: CpuParams):
    """Tile the output writer (SIMO's concat, or a pool/conv without epilogue)."""
    block = sch.get_sblock(out_name)
    loops = sch.get_loops(block)
    n, c, h, w = loops[:4]
    reds = loops[4:]
    ho, hi = sch.split(h, [None, th])
    wo, wi = sch.split(w, [None, tw])
    sch.reorder(n, ho, wo, c, hi, *reds, wi)
    tile_loop = sch.fuse(n, ho, wo)
    if not reds and tw % params.lanes == 0:
        sch.vectorize(wi)
    return tile_loop


def _schedule_inner_reduction(sch, name: str, params: CpuParams):
    """A reduction computed at the tile: its spatial region loops are (n, c, h, w). The row
    (w) is the vector axis, accumulated in a ``local`` tile with the window loops outside it;
    a conv with an input-channel reduction keeps RT output channels per pass over the inputs
    (each loaded input row feeds RT FMAs)."""
    block = sch.get_sblock(name)
    loops = sch.get_loops(block)
    f = block_facts(sch, block)
    nred = len(f.reduce)
    inner = loops[-(4 + nred):]
    n, c, h, w = inner[:4]
    reds = inner[4:]
    wext = loop_extent(sch, w) or 1
    cext = loop_extent(sch, c) or 1
    rc_ext = loop_extent(sch, reds[0]) if nred == 3 else 1
    wb = sch.cache_write(block, 0, "local")
    if rc_ext and rc_ext > 1:  # a full conv: register tile over output channels
        vectors = -(-wext // params.lanes)
        rt = largest_divisor(cext, max(1, min(8, params.registers // vectors)))
        co, ci = sch.split(c, [None, rt])
        sch.reorder(n, co, h, *reds, ci, w)
        sch.reverse_compute_at(wb, h, preserve_unit_loops=True)
        sch.unroll(ci)
        note = f"{name}: per tile, {rt} channels x {wext} lanes in registers"
    else:
        sch.reorder(n, c, h, *reds, w)
        sch.reverse_compute_at(wb, h, preserve_unit_loops=True)
        note = f"{name}: per tile, a {wext}-lane row in registers, windows outside the row"
    sch.vectorize(w)
    sch.vectorize(sch.get_loops(wb)[-1])
    return note, reds[0]


def _vectorize_spatial(sch, name: str, params: CpuParams) -> None:
    """Vectorise a staged stage's row (the pad's bounds check becomes a select)."""
    loops = sch.get_loops(sch.get_sblock(name))
    ext = loop_extent(sch, loops[-1]) or 1
    if ext <= 2 * params.lanes:
        sch.vectorize(loops[-1])
    else:
        vt = largest_divisor(ext, params.lanes)
        if vt >= 4:
            _, wi = sch.split(loops[-1], [None, vt])
            sch.vectorize(wi)


# --------------------------------------------------------------------------------- GPU

GPU_TILES = tuple((th, tw) for th in TILE_SPACE for tw in TILE_SPACE)
GPU_CHANNEL_THREADS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class GpuLimits:
    threads: int = 1024  # per thread block
    shared: int = SHARED_STATIC  # static shared memory per block
    shared_dyn: int = SHARED_STATIC  # with ``shared.dyn``: CUDA (Volta on) opts in to 96 KB

    @staticmethod
    def of(target) -> GpuLimits:
        attrs = dict(target.attrs) if target is not None else {}
        threads = int(attrs.get("max_num_threads", 1024))
        shared = min(int(attrs.get("max_shared_memory_per_block", SHARED_STATIC)), SHARED_STATIC)
        cuda = target is not None and target.kind.name == "cuda"
        return GpuLimits(threads, shared, 96 << 10 if cuda else shared)


def schedule_conv_chain_gpu(sch: s_tir.Schedule, tile: tuple[int, int] = (8, 8),
                            channel_threads: int = 4, scope: str = "shared") -> list[str]:
    """CUDA/OpenCL, SISO chain of two (the notes' §6.2 recipe, Fig. 11 of the paper).

    One thread block per ``th × tw`` output tile with all output channels. Phase 1: the
    threads fill the *padded* intermediate tile (+ halo, every channel of it) in shared
    memory, each element computed by its thread from the first op (accumulated in a
    register; its epilogue applied before padding, its own padding a guarded global read).
    Phase 2: the same ``(tw, th, tk)`` thread grid (``threadIdx.x/y/z``, equal extents in
    both phases: pitfall 5) computes the second op, each thread a contiguous range of output
    channels (pitfall 4), accumulating in registers, the epilogue stored from them. TVM's
    ThreadSync puts the one barrier between the phases."""
    stages = chain_stages(sch)
    if stages is None or len(stages.reductions) != 2:
        raise ValueError("the GPU template takes a SISO chain of two region-based operators")
    staged = _inline_elementwise(sch, stages)
    first, second = stages.reductions
    for block in sch.get_producers(sch.get_sblock(first)):  # the first op's own padding
        if sch.get(block).name_hint in staged:
            sch.compute_inline(block)
    padded = [sch.get(b).name_hint for b in sch.get_producers(sch.get_sblock(second))
              if sch.get(b).name_hint in staged]
    if len(padded) != 1:
        raise ValueError("the second op does not read one staged intermediate")
    th, tw = tile
    tk = channel_threads
    c2 = sch.get_sblock(second)
    n, k, h, w, *reds = sch.get_loops(c2)
    ho, hi = sch.split(h, [None, th])
    wo, wi = sch.split(w, [None, tw])
    ki, ko = sch.split(k, [tk, None])  # a thread owns a contiguous channel range
    sch.reorder(n, ho, wo, hi, wi, ki, ko, *reds)
    bx = sch.fuse(n, ho, wo)
    acc = sch.cache_write(c2, 0, "local")
    sch.reverse_compute_at(acc, ko, preserve_unit_loops=True)
    if stages.output != second:
        sch.reverse_compute_inline(sch.get_sblock(stages.output))
    stage = sch.get_sblock(padded[0])
    sch.compute_at(stage, bx, preserve_unit_loops=True)
    sch.set_scope(stage, 0, scope)
    flat = sch.fuse(*sch.get_loops(stage)[-3:])  # channels × halo rows × halo columns
    _, ty, tx, tz = sch.split(flat, [None, th, tw, tk])
    c1 = sch.get_sblock(first)
    sch.compute_at(c1, tz, preserve_unit_loops=True)
    sch.set_scope(c1, 0, "local")
    sch.bind(bx, "blockIdx.x")
    for phase1, phase2, tag in ((ty, hi, "threadIdx.y"), (tx, wi, "threadIdx.x"),
                                (tz, ki, "threadIdx.z")):
        sch.bind(phase1, tag)
        sch.bind(phase2, tag)
    for block, loop in ((c2, reds[0]), (c1, sch.get_loops(c1)[-len(reds)])):
        try:  # an init outside the reduction loops (pitfall 11); a pool's may not move
            sch.decompose_reduction(block, loop)
        except s_tir.ScheduleError:
            pass
    return [f"gpu conv chain: tile {th}x{tw}, {tk} channel threads ({th * tw * tk} threads), "
            f"{padded[0]} (+ halo) in {scope}, {first} and {second} accumulated in registers"]


def gpu_kernel_ok(func: tirx.PrimFunc, limits: GpuLimits, dynamic: bool = False) -> bool:
    """``verify_gpu_code`` on the function lowered to thread launches and allocations."""
    low = _lower_blocks(func)
    shared = limits.shared_dyn if dynamic else limits.shared
    return bool(s_tir.analysis.verify_gpu_code(low, {"max_shared_memory_per_block": shared,
                                                     "max_threads_per_block": limits.threads}))


def staged_tile_bytes(channels: int, tile: tuple[int, int], kernel: int, stride: int) -> int:
    """Bytes of the padded intermediate tile (+ halo) of a SISO chain (Eq. 4)."""
    rows, cols = ((t - 1) * stride + kernel for t in tile)
    return 4 * channels * rows * cols


def gpu_configs(out_h: int, out_w: int, out_c: int, mid_c: int, kernel: int, stride: int,
                limits: GpuLimits):
    """Tile and channel-thread choices, best first: tiles that divide the output (pitfall 2),
    whose staged tile fits static shared memory, then dynamic; more threads (up to 256), then
    less halo per useful element."""
    ranked = []
    for th, tw in GPU_TILES:
        if th > out_h or tw > out_w:
            continue
        for tk in GPU_CHANNEL_THREADS:
            threads = th * tw * tk
            if threads > limits.threads or out_c % tk or threads < 32:
                continue
            nbytes = staged_tile_bytes(mid_c, (th, tw), kernel, stride)
            if nbytes > limits.shared_dyn:
                continue
            halo = nbytes / (4 * mid_c * th * tw)
            key = (out_h % th or out_w % tw, nbytes > limits.shared, -min(threads, 256), halo)
            ranked.append((key, (th, tw), tk, "shared.dyn" if nbytes > limits.shared
                           else "shared"))
    return [cfg[1:] for cfg in sorted(ranked)]


def try_schedule_conv_chain_gpu(gvar, func: tirx.PrimFunc, target,
                                attempts: int = 6) -> tirx.PrimFunc | None:
    """The GPU hook of ``apply_gpu_schedules``: a fused SISO chain of two gets the
    overlapped-tile template with the best configuration that ``verify_gpu_code`` accepts;
    anything else (or nothing accepted) returns None and DLight takes it."""
    base = func.with_attr("global_symbol", "main")
    try:
        sch = s_tir.Schedule(base)
        stages = chain_stages(sch)
    except Exception:  # noqa: BLE001
        return None
    if stages is None or len(stages.reductions) != 2:
        return None
    second = stages.facts[stages.reductions[1]]
    _, out_c, out_h, out_w = (second.extents[v.name] for v in second.spatial)
    chain, chans = _chain_geometry(sch, stages)
    kernel, stride = chain[-1]
    limits = GpuLimits.of(target)
    for tile, tk, scope in gpu_configs(out_h, out_w, out_c, chans[1], kernel, stride,
                                       limits)[:attempts]:
        try:
            sch = s_tir.Schedule(base)
            notes = schedule_conv_chain_gpu(sch, tile, tk, scope)
            result = sch.mod["main"]
            if not gpu_kernel_ok(result, limits, dynamic=scope == "shared.dyn"):
                continue
        except Exception:  # noqa: BLE001 (a configuration the schedule cannot take)
            continue
        return restore_symbol(result, func).with_attrs(
            {SCHEDULE_ATTR: notes, CHAIN_ATTR: True, "tir.is_scheduled": True})
    return None


def _lower_blocks(func: tirx.PrimFunc, opaque: bool = True) -> tirx.PrimFunc:
    """Blocks lowered far enough that buffers have their compacted (tile) shapes and, with
    ``opaque``, thread bindings are launches (what ``verify_gpu_code`` reads)."""
    passes = [s_tir.transform.LowerInitBlock(),
              s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
              s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.CompactBufferAllocation()]
    if opaque:
        passes.append(s_tir.transform.LowerOpaqueBlock())
    return tvm.transform.Sequential(passes)(tvm.IRModule({"main": func}))["main"]


def shared_bytes(func: tirx.PrimFunc) -> int:
    """Bytes of shared memory (any shared scope) a scheduled function allocates, compacted."""
    total = 0
    for block in find_all(_lower_blocks(func, opaque=False).body, s_tir.SBlock):
        for buf in block.alloc_buffers:
            if "shared" in buf.scope():
                size = 1
                for e in buf.shape:
                    size *= int(e)
                total += size * buf.dtype.bits // 8
    return total


__all__ = ["ChainDeclined", "chain_stages", "is_conv_chain", "choose_band", "choose_tile",
           "halo_extent", "schedule_conv_chain_cpu", "schedule_conv_chain_gpu",
           "try_schedule_conv_chain_gpu", "gpu_configs", "gpu_kernel_ok", "shared_bytes",
           "CHAIN_ATTR"]


def try_schedule_conv_chain(gvar, func: tirx.PrimFunc, params: CpuParams, fast: bool = True,
                            declined: list | None = None):
    """The dispatch hook of ``ScheduleFusedBlocks``: a fused chain of 2–3 region-based
    operators gets the overlapped-tile template; anything else returns None (the usual rules).
    A chain the template fails on returns None too, with a warning, and the usual rules (and
    their fallback) take it; one it declines (:class:`ChainDeclined`) returns None with the
    reason appended to ``declined``, no warning."""
    base = protect_negations(func).with_attr("global_symbol", "main")
    try:
        sch = s_tir.Schedule(base)
        if chain_stages(sch) is None:
            return None
    except Exception:  # noqa: BLE001
        return None
    tile = None
    if func.attrs is not None and "tvm_fusion.conv_chain_tile" in func.attrs:
        tile = tuple(int(t) for t in func.attrs["tvm_fusion.conv_chain_tile"])
    try:
        notes = schedule_conv_chain_cpu(sch, params, tile)
    except ChainDeclined as why:
        if declined is not None:
            declined.append(f"conv-chain template not used ({why})")
        return None
    except Exception as err:  # noqa: BLE001
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        warnings.warn(f"tvm_fusion: conv-chain template failed on {gvar.name_hint} "
                      f"({type(err).__name__}: {first}); using the per-operator rules",
                      ScheduleFailedWarning, stacklevel=2)
        return None
    result = sch.mod["main"]
    if fast:
        result = fast_math(result)
    kept = {}
    for name in alloc_names(result):
        kept[name] = "conv chain: tile (+ halo) of an intermediate, computed per tile"
    reasons = kept_reasons(result, kept, notes)
    attrs = {KEPT_ATTR: reasons, SCHEDULE_ATTR: notes, DONE_ATTR: True, CHAIN_ATTR: True}
    return restore_symbol(result, func).with_attrs(attrs)


def alloc_names(func: tirx.PrimFunc) -> list[str]:
    return [b.name for b in func.body.block.alloc_buffers]

"""A correct GPU schedule for kernels that read and write textures: one texel per thread.

Stock DLight rules do not know textures: a rule that stores one scalar per thread into a
texture leaves the lane index to ``TextureFlatten``, which drops it. Here every block that
writes a texture gets a ``local`` accumulator of one texel (``cache_write``), computed by the
thread (reductions included, serially) and stored by a write-back whose RGBA lane loop is
vectorised, so the store is one 4-lane ``write_image``. Producers that cannot be inlined (a
softmax's max and sum, a layer norm's statistics) are computed per thread under the same loop:
recomputed per texel rather than communicated, which is correct everywhere and fast nowhere.
This is the correctness baseline for texture code; tuned schedules (the paper's genetic
tuner) would replace it.

Buffer outputs get the same structure without the lane vectorisation (one element per thread).
"""

from __future__ import annotations

from tvm import s_tir, tirx

from ..tir_utils import buffer_stores, find_all, iter_sblocks
from .index_maps import inline_spatial_blocks
from .texture_lower import is_texture_scope

THREADS = 64
LANES = 4
_REDUCE = 2


def schedule_texture_kernel(func: tirx.PrimFunc, threads: int = THREADS) -> tirx.PrimFunc:
    """Schedule every block of ``func`` for a GPU, texture outputs one texel per thread."""
    symbol = func.attrs.get("global_symbol") if func.attrs else None
    sch = s_tir.Schedule(func.with_attr("global_symbol", "main"))
    inline_spatial_blocks(sch)
    outputs = {p.name for p in _output_params(sch.mod["main"])}
    done: set[str] = set()
    for block in reversed(list(iter_sblocks(sch.mod["main"]))):
        name = block.name_hint
        if name in done:
            continue
        writes = {w.source.name for w in block.writes}
        if writes & outputs:
            _schedule_sink(sch, name, threads, done)
    for block in reversed(list(iter_sblocks(sch.mod["main"]))):  # left over: own kernels
        if block.name_hint not in done:
            _schedule_sink(sch, block.name_hint, threads, done)
    result = sch.mod["main"]
    result = result.with_attr("global_symbol", symbol) if symbol else result.without_attr(
        "global_symbol")
    return result.with_attr("tvm_fusion.texture_schedule", True)


def _output_params(func: tirx.PrimFunc) -> list:
    written = set()
    for block in iter_sblocks(func):
        written |= {w.source.name for w in block.writes}
    return [p for p in func.params if p.name in written]


def _schedule_sink(sch: s_tir.Schedule, name: str, threads: int, done: set[str]) -> None:
    """One output element per thread, or one texel (4 lanes of the packed dimension) per
    thread for a texture output, stored by a write-back whose lane loop is vectorised."""
    block = sch.get_sblock(name)
    sblock = sch.get(block)
    texture = is_texture_scope(sblock.writes[0].source.scope())
    spatial = _leading_spatial(sch, block, sch.get_loops(block))
    write_back = lane = None
    if texture:
        packed = _packed_iter(sblock)
        write_back = sch.cache_write(block, 0, "local")
        spatial = _leading_spatial(sch, block, sch.get_loops(block))
        outer, lane = sch.split(spatial[packed], [None, LANES])
        spatial = [loop for i, loop in enumerate(spatial) if i != packed] + [outer]
        sch.reorder(*spatial, lane)
    done.add(name)
    if not spatial:
        return
    fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    extent = sch.get(fused).extent
    if isinstance(extent, tirx.IntImm):  # a thread count that divides: no bounds predicate
        inner = min(threads, int(extent))
        while int(extent) % inner:
            inner -= 1
    else:  # a symbolic extent (buffers only: textures are static): the last block is guarded
        inner = threads
    bx, tx = sch.split(fused, [None, inner])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    if write_back is not None:
        sch.reverse_compute_at(write_back, tx)
        sch.vectorize(sch.get_loops(write_back)[-1])
        done.add(sch.get(write_back).name_hint)
    _attach_producers(sch, block, tx, done)


def _packed_iter(sblock) -> int:
    """Position, among the block's iterators, of the one whose value picks the RGBA lane (the
    last index of the texture write)."""
    lane_index = sblock.writes[0].region[-1].min if hasattr(sblock.writes[0], "region") else None
    store = next(iter(_stores(sblock)), None)
    expr = store.indices[-1] if store is not None else lane_index
    names = {v.name for v in find_all(expr, tirx.Var)}
    for i, iv in enumerate(sblock.iter_vars):
        if iv.var.name in names:
            return i
    raise ValueError(f"block {sblock.name_hint!r}: no iterator picks the texture lane")


def _stores(sblock) -> list:
    return buffer_stores(sblock.body)


def _attach_producers(sch, block, anchor, done: set[str]) -> None:
    """Compute every not-yet-scheduled producer under the consumer's thread loop."""
    for producer in sch.get_producers(block):
        pname = sch.get(producer).name_hint
        if pname in done:
            continue
        try:
            sch.compute_at(producer, anchor)
        except Exception:  # noqa: BLE001 (shared with another sink: its own kernel later)
            continue
        # Computed per thread: its values live in registers, never in a global array that
        # OpenCL cannot declare inside a kernel.
        sch.set_scope(producer, 0, "local")
        done.add(pname)
        _attach_producers(sch, producer, anchor, done)


def _leading_spatial(sch, block, loops) -> list:
    """The outer loops that bind spatial iterators (reductions stay inside the thread). The
    blocks scheduled here are untouched legalized/FuseTIR blocks or ``cache_write`` copies,
    whose loops map one-to-one, in order, onto the block's iterators."""
    kinds = [int(iv.iter_type) for iv in sch.get(block).iter_vars]
    if len(kinds) != len(loops):
        raise ValueError(f"block {sch.get(block).name_hint!r}: loops were already transformed")
    found = []
    for loop, kind in zip(loops, kinds):
        if kind == _REDUCE:
            break
        found.append(loop)
    return found


def _extent(sch, loop) -> int:
    return int(sch.get(loop).extent)

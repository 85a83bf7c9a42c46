"""The packed-weight GEMM of a fused PrimFunc, with its epilogue, as the template nest of
:mod:`.gemm_template` (``shared/specs/cpu-gemm.md``).

A *packed GEMM* block is what ``layout/gemm_pack.py`` legalises a constant-weight matmul to::

    C[s..., j] += X(s..., k) · Bp[j // NR, k, j % NR]       # Bp a parameter [⌈N/NR⌉, K, NR]

or a conv over a symbolic batch to, with B computed per image (its im2col panels)::

    C[b, s..., j] += X(s..., k) · Bp[b, j // NR, k, j % NR]   # one GEMM per image b

whose nest is the per-image GEMM's inside a loop over the images.

Two steps, around the rules of :mod:`.cpu` that schedule the other stages of the function:

1. :func:`prepare_packed_gemms`, on the live schedule after inlining: the anchor gets a
   ``local`` write-back (``cache_write``) and its epilogue chain (bias, activation, residual,
   SwiGLU's ``silu(gate) · up``, a transpose or reshape) is folded into that write-back
   (:func:`.cpu_tile.fold_epilogue_chain`), exactly as for the register-tile schedule. Both
   blocks are then left alone by the other rules.
2. :func:`emit_packed_gemms`, on the scheduled function: each write-back's loop nest is
   replaced by the template nest, whose A load is the anchor's (with its batch dimensions
   folded into the rows) and whose final store is the write-back's (the epilogue, at its
   index); the anchor's nest goes. The write-back's place is the later one: everything the
   GEMM and its epilogue read is ready there.

A packed GEMM the template cannot take (an output that is not float32, a write-back whose
shape is not the anchor's) stays a block of the function for the other rules, and the reason
is noted (``tvm_fusion.schedule``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import s_tir, sym, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir import SBlock

from ..tir_utils import (
    buffer_loads,
    buffer_stores,
    const_int,
    find_all,
    iter_sblocks,
    substitute,
    with_root_body,
)
from .analysis import param_names, root_block, stride_in_last_dim, uses_var, written_only_before
from .cpu_target import CpuParams
from .cpu_tile import PACKED_GEMM_STAGE, fold_epilogue_chain
from .deinterleave import deinterleave_phase_paddings
from .gemm_template import (
    GRID,
    STREAM_ROW_TILES,
    Blocking,
    Gemm,
    emit_gemm,
    split_gather,
    thread_plan,
)

# Integer weight types the packed GEMM widens in registers (layout/weight_quant.py packs them)
WEIGHT_DTYPES = ("int8", "uint8")

_I0 = tirx.const(0, "int64")
_ITER_SPATIAL = 0
_ITER_REDUCE = 2


@dataclass
class PackedGemm:
    """A packed GEMM block, as matched: its iterators and the load of A (``x``)."""

    rows: list  # spatial iter vars other than j (batch dims, then M), outer first
    j: tvm.ir.Var
    k: tvm.ir.Var
    extents: dict  # iter var name -> extent (PrimExpr)
    x: tvm.ir.Expr  # the A operand: any expression of rows and k
    bp: tvm.ir.Var  # the packed weight buffer (float32, or integers widened as read)
    acc: tvm.ir.Var  # the buffer the block accumulates into
    nr: int
    # an integer weight's zero points and block scales (float32): per column [⌈N/NR⌉, NR],
    # or per block of ``block`` k and column [⌈N/NR⌉, ⌈K/block⌉, NR]
    zp: tvm.ir.Var | None = None
    scale: tvm.ir.Var | None = None
    block: int = 0
    # row iterators that also index B (``Bp[b, ...]``: a conv's panels per image), outer
    # first: each value is its own GEMM, the nest runs once per value
    images: list = field(default_factory=list)

    def load_b(self, panel, k, col) -> tvm.ir.Expr:
        """B at k, column ``col`` of ``panel``: an integer weight widened to float32 in
        registers, less its zero point, times its block's scale (a weight-only quantized
        GEMM; a per-column scale is the epilogue's)."""
        value = tirx.BufferLoad(self.bp, [*self.images, panel, k, col])
        if str(self.bp.ty.dtype) == "float32":
            return value
        kb = tirx.floordiv(k, tirx.const(self.block or 1, "int64"))
        value = tirx.Cast("float32", value)
        if self.zp is not None:
            at = [panel, col] if len(self.zp.shape) == 2 else [panel, kb, col]
            value = value - tirx.BufferLoad(self.zp, at)
        if self.scale is not None:
            value = value * tirx.BufferLoad(self.scale, [panel, kb, col])
        return value


@dataclass
class GemmSite:
    """A packed GEMM prepared on the schedule: its block, write-back and folded epilogue."""

    gemm: str
    writeback: str
    epilogue: list[str]
    output: str  # the buffer the write-back stores (the epilogue's output)


def match_packed_gemm(block: SBlock) -> PackedGemm | None:
    """The packed-GEMM pattern of ``block``, or None."""
    if not isinstance(block.body, tirx.BufferStore) or block.init is None:
        return None
    spatial = [iv for iv in block.iter_vars if int(iv.iter_type) == _ITER_SPATIAL]
    reduce = [iv for iv in block.iter_vars if int(iv.iter_type) == _ITER_REDUCE]
    if len(reduce) != 1 or not spatial or len(spatial) + 1 != len(block.iter_vars):
        return None
    store = block.body
    names = [iv.var.name for iv in spatial]
    if [getattr(ix, "name", None) for ix in store.indices] != names:
        return None
    value = store.value
    if not isinstance(value, tirx.Add) or not _is_load_of(value.a, store.buffer, store.indices):
        return None
    product = value.b
    if not isinstance(product, tirx.Mul):
        return None
    j, k = spatial[-1].var, reduce[0].var
    rows = [iv.var for iv in spatial[:-1]]
    for x, b in ((product.a, product.b), (product.b, product.a)):
        bp, zp, scale, kb_size = _widened(b, j, k)
        nr = _packed_read(bp, j, k)
        if nr is not None and not _reads(x, bp.source) and not _reads(x, store.buffer):
            images = _images(bp, rows)
            if images is None or (images and (zp is not None or scale is not None)):
                return None
            extents = {iv.var.name: iv.dom.extent for iv in block.iter_vars}
            n, kk = const_int(extents[j.name]), const_int(extents[k.name])
            shape = [const_int(d) for d in bp.source.shape[len(images):]]
            if n is None or kk is None or shape != [-(-n // nr), kk, nr]:
                return None
            if kb_size and const_int(scale.shape[1]) != -(-kk // kb_size):
                return None
            return PackedGemm(rows, j, k, extents, x, bp.source, store.buffer, nr, zp, scale,
                              kb_size, images)
    return None


def _images(load, rows: list) -> list | None:
    """The row iterators ahead of B's panel index (``Bp[b, j // NR, k, j % NR]``: one B per
    image), [] for none, or None when those indices are not distinct row iterators."""
    lead = list(load.indices[:-3])
    found = [next((v for v in rows if _is_var(ix, v)), None) for ix in lead]
    if None in found or len({v.name for v in found}) != len(found):
        return None
    return found


def _widened(expr, j, k) -> tuple:
    """(the packed load, zero-point buffer, block-scale buffer, block) of B's value: the load
    itself (a float32 B), or the weight-only quantized form of ``packed_matmul``
    (``layout/gemm_pack.py``): an integer load cast to float32, less ``Zp[j // NR, j % NR]``
    (or ``Zp[j // NR, k // KB, j % NR]``), times ``S[j // NR, k // KB, j % NR]`` for a
    block-wise weight."""
    none = (None, None, None, 0)
    scale, block = None, 0
    if isinstance(expr, tirx.Mul) and isinstance(expr.b, TensorLoad):
        block = _block_of(expr.b.indices, j, k)
        if not block:
            return none
        scale, expr = expr.b.source, expr.a
    zp = None
    if isinstance(expr, tirx.Sub) and isinstance(expr.b, TensorLoad):
        indices = expr.b.indices
        if not (len(indices) == 2 and _is_column(indices, j)) and \
                not (scale is not None and _block_of(indices, j, k) == block):
            return none
        zp, expr = expr.b.source, expr.a
    if isinstance(expr, tirx.Cast) and str(expr.ty) == "float32" \
            and isinstance(expr.value, TensorLoad) \
            and str(expr.value.source.ty.dtype) in WEIGHT_DTYPES:
        return expr.value, zp, scale, block
    if zp is None and scale is None and isinstance(expr, TensorLoad) \
            and str(expr.source.ty.dtype) == "float32":
        return expr, None, None, 0
    return none


def _is_column(indices, j) -> bool:
    """``[j // NR, j % NR]``: one value per column of the packed panels."""
    panel, lane = indices
    return (isinstance(panel, tirx.FloorDiv) and isinstance(lane, tirx.FloorMod)
            and _is_var(panel.a, j) and _is_var(lane.a, j))


def _block_of(indices, j, k) -> int:
    """KB when ``indices`` are ``[j // NR, k // KB, j % NR]`` (a value per block of KB k and
    per column), else 0."""
    if len(indices) != 3 or not _is_column([indices[0], indices[2]], j):
        return 0
    kb = indices[1]
    if not (isinstance(kb, tirx.FloorDiv) and _is_var(kb.a, k)):
        return 0
    return const_int(kb.b) or 0


def _is_load_of(expr, buffer, indices) -> bool:
    return (isinstance(expr, TensorLoad) and expr.source.same_as(buffer)
            and len(expr.indices) == len(indices)
            and all(str(a) == str(b) for a, b in zip(expr.indices, indices)))


def _packed_read(expr, j, k) -> int | None:
    """NR when ``expr`` is ``Bp[..., j // NR, k, j % NR]`` (leading indices: :func:`_images`)."""
    if not isinstance(expr, TensorLoad) or len(expr.indices) < 3:
        return None
    panel, kk, lane = expr.indices[-3:]
    if not (isinstance(panel, tirx.FloorDiv) and isinstance(lane, tirx.FloorMod)):
        return None
    nr = const_int(panel.b)
    if nr is None or const_int(lane.b) != nr or const_int(expr.source.shape[-1]) != nr:
        return None
    if not (_is_var(panel.a, j) and _is_var(lane.a, j) and _is_var(kk, k)):
        return None
    return nr


def _is_var(expr, var) -> bool:
    return isinstance(expr, tvm.ir.Var) and (expr.same_as(var) or expr.name == var.name)


def _reads(expr, buffer) -> bool:
    return any(ld.source.same_as(buffer) for ld in buffer_loads(expr))


# ------------------------------------------------------------------- step 1: on the schedule

def prepare_packed_gemms(sch: s_tir.Schedule, params: CpuParams
                         ) -> tuple[list[GemmSite], list[str]]:
    """Give every packed GEMM of the function its write-back with the epilogue folded in.
    Returns the sites (whose blocks the other rules must skip) and notes."""
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(root_block(sch))
             if match_packed_gemm(sch.get(b)) is not None]
    sites, notes = [], []
    for name in names:
        block_rv = sch.get_sblock(name)
        problem = _unsupported(sch.get(block_rv), params)
        if problem:
            notes.append(f"{name}: packed GEMM kernel not used ({problem}); register tiles")
            continue
        # The nest replaces the write-back, where cache_write puts it: before the first
        # consumer, maybe after other stages (a second GEMM). All the GEMM's inputs are
        # ready there, and so is everything the folded epilogue reads.
        wb = sch.cache_write(block_rv, 0, "local")
        ready = _finished_before(sch, wb, {s.output for s in sites})
        taken = {n for s in sites for n in (s.gemm, s.writeback)} | set(names)
        fused, _ = fold_epilogue_chain(sch, wb, ready, trial=True, stop=taken)
        site = GemmSite(name, sch.get(wb).name_hint, fused,
                        sch.get(wb).writes[0].source.name)
        problem = _unsupported_writeback(sch.get(wb), sch.get(block_rv))
        if problem:  # cache_write stays: the register-tile rule takes an accumulator block
            notes.append(f"{name}: packed GEMM kernel not used ({problem}); register tiles")
            continue
        # the write-back is found again by this mark, not by its name: cache_write names it
        # after the buffer it writes, and two GEMMs of one block may write buffers of one
        # name (FuseTIR keeps each operator's ``matmul_packed``): both are
        # ``matmul_packed_local``, and a lookup by name put one GEMM's nest in both places
        sch.annotate(wb, PACKED_GEMM_STAGE, name)
        sites.append(site)
    return sites, notes


def _unsupported(block: SBlock, params: CpuParams) -> str | None:
    if str(block.body.buffer.ty.dtype) != "float32":
        return f"accumulates {block.body.buffer.ty.dtype}"
    nr = match_packed_gemm(block).nr
    if nr % params.lanes:
        return f"panels of {nr} columns are not whole {params.lanes}-lane vectors"
    return None


def _unsupported_writeback(wb: SBlock, gemm: SBlock) -> str | None:
    store = wb.body
    if not isinstance(store, tirx.BufferStore):
        return "write-back is not one store"
    acc = gemm.body.buffer
    names = [iv.var.name for iv in wb.iter_vars]
    if len(names) != len(gemm.body.indices):
        return "the write-back is not shaped like the accumulator"
    for load in buffer_loads(store.value):
        if load.source.same_as(acc) and [getattr(i, "name", None) for i in load.indices] != names:
            return "the epilogue reads the accumulator at another index"
    if any(ld.source.same_as(store.buffer) for ld in buffer_loads(store.value)):
        return "the epilogue reads its own output"
    return None


def _finished_before(sch: s_tir.Schedule, block_rv, earlier_gemms: set[str]) -> set[str]:
    """Function outputs and earlier packed GEMMs' results written only before ``block_rv``
    (the write-back): to its epilogue they are inputs (SwiGLU's product reads the gate GEMM's
    result, an attention mask an output written by an earlier stage). Their reads may be
    hidden from the dependence checks: both kinds stay where they are (the rules move neither
    a GEMM nor an output's stage), and the write-back becomes plain loops whose loads every
    later pass sees. An intermediate a rule may still move (into a later row's stage) is not
    among them."""
    return written_only_before(sch, block_rv) & (param_names(sch) | earlier_gemms)


# ------------------------------------------------------------ step 2: on the scheduled TIR

def emit_packed_gemms(func: tirx.PrimFunc, sites: list[GemmSite], params: CpuParams
                      ) -> tuple[tirx.PrimFunc, list[str]]:
    """``func`` with each site's write-back nest replaced by the template nest and its anchor
    nest removed. Returns the function and one note per site."""
    if not sites:
        return func, []
    blocks = {b.name_hint: b for b in iter_sblocks(func)}
    writebacks = {str(b.annotations[PACKED_GEMM_STAGE]): b for b in iter_sblocks(func)
                  if PACKED_GEMM_STAGE in b.annotations}
    replace, drop, notes = {}, set(), []
    root = func.body.block
    stmts = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    for site in sites:
        gemm, wb = blocks[site.gemm], writebacks[site.gemm]
        packer = _packing_stage(match_packed_gemm(gemm), stmts)
        nest, note = _nest(gemm, wb, params, packer)
        replace[site.gemm] = nest  # keyed by the GEMM: write-backs may share a name
        drop.add(site.gemm)
        if packer is not None:
            drop.add(packer.name_hint)
        epilogue = ("; epilogue " + "+".join(site.epilogue) + " at the last K block"
                    if site.epilogue else "")
        notes.append(f"{site.gemm}: packed GEMM {note}{epilogue}")
    out = []
    for stmt in stmts:
        inside = find_all(stmt, SBlock)
        names = {b.name_hint for b in inside}
        hit = [str(b.annotations[PACKED_GEMM_STAGE]) for b in inside
               if PACKED_GEMM_STAGE in b.annotations]
        if len(hit) > 1:
            raise ValueError(f"write-backs of {hit} in one nest")
        if hit:
            out.append(replace[hit[0]])
        elif not names & drop:
            stmt, copied = deinterleave_phase_paddings(stmt)
            notes.extend(copied)
            out.append(stmt)
    body = out[0] if len(out) == 1 else tirx.SeqStmt(out)
    used = {ld.source.__chandle__() for ld in buffer_loads(body)}
    used |= {st.buffer.__chandle__() for st in buffer_stores(body)}
    allocs = [b for b in root.alloc_buffers if b.__chandle__() in used]
    return with_root_body(func, body, allocs), notes


def _packing_stage(match: PackedGemm | None, stmts: list) -> SBlock | None:
    """The block that computes the packed B (a conv's im2col panels), when B is computed in
    the function, alone in a top-level nest, and read by nothing else: the GEMM nest then
    packs each block of panels itself (``Gemm.pack_b``) and this nest goes."""
    if match is None:
        return None
    found = None
    for stmt in stmts:
        for block in find_all(stmt, SBlock):
            writes = [w.source for w in block.writes]
            if any(w.same_as(match.bp) for w in writes):
                inside = find_all(stmt, SBlock)
                if found is not None or len(inside) != 1:
                    return None
                found = block
            elif any(r.source.same_as(match.bp) for r in block.reads) \
                    and not _packed_reader(block, match):
                return None  # another reader: the panels must stay a buffer
    if found is None or not isinstance(found.body, tirx.BufferStore) or found.init is not None:
        return None
    names = [getattr(ix, "name", None) for ix in found.body.indices]
    if names != [iv.var.name for iv in found.iter_vars] or len(names) != 3 + len(match.images):
        return None
    return found


def _packed_reader(block: SBlock, match: PackedGemm) -> bool:
    """``block`` is the packed GEMM itself (its init/update halves once decomposed)."""
    return isinstance(block.body, tirx.BufferStore) and block.body.buffer.same_as(match.acc)


def _nest(gemm: SBlock, wb: SBlock, params: CpuParams, packer: SBlock | None = None
          ) -> tuple[tirx.Stmt, str]:
    match = match_packed_gemm(gemm)
    if match is None:
        raise ValueError(f"{gemm.name_hint}: no longer a packed GEMM after scheduling")
    n = const_int(match.extents[match.j.name])
    k = const_int(match.extents[match.k.name])
    # one B per image: the nest below is one image's, with the images' iterators (of the
    # anchor, the write-back and the packing stage, at the same positions) bound to a loop
    image_at = [i for i, v in enumerate(match.rows) if any(v.same_as(b) for b in match.images)]
    loops = [tirx.Var(f"image{i}", "int64") for i in range(len(image_at))]
    wb_ivs = [iv.var for iv in wb.iter_vars[:-1]]
    per_image = [*zip(match.images, loops), *((wb_ivs[i], v) for i, v in zip(image_at, loops))]
    if packer is not None:
        per_image += list(zip([iv.var for iv in packer.iter_vars[:len(loops)]], loops))
    row_vars = [v for i, v in enumerate(match.rows) if i not in image_at]
    row_extents = [match.extents[v.name] for v in row_vars]
    rows = _product(row_extents)

    def unravel(m) -> list:
        """Row index ``m`` as the anchor's row iterators (batch dims folded into M)."""
        out, rest = [], m
        for pos in reversed(range(len(row_extents))):
            extent = row_extents[pos]
            if const_int(extent) == 1:
                out.insert(0, tirx.const(0, "int64"))
            elif pos == 0:
                out.insert(0, rest)
            else:
                out.insert(0, tirx.floormod(rest, extent))
                rest = tirx.floordiv(rest, extent)
        return out

    def bind(pairs) -> dict:
        return dict(pairs)

    def load_x(m, kk):
        return substitute(match.x, bind([*zip(row_vars, unravel(m)), (match.k, kk),
                                          *per_image]))

    load_a, prologue = load_x, []
    if not _contiguous_in_k(match.x, match.k) and not _row_slivers(match.x, match.k):
        # A read through div/mod of k (a transpose or reshape inlined into it) or computed:
        # copied once, row-major, so the micro-kernel's broadcasts walk along k
        copy = tirx.decl_buffer((rows, k), "float32", "a_rows")
        # one row (a GEMV's A: the classifier after a global pool) is one iteration: a
        # parallel launch for it wakes every thread for one thread's work
        known_rows = const_int(rows)
        kind = tirx.ForKind.PARALLEL if params.cores > 1 and (
            known_rows is None or known_rows >= params.cores) else tirx.ForKind.SERIAL
        m_var, k_var = tirx.Var("m", "int64"), tirx.Var("kk", "int64")
        value, tables = load_x(m_var, k_var), []
        gather = split_gather(value, m_var, k_var)
        if gather is not None:
            # a conv's window over its padded input: the offsets that depend on k from a
            # table filled once, the row's hoisted out of the k loop (no division per value)
            flat, row_part, k_part, data = gather
            offsets = tirx.decl_buffer((k,), "int64", "a_k_offsets")
            tables = [tirx.DeclBuffer(flat, data=data), tirx.AllocBuffer(offsets), tirx.For(
                k_var, _I0, tirx.const(k, "int64"), tirx.ForKind.SERIAL,
                tirx.BufferStore(offsets, k_part(k_var), [k_var]))]
            load = tirx.BufferLoad(flat, [row_part(m_var) + tirx.BufferLoad(offsets, [k_var])])
            dtype = str(value.ty.dtype)  # a cast of the gathered load stays one
            value = load if str(load.ty.dtype) == dtype else tirx.Cast(dtype, load)
        fill = tirx.For(m_var, _I0, rows, kind, tirx.For(
            k_var, _I0, tirx.const(k, "int64"), tirx.ForKind.SERIAL,
            tirx.BufferStore(copy, value, [m_var, k_var])))
        prologue = [tirx.AllocBuffer(copy), *tables, fill]

        def load_a(m, kk):
            return tirx.BufferLoad(copy, [m, kk])
        slivers = None if gather is None else _sliver_copy(
            gather, offsets, known_rows, k, _tile_rows(match, params), params.cores)
        if slivers is not None:
            # rows consecutive in the input (an NCHW 1x1 conv's positions): copied as the
            # micro-kernel reads them, MR rows side by side per k, by contiguous runs
            copy, fill, mr_a = slivers
            prologue = [tirx.AllocBuffer(copy), *tables, fill]

            def load_a(m, kk):
                return tirx.BufferLoad(copy, [tirx.floordiv(m, mr_a), kk,
                                              tirx.floormod(m, mr_a)])

    store = wb.body
    wb_rows = [v for i, v in enumerate(wb_ivs) if i not in image_at]
    wb_j = wb.iter_vars[-1].var

    def at(m, jj) -> dict:
        return bind([*zip(wb_rows, unravel(m)), (wb_j, jj), *per_image])

    def final(m, jj, acc):
        mapping = at(m, jj)
        value = _replace_loads(store.value, match.acc, acc)
        return tirx.BufferStore(store.buffer, substitute(value, mapping),
                                [substitute(i, mapping) for i in store.indices])

    partial = None
    if str(store.buffer.ty.dtype) != "float32":
        # the epilogue narrows (a QuantizeLinear's int8): the running sums of earlier K
        # blocks need float32 of their own, the output cannot hold them
        partial = tirx.decl_buffer((rows, n), "float32", "c_partial")

    def partial_at(m, jj):
        if partial is not None:
            return partial, [m, jj]
        mapping = at(m, jj)
        return store.buffer, [substitute(i, mapping) for i in store.indices]

    b_bytes = tvm.DataType(str(match.bp.ty.dtype)).bits // 8
    mr, _ = params.gemm_tile(match.nr, widened=b_bytes != 4,
                             block_scales=match.scale is not None)
    # float32 B's cache blocks also for an 8-bit B: beyond the streaming rows, each K×NC
    # block of it is converted once into a float32 block (gemm_template's staged B)
    kc, nc = params.gemm_blocks(mr, match.nr)
    blocking = Blocking(mr, match.nr, params.lanes, kc, max(nc, match.nr), params.loads_per_fma)
    pack_b = None
    if packer is not None:
        store_p = packer.body
        ivs = [iv.var for iv in packer.iter_vars]

        def pack_b(panel, kk, lane):
            return substitute(store_p.value, bind([*zip(ivs[len(loops):], (panel, kk, lane)),
                                                    *per_image]))

    def load_b(panel, kk, col):
        return substitute(match.load_b(panel, kk, col), bind(per_image))
    spec = Gemm(const_int(rows) if const_int(rows) is not None else rows, n, k, load_a,
                load_b, partial_at, final, widened=b_bytes != 4, pack_b=pack_b)
    nest = emit_gemm(spec, blocking, params.cores)
    copied = bool(prologue)
    sums_apart = partial is not None and any(st.buffer.same_as(partial)
                                             for st in buffer_stores(nest))
    if sums_apart:
        prologue = [tirx.AllocBuffer(partial), *prologue]
    nest = tirx.SeqStmt([*prologue, nest]) if prologue else nest
    for i, var in reversed(list(zip(image_at, loops))):  # the images, outermost first
        nest = tirx.For(var, _I0, match.extents[match.rows[i].name], tirx.ForKind.SERIAL, nest)
    widened = "" if b_bytes == 4 else (
        f"; {match.bp.ty.dtype} weights widened in registers (converted once per B block "
        f"beyond {STREAM_ROW_TILES * mr} rows)")
    if match.scale is not None:
        widened += f", scaled per block of {match.block} k"
    plan = thread_plan(n, blocking, params.cores, spec.rows, pack_b is not None)
    threads = plan.mode + (f" ({plan.ranges} ranges of {plan.chunk} rows)"
                           if plan.mode == GRID else "")
    note = (f"{blocking.describe()}{widened}; {threads}"
            + ("; one GEMM per image, in a loop over the batch" if loops else "")
            + ("; A copied row-major first" if copied else "")
            + (f"; B packed per block from {packer.name_hint!r}" if packer is not None else ""))
    if sums_apart:
        note += "; float32 running sums between K blocks"
    return nest, note


def _tile_rows(match: PackedGemm, params: CpuParams) -> int:
    b_bytes = tvm.DataType(str(match.bp.ty.dtype)).bits // 8
    return params.gemm_tile(match.nr, widened=b_bytes != 4,
                            block_scales=match.scale is not None)[0]


# rows of A past which the copy's runs are not worked out one by one at compile time
_SLIVER_ROWS_MAX = 8192


def _sliver_copy(gather, k_offsets: tirx.Buffer, rows: int | None, k: int, mr: int,
                 cores: int):
    """A's row-major copy as slivers ``a_slivers[m // MR, k, m % MR]`` (the micro-kernel's MR
    broadcasts of a k step side by side), where the gathered read ``flat[row(m) + koff[k]]``
    has consecutive rows at consecutive floats: an NCHW 1x1 conv's positions (positions as
    rows), whose copy into ``a_rows[m, k]`` was a transpose, a gather per value (hardware
    gathers on AVX-512). Each sliver whose MR rows are one run of the input (all of them in
    one image: every one for batch 1) copies, per k, MR consecutive floats to MR consecutive
    floats; a sliver across two images keeps the gather, and the last sliver copies only the
    rows there are (its other lanes are never read). (buffer, fill loop, MR), or None."""
    flat, row_part, _, _ = gather
    if rows is None or rows > _SLIVER_ROWS_MAX or rows < 2 or mr < 2:
        return None
    analyzer = sym.Analyzer()
    offsets = [const_int(analyzer.simplify(row_part(tirx.const(m, "int64"))))
               for m in range(rows)]
    if None in offsets:
        return None
    count = -(-rows // mr)
    runs = [all(offsets[m] == offsets[s * mr] + m - s * mr
                for m in range(s * mr, min(rows, s * mr + mr))) for s in range(count)]
    if 2 * sum(runs) < count or sum(not r for r in runs) > 8:
        return None  # rows mostly not consecutive (a padded window), or many images
    copy = tirx.decl_buffer((count, k, mr), "float32", "a_slivers")
    s_var = tirx.Var("s", "int64")

    def koff_of(kk):
        return tirx.BufferLoad(k_offsets, [kk])

    def copy_loop(lanes, source):
        # fresh loop variables per loop: a variable is bound to one range
        k_var, l_var = tirx.Var("kk", "int64"), tirx.Var("lane", "int64")
        value = source(l_var, k_var)
        if str(value.ty.dtype) != "float32":  # a 16-bit input read as float32
            value = tirx.Cast("float32", value)
        body = tirx.BufferStore(copy, value, [s_var, k_var, l_var])
        return tirx.For(k_var, _I0, tirx.const(k, "int64"), tirx.ForKind.SERIAL, tirx.For(
            l_var, _I0, tirx.const(lanes, "int64"), tirx.ForKind.SERIAL, body))

    full = rows // mr
    bounded = sym.Analyzer()
    bounded.bind(s_var, tvm.ir.Range(_I0, tirx.const(max(full, 1), "int64")))
    def run_from(first_row):
        def run(lane, kk):  # one run of the input: the sliver's first row plus the lane
            return tirx.BufferLoad(flat, [first_row + lane + koff_of(kk)])
        return run

    # a full sliver's first row, simplified with s in its range: no div/mod left
    run = run_from(bounded.simplify(row_part(s_var * mr)))

    def gathered(lane, kk):
        return tirx.BufferLoad(flat, [row_part(s_var * mr + lane) + koff_of(kk)])

    crossing = [s for s in range(full) if not runs[s]]
    body = copy_loop(mr, run)
    for s in crossing:
        body = tirx.IfThenElse(tirx.NE(s_var, tirx.const(s, "int64")), body,
                               copy_loop(mr, gathered))
    stmts = []
    if full:
        kind = tirx.ForKind.PARALLEL if cores > 1 and full >= cores else tirx.ForKind.SERIAL
        stmts.append(tirx.For(s_var, _I0, tirx.const(full, "int64"), kind, body))
    if rows % mr:  # the last sliver: its rows only
        tail_run = run_from(tirx.const(offsets[full * mr], "int64"))
        stmts.append(substitute(copy_loop(rows % mr, tail_run if runs[full] else gathered),
                                {s_var: tirx.const(full, "int64")}))
    fill = stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)
    return copy, fill, mr


def _row_slivers(x, k) -> bool:
    """``x`` is a load of a weight packed in slivers of rows, ``Ap[m // MR, k, m % MR]``
    (``layout/gemm_pack.py``): the micro-kernel's broadcasts walk it as one stream."""
    if not isinstance(x, TensorLoad) or len(x.indices) != 3:
        return False
    first, middle, last = x.indices
    if not (isinstance(first, tirx.FloorDiv) and isinstance(last, tirx.FloorMod)):
        return False
    mr = const_int(first.b)
    return (mr is not None and mr == const_int(last.b) and first.a.same_as(last.a)
            and isinstance(middle, tvm.ir.Var) and middle.same_as(k)
            and not uses_var(first, k))


def _contiguous_in_k(x, k) -> bool:
    """``x`` is one load whose last index is ``k`` plus terms without it and whose other
    indices do not use ``k``: consecutive k are consecutive floats."""
    if not isinstance(x, TensorLoad) or not x.indices:
        return False
    return stride_in_last_dim(list(x.indices), k) == 1


def _product(extents: list):
    total = tirx.const(1, "int64")
    for extent in extents:
        total = total * extent
    return sym.Analyzer().simplify(total)


def _replace_loads(expr, buffer, value):
    def visit(load):
        return value if load.source.same_as(buffer) else load
    return tvm_ffi.structural_map(expr, [(TensorLoad, visit)])


def has_packed_gemm(func: tirx.PrimFunc) -> bool:
    return any(match_packed_gemm(b) is not None for b in iter_sblocks(func))


__all__ = ["WEIGHT_DTYPES", "GemmSite", "PackedGemm", "emit_packed_gemms", "has_packed_gemm",
           "match_packed_gemm", "prepare_packed_gemms"]

"""The CPU GEMM loop nest, emitted as TIR from a template (`shared/specs/cpu-gemm.md`).

``C[m, j] = Σ_k A[m, k] · B[k, j]`` with B packed at compile time into panels
``Bp[⌈N/NR⌉, K, NR]`` (:mod:`tvm_fusion.layout.gemm_pack`), in MLAS's loop order::

    for jc in N step NC:              # B block KC×NC stays in L2      (parallel: threads)
      for kc in K step KC:
        for ir in M step MR:          # A sliver MR×KC stays in L1, A is not packed
          for jr in NC step NR:       # B micro-panel KC×NR, contiguous
            micro-kernel: acc[MR, NR] (+)= A[ir:ir+MR, kc] ⊗ Bp[jr, kc, :]

The accumulator is MR stack arrays of NR floats, one per row, whose every index is a constant
once the rows are unrolled and the columns vectorised, so LLVM keeps them in MR·NR/lanes
registers (SROA; a heap workspace, what TVM makes of a ``local`` buffer, stayed in memory
where LLVM could not rule out aliasing).
On the first K block it starts at zero (MLAS's ZeroMode), on later ones from the partial sums
stored by the previous block; the last K block stores through the epilogue (bias, activation,
residual, a permuted index), so a fused epilogue costs one expression per element stored.
Each tile first prefetches its lines of C (for writing): the partial sums it reloads after the
k loop were stored a pass over M earlier, in L3 once M is large.

Remainders are separate nests, never a predicate inside the micro-kernel: the M tail runs
row tiles of 2^i rows (one per bit of ``M mod MR``; a runtime test for a symbolic M), the N
tail computes the zero-padded last panel and stores its ``N mod NR`` columns, and a K tail
is a shorter trip count of the (not unrolled) k loop.

M = 1 (a GEMV, bandwidth-bound) streams the packed B once, panel after panel, over all of K.

A B packed by the nest (a conv's im2col, ``Gemm.pack_b``) whose read of its source splits into
a panel's offset + a k's + the lane (:func:`split_gather`) is packed through a table of the k
offsets, filled once per call: no division of k by the conv window per value packed.

An 8-bit B (a weight-only quantized weight, ``Gemm.widened``) is widened to float32 as the
micro-kernel reads it while few row tiles stream B; with more rows each KC×NC block of B is
first converted once into a float32 block, and the float32 micro-kernel reads that for every
row tile (the conversion, like MLAS's copy of a B block, is then paid once per block, not
once per row tile).

The template is plain TIR (loops, no sblocks): schedule primitives could not keep a register
accumulator across an outer K-block loop (the note, §4).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import sym, tirx
from tvm.ir.expr import TensorLoad

from ..tir_utils import const_int, substitute
from .analysis import uses_any

_F32 = "float32"
# Bytes per cache line the C tile's prefetches step by (x86-64 and the AArch64 cores of
# cpu_target's table: 64; a longer line only makes some of them redundant).
CACHE_LINE = 64
# Up to this many row tiles a GEMM is bound by streaming B from memory (2·M FLOP per 4 bytes
# of B: below ~16 rows a 100 GFLOP/s core waits on a 20 GB/s stream).
STREAM_ROW_TILES = 4
# Up to this many row tiles (a conv with few output channels) the micro-kernels read a
# nest-packed B (a conv's im2col) from its source in place instead of packing it per block:
# Zen 4, one thread, MobileNetV2's stem 3×3/2 3→32 at 224 0.30 → 0.24 ms, its 1×1 144→24 at
# 56 0.254 → 0.204, YOLOv8n's 3×3/2 16→32 at 160 0.75 → 0.62 (docs/benchmarks.md).
IN_PLACE_ROW_TILES = 2

# A load of A at (row, k).
LoadA = Callable[[tvm.ir.Expr, tvm.ir.Expr], tvm.ir.Expr]
# B's float32 value at (panel, k, column of the panel): a load of the packed panel, or an
# integer weight's load widened in registers.
LoadB = Callable[[tvm.ir.Expr, tvm.ir.Expr, tvm.ir.Expr], tvm.ir.Expr]
# Where the running sum of C[row, col] is kept between K blocks: (buffer, indices).
PartialAt = Callable[[tvm.ir.Expr, tvm.ir.Expr], tuple]
# The final store of C[row, col] = value, with the epilogue applied.
StoreC = Callable[[tvm.ir.Expr, tvm.ir.Expr, tvm.ir.Expr], tirx.Stmt]
# The value of the packed B at (panel, k, lane), for a B packed by the nest itself.
PackB = Callable[[tvm.ir.Expr, tvm.ir.Expr, tvm.ir.Expr], tvm.ir.Expr]


@dataclass(frozen=True)
class Blocking:
    """Register tile MR×NR (NR a multiple of ``lanes``) and cache blocks KC, NC (NC a multiple
    of NR) of one GEMM."""

    mr: int
    nr: int
    lanes: int
    kc: int
    nc: int
    # values the core loads per FMA beside it (CpuParams.loads_per_fma; 0: loads cost as
    # FMAs): what a row tail's tile costs against a full tile, for the thread plan
    loads_per_fma: float = 0.0

    def describe(self) -> str:
        return f"{self.mr}×{self.nr} tile, KC {self.kc}, NC {self.nc}"


@dataclass
class Gemm:
    """What the nest computes: ``rows`` (M with any batch dimensions folded in; may be
    symbolic) × ``n`` × ``k``, A read through ``load_a``, the packed B through ``load_b``,
    and where C goes."""

    rows: tvm.ir.Expr
    n: int
    k: int
    load_a: LoadA
    load_b: LoadB  # reads the packed B, [⌈n/NR⌉, k, NR]
    partial_at: PartialAt
    store: StoreC
    # B is converted as it is read (an 8-bit weight widened to float32): beyond the streaming
    # row tiles, each K×NC block of B is converted once into a float32 block that every row
    # tile then reads, instead of being widened again for each
    widened: bool = False
    # B computed, not a constant (a conv's im2col matrix): each KC × NC block of panels is
    # packed by the nest just before its micro-kernels read it (MLAS's order), into a
    # buffer that stays in L2, instead of the whole matrix going through memory first
    pack_b: PackB | None = None


def _as_f32(value) -> tvm.ir.Expr:
    """``value`` in float32: a gathered 16-bit activation is widened as it is packed."""
    return value if str(value.ty.dtype) == _F32 else tirx.Cast(_F32, value)


def _i64(value) -> tvm.ir.Expr:
    return tirx.const(value, "int64") if isinstance(value, int) else value


def _loop(name: str, extent, body_of: Callable[[tirx.Var], tirx.Stmt],
          kind: tirx.ForKind = tirx.ForKind.SERIAL) -> tirx.Stmt:
    var = tirx.Var(name, "int64")
    return tirx.For(var, _i64(0), _i64(extent), kind, body_of(var))


def _seq(stmts: list) -> tirx.Stmt:
    stmts = [s for s in stmts if s is not None]
    return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)


class _Emitter:
    """Builds the nest; the blocking may depend on the number of rows at run time (a
    symbolic M), as selects that fold away when M is known."""

    def __init__(self, gemm: Gemm, blk: Blocking, rows, cores: int = 1):
        self.g, self.b, self.cores = gemm, blk, cores
        self.vectors = blk.nr // blk.lanes
        # equal K blocks (the last one shorter by < k_blocks): 768 = 3 × 256, 1000 = 4 × 250
        blocks = max(1, -(-gemm.k // blk.kc))
        size = -(-gemm.k // blocks)
        # K blocks keep a B block in L2 for the next row tile; with one row tile there is no
        # next one: all of K in one pass (a GEMV, a decode step) saves reloading C
        one_tile = _le(rows, blk.mr)
        self.k_blocks = 1 if blocks == 1 else _pick(one_tile, 1, blocks)
        self.kc = gemm.k if blocks == 1 else _pick(one_tile, gemm.k, size)
        self.kc_block = gemm.k if blocks == 1 else size  # KC beyond one row tile
        # a few row tiles are bound by streaming B from memory: one panel per N block reads
        # it front to back; more rows reuse an NC-wide B block from L2 for the whole of M
        self.streaming = _le(rows, STREAM_ROW_TILES * blk.mr)
        split = _split_gather(gemm.pack_b, _ceildiv(gemm.n, blk.nr), gemm.k, blk.nr) \
            if gemm.pack_b is not None else None
        self.gather, self.g_src_data = (split[:3], split[3]) if split else (None, None)
        # the column's part of the gather uses the lane too (a conv's flat output positions,
        # rows not padded to whole panels): one offset per column, from a table
        self.per_column = split is not None and split[4]
        self.k_offsets = self.col_offsets = None
        if self.gather is not None:
            self.k_offsets = tirx.decl_buffer((gemm.k,), "int64", "k_offsets")
        if self.per_column:
            self.col_offsets = tirx.decl_buffer((_ceildiv(gemm.n, blk.nr) * blk.nr,), "int64",
                                                "col_offsets")

    def offset_table(self) -> list:
        """The offsets of B's gather that depend on k only (``_split_gather``), computed
        once per call: ``pack_b`` then costs one table load per k and panel, not the
        divisions of k by the conv window."""
        if self.k_offsets is None:
            return []
        flat, col_part, k_part = self.gather
        fill = _loop("k", self.g.k, lambda k: tirx.BufferStore(self.k_offsets, k_part(k), [k]))
        out = [tirx.DeclBuffer(flat, data=self.g_src_data), tirx.AllocBuffer(self.k_offsets),
               fill]
        if self.per_column:
            nr = self.b.nr
            out += [tirx.AllocBuffer(self.col_offsets), _loop(
                "j", self.col_offsets.shape[0], lambda j: tirx.BufferStore(
                    self.col_offsets, col_part(tirx.floordiv(j, _i64(nr)),
                                               tirx.floormod(j, _i64(nr))), [j]))]
        return out

    # ---------------------------------------------------------------- the micro-kernel
    def _each(self, rows: int, body_of, cols: int | None = None) -> tirx.Stmt:
        """for each row r (a Python int: the rows are unrolled here, each row its own
        accumulator array) × columns: vectorised in whole registers, or ``cols`` serial."""
        lanes = self.b.lanes

        def row(r: int) -> tirx.Stmt:
            if cols is None:
                return _loop("jo", self.vectors, lambda jo: _loop(
                    "jv", lanes, lambda jv: body_of(r, jo * lanes + jv),
                    tirx.ForKind.VECTORIZED), tirx.ForKind.UNROLLED)
            return _loop("c", cols, lambda c: body_of(r, c))
        return _seq([row(r) for r in range(rows)])

    def tile(self, rows: int, row0, panel, cols: int, k0, klen, first, last,
             load_b: LoadB | None = None) -> tirx.Stmt:
        """One MR'×NR tile of C: rows ``row0``.., panel ``panel`` (``cols`` of its NR columns
        are real), over ``klen`` values of k from ``k0``. ``first``/``last``: whether this is
        the first/last K block (Python bools or runtime conditions). ``load_b``: where B is
        read (the packed B by default)."""
        g, nr = self.g, self.b.nr
        load_b = load_b or g.load_b
        # one array per row, each a stack array (see _on_stack) that SROA splits into
        # registers
        accs = [tirx.decl_buffer((nr,), _F32, f"acc{r}") for r in range(rows)]
        col0 = panel * nr

        def zero(r, c):
            return tirx.BufferStore(accs[r], tirx.const(0.0, _F32), [c])

        def update(kk):
            k = k0 + kk

            def fma(r, c):
                cur = tirx.BufferLoad(accs[r], [c])
                return tirx.BufferStore(
                    accs[r], cur + g.load_a(row0 + r, k) * load_b(panel, k, c), [c])
            return self._each(rows, fma)

        def total(r, c, add_partial: bool):
            value = tirx.BufferLoad(accs[r], [c])
            if add_partial:
                buf, idx = g.partial_at(row0 + r, col0 + c)
                value = tirx.BufferLoad(buf, idx) + value
            return value

        def save(add_partial):
            def store(r, c):
                buf, idx = g.partial_at(row0 + r, col0 + c)
                return tirx.BufferStore(buf, total(r, c, add_partial), idx)
            return self._each(rows, store, vec_cols)

        def finish(add_partial):
            return self._each(rows, lambda r, c: g.store(
                row0 + r, col0 + c, total(r, c, add_partial)), vec_cols)

        # The accumulator always starts at zero and the partial sums of earlier K blocks are
        # added when it is stored (MLAS's ZeroMode decides only that addition): the k loop is
        # then the same whatever the block, so LLVM has no reason to version it (a reload
        # before the loop, under the block test, spilled accumulators on AVX2).
        vec_cols = None if cols == nr else cols
        body = self._k_loop(klen, update)
        out = _choose(last, _choose(first, finish(False), finish(True)),
                      _choose(first, save(False), save(True)))
        # one K block reads no partial sums back (and a narrowing write-back then allocates
        # no float32 partial sums to prefetch)
        one_block = first is True and last is True
        prefetch = [] if one_block else self._prefetch_c(rows, row0, col0, cols)
        return _seq([*map(_on_stack, accs), *prefetch, self._each(rows, zero), body, out])

    def _prefetch_c(self, rows: int, row0, col0, cols: int) -> list:
        """Prefetches (for writing) of every cache line of the tile's C, issued before its k
        loop: the partial sums read after it were stored a whole pass over M earlier (at
        M = 2,048 the 2 MB C block of an N block is in L3 by then), and their loads, issued
        only once the loop has ended, stalled the core for the L3's latency at every tile;
        the last block's stores miss the same way. Measured on Zen 3 at 2,048 × 2,048 ×
        5,632, a loaded machine: 8–14 % less time for the decoder layer's GEMMs."""
        step = CACHE_LINE // 4
        offsets = sorted({*range(0, cols, step), cols - 1})
        out = []
        for r in range(rows):
            for c in offsets:
                buf, idx = self.g.partial_at(row0 + r, col0 + c)
                out.append(_prefetch(buf, idx))
        return out

    def _k_loop(self, klen, update) -> tirx.Stmt:
        """``update(kk)`` for kk < klen, two k steps per iteration (then the odd last one):
        LLVM then leaves the loop as it is. Left to itself it unrolled a 150-step loop 3
        times and hoisted the B loads of all three steps, which spilled 9 of the 12
        accumulators of the 4×24 tile (AVX2)."""
        pairs = _simplify(tirx.floordiv(klen, _i64(2)))
        odd = _simplify(tirx.floormod(klen, _i64(2)))
        body = _loop("kk", pairs, lambda kk: _seq([update(kk * 2), update(kk * 2 + 1)]))
        known = const_int(odd)
        if known == 0:
            return body
        last = update(klen - 1)
        return _seq([body, last if known == 1 else tirx.IfThenElse(odd == _i64(1), last, None)])

    # ---------------------------------------------------------------- the nests
    def row_tails(self, kv, panel, cols: int, base, count, load_b=None) -> list:
        """Tiles for the last ``count mod MR`` rows of ``base``..``base + count``: one tile of
        2^i rows per bit of that tail (1 + 2 for 3 rows), each under a runtime test when
        ``count`` is symbolic."""
        mr = self.b.mr
        tail = _simplify(tirx.floormod(count, _i64(mr)))
        known = const_int(tail)
        start = base + count - tail
        out = []
        size = 1 << (mr - 1).bit_length()
        while size > 1:
            size //= 2
            if size >= mr or (known is not None and not (known // size) % 2):
                continue
            before = tail - tirx.floormod(tail, _i64(2 * size))  # the rows of larger bits
            stmt = self.tile(size, _simplify(start + before), panel, cols, *kv, load_b)
            if known is None:
                has = tirx.floormod(tirx.floordiv(tail, _i64(size)), _i64(2)) == _i64(1)
                stmt = tirx.IfThenElse(has, stmt, None)
            out.append(stmt)
        return out

    def k_block(self, kc) -> tuple:
        """(k0, klen, first, last) of K block ``kc`` (a loop var; None for one block)."""
        if isinstance(self.k_blocks, int) and self.k_blocks == 1:
            return (_i64(0), _i64(self.g.k), True, True)
        k0 = kc * self.kc
        whole = isinstance(self.kc, int) and self.g.k % self.kc == 0
        klen = _i64(self.kc) if whole else tirx.min(_i64(self.kc), _i64(self.g.k) - k0)
        return (k0, klen, kc == _i64(0), kc == _i64(self.k_blocks) - _i64(1))

    def panel_block(self, panels_from, panels_count, cols: int, base, count,
                    most_panels: int = 1) -> tirx.Stmt:
        """MLAS order over a block of full panels (or the one tail panel, ``cols`` < NR) for
        rows ``base``..``base + count``: kc → ir → jr, then the M tail's tiles per panel."""
        mr, nr = self.b.mr, self.b.nr
        packed, b_at = None, None
        if self.g.pack_b is not None:
            most = const_int(panels_count) or most_panels
            depth = self.kc if isinstance(self.kc, int) else self.g.k
            # flat: TVM 0.27's region bound estimate divided by zero on the 3-D form
            packed = tirx.decl_buffer((most * depth * nr,), _F32, "b_block")

        def over_k(kc):
            nonlocal b_at
            kv = self.k_block(kc)
            k0, klen = kv[0], kv[1]
            pack = None
            if packed is not None:
                def at(jr, kk, c):
                    return (jr * _i64(depth) + kk) * _i64(nr) + c

                def b_at(panel, k, c):
                    return tirx.BufferLoad(packed, [at(panel - panels_from, k - k0, c)])
                def gathered(panel, k, lane):
                    if self.gather is None:
                        return self.g.pack_b(panel, k, lane)
                    flat, col_part, _ = self.gather
                    k_off = tirx.BufferLoad(self.k_offsets, [k])
                    if self.per_column:
                        return _as_f32(tirx.BufferLoad(flat, [tirx.BufferLoad(
                            self.col_offsets, [panel * _i64(nr) + lane]) + k_off]))
                    return _as_f32(tirx.BufferLoad(flat, [col_part(panel) + k_off + lane]))

                def pack_panel(kk, jr):
                    body = _loop("lane", nr, lambda lane: tirx.BufferStore(
                        packed, gathered(panels_from + jr, k0 + kk, lane),
                        [at(jr, kk, lane)]), tirx.ForKind.VECTORIZED)
                    if const_int(panels_count) is not None:
                        return body
                    return tirx.IfThenElse(jr < panels_count, body, None)
                # k outer, panels inner: each k copies the block's consecutive panels from one
                # stretch of the source (a conv's padded input row: one stream for the
                # prefetcher), where panel after panel read KC rows at once (a 3×3 conv's
                # 3 rows × 21 channels: 18 % of a U-Net conv's time went to that copy).
                # A constant panel trip count: with the last N block's min() as the extent,
                # TVM 0.27's CompactBufferAllocation divided by zero bounding the input's region
                pack = _loop("kk", klen, lambda kk: _loop(
                    "jr", const_int(panels_count) or most, lambda jr: pack_panel(kk, jr)))
            tiles = _simplify(tirx.floordiv(count, _i64(mr)))

            def nests(load_b):
                out = [] if const_int(tiles) == 0 else [  # fewer rows than MR: tails only
                    _loop("ir", tiles, lambda ir: _loop("jr", panels_count, lambda jr:
                          self.tile(mr, base + ir * mr, panels_from + jr, cols, *kv, load_b)))]
                if self.row_tails(kv, panels_from, cols, base, count):
                    out.append(_loop("jr", panels_count, lambda jr: _seq(
                        self.row_tails(kv, panels_from + jr, cols, base, count, load_b))))
                return _seq(out)

            if packed is not None and self._in_place():
                return nests(lambda panel, k, c: gathered(panel, k, c))
            if packed is not None:
                return _seq([tirx.AllocBuffer(packed), pack, nests(b_at)])
            if not self.g.widened or self.streaming is True:
                return nests(None)
            staged = self.staged(panels_from, panels_count, kv, nests)
            return _choose(self.streaming, nests(None), staged)

        if isinstance(self.k_blocks, int) and self.k_blocks == 1:
            return over_k(None)
        return _loop("kc", self.k_blocks, over_k)

    def _in_place(self) -> bool:
        """B read by the micro-kernel where its packing would read it (``src[panel's offset +
        k_offsets[k] + lane]``: NR consecutive floats per k), not packed first: with at most
        ``IN_PLACE_ROW_TILES`` row tiles each packed value is read by one or two micro-kernels,
        and its copy (a load and a store per value, beside 2·MR / lanes FMAs per vector read)
        costs more than reading the source again. Not through the per-column table (a gather
        per value, paid once packed)."""
        rows = self.g.rows if isinstance(self.g.rows, int) else const_int(self.g.rows)
        return (self.gather is not None and not self.per_column and rows is not None
                and rows <= IN_PLACE_ROW_TILES * self.b.mr)

    def staged(self, panels_from, panels_count, kv, nests) -> tirx.Stmt:
        """The block's B (``panels_count`` panels × the K block) converted once into a float32
        block, then ``nests`` reading it: every row tile reuses the conversion (MLAS's packed
        B block, converted where MLAS copies)."""
        k0, klen = kv[0], kv[1]
        nr, lanes = self.b.nr, self.b.lanes
        per = max(1, self.per_block)
        block = tirx.decl_buffer((per, self.kc_block, nr), _F32, "b_block")
        fill = _loop("jr", panels_count, lambda jr: _loop("kk", klen, lambda kk: _loop(
            "jo", self.vectors, lambda jo: _loop("jv", lanes, lambda jv: tirx.BufferStore(
                block, self.g.load_b(panels_from + jr, k0 + kk, jo * lanes + jv),
                [jr, kk, jo * lanes + jv]), tirx.ForKind.VECTORIZED))))

        def load_block(panel, k, c):
            return tirx.BufferLoad(block, [panel - panels_from, k - k0, c])
        return _seq([tirx.AllocBuffer(block), fill, nests(load_block)])

    def columns(self, base, count, per_block: int, parallel: bool) -> list:
        """Every panel of C for rows ``base``..``base + count``: blocks of ``per_block`` full
        panels (NC; one while streaming), in parallel when asked, then the zero-padded tail
        panel."""
        full_panels, tail_cols = divmod(self.g.n, self.b.nr)
        self.per_block = min(per_block, max(full_panels, 1))
        nests = []
        if full_panels:
            per = _pick(self.streaming, 1, per_block)
            blocks = _ceildiv(full_panels, per)
            serial = parallel is False or (isinstance(blocks, int) and blocks == 1)
            kind = tirx.ForKind.SERIAL if serial else tirx.ForKind.PARALLEL

            def jc_block(jc):
                even = isinstance(per, int) and full_panels % per == 0
                size = _i64(per) if even else \
                    tirx.min(_i64(per), _i64(full_panels) - jc * _i64(per))
                return self.panel_block(jc * _i64(per), size, self.b.nr, base, count,
                                        per if isinstance(per, int) else full_panels)
            split = _tail_rows_split(const_int(count), self.b.mr, self.cores) \
                if const_int(base) == 0 else None
            if not serial and tail_cols and split is not None and isinstance(blocks, int) \
                    and blocks % self.cores == 0:
                # each thread its share of the blocks, then its range of the tail panel's
                # rows: 6 | 6 panels and the tail on one thread (MobileNetV2's 14×14 convs
                # to 64 and 96 channels, 12 panels of 16 and 4 columns) become 6 + half
                chunk, last = split
                share = blocks // self.cores

                def thread(t):
                    def tail_rows(rows: int):
                        return self.panel_block(_i64(full_panels), _i64(1), tail_cols,
                                                t * _i64(chunk), _i64(rows))
                    tail = tail_rows(chunk) if last == chunk else tirx.IfThenElse(
                        t < _i64(self.cores - 1), tail_rows(chunk), tail_rows(last))
                    own = _loop("jb", share, lambda jb: jc_block(t * _i64(share) + jb))
                    return _seq([own, tail])
                nests.append(_loop("jc_thread", self.cores, thread, kind))
                return nests
            if not serial and tail_cols and _tail_in_parallel(
                    full_panels, per, blocks, tail_cols / self.b.nr, self.cores):
                # the tail panel as one more parallel iteration: 3 panels + a tail on 2
                # threads ran 2 + 1 panels, then the tail with one thread waiting
                tail = self.panel_block(_i64(full_panels), _i64(1), tail_cols, base, count)
                nests.append(_loop("jc", blocks + 1, lambda jc: tirx.IfThenElse(
                    jc < _i64(blocks), jc_block(jc), tail), kind))
                return nests
            nests.append(_loop("jc", blocks, jc_block, kind))
        if tail_cols:
            nests.append(self.panel_block(_i64(full_panels), _i64(1), tail_cols, base, count))
        return nests


    def grid(self, rows: int, plan: ThreadPlan) -> tirx.Stmt:
        """One parallel loop over (N block, row range) pairs, the range innermost
        (:func:`thread_plan`'s grid): blocks of ``plan.per_block`` full panels, then the
        tail panel as a block of its own; ranges of ``plan.chunk`` rows, the last the rest.
        Each range's row count is a constant in its own nest (a full range, the last), so
        its row tails are static."""
        nr, per, ranges, chunk = self.b.nr, plan.per_block, plan.ranges, plan.chunk
        full, tail_cols = divmod(self.g.n, nr)
        self.per_block = min(per, max(full, 1))
        blocks = _ceildiv(full, per)
        last = rows - (ranges - 1) * chunk

        def pair(it):
            b = tirx.floordiv(it, _i64(ranges))
            t = tirx.floormod(it, _i64(ranges))
            base = t * _i64(chunk)

            def block(count: int):
                size = _i64(per) if full % per == 0 else \
                    tirx.min(_i64(per), _i64(full) - b * _i64(per))
                nest = self.panel_block(b * _i64(per), size, nr, base, _i64(count), per)
                if not tail_cols:
                    return nest
                tail = self.panel_block(_i64(full), _i64(1), tail_cols, base, _i64(count))
                return tirx.IfThenElse(b < _i64(blocks), nest, tail)
            if last == chunk:
                return block(chunk)
            return tirx.IfThenElse(t < _i64(ranges - 1), block(chunk), block(last))
        pairs = (blocks + (1 if tail_cols else 0)) * ranges
        return _loop("jc_rows", pairs, pair, tirx.ForKind.PARALLEL)


def _on_stack(acc: tirx.Buffer) -> tirx.Stmt:
    """A row of the accumulator: a ``global`` buffer under 1 KiB, which TVM's
    LowerTVMBuiltin leaves a stack array (an alloca that SROA splits into registers, every
    index being a constant after unrolling). A ``local`` buffer, or one of 1 KiB or more
    (AVX-512's 12×32 tile in one array is 1.5 KiB), becomes a heap workspace, which LLVM kept
    in registers only where it could prove that no other store aliases it: a row tail tile
    of a conv reading its packed B block had all its accumulators in memory."""
    return tirx.AllocBuffer(acc)


def _prefetch(buf: tirx.Buffer, indices: list, write: bool = True) -> tirx.Stmt:
    """A prefetch of ``buf[indices]`` into every cache level (LLVM's ``llvm.prefetch``:
    ``prefetchw`` on x86 for a write, ``prfm pstl1keep`` on AArch64)."""
    address = tirx.call_intrin("handle", "tirx.address_of", tirx.BufferLoad(buf, indices))
    return tirx.Evaluate(tirx.call_intrin("void", "tirx.prefetch", address,
                                          tirx.const(int(write), "int32"),
                                          tirx.const(3, "int32"), tirx.const(1, "int32")))


def _choose(cond, then_stmt, else_stmt):
    if cond is True:
        return then_stmt
    if cond is False:
        return else_stmt
    return tirx.IfThenElse(cond, then_stmt, else_stmt)


def thread_shares(weights: list[float], threads: int) -> list[float]:
    """The work each of ``threads`` threads gets of a parallel loop whose iterations weigh
    ``weights``: TVM gives thread t the iterations [t·c, (t+1)·c), c = ceil(extent/threads)."""
    chunk = -(-len(weights) // max(threads, 1)) or 1
    return [sum(weights[t * chunk:(t + 1) * chunk]) for t in range(threads)]


def _tail_rows_split(rows: int | None, mr: int, cores: int) -> tuple[int, int] | None:
    """The tail panel's rows shared by ``cores`` threads, each after its N blocks: ranges of
    ``chunk`` rows (whole row tiles), the last ``last`` rows; None when M is not known or
    has fewer row tiles than threads."""
    if rows is None or cores <= 1 or rows // mr < cores:
        return None
    chunk = -(-(rows // mr) // cores) * mr
    last = rows - (cores - 1) * chunk
    return (chunk, last) if last > 0 else None


def _tail_in_parallel(full_panels: int, per, blocks, tail: float, cores: int) -> bool:
    """Whether the zero-padded tail panel (``tail`` of a panel's work) is better run as one
    more parallel iteration than after the parallel loop (where one thread runs it alone)."""
    if not isinstance(per, int) or not isinstance(blocks, int) or cores <= 1:
        return False
    weights = [float(min(per, full_panels - j * per)) for j in range(blocks)]
    after = max(thread_shares(weights, cores)) + tail
    return max(thread_shares(weights + [tail], cores)) < after


def _simplify(expr):
    return sym.Analyzer().simplify(expr)


@dataclass(frozen=True)
class ThreadPlan:
    """How the nest uses its threads: ``mode`` (below), ``per_block`` full panels per N
    block and, for ``GRID``, the row ranges: ``ranges`` of ``chunk`` rows (a multiple of MR),
    the last one taking the rest of M."""

    mode: str
    per_block: int
    ranges: int = 1
    chunk: int = 0


ONE = "one thread"
N_BLOCKS = "parallel N blocks"
ROW_RANGES = "parallel row ranges"
GRID = "parallel N blocks × row ranges"
# A grid of row ranges only where its largest thread share is below this share of the N
# blocks' alone: each range reads all of its blocks' B again (and packs it again for a
# conv's im2col), which the balance model does not count
_GRID_GAIN = 0.97
# Rows of work (one-row tiles' k steps) that packing a panel's K × NR values costs each
# (block, range) pair that packs it: a second range over MobileNetV2's 1×1 convs at 14×14
# (13 position panels, 64 and 96 output channels as rows), run on one thread, took 4-6 %
# longer (0.105 -> 0.111, 0.151 -> 0.157, 0.218 -> 0.230 ms): about 5 rows' work a panel,
# the copy and the B sliver read once more from L2
_PACK_ROWS = 5.0


def _tile_cost(rows: int, blk: Blocking) -> float:
    """One k step of a tile of ``rows`` rows: its FMAs, and its loads (``rows`` broadcasts,
    NR/lanes vectors of B) over the core's rate beside them or, without one, as FMAs
    (gemm_pack._work's model)."""
    vectors = blk.nr // blk.lanes
    if blk.loads_per_fma:
        return max(rows * vectors, (rows + vectors) / blk.loads_per_fma)
    return rows * vectors + rows + vectors


def _pack_cost(blk: Blocking, packs_b: bool) -> float:
    """What packing one panel of B costs a (block, range) pair that packs it, in tile work."""
    return _PACK_ROWS * _tile_cost(1, blk) if packs_b else 0.0


def rows_cost(count: int, blk: Blocking) -> float:
    """Work of ``count`` rows of one panel: full tiles of MR rows, then the tail's tiles of
    2^i rows (what :meth:`_Emitter.row_tails` emits), per k step."""
    mr = blk.mr
    tail = count % mr
    return (count // mr) * _tile_cost(mr, blk) + sum(
        _tile_cost(1 << b, blk) for b in range(tail.bit_length()) if tail >> b & 1)


def grid_shares(n: int, rows: int, blk: Blocking, threads: int, per: int, ranges: int,
                chunk: int, packs_b: bool = False) -> list[float]:
    """Each thread's work (k steps of tiles, :func:`rows_cost`) of the parallel loop over
    (N block, row range) pairs, row range innermost: blocks of ``per`` full panels, then
    the tail panel (computed at full width) as a block of its own, × ``ranges`` ranges of
    ``chunk`` rows, the last range the rest. ``packs_b``: each pair packs its block's B
    (a conv's im2col), :data:`_PACK_ROWS` rows of work per panel."""
    full, tail = divmod(n, blk.nr)
    widths = [min(per, full - b) for b in range(0, full, per)] + ([1] if tail else [])
    counts = [chunk] * (ranges - 1) + [rows - (ranges - 1) * chunk]
    pack = _pack_cost(blk, packs_b)
    weights = [w * (rows_cost(c, blk) + pack) for w in widths for c in counts]
    return thread_shares(weights, threads)


def _grid(n: int, blk: Blocking, cores: int, rows: int, per_block: int,
          packs_b: bool) -> ThreadPlan | None:
    """The (N blocks × row ranges) split of a static M that balances best on ``cores``
    threads, or None when the N blocks alone (one range) do as well within
    :data:`_GRID_GAIN`: 5 panels over 49 rows on 2 threads ran 3 | 2 panels (1.2 times the
    ideal); as 5 panels × 2 ranges of 24 | 25 rows each thread does 2.5 panels' rows."""
    full = n // blk.nr
    tiles = rows // blk.mr
    if full < 1 or tiles < 2:
        return None
    streaming = rows <= STREAM_ROW_TILES * blk.mr
    pers = [1] if streaming else range(1, min(per_block, full) + 1)
    best = None
    for per in pers:
        for ranges in range(1, min(tiles, 4 * cores) + 1):
            chunk = -(-tiles // ranges) * blk.mr
            if (ranges - 1) * chunk >= rows:  # an empty last range: fewer ranges do it
                continue
            shares = grid_shares(n, rows, blk, cores, per, ranges, chunk, packs_b)
            # least work on the busiest thread; then fewer ranges (B read once), larger
            # blocks (fewer parallel iterations)
            key = (max(shares), ranges, -per)
            if best is None or key < best[0]:
                best = (key, ThreadPlan(GRID, per, ranges, chunk))
    if best is None or best[1].ranges == 1:
        return None
    # the N blocks alone, as columns() runs them: blocks a multiple of the cores, the tail
    # panel one more parallel iteration where that evens the shares, else after the loop
    # with the other threads waiting
    shared = max(1, min(per_block, -(-full // cores)))
    blocks = _ceildiv(_ceildiv(full, shared), cores) * cores
    per = -(-full // blocks)
    blocks = -(-full // per)
    panel = rows_cost(rows, blk) + _pack_cost(blk, packs_b)
    weights = [min(per, full - b * per) * panel for b in range(blocks)]
    alone = max(thread_shares(weights, cores))
    split = _tail_rows_split(rows, blk.mr, cores)
    if n % blk.nr and split is not None and blocks % cores == 0:  # the tail's rows shared
        alone += max(rows_cost(split[0], blk), rows_cost(split[1], blk)) \
            + _pack_cost(blk, packs_b)
    elif n % blk.nr:
        alone = min(alone + panel, max(thread_shares(weights + [panel], cores)))
    return best[1] if best[0][0] < _GRID_GAIN * alone else None


def thread_plan(n: int, blk: Blocking, cores: int, rows=None,
                packs_b: bool = False) -> ThreadPlan:
    """How the nest uses ``cores`` threads. With a static M over at least two row tiles, the
    grid of N blocks × row ranges (:func:`_grid`) where it balances better than N blocks
    alone; else N blocks in parallel when there are at least as many as cores (each block
    then at most 1/cores of N, and their number a multiple of the cores), else row ranges in
    parallel (N of one or two panels) when ``rows`` (M, when known) fill more than one row
    tile and are not a product of symbolic sizes, else one thread. ``packs_b``: the nest
    packs B per block (a conv's im2col): a row range packs it again."""
    full_panels = n // blk.nr
    per_block = max(1, blk.nc // blk.nr)
    known = const_int(rows) if rows is not None else None
    if cores <= 1:
        return ThreadPlan(ONE, per_block)
    if known is not None:
        grid = _grid(n, blk, cores, known, per_block, packs_b)
        if grid is not None:
            return grid
    shared = max(1, min(per_block, -(-full_panels // cores)))
    blocks = -(-full_panels // shared)
    if blocks >= cores:
        # a whole number of blocks per thread: a parallel loop gives each thread a contiguous
        # share of its iterations, so 3 blocks on 2 threads ran at 3/4 of their speed (BERT's
        # merged Q/K/V GEMM, N = 2304 in blocks of 25 panels); 4 smaller blocks do not
        blocks = -(-blocks // cores) * cores
        return ThreadPlan(N_BLOCKS, -(-full_panels // blocks))
    if known is not None and known <= blk.mr:
        # one row tile (a GEMV, a conv over one position): a second range would be empty,
        # and its runtime-sized row tails would be emitted for nothing
        return ThreadPlan(ONE, per_block)
    if known is None and rows is not None and not isinstance(rows, tirx.Var):
        # M a product of symbolic sizes (batch·seq): each range's row index, divided by a
        # symbolic size to address A, made TVM 0.27's CSE and LowerIntrin bind one variable
        # twice (a build error); such a GEMM keeps its rows on one thread
        return ThreadPlan(ONE, per_block)
    return ThreadPlan(ROW_RANGES, shared)


def parallel_plan(n: int, blk: Blocking, cores: int, rows=None,
                  packs_b: bool = False) -> tuple[str, int]:
    """(mode, full panels per N block) of :func:`thread_plan`."""
    plan = thread_plan(n, blk, cores, rows, packs_b)
    return plan.mode, plan.per_block


def emit_gemm(gemm: Gemm, blk: Blocking, cores: int = 1) -> tirx.Stmt:
    """The whole loop nest computing ``gemm`` (see the module docstring), threads as
    :func:`parallel_plan` says."""
    rows = _simplify(_i64(gemm.rows))
    em = _Emitter(gemm, blk, rows, cores)
    return _seq([*em.offset_table(), _nest(em, gemm, blk, cores, rows)])


def _nest(em: _Emitter, gemm: Gemm, blk: Blocking, cores: int, rows) -> tirx.Stmt:
    plan = thread_plan(gemm.n, blk, cores, rows, gemm.pack_b is not None)
    mode, per_block = plan.mode, plan.per_block
    if mode == GRID:
        return em.grid(const_int(rows), plan)
    if mode != ROW_RANGES:
        return _seq(em.columns(_i64(0), rows, per_block, mode == N_BLOCKS))
    chunk = _simplify(tirx.floordiv(rows + _i64(cores * blk.mr - 1), _i64(cores * blk.mr))
                      * _i64(blk.mr))
    known, size = const_int(rows), const_int(chunk)
    # M known: only the ranges that hold rows (13 rows in chunks of 6 on 4 cores: 3)
    ranges = cores if known is None or not size else min(cores, -(-known // size))

    def rows_of(t):
        base = t * chunk
        count = tirx.max(_i64(0), tirx.min(chunk, rows - base))
        return _seq(em.columns(base, count, per_block, False))
    return _loop("rows", ranges, rows_of, tirx.ForKind.PARALLEL)


def _split_gather(pack_b: PackB, panels: int | None = None, k_size: int | None = None,
                  nr: int | None = None):
    """``pack_b``'s value as a gather ``src[col_part(panel) + k_part(k) + lane]`` from the
    flat ``src`` (:func:`split_gather`): a conv's im2col from its padded input, where the
    window's ``k // (kh·kw)``, ``k % kw``… are the k part. Returns (a flat view of src,
    col_part, k_part, src's data), or None. ``panels``, ``k_size``, ``nr``: the variables'
    extents, which fold what only their ranges make exact (a 1×1 conv's flat positions over
    whole panels: ``p % W + (p % HW) // W · W + p // HW · CHW`` is ``p`` for p < HW)."""
    panel, k, lane = (tirx.Var(n, "int64") for n in ("panel", "k", "lane"))
    value = pack_b(panel, k, lane)
    ranges = {}
    if panels is not None and k_size is not None and nr is not None:
        ranges = {panel: panels, k: k_size, lane: nr}
    split = split_gather(value, panel, k, lane, ranges)
    if split is not None:
        return (*split, False)
    joint = split_gather(value, (panel, lane), k, None, ranges)
    return None if joint is None else (*joint, True)


def split_gather(value, outer, k: tirx.Var, lane: tirx.Var | None = None,
                 ranges: dict | None = None):
    """``value``, an expression of ``outer`` (a panel, a row; or a tuple of variables, e.g.
    a panel and its lane, that the outer part takes together), ``k`` and ``lane``, as a load
    ``src[outer_part(outer) + k_part(k) (+ lane)]`` from a flat view of ``src``: when it is
    one load from a buffer of static shape whose flat index is a sum of terms each of which
    uses one of them (``lane`` a term of its own). Returns (the flat view, outer_part,
    k_part, src's data), or None. A cast of such a load (a 16-bit activation read as float32)
    is its load's gather: the flat view has the source's dtype, the caller casts its loads."""
    if isinstance(value, tirx.Cast):
        value = value.value
    if not isinstance(value, TensorLoad):
        return None
    src = value.source
    shape = [const_int(d) for d in src.shape]
    if None in shape or len(shape) != len(value.indices):
        return None
    flat_index, stride = _i64(0), 1
    for index, extent in zip(reversed(list(value.indices)), reversed(shape)):
        flat_index = flat_index + index * _i64(stride)
        stride *= extent
    names = {"outer": outer, "k": k, **({"lane": lane} if lane is not None else {})}
    # as written, else simplified: the simplifier folds a row-major split back,
    # (t // W)·W + t % W = t
    parts = (_parts(_terms(flat_index, 1), names)
             or _parts(_terms(_simplify(flat_index), 1), names))
    if parts is None and ranges:  # as simplified with the variables in their ranges
        bounded = sym.Analyzer()
        for var, extent in ranges.items():
            bounded.bind(var, tvm.ir.Range(_i64(0), _i64(extent)))
        parts = _parts(_terms(bounded.simplify(flat_index), 1), names)
    if parts is None:
        return None

    def part(name):
        def of(*values):
            total = tirx.const(0, "int64")
            variables = names[name] if isinstance(names[name], tuple) else (names[name],)
            for term, scale in parts[name]:
                for var, value_ in zip(variables, values):
                    term = substitute(term, {var: value_})
                total = total + (term if scale == 1 else term * tirx.const(scale, "int64"))
            return total
        return of
    flat = tirx.decl_buffer((stride,), src.ty.dtype, f"{src.name}_flat", data=src.data)
    return flat, part("outer"), part("k"), src.data


def _parts(terms: list, names: dict) -> dict | None:
    """The terms grouped by the one variable of ``names`` each uses (constants with k), or
    None when a term mixes them or a lane is not a term of its own."""
    parts = {name: [] for name in names}
    for term, scale in terms:
        used = [name for name, var in names.items() if uses_any(term, var)]
        if len(used) > 1:
            return None
        parts[used[0] if used else "k"].append((term, scale))
    if "lane" in names and [(t.same_as(names["lane"]), c) for t, c in parts["lane"]] != \
            [(True, 1)]:
        return None
    return parts


def _terms(expr, scale: int) -> list:
    """``expr · scale`` as a list of (term, integer scale) whose sum it is."""
    if isinstance(expr, tirx.Add):
        return _terms(expr.a, scale) + _terms(expr.b, scale)
    if isinstance(expr, tirx.Sub):
        return _terms(expr.a, scale) + _terms(expr.b, -scale)
    if isinstance(expr, tirx.Mul):
        for x, c in ((expr.a, expr.b), (expr.b, expr.a)):
            if const_int(c) is not None:
                return _terms(x, scale * const_int(c))
    if const_int(expr) is not None:
        return [(_i64(const_int(expr)), scale)]
    return [(expr, scale)]


def _le(rows, limit: int):
    """``rows <= limit``: a Python bool when ``rows`` is known, else a runtime condition."""
    known = const_int(rows)
    return known <= limit if known is not None else rows <= _i64(limit)


def _pick(cond, then_value: int, else_value: int):
    """``then_value if cond else else_value``, folded when ``cond`` is a Python bool."""
    if isinstance(cond, bool):
        return then_value if cond else else_value
    if then_value == else_value:
        return then_value
    return tirx.Select(cond, _i64(then_value), _i64(else_value))


def _ceildiv(n: int, d):
    if isinstance(d, int):
        return -(-n // d)
    return tirx.floordiv(_i64(n) + d - _i64(1), d)


__all__ = ["STREAM_ROW_TILES", "Blocking", "Gemm", "ThreadPlan", "emit_gemm", "grid_shares",
           "parallel_plan", "rows_cost", "split_gather", "thread_plan"]

"""Fused attention on CPU: online softmax over key tiles, never a score matrix in memory.

A planned attention block reaches the schedule as one PrimFunc (FuseTIR's output);
:func:`~.attention_match.match_attention` reads its pieces (Q, K, V, the score function, the
output store) from the TIR. This template then *generates* the loop nest, FlashAttention-style
(Dao et al.; the CPU form of its algorithm 1):

* one task per (batch…, block of ``bq`` query rows); tasks run in parallel;
* the query block is packed once (``Qp[bq, dk]``, float32); a running maximum ``m``, running
  sum ``l`` and an accumulator ``acc[bq, dv]`` per row start at the max reduction's initial
  value, 0 and 0;
* per tile of ``bk`` keys: K is packed transposed (``Kt[dk, bk]``, keys contiguous) and V packed
  (``Vp[bk, dv]``); ``S = Qp·Kt`` by a register micro-kernel (``mr`` rows × ``nr`` keys in
  registers, the query broadcast, the keys vectorised); the score function (scale, masks,
  biases) is applied to the tile, the row maximum updated (``m' = max(m, max S)``), the tile
  exponentiated against it, and the sum and accumulator rescaled by ``exp(m - m')``;
  ``acc += P·Vp`` by a second micro-kernel (``mr`` rows × ``nv`` value columns);
* at the end ``out = acc / l``, stored through the output's index map (the head merge).

The tiles are sized from the target: ``bk`` so that a packed K or V tile fills half of L1,
``bq`` so that the query block, its scores and accumulator and both packed tiles fill half of
L2 (:class:`AttentionTiles`). Every tile buffer is per task (``bq × bk`` scores at most): no
buffer grows with the square of the sequence length. Sequence lengths may be symbolic: the
last query block and key tile are partial (their padding is zero and never stored).

**Masked tiles are skipped**, exactly: where the score function provably takes a value ``g(s)``
that does not depend on the position on a whole tile (a causal ``Where`` or additive ``triu``
mask above the diagonal, found by simplifying the score under each index condition it tests),
the tile is skipped when ``exp(g(s) - m) == 0`` in float32 for every row's current maximum
``m`` (a runtime check; with ``g`` depending on ``s``, the bound ``|s| ≤ dk·max|q|·max|k|``
from finite inputs). Skipped elements then contribute exactly 0, as they do unfused, and NaN
or infinite inputs are never skipped (so a NaN still reaches the output as it does unfused).
A causal mask folded to a constant (a static length) is read back as
its index expression first (:mod:`.constant_mask`), so its tiles are skipped too.

IEEE behaviour is that of the unfused operators: the running max starts where TOPI's max
reduction does (the lowest finite float), so a row of ``-inf`` scores gives ``0/0 = NaN`` as
softmax does, and NaN scores propagate through the sum.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import tvm
import tvm_ffi
from tvm import sym, tirx
from tvm.s_tir import SBlock, SBlockRealize
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..tir_utils import buffer_loads, find_all, substitute
from .attention_match import (
    F32,
    AttentionPattern,
    NotAttention,
    free_vars,
    match_attention,
)
from .constant_mask import inline_causal_masks
from .cpu_target import CpuParams
from .fast_math import fast_math
from .records import (
    DONE_ATTR,
    KEPT_ATTR,
    SCHEDULE_ATTR,
    ScheduleFailedWarning,
    first_line,
    restore_symbol,
)

# exp(x) is exactly 0 in float32 below about -103.97 (libm and fast_math alike); the skip test
# asks for this much more margin
UNDERFLOW_MARGIN = 128.0
_MAX_BQ = 128
_DECODE_KEYS = 4  # keys whose dot products the decode kernel computes side by side

__all__ = ["ATTENTION_ATTR", "TILES_ATTR", "UNDERFLOW_MARGIN", "AttentionTiles", "MaskRegion",
           "box_condition", "build_cpu_attention", "choose_tiles", "decode_splits",
           "mask_regions", "masked_from", "tile_bytes",
           "split_task", "try_schedule_attention", "under_root_block", "value_at"]


@dataclass(frozen=True)
class AttentionTiles:
    """Query rows per task, keys per tile and the two register tiles."""

    bq: int  # query rows per task (a multiple of mr)
    bk: int  # keys per tile (a multiple of nr)
    mr: int  # rows of both register tiles
    nr: int  # keys of the Q·Kᵀ register tile (a multiple of the SIMD lanes)
    nv: int  # value columns of the P·V register tile (a multiple of the SIMD lanes)
    lanes: int

    def describe(self) -> str:
        return (f"{self.bq} query rows x {self.bk} keys per tile; registers {self.mr}x{self.nr} "
                f"(Q.K^T), {self.mr}x{self.nv} (P.V)")


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def choose_tiles(pattern: AttentionPattern, params: CpuParams,
                 rows_hint: int | None = None, keys_hint: int | None = None) -> AttentionTiles:
    """Tiles from the target: register tiles from the SIMD width and register budget, ``bk``
    so that a packed K (or V) tile takes half of L1, ``bq`` so that the task's working set
    takes half of L2; ``rows_hint`` (the query length, when known) keeps ``bq`` no larger,
    ``keys_hint`` (the key length, when known) keeps ``bk`` no larger than the keys rounded
    up to the register tile: Swin's 7×7 windows have 49 keys, which a 128-key tile computed
    2.6 times over in Q·Kᵀ and P·V (``test_key_tile_follows_a_short_static_key_length``)."""
    lanes = params.lanes
    mr = max(params.registers // 2, 1)  # two vectors of keys per row: mr·2 accumulators
    if rows_hint is not None and 0 < rows_hint < mr:
        mr = rows_hint  # decode: one (or a few) query rows
    nr = 2 * lanes
    dvp = _ceil_to(pattern.dv, lanes)
    nv = 2 * lanes if dvp % (2 * lanes) == 0 else lanes
    dk, elem = pattern.dk, 4
    l1, l2 = params.l1d_bytes, params.l2_bytes
    bk = max(nr, (l1 // 2) // (max(dk, dvp) * elem) // nr * nr)
    bk = min(bk, 4 * nr)
    if keys_hint is not None and keys_hint > 0:
        bk = min(bk, _ceil_to(keys_hint, nr))
    per_row = (dk + bk + dvp) * elem
    fixed = bk * (dk + dvp) * elem
    bq = max(mr, ((l2 // 2 - fixed) // per_row) // mr * mr)
    bq = min(bq, _MAX_BQ // mr * mr or mr)
    if rows_hint is not None:  # blocks of equal size: 128 rows are 2 x 66, not 126 + 2
        blocks = -(-max(rows_hint, 1) // bq)
        bq = min(bq, _ceil_to(-(-max(rows_hint, 1) // blocks), mr))
    return AttentionTiles(bq, bk, mr, nr, nv, lanes)


# ------------------------------------------------------------------------------ masked tiles


@dataclass(frozen=True)
class MaskRegion:
    """Where the score is ``value`` (a function of ``s`` at most): ``cond == polarity`` on
    every point of a tile; ``cond`` compares affine functions of the row ``i`` and key ``j``."""

    cond: object
    polarity: bool
    value: object  # float32 over s (and scalar loads)
    slope: object | None  # value = slope·s + offset, or None when value does not read s
    offset: object


def mask_regions(pattern: AttentionPattern) -> list[MaskRegion]:
    """The index conditions of the score function under which it stops depending on the
    position (a causal or sliding-window mask), each with the value it takes there."""
    ana = pattern.analyzer()
    conds = []
    for node in find_all(pattern.score, (tirx.LT, tirx.LE, tirx.GT, tirx.GE)):
        names = free_vars(node)
        if buffer_loads(node) or not names:
            continue
        if not all(v.same_as(pattern.i) or v.same_as(pattern.j) or _is_size(v, pattern)
                   for v in names):
            continue
        if not any(v.same_as(pattern.j) for v in names):
            continue
        if not any(_equal(node, c) for c in conds):
            conds.append(node)
    regions = []
    for cond in conds:
        for polarity in (True, False):
            value = _fold_condition(pattern.score, cond, polarity, ana)
            if _position_free(value, pattern):
                slope, offset = _affine_in(value, pattern.s, ana)
                if slope is None and any(v.same_as(pattern.s) for v in free_vars(value)):
                    continue
                if _never_masks(offset):
                    continue  # the unmasked side (s·a + 0): testing it only costs
                regions.append(MaskRegion(cond, polarity, value, slope, offset))
    return regions


def _never_masks(offset) -> bool:
    """A compile-time offset above -1000: exp(offset + ... - m) is not 0 for ordinary scores,
    so a tile there is never skipped (masks use -1e4, -1e9, the lowest float or -inf)."""
    if isinstance(offset, tirx.FloatImm):
        return float(offset.value) > -1e3
    return False


def _is_size(var, pattern: AttentionPattern) -> bool:
    """A symbolic size (``seq``), not an index."""
    return not any(var.same_as(v) for v in pattern.ranges()) and not var.same_as(pattern.s)


def _equal(a, b) -> bool:
    return bool(tvm_ffi.structural_equal(a, b))


def _fold_condition(expr, cond, polarity: bool, ana):
    value = tirx.const(1 if polarity else 0, "bool")

    def fold(node):
        return value if _equal(node, cond) else node

    folded = tvm_ffi.structural_map(expr, [((tirx.LT, tirx.LE, tirx.GT, tirx.GE), fold)])
    return ana.simplify(folded)


def _position_free(value, pattern: AttentionPattern) -> bool:
    """No index variable, no load at an index that depends on one."""
    for var in free_vars(value):
        if not (var.same_as(pattern.s) or _is_size(var, pattern)):
            return False
    return True


def _affine_in(value, s, ana):
    """(slope, offset) with value = slope·s + offset, or (None, value) if ``s`` is absent;
    (None, None) when ``value`` is not affine in ``s`` (read off the expression: sums,
    differences, products and quotients by ``s``-free terms, float casts)."""

    def has_s(e) -> bool:
        return any(v.same_as(s) for v in free_vars(e))

    def split(e):
        if not has_s(e):
            return tirx.const(0.0, F32), e
        if isinstance(e, tvm.ir.Var) and e.same_as(s):
            return tirx.const(1.0, F32), tirx.const(0.0, F32)
        if isinstance(e, tirx.Cast) and str(e.ty) == F32:
            return split(e.value)
        if isinstance(e, (tirx.Add, tirx.Sub)):
            a, b = split(e.a), split(e.b)
            if a is None or b is None:
                return None
            op = type(e)
            return op(a[0], b[0]), op(a[1], b[1])
        if isinstance(e, tirx.Mul):
            for x, y in ((e.a, e.b), (e.b, e.a)):
                if not has_s(y):
                    inner = split(x)
                    return None if inner is None else (inner[0] * y, inner[1] * y)
            return None
        if isinstance(e, tirx.Div) and not has_s(e.b):
            inner = split(e.a)
            return None if inner is None else (inner[0] / e.b, inner[1] / e.b)
        return None

    if not has_s(value):
        return None, value
    found = split(value)
    if found is None:
        return None, None
    return ana.simplify(found[0]), ana.simplify(found[1])


def box_condition(cond, polarity: bool, pattern: AttentionPattern, i_lo, i_hi, j_lo, j_hi):
    """A TIR condition true when ``cond == polarity`` on every point of the box
    ``[i_lo, i_hi] × [j_lo, j_hi]`` (inclusive), or None when ``cond`` is not affine in i, j."""
    linear = _linear_condition(cond, pattern)
    if linear is None:
        return None
    ci, cj, c0, strict = linear

    def extreme(high: bool):
        total = c0
        for coef, lo, hi in ((ci, i_lo, i_hi), (cj, j_lo, j_hi)):
            if coef:
                total = total + coef * (hi if (coef > 0) == high else lo)
        return total

    if polarity:  # e < 0 (or <= 0) everywhere: its maximum
        top = extreme(True)
        return top < 0 if strict else top <= 0
    low = extreme(False)  # the condition false everywhere: e >= 0 (or > 0) at its minimum
    return low >= 0 if strict else low > 0


def _linear_condition(cond, pattern: AttentionPattern):
    """``cond`` as ``e(i, j) < 0`` (strict) or ``e <= 0``, ``e = ci·i + cj·j + c0`` with
    integer ``ci``, ``cj``: ``(ci, cj, c0, strict)``, or None."""
    if isinstance(cond, tirx.LT):
        e, strict = cond.a - cond.b, True
    elif isinstance(cond, tirx.LE):
        e, strict = cond.a - cond.b, False
    elif isinstance(cond, tirx.GT):
        e, strict = cond.b - cond.a, True
    else:
        e, strict = cond.b - cond.a, False
    coeffs = sym.detect_linear_equation(e, [pattern.i, pattern.j])
    if len(coeffs) != 3:
        return None
    ci, cj, c0 = coeffs
    if not isinstance(ci, tirx.IntImm) or not isinstance(cj, tirx.IntImm):
        return None
    return int(ci.value), int(cj.value), c0, strict


def masked_from(cond, polarity: bool, pattern: AttentionPattern, i_lo, i_hi):
    """The first key from which ``cond == polarity`` holds for every key after it and every
    row of ``[i_lo, i_hi]`` (a causal mask: the keys after the block's last row), or None when
    the region is not every key beyond a bound (a mask below the diagonal, a band). The loop
    bound :func:`box_condition`'s per-tile test gives in one expression: a tile starting at
    or after it is entirely in the region."""
    linear = _linear_condition(cond, pattern)
    if linear is None:
        return None
    ci, cj, c0, strict = linear
    if polarity:  # e < 0 (e <= 0) for all j >= J: needs cj < 0; the worst row maximises ci·i
        if cj >= 0:
            return None
        top = c0 + ci * (i_hi if ci > 0 else i_lo)  # e = top - |cj|·j
        # strict: j > top / |cj|, i.e. j >= top // |cj| + 1; else j >= ceil(top / |cj|)
        return (tirx.floordiv(top, -cj) + 1 if strict
                else tirx.floordiv(top + (-cj - 1), -cj))
    if cj <= 0:  # e >= 0 (e > 0) for all j >= J: needs cj > 0; the worst row minimises ci·i
        return None
    low = c0 + ci * (i_lo if ci > 0 else i_hi)  # e = low + cj·j
    # strict (not e < 0): j >= ceil(-low / cj); else (not e <= 0): j >= -low // cj + 1
    return (tirx.floordiv(-low + (cj - 1), cj) if strict
            else tirx.floordiv(-low, cj) + 1)


# --------------------------------------------------------------------------------- emitting


def value_at(expr, pattern: AttentionPattern, batch, i=None, j=None, k=None, d=None, s=None,
             o=None):
    """``expr`` (a piece of ``pattern``) at the given index values (and ``s``, ``o``)."""
    mapping = {var: _as_dtype(value, str(var.ty)) for var, value in zip(pattern.batch, batch)}
    for var, value in ((pattern.i, i), (pattern.j, j), (pattern.k, k), (pattern.d, d),
                       (pattern.s, s), (pattern.o, o)):
        if value is not None:
            mapping[var] = _as_dtype(value, str(var.ty))
    return substitute(expr, mapping)


def _as_dtype(value, dtype: str):
    """``value`` in the index variable's dtype: the template's loops count in int32 where the
    kernel's indices are int64, and ``substitute`` does not convert. A bare load tolerates
    the mix, but arithmetic on the index (RoPE's rotate-half: ``(k + 16) % 32``) then fails
    TIR's lowering with ``mismatched types. int32 vs. int64`` and the kernel lost its
    template."""
    if isinstance(value, int):
        return tirx.const(value, dtype)
    return value if str(value.ty) == dtype else tirx.Cast(dtype, value)


def _i64(x):
    return tirx.const(x, "int64") if isinstance(x, int) else x


def split_task(task, inner, batch_extents) -> tuple[object, list]:
    """A flat task index as (its index among ``inner`` tasks per batch entry, the batch
    indices, outermost first)."""
    rest, batch = tirx.floordiv(task, inner), []
    for ext in reversed(batch_extents):
        batch.append(tirx.floormod(rest, ext))
        rest = tirx.floordiv(rest, ext)
    return tirx.floormod(task, inner), batch[::-1]


def under_root_block(body: tirx.Stmt) -> tirx.Stmt:
    """``body`` under a root block, as a scheduled PrimFunc's is: TVM's RewriteDataflowReshape
    (Relax lowering, memory planning) asserts one in every kernel that a ``call_tir`` with one
    input calls (an attention of packed Q/K/V failed: "func->body->IsInstance<SBlockRealize>")."""
    return SBlockRealize([], tirx.const(True, "bool"), SBlock([], [], [], "root", body))


def build_cpu_attention(pattern: AttentionPattern, params: CpuParams,
                        tiles: AttentionTiles | None = None) -> tuple[tirx.PrimFunc, list[str]]:
    """The attention as one generated PrimFunc with ``pattern.func``'s signature, and notes."""
    tiles = tiles or choose_tiles(pattern, params, _static(pattern.sq), _static(pattern.sk))
    if _static(pattern.sq) == 1:
        emitter = _DecodeEmitter(pattern, tiles, params.cores)
        description = emitter.describe()
    else:
        emitter = _CpuEmitter(pattern, tiles, params.cores)
        description = (f"attention (online softmax): {tiles.describe()}; "
                       f"{len(emitter.regions)} masked-tile test(s)")
    body = under_root_block(emitter.emit())
    func = pattern.func
    result = tirx.PrimFunc(list(func.params), body, func.ret_type, func.attrs)
    result = result.with_attr("tirx.noalias", True)
    return result, [description]


def _static(expr) -> int | None:
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


class _CpuEmitter:
    def __init__(self, pattern: AttentionPattern, tiles: AttentionTiles, cores: int = 1):
        self.p = pattern
        self.t = tiles
        self.cores = max(cores, 1)
        self.dvp = _ceil_to(pattern.dv, tiles.lanes)
        self.regions = mask_regions(pattern)

    # ------------------------------------------------------------------ the loop nest

    def emit(self):
        """One task per (batch…, group of query blocks): K (transposed) and V are packed once
        per task for the whole key length, then the task's query blocks (``g, g + G, …``:
        interleaved, so that a causal mask leaves every group the same work) each run over
        the key tiles."""
        p, t = self.p, self.t
        itype = str(p.i.ty)
        bq, bk, dk, dvp = t.bq, t.bk, p.dk, self.dvp
        sq, sk = p.sq, p.sk
        n_qb = tirx.floordiv(sq + (bq - 1), bq)
        n_kt = tirx.floordiv(sk + (bk - 1), bk)
        heads = tirx.const(1, itype)
        for ext in p.batch_extents:
            heads = heads * ext
        # enough tasks for every core (4 per core) when there are few heads
        groups = tirx.max(tirx.const(1, itype), tirx.min(
            n_qb, tirx.floordiv(tirx.const(4 * self.cores, itype) + heads - 1, heads)))
        with IRBuilder() as ib:
            with T.parallel(tirx.const(0, itype), heads * groups) as task:
                g, batch = split_task(task, groups, p.batch_extents)
                # tile-major (Kt[kb, k, j]): one key tile is a contiguous dk × bk block, where
                # rows of the whole key length (a stride of 4·seq bytes, 8 KiB at 2,048) put
                # a tile's dk rows in the same few L1 sets, reloaded from L2 at every k
                kt = T.alloc_buffer((n_kt, dk, bk), F32)
                vp = T.alloc_buffer((n_kt * bk, dvp), F32)
                kstat = T.alloc_buffer((n_kt, 2), F32)  # per key tile: max |k|, all finite
                self._pack_keys(kt, vp, kstat, batch, n_kt)
                qp = T.alloc_buffer((bq, dk), F32, scope="local")
                sc = T.alloc_buffer((bq, bk), F32, scope="local")
                acc = T.alloc_buffer((bq, dvp), F32, scope="local")
                mrow = T.alloc_buffer((bq,), F32, scope="local")
                lrow = T.alloc_buffer((bq,), F32, scope="local")
                corr = T.alloc_buffer((bq,), F32, scope="local")
                stats = T.alloc_buffer((2,), F32, scope="local")  # the query block's max |q|
                with T.serial(tirx.const(0, itype),
                              tirx.floordiv(n_qb - g + groups - 1, groups)) as qi:
                    i0 = (g + qi * groups) * bq
                    nq = tirx.min(tirx.const(bq, itype), sq - i0)
                    self._pack_query(qp, batch, i0, nq, stats)
                    with T.serial(0, bq) as r:
                        T.buffer_store(mrow, p.m_init, [r])
                        T.buffer_store(lrow, tirx.const(0.0, F32), [r])
                        with T.serial(0, dvp) as c:
                            T.buffer_store(acc, tirx.const(0.0, F32), [r, c])
                    with T.serial(tirx.const(0, itype), n_kt) as kb:
                        j0 = kb * bk
                        nk = tirx.min(tirx.const(bk, itype), sk - j0)
                        skip = self._skip_condition(i0, nq, j0, nk, kb, mrow, stats, kstat)
                        if skip is None:
                            self._tile(qp, kt, vp, sc, acc, mrow, lrow, corr, batch, i0, nq,
                                       kb, nk)
                        else:
                            with T.If(tirx.Not(skip)):
                                with T.Then():
                                    self._tile(qp, kt, vp, sc, acc, mrow, lrow, corr, batch,
                                               i0, nq, kb, nk)
                    self._store(acc, lrow, batch, i0, nq)
        return ib.get()

    # ----------------------------------------------------------------- packing

    def _pack_query(self, qp, batch, i0, nq, stats):
        p, t = self.p, self.t
        T.buffer_store(stats, tirx.const(0.0, F32), [0])
        T.buffer_store(stats, tirx.const(1.0, F32), [1])
        with T.serial(0, t.bq) as r:
            with T.If(r < nq):
                with T.Then():
                    with T.serial(0, p.dk) as c:
                        x = value_at(p.query, p, batch, i=i0 + r, k=c)
                        T.buffer_store(qp, x, [r, c])
                with T.Else():
                    with T.serial(0, p.dk) as c:
                        T.buffer_store(qp, tirx.const(0.0, F32), [r, c])
        if self._needs_bounds():
            with T.serial(0, t.bq) as r:
                with T.If(r < nq):
                    with T.Then():
                        with T.serial(0, p.dk) as c:
                            self._track(stats, [0], [1], qp[r, c])

    def _track(self, buf, at_max, at_finite, x):
        """buf[at_max] = max |x|; buf[at_finite] = 0 once a value is not finite."""
        T.buffer_store(buf, tirx.max(buf[tuple(at_max)], tirx.abs(x)), at_max)
        T.buffer_store(buf, tirx.Select(tirx.isfinite(x), buf[tuple(at_finite)],
                                        tirx.const(0.0, F32)), at_finite)

    def _needs_bounds(self) -> bool:
        return any(r.slope is not None for r in self.regions)

    def _pack_keys(self, kt, vp, kstat, batch, n_kt):
        """Kt[kb, k, j] (a tile's keys contiguous) and Vp[j, d] for every key of the task's head,
        padding keys zero; per key tile the bounds the masked-tile test needs."""
        p, t = self.p, self.t
        with T.serial(tirx.const(0, str(p.j.ty)), n_kt) as kb:
            T.buffer_store(kstat, tirx.const(0.0, F32), [kb, 0])
            T.buffer_store(kstat, tirx.const(1.0, F32), [kb, 1])
            with T.serial(0, t.bk) as c:
                j = kb * t.bk + c
                with T.If(j < p.sk):
                    with T.Then():
                        with T.serial(0, p.dk) as kk:
                            T.buffer_store(kt, value_at(p.key, p, batch, j=j, k=kk),
                                           [kb, kk, c])
                        with T.serial(0, p.dv) as dd:
                            T.buffer_store(vp, value_at(p.value, p, batch, j=j, d=dd), [j, dd])
                        for dd in range(p.dv, self.dvp):
                            T.buffer_store(vp, tirx.const(0.0, F32), [j, dd])
                        if self._needs_bounds():
                            with T.serial(0, p.dk) as kk:
                                self._track(kstat, [kb, 0], [kb, 1], kt[kb, kk, c])
                    with T.Else():
                        with T.serial(0, p.dk) as kk:
                            T.buffer_store(kt, tirx.const(0.0, F32), [kb, kk, c])
                        with T.serial(0, self.dvp) as dd:
                            T.buffer_store(vp, tirx.const(0.0, F32), [j, dd])

    # -------------------------------------------------------------- masked tiles

    def _skip_condition(self, i0, nq, j0, nk, kb, mrow, stats, kstat):
        """None when no tile can be skipped; else a condition, evaluated per tile."""
        if not self.regions:
            return None
        p, t = self.p, self.t
        i_hi, j_hi = i0 + nq - 1, j0 + nk - 1
        tests = []
        for region in self.regions:
            box = box_condition(region.cond, region.polarity, p, i0, i_hi, j0, j_hi)
            if box is not None:
                tests.append((region, box))
        if not tests:
            return None
        # every row's current maximum: the smallest one decides
        mmin = T.alloc_buffer((1,), F32, scope="local")
        T.buffer_store(mmin, tirx.max_value(F32), [0])
        with T.serial(0, t.bq) as r:
            with T.If(r < nq):
                with T.Then():
                    T.buffer_store(mmin, tirx.min(mmin[0], mrow[r]), [0])
        skip = tirx.const(False, "bool")
        for region, box in tests:
            if region.slope is None:
                upper = region.offset
                ok = box
            else:
                bound = (tirx.const(float(p.dk) * (1.0 + 2.0 ** -8), F32) * stats[0]
                         * kstat[kb, 0] + tirx.const(1e-30, F32))
                upper = tirx.abs(region.slope) * bound + region.offset
                ok = tirx.And(box, tirx.And(stats[1] > 0.5, kstat[kb, 1] > 0.5))
            # exp(upper - m) == 0 for every row: m >= mmin
            ok = tirx.And(ok, upper - mmin[0] < tirx.const(-UNDERFLOW_MARGIN, F32))
            skip = tirx.Or(skip, ok)
        return skip

    # ------------------------------------------------------------------ one key tile

    def _tile(self, qp, kt, vp, sc, acc, mrow, lrow, corr, batch, i0, nq, kb, nk):
        groups = tirx.floordiv(nq + (self.t.mr - 1), self.t.mr)  # row groups holding rows
        j0 = kb * self.t.bk
        self._scores(qp, kt, sc, groups, kb)
        self._online_softmax(sc, mrow, lrow, corr, batch, i0, nq, j0, nk)
        self._accumulate(sc, vp, acc, corr, groups, j0, nk)

    def _scores(self, qp, kt, sc, groups, kb):
        """sc = qp · kt with an mr × nr register tile (keys vectorised), over the row groups
        that hold query rows (a partial last block computes only those)."""
        p, t = self.p, self.t
        vecs = t.nr // t.lanes
        with T.serial(0, groups) as rg:
            with T.serial(0, t.bk // t.nr) as cg:
                reg = T.alloc_buffer((t.mr, t.nr), F32, scope="local")
                with T.unroll(0, t.mr) as r:
                    with T.unroll(0, vecs) as v:
                        with T.vectorized(0, t.lanes) as ln:
                            T.buffer_store(reg, tirx.const(0.0, F32), [r, v * t.lanes + ln])
                with T.serial(0, p.dk) as kk:
                    with T.unroll(0, t.mr) as r:
                        with T.unroll(0, vecs) as v:
                            with T.vectorized(0, t.lanes) as ln:
                                col = v * t.lanes + ln
                                T.buffer_store(reg, reg[r, col] + qp[rg * t.mr + r, kk]
                                               * kt[kb, kk, cg * t.nr + col], [r, col])
                with T.unroll(0, t.mr) as r:
                    with T.unroll(0, vecs) as v:
                        with T.vectorized(0, t.lanes) as ln:
                            col = v * t.lanes + ln
                            T.buffer_store(sc, reg[r, col], [rg * t.mr + r, cg * t.nr + col])

    def _online_softmax(self, sc, mrow, lrow, corr, batch, i0, nq, j0, nk):
        t = self.t
        with T.serial(0, t.bq) as r:
            with T.If(r < nq):
                with T.Then():
                    i = i0 + r
                    with T.If(nk == t.bk):
                        with T.Then():
                            self._row(sc, mrow, lrow, corr, r, batch, i, j0, t.bk)
                        with T.Else():
                            self._row(sc, mrow, lrow, corr, r, batch, i, j0, nk)
                with T.Else():
                    T.buffer_store(corr, tirx.const(1.0, F32), [r])
                    with T.serial(0, t.bk) as c:
                        T.buffer_store(sc, tirx.const(0.0, F32), [r, c])

    def _row(self, sc, mrow, lrow, corr, r, batch, i, j0, count):
        """One row of the tile: scores, running max, exponentials, running sum; vectorised
        over whole registers of keys, a partial tile's last ``count % lanes`` keys scalar
        (``count`` is the constant ``bk`` on a full tile)."""
        p, t = self.p, self.t
        lanes = t.lanes
        m_old = mrow[r]
        part = T.alloc_buffer((lanes,), F32, scope="local")
        tail = T.alloc_buffer((2,), F32, scope="local")  # the scalar keys' max, then sum
        tmp = T.alloc_buffer((lanes,), F32, scope="local")  # one value, read twice
        vec = count // lanes if isinstance(count, int) else tirx.floordiv(count, lanes)
        rest = vec * lanes

        def scalars():
            return T.serial(rest, count) if not isinstance(count, int) else None

        with T.vectorized(0, lanes) as ln:
            T.buffer_store(part, m_old, [ln])
        T.buffer_store(tail, m_old, [0])
        with T.serial(0, vec) as co:
            with T.vectorized(0, lanes) as ln:
                c = co * lanes + ln
                T.buffer_store(tmp, value_at(p.score, p, batch, i=i, j=j0 + c, s=sc[r, c]), [ln])
                T.buffer_store(sc, tmp[ln], [r, c])
                T.buffer_store(part, tirx.max(part[ln], tmp[ln]), [ln])
        if scalars() is not None:
            with scalars() as c:
                T.buffer_store(sc, value_at(p.score, p, batch, i=i, j=j0 + c, s=sc[r, c]),
                               [r, c])
                T.buffer_store(tail, tirx.max(tail[0], sc[r, c]), [0])
        m_new = T.alloc_buffer((1,), F32, scope="local")
        T.buffer_store(m_new, tail[0], [0])
        for ln in range(lanes):
            T.buffer_store(m_new, tirx.max(m_new[0], part[ln]), [0])
        with T.vectorized(0, lanes) as ln:
            T.buffer_store(part, tirx.const(0.0, F32), [ln])
        T.buffer_store(tail, tirx.const(0.0, F32), [1])
        with T.serial(0, vec) as co:
            with T.vectorized(0, lanes) as ln:
                c = co * lanes + ln
                T.buffer_store(tmp, tirx.exp(sc[r, c] - m_new[0]), [ln])
                T.buffer_store(sc, tmp[ln], [r, c])
                T.buffer_store(part, part[ln] + tmp[ln], [ln])
        if scalars() is not None:
            with scalars() as c:
                T.buffer_store(sc, tirx.exp(sc[r, c] - m_new[0]), [r, c])
                T.buffer_store(tail, tail[1] + sc[r, c], [1])
            with T.serial(count, t.bk) as c:  # the padding keys weigh nothing
                T.buffer_store(sc, tirx.const(0.0, F32), [r, c])
        total = T.alloc_buffer((1,), F32, scope="local")
        T.buffer_store(total, tail[1], [0])
        for ln in range(lanes):
            T.buffer_store(total, total[0] + part[ln], [0])
        scale = tirx.exp(m_old - m_new[0])
        T.buffer_store(corr, scale, [r])
        T.buffer_store(lrow, lrow[r] * corr[r] + total[0], [r])
        T.buffer_store(mrow, m_new[0], [r])

    def _accumulate(self, sc, vp, acc, corr, groups, j0, nk):
        """acc = acc·corr + sc · vp, an mr × nv register tile (values vectorised), over the
        tile's ``nk`` keys (its padding keys weigh 0: a partial tile skips them)."""
        t = self.t
        vecs = t.nv // t.lanes
        with T.serial(0, groups) as rg:
            with T.serial(0, self.dvp // t.nv) as cg:
                reg = T.alloc_buffer((t.mr, t.nv), F32, scope="local")
                with T.unroll(0, t.mr) as r:
                    with T.unroll(0, vecs) as v:
                        with T.vectorized(0, t.lanes) as ln:
                            row, col = rg * t.mr + r, cg * t.nv + v * t.lanes + ln
                            T.buffer_store(reg, acc[row, col] * corr[row], [r, v * t.lanes + ln])
                with T.serial(tirx.const(0, str(nk.ty)), nk) as c:
                    with T.unroll(0, t.mr) as r:
                        with T.unroll(0, vecs) as v:
                            with T.vectorized(0, t.lanes) as ln:
                                col = v * t.lanes + ln
                                T.buffer_store(reg, reg[r, col] + sc[rg * t.mr + r, c]
                                               * vp[j0 + c, cg * t.nv + col], [r, col])
                with T.unroll(0, t.mr) as r:
                    with T.unroll(0, vecs) as v:
                        with T.vectorized(0, t.lanes) as ln:
                            col = v * t.lanes + ln
                            T.buffer_store(acc, reg[r, col], [rg * t.mr + r, cg * t.nv + col])

    # ------------------------------------------------------------------------ output

    def _store(self, acc, lrow, batch, i0, nq):
        p = self.p
        with T.serial(0, nq) as r:
            with T.serial(0, p.dv) as dd:
                o = p.normalise(acc[r, dd], lrow[r])
                index = [value_at(ix, p, batch, i=i0 + r, d=dd) for ix in p.out_index]
                value = value_at(p.out_value, p, batch, i=i0 + r, d=dd, o=o)
                T.buffer_store(p.out, value, index)


def decode_splits(pattern: AttentionPattern, cores: int) -> int:
    """Key ranges per (batch…) entry of a decode step: enough tasks for four per core when
    there are few heads (each range's partial softmax is combined at the end), else 1."""
    heads = 1
    for ext in pattern.batch_extents:
        if _static(ext) is None:
            return 1  # a symbolic batch: the heads are many
        heads *= _static(ext)
    return max(1, -(-4 * max(cores, 1) // max(heads, 1))) if heads < 4 * max(cores, 1) else 1


class _DecodeEmitter:
    """One query row (a decode step: the new token against the key/value cache). Nothing is
    packed: each key is used once, so K and V are read where they are (a key's dot product
    vectorised over the head dimension, ``P·V`` over the value columns), tile by tile with the
    online softmax of the general template; no score beyond a tile of ``bk`` keys is kept.
    Tasks are the (batch…) entries, each split into ``splits`` key ranges when there are
    fewer heads than four per core; the ranges' partial results (max, sum, accumulator) are
    combined at the end, rescaled to the row's maximum (flash decoding)."""

    def __init__(self, pattern: AttentionPattern, tiles: AttentionTiles, cores: int = 1):
        self.p, self.t = pattern, tiles
        self.splits = decode_splits(pattern, cores)
        self.regions: list = []  # one row: masks are applied per score, no tile is skipped

    def describe(self) -> str:
        return (f"attention (online softmax, decode): 1 query row x {self.t.bk} keys per tile, "
                f"K and V read in place; {self.splits} key range(s) per head"
                + (", combined" if self.splits > 1 else "") + "; 0 masked-tile test(s)")

    def emit(self):
        p, t = self.p, self.t
        itype = str(p.i.ty)
        dvp = _ceil_to(p.dv, t.lanes)
        n_kt = tirx.floordiv(p.sk + (t.bk - 1), t.bk)
        heads = tirx.const(1, itype)
        for ext in p.batch_extents:
            heads = heads * ext
        splits = self.splits
        per_split = tirx.floordiv(n_kt + (splits - 1), splits)
        with IRBuilder() as ib, T.serial(0, 1):  # a frame for two loops, unwrapped below
            ws = T.alloc_buffer((heads * splits, dvp + 2), F32) if splits > 1 else None
            with T.parallel(tirx.const(0, itype), heads * splits) as task:
                part, batch = split_task(task, splits, p.batch_extents)
                qv = T.alloc_buffer((p.dk,), F32, scope="local")
                sc = T.alloc_buffer((t.bk,), F32, scope="local")
                acc = T.alloc_buffer((dvp,), F32, scope="local")
                st = T.alloc_buffer((2,), F32, scope="local")  # running max, running sum
                with T.serial(0, p.dk) as c:
                    T.buffer_store(qv, value_at(p.query, p, batch, i=0, k=c), [c])
                T.buffer_store(st, p.m_init, [0])
                T.buffer_store(st, tirx.const(0.0, F32), [1])
                with T.vectorized(0, dvp) as c:
                    T.buffer_store(acc, tirx.const(0.0, F32), [c])
                first = part * per_split
                last = tirx.min(n_kt, first + per_split)
                with T.serial(first, tirx.max(first, last)) as kb:
                    j0 = kb * t.bk
                    nk = tirx.min(tirx.const(t.bk, itype), p.sk - j0)
                    self._tile(qv, sc, acc, st, batch, j0, nk, dvp)
                if ws is None:
                    self._store(acc, st[1], batch)
                else:
                    T.buffer_store(ws, st[0], [task, 0])
                    T.buffer_store(ws, st[1], [task, 1])
                    with T.vectorized(0, dvp) as c:
                        T.buffer_store(ws, acc[c], [task, c + 2])
            if ws is not None:
                self._combine(ws, heads, dvp)
        return ib.get().body

    def _tile(self, qv, sc, acc, st, batch, j0, nk, dvp):
        p, t = self.p, self.t
        lanes, group = t.lanes, _DECODE_KEYS
        full = p.dk // lanes * lanes
        part = T.alloc_buffer((group, lanes), F32, scope="local")
        red = T.alloc_buffer((2,), F32, scope="local")  # the tile's max, then its sum
        T.buffer_store(red, st[0], [0])
        # ``group`` keys' dot products side by side (independent FMA chains, the query in
        # registers); a partial group's extra keys read the last key and are dropped
        with T.serial(0, tirx.floordiv(nk + (group - 1), group)) as cg:
            with T.unroll(0, group) as g:
                with T.vectorized(0, lanes) as ln:
                    T.buffer_store(part, tirx.const(0.0, F32), [g, ln])
            with T.unroll(0, full // lanes) as kv:
                with T.unroll(0, group) as g:
                    with T.vectorized(0, lanes) as ln:
                        kk = kv * lanes + ln
                        j = tirx.min(j0 + cg * group + g, p.sk - 1)
                        T.buffer_store(part, part[g, ln] + qv[kk]
                                       * value_at(p.key, p, batch, j=j, k=kk), [g, ln])
            for g in range(group):
                c = cg * group + g
                with T.If(c < nk):
                    with T.Then():
                        j = j0 + c
                        dot = T.alloc_buffer((1,), F32, scope="local")
                        T.buffer_store(dot, tirx.const(0.0, F32), [0])
                        for kk in range(full, p.dk):
                            T.buffer_store(dot, dot[0] + qv[kk] * value_at(p.key, p, batch,
                                                                           j=j, k=kk), [0])
                        for ln in range(lanes):
                            T.buffer_store(dot, dot[0] + part[g, ln], [0])
                        T.buffer_store(sc, value_at(p.score, p, batch, i=0, j=j, s=dot[0]),
                                       [c])
                        T.buffer_store(red, tirx.max(red[0], sc[c]), [0])
        m_new = red[0]
        corr = T.alloc_buffer((1,), F32, scope="local")
        T.buffer_store(corr, tirx.exp(st[0] - m_new), [0])
        T.buffer_store(st, m_new, [0])
        T.buffer_store(red, tirx.const(0.0, F32), [1])
        with T.serial(0, nk) as c:
            T.buffer_store(sc, tirx.exp(sc[c] - st[0]), [c])
            T.buffer_store(red, red[1] + sc[c], [1])
        T.buffer_store(st, st[1] * corr[0] + red[1], [1])
        vfull = p.dv // lanes * lanes
        with T.vectorized(0, dvp) as d:
            T.buffer_store(acc, acc[d] * corr[0], [d])
        with T.serial(0, nk) as c:
            with T.unroll(0, vfull // lanes) as dv:  # the accumulator in registers
                with T.vectorized(0, lanes) as ln:
                    d = dv * lanes + ln
                    T.buffer_store(acc, acc[d] + sc[c] * value_at(p.value, p, batch, j=j0 + c,
                                                                  d=d), [d])
            for d in range(vfull, p.dv):
                T.buffer_store(acc, acc[d] + sc[c] * value_at(p.value, p, batch, j=j0 + c, d=d),
                               [d])

    def _store(self, acc, total, batch):
        p = self.p
        with T.serial(0, p.dv) as dd:
            o = p.normalise(acc[dd], total)
            index = [value_at(ix, p, batch, i=0, d=dd) for ix in p.out_index]
            T.buffer_store(p.out, value_at(p.out_value, p, batch, i=0, d=dd, o=o), index)

    def _combine(self, ws, heads, dvp):
        """Per (batch…) entry: the key ranges' partial results rescaled to the row maximum."""
        p, splits = self.p, self.splits
        itype = str(p.i.ty)
        with T.parallel(tirx.const(0, itype), heads) as h:
            _, batch = split_task(h, 1, p.batch_extents)
            base = h * splits
            top = T.alloc_buffer((2,), F32, scope="local")  # row max, row sum
            acc = T.alloc_buffer((dvp,), F32, scope="local")
            T.buffer_store(top, ws[base, 0], [0])
            for r in range(1, splits):
                T.buffer_store(top, tirx.max(top[0], ws[base + r, 0]), [0])
            T.buffer_store(top, tirx.const(0.0, F32), [1])
            with T.vectorized(0, dvp) as c:
                T.buffer_store(acc, tirx.const(0.0, F32), [c])
            for r in range(splits):
                w = tirx.exp(ws[base + r, 0] - top[0])
                T.buffer_store(top, top[1] + ws[base + r, 1] * w, [1])
                with T.vectorized(0, dvp) as c:
                    T.buffer_store(acc, acc[c] + ws[base + r, c + 2] * w, [c])
            self._store(acc, top[1], batch)


def tile_bytes(pattern: AttentionPattern, tiles: AttentionTiles) -> int:
    """Bytes of the per-task buffers (what replaces the score matrix)."""
    dvp = _ceil_to(pattern.dv, tiles.lanes)
    return 4 * (tiles.bq * (pattern.dk + tiles.bk + dvp + 3) + tiles.bk * (pattern.dk + dvp))


# ------------------------------------------------------------------------------ dispatch

ATTENTION_ATTR = "tvm_fusion.attention"
TILES_ATTR = "tvm_fusion.attention_tiles"  # (bq, bk): a tuned or forced tile


def try_schedule_attention(gvar, func: tirx.PrimFunc, params: CpuParams, fast: bool = True,
                           constants: dict | None = None):
    """The dispatch hook of ``ScheduleFusedBlocks``: a fused attention gets the generated
    online-softmax kernel; anything else returns None (the usual rules). A template failure
    warns and returns None too: the per-block rules then schedule the function.

    ``constants`` (parameter position → the constants every call passes there) lets a
    causal mask folded to a constant be read as its index expression, so its tiles are
    skipped as a symbolic length's are (:mod:`.constant_mask`)."""
    try:
        pattern = match_attention(func)
    except NotAttention:
        return None
    except Exception:  # noqa: BLE001 (an analysis TVM cannot do: not ours to schedule)
        return None
    mask_notes = []
    if constants:
        score, mask_notes = inline_causal_masks(pattern, constants)
        pattern = replace(pattern, score=score)
    tiles = None
    if func.attrs is not None and TILES_ATTR in func.attrs:
        bq, bk = (int(t) for t in func.attrs[TILES_ATTR])
        base = choose_tiles(pattern, params)
        tiles = AttentionTiles(_ceil_to(bq, base.mr), _ceil_to(bk, base.nr), base.mr, base.nr,
                               base.nv, base.lanes)
    try:
        result, notes = build_cpu_attention(pattern, params, tiles)
        notes = notes + mask_notes
        if fast:
            result = fast_math(result)
    except Exception as err:  # noqa: BLE001
        warnings.warn(f"tvm_fusion: attention template failed on {gvar.name_hint} "
                      f"({type(err).__name__}: {first_line(err)}); using the per-operator rules",
                      ScheduleFailedWarning, stacklevel=2)
        return None
    kept = {}  # the per-task tiles are allocated inside the kernel, not as function buffers
    attrs = {KEPT_ATTR: kept, SCHEDULE_ATTR: notes, DONE_ATTR: True, ATTENTION_ATTR: True}
    return restore_symbol(result, func).with_attrs(attrs)

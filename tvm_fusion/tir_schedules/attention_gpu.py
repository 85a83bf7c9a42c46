"""Fused attention on GPUs (CUDA, OpenCL): the CPU template's structure, one generated kernel.

The same pieces as on CPU (:mod:`.attention_match`):

* one thread block per (batch…, block of ``bq`` query rows); ``lanes`` threads per query row
  (:func:`gpu_tiles`: 1 where that fills the processors, else 8), each holding the query
  (``dk`` values), its accumulator (``dv``), its running maximum and sum in registers;
* per tile of ``bk`` keys the block loads K and V into shared memory together (consecutive
  threads, consecutive elements: coalesced; rows padded against bank conflicts), then every
  thread computes the scores of its keys of the tile (lane ``t``: keys ``t, t + lanes, …``;
  the score function applied), their maximum, and rescales its sum and accumulator once per
  tile: online softmax, no score matrix anywhere;
* masked tiles are skipped per row with the CPU template's exact test (the score function's
  value on the tile, the row's current maximum, finite inputs);
* the lanes of a row are merged through shared memory (rescaled to the row's maximum), and
  ``out = acc / l`` is written through the head merge's index map.

Sizes come from the target: threads (``max_num_threads``, registers), the SM count (CUDA
``arch``), ``bk`` so that the tiles fit the static shared memory. Sequence lengths may be
symbolic (the grid is computed at launch). Numerics are checked on PoCL (OpenCL on the CPU);
CUDA source compiles to PTX with ``nvcc`` where it is installed.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np
import tvm
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from .attention import (
    UNDERFLOW_MARGIN,
    box_condition,
    mask_regions,
    masked_from,
    split_task,
    under_root_block,
    value_at,
)
from .attention_match import F32, AttentionPattern, NotAttention, match_attention
from .records import SCHEDULE_ATTR, ScheduleFailedWarning, first_line, restore_symbol

ATTENTION_GPU_ATTR = "tvm_fusion.attention"
_SHARED = 48 << 10
_THREAD_INDEX = 1  # IterVar kind of a thread binding
# Streaming multiprocessors per CUDA architecture (TVM's CUDA target has no attribute for it):
# the grid is sized to give each at least two blocks. Other targets: _DEFAULT_UNITS.
_CUDA_SMS = {"sm_70": 80, "sm_75": 68, "sm_80": 108, "sm_86": 84, "sm_87": 16, "sm_89": 128,
             "sm_90": 132, "sm_90a": 132, "sm_100": 148, "sm_120": 84}
_DEFAULT_UNITS = 64
_REGISTERS = 64 << 10  # 32-bit registers per block (and per SM) on every CUDA GPU since sm_50
_REG_OVERHEAD = 40  # registers a thread needs besides its query and accumulator
_ROW_BLOCK = 64  # rows per block, one thread each, where that fills the processors
_ROW_KEYS = 32  # keys per shared tile then
_LANES = 8  # threads sharing one query row (each takes every 8th key of a tile)
_KEYS_PER_LANE = 8  # keys per thread per shared tile: the per-tile rescale's cost is 1/8

__all__ = ["GpuTiles", "build_gpu_attention", "gpu_tiles", "try_schedule_attention_gpu"]


class GpuTiles(NamedTuple):
    """bq query rows per block, ``lanes`` threads per row, bk keys per shared tile."""

    bq: int
    lanes: int
    bk: int


def compute_units(target) -> int:
    """The target's parallel processors (SMs on CUDA, by ``arch``)."""
    if target is None:
        return _DEFAULT_UNITS
    if target.kind.name == "cuda":
        return _CUDA_SMS.get(str(dict(target.attrs).get("arch", "")), _DEFAULT_UNITS)
    return _DEFAULT_UNITS


def shared_bytes(tiles: GpuTiles, dk: int, dv: int) -> int:
    """Static shared memory of one block: padded K and V tiles, the lanes' maxima and sums,
    the merge's ``lanes`` columns per thread."""
    bq, lanes, bk = tiles
    return 4 * (bk * padded_stride(dk) + bk * padded_stride(dv) + bq * lanes * (2 + lanes))


def padded_stride(width: int) -> int:
    """A shared tile's row stride: a multiple of 4 floats (16-byte loads) with an odd number
    of 16-byte units, so that the lanes of a row, reading 16 bytes of different rows at the
    same column, hit different banks."""
    stride = -(-width // 4) * 4
    return stride + 4 if (stride // 4) % 2 == 0 else stride


def gpu_tiles(pattern: AttentionPattern, target) -> GpuTiles:
    """Block shape for ``target``.

    Where one thread per row already gives every processor two blocks (or the length is
    symbolic) the kernel keeps one thread per row, ``_ROW_BLOCK`` rows and ``_ROW_KEYS`` keys
    per tile: every block streams all K/V tiles, so fewer rows per block multiply that
    traffic (on an H100, 8 lanes and 16 rows per block ran the Llama shape 1.5–2.8× slower).
    Otherwise (few rows: ViT's 197, Swin's 49-token windows) ``_LANES`` threads share a row;
    as many rows per block as the thread limit and two blocks' registers per processor allow,
    halved while the grid would leave a processor fewer than two blocks. The key tile is
    halved until the block's shared memory fits."""
    attrs = dict(target.attrs) if target is not None else {}
    threads = min(int(attrs.get("max_num_threads", 256)), 256)
    shared = min(int(attrs.get("max_shared_memory_per_block", _SHARED)), _SHARED)
    sq = pattern.sq
    heads = 1
    static = isinstance(sq, tirx.IntImm)
    for ext in pattern.batch_extents:
        if isinstance(ext, tirx.IntImm):
            heads *= int(ext.value)
        else:
            static = False
    rows = int(sq.value) if static else None
    want = 2 * compute_units(target)
    row_block = min(_ROW_BLOCK, threads)
    if rows is None or heads * (-(-rows // row_block)) >= want:
        lanes, bq, bk = 1, min(row_block, rows or row_block), _ROW_KEYS
    else:
        # each thread holds its query and accumulator in registers: two blocks per SM's file
        regs = int(attrs.get("registers_per_block", _REGISTERS))
        while threads > _LANES and 2 * threads * (pattern.dk + pattern.dv + _REG_OVERHEAD) > regs:
            threads //= 2
        lanes = max(1, min(_LANES, threads))
        bq = max(1, min(threads // lanes, rows))
        while bq > 4 and heads * (-(-rows // bq)) < want:
            bq //= 2
        bk = lanes * _KEYS_PER_LANE
    while shared_bytes(GpuTiles(bq, lanes, bk), pattern.dk, pattern.dv) > shared:
        if bk > lanes:
            bk //= 2
        elif bq > 1:
            bq //= 2
        else:
            break
    return GpuTiles(bq, lanes, bk)


def build_gpu_attention(pattern: AttentionPattern, target,
                        tiles: GpuTiles | None = None) -> tuple[tirx.PrimFunc, list[str]]:
    """The attention as one generated GPU kernel with ``pattern.func``'s signature."""
    p = pattern
    bq, lanes, bk = tiles or gpu_tiles(p, target)
    kpl = -(-bk // lanes)
    itype = str(p.i.ty)
    dk, dv = p.dk, p.dv
    sq, sk = p.sq, p.sk
    regions = [(r, r.slope is None) for r in mask_regions(p)]
    n_qb = tirx.floordiv(sq + (bq - 1), bq)
    n_kt = tirx.floordiv(sk + (bk - 1), bk)
    heads = tirx.const(1, itype)
    for ext in p.batch_extents:
        heads = heads * ext
    blocks = tirx.Cast("int32", heads * n_qb)
    bx_iv = tirx.IterVar(tvm.ir.Range(0, blocks), tirx.Var("blockIdx.x", "int32"),
                         _THREAD_INDEX, "blockIdx.x")
    tx_iv = tirx.IterVar(tvm.ir.Range(0, lanes), tirx.Var("threadIdx.x", "int32"),
                         _THREAD_INDEX, "threadIdx.x")
    ty_iv = tirx.IterVar(tvm.ir.Range(0, bq), tirx.Var("threadIdx.y", "int32"),
                         _THREAD_INDEX, "threadIdx.y")
    bx, tx, ty = bx_iv.var, tx_iv.var, ty_iv.var
    nthreads = bq * lanes
    with IRBuilder() as ib:
        with T.serial(0, 1):  # a frame to build in; the thread launches wrap it below
            task = tirx.Cast(itype, bx)
            qb, batch = split_task(task, n_qb, p.batch_extents)
            row = qb * bq + tirx.Cast(itype, ty)
            tid = ty * lanes + tx
            # flat, rows padded (see padded_stride): the lanes of a row read different keys
            kt = T.alloc_buffer((bk * padded_stride(dk),), F32, scope="shared")
            vt = T.alloc_buffer((bk * padded_stride(dv),), F32, scope="shared")
            mb = T.alloc_buffer((nthreads,), F32, scope="shared")
            lb = T.alloc_buffer((nthreads,), F32, scope="shared")
            cb = T.alloc_buffer((nthreads, lanes), F32, scope="shared")
            q = T.alloc_buffer((dk,), F32, scope="local")
            acc = T.alloc_buffer((dv,), F32, scope="local")
            sc = T.alloc_buffer((kpl,), F32, scope="local")
            st = T.alloc_buffer((4,), F32, scope="local")  # m, l, m_new, correction
            with T.serial(0, dk) as c:
                T.buffer_store(q, tirx.if_then_else(row < sq, value_at(p.query, p, batch, i=row,
                                                                 k=c),
                                                    tirx.const(0.0, F32)), [c])
            with T.serial(0, dv) as c:
                T.buffer_store(acc, tirx.const(0.0, F32), [c])
            T.buffer_store(st, _printed_exactly(p.m_init), [0])
            T.buffer_store(st, tirx.const(0.0, F32), [1])
            def key_tiles(first, last):
                with T.serial(first, last) as kb:
                    j0 = kb * bk
                    _load_tile(p, kt, kt_value=True, batch=batch, j0=j0, tid=tid,
                               nthreads=nthreads, bk=bk, width=dk, itype=itype)
                    _load_tile(p, vt, kt_value=False, batch=batch, j0=j0, tid=tid,
                               nthreads=nthreads, bk=bk, width=dv, itype=itype)
                    T.evaluate(T.tvm_storage_sync("shared"))
                    compute = tirx.LT(row, sq)
                    skip = _row_skip(p, regions, row, j0, bk, st[0], q)
                    if skip is not None:
                        compute = tirx.And(compute, tirx.Not(skip))
                    with T.If(compute):
                        with T.Then():
                            _row_tile(p, q, kt, vt, sc, acc, st, batch, row, j0, tx, lanes,
                                      kpl)
                    T.evaluate(T.tvm_storage_sync("shared"))

            zero = tirx.const(0, itype)
            tail = _causal_tail(p, regions, qb * bq, tirx.min(qb * bq + bq, sq) - 1)
            if tail is None:
                key_tiles(zero, n_kt)
            else:
                # the block's rows see no key from ``start`` on: stop at the diagonal tile,
                # and stream the rest only where the block-wide test says a row needs it
                region, start = tail
                kb_end = tirx.max(zero, tirx.min(n_kt, tirx.floordiv(start + (bk - 1), bk)))
                key_tiles(zero, kb_end)
                need = _tail_needed(p, region, batch, kb_end * bk, q, st, mb, lb, row, tid,
                                    nthreads, itype)
                with T.If(need):
                    with T.Then():
                        key_tiles(kb_end, n_kt)
            _merge_lanes(p, mb, lb, cb, acc, st, batch, row, tx, ty, tid, lanes)
    body = ib.get().body  # the frame's loop of one
    body = tirx.AttrStmt(tx_iv, "thread_extent", tirx.const(lanes, "int32"), body)
    body = tirx.AttrStmt(ty_iv, "thread_extent", tirx.const(bq, "int32"), body)
    body = under_root_block(tirx.AttrStmt(bx_iv, "thread_extent", blocks, body))
    func = p.func
    result = tirx.PrimFunc(list(func.params), body, func.ret_type, func.attrs)
    notes = [f"attention (online softmax, GPU): {bq} query rows per block, {lanes} threads per "
             f"row; {bk} keys per shared tile; {len(regions)} masked-tile test(s)"]
    return result.with_attr("tirx.noalias", True), notes


def _printed_exactly(value):
    """``value``; a float32 constant that TVM 0.27's OpenCL and CUDA source generators would
    print inexactly (``%e``: seven digits) read as its bits from a local buffer instead.

    The running max starts at the lowest finite float, printed ``-3.402823e+38f``: above a
    score masked by that very value (``Where(keep, 0, min)``), so a fully masked row's
    exponentials were all 0 and its output NaN where the unfused operators on CPU and ONNX
    Runtime give uniform weights. (A ``reinterpret`` of the literal prints ``&(-8388609)``,
    which OpenCL rejects; the simplifier would fold a ``Let`` back into the literal.)"""
    if not isinstance(value, tirx.FloatImm) or str(value.ty) != F32:
        return value
    exact = np.float32(value.value)
    if not np.isfinite(exact) or np.float32(f"{float(exact):.6e}") == exact:
        return value
    bits = T.alloc_buffer((1,), "int32", scope="local")
    T.buffer_store(bits, tirx.const(int(exact.view(np.int32)), "int32"), [0])
    return tirx.reinterpret(F32, bits[0])


def _merge_lanes(p, mb, lb, cb, acc, st, batch, row, tx, ty, tid, lanes):
    """The lanes of a row saw disjoint keys: rescale each to the row's maximum, sum their
    sums and, ``lanes`` columns at a time, their accumulators through shared memory; lane
    ``t`` writes the columns ``≡ t`` of the row's output."""
    T.buffer_store(mb, st[0], [tid])
    T.buffer_store(lb, st[1], [tid])
    T.evaluate(T.tvm_storage_sync("shared"))
    base = ty * lanes
    T.buffer_store(st, mb[base], [2])
    with T.serial(1, lanes) as t:
        T.buffer_store(st, tirx.max(st[2], mb[base + t]), [2])
    T.buffer_store(st, tirx.const(0.0, F32), [1])
    with T.serial(0, lanes) as t:
        T.buffer_store(st, st[1] + lb[base + t] * tirx.exp(mb[base + t] - st[2]), [1])
    T.buffer_store(st, tirx.exp(st[0] - st[2]), [3])
    dv = p.dv
    with T.serial(0, -(-dv // lanes)) as ch:
        with T.serial(0, lanes) as w:
            col = ch * lanes + w
            T.buffer_store(cb, tirx.if_then_else(col < dv, acc[tirx.min(col, dv - 1)],
                                                 tirx.const(0.0, F32)) * st[3], [tid, w])
        T.evaluate(T.tvm_storage_sync("shared"))
        total = T.alloc_buffer((1,), F32, scope="local")
        T.buffer_store(total, tirx.const(0.0, F32), [0])
        with T.serial(0, lanes) as t:
            T.buffer_store(total, total[0] + cb[base + t, tx], [0])
        d = ch * lanes + tx
        with T.If(tirx.And(row < p.sq, d < dv)):
            with T.Then():
                o = p.normalise(total[0], st[1])
                index = [value_at(ix, p, batch, i=row, d=d) for ix in p.out_index]
                T.buffer_store(p.out, value_at(p.out_value, p, batch, i=row, d=d, o=o), index)
        T.evaluate(T.tvm_storage_sync("shared"))


def _load_tile(p, buf, kt_value: bool, batch, j0, tid, nthreads, bk, width, itype):
    """Every thread stores a strided share of a ``bk × width`` tile (consecutive threads,
    consecutive elements of a key: coalesced); padding keys zero."""
    total = bk * width
    per_thread = -(-total // nthreads)
    with T.serial(0, per_thread) as e:
        idx = tirx.Cast(itype, e) * nthreads + tirx.Cast(itype, tid)
        c = tirx.floordiv(idx, width)
        w = tirx.floormod(idx, width)
        j = j0 + c
        expr = (value_at(p.key, p, batch, j=j, k=w) if kt_value
                else value_at(p.value, p, batch, j=j, d=w))
        with T.If(idx < total):
            with T.Then():
                T.buffer_store(buf, tirx.if_then_else(j < p.sk, expr, tirx.const(0.0, F32)),
                               [c * padded_stride(width) + w])


def _causal_tail(p, regions, i_lo, i_hi):
    """(region, first key) of an index mask that covers every key from a bound on for the
    rows ``[i_lo, i_hi]`` (a causal mask: the keys after the last row), or None."""
    for region, _ in regions:
        start = masked_from(region.cond, region.polarity, p, i_lo, i_hi)
        if start is not None:
            return region, start
    return None


def _tail_needed(p, region, batch, j_start, q, st, mb, lb, row, tid, nthreads, itype):
    """Block-uniform: does a row of the block need the keys from ``j_start`` on, all in
    ``region``? Not when their value underflows against the row's maximum, ``exp(value - m)
    == 0`` (the CPU template's masked-tile test, once for the whole tail): a constant value,
    or ``slope·s + offset`` with ``|s| ≤ dk·max|q|·max|k|``, q and the tail's keys finite
    (max |k| over the tail read by the block; V is not read). A NaN or infinite key there,
    or scores the mask does not push below the maximum, stream the tail as before."""
    ok = region.offset - st[0] < tirx.const(-UNDERFLOW_MARGIN, F32)
    if region.slope is not None:
        # the tail's max |k| and finiteness, each thread a strided share, merged in shared
        km = T.alloc_buffer((2,), F32, scope="local")
        T.buffer_store(km, tirx.const(0.0, F32), [0])
        T.buffer_store(km, tirx.const(1.0, F32), [1])
        count = tirx.max(tirx.const(0, itype), p.sk - j_start) * p.dk
        with T.serial(tirx.const(0, itype), tirx.floordiv(count + (nthreads - 1), nthreads)) as e:
            idx = e * nthreads + tirx.Cast(itype, tid)
            with T.If(idx < count):
                with T.Then():
                    x = T.alloc_buffer((1,), F32, scope="local")
                    T.buffer_store(x, value_at(p.key, p, batch, j=j_start + tirx.floordiv(
                        idx, p.dk), k=tirx.floormod(idx, p.dk)), [0])
                    T.buffer_store(km, tirx.max(km[0], tirx.abs(x[0])), [0])
                    T.buffer_store(km, tirx.Select(tirx.isfinite(x[0]), km[1],
                                                   tirx.const(0.0, F32)), [1])
        T.evaluate(T.tvm_storage_sync("shared"))
        T.buffer_store(mb, km[0], [tid])
        T.buffer_store(lb, km[1], [tid])
        T.evaluate(T.tvm_storage_sync("shared"))
        with T.serial(0, nthreads) as t:
            T.buffer_store(km, tirx.max(km[0], mb[t]), [0])
            T.buffer_store(km, tirx.min(km[1], lb[t]), [1])
        qs = T.alloc_buffer((2,), F32, scope="local")  # the row's max |q|, all finite
        T.buffer_store(qs, tirx.const(0.0, F32), [0])
        T.buffer_store(qs, tirx.const(1.0, F32), [1])
        with T.serial(0, p.dk) as c:
            T.buffer_store(qs, tirx.max(qs[0], tirx.abs(q[c])), [0])
            T.buffer_store(qs, tirx.Select(tirx.isfinite(q[c]), qs[1], tirx.const(0.0, F32)),
                           [1])
        bound = (tirx.const(float(p.dk) * (1.0 + 2.0 ** -8), F32) * qs[0] * km[0]
                 + tirx.const(1e-30, F32))
        upper = tirx.abs(region.slope) * bound + region.offset
        ok = tirx.And(tirx.And(qs[1] > 0.5, km[1] > 0.5),
                      upper - st[0] < tirx.const(-UNDERFLOW_MARGIN, F32))
    ok = tirx.Or(tirx.GE(row, p.sq), ok)
    T.evaluate(T.tvm_storage_sync("shared"))
    with T.If(tid == 0):
        with T.Then():
            T.buffer_store(lb, tirx.const(0.0, F32), [0])
    T.evaluate(T.tvm_storage_sync("shared"))
    with T.If(tirx.Not(ok)):
        with T.Then():
            T.buffer_store(lb, tirx.const(1.0, F32), [0])  # any row: the same value
    T.evaluate(T.tvm_storage_sync("shared"))
    flag = T.alloc_buffer((1,), F32, scope="local")
    T.buffer_store(flag, lb[0], [0])
    T.evaluate(T.tvm_storage_sync("shared"))  # lb is the merge's again
    return flag[0] > 0.5


def _row_skip(p, regions, row, j0, bk, m_row, q):
    """The per-row masked-tile test (the CPU template's, for one row): only the regions whose
    value does not read the product (Where/Select masks, or a constant offset)."""
    tests = []
    for region, s_free in regions:
        if not s_free:
            continue
        box = box_condition(region.cond, region.polarity, p, row, row, j0,
                             tirx.min(j0 + bk, p.sk) - 1)
        if box is None:
            continue
        tests.append(tirx.And(box, region.offset - m_row < tirx.const(-UNDERFLOW_MARGIN, F32)))
    if not tests:
        return None
    skip = tests[0]
    for t in tests[1:]:
        skip = tirx.Or(skip, t)
    return skip


def _row_tile(p, q, kt, vt, sc, acc, st, batch, row, j0, lane, lanes, kpl):
    """One thread's share of its row on one key tile (keys ``lane``, ``lane + lanes``, …):
    scores, the share's max, rescale, exponentials, P·V."""
    T.buffer_store(st, st[0], [2])
    stride = padded_stride(p.dk)
    # the thread's kpl dot products side by side (independent FMA chains), q[kk] reused
    with T.unroll(0, kpl) as e:
        T.buffer_store(sc, tirx.const(0.0, F32), [e])
    with T.unroll(0, p.dk) as kk:  # q stays in registers
        with T.unroll(0, kpl) as e:
            T.buffer_store(sc, sc[e] + q[kk] * kt[(e * lanes + lane) * stride + kk], [e])
    with T.unroll(0, kpl) as e:
        j = j0 + e * lanes + lane
        with T.If(j < p.sk):
            with T.Then():
                x = value_at(p.score, p, batch, i=row, j=j, s=sc[e])
                T.buffer_store(sc, x, [e])
                T.buffer_store(st, tirx.max(st[2], sc[e]), [2])
            with T.Else():
                T.buffer_store(sc, tirx.const(0.0, F32), [e])
    corr = tirx.exp(st[0] - st[2])
    T.buffer_store(st, st[1] * corr, [1])
    with T.serial(0, p.dv) as d:
        T.buffer_store(acc, acc[d] * corr, [d])
    with T.unroll(0, kpl) as e:
        c = e * lanes + lane
        with T.If(j0 + c < p.sk):
            with T.Then():
                pr = T.alloc_buffer((1,), F32, scope="local")
                T.buffer_store(pr, tirx.exp(sc[e] - st[2]), [0])
                T.buffer_store(st, st[1] + pr[0], [1])
                with T.serial(0, p.dv) as d:
                    T.buffer_store(acc, acc[d] + pr[0] * vt[c * padded_stride(p.dv) + d], [d])
    T.buffer_store(st, st[2], [0])


def try_schedule_attention_gpu(gvar, func: tirx.PrimFunc, target):
    """The GPU hook of ``apply_gpu_schedules``: a fused attention gets the generated kernel;
    anything else (or a template failure, warned) returns None and DLight takes it."""
    try:
        pattern = match_attention(func)
    except NotAttention:
        return None
    except Exception:  # noqa: BLE001 (an analysis TVM cannot do: not ours)
        return None
    try:
        result, notes = build_gpu_attention(pattern, target)
    except Exception as err:  # noqa: BLE001
        warnings.warn(f"tvm_fusion: GPU attention template failed on {gvar.name_hint} "
                      f"({type(err).__name__}: {first_line(err)}); DLight schedules it",
                      ScheduleFailedWarning, stacklevel=2)
        return None
    return restore_symbol(result, func).with_attrs(
        {SCHEDULE_ATTR: notes, ATTENTION_GPU_ATTR: True, "tir.is_scheduled": True})

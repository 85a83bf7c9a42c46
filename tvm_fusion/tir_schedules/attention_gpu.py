"""Fused attention on GPUs (CUDA, OpenCL): the CPU template's structure, one thread per row.

The same pieces as on CPU (:mod:`.attention_match`), generated as one kernel:

* one thread block per (batch…, block of ``bq`` query rows); one thread per query row, holding
  its query (``dk`` values), its accumulator (``dv``), its running maximum and sum in
  registers;
* per tile of ``bk`` keys the block loads K and V into shared memory together (each thread a
  strided share of the elements), then every thread computes its row's scores for the tile
  (the score function applied), the tile maximum, and rescales its sum and accumulator once
  per tile: online softmax, no score matrix anywhere;
* masked tiles are skipped per row with the CPU template's exact test (the score function's
  value on the tile, the row's current maximum, finite inputs);
* ``out = acc / l`` through the head merge's index map.

Sizes come from the target: ``bq`` threads (at most ``max_num_threads``), ``bk`` keys so that
both tiles fit the static shared memory. Sequence lengths may be symbolic (the grid is
computed at launch). Numerics are checked on PoCL (OpenCL on the CPU); CUDA source compiles
to PTX with ``nvcc`` where it is installed.
"""

from __future__ import annotations

import warnings

import tvm
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from .attention import (
    UNDERFLOW_MARGIN,
    box_condition,
    mask_regions,
    split_task,
    under_root_block,
    value_at,
)
from .attention_match import F32, AttentionPattern, NotAttention, match_attention
from .records import SCHEDULE_ATTR, ScheduleFailedWarning, first_line, restore_symbol

ATTENTION_GPU_ATTR = "tvm_fusion.attention"
_SHARED = 48 << 10
_THREAD_INDEX = 1  # IterVar kind of a thread binding

__all__ = ["build_gpu_attention", "gpu_tiles", "try_schedule_attention_gpu"]


def gpu_tiles(pattern: AttentionPattern, target) -> tuple[int, int]:
    """(bq threads/rows per block, bk keys per shared tile) for ``target``."""
    attrs = dict(target.attrs) if target is not None else {}
    threads = int(attrs.get("max_num_threads", 256))
    shared = min(int(attrs.get("max_shared_memory_per_block", _SHARED)), _SHARED)
    bq = max(1, min(64, threads))
    sq = pattern.sq
    if isinstance(sq, tirx.IntImm) and int(sq.value) < bq:
        bq = max(1, int(sq.value))
    per_key = 4 * (pattern.dk + pattern.dv)
    bk = 32
    while bk > 1 and bk * per_key > shared:
        bk //= 2
    return bq, bk


def build_gpu_attention(pattern: AttentionPattern, target,
                        tiles: tuple[int, int] | None = None) -> tuple[tirx.PrimFunc, list[str]]:
    """The attention as one generated GPU kernel with ``pattern.func``'s signature."""
    p = pattern
    bq, bk = tiles or gpu_tiles(p, target)
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
    tx_iv = tirx.IterVar(tvm.ir.Range(0, bq), tirx.Var("threadIdx.x", "int32"),
                         _THREAD_INDEX, "threadIdx.x")
    bx, tx = bx_iv.var, tx_iv.var
    with IRBuilder() as ib:
        with T.serial(0, 1):  # a frame to build in; the thread launches wrap it below
            task = tirx.Cast(itype, bx)
            qb, batch = split_task(task, n_qb, p.batch_extents)
            row = qb * bq + tirx.Cast(itype, tx)
            kt = T.alloc_buffer((bk, dk), F32, scope="shared")
            vt = T.alloc_buffer((bk, dv), F32, scope="shared")
            q = T.alloc_buffer((dk,), F32, scope="local")
            acc = T.alloc_buffer((dv,), F32, scope="local")
            sc = T.alloc_buffer((bk,), F32, scope="local")
            st = T.alloc_buffer((4,), F32, scope="local")  # m, l, m_new, tile sum
            with T.serial(0, dk) as c:
                T.buffer_store(q, tirx.if_then_else(row < sq, value_at(p.query, p, batch, i=row,
                                                                 k=c),
                                                    tirx.const(0.0, F32)), [c])
            with T.serial(0, dv) as c:
                T.buffer_store(acc, tirx.const(0.0, F32), [c])
            T.buffer_store(st, p.m_init, [0])
            T.buffer_store(st, tirx.const(0.0, F32), [1])
            with T.serial(tirx.const(0, itype), n_kt) as kb:
                j0 = kb * bk
                _load_tile(p, kt, kt_value=True, batch=batch, j0=j0, tx=tx, bq=bq, bk=bk,
                           width=dk, itype=itype)
                _load_tile(p, vt, kt_value=False, batch=batch, j0=j0, tx=tx, bq=bq,
                           bk=bk, width=dv, itype=itype)
                T.evaluate(T.tvm_storage_sync("shared"))
                compute = tirx.LT(row, sq)
                skip = _row_skip(p, regions, row, j0, bk, st[0], q)
                if skip is not None:
                    compute = tirx.And(compute, tirx.Not(skip))
                with T.If(compute):
                    with T.Then():
                        _row_tile(p, q, kt, vt, sc, acc, st, batch, row, j0, bk)
                T.evaluate(T.tvm_storage_sync("shared"))
            with T.If(row < sq):
                with T.Then():
                    with T.serial(0, dv) as c:
                        o = acc[c] / st[1]
                        index = [value_at(ix, p, batch, i=row, d=c) for ix in p.out_index]
                        T.buffer_store(p.out, value_at(p.out_value, p, batch, i=row, d=c, o=o),
                                       index)
    body = ib.get().body  # the frame's loop of one
    body = tirx.AttrStmt(tx_iv, "thread_extent", tirx.const(bq, "int32"), body)
    body = under_root_block(tirx.AttrStmt(bx_iv, "thread_extent", blocks, body))
    func = p.func
    result = tirx.PrimFunc(list(func.params), body, func.ret_type, func.attrs)
    notes = [f"attention (online softmax, GPU): {bq} query rows per block, one per thread; "
             f"{bk} keys per shared tile; {len(regions)} masked-tile test(s)"]
    return result.with_attr("tirx.noalias", True), notes


def _load_tile(p, buf, kt_value: bool, batch, j0, tx, bq, bk, width, itype):
    """Every thread stores a strided share of a ``bk × width`` tile; padding keys zero."""
    total = bk * width
    per_thread = -(-total // bq)
    with T.serial(0, per_thread) as e:
        idx = tirx.Cast(itype, e) * bq + tirx.Cast(itype, tx)
        c = tirx.floordiv(idx, width)
        w = tirx.floormod(idx, width)
        j = j0 + c
        expr = (value_at(p.key, p, batch, j=j, k=w) if kt_value
                else value_at(p.value, p, batch, j=j, d=w))
        with T.If(idx < total):
            with T.Then():
                T.buffer_store(buf, tirx.if_then_else(j < p.sk, expr, tirx.const(0.0, F32)),
                               [c, w])


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


def _row_tile(p, q, kt, vt, sc, acc, st, batch, row, j0, bk):
    """One thread's row on one key tile: scores, tile max, rescale, exponentials, P·V."""
    T.buffer_store(st, st[0], [2])
    with T.serial(0, bk) as c:
        j = j0 + c
        dot = T.alloc_buffer((1,), F32, scope="local")
        T.buffer_store(dot, tirx.const(0.0, F32), [0])
        with T.serial(0, p.dk) as kk:
            T.buffer_store(dot, dot[0] + q[kk] * kt[c, kk], [0])
        with T.If(j < p.sk):
            with T.Then():
                x = value_at(p.score, p, batch, i=row, j=j, s=dot[0])
                T.buffer_store(sc, x, [c])
                T.buffer_store(st, tirx.max(st[2], sc[c]), [2])
            with T.Else():
                T.buffer_store(sc, tirx.const(0.0, F32), [c])
    corr = tirx.exp(st[0] - st[2])
    T.buffer_store(st, st[1] * corr, [1])
    with T.serial(0, p.dv) as d:
        T.buffer_store(acc, acc[d] * corr, [d])
    with T.serial(0, bk) as c:
        with T.If(j0 + c < p.sk):
            with T.Then():
                pr = T.alloc_buffer((1,), F32, scope="local")
                T.buffer_store(pr, tirx.exp(sc[c] - st[2]), [0])
                T.buffer_store(st, st[1] + pr[0], [1])
                with T.serial(0, p.dv) as d:
                    T.buffer_store(acc, acc[d] + pr[0] * vt[c, d], [d])
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

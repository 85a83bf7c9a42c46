"""Fused attention: planned from mapping types and TIR, generated as online softmax.

Each model is built the way its exporter writes it (tvm_fusion/models/attention.py) and checked
against ONNX Runtime and stock TVM; symbolic lengths at two sizes from one compiled module;
IEEE edge values (fully masked rows, -inf masks, NaN and inf inputs) against the unfused
operators.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import tvm
from conftest import TARGET

from tvm_fusion.compile import compile_model, fuse, graph_input_names, import_onnx, run
from tvm_fusion.feeds import random_inputs
from tvm_fusion.instrument import Collector
from tvm_fusion.models.attention import attention_model
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.relay_passes.rejection import RejectReason
from tvm_fusion.report import format_report, make_report
from tvm_fusion.tir_schedules.attention import (
    ATTENTION_ATTR,
    choose_tiles,
    mask_regions,
)
from tvm_fusion.tir_schedules.attention_match import (
    NotAttention,
    free_vars,
    match_attention,
    substitute,
)
from tvm_fusion.tir_schedules.cpu_target import CpuParams
from tvm_fusion.tir_schedules.records import SCHEDULE_ATTR, ScheduleFailedWarning
from tvm_fusion.tir_utils import find_all

SMALL = {
    "bert": {},
    "gpt2": {},
    "llama": {},
    "vit": {},
    "swin": {},
}


def _plans(model, **options):
    mod = import_onnx(model)
    collector = Collector()
    with tvm.transform.PassContext(instruments=[collector]):
        fused = fuse(mod, TARGET, **options)
    return list(collector.plans[0].plans.values()), fused


def _attention_funcs(mod):
    return [f for f in mod.functions.values()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and ATTENTION_ATTR in f.attrs]


def _check(model, sizes=(None,), rtol=1e-4, atol=1e-5, **options):
    """One compiled module: vs ONNX Runtime and stock TVM at each size."""
    mod = import_onnx(model)
    ours_ex = compile_model(mod, TARGET, **options)
    stock_ex = compile_model(mod, TARGET, strategy="tvm")
    for size in sizes:
        feeds = random_inputs(model, seed=0, shape_overrides=size)
        inputs = [feeds[n] for n in graph_input_names(model)]
        ours = run(ours_ex, inputs)
        compare(ours, onnx_reference(model, feeds), rtol=rtol, atol=atol)
        compare(ours, run(stock_ex, inputs), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------- planning


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_one_attention_block_per_model(kind):
    """Planned as one block (the plan of the build itself), and the numerics of that build."""
    model = attention_model(kind, **SMALL[kind])
    collector = Collector()
    with tvm.transform.PassContext(instruments=[collector]):
        _check(model)
    (plan,) = list(collector.plans[0].plans.values())
    blocks = [b for b in plan.blocks if b.kind == "attention"]
    assert len(blocks) == 1 and len(plan.attention) == 1 and plan.attention[0].chosen
    cand = plan.attention[0].candidate
    assert {cand.qk, cand.softmax, cand.pv} <= set(blocks[0].members)
    assert cand.score_bytes > 0


def test_gqa_broadcast_and_causal_mask_join_the_block():
    plans, _ = _plans(attention_model("llama", seq="seq"))
    (plan,) = plans
    (block,) = [b for b in plan.blocks if b.kind == "attention"]
    ops = {plan.ecg.nodes[i].op_name for i in block.members}
    # repeat_kv (expand_dims, broadcast_to, reshape) and the triu mask are inside
    assert {"broadcast_to", "expand_dims", "triu", "broadcast_to1"} <= ops
    assert len(plan.blocks) == 1


def test_option_off_keeps_table3():
    plans, fused = _plans(attention_model("bert"), attention=False)
    (plan,) = plans
    assert not plan.attention and all(b.kind == "" for b in plan.blocks)
    assert not _attention_funcs(fused)
    assert len(plan.blocks) >= 3  # QK, softmax, PV apart (M2M -> M2M is red)


def test_scores_read_outside_are_refused():
    model = attention_model("bert")
    probs = next(n for n in model.graph.node if n.op_type == "Softmax").output[0]
    model.graph.output.extend([onnx_value(probs)])
    plans, _ = _plans(model)
    (plan,) = plans
    (decision,) = plan.attention
    assert not decision.chosen and decision.rejected is RejectReason.SCORES_ESCAPE
    assert all(b.kind == "" for b in plan.blocks)


def onnx_value(name):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def test_report_names_the_block_and_its_score_bytes():
    report = make_report(attention_model("gpt2"), "gpt2", target=TARGET, check=False)
    text = format_report(report, why=True)
    assert "[attention]" in text and "scores never written" in text
    (row,) = report.attention
    assert row["chosen"] and row["kernel"] is not None
    # the score matrix (1x4x64x64 floats) is written at least twice unfused
    assert row["score_bytes"] >= 2 * 4 * 64 * 64 * 4
    assert report.to_json()["attention"][0]["score_shape"] == [1, 4, 64, 64]


# -------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("kind", ["llama", "gpt2", pytest.param("bert", marks=pytest.mark.slow)])
def test_symbolic_sequence_two_lengths(kind):
    # 7: less than one register tile of rows; 150: partial query block and key tile
    _check(attention_model(kind, seq="seq"), sizes=({"seq": 7}, {"seq": 150}))


@pytest.mark.slow
def test_llama_where_mask_minus_inf():
    _check(attention_model("llama", seq="seq", mask="where"), sizes=({"seq": 70},))


def test_fp16_accumulates_in_fp32():
    model = attention_model("llama", dtype="float16")
    mod = import_onnx(model)
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[n] for n in graph_input_names(model)]
    ours = run(compile_model(mod, TARGET), inputs)[0].astype(np.float32)
    ref = onnx_reference(model, feeds)[0].astype(np.float32)
    assert np.abs(ours - ref).max() < 2e-3


def test_decode_one_query_against_a_symbolic_cache():
    model = attention_model("llama", seq=1, kv_seq="kv", mask="none")
    _check(model, sizes=({"kv": 5}, {"kv": 300}))


# ------------------------------------------------------------------------ IEEE edge values


def _nan_equal(a, b):
    assert np.array_equal(np.isnan(a), np.isnan(b))
    assert np.array_equal(np.isinf(a), np.isinf(b))
    both = np.isfinite(a) & np.isfinite(b)
    np.testing.assert_allclose(a[both], b[both], rtol=1e-4, atol=1e-5)


def test_fully_masked_rows_and_special_values_match_the_unfused_operators():
    model = attention_model("bert", seq=40, mask_rows=True)
    mod = import_onnx(model)
    ours_ex, stock_ex = compile_model(mod, TARGET), compile_model(mod, TARGET, strategy="tvm")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 40, 64)).astype("float32") for _ in range(3))
    mask = np.zeros((1, 1, 40, 40), "float32")
    mask[0, 0, 3, :] = -np.inf  # a fully masked row: softmax gives NaN
    mask[0, 0, 4, :] = -1e30  # fully masked by a finite value: uniform weights
    mask[0, 0, 5, 10:] = -np.inf
    mask[0, 0, 6, :] = np.finfo(np.float32).min
    q[0, 7, 3] = np.nan  # a NaN query: its row (one head) is NaN
    k[0, 20, 17] = np.nan  # a NaN key: every row of its head
    v[0, 11, 40] = np.inf
    inputs = [q, k, v, mask]
    ours, stock = run(ours_ex, inputs)[0], run(stock_ex, inputs)[0]
    ref = onnx_reference(model, dict(zip("qkv", (q, k, v)), mask=mask))[0]
    _nan_equal(ours, stock)
    _nan_equal(ours, ref)
    assert np.isnan(ours[0, 3]).all() and np.isfinite(ours[0, 4, :16]).all()


@pytest.mark.parametrize("mask,case", [
    ("triu", "nan_key"),
    pytest.param("triu", "inf_key", marks=pytest.mark.slow),
    pytest.param("where", "nan_key", marks=pytest.mark.slow),
    pytest.param("where", "inf_key", marks=pytest.mark.slow),
])
def test_skipped_tiles_keep_nan_and_inf(mask, case):
    """A non-finite key in a masked (skippable) tile poisons the rows the unfused operators
    poison: ``s + min`` is NaN for ``s = NaN``; ``Where`` drops it."""
    model = attention_model("llama", seq="seq", mask=mask)
    mod = import_onnx(model)
    ours_ex, stock_ex = compile_model(mod, TARGET), compile_model(mod, TARGET, strategy="tvm")
    rng = np.random.default_rng(1)
    n = 200
    q = rng.standard_normal((1, n, 128)).astype("float32")
    k = rng.standard_normal((1, n, 32)).astype("float32")
    v = rng.standard_normal((1, n, 32)).astype("float32")
    k[0, 150, 3] = np.nan if case == "nan_key" else np.inf
    ours, stock = run(ours_ex, [q, k, v])[0], run(stock_ex, [q, k, v])[0]
    _nan_equal(ours, stock)


# ----------------------------------------------------------------------- template pieces


def _fused_attention(model, **options):
    return _attention_funcs(fuse(import_onnx(model), TARGET, attention=True, **options))


def test_no_buffer_grows_with_the_square_of_the_sequence():
    """One generated kernel; its buffers are per-task tiles of constant size and the packed
    K and V of one head (linear in the length): none grows with the length's square."""
    (func,) = _fused_attention(attention_model("llama", seq="seq"))
    allocs = find_all(func.body, tvm.tirx.AllocBuffer)
    assert allocs
    (seq,) = {v for a in allocs for d in a.buffer.ty.shape
              for v in find_all(d, tvm.ir.Var)} or {None}

    def numel(n):
        total = 1
        for d in alloc.buffer.ty.shape:
            value = d if isinstance(d, tvm.tirx.IntImm) else tvm.sym.Analyzer().simplify(
                substitute(d, {seq: tvm.tirx.const(n, "int64")}))
            total *= int(value)
        return total

    for alloc in allocs:
        assert numel(4096) <= 2.1 * numel(2048), alloc.buffer.ty.shape


def test_packed_keys_are_tile_major():
    """The packed K holds one key tile as a contiguous dk x bk block (Kt[kb, k, j]): rows of
    the whole key length put a tile's dk rows 4·seq bytes apart, in the same few L1 sets."""
    (func,) = _fused_attention(attention_model("llama", seq="seq"))
    notes = " ".join(str(n) for n in func.attrs[SCHEDULE_ATTR])
    bk = int(re.search(r"x (\d+) keys per tile", notes).group(1))
    shapes = [list(a.buffer.ty.shape) for a in find_all(func.body, tvm.tirx.AllocBuffer)]
    tile_major = [s for s in shapes if len(s) == 3 and not isinstance(s[0], tvm.tirx.IntImm)
                  and int(s[2]) == bk]
    keys_innermost = [s for s in shapes if not isinstance(s[-1], tvm.tirx.IntImm)]
    assert len(tile_major) == 1 and not keys_innermost, shapes


def test_causal_masks_are_found_and_additive_masks_are_not():
    def regions(model):
        mod = fuse(import_onnx(model), TARGET, attention=True, schedule=False)
        funcs = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
        patterns = []
        for f in funcs:
            try:
                patterns.append(match_attention(f))
            except NotAttention:
                continue
        (pattern,) = patterns
        return mask_regions(pattern)

    assert regions(attention_model("llama", seq="seq"))  # triu of min: causal
    assert regions(attention_model("gpt2", seq="seq"))  # Where(Trilu(ones), s, c)
    assert not regions(attention_model("bert"))  # a mask input: data


def test_tiles_follow_the_target():
    model = attention_model("llama", seq="seq", head_dim=64)
    mod = fuse(import_onnx(model), TARGET, schedule=False)
    (pattern,) = [match_attention(f) for f in mod.functions.values()
                  if isinstance(f, tvm.tirx.PrimFunc)]
    avx2 = choose_tiles(pattern, CpuParams(8, 12, 2, l1d_bytes=32 << 10, l2_bytes=512 << 10))
    avx512 = choose_tiles(pattern, CpuParams(16, 24, 2, l1d_bytes=48 << 10, l2_bytes=1 << 20))
    neon = choose_tiles(pattern, CpuParams(4, 24, 4, l1d_bytes=64 << 10, l2_bytes=512 << 10))
    assert (avx2.mr, avx2.nr) == (6, 16) and (avx512.mr, avx512.nr) == (12, 32)
    assert (neon.mr, neon.nr) == (12, 8)
    for tiles, params in ((avx2, (32 << 10, 512 << 10)), (avx512, (48 << 10, 1 << 20))):
        # a packed K tile fits half of L1; the task's working set half of L2
        assert tiles.bk * 64 * 4 <= params[0] // 2
        assert tiles.bq % tiles.mr == 0 and tiles.bk % tiles.nr == 0
    decode = choose_tiles(pattern, CpuParams(8, 12, 2), rows_hint=1)
    assert decode.mr == 1 and decode.bq == 1


@pytest.mark.parametrize("cpu", [CpuParams(16, 24, 2, l1d_bytes=32 << 10, l2_bytes=1 << 20),
                                 CpuParams(8, 12, 2, l1d_bytes=32 << 10, l2_bytes=512 << 10)],
                         ids=["avx512", "avx2"])
def test_key_tile_follows_a_short_static_key_length(cpu):
    """Swin's 7x7 windows: 49 keys. The key tile is the keys rounded up to the Q.K^T register
    tile (64), not the L1-sized 128 it was, which computed Q.K^T and P.V 2.6 times over; the
    P.V loop runs over the tile's 49 keys. Before: 128 keys per tile on AVX-512, P.V over 64
    on AVX2 (whose tile was 64 already)."""
    from tvm_fusion.tir_schedules.attention import build_cpu_attention
    from tvm_fusion.tir_schedules.work import executed_work

    mod = fuse(import_onnx(attention_model("swin", head_dim=32)), TARGET, schedule=False)
    (pattern,) = [match_attention(f) for f in mod.functions.values()
                  if isinstance(f, tvm.tirx.PrimFunc)]
    assert int(pattern.sk) == 49
    free = choose_tiles(pattern, cpu, rows_hint=49)
    tiles = choose_tiles(pattern, cpu, rows_hint=49, keys_hint=49)
    assert free.bk == 4 * free.nr and tiles.bk == 64 and tiles.nr == 2 * cpu.lanes
    assert (tiles.bq, tiles.mr, tiles.nv) == (free.bq, free.mr, free.nv)
    assert choose_tiles(pattern, cpu, keys_hint=300).bk == free.bk  # long: L1's tile
    fused, notes = build_cpu_attention(pattern, cpu)
    assert "x 64 keys per tile" in notes[0]
    # the P.V loop runs over the tile's keys, min(64, 49 - j0), not over its 64
    pv = [f for f in find_all(fused.body, tvm.tirx.For)
          if isinstance(f.extent, tvm.tirx.Min) and int(f.min) == 0
          and any([int(d) for d in x.source.shape] == [64, 32]
                  for x in find_all(f.body, tvm.ir.expr.TensorLoad))]
    assert len(pv) == 1
    # AVX-512's free tile is 128 keys: Q.K^T over 64 instead, P.V over 49 (about 2.6x less)
    before, _ = build_cpu_attention(pattern, cpu, free)
    if free.bk == 128:
        assert executed_work(fused).ops < 0.6 * executed_work(before).ops


# ---------------------------------------------------------------------------------- GPU

OPENCL = tvm.target.Target({"kind": "opencl"}, host="llvm")


def _gpu_module(model, target):
    from tvm_fusion import pipeline
    from tvm_fusion.transform import Sequential

    with target:
        return pipeline.build(target, Sequential(target), lower=False)(import_onnx(model))


@pytest.mark.parametrize("kind,options", [("llama", {}), ("swin", {}),
                                          ("gpt2", {}),
                                          # enough rows for one thread per row (tail of 4)
                                          pytest.param("gpt2", {"seq": 260, "heads": 32},
                                                       marks=pytest.mark.slow),
                                          # ViT's shape: 197 rows, several rows per block
                                          ("bert", {"seq": 197, "heads": 12, "head_dim": 64}),
                                          pytest.param("llama", {"dtype": "float16"},
                                                       marks=pytest.mark.slow)])
def test_gpu_kernel_on_pocl(kind, options):
    from tvm_fusion.layout import opencl_runner

    ok, why = opencl_runner.available()
    if not ok:
        pytest.skip(why)
    model = attention_model(kind, **options)
    mod = _gpu_module(model, OPENCL)
    funcs = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert [f for f in funcs if f.attrs and ATTENTION_ATTR in f.attrs]  # not DLight's
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[n] for n in graph_input_names(model)]
    ours = opencl_runner.OpenCLRunner().run_module(mod, inputs, OPENCL)
    ref = onnx_reference(model, feeds)
    tol = 2e-3 if options.get("dtype") == "float16" else 1e-5
    np.testing.assert_allclose(ours[0].astype(np.float32), ref[0].astype(np.float32),
                               rtol=tol, atol=tol)


def test_gpu_decode_on_pocl():
    """The decode step (one query row, a symbolic cache) on the GPU template, at two cache
    lengths from one module."""
    from tvm_fusion.layout import opencl_runner

    ok, why = opencl_runner.available()
    if not ok:
        pytest.skip(why)
    model = attention_model("llama", seq=1, kv_seq="kv", mask="none")
    mod = _gpu_module(model, OPENCL)
    assert [f for f in mod.functions.values()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and ATTENTION_ATTR in f.attrs]
    for kv in (7, 300):
        feeds = random_inputs(model, seed=0, shape_overrides={"kv": kv})
        ours = opencl_runner.OpenCLRunner().run_module(
            mod, [feeds[n] for n in graph_input_names(model)], OPENCL)
        np.testing.assert_allclose(ours[0], onnx_reference(model, feeds)[0], rtol=1e-5,
                                   atol=1e-5)


def test_gpu_blocks_follow_the_target():
    """One thread per row where that fills the SMs (a symbolic length); else several threads
    per row, rows per block halved until every SM gets two blocks (ViT-B/16's 12 heads × 197
    rows on an H100's 132); shared memory fits."""
    from tvm_fusion.tir_schedules.attention_gpu import gpu_tiles, shared_bytes

    def tiles(model, target):
        mod = fuse(import_onnx(model), target, schedule=False)
        (pattern,) = [match_attention(f) for f in mod.functions.values()
                      if isinstance(f, tvm.tirx.PrimFunc)]
        return pattern, gpu_tiles(pattern, target)

    h100 = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    pattern, vit = tiles(attention_model("bert", seq=197, heads=12, head_dim=64), h100)
    assert vit.lanes > 1 and 12 * -(-197 // vit.bq) >= 2 * 132
    assert shared_bytes(vit, 64, 64) <= 48 << 10
    _, llama = tiles(attention_model("llama", seq="seq", head_dim=64), h100)
    assert (llama.lanes, llama.bq) == (1, 64)  # symbolic length: one thread per row
    assert shared_bytes(llama, 64, 64) <= 48 << 10
    small = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_num_threads": 64,
                               "max_shared_memory_per_block": 16 << 10}, host="llvm")
    _, little = tiles(attention_model("llama", seq="seq", head_dim=64), small)
    assert little.bq * little.lanes <= 64 and shared_bytes(little, 64, 64) <= 16 << 10


@pytest.mark.parametrize("options", [{"seq": "seq"},  # causal: the bounded tile loop
                                     {"seq": 1, "kv_seq": "kv", "mask": "none"}])  # decode
def test_cuda_kernel_compiles_to_ptx(options):
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    import tvm.support.nvcc as nvcc

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
    ex = compile_model(import_onnx(attention_model("llama", **options)), target)

    def walk(module):
        yield module
        for imported in module.imports:
            yield from walk(imported)

    source = "\n".join(m.inspect_source() for m in walk(ex.mod) if m.kind == "cuda")
    assert "__shared__" in source
    with target:
        ptx = nvcc.compile_cuda(source, target_format="ptx", compiler="nvcc")
    assert b".target sm_80" in bytes(ptx)


def test_rope_is_folded_into_the_attention_prologue():
    """RoPE on Q and K (Slice, Neg, Concat, Mul, Add per head) joins the block: the layer's
    attention, rotary embeddings included, is one kernel."""
    model = attention_model("llama", seq="seq", rope=True)
    collector = Collector()
    with tvm.transform.PassContext(instruments=[collector]):
        _check(model, sizes=({"seq": 70},))
    (plan,) = list(collector.plans[0].plans.values())
    assert len(plan.blocks) == 1 and plan.blocks[0].kind == "attention"
    ops = {plan.ecg.nodes[i].op_name for i in plan.blocks[0].members}
    assert any("concat" in op for op in ops)  # rotate_half


@pytest.mark.parametrize("seq", ["seq", 70])
def test_rope_attention_keeps_its_template(seq):
    """The template's loops count in int32 where the kernel's indices are int64; RoPE's
    rotate-half does arithmetic on the head-dim index, so the substituted loop counter must
    take the index's dtype, or TIR's lowering fails (``mismatched types``) and the kernel
    falls back to the per-operator rules (a symbolic Llama ran 5x slower)."""
    model = attention_model("llama", seq=seq, rope=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScheduleFailedWarning)
        fused = fuse(import_onnx(model), TARGET)
    (func,) = _attention_funcs(fused)
    assert "attention (online softmax)" in str(func.attrs[SCHEDULE_ATTR][0])


# ------------------------------------------------------------------- decode and causal tails


def test_decode_step_is_one_block_with_the_decode_kernel():
    """One query row against a symbolic cache: planned as one attention block (the query
    axis of extent 1 is folded out of the loads), generated by the decode kernel (K and V read
    in place, no packing)."""
    model = attention_model("llama", seq=1, kv_seq="kv", mask="none")
    plans, fused = _plans(model)
    (plan,) = plans
    assert [b.kind for b in plan.blocks] == ["attention"]
    (func,) = _attention_funcs(fused)
    assert "decode" in str(func.attrs[SCHEDULE_ATTR][0])


def test_decode_odd_head_size_and_partial_key_groups():
    """A head size that is not a multiple of the SIMD width (20 = 16 vectorised + 4 scalar)
    and caches whose tiles end inside a group of keys computed side by side."""
    model = attention_model("llama", seq=1, kv_seq="kv", mask="none", head_dim=20)
    _check(model, sizes=({"kv": 1}, {"kv": 6}, {"kv": 301}))


def test_decode_key_ranges_are_combined():
    """Few heads for the cores: each head's keys are split into ranges whose partial softmax
    results are combined (flash decoding); one module at two cache lengths."""
    from tvm_fusion.tir_schedules.attention import decode_splits

    model = attention_model("llama", seq=1, kv_seq="kv", mask="none", heads=2, kv_heads=1)
    many = {"kind": "llvm", "num-cores": 4}
    (func,) = _attention_funcs(fuse(import_onnx(model), many))
    assert "combined" in str(func.attrs[SCHEDULE_ATTR][0])
    (pattern,) = [match_attention(f) for f in fuse(import_onnx(model), many, schedule=False)
                  .functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert decode_splits(pattern, 4) == 8  # 2 heads, 4 tasks per core
    ex = compile_model(import_onnx(model), many)
    for kv in (3, 300):  # fewer tiles than ranges, then several tiles per range
        feeds = random_inputs(model, seed=0, shape_overrides={"kv": kv})
        got = run(ex, [feeds[n] for n in graph_input_names(model)])
        compare(got, onnx_reference(model, feeds), rtol=1e-4, atol=1e-5)


def test_masked_from_agrees_with_the_tile_test():
    """The first key of a region covering every later key (the GPU's loop bound) agrees with
    the per-tile box test, for causal masks with an offset, both polarities."""
    from tvm_fusion.tir_schedules.attention import box_condition, masked_from

    model = attention_model("llama", seq="seq", mask="none")
    mod = fuse(import_onnx(model), TARGET, schedule=False)
    (pattern,) = [match_attention(f) for f in mod.functions.values()
                  if isinstance(f, tvm.tirx.PrimFunc)]
    i, j = pattern.i, pattern.j
    ana = tvm.sym.Analyzer()
    conds = [(j > i, True), (j > i + 2, True), (j >= i - 1, True), (j <= i, False),
             (i < j - 3, True), (j < i, True), (j - i <= 1, False)]
    for cond, polarity in conds:
        for lo, hi in ((0, 0), (5, 9), (64, 127)):
            start = masked_from(cond, polarity, pattern, tvm.tirx.const(lo, "int64"),
                                tvm.tirx.const(hi, "int64"))
            if cond.__class__ is tvm.tirx.LT and cond.a.same_as(j) and polarity:
                assert start is None  # j < i: keys below the diagonal, not a tail
                continue
            first = int(ana.simplify(start))
            for j0 in range(max(first - 3, 0), first + 3):
                whole = ana.simplify(box_condition(cond, polarity, pattern, lo, hi, j0,
                                                   j0 + 40))
                assert bool(whole) == (j0 >= first), (cond, polarity, lo, hi, j0)


def _key_tile_loops(func):
    """The GPU kernel's loops over key tiles: the loops whose extent reads blockIdx.x."""
    return [loop for loop in find_all(func.body, tvm.tirx.For)
            if any(v.name == "blockIdx.x" for v in free_vars(loop.extent))]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_gpu_causal_block_stops_at_its_diagonal(kind):
    """A causal block's first K/V tile loop ends at the tile holding its last row's diagonal
    (additive ``triu`` mask and ``Where`` alike); the tail is streamed only if the block-wide
    test needs it (a second loop under a condition)."""
    from tvm_fusion.tir_schedules.attention_gpu import build_gpu_attention, gpu_tiles

    h100 = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    mod = fuse(import_onnx(attention_model(kind, seq="seq", head_dim=64)), h100,
               schedule=False)
    (pattern,) = [match_attention(f) for f in mod.functions.values()
                  if isinstance(f, tvm.tirx.PrimFunc)]
    tiles = gpu_tiles(pattern, h100)
    func, _ = build_gpu_attention(pattern, h100, tiles)
    first = _key_tile_loops(func)[0]
    seq = next(v for v in free_vars(first.extent) if v.name == "seq")
    bx = next(v for v in free_vars(first.extent) if v.name == "blockIdx.x")
    ana = tvm.sym.Analyzer()
    for n in (1, 64, 200, 2048):
        blocks = -(-n // tiles.bq)
        counted = 0
        for b in range(blocks):
            ext = ana.simplify(substitute(first.extent, {seq: tvm.tirx.const(n, "int64"),
                                                         bx: tvm.tirx.const(b, "int32")}))
            last_row = min((b + 1) * tiles.bq, n) - 1
            assert int(ext) == last_row // tiles.bk + 1  # up to the diagonal's tile
            counted += int(ext)
        full = blocks * -(-n // tiles.bk)
        assert n < 1024 or counted < 0.55 * full  # about half of all tiles


@pytest.mark.parametrize("kind,case", [pytest.param("llama", None, marks=pytest.mark.slow),
                                       ("gpt2", None), ("llama", "nan_key"), ("gpt2", "nan_key")])
def test_gpu_causal_tail_on_pocl(kind, case):
    """The causal tail bound on PoCL, symbolic length at two sizes from one module; a NaN key
    in the masked tail poisons every row through ``s + min`` (the tail is then streamed, as
    unfused) and nothing through ``Where``."""
    from tvm_fusion.layout import opencl_runner

    ok, why = opencl_runner.available()
    if not ok:
        pytest.skip(why)
    model = attention_model(kind, seq="seq", heads=2, head_dim=16, **(
        {"kv_heads": 1} if kind == "llama" else {}))
    mod = _gpu_module(model, OPENCL)
    assert [f for f in mod.functions.values()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and ATTENTION_ATTR in f.attrs]
    for n in ((150,) if case else (7, 150)):
        feeds = random_inputs(model, seed=0, shape_overrides={"seq": n})
        names = graph_input_names(model)
        if case == "nan_key":
            key = feeds[names[1]] if kind == "llama" else feeds[names[0]]
            col = 0 if kind == "llama" else 2 * 16  # K's first column (gpt2: after Q)
            key[0, n - 10, col] = np.nan
        inputs = [feeds[n_] for n_ in names]
        ours = opencl_runner.OpenCLRunner().run_module(mod, inputs, OPENCL)
        ref = onnx_reference(model, feeds)
        _nan_equal(ours[0], ref[0])


def _torchscript_masked_attention(heads=2, head_dim=8):
    """A causal attention with a padding mask read at ``arange(L)``, exported with a symbolic
    sequence by the TorchScript exporter (``dynamo=False``), as transformers' GPT-2 and Llama
    are: the mask's Gather normalises its index against the mask's length, a scalar ``take``
    of a shape value that TOPI stores at no iterator (``T[()]`` under a unit ``vi``)."""
    torch = pytest.importorskip("torch")
    import io

    import onnx

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(heads * head_dim, 3 * heads * head_dim)

        def forward(self, x, mask):
            b, length, _ = x.shape
            q, k, v = (t.view(b, length, heads, head_dim).transpose(1, 2)
                       for t in self.qkv(x).split(heads * head_dim, dim=-1))
            idx = torch.arange(length)
            keep = (idx[None, :] <= idx[:, None]) & mask[0][idx].bool()[None, :]
            bias = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
            p = torch.softmax(q @ k.transpose(-1, -2) * head_dim ** -0.5 + bias, -1)
            return (p @ v).transpose(1, 2).reshape(b, length, heads * head_dim)

    torch.manual_seed(0)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = (torch.randn(1, 5, heads * head_dim), torch.ones(1, 5, dtype=torch.int64))
        torch.onnx.export(Attention().eval(), args, buf, dynamo=False,
                          input_names=["x", "mask"], output_names=["y"],
                          dynamic_axes={"x": {1: "seq"}, "mask": {1: "seq"}})
    return onnx.load_from_string(buf.getvalue())


def test_torchscript_symbolic_mask_is_one_attention_block():
    model = _torchscript_masked_attention()
    plans, _ = _plans(model)
    (plan,) = plans
    assert [d.chosen for d in plan.attention] == [True], [d.reason for d in plan.attention]
    assert len([b for b in plan.blocks if b.kind == "attention"]) == 1
    _check(model, sizes=({"seq": 7}, {"seq": 150}))

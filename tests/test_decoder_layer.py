"""A Llama-style decoder layer with symbolic lengths (issue 21), and a causal mask computed
from indices once for several attentions (issue 24).

The layer (``llama_decoder_layer``: RMSNorm, GQA attention with RoPE and a causal mask,
SwiGLU) is compiled once and run at two lengths against ONNX Runtime: the prefill export at
two sequence lengths, the decode export (one query, a key/value cache of symbolic length) at
two cache lengths. ``scripts/bench_decoder.py`` times the Llama-size layer.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tvm
from conftest import TARGET
from tvm import relax, te, topi

from tvm_fusion.compile import compile_model, fuse, graph_input_names, import_onnx, run
from tvm_fusion.feeds import random_inputs
from tvm_fusion.models.attention import llama_decoder_layer
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.relay_passes.compound_extents import BindCompoundExtents
from tvm_fusion.relay_passes.index_masks import RecomputeIndexMasks, is_index_computation
from tvm_fusion.symbolic import takes_sizes
from tvm_fusion.tir_schedules.attention import ATTENTION_ATTR
from tvm_fusion.tir_schedules.records import SCHEDULE_ATTR, ScheduleFailedWarning

TINY = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 96}


def _one_module(model, sizes):
    executable = compile_model(import_onnx(model), TARGET)
    for size in sizes:
        feeds = random_inputs(model, seed=0, shape_overrides=size)
        got = run(executable, [feeds[n] for n in graph_input_names(model)])
        assert [g.shape for g in got] == [r.shape for r in onnx_reference(model, feeds)]
        compare(got, onnx_reference(model, feeds), rtol=1e-4, atol=1e-5)


def _attention_schedules(model) -> list[str]:
    fused = fuse(import_onnx(model), TARGET)
    return [str(f.attrs[SCHEDULE_ATTR][0]) for f in fused.functions.values()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and ATTENTION_ATTR in f.attrs]


def test_prefill_two_lengths_one_module():
    _one_module(llama_decoder_layer(seq="seq", **TINY), ({"seq": 7}, {"seq": 150}))


def test_decode_step_two_cache_lengths_one_module():
    """One query against the cache: outputs ``y`` and the cache with the new token. Every
    kernel keeps its schedule: the ``past + 1`` keys after the concat no longer make the
    fused Q/K/V projection fall back to plain loops (BindCompoundExtents)."""
    model = llama_decoder_layer(seq=1, past="past", **TINY)
    assert [o.name for o in model.graph.output] == ["y", "present_k", "present_v"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScheduleFailedWarning)
        _one_module(model, ({"past": 5}, {"past": 300}))


def test_shared_range_mask_skips_tiles_in_every_layer():
    """The dynamo exporter's causal mask (Range, LessOrEqual, Where) is computed once and
    added by both layers: each layer's attention gets its own copy, takes it in, and reads it
    as ``j <= i``, with a masked-tile test (before, the shared mask was data: none)."""
    model = llama_decoder_layer(seq="seq", layers=2, mask="range", **TINY)
    assert sum(n.op_type == "Where" for n in model.graph.node) == 1  # one mask, two readers
    schedules = _attention_schedules(model)
    assert schedules and all("masked-tile test" in s and "0 masked-tile" not in s
                             for s in schedules)


@pytest.mark.slow
def test_shared_range_mask_two_lengths_one_module():
    _one_module(llama_decoder_layer(seq="seq", layers=2, mask="range", **TINY),
                ({"seq": 7}, {"seq": 150}))


# ------------------------------------------------------------------- RecomputeIndexMasks


def _prim(te_func, *shapes):
    args = [te.placeholder(s, "float32", name=f"a{i}") for i, s in enumerate(shapes)]
    return te.create_prim_func(args + [te_func(*args)])


def test_index_computation_is_spatial_and_float_free():
    n = te.var("n", "int64")
    pos = te.compute((n, n), lambda i, j: j <= i, name="keep")
    mask = te.compute((n, n), lambda i, j: tvm.tirx.Select(
        pos[i, j], tvm.tirx.const(0.0, "float32"), tvm.tirx.const(-1e9, "float32")),
        name="mask")
    assert is_index_computation(te.create_prim_func([mask]))
    assert not is_index_computation(_prim(topi.cos, (4, 8)))  # float math: RoPE's tables
    assert not is_index_computation(_prim(lambda a: topi.sum(a, axis=1), (4, 8)))


def _shared_mask_module():
    """``mask = where(j <= i, 0, min)`` from ``arange(n)``, added to two score tensors."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, n), "float32"))
    y = relax.Var("y", relax.TensorType((n, n), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            pos = bb.emit(relax.op.arange(n, dtype="int64"))
            keep = bb.emit(relax.op.less_equal(relax.op.expand_dims(pos, 0),
                                               relax.op.expand_dims(pos, 1)))
            mask = bb.emit(relax.op.where(keep, relax.const(0.0, "float32"),
                                          relax.const(-3.4e38, "float32")))
            a = bb.emit(relax.op.add(x, mask))
            b = bb.emit(relax.op.add(y, mask))
            out = bb.emit_output(relax.op.multiply(a, b))
        bb.emit_func_output(out)
    return relax.transform.LegalizeOps()(bb.get())


def _readers_of_masks(mod):
    """For each binding that is not an index computation, the index-computed vars it reads."""
    bindings = mod["main"].body.blocks[0].bindings
    index = {b.var for b in bindings
             if is_index_computation(mod[b.value.args[0]])} if bindings else set()
    return {b.var.name: [v for v in relax.analysis.free_vars(b.value) if v in index]
            for b in bindings if b.var not in index}


def test_recompute_index_masks_gives_each_reader_its_copy():
    before = _shared_mask_module()
    after = RecomputeIndexMasks()(before)
    shared = _readers_of_masks(before)
    copies = _readers_of_masks(after)
    # before: both adds read the one mask; after: each reads its own
    adds = [name for name, masks in shared.items() if masks]
    assert len(adds) == 2 and shared[adds[0]][0].same_as(shared[adds[1]][0])
    first, second = (copies[name] for name in adds)
    assert len(first) == len(second) == 1 and not first[0].same_as(second[0])
    # and the module computes the same
    n = 9
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((n, n)).astype("float32") for _ in range(2)]
    results = []
    for mod in (before, after):
        vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
        results.append(vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy())
    np.testing.assert_array_equal(results[0], results[1])


# ------------------------------------------------------------------- BindCompoundExtents


def _cache_module():
    """``concat(past_k, k)`` (``past + 1`` keys), then two operators on the result."""
    past = tvm.tirx.Var("past", "int64")
    bb = relax.BlockBuilder()
    cache = relax.Var("cache", relax.TensorType((2, past, 8), "float32"))
    new = relax.Var("new", relax.TensorType((2, 1, 8), "float32"))
    with bb.function("main", [cache, new]):
        with bb.dataflow():
            keys = bb.emit(relax.op.concat([cache, new], axis=1))
            doubled = bb.emit(relax.op.add(keys, keys))
            total = bb.emit(relax.op.sum(relax.op.exp(doubled), axis=1))
            out = bb.emit_output(relax.Tuple([total, keys]))
        bb.emit_func_output(out)
    return bb.get()


def _calls_with_sizes(mod) -> int:
    """``call_tir``s that take symbolic sizes as arguments (never fused)."""
    return sum(takes_sizes(b.value) for b in mod["main"].body.blocks[0].bindings
               if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir")


def test_compound_extents_get_a_variable_and_no_size_arguments():
    before = _cache_module()
    after = BindCompoundExtents()(before)
    legalize = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                         relax.transform.CanonicalizeBindings()])
    assert _calls_with_sizes(legalize(before)) == 3  # add, exp, sum over past + 1
    assert _calls_with_sizes(legalize(after)) == 0
    # the outputs keep their shapes (the function's return type), and the values
    assert str(after["main"].ret_ty) == str(before["main"].ret_ty)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(s).astype("float32") for s in ((2, 5, 8), (2, 1, 8))]
    results = []
    for mod in (before, after):
        vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
        got = vm["main"](*[tvm.runtime.tensor(a) for a in inputs])
        results.append([g.numpy() for g in got])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)

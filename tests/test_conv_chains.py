"""OptiFX conv→conv fusion: candidates, cost model, search, the overlapped-tile template."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tvm
from conftest import TARGET
from tvm import s_tir

from tvm_fusion.compile import compile_model, fuse, graph_input_names, import_onnx, run
from tvm_fusion.feeds import random_inputs
from tvm_fusion.models.conv_chains import chain_model, miso_model, simo_model
from tvm_fusion.numerics import compare
from tvm_fusion.relay_passes import optifx as cc
from tvm_fusion.relay_passes.rejection import RejectReason
from tvm_fusion.tir_schedules.optifx import CHAIN_ATTR, choose_band, choose_tile, halo_extent
from tvm_fusion.tir_utils import find_all

# the chain in one kernel through Table 3 alone; NCHW convs (the templates' layout)
FORCE = {"table3": {("M2M", "M2M"): "green"}, "conv_chains": "off", "conv_layout": "NCHW"}

DW_PW = [("conv", -1, 3, 1, 1, -1, "relu6"), ("conv", 24, 1, 1, 0, 1, None)]
CASES = {
    "3x3-3x3": (8, 12, [("conv", 8, 3, 1, 1, 1, "relu"), ("conv", 8, 3, 1, 1, 1, "relu")]),
    "3x3-1x1": (8, 12, [("conv", 16, 3, 1, 1, 1, "relu"), ("conv", 8, 1, 1, 0, 1, None)]),
    "dw-pw": (16, 14, DW_PW),
    "conv-maxpool": (8, 12, [("conv", 8, 3, 1, 1, 1, None), ("maxpool", 3, 2, 1)]),
    "strided-second": (8, 12, [("conv", 8, 1, 1, 0, 1, "relu"), ("conv", 8, 3, 2, 1, 1, None)]),
    "tile-not-dividing": (8, 13, [("conv", 8, 3, 1, 1, 1, "relu"), ("conv", 8, 1, 1, 0, 1, None)]),
}


def _numerics(model, **options):
    """The chain fused into one kernel vs the unfused build (two kernels), exact to 1e-5."""
    mod = import_onnx(model)
    feeds = random_inputs(model, seed=1)
    inputs = [feeds[n] for n in graph_input_names(model)]
    fused = run(compile_model(mod, TARGET, **options), inputs)
    plain = run(compile_model(mod, TARGET, conv_chains="off"), inputs)
    compare(fused, plain, rtol=1e-5, atol=1e-5)
    return fuse(mod, TARGET, **options)


def _chain_funcs(mod):
    return [(g.name_hint, f) for g, f in mod.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and CHAIN_ATTR in f.attrs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_chain_numerics_and_template(case):
    channels, size, ops = CASES[case]
    mod = _numerics(chain_model(channels, size, ops), **FORCE)
    funcs = _chain_funcs(mod)
    assert len(funcs) == 1, f"{case}: the conv-chain template did not schedule the chain"


@pytest.mark.parametrize("case", ["dw-pw", "3x3-1x1", "tile-not-dividing"])
def test_pointwise_tail_runs_in_row_bands(case):
    """A chain ending in a 1×1 stride-1 conv needs no halo: it is scheduled in bands of whole
    rows (the 1×1 conv's inner loop is the separate kernel's), numerics as unfused."""
    channels, size, ops = CASES[case]
    (_, func), = _chain_funcs(_numerics(chain_model(channels, size, ops), **FORCE))
    assert "bands of" in func.attrs["tvm_fusion.schedule"][0]


def test_pointwise_tail_without_epilogue_between():
    ops = [("conv", -1, 3, 1, 1, -1, None), ("conv", 8, 1, 1, 0, 1, "relu")]
    (_, func), = _chain_funcs(_numerics(chain_model(16, 14, ops), **FORCE))
    assert "bands of" in func.attrs["tvm_fusion.schedule"][0]


def test_band_choice():
    rows = choose_band(56, 56, 96, cores=2, lanes=16)
    assert 56 % rows == 0 and 56 // rows >= 2
    assert 4 * 96 * rows * 56 <= 512 << 10
    assert choose_band(13, 13, 8, cores=2, lanes=16) == 1  # 13 rows: bands of 1 for 2 cores
    assert choose_band(14, 14, 384, cores=2, lanes=16) == 7  # one band per core


def test_simo_numerics():
    model = simo_model(8, 12, ("conv", 8, 1, 1, 0, 1, "relu"),
                       [("conv", 8, 1, 1, 0, 1, "relu"), ("conv", 8, 3, 1, 1, 1, "relu")])
    _numerics(model, **FORCE)


def test_miso_numerics():
    model = miso_model(8, 12, ("conv", 8, 3, 1, 1, 1, None), ("conv", 8, 1, 1, 0, 1, None))
    _numerics(model, **FORCE)


def _lowered_sizes(func) -> dict[str, int]:
    passes = [s_tir.transform.LowerInitBlock(),
              s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
              s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.CompactBufferAllocation()]
    low = tvm.transform.Sequential(passes)(
        tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))["main"]
    return {b.name: int(np.prod([int(d) for d in b.shape]))
            for blk in find_all(low.body, tvm.s_tir.SBlock) for b in blk.alloc_buffers}


def test_buffers_are_tile_sized():
    """dw 3×3 → pw on 16×56×56: every intermediate is tile (+ halo) sized, not 16·56·56."""
    mod = fuse(import_onnx(chain_model(16, 56, DW_PW)), TARGET, **FORCE)
    (_, func), = _chain_funcs(mod)
    full = 16 * 56 * 56
    sizes = _lowered_sizes(func)
    assert sizes, "no intermediate at all?"
    for name, size in sizes.items():
        assert size * 4 <= full, f"{name} has {size} elements: tensor-sized, not a tile"


# --------------------------------------------------------------------------- analytics


def test_t_red_paper_example():
    assert cc.t_red(8, 8, 4, 4, 2, 2) == 132  # Fig. 8


def test_halo_eq4():
    assert halo_extent(2, [(3, 1), (3, 1)]) == [6, 4, 2]  # Fig. 5d
    assert halo_extent(2, [(3, 1), (1, 1)]) == [4, 2, 2]  # Fig. 5b


def test_g4_intensity_uses_per_group_weights():
    """Table 4's G4 (MobileNet dw 3×3 s2 → 1×1): I = 3.27 only with weights / G."""
    dw = cc.RegionOp(0, "depthwise", 1, 144, 113, 113, 144, 56, 56, 3, 3, 2, 144)
    pw = cc.RegionOp(1, "conv", 1, 144, 56, 56, 32, 56, 56, 1, 1, 1, 1)
    flops = dw.flops + pw.flops
    nbytes = sum(o.in_bytes + o.weight_bytes + o.out_bytes for o in (dw, pw))
    assert abs(flops / nbytes - 3.27) < 0.05


def test_tile_choice_within_hardware_and_space():
    th, tw = choose_tile(56, 56, [96, 96, 24], [(3, 1), (1, 1)], cores=2, lanes=16)
    assert 56 % tw == 0 and tw <= 16 and th in (2, 4, 8, 16, 56)


# ---------------------------------------------------------------------- candidates, search


def _ecg_of(model):
    from tvm_fusion.relay_passes.ecg import build_ecg
    from tvm_fusion.relay_passes.plan_fusion import _dataflow_blocks
    from tvm_fusion.transform import legalize_passes

    mod = import_onnx(model)
    with TARGET:
        mod = tvm.transform.Sequential(legalize_passes(TARGET))(mod)
    from tvm_fusion.relay_passes.mapping_type import AnnotateMappingType

    mod = AnnotateMappingType("expanding_only")(mod)
    block = _dataflow_blocks(mod["main"])[0]
    return build_ecg(mod, block), mod


def _candidates(model):
    ecg, mod = _ecg_of(model)
    rops = {n.index: op for n in ecg.nodes if (op := cc.region_op(ecg, n.index, mod))}
    return cc.find_candidates(ecg, rops), rops


def test_candidate_shapes():
    siso, _ = _candidates(chain_model(8, 12, [("conv", 8, 1, 1, 0, 1, "relu")] * 3))
    assert sorted(len(c.rops) for c in siso if c.shape == "SISO") == [2, 2, 3]
    simo, _ = _candidates(simo_model(8, 12, ("conv", 8, 1, 1, 0, 1, "relu"),
                                     [("conv", 8, 1, 1, 0, 1, "relu"),
                                      ("conv", 8, 3, 1, 1, 1, "relu")]))
    assert any(c.shape == "SIMO" and len(c.rops) == 3 for c in simo)
    miso, _ = _candidates(miso_model(8, 12, ("conv", 8, 3, 1, 1, 1, None),
                                     ("conv", 8, 1, 1, 0, 1, None)))
    assert [c.shape for c in miso] == ["MISO"]


def test_pruning_modes():
    """dw→pw (memory-bound) passes both rules on the paper's GPU; a compute-bound 3×3→3×3
    with 256 channels is pruned by the literal aggregate rule (I above the ridge)."""
    big = cc.RegionOp(0, "conv", 1, 256, 56, 56, 256, 56, 56, 3, 3, 1, 1)
    big2 = cc.RegionOp(1, "conv", 1, 256, 56, 56, 256, 56, 56, 3, 3, 1, 1)
    cand = cc.ChainCandidate("SISO", (0, 1), frozenset({0, 1}), (0,))
    rops = {0: big, 1: big2}
    gpu = cc.PLATFORMS["a6000_ada"]
    assert not cc.score(cand, rops, gpu, "paper_1.05").keep
    dw = cc.RegionOp(0, "depthwise", 1, 144, 56, 56, 144, 56, 56, 3, 3, 1, 144)
    pw = cc.RegionOp(1, "conv", 1, 144, 56, 56, 32, 56, 56, 1, 1, 1, 1)
    rops = {0: dw, 1: pw}
    for mode in ("paper_1.05", "cost_model"):
        assert cc.score(cand, rops, gpu, mode).keep, mode


def test_backtracking_search_picks_best_non_overlapping():
    a = cc.ChainCandidate("SISO", (0, 1), frozenset({0, 1}), (0,))
    b = cc.ChainCandidate("SISO", (1, 2), frozenset({1, 2}), (1,))
    c = cc.ChainCandidate("SISO", (2, 3), frozenset({2, 3}), (2,))
    gains = [-1.0, -1.5, -1.0]
    best = cc.backtracking_search([a, b, c], lambda st: 10 + sum(gains[i] for i in st))
    assert best == frozenset({0, 2})  # 2.0 saved beats b alone (1.5)


def test_off_mode_and_option_validation():
    assert cc.choose_chains(_ecg_of(chain_model(8, 12, DW_PW))[0], "off") == []
    with pytest.raises(ValueError, match="conv_chains"):
        fuse(import_onnx(chain_model(8, 12, DW_PW)), TARGET, conv_chains="bogus")


def test_default_fuses_profitable_chain_into_one_kernel():
    from tvm_fusion.compile import count_kernels

    model = chain_model(32, 56, [("conv", -1, 3, 1, 1, -1, "relu6"),
                                 ("conv", 16, 1, 1, 0, 1, None)])
    mod = _numerics(model, conv_chains="cost_model")
    assert count_kernels(mod) == 1


def test_measured_times_override_the_cost_model():
    """With a profiling database the measurement decides: a halo chain the CPU rule rejects
    is fused when it was timed faster, a pointwise tail the model keeps is not when slower."""
    halo_ecg, halo_mod = _ecg_of(chain_model(8, 12, CASES["3x3-3x3"][2]))
    rule_only = cc.choose_chains(halo_ecg, "cost_model", mod=halo_mod)
    assert not any(d.chosen for d in rule_only)
    assert {d.rejected for d in rule_only} == {RejectReason.PROFITABILITY}
    faster = cc.choose_chains(halo_ecg, "cost_model", mod=halo_mod,
                              latency=lambda c: (1e-6, 2e-6, "timed"))
    assert [d.chosen for d in faster] == [True] and "measured, timed" in faster[0].reason
    tail_ecg, tail_mod = _ecg_of(chain_model(32, 56, DW_PW))
    assert any(d.chosen for d in cc.choose_chains(tail_ecg, "cost_model", mod=tail_mod))
    slower = cc.choose_chains(tail_ecg, "cost_model", mod=tail_mod,
                              latency=lambda c: (3e-6, 2e-6, "timed"))
    assert not any(d.chosen for d in slower)
    assert {d.rejected for d in slower} == {RejectReason.PROFITABILITY}


def test_chains_are_timed_once_into_the_profiling_database(tmp_path):
    """profile="measure": each candidate chain is built fused and as planned (one kernel per
    planned block) and timed; the next build looks the pair up and measures nothing."""
    from tvm_fusion.compile import count_kernels
    from tvm_fusion.tuning.database import ProfilingDatabase

    model = chain_model(16, 14, DW_PW)
    db = tmp_path / "chains.db"
    options = {"conv_chains": "cost_model", "conv_layout": "NCHW", "profile_db": str(db)}
    first = fuse(import_onnx(model), TARGET, profile="measure", **options)
    with ProfilingDatabase(db) as database:
        entries = list(database.entries())
        assert sorted(e.variant for e in entries) == ["fused", "split:blocks"]
        fused = next(e for e in entries if e.variant == "fused")
        split = next(e for e in entries if e.variant == "split:blocks")
    assert count_kernels(first) == (1 if fused.min < split.min else 2)
    again = fuse(import_onnx(model), TARGET, profile="db", **options)
    with ProfilingDatabase(db) as database:
        assert len(list(database.entries())) == 2
    assert count_kernels(again) == count_kernels(first)
    _numerics(model, profile="db", **options)


# ------------------------------------------------------------------------------ models


@pytest.mark.slow
@pytest.mark.parametrize("name,m2m,expected",
                         [("mobilenet_v2", 54, 41), ("efficientnet_b0", 99, 99)])
def test_real_models_and_the_anchor_bound(name, m2m, expected):
    """MobileNetV2's dw→pw pairs share kernels: below its 54 Many-to-Many operators (the
    three on 7×7 maps stay apart: no two bands of a register each). EfficientNet-B0's pairs
    have squeeze-excitation between dw and pw (a global reduction: no band of the pw can start
    before the whole dw output), so the cost model alone fuses none of its chains on a CPU;
    measured, it does (next test)."""
    import os

    from tvm_fusion.compile import count_kernels, load_onnx
    from tvm_fusion.numerics import onnx_reference

    path = os.path.join(os.path.dirname(__file__), "..", "models", f"{name}.onnx")
    if not os.path.exists(path):
        pytest.skip(f"{path} not exported")
    model = load_onnx(path)
    mod = import_onnx(model)
    fused = fuse(mod, TARGET, conv_chains="cost_model")
    assert count_kernels(fused) == expected and expected <= m2m
    feeds = random_inputs(model)
    inputs = [feeds[n] for n in graph_input_names(model)]
    ours = run(compile_model(mod, TARGET, conv_chains="cost_model"), inputs)
    compare(ours, onnx_reference(model, feeds), rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_efficientnet_b0_below_its_anchor_bound_with_measured_chains(tmp_path):
    """Every candidate chain of EfficientNet-B0 timed on this machine (about a minute): the
    ones that ran faster fused (projection→expansion 1×1 pairs, squeeze-excitation's pool →
    1×1 conv) share kernels, below its 99 Many-to-Many operators, and the model still
    matches ONNX Runtime."""
    import os

    from tvm_fusion.compile import count_kernels, load_onnx
    from tvm_fusion.numerics import onnx_reference

    path = os.path.join(os.path.dirname(__file__), "..", "models", "efficientnet_b0.onnx")
    if not os.path.exists(path):
        pytest.skip(f"{path} not exported")
    model = load_onnx(path)
    mod = import_onnx(model)
    options = {"conv_chains": "cost_model", "profile": "measure",
               "profile_db": str(tmp_path / "chains.db")}
    assert count_kernels(fuse(mod, TARGET, **options)) < 99
    feeds = random_inputs(model)
    inputs = [feeds[n] for n in graph_input_names(model)]
    ours = run(compile_model(mod, TARGET, **options), inputs)
    compare(ours, onnx_reference(model, feeds), rtol=1e-3, atol=1e-4)


def test_report_shows_halo_redundancy_and_bytes_saved():
    """Per candidate chain: tile, halo, redundant FLOPs (T_red) and the intermediate's bytes
    that never travel (written once and read once unfused: 2 x 96·56·56·4)."""
    from tvm_fusion.report import format_report, make_report

    ops = DW_PW + [("conv", 24, 3, 1, 1, 1, "relu")]
    report = make_report(chain_model(96, 56, ops), "chain", TARGET, check=False,
                         conv_chains="cost_model")
    by_ops = {len(c["operators"]): c for c in report.conv_chains}
    assert len(report.conv_chains) == 3
    pair = next(c for c in report.conv_chains if c["chosen"])
    assert pair["bytes_saved"] == 2 * 96 * 56 * 56 * 4
    assert pair["halo"] == [0, 0] and pair["redundant_flops"] == 0  # a 1×1 tail: no halo
    triple = by_ops[3]
    assert triple["halo"] == [2, 2] and triple["redundant_flops"] > 0
    text = format_report(report, why=True)
    assert "conv chains (OptiFX): 1 of 3 candidates fused" in text
    assert "redundant" in text and "saved" in text


# ----------------------------------------------------------------------------- GPU template

GPU_CASES = ["dw-pw", "3x3-3x3", "conv-maxpool", "strided-second", "tile-not-dividing"]


def _gpu_fused(case, target):
    from tvm_fusion.pipeline import apply_gpu_schedules
    from tvm_fusion.transform import Sequential

    channels, size, ops = CASES[case]
    model = chain_model(channels, size, ops)
    with target:
        mod = apply_gpu_schedules(Sequential(target, **FORCE)(import_onnx(model)))
    return model, mod


@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_template_numerics_on_opencl(case):
    """The CUDA/OpenCL template (one thread block per tile, the padded intermediate + halo in
    shared memory) run through OpenCL on PoCL, against the unfused CPU build."""
    from tvm_fusion.layout import opencl_runner

    ok, why = opencl_runner.available()
    if not ok:
        pytest.skip(why)
    target = tvm.target.Target({"kind": "opencl"}, host="llvm")
    model, mod = _gpu_fused(case, target)
    assert len(_chain_funcs(mod)) == 1, "the GPU template did not take the chain"
    feeds = random_inputs(model, seed=1)
    inputs = [feeds[n] for n in graph_input_names(model)]
    expected = run(compile_model(import_onnx(model), TARGET, conv_chains="off"), inputs)
    got = opencl_runner.OpenCLRunner().run_module(mod, inputs, target, pipeline="s_tir")
    compare(got, expected, rtol=1e-5, atol=1e-5)


def test_gpu_template_is_verified_and_tile_sized():
    """dw 3×3 → pw on 16×14×14: the shared buffer is the staged tile (all 16 channels × tile),
    and ``verify_gpu_code`` accepts the kernel under the target's limits."""
    from tvm_fusion.tir_schedules.optifx import GpuLimits, gpu_kernel_ok, shared_bytes

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    _, mod = _gpu_fused("dw-pw", target)
    (_, func), = _chain_funcs(mod)
    note = func.attrs["tvm_fusion.schedule"][0]
    th, tw = (int(t) for t in note.split("tile ")[1].split(",")[0].split("x"))
    assert shared_bytes(func) == 4 * 16 * th * tw  # a 1×1 second op: no halo
    assert gpu_kernel_ok(func, GpuLimits.of(target))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("case", ["dw-pw", "3x3-3x3"])
def test_gpu_template_cuda_compiles_to_ptx(case):
    from tvm_fusion.transform import get_pipeline

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    channels, size, ops = CASES[case]
    ex = tvm.compile(import_onnx(chain_model(channels, size, ops)), target,
                     relax_pipeline=get_pipeline(target, **FORCE))
    source = next(m for m in _walk(ex.mod) if m.kind == "cuda").inspect_source()
    assert "__shared__" in source  # the staged tile of the chain kernel
    with target:
        ptx = tvm.support.nvcc.compile_cuda(source, target_format="ptx", compiler="nvcc")
    assert b".target sm_80" in bytes(ptx)


def _walk(module):
    yield module
    for imported in module.imports:
        yield from _walk(imported)


def test_chain_whose_tile_loop_tvm_will_not_parallelise_is_declined():
    """A 1×1 conv from one channel then a padded 3×3 conv on a 1×4 map (fuzz seed 6141): the
    tiles are 1 wide, the first conv's halo leaves the map and compute_at clips it with a
    predicate, and TVM takes no predicated reduction inside a parallel loop. The template
    declines before building (the reason in the notes, no ScheduleFailedWarning) and the
    per-operator rules schedule the block."""
    import warnings

    from onnx import TensorProto, helper, numpy_helper

    from tvm_fusion.testing.notes import schedule_notes
    from tvm_fusion.tir_schedules.records import ScheduleFailedWarning

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype("float32"), n)
             for n, s in (("w1", (16, 1, 1, 1)), ("b1", (16,)), ("w2", (16, 16, 3, 3)))]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], kernel_shape=[1, 1]),
         helper.make_node("Conv", ["h", "w2"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
        "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16, 1, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScheduleFailedWarning)
        mod = _numerics(model, table3={("M2M", "M2M"): "green"}, conv_chains="cost_model")
    assert "conv-chain template not used (TVM does not run its tile loop in parallel" in \
        schedule_notes(mod)

"""Apollo (issue 10): rules ①-⑥, Layers II/III, the resource check, feedback, numerics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm
from conftest import TARGET, check_model
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion.compile import compile_model, count_kernels, fuse, graph_input_names, import_onnx
from tvm_fusion.compile import run as run_vm
from tvm_fusion.feeds import random_inputs
from tvm_fusion.instrument import Collector
from tvm_fusion.models import transformer_encoder_layer
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.relay_passes.apollo.partition import parallel_gain, rule_groups
from tvm_fusion.relay_passes.rejection import RejectReason

RAW = dict(rewrite=False, layout=False)  # the graph as imported: no rewriting, no pre-fusion


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _const(name, value):
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _fuse_collecting(mod, **options):
    """``fuse`` and the plan its run recorded."""
    collector = Collector()
    with tvm.transform.PassContext(instruments=[collector]):
        out = fuse(mod, TARGET, **options)
    return out, collector.plans[-1]


def _plan(model, **options):
    opts = {"apollo_blocklist": "memory", "schedule": False, **RAW, **options}
    return _fuse_collecting(import_onnx(model), strategy="apollo", **opts)


def _kernels(model, **options) -> int:
    return count_kernels(_plan(model, **options)[0])


def _types(plan) -> list[str]:
    (block_plan,) = plan.plans.values()
    return [block_plan.types[n.index] for n in block_plan.ecg.nodes]


def _rules(plan) -> list[str]:
    return [m.rule for p in plan.plans.values() for t in p.traces for m in t]


def _numerics(model, **options):
    """Apollo build vs ONNX reference and the stock TVM build."""
    mod = import_onnx(model)
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[name] for name in graph_input_names(model)]
    ours = run_vm(compile_model(mod, TARGET, strategy="apollo", apollo_blocklist="memory",
                                **options), inputs)
    compare(ours, onnx_reference(model, feeds), rtol=1e-4, atol=1e-5)
    compare(ours, run_vm(compile_model(mod, TARGET, strategy="tvm"), inputs), rtol=1e-4,
            atol=1e-5)


# ---------------------------------------------------------------------------- rules ①-⑥

def _reduce_chain():
    """x → Exp → Abs → ReduceSum → Mul(2) → y: ① then ④; ⑦ only in Layer II."""
    return _model([
        helper.make_node("Exp", ["x"], ["e"]),
        helper.make_node("Abs", ["e"], ["a"]),
        helper.make_node("ReduceSum", ["a", "axes"], ["s"], keepdims=1),
        helper.make_node("Mul", ["s", "two"], ["y"]),
    ], [_vi("x", [8, 16])], [_vi("y", [8, 1])],
        [numpy_helper.from_array(np.array([-1], np.int64), "axes"), _const("two", 2.0)])


def test_classification_by_access_functions():
    _, plan = _plan(_reduce_chain())
    assert _types(plan) == ["elementwise", "elementwise", "reduction", "elementwise"]
    bias = _model([helper.make_node("Add", ["x", "b"], ["y"])], [_vi("x", [8, 16])],
                  [_vi("y", [8, 16])], [_const("b", np.ones(16))])
    assert _types(_plan(bias)[1]) == ["broadcast"]  # Def. 2: the bias lacks an output iterator
    scalar = _model([helper.make_node("Add", ["x", "b"], ["y"])], [_vi("x", [8, 16])],
                    [_vi("y", [8, 16])], [_const("b", 1.0)])
    assert _types(_plan(scalar)[1]) == ["elementwise"]  # scalar inputs are discarded


def test_classification_conv_pool_and_small_fma():
    rng = np.random.default_rng(0)
    model = _model([
        helper.make_node("Conv", ["x", "w3"], ["c"], pads=[1, 1, 1, 1]),
        # overlapping windows: a "general" relation; a 2x2/2 pool would tile, i.e. reduce
        helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["p", "w1"], ["y"]),  # 1x1: a matmul
        helper.make_node("ReduceMean", ["y"], ["m"], axes=[2, 3], keepdims=1),
        helper.make_node("Conv", ["m", "w1"], ["z"]),  # squeeze-excite: few FLOPs, still FMA
    ], [_vi("x", [1, 4, 8, 8])], [_vi("z", [1, 4, 1, 1])],
        [_const("w3", rng.standard_normal((4, 4, 3, 3))), _const("w1", rng.standard_normal(
            (4, 4, 1, 1)))])
    types = _types(_plan(model, apollo_layers=1)[1])
    assert [t for t in types if t != "elementwise"] == [
        "conv", "other", "matmul", "reduction", "matmul"], types


def test_reduction_never_absorbs_consumer_in_layer1_but_stitches_in_layer2():
    _, plan1 = _plan(_reduce_chain(), apollo_layers=1)
    assert _rules(plan1) == ["①", "④"]
    assert count_kernels(_plan(_reduce_chain(), apollo_layers=1)[0]) == 2
    out2, plan2 = _plan(_reduce_chain(), apollo_layers=2)
    assert _rules(plan2) == ["①", "④", "⑦"] and count_kernels(out2) == 1


def test_rule_order_paper_vs_practical():
    """ew → bc → ew: ② merges bc+ew; ew → bc has no rule in Table 1 (notes §7.2)."""
    model = _model([
        helper.make_node("Exp", ["x"], ["e"]),
        helper.make_node("Add", ["e", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["y"]),
    ], [_vi("x", [8, 16])], [_vi("y", [8, 16])], [_const("b", np.ones(16))])
    out, plan = _plan(model, apollo_rules="paper")
    assert _rules(plan) == ["②"] and count_kernels(out) == 2
    out, plan = _plan(model, apollo_rules="practical")
    assert count_kernels(out) == 1
    assert ("elementwise", "broadcast", "broadcast") not in dict(rule_groups("paper"))["②"]


def test_matmul_absorbs_elementwise_neighbours_never_another_matmul():
    w = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    model = _model([
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("MatMul", ["r", "w1"], ["m"]),
        helper.make_node("Tanh", ["m"], ["t"]),
        helper.make_node("MatMul", ["t", "w2"], ["y"]),
    ], [_vi("x", [8, 16])], [_vi("y", [8, 16])], [_const("w1", w), _const("w2", w)])
    out, plan = _plan(model, apollo_rules="paper")
    assert _types(plan) == ["elementwise", "matmul", "elementwise", "matmul"]
    assert _rules(plan) == ["⑥-matmul", "⑥-matmul"]  # prologue and epilogue, equal priority
    assert count_kernels(out) == 2  # two compute-bound operators never merge
    _numerics(model)


def test_transpose_absorbs_producers():
    model = _model([
        helper.make_node("Exp", ["x"], ["e"]),
        helper.make_node("Transpose", ["e"], ["y"], perm=[1, 0]),
    ], [_vi("x", [8, 16])], [_vi("y", [16, 8])])
    out, plan = _plan(model, apollo_rules="paper")
    assert _types(plan) == ["elementwise", "transpose"] and _rules(plan) == ["⑥-transpose"]
    assert count_kernels(out) == 1


# ------------------------------------------------------------------------------ Layer III

def _three_projections(n=3, hidden=32):
    rng = np.random.default_rng(1)
    nodes, inits, outs = [], [], []
    for i in range(n):
        inits += [_const(f"w{i}", rng.standard_normal((hidden, hidden)) / hidden),
                  _const(f"b{i}", rng.standard_normal(hidden))]
        nodes += [helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"])]
        outs.append(_vi(f"y{i}", [16, hidden]))
    return _model(nodes, [_vi("x", [16, hidden])], outs, inits)


def test_layer3_packs_parallel_matmuls_into_one_kernel():
    model = _three_projections()
    out, plan = _plan(model)
    assert count_kernels(out) == 1
    assert count_kernels(fuse(import_onnx(model), TARGET, strategy="tvm")) == 3
    (block_plan,) = plan.plans.values()
    assert any(d["fused"] and d["kernels"] == 3 for d in block_plan.parallel)
    assert _kernels(model, apollo_layers=2) == 3  # Layer III off
    _numerics(model, **RAW)


def test_resource_check_refuses_too_many_branches_and_over_budget():
    cost = {"bytes": 1000, "time": 1e-6, "occupancy": 0.5}
    assert parallel_gain([cost] * 7, 1 << 20)["fuse"]
    refused = parallel_gain([cost] * 8, 1 << 20)
    assert not refused["fuse"] and refused["rejected"] is RejectReason.BLOCK_LIMIT
    over = parallel_gain([cost] * 3, 2500)
    assert not over["fuse"] and over["rejected"] is RejectReason.WORKING_SET
    # end to end: 9 projections pack as at most 7 + the rest, never 9 in one kernel
    assert _kernels(_three_projections(9)) == 2
    assert _kernels(_three_projections(), apollo_max_branches=2) == 2
    assert _kernels(_three_projections(), apollo_stitch_bytes=1) == 3


# ------------------------------------------------------------------------------- feedback

def test_failing_schedule_splits_partition_and_build_succeeds(tmp_path: Path):
    """A deliberately failing schedule (matmul fused with the Gelu epilogue) is sent back: the
    partition's last merge is undone, blocklisted in the profiling database, and the rebuilt
    module has no failing function and still computes the right thing."""
    model = transformer_encoder_layer()
    db = str(tmp_path / "profiling.db")
    failed: list[str] = []

    def hook(name, func):
        bad = "matmul" in name and "erf" in name
        if bad:
            failed.append(name)
        return bad

    opts = dict(apollo_fail_hook=hook, profile_db=db, **RAW)
    mod = import_onnx(model)
    fused, plan = _fuse_collecting(mod, strategy="apollo", **opts)
    assert failed and plan.feedback, "the injected failure must trigger feedback"
    event = plan.feedback[0]
    assert event.split.startswith("⑥-matmul") and "injected" in event.reason
    assert plan.rounds == 2
    assert all("erf" not in g.name_hint or "matmul" not in g.name_hint
               for g in fused.functions)
    from tvm_fusion.tuning.database import ProfilingDatabase

    with ProfilingDatabase(db) as database:
        assert [e["signature"] for e in database.blocklist("llvm")] == [event.split]
    # the blocklist persists: a fresh build never tries the merge again
    failed.clear()
    _, plan2 = _fuse_collecting(mod, strategy="apollo", **opts)
    assert not failed and not plan2.feedback and plan2.rounds == 1
    # and the build runs correctly
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[n] for n in graph_input_names(model)]
    ex = compile_model(mod, TARGET, strategy="apollo", apollo_fail_hook=hook, profile_db=db,
                       **RAW)
    compare(run_vm(ex, inputs), onnx_reference(model, feeds), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------ encoder, numerics

def test_encoder_kernels_and_numerics():
    model = transformer_encoder_layer()
    mod = import_onnx(model)
    stock = count_kernels(fuse(mod, TARGET, strategy="tvm"))
    dnn = count_kernels(fuse(mod, TARGET, strategy="dnnfusion", **RAW))
    raw = _kernels(model)
    # DNNFusion: the attention block takes Q.K^T, mask, softmax and .V; Apollo (raw): Q/K/V
    # packed by Layer III
    assert (stock, dnn, raw) == (19, 11, 9)
    default = check_model(model, strategy="apollo", apollo_blocklist="memory")
    assert count_kernels(default) == 9


# -------------------------------------------------------------------------------- the zoo

MODELS = Path(__file__).resolve().parents[1] / "models"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert_base", "tinybert", "mobilenet_v2", "resnet50"])
def test_zoo_apollo_numerics(name):
    path = MODELS / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} missing: run `python -m tvm_fusion.export_models`")
    from tvm_fusion.compile import load_onnx

    model = load_onnx(path)
    mod = import_onnx(model)
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[n] for n in graph_input_names(model)]
    ours = run_vm(compile_model(mod, TARGET, strategy="apollo", apollo_blocklist="memory"),
                  inputs)
    compare(ours, onnx_reference(model, feeds), rtol=1e-3, atol=1e-4)
    if name == "bert_base":
        import tvm

        from tvm_fusion.relay_passes.plan_fusion import plan_module
        from tvm_fusion.transform import legalize_passes

        with TARGET:
            legal = tvm.transform.Sequential(legalize_passes(TARGET))(mod)
        bound = plan_module(legal).anchor_bound
        kernels = count_kernels(fuse(mod, TARGET, strategy="apollo", apollo_blocklist="memory"))
        assert kernels < bound, (kernels, bound)


def test_report_lists_every_feedback_event(tmp_path: Path):
    from tvm_fusion.report import format_report, make_report

    def hook(name, func):
        return "matmul" in name and "erf" in name

    report = make_report(transformer_encoder_layer(), "encoder", check=False,
                         strategy="apollo", apollo_fail_hook=hook,
                         profile_db=str(tmp_path / "p.db"), **RAW)
    assert report.feedback and "split" in report.feedback[0]
    assert "scheduler feedback (Apollo):" in format_report(report)

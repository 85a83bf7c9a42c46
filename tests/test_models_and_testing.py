"""Tests of the built-in models and the test helpers everything else relies on.

If these helpers were wrong (invalid models, feeds outside an op's domain, a loose ``compare``),
every fusion test downstream would pass or fail for the wrong reason.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from tvm_fusion.feeds import random_inputs
from tvm_fusion.models import BUILTIN_MODELS, figure3_graph, get_builtin, transformer_encoder_layer
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.testing.onnx_backend import load_backend_case, onnx_backend_model_dirs
from tvm_fusion.testing.random_dag import random_dag_models
from tvm_fusion.testing.single_op import SINGLE_OP_EXPECTED, SINGLE_OP_TYPES, single_op_model
from tvm_fusion.testing.stock import TVM_UNSUPPORTED, run_tvm_stock

MAPPING_TYPES = {"ONE_TO_ONE", "ONE_TO_MANY", "MANY_TO_MANY", "REORGANIZE", "SHUFFLE"}


def _check_and_run(model: onnx.ModelProto, seed: int = 0):
    onnx.checker.check_model(model, full_check=True)
    feeds = random_inputs(model, seed=seed)
    outs = onnx_reference(model, feeds)
    assert len(outs) == len(model.graph.output)
    for out in outs:
        if np.issubdtype(out.dtype, np.floating):
            assert np.isfinite(out).all()
    return feeds, outs


# ---------------------------------------------------------------------------------------------
# Built-in models
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_model_checks_runs_and_matches_onnx_reference(name):
    model = get_builtin(name)
    assert model.ir_version == 8
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 17)}
    feeds, outs = _check_and_run(model)
    ref = ReferenceEvaluator(model).run(None, feeds)
    compare(outs, ref, rtol=1e-4, atol=1e-4)


def test_builtin_models_are_deterministic():
    for name in BUILTIN_MODELS:
        assert get_builtin(name).SerializeToString() == get_builtin(name).SerializeToString()


def test_get_builtin_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="encoder, figure3"):
        get_builtin("resnet")


def test_encoder_layer_structure():
    model = transformer_encoder_layer(seq=16, hidden=32, heads=2, ffn=64, mask_input=False)
    ops = [n.op_type for n in model.graph.node]
    assert [i.name for i in model.graph.input] == ["x"]
    assert ops.count("MatMul") == 8  # Q, K, V, QK^T, PV, out-proj, FFN in, FFN out
    assert ops.count("Softmax") == 1 and ops.count("Erf") == 1
    assert ops.count("ReduceMean") == 4 and ops.count("Pow") == 2 and ops.count("Sqrt") == 2
    # TinyBERT's LayerNorm chain appears in that order: Sub, Pow, ReduceMean, Add, Sqrt
    i = ops.index("Pow")
    assert ops[i - 1 : i + 4] == ["Sub", "Pow", "ReduceMean", "Add", "Sqrt"]
    _check_and_run(model)
    with pytest.raises(ValueError, match="divisible"):
        transformer_encoder_layer(hidden=30, heads=4)


def test_encoder_mask_input_hint_gives_an_additive_mask():
    model = transformer_encoder_layer(seq=8, hidden=16, heads=2, ffn=32)
    mask = random_inputs(model)["mask"]
    assert mask.shape == (1, 1, 1, 8)
    assert set(np.unique(mask)) == {0.0, -1e4} and (mask[..., :6] == 0).all()


def test_figure3_graph_structure():
    model = figure3_graph()
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["MatMul", "Add", "Conv", "Relu", "Mul", "Sub"]
    conv = model.graph.node[2]
    assert len(conv.input) == 2  # no bias
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    shapes = {
        vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
        for vi in [*inferred.graph.value_info, *inferred.graph.output]
    }
    for node in model.graph.node:  # "identical output shape" for every operator
        assert shapes[node.output[0]] == [1, 16, 8, 8]
    assert [o.name for o in model.graph.output] == ["out_relu", "out_mul", "out_sub"]


# ---------------------------------------------------------------------------------------------
# Single-op models
# ---------------------------------------------------------------------------------------------
def test_single_op_expected_covers_every_model_with_valid_types():
    assert set(SINGLE_OP_EXPECTED) == set(SINGLE_OP_TYPES)
    assert set(SINGLE_OP_EXPECTED.values()) == MAPPING_TYPES
    table2 = {
        "ONE_TO_ONE": "Add Asin BatchNormalization Cast Ceil Clip Concat Cos Erf Exp Greater "
        "LeakyRelu Log Not PRelu Reciprocal Relu Round Sigmoid Sin Slice Split Sqrt Tanh Where",
        "ONE_TO_MANY": "Expand Gather Resize Upsample",
        "MANY_TO_MANY": "AveragePool Conv ConvTranspose CumSum Einsum Gemm InstanceNormalization "
        "MaxPool ReduceProd ReduceMean Softmax",
        "REORGANIZE": "Flatten Reshape Squeeze Unsqueeze",
        "SHUFFLE": "DepthToSpace SpaceToDepth Transpose",
    }
    for kind, ops in table2.items():
        for op in ops.split():
            assert SINGLE_OP_EXPECTED[op] == kind, op
    assert SINGLE_OP_EXPECTED["AddBroadcast"] == "ONE_TO_MANY"
    assert SINGLE_OP_EXPECTED["AddBias"] == "ONE_TO_ONE"
    assert SINGLE_OP_EXPECTED["MatMul"] == "MANY_TO_MANY"


@pytest.mark.parametrize("op_type", SINGLE_OP_TYPES)
def test_single_op_model_checks_and_runs(op_type):
    model = single_op_model(op_type)
    assert len(model.graph.node) == 1
    expected_onnx_op = {"AddBroadcast": "Add", "AddBias": "Add"}.get(op_type, op_type)
    assert model.graph.node[0].op_type == expected_onnx_op
    _check_and_run(model)


@pytest.mark.parametrize("op_type", ["Conv", "Softmax", "LayerNormalization", "Resize", "Asin"])
def test_single_op_model_matches_onnx_reference_evaluator(op_type):
    model = single_op_model(op_type)
    feeds, outs = _check_and_run(model)
    compare(outs, ReferenceEvaluator(model).run(None, feeds), rtol=1e-4, atol=1e-5)


def test_single_op_model_overrides_and_unknown():
    model = single_op_model("Relu", shape=[3, 5])
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [3, 5]
    model = single_op_model("LeakyRelu", alpha=0.3)
    assert helper.get_attribute_value(model.graph.node[0].attribute[0]) == pytest.approx(0.3)
    assert single_op_model("Upsample").opset_import[0].version == 9
    assert single_op_model("Gelu").opset_import[0].version == 20
    with pytest.raises(ValueError, match="unknown single-op model"):
        single_op_model("Frobnicate")


def test_add_broadcast_is_a_true_expansion_and_add_bias_is_not():
    bcast = single_op_model("AddBroadcast")
    shapes = [[d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in bcast.graph.input]
    assert shapes == [[4, 1], [1, 5]]
    bias = single_op_model("AddBias")
    assert [i.name for i in bias.graph.input] == ["x"]
    assert list(onnx.numpy_helper.to_array(bias.graph.initializer[0]).shape) == [1, 8, 1, 1]


@pytest.mark.parametrize("op_type", SINGLE_OP_TYPES)
def test_single_op_model_through_stock_tvm(op_type):
    if op_type in TVM_UNSUPPORTED:
        pytest.skip(f"TVM 0.27: {TVM_UNSUPPORTED[op_type]}")
    model = single_op_model(op_type)
    feeds = random_inputs(model)
    compare(run_tvm_stock(model, feeds), onnx_reference(model, feeds), rtol=1e-4, atol=1e-5)


def test_upsample_tvm_bugs_are_as_documented():
    """Keeps TVM_UNSUPPORTED honest: both Upsample forms still break in TVM 0.27."""
    model = single_op_model("Upsample")  # opset 9: scales is an input
    with pytest.raises(Exception, match="NoneType"):
        run_tvm_stock(model, random_inputs(model))
    # Upsample-7 (scales attribute, opset 8) imports, but rounds nearest indices instead of
    # flooring them: [0, 1, 2, 3] x2 -> [0, 0, 1, 2, 2, 2, 3, 3] instead of [0, 0, 1, 1, ...].
    node = helper.make_node("Upsample", ["x"], ["y"], scales=[1.0, 1.0, 1.0, 2.0])
    graph = helper.make_graph(
        [node],
        "upsample7",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 1, 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)])
    model.ir_version = 8
    feeds = {"x": np.arange(4, dtype=np.float32).reshape(1, 1, 1, 4)}
    np.testing.assert_array_equal(onnx_reference(model, feeds)[0].ravel(), [0, 0, 1, 1, 2, 2, 3, 3])
    assert run_tvm_stock(model, feeds)[0].ravel().tolist() != [0, 0, 1, 1, 2, 2, 3, 3]


# ---------------------------------------------------------------------------------------------
# random_inputs
# ---------------------------------------------------------------------------------------------
def test_random_inputs_honours_domain_hints():
    assert (random_inputs(single_op_model("Log"))["x"] >= 0.1).all()
    assert (random_inputs(single_op_model("Sqrt"))["x"] >= 0.1).all()
    asin = random_inputs(single_op_model("Asin"))["x"]
    assert (np.abs(asin) <= 0.9).all()
    assert (random_inputs(single_op_model("Div"))["b"] >= 0.1).all()
    idx = random_inputs(single_op_model("Gather"))["indices"]
    assert idx.dtype == np.int64 and idx.min() >= 0 and idx.max() < 10
    feeds = random_inputs(single_op_model("Where"))
    assert feeds["cond"].dtype == np.bool_ and feeds["a"].dtype == np.float32


def _model_with_inputs(*value_infos) -> onnx.ModelProto:
    nodes = [helper.make_node("Identity", [vi.name], [f"{vi.name}_out"]) for vi in value_infos]
    outs = [
        helper.make_tensor_value_info(f"{vi.name}_out", vi.type.tensor_type.elem_type, None)
        for vi in value_infos
    ]
    graph = helper.make_graph(nodes, "g", list(value_infos), outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_random_inputs_integer_conventions_and_determinism():
    model = _model_with_inputs(
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [2, 50]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [2, 50]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, [4, 3]),
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
    )
    feeds = random_inputs(model, seed=1)
    assert feeds["input_ids"].min() >= 0 and feeds["input_ids"].max() <= 99
    assert feeds["input_ids"].max() >= 10  # really uses the 0..99 range
    assert (feeds["attention_mask"] == 1).all()
    assert feeds["positions"].max() < 3  # bounded by the smallest dim
    again = random_inputs(model, seed=1)
    assert all(np.array_equal(feeds[k], again[k]) for k in feeds)
    assert not np.array_equal(feeds["x"], random_inputs(model, seed=2)["x"])


def test_random_inputs_symbolic_dims_need_overrides():
    model = _model_with_inputs(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]))
    with pytest.raises(ValueError, match="'x'"):
        random_inputs(model)
    assert random_inputs(model, shape_overrides={"batch": 3})["x"].shape == (3, 4)
    assert random_inputs(model, shape_overrides={"x": [2, 4]})["x"].shape == (2, 4)


def test_random_inputs_skips_initializers():
    model = single_op_model("Conv")
    assert list(random_inputs(model)) == ["x"]


# ---------------------------------------------------------------------------------------------
# compare
# ---------------------------------------------------------------------------------------------
def test_compare_returns_max_abs_error_and_reports_failures():
    ref = [np.ones((2, 3), np.float32), np.zeros(4, np.float32)]
    out = [ref[0] + np.float32(2**-20), ref[1].copy()]  # exactly representable offset
    assert compare(out, ref) == 2**-20
    bad = [ref[0].copy(), ref[1] + np.array([0, 0, 0.5, 0], np.float32)]
    with pytest.raises(AssertionError, match=r"output 1 .*max abs err 0\.5"):
        compare(bad, ref)
    with pytest.raises(AssertionError, match="shape"):
        compare([ref[0].T, ref[1]], ref)
    with pytest.raises(AssertionError, match="2 outputs"):
        compare(ref, ref[:1])
    with pytest.raises(AssertionError):
        compare([np.array([np.nan])], [np.array([1.0])])
    assert compare([np.array([True, False])], [np.array([True, False])]) == 0.0
    assert compare([np.array([np.nan, np.inf])], [np.array([np.nan, np.inf])]) == 0.0


# ---------------------------------------------------------------------------------------------
# random_dag_models
# ---------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dag_models())
def test_random_dag_models_check_and_run(model):
    assert 3 <= len(model.graph.node) <= 12
    assert 1 <= len(model.graph.output) <= 2
    x = model.graph.input[0]
    assert x.name == "x" and len(x.type.tensor_type.shape.dim) == 4
    _check_and_run(model)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dag_models())
def test_random_dag_models_through_stock_tvm(model):
    feeds = random_inputs(model)
    compare(run_tvm_stock(model, feeds), onnx_reference(model, feeds), rtol=1e-4, atol=1e-4)


def test_random_dag_models_cover_the_promised_features():
    """Over a fixed batch of draws: multi-consumer edges, 2 outputs, intermediate outputs."""
    models = []

    @settings(max_examples=60, deadline=None, database=None, derandomize=True)
    @given(random_dag_models())
    def collect(model):
        models.append(model)

    collect()
    seen_ops, multi, two_out, inner_out = set(), 0, 0, 0
    for m in models:
        reads = [i for n in m.graph.node for i in n.input]
        seen_ops.update(n.op_type for n in m.graph.node)
        produced = {o for n in m.graph.node for o in n.output}
        multi += any(reads.count(t) >= 2 for t in produced | {"x"})
        two_out += len(m.graph.output) == 2
        inner_out += any(o.name in reads for o in m.graph.output)
    assert multi and two_out and inner_out
    assert {"Conv", "MatMul", "Softmax", "Transpose", "Concat"} <= seen_ops


# ---------------------------------------------------------------------------------------------
# ONNX backend test data
# ---------------------------------------------------------------------------------------------
def test_backend_model_dirs_and_loading():
    cases = onnx_backend_model_dirs()
    suites = {p.parent.name for p in cases}
    assert suites == {"light", "pytorch-converted", "pytorch-operator", "simple"}
    assert len(cases) > 100
    for p in cases:
        if p.parent.name == "light":
            assert p.is_file() and p.suffix == ".onnx" and "_output_" not in p.name
        else:
            assert (p / "model.onnx").is_file() and (p / "test_data_set_0").is_dir()
    with pytest.raises(ValueError, match="no backend test suite"):
        onnx_backend_model_dirs(["nope"])


@pytest.mark.parametrize(
    "case",
    [
        "pytorch-operator/test_operator_add_broadcast",
        "pytorch-converted/test_Conv2d",
        "simple/test_single_relu_model",
        "light/light_squeezenet.onnx",
    ],
)
def test_load_backend_case_matches_onnxruntime(case):
    path = onnx_backend_model_dirs([case.split("/")[0]])[0].parent / case.split("/")[1]
    model, feeds, expected = load_backend_case(path)
    assert len(expected) == len(model.graph.output)
    compare(onnx_reference(model, feeds), expected, rtol=1e-3, atol=1e-4)

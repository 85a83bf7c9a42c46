"""``scripts/gpu_bundle.py``'s weight rewrite: the CUDA bundle embeds tiled weights so that the
compiled libraries compress; the model must keep its shapes, dtypes and non-weight constants.
Nothing here needs a GPU (the GPU run itself is ``scripts/gpu_run.py``, docs/targets.md)."""

import lzma

import numpy as np
from onnx import TensorProto, helper, numpy_helper
from script_module import load_script

from tvm_fusion.numerics import onnx_reference


def _bundle_script():
    return load_script("gpu_bundle")


def _model():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((67, 45)).astype(np.float32)  # odd sizes: periods clip
    bias = rng.standard_normal(45).astype(np.float32)  # small: kept
    shape = np.array([1, 3, 15], np.int64)  # an int initializer: kept
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Reshape", ["a", "s"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 67])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 15])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b"),
         numpy_helper.from_array(shape, "s")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_tiling_keeps_shapes_dtypes_and_small_constants():
    bundle = _bundle_script()
    model = _model()
    tiled = bundle.tile_initializers(model, min_size=1024, period=8)
    before = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    after = {i.name: numpy_helper.to_array(i) for i in tiled.graph.initializer}
    assert list(before) == list(after)
    for name in before:
        assert after[name].shape == before[name].shape and after[name].dtype == before[name].dtype
    np.testing.assert_array_equal(after["b"], before["b"])
    np.testing.assert_array_equal(after["s"], before["s"])
    w, w0 = after["w"], before["w"]
    np.testing.assert_array_equal(w[:, :8], w0[:, :8])  # its own leading block, whole along
    np.testing.assert_array_equal(w[:, 40:45], w0[:, 0:5])  # the summed axis, repeated along N
    assert not np.array_equal(w, w0)
    transposed = np.ascontiguousarray(w.T).tobytes()  # still periodic after a transpose
    assert len(lzma.compress(transposed)) < len(lzma.compress(w0.T.tobytes())) / 4
    x = {"x": np.ones((1, 67), np.float32)}
    assert np.isfinite(onnx_reference(tiled, x)[0]).all()


def test_reduction_axes_of_conv_matmul_and_gemm():
    bundle = _bundle_script()
    nodes = [helper.make_node("Conv", ["x", "cw"], ["c"]),
             helper.make_node("MatMul", ["c", "mw"], ["m"]),
             helper.make_node("Gemm", ["m", "gw"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "g", [], [])
    axes = bundle.reduction_axes(helper.make_model(graph))
    assert 1 in axes["cw"] and 0 not in axes["cw"]  # input channels, not output channels
    assert axes["mw"] == {-2} and axes["gw"] == {1}


def _run_script():
    return load_script("gpu_run")


def test_runner_times_in_turns_and_reports_a_failed_build():
    """``gpu_run.py``'s timing loop and table, on plain callables (no TVM, no GPU)."""
    runner = _run_script()
    calls = []
    variants = {name: runner.Variant(lambda n=name: calls.append(n), lambda: None, list)
                for name in ("fused", "stock")}
    times = runner.alternate(variants, seconds=0.01, batch_s=0.001)
    assert set(times) == {"fused", "stock"} and all(t["batches"] >= 5 for t in times.values())
    assert calls[:2] == ["fused", "fused"] and "stock" in calls  # warm-up, then in turns
    entry = {"builds": {"fused": {"error": "ptxas error: too much shared data"},
                        "stock": {"primfunc_calls_in_main": 7}}}
    row = {"time": {"stock": times["stock"]}, "err": {},
           "build_errors": {"fused": "ptxas error: too much shared data"}}
    text = runner.markdown({"device_name": "cpu", "sections": {"m": {"entry": entry,
                                                                      "rows": [row]}},
                            "errors": {}})
    assert "fused build failed: `ptxas error: too much shared data`" in text
    assert "?/7" in text

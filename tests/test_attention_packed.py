"""A fused attention whose only input is a packed Q/K/V tensor (a self-attention after
rewriting packs its projections: the SD U-Net block, wav2vec2). TVM's Relax lowering
(``RewriteDataflowReshape``, in the build and in memory planning) asserts that a kernel a
one-input ``call_tir`` calls has a root block; the generated kernel has one."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from conftest import TARGET
from onnx import TensorProto, helper

from tvm_fusion.compile import compile_model, fuse, import_onnx, run
from tvm_fusion.memory import planned_memory
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.tir_schedules.attention import ATTENTION_ATTR

SEQ, HEADS, DIM = 24, 2, 8


def _packed_self_attention(cast_probabilities: bool = False) -> onnx.ModelProto:
    width = HEADS * DIM
    const = [helper.make_tensor("split", TensorProto.INT64, [3], [width] * 3),
             helper.make_tensor("heads", TensorProto.INT64, [4], [0, 0, HEADS, DIM]),
             helper.make_tensor("merged", TensorProto.INT64, [3], [0, 0, width]),
             helper.make_tensor("scale", TensorProto.FLOAT, [], [DIM ** -0.5]),
             helper.make_tensor("w", TensorProto.FLOAT, [width, width],
                                np.random.default_rng(1).standard_normal(width * width) / 4)]
    nodes = [helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=2)]
    for name, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [helper.make_node("Reshape", [name, "heads"], [f"{name}4"]),
                  helper.make_node("Transpose", [f"{name}4"], [f"{name}h"], perm=perm)]
    nodes += [helper.make_node("MatMul", ["qh", "kh"], ["s"]),
              helper.make_node("Mul", ["s", "scale"], ["ss"]),
              helper.make_node("Softmax", ["ss"], ["p0" if cast_probabilities else "p"], axis=-1),
              *([helper.make_node("Cast", ["p0"], ["p"], to=TensorProto.FLOAT)]
                if cast_probabilities else []),
              helper.make_node("MatMul", ["p", "vh"], ["o"]),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "merged"], ["ctx"]),
              # the attention's result inside the dataflow block (an output is not rewritten)
              helper.make_node("MatMul", ["ctx", "w"], ["y"])]
    graph = helper.make_graph(
        nodes, "packed_self_attention",
        [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, "seq", 3 * width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", width])], const)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("cast_probabilities", [False, True])
def test_one_input_attention_lowers_plans_memory_and_matches(cast_probabilities):
    """A symbolic sequence (rewriting, which would drop an identity cast, skips symbolic
    graphs). ``cast_probabilities``: TorchScript's GPT-2 casts the probabilities to their own
    dtype before P·V (``attn_weights.type(value.dtype)``), a copy once legalized; it is part of
    the block like a real cast."""
    model = _packed_self_attention(cast_probabilities)
    mod = import_onnx(model)
    fused = fuse(mod, TARGET)
    kernels = [f for f in fused.functions.values()
               if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and ATTENTION_ATTR in f.attrs]
    assert len(kernels) == 1 and len(kernels[0].params) == 2  # qkv in, the result out
    assert planned_memory(fused, TARGET).total > 0
    x = np.random.default_rng(0).standard_normal((1, SEQ, 3 * HEADS * DIM)).astype("float32")
    compare(run(compile_model(mod, TARGET), [x]), onnx_reference(model, {"qkv": x}),
            rtol=1e-4, atol=1e-5)



def test_one_input_attention_builds_and_matches_on_a_gpu_target():
    """The GPU template's kernel has its root block too (the SD U-Net block and wav2vec2 did
    not build for CUDA): built for OpenCL with the registered pipeline, run on PoCL."""
    from tvm_fusion import pipeline
    from tvm_fusion.layout import opencl_runner
    from tvm_fusion.transform import Sequential

    model = _packed_self_attention()
    target = tvm.target.Target({"kind": "opencl"}, host="llvm")
    tvm.compile(import_onnx(model), target, relax_pipeline="tvm_fusion")  # the whole lowering
    ok, why = opencl_runner.available()
    if not ok:
        pytest.skip(why)
    static = tvm.relax.transform.BindSymbolicVars({"seq": SEQ})(import_onnx(model))
    with target:
        mod = pipeline.build(target, Sequential(target), lower=False)(static)
    assert [f for f in mod.functions.values()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and ATTENTION_ATTR in f.attrs]
    x = np.random.default_rng(0).standard_normal((1, SEQ, 3 * HEADS * DIM)).astype("float32")
    ours = opencl_runner.OpenCLRunner().run_module(mod, [x], target)
    np.testing.assert_allclose(ours[0], onnx_reference(model, {"qkv": x})[0],
                               rtol=1e-4, atol=1e-5)

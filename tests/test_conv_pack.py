"""Packed NCHW[x]c convs on CPU (DNNFusion's inter-block layout): when, and same numbers."""

import onnx
import pytest
import tvm
from conftest import TARGET

from tvm_fusion.compile import compile_model, fuse, graph_input_names, import_onnx, run
from tvm_fusion.feeds import random_inputs
from tvm_fusion.layout.conv_pack import should_pack
from tvm_fusion.models.conv_chains import chain_model
from tvm_fusion.numerics import compare, onnx_reference

DENSE = [("conv", 32, 3, 1, 1, 1, "relu"), ("conv", 32, 1, 1, 0, 1, None),
         ("conv", 16, 3, 2, 1, 1, "relu"), ("maxpool", 3, 2, 1)]
DEPTHWISE = [("conv", -1, 3, 1, 1, -1, "relu6"), ("conv", 32, 1, 1, 0, 1, None)]


def _conv_kernels(mod) -> list[str]:
    return [g.name_hint for g, f in mod.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc) and "conv2d" in g.name_hint]


def _check(model, **options):
    """Against ONNX Runtime and against the unpacked build."""
    feeds = random_inputs(model, seed=3)
    inputs = [feeds[n] for n in graph_input_names(model)]
    got = run(compile_model(import_onnx(model), TARGET, **options), inputs)
    plain = run(compile_model(import_onnx(model), TARGET, conv_layout="NCHW"), inputs)
    compare(got, plain, rtol=1e-5, atol=1e-5)
    reference = onnx.ModelProto()
    reference.CopyFrom(model)
    reference.ir_version = min(reference.ir_version, 10)  # what this onnxruntime reads
    compare(got, onnx_reference(reference, feeds), rtol=1e-4, atol=1e-4)


def test_dense_convs_are_packed_and_exact():
    """By default dense convs with constant weights run as the packed GEMM (im2col panels,
    layout/gemm_pack.py); ``conv_layout="NCHWc"`` packs them instead: 3 input channels (the
    first conv) stay NCHW, the rest run as conv2d_NCHWc."""
    model = chain_model(16, 20, DENSE)
    kernels = _conv_kernels(fuse(import_onnx(model), TARGET))
    assert kernels and all("conv2d_gemm" in k for k in kernels), kernels
    packed = _conv_kernels(fuse(import_onnx(model), TARGET, conv_layout="NCHWc"))
    assert any("NCHWc" in k for k in packed), packed
    _check(model)
    _check(model, conv_layout="NCHWc")


def test_auto_keeps_nchw_with_grouped_convs_and_forced_packing_is_exact():
    model = chain_model(16, 14, DEPTHWISE)
    assert not should_pack(import_onnx(model), "auto")[0]
    assert not any("NCHWc" in k for k in _conv_kernels(fuse(import_onnx(model), TARGET)))
    _check(model, conv_layout="NCHWc")


def test_nchw_policy_and_bad_value():
    model = chain_model(16, 20, DENSE)
    assert not any("NCHWc" in k for k in _conv_kernels(
        fuse(import_onnx(model), TARGET, conv_layout="NCHW")))
    with pytest.raises(ValueError, match="conv_layout"):
        fuse(import_onnx(model), TARGET, conv_layout="NHWC")


def _conv_add(z_shape):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    def vi(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    w = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((8, 4, 3, 3)).astype("float32"), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Add", ["c", "z"], ["y"])], "conv_add",
        [vi("x", [1, 4, 6, 6]), vi("z", z_shape)], [vi("y", [1, 8, 6, 6])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("z_shape", [[6], [1, 6], [8, 1, 1], [1, 8, 1, 6], [6, 6]])
def test_packed_conv_with_broadcast_operands(z_shape):
    _check(_conv_add(z_shape), conv_layout="NCHWc")


def test_convert_layout_failure_keeps_nchw_with_a_warning():
    """TVM 0.27's ConvertLayout cannot broadcast a [1, 1, H, W] operand against a packed
    tensor ("Cannot broadcast from 5 to 4"): the module stays NCHW, a warning says why."""
    from tvm_fusion.layout.conv_pack import PackConvsWarning

    with pytest.warns(PackConvsWarning, match="keeping NCHW"):
        _check(_conv_add([1, 1, 6, 6]), conv_layout="NCHWc")

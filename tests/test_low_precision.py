"""fp16 and bf16 models (issue 19, item 2): planning, rewriting and the CPU schedules keep
working, with the numbers of stock TVM.

Stock TVM 0.27 legalises an fp16 (bf16) MatMul or Conv with an fp16 (bf16) accumulator on
every target (``out_dtype`` unset: the sum is of the input type); LLVM computes each fp16 add
in fp32 and rounds it back. On a CPU without fp16 arithmetic tvm_fusion sums them in float32
(``relay_passes/accumulate.py``, tests/test_transform_accumulate_in_float32.py), as ONNX
Runtime does, so its error against ONNX Runtime is at most stock TVM's; a tvm_fusion output
passes when its error is within the dtype's tolerance or no larger than stock TVM's own
(:func:`tvm_fusion.numerics.check_outputs`).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import tvm
from onnx import numpy_helper

from tvm_fusion.compile import compile_model, count_kernels, fuse, graph_input_names, import_onnx
from tvm_fusion.compile import run as run_vm
from tvm_fusion.feeds import random_inputs
from tvm_fusion.models.builtin import transformer_encoder_layer
from tvm_fusion.models.precision import cast_model, round_to
from tvm_fusion.models.quantized import conv_net, matmul_net
from tvm_fusion.numerics import check_outputs, max_abs_error, onnx_reference
from tvm_fusion.target import host_target
from tvm_fusion.tir_schedules.cpu_target import CpuParams, cpu_params
from tvm_fusion.tir_schedules.fast_math import fast_math
from tvm_fusion.tir_schedules.records import SCHEDULE_ATTR

TARGET = host_target()


def _three_ways(model: onnx.ModelProto):
    mod = import_onnx(model)
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[n] for n in graph_input_names(model)]
    ours = run_vm(compile_model(mod, TARGET), inputs)
    stock = run_vm(compile_model(mod, TARGET, strategy="tvm"), inputs)
    return ours, stock, onnx_reference(model, feeds), mod


@pytest.mark.parametrize("build,stock_kernels,ours_kernels", [
    (conv_net, 5, 5), (transformer_encoder_layer, 19, 10)], ids=["conv_net", "encoder"])
def test_fp16_model_matches_onnxruntime_and_stock(build, stock_kernels, ours_kernels):
    model = cast_model(build(), "float16")
    ours, stock, ref, mod = _three_ways(model)
    assert ours[0].dtype == np.float16
    check_outputs(ours, stock, ref)  # raises naming the output when out of tolerance
    # float32 sums (stock's are fp16): never further from ONNX Runtime than stock
    assert max_abs_error(ours, ref) <= max_abs_error(stock, ref)
    assert count_kernels(fuse(mod, TARGET, strategy="tvm", schedule=False)) == stock_kernels
    assert count_kernels(fuse(mod, TARGET, schedule=False)) == ours_kernels


def test_fp16_with_batch_norm_builds_where_stock_tvm_fails():
    """Stock TVM 0.27's batch-norm legalisation returns float32 for an fp16 input, and its
    next conv fails type inference; tvm_fusion decomposes batch norm for inference first."""
    from tvm_fusion.models.symbolic import conv_net as conv_bn_net

    model = cast_model(conv_bn_net(), "float16")
    mod = import_onnx(model, shape_dict={"x": [1, 3, 32, 32]})
    with pytest.raises(TypeError, match="same datatype"):
        compile_model(mod, TARGET, strategy="tvm")
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float16)
    ours = run_vm(compile_model(mod, TARGET), [x])
    ref = onnx_reference(model, {"x": x})
    check_outputs(ours, None, ref)


def _bf16_reference_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """The float32 model with its weights rounded to bfloat16: ONNX Runtime has no bf16
    MatMul/Conv on CPU, so this is the reference a bf16 build is compared with."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for i, t in enumerate(out.graph.initializer):
        value = numpy_helper.to_array(t)
        if value.dtype == np.float32:
            out.graph.initializer[i].CopyFrom(
                numpy_helper.from_array(round_to(value, "bfloat16"), t.name))
    return out


@pytest.mark.parametrize("build,opset", [(matmul_net, None), (conv_net, 22)],
                         ids=["matmul_gemm", "conv_net"])
def test_bf16_through_the_onnx_importer(build, opset):
    """TVM's importer takes bf16 graphs (Conv from opset 22, where ONNX allows it); ONNX
    Runtime does not run them, so the reference is the float32 model on bf16-rounded weights
    and inputs. (A decomposed LayerNorm's Pow does not legalise in bf16 in TVM 0.27, stock or
    ours: ``power only applies to float``.)"""
    import ml_dtypes

    f32 = build()
    model = cast_model(f32, "bfloat16", opset=opset)
    feeds = {k: round_to(v, "bfloat16") for k, v in random_inputs(f32, seed=0).items()}
    ref = onnx_reference(_bf16_reference_model(f32), feeds)
    inputs = [feeds[k].astype(ml_dtypes.bfloat16) for k in graph_input_names(model)]
    mod = import_onnx(model)
    ours = run_vm(compile_model(mod, TARGET), inputs)
    stock = run_vm(compile_model(mod, TARGET, strategy="tvm"), inputs)
    assert ours[0].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(ours[0].astype(np.float32), stock[0].astype(np.float32))
    check_outputs([o.astype(np.float32) for o in ours], None, ref, dtype="bfloat16")


def test_lanes_follow_the_dtype():
    avx2 = CpuParams(8, 12, 1)
    assert avx2.for_dtype("float32") is avx2
    assert (avx2.for_dtype("float16").lanes, avx2.for_dtype("float16").registers) == (16, 6)
    assert avx2.for_dtype("int8").lanes == 32
    assert avx2.for_dtype("float64").lanes == 4
    native = CpuParams(16, 24, 1, native_fp16=True)
    assert (native.for_dtype("float16").lanes, native.for_dtype("float16").registers) == (32, 24)
    assert native.for_dtype("bfloat16").registers == 12  # no bf16 arithmetic: fp32 registers
    znver3 = cpu_params(tvm.target.Target({"kind": "llvm", "mcpu": "znver3"}))
    assert (znver3.lanes, znver3.native_fp16) == (8, False)


def test_fp16_matmul_tile_uses_fp16_lanes():
    """With fp16 arithmetic (AVX512-FP16) the matmul sums in fp16, in registers of 32 fp16
    lanes: the 64-column one in two (without it, it sums in float32:
    test_transform_accumulate_in_float32.py)."""
    model = cast_model(matmul_net(), "float16")
    fused = fuse(import_onnx(model), tvm.target.Target({"kind": "llvm",
                                                         "mcpu": "sapphirerapids"}))
    notes = [str(n) for f in fused.functions.values() if isinstance(f, tvm.tirx.PrimFunc)
             for n in (f.attrs or {}).get(SCHEDULE_ATTR, [])]
    tiles = [n for n in notes if "tile matmul" in n]
    assert any("×64 lanes" in n for n in tiles), tiles


def test_fast_math_leaves_fp16_alone():
    """The approximations are float32's (their error is measured in fp32); an fp16 exp stays
    the exact function, and an fp32 erf inside an fp16 GELU (stock's legalisation casts up)
    is approximated in fp32."""
    x = tvm.tirx.Var("x", "float16")
    y = tvm.tirx.Var("y", "float32")
    h = tvm.tirx.decl_buffer((4,), "float16", "h")
    func = tvm.tirx.PrimFunc([x, y, h], tvm.tirx.SeqStmt([
        tvm.tirx.BufferStore(h, tvm.tirx.exp(x), [0]),
        tvm.tirx.BufferStore(h, tvm.tirx.Cast("float16", tvm.tirx.erf(y)), [1])]))
    text = fast_math(func).script()
    assert "T.exp(x)" in text
    assert "T.erf(" not in text


def test_torch_half_export(tmp_path):
    """A model exported from PyTorch after ``.half()`` (CPU, TorchScript exporter): conv,
    depthwise conv with SiLU, a residual add, a mean and a Linear, all in fp16."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.depthwise = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x):
            y = torch.relu(self.conv(x))
            y = torch.nn.functional.silu(self.depthwise(y)) + y
            return self.fc(y.mean(dim=(2, 3)))

    torch.manual_seed(0)
    path = tmp_path / "half.onnx"
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notice
        warnings.simplefilter("ignore")
        torch.onnx.export(Net().eval().half(), (torch.randn(1, 3, 16, 16).half(),), str(path),
                          dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["y"])
    model = onnx.load(path)
    ours, stock, ref, _ = _three_ways(model)
    assert ours[0].dtype == np.float16
    check_outputs(ours, stock, ref)


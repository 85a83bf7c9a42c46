"""fp16/bf16 convs, matmuls and reductions sum in float32 on CPUs without 16-bit float
arithmetic (``relay_passes/accumulate.py``), and keep their type where the target has it.

The decision is the target's: Zen 3 (AVX2, no AVX512-FP16) and AArch64 without ``+fullfp16``
sum in float32; AArch64 with ``+fullfp16`` (and AVX512-FP16) as the model says. Numerics: the
fp16 builds against ONNX Runtime (which computes such nodes in float32 on x86) and stock TVM
(fp16 sums): at least as accurate as stock, within fp16's tolerance.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import relax as R

from tvm_fusion.compile import compile_model, fuse, graph_input_names, import_onnx
from tvm_fusion.compile import run as run_vm
from tvm_fusion.feeds import random_inputs
from tvm_fusion.memory import kernel_workspace
from tvm_fusion.models.precision import cast_model
from tvm_fusion.numerics import check_outputs, max_abs_error, onnx_reference
from tvm_fusion.relay_passes.accumulate import AccumulateInFloat32, widened_legalizations
from tvm_fusion.tir_schedules.records import SCHEDULE_ATTR
from tvm_fusion.tir_utils import iter_sblocks

ZEN3 = tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 1})
AARCH64 = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                             "mattr": ["+neon"], "num-cores": 1})
AARCH64_FP16 = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                                  "mattr": ["+neon", "+fullfp16"], "num-cores": 1})


# ------------------------------------------------------------------------- the Relax pass

@tvm.script.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((1, 8, 6, 6), "float16"), w: R.Tensor((4, 8, 3, 3), "float16"),
             a: R.Tensor((5, 16), "float16"), b: R.Tensor((16, 7), "float16")):
        with R.dataflow():
            y = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
            z = R.matmul(a, b)
            R.output(y, z)
        return (y, z)


@tvm.script.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((1, 8, 6, 6), "float16"), w: R.Tensor((4, 8, 3, 3), "float16"),
             a: R.Tensor((5, 16), "float16"), b: R.Tensor((16, 7), "float16")):
        with R.dataflow():
            y_sum = R.nn.conv2d(x, w, padding=[1, 1, 1, 1], out_dtype="float32")
            y = R.astype(y_sum, "float16")
            z_sum = R.matmul(a, b, out_dtype="float32")
            z = R.astype(z_sum, "float16")
            R.output(y, z)
        return (y, z)


def test_fp16_conv_and_matmul_sum_in_float32_without_fp16_arithmetic():
    for target in (ZEN3, AARCH64):
        tvm.ir.assert_structural_equal(AccumulateInFloat32(target)(Before), Expected)


def test_fp16_arithmetic_and_float32_models_are_left_alone():
    tvm.ir.assert_structural_equal(AccumulateInFloat32(AARCH64_FP16)(Before), Before)
    avx512fp16 = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"})
    tvm.ir.assert_structural_equal(AccumulateInFloat32(avx512fp16)(Before), Before)
    f32 = relax.transform.ConvertToDataflow()(_float32(Before))
    tvm.ir.assert_structural_equal(AccumulateInFloat32(ZEN3)(f32), f32)


def _float32(mod: tvm.IRModule) -> tvm.IRModule:
    text = mod.script().replace('"float16"', '"float32"')
    return tvm.script.from_source(text)


def _reduction_dtypes(mod: tvm.IRModule) -> set[str]:
    """The dtypes every reduction block of ``mod``'s PrimFuncs accumulates in."""
    return {str(block.body.buffer.ty.dtype) for func in mod.functions.values()
            if isinstance(func, tvm.tirx.PrimFunc) for block in iter_sblocks(func)
            if block.init is not None and isinstance(block.body, tvm.tirx.BufferStore)}


@tvm.script.ir_module
class Reductions:
    @R.function
    def main(x: R.Tensor((1, 8, 28, 28), "float16")):
        with R.dataflow():
            m = R.mean(x, axis=[2, 3], keepdims=True)
            s = R.nn.softmax(x, axis=1)
            p = R.nn.avg_pool2d(x, pool_size=[2, 2])
            R.output(m, s, p)
        return (m, s, p)


def test_fp16_reductions_are_legalised_with_float32_sums():
    """One kernel per reduction, as TVM's legalisation makes it, summing in float32 (a 784-term
    fp16 sum, a global average pool, loses digits at every step); fp16 where the target has
    fp16 arithmetic."""
    ours = relax.transform.LegalizeOps(widened_legalizations(ZEN3))(Reductions)
    assert _reduction_dtypes(ours) == {"float32"}
    assert sum(isinstance(f, tvm.tirx.PrimFunc) for f in ours.functions.values()) == 3
    native = relax.transform.LegalizeOps(widened_legalizations(AARCH64_FP16) or None)(Reductions)
    assert "float16" in _reduction_dtypes(native)


# ------------------------------------------------------------------------- numerics

def _conv_model() -> onnx.ModelProto:
    """Conv 3×3 stride 2 (5 → 17 channels, 15×15), depthwise 3×3, 1×1 conv (17 → 33),
    global average pool, a constant-weight MatMul (33 → 50, M = 1) and a Softmax: float32,
    cast to fp16 by the tests."""
    rng = np.random.default_rng(0)

    def init(name, shape, fan_in):
        return numpy_helper.from_array(
            (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32), name)

    inits = [init("w1", (17, 5, 3, 3), 45), init("b1", (17,), 45), init("w2", (17, 1, 3, 3), 9),
             init("w3", (33, 17, 1, 1), 17), init("b3", (33,), 17), init("w4", (33, 50), 33)]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], group=17, pads=[1, 1, 1, 1]),
        helper.make_node("HardSwish", ["c2"], ["h2"]),
        helper.make_node("Conv", ["h2", "w3", "b3"], ["c3"]),
        helper.make_node("GlobalAveragePool", ["c3"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("MatMul", ["f", "w4"], ["m"]),
        helper.make_node("Softmax", ["m"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "fp16_convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                            [1, 5, 15, 15])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 50])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _matmul_model() -> onnx.ModelProto:
    """x[2, 17, 33] · W[33, 50] + b, then the un-normalised values: a K of 33 and an N of 50
    that no tile divides."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((33, 50)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(50).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])],
        "fp16_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 17, 33])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 17, 50])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("build", [_conv_model, _matmul_model], ids=["convs", "matmul"])
def test_fp16_builds_match_onnxruntime_at_least_as_well_as_stock(build):
    model = cast_model(build(), "float16")
    mod = import_onnx(model)
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[n] for n in graph_input_names(model)]
    ref = onnx_reference(model, feeds)
    stock = run_vm(compile_model(mod, ZEN3, strategy="tvm"), inputs)
    errors = {}
    for name, options in (("tvm_fusion", {}), ("fuseops", {"strategy": "tvm", "schedule": True})):
        ours = run_vm(compile_model(mod, ZEN3, **options), inputs)
        assert ours[0].dtype == np.float16
        check_outputs(ours, stock, ref)
        errors[name] = max_abs_error(ours, ref)
    stock_error = max_abs_error(stock, ref)
    # float32 sums: as close to ONNX Runtime as fp16 storage allows, never further than stock
    assert max(errors.values()) <= stock_error, (errors, stock_error)
    scale = max(float(np.abs(r).max()) for r in ref)
    assert max(errors.values()) <= 4e-3 * scale, (errors, scale)


def test_fp16_convs_and_matmuls_run_as_the_packed_gemm_with_float32_sums():
    mod = import_onnx(cast_model(_conv_model(), "float16"))
    fused = fuse(mod, ZEN3)
    notes = [str(n) for f in fused.functions.values() if isinstance(f, tvm.tirx.PrimFunc)
             for n in (f.attrs or {}).get(SCHEDULE_ATTR, [])]
    # the strided 3×3 conv, the 1×1 conv and the MatMul; the depthwise conv stays direct
    assert sum("packed GEMM" in n for n in notes) == 3, notes
    assert _reduction_dtypes(fuse(mod, ZEN3, schedule=False)) == {"float32"}
    # the global average pool reads its fp16 input cast up in place: no float32 copy of the
    # 33×8×8 map inside the kernel
    for build in (fused, fuse(mod, ZEN3, strategy="tvm", schedule=True)):
        means = [f for gv, f in build.functions.items() if "mean" in gv.name_hint]
        assert means and all(kernel_workspace(f) < 33 * 8 * 8 * 2 for f in means)


@pytest.mark.parametrize("target", [AARCH64, AARCH64_FP16], ids=["neon", "neon-fullfp16"])
def test_aarch64_builds_with_and_without_fp16_arithmetic(target):
    """Cross-compiled only (no device): without ``+fullfp16`` the sums are float32, with it
    the model's fp16, and both build."""
    mod = import_onnx(cast_model(_conv_model(), "float16"))
    dtypes = _reduction_dtypes(fuse(mod, target, schedule=False))
    assert ("float16" in dtypes) == (target is AARCH64_FP16), dtypes
    compile_model(mod, target)

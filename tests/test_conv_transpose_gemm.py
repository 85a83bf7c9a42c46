"""ConvTranspose as the packed GEMM of a 1×1 conv and a col2im (``layout/gemm_pack.py``:
``conv2d_transpose_gemm``): which transposed convs take it, that a 2×2/2 upsampling's col2im
folds into the GEMM's write-back, and the same numbers as ONNX Runtime and stock TVM (TOPI's
conv over the zero-dilated input) on odd sizes, strides, padding, output_padding, dilation
and batches."""

import numpy as np
import pytest
import tvm
from asm_inspect import AARCH64, AVX512, ZEN3, assembly, fma_loops
from conftest import TARGET
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion.compile import compile_model, fuse, import_onnx, run
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.testing.notes import schedule_notes

AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 1})


def conv_transpose_model(c_in, c_out, size, k, stride=1, pads=(0, 0, 0, 0),
                         output_padding=(0, 0), dilation=1, batch=1, groups=1,
                         epilogue="Relu"):
    """One ONNX ConvTranspose (+ bias) on a ``size × size`` map, then ``epilogue``."""
    rng = np.random.default_rng(11)
    weight = rng.standard_normal((c_in, c_out // groups, k, k)).astype("float32")
    bias = rng.standard_normal(c_out).astype("float32")
    nodes = [helper.make_node("ConvTranspose", ["x", "W", "B"], ["y"], kernel_shape=[k, k],
                              strides=[stride] * 2, pads=list(pads),
                              output_padding=list(output_padding), dilations=[dilation] * 2,
                              group=groups),
             helper.make_node(epilogue, ["y"], ["z"])]
    graph = helper.make_graph(
        nodes, "conv_transpose",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c_in, size, size])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _check(model, target, shape=None):
    """Ours against ONNX Runtime and against stock TVM's conv2d_transpose (TOPI)."""
    shape = shape or [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(3).standard_normal(shape).astype("float32")
    got = run(compile_model(import_onnx(model), target), [x])
    compare(got, onnx_reference(model, {"x": x}), rtol=1e-4, atol=1e-4)
    stock = run(compile_model(import_onnx(model), target, strategy="tvm", pack_weights=False),
                [x])
    compare(got, stock, rtol=1e-4, atol=1e-4)


CASES = {
    # (c_in, c_out, size, k, stride, pads, output_padding, dilation, batch)
    "2x2-stride2": (16, 8, 9, 2, 2),  # the U-Net's upsampling: one tap per output
    "2x2-stride2-odd-batch": (17, 11, 7, 2, 2, (0, 0, 0, 0), (0, 0), 1, 2),
    "2x2-stride2-cropped": (8, 8, 6, 2, 2, (1, 0, 1, 1), (0, 1)),  # pads crop the GEMM's taps
    "3x3-stride2-output-padding": (8, 6, 5, 3, 2, (1, 1, 1, 1), (1, 1)),  # overlapping taps
    "4x4-stride2-pad1": (8, 5, 7, 4, 2, (1, 1, 1, 1)),  # DCGAN's
    "3x3-stride1-pad1": (5, 7, 6, 3, 1, (1, 1, 1, 1)),
    "1x1-stride2": (4, 9, 5, 1, 2, (0, 0, 0, 0), (1, 1)),  # outputs that no tap reaches
    "3x3-stride2-dilated-asym": (6, 4, 5, 3, 2, (1, 0, 2, 1), (1, 0), 2),
    "positions-as-rows": (32, 48, 3, 2, 2),  # 9 positions < 48·4 rows of taps
    "multi-k-block": (300, 8, 5, 2, 2),  # K = 300 input channels: two K blocks
}


# the baseline-x86 build of every case is in the slow run: the default run keeps CI's budget
@pytest.mark.parametrize("target", [pytest.param(TARGET, id="llvm", marks=pytest.mark.slow),
                                    pytest.param(AVX2, id="avx2")])
@pytest.mark.parametrize("name", list(CASES))
def test_conv_transpose_as_packed_gemm_matches_onnxruntime_and_stock(name, target):
    model = conv_transpose_model(*CASES[name])
    notes = schedule_notes(fuse(import_onnx(model), target))
    assert "packed GEMM" in notes, notes
    assert "conv2d_transpose_nchw" not in notes and "data_dilate" not in notes, notes
    _check(model, target)


@pytest.mark.parametrize("target", [TARGET, AVX2], ids=["llvm", "avx2"])
def test_upsampling_col2im_and_epilogue_fold_into_the_gemm_write_back(target):
    """Kernel = stride (2×2/2): each output reads one tap, so the col2im is an index change
    of the GEMM's columns, and it, the bias and the ReLU become the write-back's store: one
    kernel, no buffer of taps."""
    model = conv_transpose_model(16, 8, 9, 2, 2)
    mod = fuse(import_onnx(model), target)
    notes = schedule_notes(mod)
    assert "becomes an index change" in notes and "epilogue" in notes, notes
    funcs = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(funcs) == 1, [f.attrs["global_symbol"] for f in funcs]


def test_overlapping_taps_sum_after_the_gemm():
    """A 4×4/2 kernel: up to four taps reach an output, the col2im sums them after the GEMM
    (a stage of its own, bias and ReLU with it)."""
    model = conv_transpose_model(8, 5, 7, 4, 2, (1, 1, 1, 1))
    notes = schedule_notes(fuse(import_onnx(model), AVX2))
    assert "packed GEMM" in notes and "at the last K block" not in notes, notes


def test_symbolic_batch_and_groups():
    """A symbolic batch runs the GEMM once per image; a grouped ConvTranspose keeps TOPI's
    conv (both against ONNX Runtime and stock)."""
    model = conv_transpose_model(8, 4, 9, 3, 2, (1, 1, 1, 1), (1, 1))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "n"
    notes = schedule_notes(fuse(import_onnx(model), AVX2))
    assert "packed GEMM" in notes and "one GEMM per image" in notes, notes
    for batch in (1, 3):
        _check(model, AVX2, [batch, 8, 9, 9])
    grouped = conv_transpose_model(8, 6, 5, 2, 2, groups=2)
    assert "packed GEMM" not in schedule_notes(fuse(import_onnx(grouped), AVX2))
    _check(grouped, AVX2)


@pytest.mark.parametrize("target", [ZEN3, AVX512, AARCH64], ids=["avx2", "avx512", "aarch64"])
def test_conv_transpose_gemm_cross_compiles_without_spills(target):
    """Compile only (AArch64 cross-compiled): the GEMM's FMA loops keep every accumulator in
    registers, for the one-tap upsampling and for an overlapping kernel."""
    if "aarch64" in str(target) and "aarch64" not in str(
            tvm.target.codegen.llvm_get_targets()):
        pytest.skip("LLVM built without the AArch64 backend")
    for model in (conv_transpose_model(32, 16, 12, 2, 2),
                  conv_transpose_model(32, 8, 10, 3, 2, (1, 1, 1, 1), (1, 1))):
        loops = fma_loops(assembly(model, target))
        assert loops and all(stack == 0 for _, _, stack in loops), loops

"""Issue 22: AArch64 code run on an emulated AArch64 device through TVM's RPC, against ONNX Runtime.

The device is ``scripts/arm64_device.py``: a real ``tvm.exec.rpc_server`` in an AArch64 Python
under ``qemu-aarch64-static``, registered at a tracker on 127.0.0.1 (fixtures ``arm64`` and
``arm64_device`` in conftest.py; skipped with the reason where qemu or the cross g++ is absent).
Models are compiled here for ``{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr":
["+neon"]}``, linked with ``aarch64-linux-gnu-g++``, uploaded, run there and compared with
ONNX Runtime on the same inputs. Emulated timings mean nothing; only outputs are checked.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion.compile import compile_model, fuse, graph_input_names, import_onnx, load_onnx
from tvm_fusion.feeds import random_inputs
from tvm_fusion.models import transformer_encoder_layer
from tvm_fusion.models.conv_chains import chain_model
from tvm_fusion.numerics import compare, max_abs_error, onnx_reference
from tvm_fusion.tuning import tune as T

AARCH64 = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"], "num-cores": 2}
MODELS_DIR = Path(os.environ.get("TVM_FUSION_MODELS", Path(__file__).parent.parent / "models"))


def check_on_device(device, model, name: str, suffix: str = ".so", rtol=1e-4, atol=1e-4,
                    **options) -> float:
    """Compile ``model`` for AArch64, run it on ``device``, compare with ONNX Runtime; returns
    the max abs error (printed with the model's name)."""
    target = T.resolve_target(AARCH64)
    executable = compile_model(import_onnx(model), target, **options)
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[n] for n in graph_input_names(model)]
    got = T.remote_run(executable, inputs, device.tracker, device.key, target, suffix=suffix)
    reference = onnx_reference(model, feeds)
    err = max_abs_error(got, reference)
    print(f"\n[issue 22] {name} on the emulated AArch64 device ({suffix}): max |err| vs ORT "
          f"{err:.2e}")
    compare(got, reference, rtol=rtol, atol=atol)
    return err


# ------------------------------------------------------------------------- default suite

@pytest.mark.timeout(600)
def test_small_conv_net_with_conv_chains(arm64_device):
    """A depthwise-pointwise chain that conv_chains fuses into one kernel (the OptiFX
    template's AArch64 code), then a plain 3x3 conv + maxpool net."""
    chain = chain_model(32, 28, [("conv", -1, 3, 1, 1, -1, "relu6"),
                                 ("conv", 16, 1, 1, 0, 1, None)])
    check_on_device(arm64_device, chain, "dw-pw chain (conv_chains=cost_model)",
                    conv_chains="cost_model")
    net = chain_model(8, 16, [("conv", 16, 3, 1, 1, 1, "relu"), ("maxpool", 3, 2, 1),
                              ("conv", 8, 1, 1, 0, 1, "relu")], seed=1)
    check_on_device(arm64_device, net, "conv-maxpool-conv net (.tar, linked on the device)",
                    suffix=".tar")


@pytest.mark.timeout(600)
def test_packed_gemm_tails_and_epilogue(arm64_device):
    """Issue 20: the packed-weight GEMM's NEON code (8×12 tile) with an M tail (19 = 2·8 +
    2 + 1), an N tail panel (37 = 3·12 + 1), several K blocks (700) and a bias + GELU
    epilogue at the last one."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"]),
         helper.make_node("Gelu", ["z"], ["g"])], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [19, 700])],
        [helper.make_tensor_value_info("g", TensorProto.FLOAT, [19, 37])],
        [numpy_helper.from_array(rng.standard_normal((700, 37)).astype("float32"), "W"),
         numpy_helper.from_array(rng.standard_normal(37).astype("float32"), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    check_on_device(arm64_device, model, "packed GEMM 19x700x37 + bias + GELU", atol=2e-4)


@pytest.mark.timeout(600)
def test_small_transformer_block(arm64_device):
    model = transformer_encoder_layer(seq=32, hidden=64, heads=4, ffn=256)
    check_on_device(arm64_device, model, "transformer encoder layer (seq 32, hidden 64)")


@pytest.mark.timeout(900)
def test_tinybert_sized_layer(arm64_device):
    """A TinyBERT-4 layer's shapes (hidden 312, 12 heads, FFN 1200, seq 128), built with
    tvm_fusion.models: needs no zoo export."""
    model = transformer_encoder_layer(seq=128, hidden=312, heads=12, ffn=1200)
    check_on_device(arm64_device, model, "TinyBERT-sized encoder layer", rtol=1e-3, atol=1e-3)


@pytest.mark.timeout(900)
def test_mobilenet_v2_blocks(arm64_device):
    """Two MobileNetV2 inverted residuals' convs (expand 1x1, depthwise 3x3 stride 2,
    project 1x1) at 56x56, conv_chains on."""
    model = chain_model(24, 56, [("conv", 144, 1, 1, 0, 1, "relu6"),
                                 ("conv", -1, 3, 2, 1, -1, "relu6"),
                                 ("conv", 32, 1, 1, 0, 1, None),
                                 ("conv", 192, 1, 1, 0, 1, "relu6"),
                                 ("conv", -1, 3, 1, 1, -1, "relu6"),
                                 ("conv", 32, 1, 1, 0, 1, None)])
    check_on_device(arm64_device, model, "MobileNetV2 blocks (conv_chains=cost_model)",
                    conv_chains="cost_model", rtol=1e-3, atol=1e-3)


@pytest.mark.timeout(900)
def test_resnet50_bottleneck_convs(arm64_device):
    """ResNet-50's first bottleneck's convs (1x1 64, 3x3 64, 1x1 256 at 56x56; no residual
    add: chain_model is single-path)."""
    model = chain_model(64, 56, [("conv", 64, 1, 1, 0, 1, "relu"),
                                 ("conv", 64, 3, 1, 1, 1, "relu"),
                                 ("conv", 256, 1, 1, 0, 1, None)], seed=2)
    check_on_device(arm64_device, model, "ResNet-50 bottleneck convs", rtol=1e-3, atol=1e-3)


# One conv per case, each on its own input (one model, one upload): the 1×1 conv on the flat
# positions, 3×3 stride 2 (the column phases), odd channels with padding (a tail panel, rows
# padded to whole panels), two K blocks of per-block packed panels, the positions as rows
# (fewer positions than output channels), and a 1×1 conv on one position (a squeeze-excite's).
# (c_in, c_out, map, kernel, stride, pad)
CONV_GEMM_CASES = [(16, 24, 9, 1, 1, 0), (16, 32, 14, 3, 2, 1), (17, 33, 13, 3, 1, 1),
                   (40, 16, 8, 3, 1, 1), (16, 40, 5, 3, 1, 1), (24, 20, 1, 1, 1, 0)]


def conv_gemm_cases_model():
    rng = np.random.default_rng(4)
    nodes, inputs, outputs, inits = [], [], [], []
    for i, (c_in, c_out, size, k, stride, pad) in enumerate(CONV_GEMM_CASES):
        nodes += [helper.make_node("Conv", [f"x{i}", f"W{i}", f"B{i}"], [f"c{i}"],
                                   kernel_shape=[k, k], strides=[stride] * 2, pads=[pad] * 4),
                  helper.make_node("Relu", [f"c{i}"], [f"y{i}"])]
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT,
                                                    [1, c_in, size, size]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
        inits += [numpy_helper.from_array(
                      rng.standard_normal((c_out, c_in, k, k)).astype("float32"), f"W{i}"),
                  numpy_helper.from_array(rng.standard_normal(c_out).astype("float32"), f"B{i}")]
    graph = helper.make_graph(nodes, "conv_gemms", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


@pytest.mark.timeout(900)
def test_conv_gemm_shapes(arm64_device):
    """Issue 20: dense convs as the packed GEMM, in NEON code (AArch64's 8×12 micro-kernel and
    its panel widths): every case takes the GEMM route, and all match ONNX Runtime."""
    model = conv_gemm_cases_model()
    mod = fuse(import_onnx(model), T.resolve_target(AARCH64))
    notes = [str(note) for f in mod.functions.values() if f.attrs is not None
             and "tvm_fusion.schedule" in f.attrs for note in f.attrs["tvm_fusion.schedule"]]
    gemms = [n for n in notes if "packed GEMM" in n]
    assert len(gemms) == len(CONV_GEMM_CASES), notes
    assert any("B packed per block" in n for n in gemms), gemms
    assert any("A copied row-major first" in n for n in gemms), gemms  # positions as rows
    check_on_device(arm64_device, model, "conv GEMMs (1x1, 3x3/2, odd, K blocks, positions "
                    "as rows, one position)", atol=2e-4)


@pytest.mark.timeout(900)
def test_conv_gemm_over_a_symbolic_batch(arm64_device):
    """A conv with a symbolic batch as the packed GEMM in NEON code: one image's plan in a loop
    over the images (odd channels, stride 2, padding), one build run at batch 1 and 3."""
    c_in, c_out, size = 17, 33, 13
    rng = np.random.default_rng(6)
    node = helper.make_node("Conv", ["x", "W", "B"], ["y"], kernel_shape=[3, 3],
                            strides=[2, 2], pads=[1] * 4)
    graph = helper.make_graph(
        [node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                       ["batch", c_in, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rng.standard_normal((c_out, c_in, 3, 3)).astype("float32"),
                                 "W"),
         numpy_helper.from_array(rng.standard_normal(c_out).astype("float32"), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    target = T.resolve_target(AARCH64)
    mod = fuse(import_onnx(model), target)
    notes = [str(note) for f in mod.functions.values() if f.attrs is not None
             and "tvm_fusion.schedule" in f.attrs for note in f.attrs["tvm_fusion.schedule"]]
    assert any("one GEMM per image" in n for n in notes), notes
    executable = compile_model(import_onnx(model), target)
    for batch in (1, 3):
        x = rng.standard_normal((batch, c_in, size, size)).astype("float32")
        got = T.remote_run(executable, [x], arm64_device.tracker, arm64_device.key, target)
        compare(got, onnx_reference(model, {"x": x}), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- slow set

@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", ["mobilenet_v2", "resnet50", "tinybert", "efficientnet_b0"])
def test_zoo_model(arm64_device, name):
    path = MODELS_DIR / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} missing: run `python -m tvm_fusion.export_models --only {name}` "
                    "(needs pip install -e '.[models]', i.e. torch)")
    check_on_device(arm64_device, load_onnx(path), name, rtol=1e-3, atol=1e-3)

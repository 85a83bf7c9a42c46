"""The zoo's registry (``tvm_fusion.export_models``): what each spec promises holds together,
and the locally defined architectures build and run. Exporting whole models is the export
script's job (``python -m tvm_fusion.export_models``); their checks are in test_real_models."""

from __future__ import annotations

import pytest

from tvm_fusion import export_models as zoo

# the architectures issue 19 added (a decoder with GQA/RoPE/RMSNorm/SwiGLU, an LM with its
# vocabulary head, depthwise 7x7 + channel LayerNorm, a YOLO-style head, a diffusion block, a
# second 3-D conv net, fp16, QDQ int8, a dynamic batch, speech with 1-D convs)
ADDED = ["llama_decoder", "gpt2_lm", "convnext_t", "yolov8n", "sd_unet_block", "r2plus1d_18",
         "mobilenet_v3_fp16", "resnet18_int8", "regnet_y_400mf", "wav2vec2"]


def test_the_zoo_has_the_added_architectures():
    assert set(ADDED) <= set(zoo.MODELS)
    assert len(zoo.MODELS) == 15 + len(ADDED)
    assert zoo.MODELS["mobilenet_v3_fp16"].precision == "fp16"
    assert zoo.MODELS["mobilenet_v3_fp16"].inputs[0].dtype == "float16"
    assert zoo.MODELS["resnet18_int8"].precision == "int8"
    assert zoo.MODELS["regnet_y_400mf"].dynamic_in_zoo


@pytest.mark.parametrize("name", sorted(zoo.MODELS))
def test_symbolic_dimensions_name_real_inputs(name):
    spec = zoo.MODELS[name]
    inputs = {i.name: i for i in spec.inputs}
    for input_name, axis, dim in spec.symbolic:
        assert input_name in inputs and axis < len(inputs[input_name].shape)
        assert dim in zoo.TRACE_SIZES and dim in zoo.CHECK_SIZES
    assert spec.precision in zoo.TOLERANCE


@pytest.mark.parametrize("name", sorted(zoo.SMALL))
def test_small_configurations_mirror_the_full_specs(name):
    """Piece 1's models are defined once: the full spec names its tiny configuration, which
    has the same inputs and symbolic dimensions."""
    small, full = zoo.SMALL[name], zoo.MODELS[name]
    assert full.small is small
    assert small.symbolic == full.symbolic
    assert [i.name for i in small.inputs] == [i.name for i in full.inputs]
    assert small.outputs == full.outputs


def test_symbolic_exports_are_written_beside_the_zoo(tmp_path):
    spec = zoo.MODELS["gpt2_lm"]
    assert zoo.symbolic_path(tmp_path, spec, "dynamo") == tmp_path / "symbolic/gpt2_lm.dynamo.onnx"
    assert zoo.symbolic_path(tmp_path, spec, "torch_export").suffix == ".pt2"
    assert zoo.dynamic_axes(zoo.MODELS["bert_base"]) == {"input_ids": {1: "seq"},
                                                         "attention_mask": {1: "seq"}}
    feeds = zoo.random_inputs(zoo.MODELS["vit_b16"], sizes={"batch": 3})
    assert feeds["input"].shape == (3, 3, 224, 224)


def test_local_architectures_run():
    torch = pytest.importorskip("torch")
    from tvm_fusion import export_architectures as arch

    yolo = arch.yolo_v8n().eval()
    with torch.no_grad():
        out = yolo(torch.randn(1, 3, 64, 64))
    # per level 64 box bins + 80 classes, over (64/8)^2 + (64/16)^2 + (64/32)^2 cells
    assert tuple(out.shape) == (1, 144, 64 + 16 + 4)
    block = arch.sd_unet_block(channels=64, context_dim=32, heads=4, time_dim=128).eval()
    with torch.no_grad():
        out = block(torch.randn(1, 64, 8, 8), torch.randn(1, 128), torch.randn(1, 5, 32))
    assert tuple(out.shape) == (1, 64, 8, 8)

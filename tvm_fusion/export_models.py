"""Export real architectures (random, seeded weights) to ONNX for the fusion benchmarks.

Nothing can be fetched from model hubs, so every model is built from its definition
(torchvision / transformers config classes / a local U-Net) and exported with batch 1, fp32,
static shapes, opset 17 (TorchScript exporter; torch.export-based one only as a fallback).
Weights are seeded and "calibrated" (see ``calibrate``) so outputs are neither zero nor tiny,
static shape arithmetic is folded (see ``simplify``) so TVM's ONNX frontend accepts every graph,
and a file only lands in the zoo folder (``./models``; ``--out`` or ``$TVM_FUSION_MODELS``
override it, as for ``tvm-fusion report --zoo``) after ``onnx.checker`` and an onnxruntime run
matching PyTorch pass. Needs the ``models`` extra (``pip install "tvm_fusion[models]"``).

    python -m tvm_fusion.export_models --list
    python -m tvm_fusion.export_models --only resnet50,bert_base --force --tvm

``load_model(name)`` gives a model's path, exporting on demand. Heavy imports (torch,
transformers) happen only when exporting, so ``tvm-fusion bench`` can read ``MODELS``.
"""

import argparse
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ENV_DIR = "TVM_FUSION_MODELS"
OPSET = 17
DYNAMO_OPSET = 18  # the torch.export-based exporter does not go below 18 cleanly
SEQ_LEN = 128
SEED = 0


@dataclass(frozen=True)
class InputSpec:
    """One graph input; ``low``/``high`` bound random integer inputs (token ids, masks)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    low: int = 0
    high: int = 1


@dataclass(frozen=True)
class ModelSpec:
    """How to build one model; ``build`` returns an eval-mode ``torch.nn.Module``.

    ``symbolic`` names the dimensions that the symbolic exports (``--symbolic``) leave
    symbolic, as ``(input, axis, name)``; with ``dynamic_in_zoo`` the zoo file itself keeps
    them (a dynamic batch). ``precision`` ``"fp16"`` exports the model in half precision,
    ``"int8"`` quantizes the fp32 export to QDQ int8 (ONNX Runtime's ``quantize_static``, a
    small random calibration set). ``small`` is the same architecture in a tiny configuration,
    for tests."""

    name: str
    family: str  # "cnn" | "transformer" | "detector" | "video" | "audio" | "diffusion"
    build: Callable[[], object]
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    note: str = ""
    symbolic: tuple[tuple[str, int, str], ...] = ()
    dynamic_in_zoo: bool = False
    precision: str = "fp32"
    small: "ModelSpec | None" = None


# --------------------------------------------------------------------------------------------
# Import helpers
# --------------------------------------------------------------------------------------------


def _import_torchvision():
    """Import torchvision even when its compiled ops cannot load.

    PyPI only has CUDA builds of torchvision; next to a CPU torch their ``_C.so`` fails to load
    and ``torchvision/_meta_registrations.py`` raises "operator torchvision::nms does not exist"
    at import time (which also breaks ``import timm`` and ``import transformers`` models).
    The models we export never call torchvision ops, so skipping those registrations is safe.
    """
    import types

    try:
        import torchvision
    except RuntimeError as err:
        if "torchvision::" not in str(err):
            raise
        for key in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[key]
        stub = types.ModuleType("torchvision._meta_registrations")
        sys.modules["torchvision._meta_registrations"] = stub
        import torchvision
    return torchvision


def _transformers():
    """Import transformers after torchvision is made importable (transformers imports it)."""
    try:
        _import_torchvision()
    except ImportError:
        pass
    import transformers

    return transformers


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------


def _tv(fn_name: str, module: str = "torchvision.models", **kw) -> Callable[[], object]:
    """Builder for a torchvision classifier with ``weights=None`` (random init)."""

    def build():
        import importlib

        _import_torchvision()
        fn = getattr(importlib.import_module(module), fn_name)
        return fn(weights=None, **kw)

    return build


def _build_ssd():
    """SSDlite320-MobileNetV3 backbone + head: raw box regressions and class logits.

    The GeneralizedRCNNTransform (resize/normalise), anchor generation, box decoding and NMS
    are left out: they are data-dependent post-processing, not part of the fused network.
    """
    import torch

    _import_torchvision()
    from torchvision.models.detection import ssdlite320_mobilenet_v3_large

    det = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None)

    class SSDHead(torch.nn.Module):
        def __init__(self, det):
            super().__init__()
            self.backbone, self.head = det.backbone, det.head

        def forward(self, x):
            feats = list(self.backbone(x).values())
            out = self.head(feats)
            return out["bbox_regression"], out["cls_logits"]

    return SSDHead(det)


def _build_unet():
    """Classic U-Net (Ronneberger et al. 2015, padded convs + BN as in milesial/Pytorch-UNet)."""
    import torch
    from torch import nn

    def double_conv(cin, cout):
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )

    class UNet(nn.Module):
        def __init__(self, in_ch=3, n_classes=1, widths=(64, 128, 256, 512, 1024)):
            super().__init__()
            self.inc = double_conv(in_ch, widths[0])
            self.downs = nn.ModuleList(
                double_conv(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True)
            )
            rev = widths[::-1]
            self.ups = nn.ModuleList(
                nn.ConvTranspose2d(a, b, 2, stride=2)
                for a, b in zip(rev[:-1], rev[1:], strict=True)
            )
            self.up_convs = nn.ModuleList(
                double_conv(a, b) for a, b in zip(rev[:-1], rev[1:], strict=True)
            )
            self.outc = nn.Conv2d(widths[0], n_classes, 1)

        def forward(self, x):
            skips = [self.inc(x)]
            for down in self.downs:
                skips.append(down(nn.functional.max_pool2d(skips[-1], 2)))
            x = skips.pop()
            for up, conv in zip(self.ups, self.up_convs, strict=True):
                x = conv(torch.cat([skips.pop(), up(x)], dim=1))
            return self.outc(x)

    return UNet()


def _last_hidden_state(model, output: str = "last_hidden_state"):
    """Wrap a transformers model so the graph has one plain output (``last_hidden_state``, or
    ``logits`` of a model with its head)."""
    import torch

    class LastHidden(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, input_ids, attention_mask=None):
            # An explicit all-ones mask (HF's own default) keeps GPT-2 off the packed-sequence
            # detection path, whose aten::diff the TorchScript exporter cannot translate.
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask)
            return getattr(out, output)

    return LastHidden(model)


def _hf(model_cls: str, config_cls: str, model_kw=None, output="last_hidden_state", **cfg):
    """Builder for a transformers encoder/decoder from its config class (no from_pretrained).

    Eager attention keeps the graph as plain MatMul/Softmax instead of an SDPA pattern.
    """

    def build():
        T = _transformers()
        config = getattr(T, config_cls)(attn_implementation="eager", **cfg)
        model = getattr(T, model_cls)(config, **(model_kw or {}))
        return _last_hidden_state(model, output)

    return build


def _hf_audio(model_cls: str, config_cls: str, **cfg):
    """Builder for a transformers speech encoder on raw audio (``input_values``)."""

    def build():
        import torch

        T = _transformers()
        config = getattr(T, config_cls)(attn_implementation="eager", **cfg)
        model = getattr(T, model_cls)(config)

        class Audio(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.model = m

            def forward(self, input_values):
                return self.model(input_values=input_values).last_hidden_state

        return Audio(model)

    return build


def _local(fn_name: str, **kw) -> Callable[[], object]:
    """Builder for an architecture of :mod:`tvm_fusion.export_architectures`."""

    def build():
        from . import export_architectures

        return getattr(export_architectures, fn_name)(**kw)

    return build


def _vit_small():
    """ViT-B/16's architecture (torchvision) at image 32, patch 8, 2 layers, width 64."""
    _import_torchvision()
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                             hidden_dim=64, mlp_dim=128, num_classes=10)


def _img(h=224, w=224) -> tuple[InputSpec, ...]:
    return (InputSpec("input", (1, 3, h, w)),)


def _tokens(vocab: int, with_mask: bool = True) -> tuple[InputSpec, ...]:
    ids = InputSpec("input_ids", (1, SEQ_LEN), "int64", 0, vocab)
    if not with_mask:
        return (ids,)
    return (ids, InputSpec("attention_mask", (1, SEQ_LEN), "int64", 1, 2))


BERT_VOCAB = 30522
SMALL_VOCAB = 1000
SEQ = (("input_ids", 1, "seq"), ("attention_mask", 1, "seq"))
BATCH = (("input", 0, "batch"),)
LLAMA = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
             max_position_embeddings=2048, rms_norm_eps=1e-5, use_cache=False)
SMALL_LLAMA = dict(LLAMA, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                   vocab_size=SMALL_VOCAB, max_position_embeddings=512)
SMALL_BERT = dict(vocab_size=SMALL_VOCAB, hidden_size=128, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=256)
SMALL_GPT2 = dict(vocab_size=SMALL_VOCAB, n_embd=128, n_layer=2, n_head=4, use_cache=False,
                  bos_token_id=0, eos_token_id=0)
# the transformers models of Piece 1 (issue 24) in tiny configurations: same architecture,
# seconds to export and compile
SMALL: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("bert_base", "transformer",
                  _hf("BertModel", "BertConfig", model_kw={"add_pooling_layer": False},
                      **SMALL_BERT),
                  _tokens(SMALL_VOCAB), ("last_hidden_state",), symbolic=SEQ),
        ModelSpec("gpt2_lm", "transformer",
                  _hf("GPT2LMHeadModel", "GPT2Config", output="logits", **SMALL_GPT2),
                  _tokens(SMALL_VOCAB, with_mask=False), ("logits",), symbolic=SEQ[:1]),
        ModelSpec("llama_decoder", "transformer",
                  _hf("LlamaModel", "LlamaConfig", **SMALL_LLAMA),
                  _tokens(SMALL_VOCAB, with_mask=False), ("last_hidden_state",),
                  symbolic=SEQ[:1]),
        ModelSpec("vit_b16", "transformer", _vit_small, _img(32, 32), ("logits",),
                  symbolic=BATCH),
    ]
}
MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("efficientnet_b0", "cnn", _tv("efficientnet_b0"), _img(), ("logits",)),
        ModelSpec("vgg16", "cnn", _tv("vgg16"), _img(), ("logits",)),
        ModelSpec("resnet50", "cnn", _tv("resnet50"), _img(), ("logits",)),
        ModelSpec("mobilenet_v2", "cnn", _tv("mobilenet_v2"), _img(), ("logits",)),
        ModelSpec(
            "ssd_mobilenet",
            "detector",
            _build_ssd,
            _img(320, 320),
            ("bbox_regression", "cls_logits"),
            note="torchvision ssdlite320_mobilenet_v3_large backbone+head, no transform/NMS",
        ),
        ModelSpec(
            "r3d_18",
            "video",
            _tv("r3d_18", "torchvision.models.video"),
            (InputSpec("input", (1, 3, 16, 112, 112)),),
            ("logits",),
        ),
        ModelSpec(
            "unet",
            "cnn",
            _build_unet,
            _img(256, 256),
            ("mask_logits",),
            note="local U-Net, widths 64..1024, 1 output class",
        ),
        ModelSpec("swin_t", "transformer", _tv("swin_t"), _img(), ("logits",)),
        ModelSpec("vit_b16", "transformer", _tv("vit_b_16"), _img(), ("logits",),
                  symbolic=BATCH, small=SMALL["vit_b16"]),
        ModelSpec(
            "tinybert",
            "transformer",
            _hf(
                "BertModel",
                "BertConfig",
                model_kw={"add_pooling_layer": False},
                num_hidden_layers=4,
                hidden_size=312,
                num_attention_heads=12,
                intermediate_size=1200,
            ),
            _tokens(BERT_VOCAB),
            ("last_hidden_state",),
            note="TinyBERT General 4L-312D config",
            symbolic=SEQ,
        ),
        ModelSpec(
            "distilbert",
            "transformer",
            _hf("DistilBertModel", "DistilBertConfig"),
            _tokens(BERT_VOCAB),
            ("last_hidden_state",),
            symbolic=SEQ,
        ),
        ModelSpec(
            "albert",
            "transformer",
            _hf(
                "AlbertModel",
                "AlbertConfig",
                model_kw={"add_pooling_layer": False},
                embedding_size=128,
                hidden_size=768,
                num_attention_heads=12,
                intermediate_size=3072,
                num_hidden_layers=12,
                hidden_act="gelu_new",
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            ),
            _tokens(30000),
            ("last_hidden_state",),
            note="albert-base-v2 config",
        ),
        ModelSpec(
            "bert_base",
            "transformer",
            _hf("BertModel", "BertConfig", model_kw={"add_pooling_layer": False}),
            _tokens(BERT_VOCAB),
            ("last_hidden_state",),
            note="bert-base-uncased config, no pooler",
            symbolic=SEQ,
            small=SMALL["bert_base"],
        ),
        ModelSpec(
            "mobilebert",
            "transformer",
            _hf("MobileBertModel", "MobileBertConfig", model_kw={"add_pooling_layer": False}),
            _tokens(BERT_VOCAB),
            ("last_hidden_state",),
        ),
        ModelSpec(
            "gpt2",
            "transformer",
            _hf("GPT2Model", "GPT2Config", use_cache=False),
            _tokens(50257, with_mask=False),
            ("last_hidden_state",),
            note="GPT2Model (no LM head), gpt2 124M config, use_cache=False",
            symbolic=SEQ[:1],
        ),
        # -- added with issue 19 (ten architectures the zoo lacked) and issue 24 --
        ModelSpec(
            "llama_decoder",
            "transformer",
            _hf("LlamaModel", "LlamaConfig", **LLAMA),
            _tokens(32000, with_mask=False),
            ("last_hidden_state",),
            note="Llama-style decoder, 2 layers: GQA (8 heads, 2 KV heads), RoPE, RMSNorm, "
                 "SwiGLU; hidden 512",
            symbolic=SEQ[:1],
            small=SMALL["llama_decoder"],
        ),
        ModelSpec(
            "gpt2_lm",
            "transformer",
            _hf("GPT2LMHeadModel", "GPT2Config", output="logits", use_cache=False),
            _tokens(50257, with_mask=False),
            ("logits",),
            note="GPT2LMHeadModel: gpt2 124M config with its tied 50257-word head",
            symbolic=SEQ[:1],
            small=SMALL["gpt2_lm"],
        ),
        ModelSpec("convnext_t", "cnn", _tv("convnext_tiny"), _img(), ("logits",),
                  note="ConvNeXt-T: depthwise 7x7 convs, LayerNorm over channels"),
        ModelSpec(
            "yolov8n",
            "detector",
            _local("yolo_v8n"),
            _img(320, 320),
            ("head",),
            note="YOLOv8-n backbone, neck and head (C2f Split/Concat, SPPF, SiLU), raw "
                 "outputs without box decoding",
        ),
        ModelSpec(
            "sd_unet_block",
            "diffusion",
            _local("sd_unet_block"),
            (InputSpec("latent", (1, 320, 32, 32)), InputSpec("temb", (1, 1280)),
             InputSpec("context", (1, 77, 768))),
            ("out",),
            note="Stable-Diffusion 1.x U-Net block: ResBlock (GroupNorm, SiLU, timestep "
                 "embedding) + spatial transformer (self- and cross-attention, GEGLU)",
        ),
        ModelSpec("r2plus1d_18", "video", _tv("r2plus1d_18", "torchvision.models.video"),
                  (InputSpec("input", (1, 3, 8, 112, 112)),), ("logits",),
                  note="R(2+1)D-18: 3-D convs factorised into spatial and temporal ones"),
        ModelSpec("mobilenet_v3_fp16", "cnn", _tv("mobilenet_v3_large"),
                  (InputSpec("input", (1, 3, 224, 224), "float16"),), ("logits",),
                  note="MobileNetV3-Large exported in half precision", precision="fp16"),
        ModelSpec("resnet18_int8", "cnn", _tv("resnet18"), _img(), ("logits",),
                  note="ResNet-18 quantized to QDQ int8 (onnxruntime quantize_static, "
                       "random calibration)", precision="int8"),
        ModelSpec("regnet_y_400mf", "cnn", _tv("regnet_y_400mf"), _img(), ("logits",),
                  note="RegNetY-400MF (grouped convs, squeeze-excitation) with a dynamic batch",
                  symbolic=BATCH, dynamic_in_zoo=True),
        ModelSpec(
            "wav2vec2",
            "audio",
            _hf_audio("Wav2Vec2Model", "Wav2Vec2Config", hidden_size=384, num_hidden_layers=4,
                      num_attention_heads=6, intermediate_size=1536,
                      conv_dim=(256,) * 7, feat_extract_norm="group",
                      num_conv_pos_embeddings=64, num_conv_pos_embedding_groups=16,
                      do_stable_layer_norm=False),
            (InputSpec("input_values", (1, 16000)),),
            ("last_hidden_state",),
            note="wav2vec 2.0-style speech encoder: 7 strided 1-D convs (GroupNorm), a grouped "
                 "positional conv, 4 transformer layers; 1 s of 16 kHz audio",
        ),
    ]
}


# --------------------------------------------------------------------------------------------
# Export + checks
# --------------------------------------------------------------------------------------------


def models_dir(out_dir: str | os.PathLike | None = None) -> Path:
    """The zoo folder: ``out_dir``, else ``$TVM_FUSION_MODELS``, else ``./models``."""
    return Path(out_dir or os.environ.get(ENV_DIR) or "models")


def random_inputs(spec: ModelSpec, seed: int = SEED, sizes: dict | None = None) -> dict:
    """Seeded numpy feeds matching the spec, for onnxruntime / TVM comparisons; ``sizes``
    (symbolic dimension name -> size) resizes the spec's symbolic dimensions."""
    import numpy as np

    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in spec.inputs:
        shape = list(inp.shape)
        for name, axis, dim in spec.symbolic:
            if name == inp.name and sizes and dim in sizes:
                shape[axis] = sizes[dim]
        if inp.dtype == "int64":
            feeds[inp.name] = rng.integers(inp.low, inp.high, shape, dtype=np.int64)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(inp.dtype)
    return feeds


def dynamic_axes(spec: ModelSpec) -> dict[str, dict[int, str]]:
    """``torch.onnx.export``'s ``dynamic_axes`` of the spec's symbolic dimensions."""
    axes: dict[str, dict[int, str]] = {}
    for name, axis, dim in spec.symbolic:
        axes.setdefault(name, {})[axis] = dim
    return axes


def calibrate(model, spec: ModelSpec, batch: int = 4):
    """Make the random weights numerically meaningful for correctness tests.

    Library inits leave biases at 0, norm scales at 1 and some heads at 0 (torchvision ViT),
    and with identity BatchNorm statistics EfficientNet/MobileNet/SSD outputs shrink to ~1e-14:
    a fusion bug that drops a bias-add or a BN would then go unnoticed. So: constant tensors
    get N(0, 0.1) noise, all-zero matrices N(0, 0.02), and BatchNorm running statistics are
    measured on one random batch (like a calibration pass). Uses the global (seeded) RNG.
    """
    import torch
    from torch import nn

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, 0.02)
            elif p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(torch.randn_like(p) * 0.1)
        bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if bns:
            for bn in bns:
                bn.reset_running_stats()
                bn.momentum = None  # cumulative average: one batch gives its exact statistics
                bn.train()
            model(*(torch.randn(batch, *i.shape[1:]) for i in spec.inputs))
            for bn in bns:
                bn.momentum = 0.1
    return model.eval()


def _torch_export(model, args, path: Path, spec: ModelSpec) -> str:
    """Legacy TorchScript exporter first (plain ONNX ops); torch.export-based one as fallback.

    No ``torch.no_grad()`` here: under it ``nn.MultiheadAttention`` takes its fused fast path
    (``aten::_native_multi_head_attention``), which the TorchScript exporter cannot translate.
    A spec with ``dynamic_in_zoo`` keeps its symbolic dimensions.
    """
    import torch

    common = dict(input_names=[i.name for i in spec.inputs], output_names=list(spec.outputs))
    if spec.dynamic_in_zoo:
        common["dynamic_axes"] = dynamic_axes(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(model, args, str(path), dynamo=False, opset_version=OPSET, **common)
            return f"torchscript/opset{OPSET}"
        except Exception as err:  # any tracer failure: try dynamo
            legacy_err = err
        try:
            torch.onnx.export(
                model, args, str(path), dynamo=True, opset_version=DYNAMO_OPSET, **common
            )
            return f"dynamo/opset{DYNAMO_OPSET}"
        except Exception as err:
            raise RuntimeError(f"legacy: {_reason(legacy_err)}; dynamo: {_reason(err)}") from err


# ORT's basic level minus every rewrite that changes the operator mix: what is left is constant
# folding (incl. Shape of static tensors), CSE and Identity/no-op elimination.
_ORT_DISABLED = [
    "MatMulAddFusion",
    "ConvAddFusion",
    "ConvMulFusion",
    "ConvBNFusion",
    "ReluClipFusion",
    "PadFusion",
    "DivMulFusion",
    "NotWhereFusion",
    "GemmTransposeFusion",
    "GeluFusionL1",
    "LayerNormFusionL1",
    "SliceConcatToSpaceToDepthFusion",
    "TransposeOptimizer",
]


def simplify(src: Path, dst: Path) -> None:
    """Fold the exporter's static shape arithmetic so TVM's ONNX frontend accepts the graph.

    The traced graphs carry Shape/Gather/Concat/ConstantOfShape chains (HF mask creation,
    torchvision Swin padding, MobileBERT trigram Pad) that TVM 0.27 rejects ("Dynamic pads",
    0-d ConstantOfShape, Reshape of unknown shape) although every shape here is static.
    """
    import onnx
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.optimized_model_filepath = str(dst)
    opts.log_severity_level = 3
    ort.InferenceSession(
        str(src), opts, providers=["CPUExecutionProvider"], disabled_optimizers=_ORT_DISABLED
    )
    model = onnx.load(str(dst))
    _refuse_hardswish(model.graph)
    used = {n.domain for n in model.graph.node} | {""}  # ORT lists all its contrib domains
    keep = [o for o in model.opset_import if o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    onnx.save(model, str(dst))


def _refuse_hardswish(graph) -> None:
    """Undo ORT's inlining of HardSwish (an ONNX function op) into HardSigmoid + Mul."""
    import onnx

    nodes = [onnx.NodeProto.FromString(n.SerializeToString()) for n in graph.node]
    uses: dict[str, int] = {}
    for node in nodes:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    sigmoids = {}
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if (
            node.op_type == "HardSigmoid"
            and abs(attrs.get("alpha", 0.2) - 1 / 6) < 1e-6
            and abs(attrs.get("beta", 0.5) - 0.5) < 1e-6
            and uses[node.output[0]] == 1
        ):
            sigmoids[node.output[0]] = node.input[0]
    fused, out = set(), []
    for node in nodes:
        hs = next((i for i in node.input if i in sigmoids), None)
        if node.op_type == "Mul" and hs and set(node.input) == {hs, sigmoids[hs]}:
            fused.add(hs)
            node = onnx.helper.make_node("HardSwish", [sigmoids[hs]], list(node.output), node.name)
        out.append(node)
    del graph.node[:]
    graph.node.extend(n for n in out if not (n.op_type == "HardSigmoid" and n.output[0] in fused))


def _reason(err: BaseException) -> str:
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0][:160] if lines else ''}"


@dataclass
class Result:
    """Outcome of one export, printed as the one-line summary."""

    name: str
    ok: bool = False
    cached: bool = False
    nodes: int = 0
    raw_nodes: int = 0
    params_mb: float = 0.0
    seconds: float = 0.0
    max_err: float = 0.0
    exporter: str = ""
    error: str = ""
    tvm: str = ""

    def line(self) -> str:
        state = "cached" if self.cached else ("ok" if self.ok else f"FAILED ({self.error})")
        raw = f"(raw {self.raw_nodes})" if self.raw_nodes else ""
        err = f"err={self.max_err:.1e}" if self.ok and not self.cached else ""
        text = (
            f"{self.name:<16} nodes={self.nodes:<5}{raw:<11} params={self.params_mb:7.1f}MB "
            f"time={self.seconds:5.1f}s {self.exporter:<19} {err:<12} {state}"
        )
        return text + (f" | tvm: {self.tvm}" if self.tvm else "")


def onnx_stats(path: Path) -> tuple[int, float]:
    """Top-level node count and initializer megabytes (without materialising the tensors)."""
    import numpy as np
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    nbytes = 0
    for init in model.graph.initializer:
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
        nbytes += int(np.prod(init.dims, dtype=np.int64)) * itemsize
    return len(model.graph.node), nbytes / 1e6


# ONNX Runtime vs PyTorch, relative to the output's magnitude, per precision: fp16 rounds
# differently in the two; int8 is ONNX Runtime's quantized model against PyTorch's fp32 one
TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2, "int8": 0.25}


def verify(path: Path, spec: ModelSpec, feeds: dict, expected: list) -> float:
    """onnx.checker plus one onnxruntime run; returns the max abs error against PyTorch."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    onnx.checker.check_model(str(path), full_check=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outs = sess.run(None, feeds)
    tolerance = TOLERANCE[spec.precision]
    if len(outs) != len(expected):
        raise RuntimeError(f"expected {len(expected)} outputs, got {len(outs)}")
    worst = 0.0
    for got, ref in zip(outs, expected, strict=True):
        if got.shape != ref.shape:
            raise RuntimeError(f"output shape {got.shape} != torch {ref.shape}")
        if not np.isfinite(got).all():
            raise RuntimeError("onnxruntime produced non-finite outputs")
        err = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
        if err > tolerance * (1.0 + float(np.max(np.abs(ref)))):
            raise RuntimeError(f"onnxruntime differs from torch by {err:.3g}")
        worst = max(worst, err)
    return worst


def quantize_qdq(src: Path, dst: Path, spec: ModelSpec, seed: int = SEED,
                 samples: int = 8) -> None:
    """``src`` quantized to QDQ int8 (weights and activations, symmetric, per tensor) by ONNX
    Runtime's ``quantize_static``, calibrated on ``samples`` random inputs."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([random_inputs(spec, seed + 1 + i) for i in range(samples)])

        def get_next(self):
            return next(self.feeds, None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)


def _set_metadata(path: Path, spec: ModelSpec, exporter: str, seed: int, raw: bool) -> None:
    """Record provenance in the file: random weights must never pass for trained ones."""
    import onnx
    import torch

    model = onnx.load(str(path))
    props = {
        "tvm_fusion.model": spec.name,
        "tvm_fusion.family": spec.family,
        "tvm_fusion.weights": f"random (calibrated, see calibrate()), seed {seed}",
        "tvm_fusion.exporter": f"{exporter} torch={torch.__version__}",
        "tvm_fusion.simplified": "none" if raw or spec.precision == "fp16"
        else "onnxruntime basic, fusions disabled",
    }
    if spec.note:
        props["tvm_fusion.note"] = spec.note
    onnx.helper.set_model_props(model, props)
    onnx.save(model, str(path))


def export_model(spec: ModelSpec, out_dir: Path, seed: int = SEED, raw: bool = False) -> Result:
    """Build, export to temp files, simplify, verify, then atomically move into place."""
    import torch

    res = Result(spec.name)
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{spec.name}.onnx"
    tmp_raw = out_dir / f".{spec.name}.{os.getpid()}.raw.onnx.tmp"
    tmp = out_dir / f".{spec.name}.{os.getpid()}.onnx.tmp"
    try:
        torch.manual_seed(seed)
        model = calibrate(spec.build().eval(), spec)
        if spec.precision == "fp16":
            model = model.half()
        feeds = random_inputs(spec, seed)
        args = tuple(torch.from_numpy(feeds[i.name]) for i in spec.inputs)
        expected = _torch_outputs(model, args)
        others = []  # a dynamic dimension is checked at a second size too
        if spec.dynamic_in_zoo:
            sizes = {dim: CHECK_SIZES[dim][-1] for _, _, dim in spec.symbolic}
            more = random_inputs(spec, seed + 1, sizes)
            others.append((more, _torch_outputs(model, tuple(
                torch.from_numpy(more[i.name]) for i in spec.inputs))))
        res.exporter = _torch_export(model, args, tmp_raw, spec)
        del model
        if raw or spec.precision == "fp16":  # ORT's optimiser would wrap fp16 ops in Casts
            os.replace(tmp_raw, tmp)
        else:
            res.raw_nodes = onnx_stats(tmp_raw)[0]
            simplify(tmp_raw, tmp)
        if spec.precision == "int8":
            quantize_qdq(tmp, tmp_raw, spec, seed)
            os.replace(tmp_raw, tmp)
            res.exporter += "+qdq-int8"
        _set_metadata(tmp, spec, res.exporter, seed, raw)
        res.max_err = verify(tmp, spec, feeds, expected)
        for more, outs in others:
            res.max_err = max(res.max_err, verify(tmp, spec, more, outs))
        res.nodes, res.params_mb = onnx_stats(tmp)
        os.replace(tmp, final)
        res.ok = True
    except Exception as err:  # report, go on with the next model
        res.error = _reason(err)
    finally:
        tmp_raw.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    res.seconds = time.perf_counter() - start
    return res


def _torch_outputs(model, args) -> list:
    import torch

    with torch.no_grad():
        out = model(*args)
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


# --------------------------------------------------------------------------------------------
# Symbolic exports (issue 24): the transformer models with a symbolic sequence (or batch),
# through both ONNX exporters and torch.export, raw (no simplification: the frontend's job)
# --------------------------------------------------------------------------------------------

SYMBOLIC_EXPORTERS = ("dynamo", "torchscript", "torch_export")
# sizes traced at (a batch of 1 would be specialised by torch.export) and checked at
TRACE_SIZES = {"seq": SEQ_LEN, "batch": 2}
CHECK_SIZES = {"seq": (7, 200), "batch": (1, 3)}


def symbolic_path(out_dir: Path, spec: ModelSpec, exporter: str) -> Path:
    """Where ``--symbolic`` writes a model: ``<zoo>/symbolic/<name>.<exporter>.onnx|.pt2``."""
    suffix = "pt2" if exporter == "torch_export" else "onnx"
    return out_dir / "symbolic" / f"{spec.name}.{exporter}.{suffix}"


def export_symbolic(spec: ModelSpec, exporter: str, out_dir: Path, seed: int = SEED
                    ) -> Result:
    """Export ``spec`` with its ``symbolic`` dimensions left symbolic by ``exporter``
    (:data:`SYMBOLIC_EXPORTERS`), check it at two sizes of each against PyTorch (ONNX Runtime
    for ONNX files, the program's own module for torch.export), then move it into place."""
    import torch

    res = Result(f"{spec.name}.{exporter}")
    start = time.perf_counter()
    final = symbolic_path(out_dir, spec, exporter)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        if not spec.symbolic:
            raise ValueError(f"{spec.name} has no symbolic dimensions")
        torch.manual_seed(seed)
        model = calibrate(spec.build().eval(), spec)
        trace = random_inputs(spec, seed, TRACE_SIZES)
        args = tuple(torch.from_numpy(trace[i.name]) for i in spec.inputs)
        names = [i.name for i in spec.inputs]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if exporter == "torch_export":
                axes = dynamic_axes(spec)
                shapes = tuple({a: torch.export.Dim.AUTO for a in axes.get(n, {})}
                               for n in names)
                program = torch.export.export(model, args, dynamic_shapes=shapes)
                torch.export.save(program, str(tmp))
                res.exporter = "torch.export"
            else:
                torch.onnx.export(model, args, str(tmp), dynamo=exporter == "dynamo",
                                  opset_version=DYNAMO_OPSET if exporter == "dynamo" else OPSET,
                                  input_names=names, output_names=list(spec.outputs),
                                  dynamic_axes=dynamic_axes(spec),
                                  **({"external_data": False} if exporter == "dynamo" else {}))
                res.exporter = f"{exporter}/opset" + str(
                    DYNAMO_OPSET if exporter == "dynamo" else OPSET)
        for i in range(2):
            sizes = {dim: CHECK_SIZES[dim][i] for _, _, dim in spec.symbolic}
            feeds = random_inputs(spec, seed + i, sizes)
            expected = _torch_outputs(model, tuple(torch.from_numpy(feeds[n]) for n in names))
            if exporter == "torch_export":
                got = _torch_outputs(torch.export.load(str(tmp)).module(),
                                     tuple(torch.from_numpy(feeds[n]) for n in names))
                res.max_err = max(res.max_err, max(float(abs(g - e).max())
                                                   for g, e in zip(got, expected, strict=True)))
            else:
                res.max_err = max(res.max_err, verify(tmp, spec, feeds, expected))
        res.nodes = onnx_stats(tmp)[0] if exporter != "torch_export" else 0
        os.replace(tmp, final)
        res.ok = True
    except Exception as err:  # report, go on with the next model
        res.error = _reason(err)
    finally:
        tmp.unlink(missing_ok=True)
    res.seconds = time.perf_counter() - start
    return res


_TVM_SNIPPET = """
import sys, onnx
from tvm.relax.frontend.onnx import from_onnx
mod = from_onnx(onnx.load(sys.argv[1]), keep_params_in_input=False)
print("funcs=%d" % len(mod.functions))
"""


def tvm_import_check(path: Path, timeout: float = 900) -> str:
    """Try TVM's Relax ONNX frontend in a subprocess (a crash there must not kill the export)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _TVM_SNIPPET, str(path)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"FAILED (timeout {timeout:.0f}s)"
    if proc.returncode == 0:
        return "ok " + proc.stdout.strip().splitlines()[-1]
    tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
    err = next((ln for ln in reversed(tail) if "Error" in ln), tail[-1] if tail else "")
    return f"FAILED rc={proc.returncode} ({err.strip()[:200]})"


def load_model(name: str, out_dir: str | os.PathLike | None = None) -> Path:
    """Path to ``<name>.onnx`` in the cache, exporting it first when missing."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    path = models_dir(out_dir) / f"{name}.onnx"
    if not path.exists():
        res = export_model(MODELS[name], path.parent)
        if not res.ok:
            raise RuntimeError(f"export of {name} failed: {res.error}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvm_fusion.export_models",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help=f"cache folder (default ${ENV_DIR} or ./models)")
    parser.add_argument("--list", action="store_true", help="list models and cache state")
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--force", action="store_true", help="re-export cached models")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--tvm", action="store_true", help="also try tvm.relax from_onnx")
    parser.add_argument(
        "--raw", action="store_true", help="keep the exporter's graph (no shape folding)"
    )
    parser.add_argument(
        "--symbolic", action="store_true",
        help="write the models with symbolic dimensions (sequence or batch) to <out>/symbolic/, "
             "raw, through each of --exporters; --small: their tiny configurations (tests)")
    parser.add_argument("--exporters", default=",".join(SYMBOLIC_EXPORTERS),
                        help=f"with --symbolic: a subset of {','.join(SYMBOLIC_EXPORTERS)}")
    parser.add_argument("--small", action="store_true",
                        help="with --symbolic: the tiny configurations of the models")
    args = parser.parse_args(argv)

    out_dir = models_dir(args.out)
    names = list(MODELS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in MODELS]
        if unknown:
            parser.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")

    if args.list:
        for name in names:
            spec, path = MODELS[name], out_dir / f"{name}.onnx"
            state = f"cached {path.stat().st_size / 1e6:.1f}MB" if path.exists() else "missing"
            shapes = " ".join(f"{i.name}{list(i.shape)}:{i.dtype}" for i in spec.inputs)
            print(f"{name:<16} {spec.family:<12} {state:<18} {shapes}  {spec.note}")
        return 0

    if args.symbolic:
        return _main_symbolic(args, names, out_dir, parser)

    failed = False
    for name in names:
        path = out_dir / f"{name}.onnx"
        if path.exists() and not args.force:
            res = Result(name, ok=True, cached=True)
            res.nodes, res.params_mb = onnx_stats(path)
        else:
            res = export_model(MODELS[name], out_dir, args.seed, args.raw)
        if res.ok and args.tvm:
            res.tvm = tvm_import_check(path)
        failed |= not res.ok
        print(res.line(), flush=True)
    return 1 if failed else 0


def _main_symbolic(args, names: list[str], out_dir: Path, parser) -> int:
    exporters = [e.strip() for e in args.exporters.split(",") if e.strip()]
    unknown = [e for e in exporters if e not in SYMBOLIC_EXPORTERS]
    if unknown:
        parser.error(f"unknown exporter(s) {unknown}; known: {', '.join(SYMBOLIC_EXPORTERS)}")
    registry = SMALL if args.small else MODELS
    if args.small:
        out_dir = out_dir / "small"
    failed = False
    for name in names:
        spec = registry.get(name)
        if spec is None or not spec.symbolic:
            continue
        for exporter in exporters:
            path = symbolic_path(out_dir, spec, exporter)
            if path.exists() and not args.force:
                res = Result(f"{name}.{exporter}", ok=True, cached=True)
            else:
                res = export_symbolic(spec, exporter, out_dir, args.seed)
            failed |= not res.ok
            print(res.line(), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

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
    """How to build one model; ``build`` returns an eval-mode ``torch.nn.Module``."""

    name: str
    family: str  # "cnn" | "transformer" | "detector" | "video"
    build: Callable[[], object]
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    note: str = ""


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


def _last_hidden_state(model):
    """Wrap a transformers model so the graph has one plain output, ``last_hidden_state``."""
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
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return LastHidden(model)


def _hf(model_cls: str, config_cls: str, model_kw=None, **cfg):
    """Builder for a transformers encoder/decoder from its config class (no from_pretrained).

    Eager attention keeps the graph as plain MatMul/Softmax instead of an SDPA pattern.
    """

    def build():
        T = _transformers()
        config = getattr(T, config_cls)(attn_implementation="eager", **cfg)
        model = getattr(T, model_cls)(config, **(model_kw or {}))
        return _last_hidden_state(model)

    return build


def _img(h=224, w=224) -> tuple[InputSpec, ...]:
    return (InputSpec("input", (1, 3, h, w)),)


def _tokens(vocab: int, with_mask: bool = True) -> tuple[InputSpec, ...]:
    ids = InputSpec("input_ids", (1, SEQ_LEN), "int64", 0, vocab)
    if not with_mask:
        return (ids,)
    return (ids, InputSpec("attention_mask", (1, SEQ_LEN), "int64", 1, 2))


BERT_VOCAB = 30522
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
        ModelSpec("vit_b16", "transformer", _tv("vit_b_16"), _img(), ("logits",)),
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
        ),
        ModelSpec(
            "distilbert",
            "transformer",
            _hf("DistilBertModel", "DistilBertConfig"),
            _tokens(BERT_VOCAB),
            ("last_hidden_state",),
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
        ),
    ]
}


# --------------------------------------------------------------------------------------------
# Export + checks
# --------------------------------------------------------------------------------------------


def models_dir(out_dir: str | os.PathLike | None = None) -> Path:
    """The zoo folder: ``out_dir``, else ``$TVM_FUSION_MODELS``, else ``./models``."""
    return Path(out_dir or os.environ.get(ENV_DIR) or "models")


def random_inputs(spec: ModelSpec, seed: int = SEED) -> dict:
    """Seeded numpy feeds matching the spec, for onnxruntime / TVM comparisons."""
    import numpy as np

    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in spec.inputs:
        if inp.dtype == "int64":
            feeds[inp.name] = rng.integers(inp.low, inp.high, inp.shape, dtype=np.int64)
        else:
            feeds[inp.name] = rng.standard_normal(inp.shape).astype(inp.dtype)
    return feeds


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
    """
    import torch

    common = dict(input_names=[i.name for i in spec.inputs], output_names=list(spec.outputs))
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


def verify(path: Path, spec: ModelSpec, feeds: dict, expected: list) -> float:
    """onnx.checker plus one onnxruntime run; returns the max abs error against PyTorch."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    onnx.checker.check_model(str(path), full_check=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outs = sess.run(None, feeds)
    if len(outs) != len(expected):
        raise RuntimeError(f"expected {len(expected)} outputs, got {len(outs)}")
    worst = 0.0
    for got, ref in zip(outs, expected, strict=True):
        if got.shape != ref.shape:
            raise RuntimeError(f"output shape {got.shape} != torch {ref.shape}")
        if not np.isfinite(got).all():
            raise RuntimeError("onnxruntime produced non-finite outputs")
        err = float(np.max(np.abs(got - ref)))
        if err > 1e-3 * (1.0 + float(np.max(np.abs(ref)))):
            raise RuntimeError(f"onnxruntime differs from torch by {err:.3g}")
        worst = max(worst, err)
    return worst


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
        "tvm_fusion.simplified": "none" if raw else "onnxruntime basic, fusions disabled",
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
        feeds = random_inputs(spec, seed)
        args = tuple(torch.from_numpy(feeds[i.name]) for i in spec.inputs)
        with torch.no_grad():
            expected = model(*args)
        expected = [t.numpy() for t in (expected if isinstance(expected, tuple) else (expected,))]
        res.exporter = _torch_export(model, args, tmp_raw, spec)
        del model
        if raw:
            os.replace(tmp_raw, tmp)
        else:
            res.raw_nodes = onnx_stats(tmp_raw)[0]
            simplify(tmp_raw, tmp)
        _set_metadata(tmp, spec, res.exporter, seed, raw)
        res.max_err = verify(tmp, spec, feeds, expected)
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


if __name__ == "__main__":
    sys.exit(main())

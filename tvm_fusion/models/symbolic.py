"""ONNX models with symbolic (``dim_param``) batch and sequence dimensions: the shapes every
LLM and dynamic-batch export has (tests/test_symbolic.py, scripts/bench_host_target.py)."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto

from .graph import GraphBuilder, value_info

__all__ = ["MODELS", "conv_net", "decoder_block", "encoder_layer", "mlp", "nms_model"]

HIDDEN = 64
HEADS = 4


class _Builder(GraphBuilder):
    """Numbered names: ``c<n>`` for constants, ``<op><n>_<i>`` for node outputs."""

    def __init__(self, name: str, seed: int = 0):
        super().__init__(name)
        self.rng = np.random.default_rng(seed)

    def const(self, value, dtype=np.float32) -> str:
        return self.add_initializer(self.fresh("c"), value, dtype)

    def weight(self, *shape: int) -> str:
        return self.const(self.rng.standard_normal(shape) / math.sqrt(shape[0]))

    def node(self, op: str, *inputs: str, n_out: int = 1, **attrs) -> str | list[str]:
        stem = self.fresh(op.lower())
        outs = self.add_node(op, inputs, [f"{stem}_{i}" for i in range(n_out)], **attrs)
        return outs[0] if n_out == 1 else outs

    def model(self, inputs, outputs) -> onnx.ModelProto:
        self.inputs.extend(inputs)
        self.outputs.extend(outputs)
        return super().model()


def _rename_last(b: _Builder, out: str) -> None:
    b.nodes[-1].output[0] = out


def mlp(seed: int = 0) -> onnx.ModelProto:
    """MatMul + Add + ReLU on x[batch, seq, 64]."""
    b = _Builder("mlp", seed)
    y = b.node("MatMul", "x", b.weight(HIDDEN, HIDDEN))
    y = b.node("Add", y, b.const(0.1 * b.rng.standard_normal(HIDDEN)))
    b.node("Relu", y)
    _rename_last(b, "y")
    return b.model([value_info("x", ["batch", "seq", HIDDEN])],
                   [value_info("y", ["batch", "seq", HIDDEN])])


def _linear(b: _Builder, x: str, n_in: int, n_out: int) -> str:
    y = b.node("MatMul", x, b.weight(n_in, n_out))
    return b.node("Add", y, b.const(0.02 * b.rng.standard_normal(n_out)))


def _layer_norm(b: _Builder, x: str) -> str:
    return b.node("LayerNormalization", x, b.const(np.ones(HIDDEN)), b.const(np.zeros(HIDDEN)),
                  axis=-1, epsilon=1e-5)


def _attention(b: _Builder, x: str, mask: str | None, causal: bool) -> str:
    """Multi-head self-attention; heads split with Reshape [0, 0, heads, d] (0: keep the dim)."""
    d = HIDDEN // HEADS
    split = b.const([0, 0, HEADS, d], np.int64)

    def heads(t: str, perm):
        return b.node("Transpose", b.node("Reshape", t, split), perm=perm)

    q = heads(_linear(b, x, HIDDEN, HIDDEN), [0, 2, 1, 3])
    k = heads(_linear(b, x, HIDDEN, HIDDEN), [0, 2, 3, 1])
    v = heads(_linear(b, x, HIDDEN, HIDDEN), [0, 2, 1, 3])
    s = b.node("Div", b.node("MatMul", q, k), b.const(math.sqrt(d)))
    if mask is not None:
        s = b.node("Add", s, mask)
    if causal:
        # lower-triangular keep mask of the scores' own [seq, seq] (a mask read from Shape
        # goes through tensor_to_shape, whose fresh symbolic dims stock TVM cannot legalize)
        ones = b.node("Add", b.node("Mul", s, b.const(0.0)), b.const(1.0))
        keep = b.node("Cast", b.node("Trilu", ones, upper=0), to=TensorProto.BOOL)
        s = b.node("Where", keep, s, b.const(-1e9))
    p = b.node("Softmax", s, axis=-1)
    ctx = b.node("Transpose", b.node("MatMul", p, v), perm=[0, 2, 1, 3])
    # merge heads with the runtime [batch, seq] read by Shape, as PyTorch exports it
    lead = b.node("Slice", b.node("Shape", x), b.const([0], np.int64), b.const([2], np.int64))
    ctx = b.node("Reshape", ctx, b.node("Concat", lead, b.const([HIDDEN], np.int64), axis=0))
    return _linear(b, ctx, HIDDEN, HIDDEN)


def encoder_layer(seed: int = 0, ffn: int = 128) -> onnx.ModelProto:
    """Post-LN BERT layer on x[batch, seq, 64] with an additive mask[batch, 1, 1, seq]:
    attention, LayerNormalization, FFN with Gelu written out (Div, Erf, Add, Mul, Mul)."""
    b = _Builder("encoder_layer", seed)
    a = _attention(b, "x", "mask", causal=False)
    h = _layer_norm(b, b.node("Add", a, "x"))
    f = _linear(b, h, HIDDEN, ffn)
    e = b.node("Erf", b.node("Div", f, b.const(math.sqrt(2.0))))
    e = b.node("Mul", b.node("Mul", f, b.node("Add", e, b.const(1.0))), b.const(0.5))
    f = _linear(b, e, ffn, HIDDEN)
    _layer_norm(b, b.node("Add", f, h))
    _rename_last(b, "y")
    mask = value_info("mask", ["batch", 1, 1, "seq"], doc="additive_mask")
    return b.model([value_info("x", ["batch", "seq", HIDDEN]), mask],
                   [value_info("y", ["batch", "seq", HIDDEN])])


def decoder_block(seed: int = 0, ffn: int = 128) -> onnx.ModelProto:
    """Pre-LN GPT block on x[batch, seq, 64]: causal self-attention (Trilu + Where on the
    scores' shape), residuals, FFN with Tanh-Gelu-like Sigmoid gating."""
    b = _Builder("decoder_block", seed)
    a = _attention(b, _layer_norm(b, "x"), None, causal=True)
    h = b.node("Add", "x", a)
    f = _linear(b, _layer_norm(b, h), HIDDEN, ffn)
    f = b.node("Mul", f, b.node("Sigmoid", b.node("Mul", f, b.const(1.702))))
    f = _linear(b, f, ffn, HIDDEN)
    b.node("Add", h, f)
    _rename_last(b, "y")
    return b.model([value_info("x", ["batch", "seq", HIDDEN])],
                   [value_info("y", ["batch", "seq", HIDDEN])])


def conv_net(seed: int = 0) -> onnx.ModelProto:
    """Conv-BN-ReLU, depthwise conv, MaxPool, 1x1 conv, GlobalAveragePool and Gemm on
    x[batch, 3, 32, 32]."""
    b = _Builder("conv_net", seed)
    y = b.node("Conv", "x", b.weight(16, 3, 3, 3), b.const(np.zeros(16)), pads=[1, 1, 1, 1])
    y = b.node("BatchNormalization", y, b.const(np.ones(16)), b.const(0.1 * np.ones(16)),
               b.const(np.zeros(16)), b.const(np.ones(16)))
    y = b.node("Relu", y)
    y = b.node("Conv", y, b.weight(16, 1, 3, 3), b.const(np.zeros(16)), pads=[1, 1, 1, 1],
               group=16)
    y = b.node("Clip", y, b.const(0.0), b.const(6.0))
    y = b.node("MaxPool", y, kernel_shape=[2, 2], strides=[2, 2])
    y = b.node("Relu", b.node("Conv", y, b.weight(32, 16, 1, 1), b.const(np.zeros(32))))
    y = b.node("Flatten", b.node("GlobalAveragePool", y))
    b.node("Gemm", y, b.weight(32, 10), b.const(np.zeros(10)))
    _rename_last(b, "y")
    return b.model([value_info("x", ["batch", 3, 32, 32])], [value_info("y", ["batch", 10])])


def nms_model(seed: int = 0) -> onnx.ModelProto:
    """A detector tail: boxes[1, num_boxes, 4] decoded from offsets, Sigmoid scores, then
    NonMaxSuppression (selected indices [num_selected, 3])."""
    b = _Builder("nms", seed)
    boxes = b.node("Add", "anchors", b.node("Mul", "offsets", b.const(0.1)))
    scores = b.node("Sigmoid", "logits")
    b.node("NonMaxSuppression", boxes, scores, b.const([5], np.int64), b.const([0.5]),
           b.const([0.2]))
    _rename_last(b, "selected")
    return b.model([value_info("anchors", [1, "num_boxes", 4]),
                    value_info("offsets", [1, "num_boxes", 4]),
                    value_info("logits", [1, 2, "num_boxes"])],
                   [value_info("selected", ["num_selected", 3], TensorProto.INT64)])


MODELS = {"mlp": mlp, "encoder_layer": encoder_layer, "decoder_block": decoder_block,
          "conv_net": conv_net, "nms": nms_model}

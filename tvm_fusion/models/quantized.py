"""Small static conv and MatMul/Gemm nets in float32 and in ONNX's QDQ int8 form.

The QDQ form is the one ``onnxruntime.quantization.quantize_static(quant_format=QDQ)``
writes: each activation goes through ``QuantizeLinear → DequantizeLinear`` after the operator
that produces it (the graph input too), each weight is an int8 initializer read through
``DequantizeLinear`` (per tensor, or per output channel with ``axis=0``), each bias an int32
initializer with scale ``s_input · s_weight`` and zero point 0. ``int8_output=True`` ends the
graph at the last ``QuantizeLinear``, so the model's output is the int8 tensor itself (the
one output two compilers must agree on exactly). Scales are fixed from the weights' ranges
and the activations' expected ranges (inputs are N(0, 1)), not calibrated, so every call
returns the same model.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto

from .graph import GraphBuilder

__all__ = ["conv_net", "matmul_net", "qdq_conv_net", "qdq_deep_conv", "qdq_matmul_net"]

#: Expected |activation| bound (inputs N(0, 1), weights scaled by 1/sqrt(fan_in)).
ACT_RANGE = 4.0


class _Builder(GraphBuilder):
    def __init__(self, name: str, seed: int, qdq: bool, per_channel: bool, act: int):
        super().__init__(name, opset=17)
        self.rng = np.random.default_rng(seed)
        self.qdq, self.per_channel, self.act = qdq, per_channel, act
        self.act_np = np.int8 if act == TensorProto.INT8 else np.uint8
        self.scale_of: dict[str, float] = {}  # activation -> its quantization scale

    def const(self, value, dtype=np.float32) -> str:
        return self.add_initializer(self.fresh("c"), np.asarray(value), dtype)

    def node(self, op: str, *inputs: str, **attrs) -> str:
        return self.add_node(op, inputs, [self.fresh(op.lower())], **attrs)[0]

    def weight(self, shape, fan_in: int, axis: int = 0) -> str:
        """A float weight, or its int8 form read through DequantizeLinear; per channel, the
        output channels are along ``axis`` (0 for Conv and a transB Gemm, 1 for MatMul)."""
        w = self.rng.standard_normal(shape) / math.sqrt(fan_in)
        if not self.qdq:
            return self.const(w)
        if self.per_channel:
            scale = np.abs(np.moveaxis(w, axis, 0)).reshape(shape[axis], -1).max(axis=1) / 127.
            bcast = [1] * len(shape)
            bcast[axis] = -1
            q = np.round(w / scale.reshape(bcast))
            return self.node("DequantizeLinear", self.const(q, np.int8), self.const(scale),
                             self.const(np.zeros(shape[axis]), np.int8), axis=axis)
        scale = float(np.abs(w).max() / 127.0)
        return self.node("DequantizeLinear", self.const(np.round(w / scale), np.int8),
                         self.const(np.float32(scale)), self.const(np.int8(0), np.int8))

    def bias(self, n: int, x: str, w_scale) -> str:
        b = 0.1 * self.rng.standard_normal(n)
        if not self.qdq:
            return self.const(b)
        scale = self.scale_of[x] * np.broadcast_to(np.asarray(w_scale, np.float64), (n,))
        return self.node("DequantizeLinear", self.const(np.round(b / scale), np.int32),
                         self.const(scale), self.const(np.zeros(n), np.int32), axis=0)

    def qdq_pair(self, x: str, bound: float = ACT_RANGE) -> str:
        """``x`` through QuantizeLinear → DequantizeLinear (QDQ form only)."""
        if not self.qdq:
            return x
        low, high = (-128, 127) if self.act == TensorProto.INT8 else (0, 255)
        scale = 2 * bound / (high - low)
        zp = self.const(self.act_np((low + high + 1) // 2), self.act_np)
        s = self.const(np.float32(scale))
        q = self.node("QuantizeLinear", x, s, zp)
        self.last_quantized = q
        out = self.node("DequantizeLinear", q, s, zp)
        self.scale_of[out] = float(np.float32(scale))
        return out

    def weight_scale(self, name: str):
        """The scale initializer a DequantizeLinear weight reads (1.0 for a float weight)."""
        for node in self.nodes:
            if node.output[0] == name and node.op_type == "DequantizeLinear":
                init = next(t for t in self.initializers if t.name == node.input[1])
                return onnx.numpy_helper.to_array(init).astype(np.float64)
        return 1.0

    def finish(self, out: str, shape, int8_output: bool) -> onnx.ModelProto:
        if self.qdq and int8_output:  # end at the last QuantizeLinear: an int8 output
            self.nodes.pop()  # its DequantizeLinear
            self.add_output(self.last_quantized, list(shape), self.act)
        else:
            self.add_output(out, list(shape))
        return self.model(prune=True)


def _layer(b: _Builder, op: str, x: str, w_shape, fan_in: int, **attrs) -> str:
    w = b.weight(w_shape, fan_in, axis=1 if op == "MatMul" else 0)
    bias = b.bias(w_shape[1] if op == "MatMul" else w_shape[0], x, b.weight_scale(w))
    if op == "MatMul":
        return b.node("Add", b.node("MatMul", x, w), bias)
    return b.node(op, x, w, bias, **attrs)


def _conv_net(qdq: bool, per_channel: bool, seed: int, act: int,
              int8_output: bool) -> onnx.ModelProto:
    b = _Builder("qdq_conv_net" if qdq else "conv_net", seed, qdq, per_channel, act)
    x = b.qdq_pair(b.add_input("x", [1, 8, 16, 16]))
    r1 = b.qdq_pair(b.node("Relu", _layer(b, "Conv", x, (16, 8, 3, 3), 72, pads=[1] * 4)))
    d = b.qdq_pair(b.node("Relu", _layer(b, "Conv", r1, (16, 1, 3, 3), 9, pads=[1] * 4,
                                         group=16)))
    c = b.qdq_pair(_layer(b, "Conv", d, (16, 16, 1, 1), 16))
    s = b.qdq_pair(b.node("Add", c, r1), 2 * ACT_RANGE)  # the residual: r1 has two readers
    p = b.qdq_pair(b.node("MaxPool", s, kernel_shape=[2, 2], strides=[2, 2]), 2 * ACT_RANGE)
    out = b.qdq_pair(_layer(b, "Conv", p, (8, 16, 3, 3), 144, pads=[1] * 4), 2 * ACT_RANGE)
    return b.finish(out, (1, 8, 8, 8), int8_output)


def _matmul_net(qdq: bool, per_channel: bool, seed: int, act: int,
                int8_output: bool) -> onnx.ModelProto:
    b = _Builder("qdq_matmul_net" if qdq else "matmul_net", seed, qdq, per_channel, act)
    x = b.qdq_pair(b.add_input("x", [8, 32]))
    h = b.qdq_pair(b.node("Relu", _layer(b, "MatMul", x, (32, 64), 32)))
    w2 = b.weight((16, 64), 64)  # a Gemm weight stored [out, in]: transB
    g = b.node("Gemm", h, w2, b.bias(16, h, b.weight_scale(w2)), transB=1)
    out = b.qdq_pair(g)
    return b.finish(out, (8, 16), int8_output)


def conv_net(seed: int = 0) -> onnx.ModelProto:
    """Conv+ReLU, depthwise conv+ReLU, 1×1 conv, a residual Add, MaxPool and a last conv on
    x[1, 8, 16, 16] (float32; static shapes, no BatchNormalization)."""
    return _conv_net(False, False, seed, TensorProto.INT8, False)


def matmul_net(seed: int = 0) -> onnx.ModelProto:
    """MatMul+Add+ReLU then Gemm(transB) on x[8, 32] (float32)."""
    return _matmul_net(False, False, seed, TensorProto.INT8, False)


def qdq_conv_net(per_channel: bool = False, seed: int = 0, act: int = TensorProto.INT8,
                 int8_output: bool = False) -> onnx.ModelProto:
    """:func:`conv_net` in QDQ form (``act``: INT8 or UINT8 activations)."""
    return _conv_net(True, per_channel, seed, act, int8_output)


def qdq_deep_conv(channels: int = 128, out_channels: int = 64, size: int = 7,
                  per_channel: bool = False, seed: int = 0) -> onnx.ModelProto:
    """One QDQ 3×3 conv (padded, bias) on x[1, channels, size, size] ending at its
    QuantizeLinear (an int8 output): with many input channels the reduction (9 · channels)
    spans several of a CPU GEMM's K blocks, whose running sums the int8 output cannot hold;
    fewer positions than output channels make the positions the GEMM's rows, so the
    quantize is the GEMM's epilogue."""
    b = _Builder("qdq_deep_conv", seed, True, per_channel, TensorProto.INT8)
    x = b.qdq_pair(b.add_input("x", [1, channels, size, size]))
    out = b.qdq_pair(_layer(b, "Conv", x, (out_channels, channels, 3, 3), 9 * channels,
                            pads=[1] * 4))
    return b.finish(out, (1, out_channels, size, size), True)


def qdq_matmul_net(per_channel: bool = False, seed: int = 0, act: int = TensorProto.INT8,
                   int8_output: bool = False) -> onnx.ModelProto:
    """:func:`matmul_net` in QDQ form."""
    return _matmul_net(True, per_channel, seed, act, int8_output)

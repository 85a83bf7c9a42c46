"""Small ONNX models of conv chains (SISO, SIMO, MISO) for the conv→conv tests and benchmarks.

Each region-based operator is ``("conv", out_channels, kernel, stride, pad, groups, act)`` or
``("maxpool", kernel, stride, pad)``; ``groups=-1`` means depthwise. Convs carry a bias and an
activation (``"relu"``, ``"relu6"``, ``None``), as the zoo's CNNs do: PyTorch's ONNX export of
an eval-mode model folds BatchNorm into the conv. ``batchnorm=True`` keeps an explicit
BatchNormalization after each conv (what a training-mode export leaves), whose per-element
division the epilogue then pays. Opset 13; output shapes come from ONNX shape inference.
"""

from __future__ import annotations

import numpy as np
import onnx

from .graph import GraphBuilder

__all__ = ["chain_model", "miso_model", "simo_model"]


class _Builder(GraphBuilder):
    def __init__(self, seed: int, batchnorm: bool):
        super().__init__("chain", opset=13, ir_version=None)
        self.rng = np.random.default_rng(seed)
        self.batchnorm = batchnorm

    def const(self, value: np.ndarray, prefix: str) -> str:
        return self.add_initializer(self.fresh(prefix), value, np.float32)

    def rop(self, x: str, channels: int, spec) -> tuple[str, int]:
        kind = spec[0]
        if kind == "maxpool":
            _, k, s, p = spec
            (out,) = self.add_node("MaxPool", [x], [self.fresh("pool")], kernel_shape=[k, k],
                                   strides=[s, s], pads=[p, p, p, p])
            return out, channels
        _, cout, k, s, p, groups, act = spec
        if groups == -1:
            groups, cout = channels, channels
        fan_in = channels // groups * k * k
        w = self.rng.standard_normal((cout, channels // groups, k, k)) / np.sqrt(fan_in)
        b = self.rng.standard_normal(cout) * 0.1
        conv = self.fresh("conv")
        self.add_node("Conv", [x, self.const(w, "w"), self.const(b, "b")], [conv],
                      kernel_shape=[k, k], strides=[s, s], pads=[p, p, p, p], group=groups)
        out = conv
        if self.batchnorm:
            out = self.fresh("bn")
            self.add_node(
                "BatchNormalization",
                [conv, self.const(1 + 0.1 * self.rng.standard_normal(cout), "g"),
                 self.const(0.1 * self.rng.standard_normal(cout), "beta"),
                 self.const(0.1 * self.rng.standard_normal(cout), "mean"),
                 self.const(1 + 0.1 * self.rng.random(cout), "var")], [out])
        if act == "relu":
            (out,) = self.add_node("Relu", [out], [self.fresh("relu")])
        elif act == "relu6":
            lo, hi = self.const(np.array(0.0), "lo"), self.const(np.array(6.0), "hi")
            (out,) = self.add_node("Clip", [out, lo, hi], [self.fresh("clip")])
        return out, cout


def chain_model(channels: int, size: int, ops, seed: int = 0, batch: int = 1,
                batchnorm: bool = False) -> onnx.ModelProto:
    """SISO: ``x → ops[0] → ops[1] → … → y`` on an ``(batch, channels, size, size)`` input."""
    b = _Builder(seed, batchnorm)
    x, c = b.add_input("x", [batch, channels, size, size]), channels
    for spec in ops:
        x, c = b.rop(x, c, spec)
    b.add_output(x)
    return b.model()


def simo_model(channels: int, size: int, first, branches, seed: int = 0,
               concat: bool = True, batchnorm: bool = False) -> onnx.ModelProto:
    """SIMO (Fig. 7a): ``x → first → {branches}`` joined by a Concat, or two outputs."""
    b = _Builder(seed, batchnorm)
    mid, c = b.rop(b.add_input("x", [1, channels, size, size]), channels, first)
    outs = [b.rop(mid, c, spec)[0] for spec in branches]
    if concat:
        outs = b.add_node("Concat", outs, [b.fresh("cat")], axis=1)
    for out in outs:
        b.add_output(out)
    return b.model()


def miso_model(channels: int, size: int, left, right, seed: int = 0,
               batchnorm: bool = False) -> onnx.ModelProto:
    """MISO (Fig. 7b): ``x1 → left``, ``x2 → right``, joined by an element-wise Add."""
    b = _Builder(seed, batchnorm)
    shape = [1, channels, size, size]
    a, _ = b.rop(b.add_input("x1", shape), channels, left)
    r, _ = b.rop(b.add_input("x2", shape), channels, right)
    b.add_node("Add", [a, r], ["y"])
    b.add_output("y")
    return b.model()

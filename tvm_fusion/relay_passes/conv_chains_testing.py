"""Small ONNX models of conv chains (SISO, SIMO, MISO) for the conv→conv tests and benchmarks.

Each region-based operator is ``("conv", out_channels, kernel, stride, pad, groups, act)`` or
``("maxpool", kernel, stride, pad)``; ``groups=-1`` means depthwise. Convs carry a bias and an
activation (``"relu"``, ``"relu6"``, ``None``), as the zoo's CNNs do: PyTorch's ONNX export of
an eval-mode model folds BatchNorm into the conv. ``batchnorm=True`` keeps an explicit
BatchNormalization after each conv (what a training-mode export leaves), whose per-element
division the epilogue then pays.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _Builder:
    def __init__(self, seed: int, batchnorm: bool):
        self.rng = np.random.default_rng(seed)
        self.batchnorm = batchnorm
        self.nodes: list = []
        self.inits: list = []
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, value: np.ndarray, prefix: str) -> str:
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(value.astype("float32"), name))
        return name

    def rop(self, x: str, channels: int, spec) -> tuple[str, int]:
        kind = spec[0]
        if kind == "maxpool":
            _, k, s, p = spec
            out = self.name("pool")
            self.nodes.append(helper.make_node("MaxPool", [x], [out], kernel_shape=[k, k],
                                               strides=[s, s], pads=[p, p, p, p]))
            return out, channels
        _, cout, k, s, p, groups, act = spec
        if groups == -1:
            groups, cout = channels, channels
        fan_in = channels // groups * k * k
        w = self.rng.standard_normal((cout, channels // groups, k, k)) / np.sqrt(fan_in)
        b = self.rng.standard_normal(cout) * 0.1
        conv = self.name("conv")
        self.nodes.append(helper.make_node(
            "Conv", [x, self.const(w, "w"), self.const(b, "b")], [conv], kernel_shape=[k, k],
            strides=[s, s], pads=[p, p, p, p], group=groups))
        out = conv
        if self.batchnorm:
            out = self.name("bn")
            self.nodes.append(helper.make_node(
                "BatchNormalization",
                [conv, self.const(1 + 0.1 * self.rng.standard_normal(cout), "g"),
                 self.const(0.1 * self.rng.standard_normal(cout), "beta"),
                 self.const(0.1 * self.rng.standard_normal(cout), "mean"),
                 self.const(1 + 0.1 * self.rng.random(cout), "var")], [out]))
        if act == "relu":
            relu = self.name("relu")
            self.nodes.append(helper.make_node("Relu", [out], [relu]))
            out = relu
        elif act == "relu6":
            lo, hi = self.const(np.array(0.0), "lo"), self.const(np.array(6.0), "hi")
            clip = self.name("clip")
            self.nodes.append(helper.make_node("Clip", [out, lo, hi], [clip]))
            out = clip
        return out, cout

    def model(self, inputs, outputs) -> onnx.ModelProto:
        names = [o.name for o in outputs]
        graph = helper.make_graph(self.nodes, "chain", inputs, [], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
        model.graph.output.extend([inferred[n] for n in names])
        onnx.checker.check_model(model)
        return model


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                         None if shape is None else list(shape))


def chain_model(channels: int, size: int, ops, seed: int = 0, batch: int = 1,
                batchnorm: bool = False) -> onnx.ModelProto:
    """SISO: ``x → ops[0] → ops[1] → … → y`` on an ``(batch, channels, size, size)`` input."""
    b = _Builder(seed, batchnorm)
    x, c = "x", channels
    for spec in ops:
        x, c = b.rop(x, c, spec)
    return b.model([_vi("x", (batch, channels, size, size))], [_vi(x, None)])


def simo_model(channels: int, size: int, first, branches, seed: int = 0,
               concat: bool = True, batchnorm: bool = False) -> onnx.ModelProto:
    """SIMO (Fig. 7a): ``x → first → {branches}`` joined by a Concat, or two outputs."""
    b = _Builder(seed, batchnorm)
    mid, c = b.rop("x", channels, first)
    outs = [b.rop(mid, c, spec)[0] for spec in branches]
    if concat:
        y = b.name("cat")
        b.nodes.append(helper.make_node("Concat", outs, [y], axis=1))
        outs = [y]
    return b.model([_vi("x", (1, channels, size, size))], [_vi(o, None) for o in outs])


def miso_model(channels: int, size: int, left, right, seed: int = 0,
               batchnorm: bool = False) -> onnx.ModelProto:
    """MISO (Fig. 7b): ``x1 → left``, ``x2 → right``, joined by an element-wise Add."""
    b = _Builder(seed, batchnorm)
    a, _ = b.rop("x1", channels, left)
    r, _ = b.rop("x2", channels, right)
    b.nodes.append(helper.make_node("Add", [a, r], ["y"]))
    shape = (1, channels, size, size)
    return b.model([_vi("x1", shape), _vi("x2", shape)], [_vi("y", None)])

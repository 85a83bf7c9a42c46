"""Small convolutional nets in the shape of the zoo's CNNs, for tests that cannot wait for (or
find) the exported zoo: MobileNetV2's inverted residuals and ResNet's bottleneck block.

Weights are seeded; convs carry a bias, as PyTorch's eval-mode export leaves them (BatchNorm
folded), except where ``batchnorm=True`` keeps an explicit BatchNormalization (a training-mode
export). Node names follow the PyTorch exporter's ``/features.1/conv/conv.0/Conv`` style, so
reports and pictures show where each operator came from.
"""

from __future__ import annotations

import numpy as np
import onnx

from .graph import GraphBuilder

__all__ = ["inverted_residual_net", "resnet_bottleneck"]


class _Builder(GraphBuilder):
    def __init__(self, name: str, seed: int, batchnorm: bool):
        super().__init__(name)
        self.rng = np.random.default_rng(seed)
        self.batchnorm = batchnorm

    def const(self, value, name: str) -> str:
        return self.add_initializer(name, np.asarray(value, np.float32))

    def conv(self, x: str, cin: int, cout: int, k: int, stride: int, prefix: str,
             groups: int = 1, act: str | None = None) -> str:
        """Conv (+ BatchNormalization) (+ ReLU / ReLU6 as Clip)."""
        fan_in = cin // groups * k * k
        w = self.rng.standard_normal((cout, cin // groups, k, k)) / np.sqrt(fan_in)
        inputs = [x, self.const(w, f"{prefix}.weight")]
        if not self.batchnorm:
            inputs.append(self.const(0.1 * self.rng.standard_normal(cout), f"{prefix}.bias"))
        p = k // 2
        (out,) = self.add_node("Conv", inputs, [f"/{prefix}/Conv_output_0"],
                               name=f"/{prefix}/Conv", kernel_shape=[k, k],
                               strides=[stride, stride], pads=[p, p, p, p], group=groups)
        if self.batchnorm:
            stats = [1 + 0.1 * self.rng.standard_normal(cout), 0.1 * self.rng.standard_normal(cout),
                     0.1 * self.rng.standard_normal(cout), 1 + 0.1 * self.rng.random(cout)]
            names = [self.const(v, f"{prefix}.bn.{s}")
                     for v, s in zip(stats, ("weight", "bias", "running_mean", "running_var"))]
            (out,) = self.add_node("BatchNormalization", [out, *names],
                                   [f"/{prefix}/BatchNormalization_output_0"],
                                   name=f"/{prefix}/BatchNormalization")
        if act == "relu":
            (out,) = self.add_node("Relu", [out], [f"/{prefix}/Relu_output_0"],
                                   name=f"/{prefix}/Relu")
        elif act == "relu6":
            lo = self.const(np.array(0.0), f"{prefix}.clip.min")
            hi = self.const(np.array(6.0), f"{prefix}.clip.max")
            (out,) = self.add_node("Clip", [out, lo, hi], [f"/{prefix}/Clip_output_0"],
                                   name=f"/{prefix}/Clip")
        return out


def inverted_residual_net(size: int = 32, classes: int = 10, seed: int = 0,
                          batchnorm: bool = False) -> onnx.ModelProto:
    """MobileNetV2 in miniature on ``x`` [1, 3, size, size]: a strided 3×3 stem, three inverted
    residual blocks (1×1 expansion, depthwise 3×3, linear 1×1 projection; ReLU6; the stride-1
    block with its residual Add), a 1×1 head conv, global average pooling and the classifier
    Gemm. Output ``logits`` [1, classes]."""
    g = _Builder("inverted_residual_net", seed, batchnorm)
    x = g.add_input("x", [1, 3, size, size])
    h = g.conv(x, 3, 16, 3, 2, "features.0", act="relu6")
    # (expansion t, out channels, stride): MobileNetV2's first rows, narrowed
    channels = 16
    for i, (t, cout, stride) in enumerate([(1, 8, 1), (6, 16, 2), (6, 16, 1)], start=1):
        hidden = channels * t
        y = h
        if t != 1:
            y = g.conv(y, channels, hidden, 1, 1, f"features.{i}.conv.0", act="relu6")
        y = g.conv(y, hidden, hidden, 3, stride, f"features.{i}.conv.1", groups=hidden,
                   act="relu6")
        y = g.conv(y, hidden, cout, 1, 1, f"features.{i}.conv.2")
        if stride == 1 and cout == channels:
            (y,) = g.add_node("Add", [h, y], [f"/features.{i}/Add_output_0"],
                              name=f"/features.{i}/Add")
        h, channels = y, cout
    h = g.conv(h, channels, 64, 1, 1, "features.4", act="relu6")
    (h,) = g.add_node("GlobalAveragePool", [h], ["/GlobalAveragePool_output_0"],
                      name="/GlobalAveragePool")
    (h,) = g.add_node("Flatten", [h], ["/Flatten_output_0"], name="/Flatten", axis=1)
    w = g.const(g.rng.standard_normal((classes, 64)) / 8.0, "classifier.weight")
    b = g.const(0.1 * g.rng.standard_normal(classes), "classifier.bias")
    g.add_node("Gemm", [h, w, b], ["logits"], name="/classifier/Gemm", transB=1)
    g.add_output("logits", [1, classes])
    return g.model(doc=inverted_residual_net.__doc__)


def resnet_bottleneck(channels: int = 32, size: int = 16, seed: int = 0,
                      batchnorm: bool = True) -> onnx.ModelProto:
    """ResNet-50's downsampling bottleneck on ``x`` [1, channels, size, size]: 1×1 reduce to
    channels/2, strided 3×3, 1×1 expand to 2·channels, each with BatchNormalization, the
    projection shortcut (strided 1×1 + BatchNormalization), Add and ReLU; then an identity
    bottleneck. Output ``y`` [1, 2·channels, size/2, size/2]."""
    g = _Builder("resnet_bottleneck", seed, batchnorm)
    x = g.add_input("x", [1, channels, size, size])
    mid, out = channels // 2, 2 * channels
    h = x
    for i, (cin, stride) in enumerate([(channels, 2), (out, 1)]):
        y = g.conv(h, cin, mid, 1, 1, f"layer.{i}.conv1", act="relu")
        y = g.conv(y, mid, mid, 3, stride, f"layer.{i}.conv2", act="relu")
        y = g.conv(y, mid, out, 1, 1, f"layer.{i}.conv3")
        short = h if stride == 1 and cin == out else g.conv(h, cin, out, 1, stride,
                                                            f"layer.{i}.downsample")
        (y,) = g.add_node("Add", [y, short], [f"/layer.{i}/Add_output_0"],
                          name=f"/layer.{i}/Add")
        name = "y" if i == 1 else f"/layer.{i}/Relu_output_0"
        (h,) = g.add_node("Relu", [y], [name], name=f"/layer.{i}/Relu")
    g.add_output("y", [1, out, size // 2, size // 2])
    return g.model(doc=resnet_bottleneck.__doc__)

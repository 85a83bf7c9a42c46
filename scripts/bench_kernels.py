"""Kernel shape sweep (issue 20, item 4): every shape built through tvm_fusion and timed against
ONNX Runtime's single-operator model, in one process, calls alternating, one thread each.

    taskset -c 1 python scripts/bench_kernels.py [--quick] [--out out/kernels]
        [--peak-gflops 99.3] [--bandwidth 19.7] [--target '{"kind":"llvm","mcpu":"znver3"}']
        [--seconds 2] [--only 197x768x3072,1x768x50257,64x50257x768]
        [--families matmul,conv] [--stock] [--clock cpu]

MatMul ``[M, K] × W[K, N]`` (W an initializer: packed at compile time by both runtimes) over
M ∈ {1, 8, 32, 128, 197, 512, 2048} × (K, N) ∈ square, tall, wide, vocabulary-sized and odd
sizes (``--only`` takes any ``MxKxN``, in the sweep or not). ``--quick`` leaves out the
shapes above 20 GFLOP (the largest M of the biggest N·K), so the sweep runs in minutes.
Prints a Markdown table (ms, GFLOP/s, % of the FMA peak, or % of the read bandwidth for
M = 1, which streams the weight once, and the speed relative to ONNX Runtime: its time over
ours, > 1 is faster) and the geometric mean of those ratios; writes ``kernels.json`` and
``kernels.png`` to ``--out``.

The peak and the bandwidth are measured here when not given: a TIR loop of 12 independent
vector FMA chains, and a vector sum over 256 MiB (the method of shared/tools/cpu-peak).

``--families conv`` (or ``matmul,conv``) is the conv sweep (:data:`CONV_SHAPES`: single Conv
operators with bias from ResNet-50, MobileNetV2, ConvNeXt-T, the SD U-Net block, YOLOv8n and
the U-Net, plus grouped, dilated and odd-channel ones; :data:`CONV_TRANSPOSE_SHAPES`:
ConvTranspose; :data:`CONV3D_SHAPES`: the 3-D convs of r3d_18 and r2plus1d_18; ``--only``
takes their names, or any 2-D conv named as they are, ``[model-][dw|gG-]KxK[sS]-CIN[>COUT]@HW``,
e.g. ``mnv2-1x1-960>160@7`` or ``mnv2-dw3x3s2-576@14``: a model's own shapes). ``--stock`` also
builds each shape through stock FuseOps with our CPU schedules (the ``tvm-fuseops-sched``
variant: no conv packing) and times it in the same loop.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TVM_NUM_THREADS", "1")  # before TVM's runtime starts its pool

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.script import tirx as T  # noqa: E402

from tvm_fusion.compile import compile_model, import_onnx  # noqa: E402
from tvm_fusion.models.precision import cast_model  # noqa: E402
from tvm_fusion.target import host_cpu  # noqa: E402
from tvm_fusion.tir_schedules.cpu_target import cpu_params  # noqa: E402

M_VALUES = (1, 8, 32, 128, 197, 512, 2048)
KN_VALUES = ((768, 768), (768, 3072), (3072, 768), (2048, 256), (2048, 5632), (5632, 2048),
             (768, 50257), (4096, 32000), (1000, 1), (17, 33))
QUICK_MAX_FLOP = 2e10


@dataclass
class Case:
    """One kernel to time: its ONNX model (one operator), inputs, and what bounds it."""

    name: str
    family: str
    model: onnx.ModelProto
    feeds: dict
    flop: float
    bytes_read: float  # of the operand that bounds a bandwidth-bound case
    bandwidth_bound: bool
    shape: dict = field(default_factory=dict)


def matmul_case(m: int, k: int, n: int) -> Case:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((k, n)).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [numpy_helper.from_array(weight, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": rng.standard_normal((m, k)).astype("float32")}
    return Case(f"{m}x{k}x{n}", "matmul", model, feeds, 2.0 * m * k * n, 4.0 * k * n, m == 1,
                {"M": m, "K": k, "N": n})


def matmul_cases(quick: bool) -> list[Case]:
    shapes = [(m, k, n) for k, n in KN_VALUES for m in M_VALUES
              if not (quick and 2.0 * m * k * n > QUICK_MAX_FLOP)]
    return [_Lazy(matmul_case, shape) for shape in shapes]


# Conv shapes (batch 1, float32, with bias), from the models named: (name, C_in, C_out, H, W,
# kernel, stride, pad, dilation, groups). The name says where it comes from.
CONV_SHAPES = (
    ("r50-stem-7x7s2-3>64@224", 3, 64, 224, 224, 7, 2, 3, 1, 1),
    ("r50-1x1-64>256@56", 64, 256, 56, 56, 1, 1, 0, 1, 1),
    ("r50-3x3-64>64@56", 64, 64, 56, 56, 3, 1, 1, 1, 1),
    ("r50-3x3s2-128>128@56", 128, 128, 56, 56, 3, 2, 1, 1, 1),
    ("r50-1x1-1024>256@14", 1024, 256, 14, 14, 1, 1, 0, 1, 1),
    ("r50-1x1s2-512>1024@28", 512, 1024, 28, 28, 1, 2, 0, 1, 1),
    ("r50-3x3-512>512@7", 512, 512, 7, 7, 3, 1, 1, 1, 1),
    ("r50-3x3-256>256@14", 256, 256, 14, 14, 3, 1, 1, 1, 1),
    ("mnv2-3x3s2-3>32@224", 3, 32, 224, 224, 3, 2, 1, 1, 1),
    ("mnv2-dw3x3-144@56", 144, 144, 56, 56, 3, 1, 1, 1, 144),
    ("mnv2-dw3x3s2-96@112", 96, 96, 112, 112, 3, 2, 1, 1, 96),
    ("mnv2-dw3x3s2-144@56", 144, 144, 56, 56, 3, 2, 1, 1, 144),
    ("effb0-dw5x5s2-240@28", 240, 240, 28, 28, 5, 2, 2, 1, 240),
    ("odd-dw3x3s2-37@29", 37, 37, 29, 29, 3, 2, 1, 1, 37),
    ("mnv2-1x1-144>24@56", 144, 24, 56, 56, 1, 1, 0, 1, 1),
    ("mnv2-1x1-320>1280@7", 320, 1280, 7, 7, 1, 1, 0, 1, 1),
    ("cnxt-4x4s4-3>96@224", 3, 96, 224, 224, 4, 4, 0, 1, 1),
    ("cnxt-dw7x7-96@56", 96, 96, 56, 56, 7, 1, 3, 1, 96),
    ("cnxt-dw7x7-768@7", 768, 768, 7, 7, 7, 1, 3, 1, 768),
    ("cnxt-2x2s2-96>192@56", 96, 192, 56, 56, 2, 2, 0, 1, 1),
    ("sd-3x3-320>320@32", 320, 320, 32, 32, 3, 1, 1, 1, 1),
    ("sd-1x1-320>320@32", 320, 320, 32, 32, 1, 1, 0, 1, 1),
    ("yolo-3x3s2-16>32@160", 16, 32, 160, 160, 3, 2, 1, 1, 1),
    ("yolo-3x3-80>80@40", 80, 80, 40, 40, 3, 1, 1, 1, 1),
    ("grp32-3x3-128>128@56", 128, 128, 56, 56, 3, 1, 1, 1, 32),
    ("rnx-grp32-3x3-1024>1024@7", 1024, 1024, 7, 7, 3, 1, 1, 1, 32),  # ResNeXt-50's last
    ("dil2-3x3-256>256@28", 256, 256, 28, 28, 3, 1, 2, 2, 1),
    ("odd-3x3-17>33@31", 17, 33, 31, 31, 3, 1, 1, 1, 1),
    # 1-D convs (H = 0: an (N, C, W) input), wav2vec2's feature extractor and positional conv
    ("w2v-1d-k10s5-1>512@16000", 1, 512, 0, 16000, 10, 5, 0, 1, 1),
    ("w2v-1d-k3s2-512>512@3199", 512, 512, 0, 3199, 3, 2, 0, 1, 1),
    ("w2v-1d-k2s2-512>512@99", 512, 512, 0, 99, 2, 2, 0, 1, 1),
    ("w2v-1d-pos-k128g16-768@49", 768, 768, 0, 49, 128, 1, 64, 1, 16),
    # the U-Net's (models/unet.onnx) large maps with few channels, and its deepest level
    ("unet-3x3-64>64@256", 64, 64, 256, 256, 3, 1, 1, 1, 1),
    ("unet-3x3-128>64@256", 128, 64, 256, 256, 3, 1, 1, 1, 1),
    ("unet-3x3-128>128@128", 128, 128, 128, 128, 3, 1, 1, 1, 1),
    ("unet-3x3-1024>1024@16", 1024, 1024, 16, 16, 3, 1, 1, 1, 1),
    # RegNetY-400MF: 1×1 convs on small maps, 3×3 convs of 8-channel groups
    ("regnet-1x1-208>208@14", 208, 208, 14, 14, 1, 1, 0, 1, 1),
    ("regnet-1x1-440>440@7", 440, 440, 7, 7, 1, 1, 0, 1, 1),
    ("regnet-g6-3x3s2-48@112", 48, 48, 112, 112, 3, 2, 1, 1, 6),
    ("regnet-g26-3x3-208@14", 208, 208, 14, 14, 3, 1, 1, 1, 26),
    ("regnet-g55-3x3-440@7", 440, 440, 7, 7, 3, 1, 1, 1, 55),
)

# ConvTranspose shapes (batch 1, float32, with bias): (name, C_in, C_out, H, W, kernel, stride,
# pad, output_padding). The U-Net's 2×2/2 upsamplings, a DCGAN-style 4×4/2 and a decoder's
# 3×3/2 with output_padding (overlapping taps).
CONV_TRANSPOSE_SHAPES = (
    ("unet-convT-2x2s2-128>64@128", 128, 64, 128, 128, 2, 2, 0, 0),
    ("unet-convT-2x2s2-1024>512@16", 1024, 512, 16, 16, 2, 2, 0, 0),
    ("convT-4x4s2p1-256>128@32", 256, 128, 32, 32, 4, 2, 1, 0),
    ("convT-3x3s2p1op1-64>32@56", 64, 32, 56, 56, 3, 2, 1, 1),
)


def conv_case(name: str, c_in: int, c_out: int, h: int, w: int, k: int, stride: int, pad: int,
              dilation: int, groups: int) -> Case:
    """A 2-D conv on a ``h × w`` map, or (``h`` = 0) a 1-D conv on ``w`` positions."""
    rng = np.random.default_rng(0)
    dims = 1 if h == 0 else 2
    kernel = (k,) * dims
    weight = (rng.standard_normal((c_out, c_in // groups, *kernel)) /
              math.sqrt(c_in // groups * k ** dims)).astype("float32")
    bias = rng.standard_normal(c_out).astype("float32")
    span = dilation * (k - 1) + 1
    ow = (w + 2 * pad - span) // stride + 1
    oh = 1 if h == 0 else (h + 2 * pad - span) // stride + 1
    x_shape = [1, c_in, w] if h == 0 else [1, c_in, h, w]
    y_shape = [1, c_out, ow] if h == 0 else [1, c_out, oh, ow]
    node = helper.make_node("Conv", ["x", "W", "B"], ["y"], kernel_shape=list(kernel),
                            strides=[stride] * dims, pads=[pad] * 2 * dims,
                            dilations=[dilation] * dims, group=groups)
    graph = helper.make_graph(
        [node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": rng.standard_normal(x_shape).astype("float32")}
    flop = 2.0 * c_out * oh * ow * (c_in // groups) * k ** dims
    return Case(name, "conv", model, feeds, flop, 4.0 * (c_in * max(h, 1) * w + c_out * oh * ow),
                False, {"C_in": c_in, "C_out": c_out, "H": h, "W": w, "k": k, "stride": stride,
                        "dilation": dilation, "groups": groups})


def conv_transpose_case(name: str, c_in: int, c_out: int, h: int, w: int, k: int,
                        stride: int, pad: int, output_padding: int) -> Case:
    """A 2-D ConvTranspose on a ``h × w`` map."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((c_in, c_out, k, k)) / math.sqrt(c_in)).astype("float32")
    bias = rng.standard_normal(c_out).astype("float32")
    oh, ow = ((size - 1) * stride - 2 * pad + k + output_padding for size in (h, w))
    node = helper.make_node("ConvTranspose", ["x", "W", "B"], ["y"], kernel_shape=[k, k],
                            strides=[stride] * 2, pads=[pad] * 4,
                            output_padding=[output_padding] * 2)
    graph = helper.make_graph(
        [node], "conv_transpose",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c_in, h, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c_out, oh, ow])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": rng.standard_normal((1, c_in, h, w)).astype("float32")}
    flop = 2.0 * c_in * h * w * c_out * k * k  # every tap of every input, as a GEMM
    return Case(name, "conv", model, feeds, flop, 4.0 * (c_in * h * w + c_out * oh * ow),
                False, {"C_in": c_in, "C_out": c_out, "H": h, "W": w, "k": k, "stride": stride,
                        "transposed": True})


# 3-D convs (batch 1, float32, with bias; NCDHW) of the video models: (name, C_in, C_out,
# (D, H, W), (kd, kh, kw), (sd, sh, sw), (pd, ph, pw)) with the same padding at both ends.
CONV3D_SHAPES = (
    ("r3d-3x7x7s122-3>64@16x112", 3, 64, (16, 112, 112), (3, 7, 7), (1, 2, 2), (1, 3, 3)),
    ("r3d-3x3x3-64>64@16x56", 64, 64, (16, 56, 56), (3, 3, 3), (1, 1, 1), (1, 1, 1)),
    ("r3d-3x3x3s2-64>128@16x56", 64, 128, (16, 56, 56), (3, 3, 3), (2, 2, 2), (1, 1, 1)),
    ("r3d-3x3x3-128>128@8x28", 128, 128, (8, 28, 28), (3, 3, 3), (1, 1, 1), (1, 1, 1)),
    ("r3d-3x3x3-256>256@4x14", 256, 256, (4, 14, 14), (3, 3, 3), (1, 1, 1), (1, 1, 1)),
    ("r3d-3x3x3-512>512@2x7", 512, 512, (2, 7, 7), (3, 3, 3), (1, 1, 1), (1, 1, 1)),
    ("r3d-1x1x1s2-64>128@16x56", 64, 128, (16, 56, 56), (1, 1, 1), (2, 2, 2), (0, 0, 0)),
    ("r21d-1x7x7s122-3>45@8x112", 3, 45, (8, 112, 112), (1, 7, 7), (1, 2, 2), (0, 3, 3)),
    ("r21d-1x3x3-64>144@8x56", 64, 144, (8, 56, 56), (1, 3, 3), (1, 1, 1), (0, 1, 1)),
    ("r21d-3x1x1-144>64@8x56", 144, 64, (8, 56, 56), (3, 1, 1), (1, 1, 1), (1, 0, 0)),
    ("r21d-1x3x3s122-64>230@8x56", 64, 230, (8, 56, 56), (1, 3, 3), (1, 2, 2), (0, 1, 1)),
    ("r21d-3x1x1s211-230>128@8x28", 230, 128, (8, 28, 28), (3, 1, 1), (2, 1, 1), (1, 0, 0)),
    ("r21d-1x3x3-256>576@2x14", 256, 576, (2, 14, 14), (1, 3, 3), (1, 1, 1), (0, 1, 1)),
    ("r21d-3x1x1-576>256@2x14", 576, 256, (2, 14, 14), (3, 1, 1), (1, 1, 1), (1, 0, 0)),
    ("odd-3x3x3s2-17>33@9x13x11", 17, 33, (9, 13, 11), (3, 3, 3), (2, 2, 2), (1, 1, 1)),
)


def conv3d_case(name: str, c_in: int, c_out: int, size: tuple, kernel: tuple, strides: tuple,
                pads: tuple) -> Case:
    """An NCDHW conv with bias (:data:`CONV3D_SHAPES`)."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((c_out, c_in, *kernel)) /
              math.sqrt(c_in * math.prod(kernel))).astype("float32")
    bias = rng.standard_normal(c_out).astype("float32")
    out = [(n + 2 * p - k) // s + 1 for n, k, s, p in zip(size, kernel, strides, pads)]
    x_shape, y_shape = [1, c_in, *size], [1, c_out, *out]
    node = helper.make_node("Conv", ["x", "W", "B"], ["y"], kernel_shape=list(kernel),
                            strides=list(strides), pads=[*pads, *pads])
    graph = helper.make_graph(
        [node], "conv3d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": rng.standard_normal(x_shape).astype("float32")}
    flop = 2.0 * c_out * math.prod(out) * c_in * math.prod(kernel)
    return Case(name, "conv", model, feeds, flop,
                4.0 * (c_in * math.prod(size) + c_out * math.prod(out)), False,
                {"C_in": c_in, "C_out": c_out, "H": size[1], "W": size[2],
                 "k": "x".join(map(str, kernel)), "stride": "x".join(map(str, strides)),
                 "dilation": 1, "groups": 1})


def conv_cases(quick: bool) -> list[Case]:
    """The conv shapes of issue 20, item 4 (:data:`CONV_SHAPES`: 1×1, 3×3, strided, 7×7 and
    3×3 depthwise, grouped, dilated, odd channels, 7×7 to 224×224 maps); all are small
    enough for ``--quick``."""
    del quick
    lazies = []
    for make, shapes in ((conv_case, CONV_SHAPES), (conv_transpose_case, CONV_TRANSPOSE_SHAPES),
                         (conv3d_case, CONV3D_SHAPES)):
        for shape in shapes:
            lazy = _Lazy(make, shape)
            lazy.name = shape[0]
            lazies.append(lazy)
    return lazies


FAMILIES = {"matmul": matmul_cases, "conv": conv_cases}

_CONV_NAME = re.compile(r"^(?:[\w.]+-)?(dw|g(\d+)-)?(\d+)x(\d+)(?:s(\d+))?-(\d+)(?:>(\d+))?@(\d+)$")


def parse_conv_name(name: str) -> tuple | None:
    """A 2-D conv named as the sweep's are, ``[model-][dw|gG-]KxK[sS]-CIN[>COUT]@HW`` (square
    kernel and map, padding K // 2, no dilation; ``dw`` depthwise, ``gG-`` G groups), as
    :func:`conv_case`'s arguments, or None."""
    match = _CONV_NAME.match(name)
    if match is None:
        return None
    dw, groups, kh, kw, stride, c_in, c_out, hw = match.groups()
    if kh != kw:
        return None
    c_in = int(c_in)
    c_out = int(c_out) if c_out else c_in
    groups = c_in if dw == "dw" else int(groups) if groups else 1
    if (dw == "dw" and c_out != c_in) or c_in % groups or c_out % groups:
        return None
    return (name, c_in, c_out, int(hw), int(hw), int(kh), int(stride or 1), int(kh) // 2, 1,
            groups)


class _Lazy:
    """A case built when measured (the vocabulary-sized weights are 0.5 GB each)."""

    def __init__(self, make, args):
        self.make, self.args = make, args
        self.name = "x".join(map(str, args))

    def build(self) -> Case:
        return self.make(*self.args)


# --------------------------------------------------------------------------- the machine

def measure_peak(target: tvm.target.Target, lanes: int) -> float:
    """GFLOP/s of one thread doing 12 independent vector FMA chains (the cpu-peak method)."""
    chains = 12

    @T.prim_func
    def peak(coef: T.Buffer((2,), "float32"), out: T.Buffer((chains * lanes,), "float32"),
             n: T.int64):
        T.func_attr({"tirx.noalias": True})
        acc = T.alloc_buffer((chains, lanes), "float32", scope="local")
        for i in T.unroll(chains):
            for v in T.vectorized(lanes):
                acc[i, v] = T.float32(1.0) + T.Cast("float32", i)
        for _ in range(n):
            for i in T.unroll(chains):
                for v in T.vectorized(lanes):
                    acc[i, v] = acc[i, v] * coef[0] + coef[1]
        for i in T.unroll(chains):
            for v in T.vectorized(lanes):
                out[i * lanes + v] = acc[i, v]

    lib = tvm.tirx.build(tvm.IRModule({"main": peak}), target)
    coef = tvm.runtime.tensor(np.array([1.0000001, 1e-7], "float32"))
    out = tvm.runtime.empty((chains * lanes,), "float32")
    n = 20_000_000
    best = min(_time(lambda: lib["main"](coef, out, n)) for _ in range(5))
    return n * chains * lanes * 2 / best / 1e9


def measure_bandwidth(target: tvm.target.Target, lanes: int) -> float:
    """GB/s of one thread summing 256 MiB with 8 vector accumulators."""
    size, step = 64 << 20, 8 * lanes

    @T.prim_func
    def stream(x: T.Buffer((size,), "float32"), out: T.Buffer((step,), "float32")):
        T.func_attr({"tirx.noalias": True})
        acc = T.alloc_buffer((8, lanes), "float32", scope="local")
        for j in T.unroll(8):
            for v in T.vectorized(lanes):
                acc[j, v] = T.float32(0)
        for i in range(size // step):
            for j in T.unroll(8):
                for v in T.vectorized(lanes):
                    acc[j, v] = acc[j, v] + x[i * step + j * lanes + v]
        for j in T.unroll(8):
            for v in T.vectorized(lanes):
                out[j * lanes + v] = acc[j, v]

    lib = tvm.tirx.build(tvm.IRModule({"main": stream}), target)
    x = tvm.runtime.tensor(np.ones(size, "float32"))
    out = tvm.runtime.empty((step,), "float32")
    best = min(_time(lambda: lib["main"](x, out)) for _ in range(5))
    return size * 4 / best / 1e9


# What a call is timed with: wall time, or (``--clock cpu``) the calling thread's CPU time,
# which leaves out the time a busy neighbour keeps the thread off the core (one thread per
# runtime: both run their kernels in the calling thread).
CLOCK = time.perf_counter


def _time(call) -> float:
    start = CLOCK()
    call()
    return CLOCK() - start


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# ----------------------------------------------------------------------------- the sweep

def alternate(*calls, seconds: float, min_calls: int = 5) -> list[list[float]]:
    """Seconds per call of each of ``calls``, calls alternating one by one until each has run
    at least ``min_calls`` times and ``seconds`` have passed."""
    for call in calls:
        call()  # warm-up
    times = [[] for _ in calls]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times[0]) < min_calls:
        for call, samples in zip(calls, times):
            samples.append(_time(call))
    return times


def run_case(case: Case, target: tvm.target.Target, seconds: float, options: dict,
             stock: bool = False) -> dict:
    """Build ``case`` through tvm_fusion (and, with ``stock``, through stock FuseOps with our
    CPU schedules: the ``tvm-fuseops-sched`` variant), check it against ONNX Runtime and time
    them all in one alternating loop."""
    options_ = ort.SessionOptions()
    options_.intra_op_num_threads = 1
    options_.inter_op_num_threads = 1
    session = ort.InferenceSession(case.model.SerializeToString(), options_,
                                   providers=["CPUExecutionProvider"])
    start = time.perf_counter()
    executable = compile_model(import_onnx(case.model), target, **options)
    build_s = time.perf_counter() - start
    expected = session.run(None, case.feeds)[0]
    args = [tvm.runtime.tensor(v) for v in case.feeds.values()]

    def runner(exe):
        vm = relax.VirtualMachine(exe, tvm.cpu())
        got = vm["main"](*args).numpy()
        got, want = got.astype("float64"), expected.astype("float64")
        err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
        return (lambda: vm["main"](*args)), err

    ours_call, err = runner(executable)
    calls = [ours_call, lambda: session.run(None, case.feeds)]
    stock_err = None
    if stock:
        stock_call, stock_err = runner(compile_model(import_onnx(case.model), target,
                                                     strategy="tvm", schedule=True))
        calls.append(stock_call)
    times = alternate(*calls, seconds=seconds)
    ours, theirs = times[0], times[1]
    ours_s, ort_s = statistics.median(ours), statistics.median(theirs)
    # the fastest calls: what each does undisturbed, when a busy neighbour makes the medians
    # of calls that alternate still drift apart
    row = {"name": case.name, "family": case.family, **case.shape, "ours_ms": ours_s * 1e3,
           "ort_ms": ort_s * 1e3, "flop": case.flop, "bytes": case.bytes_read,
           "bandwidth_bound": case.bandwidth_bound, "speed_vs_ort": ort_s / ours_s,
           "speed_vs_ort_fastest": min(theirs) / min(ours), "calls": len(ours),
           "rel_err": err, "build_s": build_s}
    if stock:
        row["stock_ms"] = statistics.median(times[2]) * 1e3
        row["stock_rel_err"] = stock_err
    return row


def in_dtype(case: Case, dtype: str) -> Case:
    """``case`` with its model, weights and inputs in ``dtype`` (``--dtype float16``: storage
    half the bytes; the FLOPs are the same)."""
    if dtype == "float32":
        return case
    feeds = {name: value.astype(dtype) for name, value in case.feeds.items()}
    return Case(case.name, case.family, cast_model(case.model, dtype), feeds, case.flop,
                case.bytes_read / 2, case.bandwidth_bound, case.shape)


def describe(row: dict, peak: float, bandwidth: float) -> dict:
    ours, theirs = row["ours_ms"] / 1e3, row["ort_ms"] / 1e3
    row["ours_gflops"] = row["flop"] / ours / 1e9
    row["ort_gflops"] = row["flop"] / theirs / 1e9
    if row["bandwidth_bound"]:
        row["ours_pct"] = 100 * row["bytes"] / ours / 1e9 / bandwidth
        row["ort_pct"] = 100 * row["bytes"] / theirs / 1e9 / bandwidth
        row["pct_of"] = "bandwidth"
    else:
        row["ours_pct"] = 100 * row["ours_gflops"] / peak
        row["ort_pct"] = 100 * row["ort_gflops"] / peak
        row["pct_of"] = "peak"
    return row


def table(rows: list[dict]) -> str:
    stock = any("stock_ms" in r for r in rows)
    shape = "shape (M×K×N)" if all(r["family"] == "matmul" for r in rows) else "shape"
    lines = [f"| {shape} | tvm_fusion ms | ORT ms | "
             + ("FuseOps+sched ms | " if stock else "")
             + "tvm_fusion GFLOP/s | % of peak (bw) | ORT % | speed vs ORT (medians) | "
             "(fastest calls) |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if stock else "")]
    for r in rows:
        unit = " bw" if r["pct_of"] == "bandwidth" else ""
        extra = (f"{r['stock_ms']:.3f} | " if "stock_ms" in r else "– | ") if stock else ""
        lines.append(f"| {r['name']} | {r['ours_ms']:.3f} | {r['ort_ms']:.3f} | {extra}"
                     f"{r['ours_gflops']:.1f} | {r['ours_pct']:.0f}{unit} | "
                     f"{r['ort_pct']:.0f}{unit} | {r['speed_vs_ort']:.2f} | "
                     f"{r['speed_vs_ort_fastest']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    x = np.arange(len(rows))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(10, 0.28 * len(rows)), 8), sharex=True)
    top.bar(x, [r["speed_vs_ort"] for r in rows],
            color=["tab:green" if r["speed_vs_ort"] >= 1 else "tab:orange"
                   if r["speed_vs_ort"] >= 0.8 else "tab:red" for r in rows])
    if any("stock_ms" in r for r in rows):
        top.plot([i for i, r in enumerate(rows) if "stock_ms" in r],
                 [r["ort_ms"] / r["stock_ms"] for r in rows if "stock_ms" in r], "k_",
                 markersize=12, label="FuseOps + our schedules")
        top.legend(fontsize=7)
    for level in (0.8, 1.0):
        top.axhline(level, color="grey", linestyle="--", linewidth=0.8)
    top.set_ylabel("speed vs ONNX Runtime (×)")
    top.set_title(title, fontsize=9)
    bottom.plot(x, [r["ours_pct"] for r in rows], "o", label="tvm_fusion")
    bottom.plot(x, [r["ort_pct"] for r in rows], "x", label="ONNX Runtime")
    bottom.set_ylabel("% of FMA peak (M=1: % of read bandwidth)")
    bottom.set_ylim(0, max([110] + [r["ours_pct"] + 10 for r in rows]))
    bottom.legend()
    bottom.set_xticks(x, names, rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="leave out shapes over 20 GFLOP")
    parser.add_argument("--families", default="matmul", help="comma list of " + ",".join(FAMILIES))
    parser.add_argument("--only", default="", help="comma list of case names (M x K x N)")
    parser.add_argument("--target", default="", help="LLVM target as JSON (default: this CPU, "
                        "one core)")
    parser.add_argument("--peak-gflops", type=float, default=None)
    parser.add_argument("--bandwidth", type=float, default=None, help="read bandwidth, GB/s")
    parser.add_argument("--seconds", type=float, default=2.0, help="timing per shape")
    parser.add_argument("--option", action="append", default=[],
                        help="tvm_fusion option name=value (e.g. pack_weights=false)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time calls by wall clock or by this thread's CPU time (a "
                        "shared machine: only the time the thread ran)")
    parser.add_argument("--stock", action="store_true",
                        help="also time stock FuseOps with our schedules (tvm-fuseops-sched)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                        help="the operators' dtype (float16: ONNX Runtime inserts Casts to "
                             "float32 on x86)")
    parser.add_argument("--out", default="out/kernels")
    args = parser.parse_args(argv)
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        print(f"bench_kernels: unknown family {unknown[0]!r} (known: {', '.join(FAMILIES)})",
              file=sys.stderr)
        return 2
    try:
        target = tvm.target.Target(json.loads(args.target) if args.target else
                                   {"kind": "llvm", "mcpu": host_cpu(), "num-cores": 1})
    except (ValueError, json.JSONDecodeError) as err:
        print(f"bench_kernels: --target: {err}", file=sys.stderr)
        return 2
    options = {}
    for item in args.option:
        name, _, value = item.partition("=")
        options[name] = {"true": True, "false": False}.get(value.lower(), value)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    lanes = cpu_params(target).lanes
    peak = args.peak_gflops or measure_peak(target, lanes)
    bandwidth = args.bandwidth or measure_bandwidth(target, lanes)
    mcpu = str(target.attrs.get("mcpu", "")) if "mcpu" in target.attrs else ""
    header = (f"{cpu_name()} (LLVM mcpu {mcpu or 'generic'}), one thread; FMA peak "
              f"{peak:.1f} GFLOP/s, read bandwidth {bandwidth:.1f} GB/s"
              f"{' (given)' if args.peak_gflops or args.bandwidth else ' (measured)'}")
    print(header, flush=True)
    only = list(dict.fromkeys(filter(None, args.only.split(","))))
    cases = [c for f in args.families.split(",") for c in FAMILIES[f](args.quick)
             if not only or c.name in only]
    for name in [n for n in only if n not in {c.name for c in cases}]:
        conv = parse_conv_name(name)  # a conv outside the sweep, named as the sweep's are
        if conv is not None:
            lazy = _Lazy(conv_case, conv)
            lazy.name = name
            cases.append(lazy)
            continue
        shape = name.split("x")  # a MatMul outside the sweep
        if len(shape) != 3 or not all(part.isdigit() and int(part) > 0 for part in shape):
            print(f"bench_kernels: --only: {name!r} is neither a case of the sweep, a conv "
                  f"named as they are (e.g. mnv2-1x1-960>160@7, x-dw3x3s2-96@112) nor MxKxN",
                  file=sys.stderr)
            return 2
        cases.append(_Lazy(matmul_case, tuple(map(int, shape))))
    rows = []
    for lazy in cases:
        case = in_dtype(lazy.build() if isinstance(lazy, _Lazy) else lazy, args.dtype)
        row = describe(run_case(case, target, args.seconds, options, args.stock), peak,
                       bandwidth)
        rows.append(row)
        print(f"{row['name']:>16}: ours {row['ours_ms']:9.3f} ms ({row['ours_pct']:3.0f} % "
              f"{row['pct_of']})  ORT {row['ort_ms']:9.3f} ms ({row['ort_pct']:3.0f} %)  "
              f"speed vs ORT {row['speed_vs_ort']:.2f} (fastest calls "
              f"{row['speed_vs_ort_fastest']:.2f})  err {row['rel_err']:.0e}"
              + (f"  FuseOps+sched {row['stock_ms']:.3f} ms" if "stock_ms" in row else ""),
              flush=True)
        del case
        gc.collect()
    mean = geomean(r["speed_vs_ort"] for r in rows)
    mean_fastest = geomean(r["speed_vs_ort_fastest"] for r in rows)
    worst = min(rows, key=lambda r: r["speed_vs_ort"]) if rows else None
    print()
    print(table(rows))
    print(f"\ngeomean speed vs ONNX Runtime: {mean:.2f}× (medians), {mean_fastest:.2f}× "
          f"(fastest calls)" + (f"; lowest median {worst['speed_vs_ort']:.2f}× "
                                f"({worst['name']})" if worst else ""))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": _commit(), "cpu": cpu_name(), "mcpu": mcpu, "target": str(target),
            "peak_gflops": peak, "bandwidth_gbs": bandwidth, "load_average": os.getloadavg(),
            "onnxruntime": ort.__version__, "tvm": tvm.__version__, "clock": args.clock,
            "geomean_speed_vs_ort": mean, "geomean_speed_vs_ort_fastest": mean_fastest}
    (out / "kernels.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, out / "kernels.png", header)
    print(f"wrote {out / 'kernels.json'} and {out / 'kernels.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

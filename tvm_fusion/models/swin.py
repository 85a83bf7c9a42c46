"""Small ONNX models of the layout-heavy blocks SmartMem targets.

The Swin-T window-attention block is written the way torchvision's ``shifted_window_attention``
exports it (``models/swin_t.onnx``, stage 1): window partition (Reshape → Transpose →
Reshape), the QKV projection, the head split (Reshape → Transpose → three ``Gather`` on axis
0), ``q·scale @ kᵀ`` plus the relative-position bias gathered from its table, softmax, ``@ v``,
the head merge (Transpose → Reshape), the output projection and the window reverse (Reshape →
Transpose → Reshape). Half of its operators only move data, which is the point.
"""

from __future__ import annotations

import numpy as np
import onnx

from .graph import GraphBuilder

__all__ = ["relative_position_index", "swin_window_attention"]


def relative_position_index(window: int) -> np.ndarray:
    """Swin's ``relative_position_index`` (window² × window², flattened): the bias table row of
    every (query, key) pair of one window."""
    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij"))
    flat = coords.reshape(2, -1)
    rel = (flat[:, :, None] - flat[:, None, :]).transpose(1, 2, 0) + (window - 1)
    return (rel[..., 0] * (2 * window - 1) + rel[..., 1]).reshape(-1).astype(np.int64)


def swin_window_attention(
    resolution: int = 56, channels: int = 96, heads: int = 3, window: int = 7, seed: int = 0
) -> onnx.ModelProto:
    """Swin-T's window attention (stage 1 by default: 56×56×96, 3 heads, 7×7 windows).

    Input ``x`` is ``(1, H, W, C)`` (channels last, as Swin keeps it); the output has the same
    shape. Weights are initializers, so they are constants after import.
    """
    if resolution % window or channels % heads:
        raise ValueError("resolution must be a multiple of window and channels of heads")
    rng = np.random.default_rng(seed)
    n_win = resolution // window
    tokens = window * window
    head_dim = channels // heads
    windows = n_win * n_win
    g = GraphBuilder("swin_window_attention")
    x = g.add_input("x", [1, resolution, resolution, channels])
    const = g.add_initializer
    const("w_qkv", (rng.standard_normal((channels, 3 * channels)) / np.sqrt(channels))
          .astype(np.float32))
    const("b_qkv", (0.1 * rng.standard_normal(3 * channels)).astype(np.float32))
    const("w_proj", (rng.standard_normal((channels, channels)) / np.sqrt(channels))
          .astype(np.float32))
    const("b_proj", (0.1 * rng.standard_normal(channels)).astype(np.float32))
    const("bias_table", (0.1 * rng.standard_normal(((2 * window - 1) ** 2, heads)))
          .astype(np.float32))
    const("bias_index", relative_position_index(window))
    const("scale", np.array(head_dim ** -0.5, np.float32))
    const("s_part", np.array([1, n_win, window, n_win, window, channels], np.int64))
    const("s_win", np.array([windows, tokens, channels], np.int64))
    const("s_qkv", np.array([windows, tokens, 3, heads, head_dim], np.int64))
    const("s_bias", np.array([tokens, tokens, heads], np.int64))
    const("s_merge", np.array([windows, tokens, channels], np.int64))
    const("s_rev", np.array([1, n_win, n_win, window, window, channels], np.int64))
    const("s_out", np.array([1, resolution, resolution, channels], np.int64))
    const("i0", np.array(0, np.int64))
    const("i1", np.array(1, np.int64))
    const("i2", np.array(2, np.int64))
    const("axes0", np.array([0], np.int64))
    node = g.add_node
    # window partition
    node("Reshape", [x, "s_part"], ["part6"])
    node("Transpose", ["part6"], ["part6t"], perm=[0, 1, 3, 2, 4, 5])
    node("Reshape", ["part6t", "s_win"], ["xw"])
    # qkv projection and head split
    node("MatMul", ["xw", "w_qkv"], ["qkv_mm"])
    node("Add", ["b_qkv", "qkv_mm"], ["qkv"])
    node("Reshape", ["qkv", "s_qkv"], ["qkv5"])
    node("Transpose", ["qkv5"], ["qkv5t"], perm=[2, 0, 3, 1, 4])
    node("Gather", ["qkv5t", "i0"], ["q"], axis=0)
    node("Gather", ["qkv5t", "i1"], ["k"], axis=0)
    node("Gather", ["qkv5t", "i2"], ["v"], axis=0)
    # attention with relative position bias
    node("Mul", ["q", "scale"], ["qs"])
    node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2])
    node("MatMul", ["qs", "kt"], ["attn"])
    node("Gather", ["bias_table", "bias_index"], ["bias_g"], axis=0)
    node("Reshape", ["bias_g", "s_bias"], ["bias3"])
    node("Transpose", ["bias3"], ["bias3t"], perm=[2, 0, 1])
    node("Unsqueeze", ["bias3t", "axes0"], ["bias4"])
    node("Add", ["attn", "bias4"], ["attn_b"])
    node("Softmax", ["attn_b"], ["prob"], axis=-1)
    node("MatMul", ["prob", "v"], ["ctx"])
    # head merge, output projection, window reverse
    node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3])
    node("Reshape", ["ctx_t", "s_merge"], ["ctx_m"])
    node("MatMul", ["ctx_m", "w_proj"], ["proj_mm"])
    node("Add", ["b_proj", "proj_mm"], ["proj"])
    node("Reshape", ["proj", "s_rev"], ["rev6"])
    node("Transpose", ["rev6"], ["rev6t"], perm=[0, 1, 3, 2, 4, 5])
    node("Reshape", ["rev6t", "s_out"], ["y"])
    g.add_output("y", [1, resolution, resolution, channels])
    return g.model()

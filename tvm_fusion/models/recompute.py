"""Small models where a fused loop nest may recompute: the fusion guard's cases.

* :func:`patch_merging`: Swin-T's patch merging (``x(1, H, W, C)`` → four stride-2 slices →
  concat → LayerNorm → matmul), the block issue 20 measured 2.3× slower fused on one machine;
* :func:`layer_norm_tiled`: a LayerNorm read by a ``Tile`` along its rows, so a fused kernel
  computing each row's statistics per output row recomputes them ``copies`` times;
* :func:`reduction_tiled`: a row reduction (``ReduceMax``) broadcast by a ``Tile``, the same
  for a reduction alone.
"""

from __future__ import annotations

import numpy as np
import onnx

from .graph import GraphBuilder

__all__ = ["layer_norm_tiled", "patch_merging", "reduction_tiled"]


def _layer_norm_params(g: GraphBuilder, rng, c: int) -> tuple[str, str]:
    gamma = g.add_initializer("gamma", (1 + 0.1 * rng.standard_normal(c)).astype(np.float32))
    beta = g.add_initializer("beta", (0.1 * rng.standard_normal(c)).astype(np.float32))
    return gamma, beta


def patch_merging(resolution: int = 14, channels: int = 32, seed: int = 0) -> onnx.ModelProto:
    """Swin's ``PatchMerging`` as torchvision exports it (without the zero pad of an even
    side): ``(1, H, W, C)`` → ``(1, H/2, W/2, 2C)``."""
    if resolution % 2:
        raise ValueError("resolution must be even")
    rng = np.random.default_rng(seed)
    c = channels
    g = GraphBuilder("patch_merging")
    g.add_input("x", [1, resolution, resolution, c])
    gamma, beta = _layer_norm_params(g, rng, 4 * c)
    g.add_initializer("w", (rng.standard_normal((4 * c, 2 * c)) / np.sqrt(4 * c))
                      .astype(np.float32))
    for name, value in (("end", [resolution, resolution]), ("axes", [1, 2]), ("steps", [2, 2])):
        g.add_initializer(name, np.array(value, np.int64))
    parts = []
    for i, start in enumerate(([0, 0], [1, 0], [0, 1], [1, 1])):  # torchvision's x0..x3
        g.add_initializer(f"start{i}", np.array(start, np.int64))
        parts += g.add_node("Slice", ["x", f"start{i}", "end", "axes", "steps"], [f"x{i}"])
    g.add_node("Concat", parts, ["merged"], axis=-1)
    g.add_node("LayerNormalization", ["merged", gamma, beta], ["normed"], axis=-1, epsilon=1e-5)
    g.add_node("MatMul", ["normed", "w"], ["y"])
    g.add_output("y", [1, resolution // 2, resolution // 2, 2 * c])
    return g.model(doc=patch_merging.__doc__)


def layer_norm_tiled(rows: int = 16, channels: int = 64, copies: int = 8,
                     seed: int = 0) -> onnx.ModelProto:
    """``Tile(LayerNorm(x), [1, copies, 1])`` on ``x(1, rows, channels)``."""
    rng = np.random.default_rng(seed)
    g = GraphBuilder("layer_norm_tiled")
    g.add_input("x", [1, rows, channels])
    gamma, beta = _layer_norm_params(g, rng, channels)
    g.add_initializer("reps", np.array([1, copies, 1], np.int64))
    g.add_node("LayerNormalization", ["x", gamma, beta], ["normed"], axis=-1, epsilon=1e-5)
    g.add_node("Tile", ["normed", "reps"], ["y"])
    g.add_output("y", [1, rows * copies, channels])
    return g.model(doc=layer_norm_tiled.__doc__)


def reduction_tiled(rows: int = 16, channels: int = 64, copies: int = 8,
                    reduce: str = "ReduceMax") -> onnx.ModelProto:
    """``Tile(x - reduce(x, -1), [1, copies, 1])`` on ``x(1, rows, channels)``: a row
    reduction (``ReduceMax`` by default) whose result every output
    row of the tile reads."""
    g = GraphBuilder("reduction_tiled")
    g.add_input("x", [1, rows, channels])
    g.add_initializer("reps", np.array([1, copies, 1], np.int64))
    g.add_node(reduce, ["x"], ["peak"], axes=[-1], keepdims=1)  # opset 13: an attribute
    g.add_node("Sub", ["x", "peak"], ["shifted"])
    g.add_node("Tile", ["shifted", "reps"], ["y"])
    g.add_output("y", [1, rows * copies, channels])
    return g.model(doc=reduction_tiled.__doc__)

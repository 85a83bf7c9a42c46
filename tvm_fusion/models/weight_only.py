"""Weight-only quantized models: float32 activations, integer weights read through ONNX's
``DequantizeLinear`` (what a weight-only int8 export of an LLM's linear layers looks like).

``weight_only_matmul`` is one MatMul ``x[M, K] · dq(W_q)``; ``weight_only_mlp`` a Llama-style
MLP (SwiGLU: ``down(silu(gate(x)) · up(x))``). Each weight is quantized from a fixed random
float weight: per output channel (``block=None``: ``axis`` the output channels, symmetric or
with ``zero_point=True`` a small zero point per channel), or in blocks of ``block`` along K
(opset 21's ``block_size``). ``transposed`` stores ``W_q`` as ``[N, K]`` (a PyTorch Linear's
weight) read through a Transpose. ``float_weights`` gives the same model with the dequantized
float32 weights as initializers (the float32 GEMM the quantized one is measured against).
"""

from __future__ import annotations

import numpy as np

from .graph import GraphBuilder

__all__ = ["quantize_weight", "weight_only_matmul", "weight_only_mlp"]


def quantize_weight(w: np.ndarray, axis: int, dtype=np.int8, block: int | None = None,
                    zero_point: bool = False, rng: np.random.Generator | None = None) -> dict:
    """``w`` quantized to ``dtype`` with one scale per index of ``axis`` (the output
    channels), or with ``block``: one per block of ``block`` along ``1 - axis`` (K) and per
    output channel. Returns ``q``, ``scale``, ``zero_point`` (or None) and ``dequantized``
    (float32, what DequantizeLinear computes)."""
    info = np.iinfo(dtype)
    lo, hi = int(info.min), int(info.max)
    k_axis = 1 - axis
    if block is None:
        scale = (np.abs(w).max(axis=k_axis, keepdims=True) / (hi - (lo + hi + 1) // 2))
        full = scale
    else:
        k = w.shape[k_axis]
        blocks = -(-k // block)
        padded = np.zeros(w.shape[:k_axis] + (blocks * block,) + w.shape[k_axis + 1:])
        np.moveaxis(padded, k_axis, 0)[:k] = np.moveaxis(w, k_axis, 0)
        grouped = np.moveaxis(padded, k_axis, 0).reshape(blocks, block, -1)
        scale = np.moveaxis(np.abs(grouped).max(axis=1).reshape(
            (blocks,) + tuple(np.moveaxis(w, k_axis, 0).shape[1:])), 0, k_axis)
        scale = scale / (hi - (lo + hi + 1) // 2)
        full = np.repeat(scale, block, axis=k_axis).take(range(k), axis=k_axis)
    scale = np.maximum(scale, 1e-8).astype(np.float32)
    full = np.maximum(full, 1e-8).astype(np.float32)
    zp = None
    if zero_point or lo == 0:  # an unsigned type always needs its middle as zero point
        rng = rng or np.random.default_rng(0)
        zp = (rng.integers(-3, 4, scale.shape) if zero_point else np.zeros(scale.shape, int)) \
            + (lo + hi + 1) // 2
    zfull = 0 if zp is None else (zp if block is None else np.repeat(zp, block, axis=k_axis)
                                  .take(range(w.shape[k_axis]), axis=k_axis))
    q = np.clip(np.round(w / full) + zfull, lo, hi).astype(dtype)
    deq = ((q.astype(np.float32) - np.float32(zfull)) * full).astype(np.float32)
    if block is None:
        scale = scale.reshape(-1)
        zp = None if zp is None else zp.reshape(-1)
    return {"q": q, "scale": scale, "zero_point": None if zp is None else zp.astype(dtype),
            "dequantized": deq}


class _Builder(GraphBuilder):
    def __init__(self, name, seed, transposed, dtype, block, zero_point, float_weights):
        super().__init__(name, opset=21 if block else 17)
        self.rng = np.random.default_rng(seed)
        self.transposed, self.dtype, self.block = transposed, dtype, block
        self.zero_point, self.float_weights = zero_point, float_weights

    def weight(self, k: int, n: int) -> str:
        """``B[K, N]``: an int8 ``W_q`` through DequantizeLinear (and a Transpose when
        ``transposed``), or its float32 dequantized values."""
        w = self.rng.standard_normal((n, k) if self.transposed else (k, n)) / np.sqrt(k)
        axis = 0 if self.transposed else 1
        qw = quantize_weight(w, axis, self.dtype, self.block, self.zero_point, self.rng)
        if self.float_weights:
            name = self.add_initializer(self.fresh("w"), qw["dequantized"])
        else:
            inputs = [self.add_initializer(self.fresh("wq"), qw["q"], self.dtype),
                      self.add_initializer(self.fresh("ws"), qw["scale"], np.float32)]
            if qw["zero_point"] is not None:
                inputs.append(self.add_initializer(self.fresh("wz"), qw["zero_point"],
                                                   self.dtype))
            attrs = {"axis": axis} if self.block is None else \
                {"axis": 1 - axis, "block_size": self.block}
            name = self.add_node("DequantizeLinear", inputs, [self.fresh("w")], **attrs)[0]
        if self.transposed:
            name = self.add_node("Transpose", [name], [self.fresh("wt")], perm=[1, 0])[0]
        return name

    def matmul(self, x: str, k: int, n: int, out: str | None = None) -> str:
        return self.add_node("MatMul", [x, self.weight(k, n)], [out or self.fresh("mm")])[0]


def weight_only_matmul(m, k: int, n: int, *, seed: int = 0, transposed: bool = False,
                       dtype=np.int8, block: int | None = None, zero_point: bool = False,
                       float_weights: bool = False):
    """``y = x[M, K] · dq(W_q)[K, N]``; ``m`` an int or a symbolic name."""
    b = _Builder("weight_only_matmul", seed, transposed, dtype, block, zero_point,
                 float_weights)
    x = b.add_input("x", [m, k])
    b.add_output(b.matmul(x, k, n, "y"))
    return b.model()


def weight_only_mlp(m="M", hidden: int = 256, intermediate: int = 688, *, seed: int = 0,
                    transposed: bool = False, dtype=np.int8, block: int | None = None,
                    zero_point: bool = False, float_weights: bool = False):
    """Llama's MLP on ``x[M, hidden]``: ``down(silu(gate(x)) · up(x))``, three weight-only
    quantized projections."""
    b = _Builder("weight_only_mlp", seed, transposed, dtype, block, zero_point, float_weights)
    x = b.add_input("x", [m, hidden])
    gate = b.matmul(x, hidden, intermediate)
    up = b.matmul(x, hidden, intermediate)
    sig = b.add_node("Sigmoid", [gate], [b.fresh("sig")])[0]
    silu = b.add_node("Mul", [gate, sig], [b.fresh("silu")])[0]
    h = b.add_node("Mul", [silu, up], [b.fresh("h")])[0]
    b.add_output(b.matmul(h, intermediate, hidden, "y"))
    return b.model()

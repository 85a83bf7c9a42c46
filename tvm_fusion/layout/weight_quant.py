"""Weight-only quantized GEMM weights: an integer constant read through ``R.dequantize`` whose
scale (and zero point) is per output channel, recognised so that the packed GEMM can keep the
integers packed and dequantize in its inner loop (``layout/gemm_pack.py``).

ONNX's weight-only quantization is ``DequantizeLinear(W_q, scale, zero_point, axis) → MatMul``
(or ``Gemm``): TVM's importer gives ``R.dequantize(q, s, zp, axis)`` of constants, which
``FoldConstant`` would fold into a float32 weight, four times the bytes. Per output channel
``c`` the sum factors::

    Σ_k a[k] · (q[k, c] − zp[c]) · s[c]  =  s[c] · Σ_k a[k] · (q[k, c] − zp[c])

so the GEMM multiplies integers widened to float32 in registers, and the scale is one product
per output element after the K loop (an elementwise epilogue, fused into the GEMM's store).
A scale along K (per input channel, or blocks along K) does not factor out: such a weight is
left to the float32 path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import GenericConst

#: Integer weight types kept packed as they are (LLVM widens them to float32 lanes).
WEIGHT_DTYPES = ("int8", "uint8")


@dataclass
class QuantizedWeight:
    """``B = (q − zp) · scale`` with ``q`` the integer ``[K, N]`` (``[N, K]`` when read
    through a transpose: ``transposed``), ``scale``/``zero_point`` one value per column of B
    (zero point ``None`` when every one is zero)."""

    q: np.ndarray
    scale: np.ndarray  # float32 [N]
    zero_point: np.ndarray | None  # float32 [N] or None


def _const(expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, GenericConst) else None


def _per_column(value: np.ndarray, n: int) -> np.ndarray | None:
    """A per-tensor (scalar) or per-channel ([N]) value as N values, else None."""
    if value.size == 1:
        return np.full(n, value.reshape(()), dtype=value.dtype)
    return value.reshape(n) if value.shape == (n,) else None


def quantized_weight(expr: relax.Expr, transposed: bool) -> QuantizedWeight | None:
    """The per-output-channel quantized 2-D constant weight ``expr`` (an ``R.dequantize`` of
    constants to float32) computes, or None. ``transposed``: the matmul reads its transpose,
    so the output channels are axis 0 of ``q``, not axis 1."""
    if not (isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.dequantize"):
        return None
    q, scale, zp = (_const(a) for a in expr.args)
    if q is None or scale is None or zp is None or q.ndim != 2 or 0 in q.shape:
        return None
    if str(q.dtype) not in WEIGHT_DTYPES or str(expr.ty.dtype) != "float32":
        return None
    if str(scale.dtype) != "float32":
        return None
    out_axis = 0 if transposed else 1
    n = q.shape[out_axis]
    axis = int(expr.attrs.axis) % 2
    # one value (per tensor) needs no axis; a vector must run along the output channels
    if (scale.size != 1 or zp.size != 1) and axis != out_axis:
        return None
    scale, zp = _per_column(scale, n), _per_column(zp, n)
    if scale is None or zp is None:
        return None
    zero = None if not zp.any() else zp.astype(np.float32)
    return QuantizedWeight(q, scale.astype(np.float32), zero)


def pack_columns(values: np.ndarray, nr: int) -> np.ndarray:
    """Per-column values ``[N]`` laid out as the panels' columns, ``[⌈N/NR⌉, NR]``, zeros
    past column N."""
    panels = -(-values.shape[0] // nr)
    out = np.zeros(panels * nr, dtype=values.dtype)
    out[:values.shape[0]] = values
    return out.reshape(panels, nr)


def is_quantized_dtype(dtype) -> bool:
    return str(tvm.DataType(str(dtype))) in WEIGHT_DTYPES


__all__ = ["WEIGHT_DTYPES", "QuantizedWeight", "is_quantized_dtype", "pack_columns",
           "quantized_weight"]

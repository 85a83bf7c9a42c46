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

Block-wise weights (opset 21's ``block_size`` along K, imported by the frontend's
``blocked_dequantize`` repair as ``(astype(q) − spread(zp)) · spread(scale)``, ``spread``
repeating each block's value along K) keep their scale inside the sum: the kernel multiplies
the widened integer by its block's scale as it reads it. A scale per input channel (axis K,
no blocks) is left to the float32 path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import relax
from tvm.ir.expr import GenericConst

from ..tir_schedules.cpu_gemm import WEIGHT_DTYPES  # the 8-bit types the kernel widens


@dataclass
class QuantizedWeight:
    """``B = (q − zp) · scale`` with ``q`` the integer ``[K, N]`` (``[N, K]`` when read
    through a transpose: ``transposed``), ``scale``/``zero_point`` one value per column of B,
    ``[N]``, or with ``block`` one per column and block of ``block`` rows of B, ``[⌈K/block⌉,
    N]`` (zero point ``None`` when every one is zero)."""

    q: np.ndarray
    scale: np.ndarray  # float32 [N], or [⌈K/block⌉, N]
    zero_point: np.ndarray | None  # float32, shaped as scale, or None
    block: int | None = None


def _const(expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, GenericConst) else None


def _per_column(value: np.ndarray, n: int) -> np.ndarray | None:
    """A per-tensor (scalar) or per-channel ([N]) value as N values, else None."""
    if value.size == 1:
        return np.full(n, value.reshape(()), dtype=value.dtype)
    return value.reshape(n) if value.shape == (n,) else None


def _call(expr, name: str, lookup) -> relax.Call | None:
    """``expr`` (or what the variable ``expr`` is bound to) when it is a call of ``name``."""
    if isinstance(expr, relax.Var):
        expr = lookup(expr)
    if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == f"relax.{name}":
        return expr
    return None


def _ints(tup) -> list[int] | None:
    fields = getattr(tup, "fields", None)
    if fields is None or not all(hasattr(f, "value") for f in fields):
        return None
    return [int(f.value) for f in fields]


def _spread(expr, lookup, k_axis: int, k: int) -> tuple[np.ndarray, int] | None:
    """(the constant, block) of ``strided_slice(repeat(c, block, k_axis))`` or
    ``repeat(c, block, k_axis)`` of length ``k`` along ``k_axis``."""
    sliced = _call(expr, "strided_slice", lookup)
    if sliced is not None:
        axes, begin = (_ints(a) for a in sliced.args[1:3])
        if axes is None or [a % 2 for a in axes] != [k_axis] or begin != [0]:
            return None
        expr = sliced.args[0]
    repeat = _call(expr, "repeat", lookup)
    if repeat is None or int(repeat.attrs.axis) % 2 != k_axis:
        return None
    value = _const(repeat.args[0])
    block = int(repeat.attrs.repeats)
    if value is None or value.ndim != 2 or -(-k // block) != value.shape[k_axis]:
        return None
    return value, block


def _blocked(expr, transposed: bool, lookup) -> QuantizedWeight | None:
    """The block-wise weight of the ``blocked_dequantize`` repair's form, or None."""
    mul = _call(expr, "multiply", lookup)
    if mul is None:
        return None
    value, scale_expr = mul.args
    zp_expr = None
    sub = _call(value, "subtract", lookup)
    if sub is not None:
        value, zp_expr = sub.args
    cast = _call(value, "astype", lookup)
    q = None if cast is None else _const(cast.args[0])
    if q is None or q.ndim != 2 or str(q.dtype) not in WEIGHT_DTYPES \
            or str(cast.ty.dtype) != "float32":
        return None
    k_axis = 1 if transposed else 0
    scale = _spread(scale_expr, lookup, k_axis, q.shape[k_axis])
    if scale is None or str(scale[0].dtype) != "float32":
        return None
    zp = None
    if zp_expr is not None:
        zp_cast = _call(zp_expr, "astype", lookup)
        zp = None if zp_cast is None else _spread(zp_cast.args[0], lookup, k_axis,
                                                   q.shape[k_axis])
        if zp is None or zp[1] != scale[1]:
            return None
    # in B's orientation: [blocks of K, N]
    def oriented(v):
        return np.ascontiguousarray(v.T if transposed else v).astype(np.float32)
    zero = None if zp is None or not zp[0].any() else oriented(zp[0])
    return QuantizedWeight(q, oriented(scale[0]), zero, scale[1])


def quantized_weight(expr: relax.Expr, transposed: bool,
                     lookup=lambda var: None) -> QuantizedWeight | None:
    """The quantized 2-D constant weight ``expr`` computes, or None: an ``R.dequantize`` of
    constants to float32 per output channel (or per tensor), or the frontend's block-wise
    form (``lookup`` gives a variable's bound value). ``transposed``: the matmul reads its
    transpose, so the output channels are axis 0 of ``q``, not axis 1."""
    if not (isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.dequantize"):
        return _blocked(expr, transposed, lookup)
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
    """Per-column values ``[N]`` laid out as the panels' columns, ``[⌈N/NR⌉, NR]``, or per
    block and column ``[KB, N]`` as ``[⌈N/NR⌉, KB, NR]``; zeros past column N."""
    n = values.shape[-1]
    panels = -(-n // nr)
    rows = values.reshape(-1, n)
    out = np.zeros((rows.shape[0], panels * nr), dtype=values.dtype)
    out[:, :n] = rows
    out = out.reshape(rows.shape[0], panels, nr).transpose(1, 0, 2)
    return np.ascontiguousarray(out[:, 0] if values.ndim == 1 else out)


__all__ = ["WEIGHT_DTYPES", "QuantizedWeight", "pack_columns", "quantized_weight"]

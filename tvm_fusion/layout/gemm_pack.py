"""Constant GEMM weights packed at compile time into the panels the CPU GEMM kernel streams.

``R.matmul(x, B)`` whose ``B`` is a 2-D constant (an ONNX MatMul with an initializer) or the
transpose of one (ONNX Gemm with ``transB=1``, PyTorch's ``x @ W.T``) becomes

    y = call_tir(matmul_packed, (x, Bp))    # y[..., i, j] = Σ_k x[..., i, k] ·
                                            #     Bp[j // NR, k, j % NR]

with ``Bp[⌈N/NR⌉, K, NR]`` zero-padded to whole panels of NR columns (the target's GEMM
register tile, :meth:`~tvm_fusion.tir_schedules.cpu_target.CpuParams.gemm_tile`; a narrower
panel, whole vectors, when N is smaller). Each k-step of a panel is NR contiguous floats and a
panel's K rows follow each other, which is the order the micro-kernel reads them
(``tir_schedules/gemm_template.py``). ``Bp`` is a new constant computed here from ``W``'s
data, so the module holds the packed weight only (what MLAS's ``MlasGemmPackB`` does at
session creation); packing in numpy, not as a TIR function folded by ``FoldConstant``, keeps
the pass at milliseconds (folding built one LLVM function per weight shape: seconds per model).

A weight-only quantized weight (``R.dequantize`` of an int8/uint8 constant per output channel,
or the frontend's block-wise form: :mod:`.weight_quant`) is packed as integers into the same
panels; ``matmul_packed`` widens them to float32 as it reads them (less the zero point, times a
block's scale), and a per-channel scale becomes an elementwise multiply after it, an epilogue.
Those are packed by a first run (``quantized_only``) before the rewriting's ``FoldConstant``.

``matmul_packed`` is an ordinary reduction for legalisation, TVM's op patterns and fusion: the
epilogues fuse into it as into a matmul; ``ScheduleFusedBlocks`` recognises its read of ``Bp``
and emits the packed GEMM nest (``tir_schedules/cpu_gemm.py``).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.ir.expr import GenericConst

from ..tir_schedules.cpu_target import CpuParams, cpu_params
from .weight_quant import QuantizedWeight, pack_columns, quantized_weight

PACKED_GEMM = "matmul_packed"


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


def panel_width(n: int, params: CpuParams) -> int:
    """NR of the panels for N columns: the ISA's tile, or fewer whole vectors when N is
    smaller (a 1- or 17-column B is not padded to 24)."""
    _, nr = params.gemm_tile()
    lanes = params.lanes
    return min(nr, -(-n // lanes) * lanes)


def packed_matmul(x: te.Tensor, bp: te.Tensor, n: int, zp: te.Tensor | None = None,
                  scale: te.Tensor | None = None, block: int = 0) -> te.Tensor:
    """``x[..., K] · B`` for ``B`` packed as ``bp[⌈n/NR⌉, K, NR]``. An integer ``bp`` (a
    weight-only quantized B) is widened to float32 as it is read, less its zero point (float32,
    ``zp[⌈n/NR⌉, NR]`` per column or ``[⌈n/NR⌉, ⌈K/block⌉, NR]`` per block) when there is one;
    a block-wise weight is then multiplied by its block's ``scale[⌈n/NR⌉, ⌈K/block⌉, NR]``
    (a per-column scale is applied after the sum, by the caller)."""
    nr = int(bp.shape[2])
    k = te.reduce_axis((0, x.shape[-1]), name="k")

    def value(*idx):
        j = idx[-1]
        panel = tirx.floordiv(j, tirx.const(nr, _dtype(j)))
        lane = tirx.floormod(j, tirx.const(nr, _dtype(j)))
        b = bp[panel, k, lane]
        if str(bp.dtype) != "float32":
            kb = tirx.floordiv(k.var, tirx.const(block or 1, _dtype(k.var)))
            b = b.astype("float32")
            if zp is not None:
                b = b - (zp[panel, lane] if len(zp.shape) == 2 else zp[panel, kb, lane])
            if scale is not None:
                b = b * scale[panel, kb, lane]
        return te.sum(x[(*idx[:-1], k)] * b, axis=k)

    return te.compute((*x.shape[:-1], tirx.const(n, "int64")), value, name=PACKED_GEMM)


def pack_weight(w: np.ndarray, nr: int, transposed: bool) -> np.ndarray:
    """``B[K, N]`` (or ``W[N, K]`` when ``transposed``) as ``Bp[⌈N/NR⌉, K, NR]``, zeros past
    column N."""
    b = w.T if transposed else w
    k, n = b.shape
    panels = -(-n // nr)
    padded = np.zeros((k, panels * nr), dtype=w.dtype)
    padded[:, :n] = b
    return np.ascontiguousarray(padded.reshape(k, panels, nr).transpose(1, 0, 2))


@relax.expr_functor.mutator
class _Packer(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, params: CpuParams, quantized_only: bool):
        super().__init__(mod)
        self.params = params
        self.quantized_only = quantized_only
        self.packed = 0

    def _bound(self, var):
        return self.lookup_binding(var)

    def _constant_weight(self, expr) -> tuple[relax.Expr | QuantizedWeight | None, bool]:
        """(the 2-D float32 constant or per-channel quantized weight, transposed) behind
        ``expr``, or (None, False)."""
        if isinstance(expr, tvm.ir.Var):
            bound = self.lookup_binding(expr)
            if bound is not None:
                expr = bound
        transposed = False
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == \
                "relax.permute_dims":
            axes = expr.attrs.axes
            if axes is not None and [int(a) for a in axes] != [1, 0]:
                return None, False
            transposed, expr = True, expr.args[0]
            if isinstance(expr, tvm.ir.Var):
                bound = self.lookup_binding(expr)
                expr = expr if bound is None else bound
        quantized = quantized_weight(expr, transposed, self._bound)
        if quantized is not None:
            return quantized, transposed
        if not isinstance(expr, GenericConst):
            return None, False
        shape = [int(s) for s in expr.ty.shape]
        if len(shape) != 2 or str(expr.ty.dtype) != "float32" or 0 in shape:
            return None, False
        return expr, transposed

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (TVM's visitor name)
        call = self.visit_expr_post_order(call)
        if getattr(call.op, "name", "") != "relax.matmul" or len(call.args) != 2:
            return call
        x, b = call.args
        out_dtype = getattr(call.attrs, "out_dtype", None)
        if out_dtype is not None and str(out_dtype) not in ("", "void", "float32"):
            return call
        x_ty = x.ty
        if str(getattr(x_ty, "dtype", "")) != "float32" or getattr(x_ty, "shape", None) is None:
            return call
        if len(x_ty.shape) < 1:
            return call
        weight, transposed = self._constant_weight(b)
        if weight is None:
            return call
        quantized = isinstance(weight, QuantizedWeight)
        if self.quantized_only and not quantized:
            return call
        data = weight.q if quantized else weight.value.numpy()
        rows, cols = data.shape
        n, k = (rows, cols) if transposed else (cols, rows)
        x_k = x_ty.shape[-1]
        if not isinstance(x_k, tirx.IntImm) or int(x_k) != k:
            return call
        nr = panel_width(n, self.params)
        bp = relax.const(pack_weight(data, nr, transposed))
        self.packed += 1
        if not quantized:
            return self.builder_.call_te(packed_matmul, x, bp, n,
                                         primfunc_name_hint=PACKED_GEMM)
        # integers packed as they are; the per-channel scale after the K loop, an
        # elementwise epilogue that fuses into the GEMM's store (layout/weight_quant.py)
        zp = (None if weight.zero_point is None
              else relax.const(pack_columns(weight.zero_point, nr)))
        if weight.block:  # block-wise: each block's scale inside the sum
            return self.builder_.call_te(
                packed_matmul, x, bp, n, zp, relax.const(pack_columns(weight.scale, nr)),
                weight.block, primfunc_name_hint=PACKED_GEMM)
        acc = self.builder_.emit(self.builder_.call_te(
            packed_matmul, x, bp, n, zp, primfunc_name_hint=PACKED_GEMM))
        return relax.op.multiply(acc, relax.const(weight.scale))


def PackMatmulWeights(target: tvm.target.Target,  # noqa: N802 (a pass)
                      quantized_only: bool = False) -> tvm.transform.Pass:
    """Pack constant matmul weights into GEMM panels on ``llvm`` targets (other targets are
    left alone): one packed constant per weight. ``quantized_only``: only the weight-only
    quantized ones (run before anything that folds constants)."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.PackMatmulWeights")
    def _pack(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if target.kind.name != "llvm":
            return mod
        packer = _Packer(mod, cpu_params(target), quantized_only)
        changed = False
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                packer.packed = 0
                new = packer.visit_expr(func)
                if packer.packed:
                    packer.builder_.update_func(gvar, new)
                    changed = True
        if not changed:
            return mod
        # the pass's own clean-up: the unpacked weight (or its transpose) dropped
        return relax.transform.DeadCodeElimination()(packer.builder_.get())

    return _pack


__all__ = ["PACKED_GEMM", "PackMatmulWeights", "pack_weight", "packed_matmul",
           "panel_width"]

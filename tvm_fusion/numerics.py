"""How close a build's outputs are to a reference: the unfused ONNX model's outputs
(:func:`onnx_reference`), checked element-wise with a readable failure (:func:`compare`) at the
tolerance of the output's dtype (:func:`tolerance_for`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

__all__ = ["STOCK_ERROR_MARGIN", "abs_error", "check_outputs", "compare", "max_abs_error",
           "onnx_reference", "tolerance_for"]

#: How much larger than stock TVM's own error against the reference tvm_fusion's may be, as a
#: fraction of it (plus the dtype's ``atol``): two summation orders of one fp16 accumulation,
#: or one half-way tie in a QDQ graph rounded the other way and carried through the layers,
#: are samples of the same error, not a fusion bug.
STOCK_ERROR_MARGIN = 0.5


def max_abs_error(got, expected) -> float:
    """Largest absolute difference over paired outputs (arrays or TVM tensors), in float64;
    empty outputs are skipped."""
    got = [np.asarray(g.numpy() if hasattr(g, "numpy") else g, "float64") for g in got]
    expected = [np.asarray(e, "float64") for e in expected]
    return float(max((np.abs(g - e).max() for g, e in zip(got, expected) if g.size),
                     default=0.0))


def onnx_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run the unfused model: onnxruntime CPU with graph optimisations off, else onnx.reference.

    Optimisations are off so the reference does not itself fuse (and re-associate) anything.
    ``onnx.reference.ReferenceEvaluator`` is used when onnxruntime is not installed, and also when
    onnxruntime refuses to *load* the model (it has no kernels for opsets < 7, which old
    pytorch-converted backend cases use).
    """
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - onnxruntime is a dev dependency
        ort = None
    sess = None
    if ort is not None:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.log_severity_level = 3
        try:
            sess = ort.InferenceSession(
                model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
            )
        except Exception as err:  # noqa: BLE001 - ORT raises its own untyped errors
            if "NOT_IMPLEMENTED" not in str(err):
                raise
    if sess is None:
        from onnx.reference import ReferenceEvaluator

        return [np.asarray(o) for o in ReferenceEvaluator(model).run(None, feeds)]
    return [np.asarray(o) for o in sess.run(None, feeds)]


def compare(
    outputs: Sequence[np.ndarray],
    reference: Sequence[np.ndarray],
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> float:
    """Check ``|out - ref| <= atol + rtol * |ref|`` element-wise; return the max abs error.

    Raises ``AssertionError`` naming the output, its shape and the max abs/rel error, because a
    bare ``allclose`` failure inside a fusion test says nothing about which block broke.
    """
    outputs, reference = list(outputs), list(reference)
    if len(outputs) != len(reference):
        raise AssertionError(f"got {len(outputs)} outputs, reference has {len(reference)}")
    worst = 0.0
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        out, ref = np.asarray(out), np.asarray(ref)
        if out.shape != ref.shape:
            raise AssertionError(f"output {i}: shape {out.shape} != reference shape {ref.shape}")
        if out.dtype.kind in "OSU" or ref.dtype.kind in "OSU":  # strings: exact match only
            if not np.array_equal(out, ref):
                raise AssertionError(f"output {i} (shape {out.shape}): string values differ")
            continue
        if out.dtype == np.bool_ or ref.dtype == np.bool_:
            out, ref = out.astype(np.int8), ref.astype(np.int8)
        o64, r64 = out.astype(np.float64), ref.astype(np.float64)
        if o64.size == 0:
            continue
        both = ~np.isnan(o64) & ~np.isnan(r64)
        err = abs_error(o64, r64)
        max_abs = float(err.max())
        rel = err / np.maximum(np.abs(r64), np.finfo(np.float64).tiny)
        max_rel = float(np.where(err > 0, rel, 0.0).max())
        bad = err > atol + rtol * np.abs(np.where(both, r64, 0.0))
        if bad.any():
            idx = tuple(int(j) for j in np.unravel_index(int(np.argmax(err)), err.shape))
            raise AssertionError(
                f"output {i} (shape {out.shape}, dtype {out.dtype}) out of tolerance "
                f"rtol={rtol}, atol={atol}: max abs err {max_abs:.3g}, max rel err {max_rel:.3g}, "
                f"{int(bad.sum())}/{bad.size} elements bad; worst at {idx}: "
                f"got {o64[idx]!r}, expected {r64[idx]!r}"
            )
        worst = max(worst, max_abs)
    return worst


def abs_error(out: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Element-wise ``|out - ref|`` in float64, IEEE-aware: 0 where both are NaN or the same
    infinity, inf where only one is NaN."""
    o64, r64 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    nan_mismatch = np.isnan(o64) != np.isnan(r64)
    both = ~np.isnan(o64) & ~np.isnan(r64)
    inf_same = np.isinf(o64) & (o64 == r64)
    with np.errstate(invalid="ignore"):  # inf - inf where both are the same infinity
        err = np.where(both & ~inf_same, np.abs(o64 - r64), 0.0)
    return np.where(nan_mismatch, np.inf, err)


def tolerance_for(dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for checking a build's output of ``dtype`` against a reference.

    A reduced-precision output is only as exact as its format: a one- or two-ulp difference in
    fp16 is ~1e-3 relative (bf16: ~1e-2), which fp32 tolerances call a failure. Integers and
    booleans (indices, masks, counts) must match exactly.
    """
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name in ("float16", "half"):
        return 1e-2, 1e-3
    if name == "bfloat16":
        return 5e-2, 1e-2
    if name.startswith(("float", "complex")):
        return 1e-3, 1e-4
    return 0.0, 0.0


def check_outputs(ours, stock, reference, dtype=None) -> list[str]:
    """The numerical check of a build: each output of tvm_fusion against the reference (ONNX
    Runtime), with the tolerance of its dtype (:func:`tolerance_for`; ``dtype`` overrides it,
    for outputs converted to float32 such as bfloat16). Returns notes for outputs accepted
    otherwise; raises ``AssertionError`` naming the output when one is wrong.

    ``stock`` (stock TVM's outputs, or None when stock TVM cannot build the model) decides
    what the reference alone cannot:

    * integers (int8 from a QuantizeLinear, indices, masks) must equal the reference or stock
      TVM exactly: an int8 value one off is a rounding the fused kernel moved;
    * a float output out of tolerance of the reference passes when it is within tolerance of
      stock TVM's (ties that TVM's TopK/ArgMax break another way, TVM's own accumulation), or
      when its error against the reference is no larger than stock TVM's own error plus
      :data:`STOCK_ERROR_MARGIN` of it and ``atol`` (fp16 accumulation, QDQ graphs).
    """
    ours, reference = list(ours), list(reference)
    stock = list(stock) if stock is not None else [None] * len(ours)
    if not len(ours) == len(stock) == len(reference):
        raise AssertionError(f"tvm_fusion has {len(ours)} outputs, stock TVM {len(stock)}, "
                             f"the reference {len(reference)}")
    notes = []
    for i, (out, base, ref) in enumerate(zip(ours, stock, reference, strict=True)):
        note = _check_output(i, np.asarray(out), None if base is None else np.asarray(base),
                             np.asarray(ref), dtype)
        if note:
            notes.append(note)
    return notes


def _check_output(i: int, out, base, ref, dtype) -> str | None:
    exact = ref.dtype.kind in "iub" or out.dtype.kind in "iub"
    rtol, atol = (0.0, 0.0) if exact else tolerance_for(dtype or ref.dtype)
    try:
        compare([out], [ref], rtol=rtol, atol=atol)
        return None
    except AssertionError as err:
        vs_onnx = str(err).replace("output 0", f"output {i}", 1)
    if base is None:
        raise AssertionError(f"{vs_onnx} (ONNX Runtime's reference; stock TVM does not "
                             f"build the model)")
    err_ours, err_stock = max_abs_error([out], [ref]), max_abs_error([base], [ref])
    try:
        compare([out], [base], rtol=rtol, atol=atol)
        return (f"output {i} differs from ONNX Runtime (max abs err {err_ours:.3g}) as stock "
                f"TVM's does; tvm_fusion agrees with stock TVM (max abs err "
                f"{max_abs_error([out], [base]):.3g})")
    except AssertionError:
        pass
    if not exact and err_ours <= err_stock * (1 + STOCK_ERROR_MARGIN) + atol:
        return (f"output {i} differs from ONNX Runtime by {err_ours:.3g}, stock TVM by "
                f"{err_stock:.3g}: tvm_fusion's error is no larger than stock TVM's own "
                f"(within {STOCK_ERROR_MARGIN:g} of it)")
    raise AssertionError(f"{vs_onnx} (ONNX Runtime's reference; stock TVM's own error is "
                         f"{err_stock:.3g}, tvm_fusion differs from it by at most "
                         f"{max_abs_error([out], [base]):.3g})")

"""torch.export's attention: its safe softmax folded into one softmax, its batch·heads bmm
unflattened, and the attention then fused (relay_passes/safe_softmax.py, batch_views.py)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from conftest import TARGET
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion.compile import compile_model, fuse, import_onnx, run
from tvm_fusion.models.attention import attention_model
from tvm_fusion.numerics import onnx_reference
from tvm_fusion.relay_passes.batch_views import UnflattenBatchMatmul
from tvm_fusion.relay_passes.safe_softmax import FoldSafeSoftmax
from tvm_fusion.tir_schedules.attention import ATTENTION_ATTR


def _safe_softmax_module(zero):
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 4, 17, 17), "float32")):
            with R.dataflow():
                sm = R.nn.softmax(x, axis=-1)
                eq = R.equal(x, R.const(-np.inf, "float32"))
                ne = R.logical_not(eq)
                i8 = R.astype(ne, "int8")
                mx = R.max(i8, axis=[-1], keepdims=True)
                b = R.astype(mx, "bool")
                empty = R.logical_not(b)
                z = zero(sm)
                out = R.where(empty, z, sm)
                R.output(out)
            return out

    return Before


@pytest.mark.parametrize("zero", [
    lambda sm: R.full_like(sm, R.const(0.0, "float32")),
    lambda sm: R.const(0.0, "float32"),
], ids=["full_like", "scalar"])
def test_the_nine_operators_become_one_guarded_softmax(zero):
    after = FoldSafeSoftmax()(_safe_softmax_module(zero))
    calls = [b.value for b in after["main"].body.blocks[0].bindings]
    assert len(calls) == 1 and calls[0].op.same_as(tvm.ir.Op.get("relax.call_tir"))
    assert calls[0].args[0].name_hint == "safe_softmax"


def test_a_softmax_without_the_guard_is_left_alone():
    @I.ir_module
    class Plain:
        @R.function
        def main(x: R.Tensor((2, 8), "float32"), c: R.Tensor((2, 1), "bool")):
            with R.dataflow():
                sm = R.nn.softmax(x, axis=-1)
                out = R.where(c, R.const(0.0, "float32"), sm)  # a guard, but not of x's rows
                R.output(out)
            return out

    tvm.ir.assert_structural_equal(FoldSafeSoftmax()(Plain), Plain)


def test_rows_of_only_minus_inf_give_zero_and_nan_stays_nan():
    mod = FoldSafeSoftmax()(_safe_softmax_module(lambda sm: R.full_like(sm, R.const(0.0))))
    ex = tvm.compile(mod, TARGET)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    x = np.random.default_rng(0).standard_normal((2, 4, 17, 17)).astype("float32")
    x[0, 1, 3, :] = -np.inf  # an empty row: 0
    x[0, 1, 4, :5] = -np.inf
    x[1, 2, 5, :] = -np.inf
    x[1, 2, 5, 7] = np.nan  # NaN among -inf: softmax's NaN
    x[1, 3, 6, 2] = np.inf  # +inf: NaN
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    with np.errstate(invalid="ignore"):
        e = np.exp(x - np.where(np.isnan(x), -np.inf, x).max(axis=-1, keepdims=True))
        want = e / e.sum(-1, keepdims=True)
    want[0, 1, 3, :] = 0.0
    want[1, 2, 5, :] = np.nan
    want[1, 3, 6, :] = np.nan
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=1e-6, atol=1e-7)


def test_bmm_over_flattened_heads_is_a_batched_matmul_of_the_axes():
    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor(("n", 4, 17, 16), "float32"), k: R.Tensor(("n", 4, 16, 17),
                                                                       "float32")):
            n = T.int64()
            with R.dataflow():
                qb = R.broadcast_to(q, R.shape([n, 4, 17, 16]))
                qf = R.reshape(qb, R.shape([n * 4, 17, 16]))
                kf = R.reshape(k, R.shape([n * 4, 16, 17]))
                s = R.matmul(qf, kf, out_dtype="float32")
                out = R.reshape(s, R.shape([n, 4, 17, 17]))
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @R.function
        def main(q: R.Tensor(("n", 4, 17, 16), "float32"), k: R.Tensor(("n", 4, 16, 17),
                                                                       "float32")):
            with R.dataflow():
                out = R.matmul(q, k, out_dtype="float32")
                R.output(out)
            return out

    after = relax.transform.CanonicalizeBindings()(UnflattenBatchMatmul()(Before))
    tvm.ir.assert_structural_equal(after, Expected)


def test_different_batch_axes_are_not_unflattened():
    @I.ir_module
    class Mixed:
        @R.function
        def main(q: R.Tensor((2, 6, 17, 16), "float32"), k: R.Tensor((3, 4, 16, 17), "float32")):
            with R.dataflow():
                qf = R.reshape(q, R.shape([12, 17, 16]))
                kf = R.reshape(k, R.shape([12, 16, 17]))
                out = R.matmul(qf, kf, out_dtype="float32")
                R.output(out)
            return out

    tvm.ir.assert_structural_equal(UnflattenBatchMatmul()(Mixed), Mixed)


def _masked_inputs():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 40, 64)).astype("float32") for _ in range(3))
    mask = np.zeros((1, 1, 40, 40), "float32")
    mask[0, 0, 3, :] = -np.inf  # an empty row: zeros (softmax alone: NaN)
    mask[0, 0, 5, 10:] = -np.inf
    mask[0, 0, 6, :] = np.finfo(np.float32).min
    return [q, k, v, mask]


def test_safe_softmax_attention_is_fused_and_matches_onnx_runtime_and_stock():
    """The ONNX form of torch's decomposition, with rows masked entirely by -inf: one fused
    attention, whose empty rows are 0 as ONNX Runtime's and stock TVM's."""
    model = attention_model("bert", seq=40, mask_rows=True, safe_softmax=True)
    mod = import_onnx(model)
    fused = fuse(mod, TARGET)
    funcs = [f for f in fused.functions.values()
             if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and ATTENTION_ATTR in f.attrs]
    assert len(funcs) == 1
    ours_ex, stock_ex = compile_model(mod, TARGET), compile_model(mod, TARGET, strategy="tvm")
    inputs = _masked_inputs()
    ours, stock = run(ours_ex, inputs)[0], run(stock_ex, inputs)[0]
    ref = onnx_reference(model, dict(zip(["q", "k", "v", "mask"], inputs)))[0]
    assert (ours[0, 3] == 0).all() and np.isfinite(ours).all()
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours, stock, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("safe", [False, True], ids=["softmax", "safe_softmax"])
def test_gpu_template_on_rows_masked_entirely_on_pocl(safe):
    """Row 3 masked by -inf (NaN, or 0 from a safe softmax), row 6 by the lowest float
    (uniform weights: the kernel's running max starts at exactly that value, which TVM's
    OpenCL code generator printed as ``-3.402823e+38f``, above it)."""
    from tvm_fusion import pipeline
    from tvm_fusion.layout import opencl_runner
    from tvm_fusion.transform import Sequential

    ok, why = opencl_runner.available()
    if not ok:
        pytest.skip(why)
    target = tvm.target.Target({"kind": "opencl"}, host="llvm")
    model = attention_model("bert", seq=40, mask_rows=True, safe_softmax=safe)
    with target:
        mod = pipeline.build(target, Sequential(target), lower=False)(import_onnx(model))
    assert [f for f in mod.functions.values()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and ATTENTION_ATTR in f.attrs]
    inputs = _masked_inputs()
    ours = opencl_runner.OpenCLRunner().run_module(mod, inputs, target)[0]
    ref = onnx_reference(model, dict(zip(["q", "k", "v", "mask"], inputs)))[0]
    assert (ours[0, 3] == 0).all() if safe else np.isnan(ours[0, 3]).all()
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)  # NaN where ORT has NaN

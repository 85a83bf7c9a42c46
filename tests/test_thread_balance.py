"""Thread balance of the CPU schedules: every kernel with work worth a parallel launch has a
parallel loop, and that loop's iterations split evenly over 2 and 4 threads (TVM gives each
thread a contiguous ceil(E/T) of them: 3 N blocks on 2 threads is one thread doing two)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper

from tvm_fusion.compile import compile_model, import_onnx, run
from tvm_fusion.models.cnn import inverted_residual_net
from tvm_fusion.target import host_target
from tvm_fusion.tir_schedules.gemm_template import _tail_in_parallel, thread_shares
from tvm_fusion.tir_schedules.loops import PARALLEL_MIN_WORK
from tvm_fusion.tir_schedules.thread_balance import kernel_balance, parallel_loops
from tvm_fusion.transform import get_pipeline


def _scheduled(model, cores: int, mcpu: str | None = None, **options) -> tvm.IRModule:
    target = _target(cores, mcpu)
    with target:
        return get_pipeline(target, **options)(import_onnx(model))


def _target(cores: int, mcpu: str | None = None) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "num-cores": cores, **({"mcpu": mcpu} if mcpu
                                                                     else {})})


@pytest.mark.parametrize("cores", [2, 4])
@pytest.mark.parametrize("options", [{}, {"strategy": "tvm", "schedule": True}],
                         ids=["tvm_fusion", "fuseops-sched"])
def test_every_kernel_of_a_small_mobilenet_balances(cores, options):
    """MobileNetV2 in miniature at 112×112: each kernel doing at least 4 parallel launches'
    worth of work runs >= 90 % of it in parallel loops whose largest thread share is within
    10 % of the ideal; the global average pool (a divide per channel with the sum over every
    pixel attached per row) is one of them: it ran on one thread."""
    balance = kernel_balance(_scheduled(inverted_residual_net(size=112), cores, **options),
                             cores)
    heavy = {name: fact for name, fact in balance.items()
             if fact["ops"] >= 4 * PARALLEL_MIN_WORK}
    assert any(name.startswith("mean") for name in heavy)
    for name, fact in heavy.items():
        assert fact["loops"], f"{name}: no parallel loop ({fact})"
        assert fact["share"] >= 0.9, f"{name}: {fact}"
        assert fact["imbalance"] <= 1.1, f"{name}: {fact}"


def test_thread_shares_are_contiguous_chunks():
    assert thread_shares([1.0, 1.0, 1.0], 2) == [2.0, 1.0]
    assert thread_shares([1.0, 1.0, 1.0, 0.75], 2) == [2.0, 1.75]
    assert thread_shares([1.0] * 7, 4) == [2.0, 2.0, 2.0, 1.0]


def test_tail_panel_joins_the_parallel_loop_only_when_it_balances():
    # a GEMV over 3 panels + a 3/4 tail on 2 threads: 2 | 1 + tail beats 2 | 1, then tail
    assert _tail_in_parallel(3, 1, 3, 0.75, 2)
    # 31 panels in 2 blocks of 16 + 15: a third iteration would give one thread both blocks
    assert not _tail_in_parallel(31, 16, 2, 0.25, 2)
    assert not _tail_in_parallel(3, 1, 3, 0.75, 1)


def _gemv_model(k: int, n: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [k, n], rng.standard_normal((k, n)).ravel()
                           .astype(np.float32))
    b = helper.make_tensor("b", TensorProto.FLOAT, [n], rng.standard_normal(n).astype(
        np.float32))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y0"]), helper.make_node("Add", ["y0", "b"],
                                                                          ["y"])],
        "gemv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_gemv_tail_panel_runs_in_the_parallel_loop_and_is_exact():
    """N = 120 on 2 threads of AVX-512 (built, not run, for Zen 4): 3 full panels of 32 and a
    24-column tail, one parallel loop of 4 iterations (the tail the fourth), no serial tail
    after it; results (this machine's CPU) as NumPy's."""
    model = _gemv_model(480, 120)
    mod = _scheduled(model, 2, "znver4")
    gemms = [f for gv, f in mod.functions.items()
             if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint]
    assert gemms
    extents = [extent for extent, _, _, _ in parallel_loops(gemms[0])]
    assert 4 in extents, extents
    balance = kernel_balance(mod, 2)
    fact = next(f for name, f in balance.items() if "matmul" in name)
    assert fact["imbalance"] <= 1.1 and fact["share"] >= 0.9, fact
    x = np.random.default_rng(1).standard_normal((1, 480)).astype(np.float32)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    target = tvm.target.Target({**{k: v for k, v in host_target().export().items()
                                   if k in ("kind", "mcpu", "mattr")}, "num-cores": 2})
    (out,) = run(compile_model(import_onnx(model), target), [x])
    np.testing.assert_allclose(out, x @ weights["w"] + weights["b"], rtol=1e-4, atol=1e-4)

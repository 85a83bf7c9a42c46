"""Thread balance of the CPU schedules: every kernel with work worth a parallel launch has a
parallel loop, and that loop's iterations split evenly over 2 and 4 threads (TVM gives each
thread a contiguous ceil(E/T) of them: 3 N blocks on 2 threads is one thread doing two)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper

from tvm_fusion.compile import compile_model, import_onnx, run
from tvm_fusion.models.cnn import inverted_residual_net
from tvm_fusion.numerics import onnx_reference
from tvm_fusion.target import host_target
from tvm_fusion.tir_schedules.gemm_template import (
    GRID,
    N_BLOCKS,
    Blocking,
    _tail_in_parallel,
    grid_shares,
    rows_cost,
    thread_plan,
    thread_shares,
)
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


# Zen 4's AVX-512 blocking of a conv GEMM with the positions as rows: 12×32 tiles, KC 160,
# NC 800, two values loaded per FMA beside it (CpuParams.loads_per_fma)
ZEN4_BLOCKING = Blocking(mr=12, nr=32, lanes=16, kc=160, nc=800, loads_per_fma=2.0)


def test_small_map_gemm_splits_panels_and_rows_over_2_and_3_threads():
    """A 1×1 conv 960→160 over a 7×7 map (MobileNetV2's): 49 positions as rows (4 tiles of
    12 and a 1-row tail) × 5 panels of 32 channels. As N blocks alone, 2 threads ran 3 | 2
    panels (1.2 times the ideal). The grid of 5 panels × 2 row ranges of 24 | 25 rows gives
    each thread 2.5 panels' rows: per panel 2 tiles (48 k-step units) and 2 tiles + a 1-row
    tile (50), shares 244 | 246 (1.004). On 3 threads: 4 ranges of 12 rows (24, 24, 24, 26
    a panel), 20 pairs in 7 | 7 | 6, shares 170 | 172 | 148 (1.053; N blocks alone 2 | 2 | 1
    panels, 1.2)."""
    blk = ZEN4_BLOCKING
    assert rows_cost(24, blk) == 48 and rows_cost(25, blk) == 50
    two = thread_plan(160, blk, 2, 49)
    assert (two.mode, two.per_block, two.ranges, two.chunk) == (GRID, 1, 2, 24)
    assert grid_shares(160, 49, blk, 2, 1, 2, 24) == [244, 246]
    assert grid_shares(160, 49, blk, 2, 3, 1, 49) == [294, 196]  # N blocks alone: 3 | 2
    three = thread_plan(160, blk, 3, 49)
    assert (three.mode, three.per_block, three.ranges, three.chunk) == (GRID, 1, 4, 12)
    assert grid_shares(160, 49, blk, 3, 1, 4, 12) == [170, 172, 148]
    # balanced N blocks keep their plan: 10 panels on 2 threads, 5 | 5
    assert thread_plan(320, blk, 2, 49).mode == N_BLOCKS
    assert thread_plan(160, blk, 1, 49).mode == "one thread"


def _conv1x1(c_in: int, c_out: int, size: int, residual: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((c_out, c_in, 1, 1)) / np.sqrt(c_in)).astype(np.float32)
    b = rng.standard_normal(c_out).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c_in, size, size])]
    if residual:
        nodes.append(helper.make_node("Add", ["c", "r"], ["y"]))
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT,
                                                    [1, c_out, size, size]))
    else:
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
    inits = [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(b, "b"),
             onnx.numpy_helper.from_array(np.float32(0), "lo"),
             onnx.numpy_helper.from_array(np.float32(6), "hi")]
    graph = helper.make_graph(nodes, "conv", inputs, [helper.make_tensor_value_info(
        "y", TensorProto.FLOAT, [1, c_out, size, size])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("c_in, c_out, residual, plans", [
    # MobileNetV2's projection with its residual add: 5 panels of 32 (12×32 tiles)
    (960, 160, True, ((2, "2 ranges of 24 rows", 1.01), (3, "4 ranges of 12 rows", 1.06))),
    # 10 panels of 16 and an 8-channel tail panel (16×16 tiles), ReLU6: on 2 threads 5 | 5
    # panels, each thread then its rows of the tail panel (32 | 17)
    (576, 168, False, ((2, "parallel N blocks;", 1.03), (3, "3 ranges of 16 rows", 1.01))),
])
def test_small_map_conv_grid_balances_and_matches_onnxruntime(c_in, c_out, residual, plans,
                                                                tmp_path):
    """Built for Zen 4 on 2 and 3 threads, a 1×1 conv over a 7×7 map takes the grid (the
    schedule note names its ranges), its kernel's largest thread share within the bound of
    the ideal; run on this CPU with 2 threads its results are ONNX Runtime's."""
    model = _conv1x1(c_in, c_out, 7, residual)
    for cores, ranges, bound in plans:
        mod = _scheduled(model, cores, "znver4")
        notes = "\n".join(str(n) for f in mod.functions.values()
                          if isinstance(f, tvm.tirx.PrimFunc)
                          for n in f.attrs.get("tvm_fusion.schedule", []))
        assert (ranges if ranges.startswith("parallel") else
                f"parallel N blocks × row ranges ({ranges})") in notes, notes
        fact = next(f for name, f in kernel_balance(mod, cores).items() if "conv" in name)
        assert fact["share"] >= 0.99 and fact["imbalance"] <= bound, fact
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((1, c_in, 7, 7)).astype(np.float32)}
    if residual:
        feeds["r"] = rng.standard_normal((1, c_out, 7, 7)).astype(np.float32)
    # the runtime's pool is sized when it starts: 2 threads in a process of their own
    onnx.save(model, tmp_path / "conv.onnx")
    np.savez(tmp_path / "feeds.npz", **feeds)
    env = {**os.environ, "TVM_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", _RUN_ON_2_THREADS, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = np.load(tmp_path / "out.npy")
    np.testing.assert_allclose(out, onnx_reference(model, feeds)[0], rtol=1e-4, atol=1e-4)


_RUN_ON_2_THREADS = """
import sys
from pathlib import Path
import numpy as np, onnx, tvm
from tvm_fusion.compile import compile_model, import_onnx, run
from tvm_fusion.target import host_target
here = Path(sys.argv[1])
model = onnx.load(here / "conv.onnx")
feeds = np.load(here / "feeds.npz")
target = tvm.target.Target({**{k: v for k, v in host_target().export().items()
                               if k in ("kind", "mcpu", "mattr")}, "num-cores": 2})
exe = compile_model(import_onnx(model), target)
assert tvm.get_global_func("runtime.NumThreads")() == 2
(out,) = run(exe, [feeds[n] for n in ("x", "r") if n in feeds])
np.save(here / "out.npy", out)
"""


def test_tail_panel_rows_are_shared_after_the_n_blocks():
    """A 1×1 conv 384→64 at 14×14 (MobileNetV2's): 64 output channels as rows (4 tiles of
    16), 196 positions as 12 panels of 16 and a 4-column tail. As N blocks on 2 threads it
    ran 6 | 6 panels, then the tail panel on one thread (8 % of the work outside the
    parallel loop); now each thread runs its 6 panels and then 32 rows of the tail panel:
    the whole kernel in one parallel loop of 2, evenly. Results as ONNX Runtime's."""
    model = _conv1x1(384, 64, 14)
    mod = _scheduled(model, 2, "znver4")
    conv = next(f for gv, f in mod.functions.items() if "conv" in gv.name_hint)
    assert [extent for extent, _, _, _ in parallel_loops(conv)] == [2]
    fact = next(f for name, f in kernel_balance(mod, 2).items() if "conv" in name)
    assert fact["share"] >= 0.99 and fact["imbalance"] <= 1.01, fact
    x = np.random.default_rng(2).standard_normal((1, 384, 14, 14)).astype(np.float32)
    target = tvm.target.Target({**{k: v for k, v in host_target().export().items()
                                   if k in ("kind", "mcpu", "mattr")}, "num-cores": 2})
    (out,) = run(compile_model(import_onnx(model), target), [x])
    np.testing.assert_allclose(out, onnx_reference(model, {"x": x})[0], rtol=1e-4, atol=1e-4)

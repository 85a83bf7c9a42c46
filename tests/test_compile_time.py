"""Compile time linear in a block's size (issue 17, item 4).

k chained Tanh took 0.12 s (k = 4), 1.5 s (5), 33 s (6): TVM's simplifier substitutes every
bound value into its uses, and each fast approximation reads its argument several times, so
one expression with k of them grew ~20^k. The inliner now keeps at most
``fast_math.MAX_NESTED`` of them, and at most ``inline.MAX_INLINED_COST`` operations, in one
expression, and sweeps the blocks once per round instead of restarting after every inline.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tvm_fusion.compile import compile_model, fuse, import_onnx, run
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.tir_schedules.fused_block import KEPT_ATTR


def _chain(ops: list[str]):
    nodes, prev = [], "x"
    for i, op in enumerate(ops):
        out = "y" if i == len(ops) - 1 else f"t{i}"
        inputs = [prev, "x"] if op in ("Add", "Mul", "Sub") else [prev]
        nodes.append(helper.make_node(op, inputs, [out]))
        prev = out
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _check(model):
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    got = run(compile_model(import_onnx(model), "llvm"), [x])
    compare(got, onnx_reference(model, {"x": x}), rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(60)
def test_chained_tanh_kept_to_two_per_expression():
    model = _chain(["Tanh"] * 8)
    _check(model)
    fused = fuse(import_onnx(model), "llvm")
    (func,) = [f for f in fused.functions.values() if KEPT_ATTR in (f.attrs or {})]
    reasons = list(func.attrs[KEPT_ATTR].values())
    assert len(reasons) == 3 and all("nested" in r for r in reasons)  # 8 tanh: 4 stages


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_thousand_mixed_operators_compile():
    ops = ["Tanh", "Mul", "Sigmoid", "Add", "Erf", "Exp", "Sub"]
    _check(_chain([ops[i % len(ops)] for i in range(1000)]))

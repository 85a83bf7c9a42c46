"""The fast (vectorisable) exp/tanh/erf/sigmoid keep IEEE special values (issue 17, item 3).

Clamped before any NaN check, NaN came out as a bound (Exp(NaN) = inf, Tanh(NaN) = 1, a
Softmax row with a NaN all zeros), and ``exp`` saturated at 88.38 where float32 still holds
exp(88.72). The values below cover NaN, ±inf, ±0, denormals, the overflow and underflow edges
and the approximations' clamp bounds; ONNX Runtime computes the exact functions.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tvm_fusion.compile import compile_model, import_onnx, run
from tvm_fusion.numerics import compare, onnx_reference

EDGES = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-40, 88.5,
                  88.7, 88.73, 89.5, -87.0, -88.5, -95.0, -103.0, -104.5, -200.0, 3.9, 4.5,
                  9.5, -9.5, 20.0, -20.0, 0.3, 1.0, -1.0], dtype=np.float32)


@pytest.mark.parametrize("fast_math", [True, False])
@pytest.mark.parametrize("op", ["Exp", "Tanh", "Sigmoid", "Erf", "Softmax", "Gelu"])
def test_special_values_as_the_exact_functions(op, fast_math):
    n = EDGES.size
    attrs = {"axis": -1} if op == "Softmax" else {}
    graph = helper.make_graph(
        [helper.make_node(op, ["x"], ["y"], **attrs)], "edges",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    # row 0: the edges (a NaN in a Softmax row makes the row NaN); row 1: finite, small
    x = np.stack([EDGES, np.nan_to_num(EDGES, nan=0.0, posinf=1.0, neginf=-1.0) * 0.01])
    got = run(compile_model(import_onnx(model), "llvm", fast_math=fast_math), [x])
    compare(got, onnx_reference(model, {"x": x}), rtol=1e-5, atol=1e-6)


def test_silu_at_the_edges():
    """x · sigmoid(x), the fast sigmoid's own clamp (±88, one 2^n scale): far below -88 the
    product stays 0 (a clamped sigmoid's 6e-39 times -1e30 would not), NaN propagates."""
    edges = np.concatenate([EDGES, np.array([-1e30, -3e38, 1e30, -88.0, 88.0, -87.9],
                                            dtype=np.float32)])
    graph = helper.make_graph(
        [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])],
        "silu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, edges.size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, edges.size])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    x = edges[None]
    got = run(compile_model(import_onnx(model), "llvm"), [x])
    compare(got, onnx_reference(model, {"x": x}), rtol=1e-5, atol=1e-6)

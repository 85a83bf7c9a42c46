"""A scan (CumSum) followed by elementwise operators (issue 17, item 2).

TVM legalises CumSum to an opaque loop over a buffer with a free ``elem_offset``; SmartMem's
epilogue grouping took it for an anchor, and ``FuseTIR`` stopped on the merged group
("Inconsistent buffers … mapped to the same relax var"). A scan is no anchor: it stays a
kernel of its own, as under stock FuseOps.
"""

from __future__ import annotations

import pytest
from conftest import check_model
from onnx import TensorProto, helper

N = helper.make_node


def _model(nodes, elem, inits):
    graph = helper.make_graph(
        nodes, "scan", [helper.make_tensor_value_info("x", elem, [3, 8])],
        [helper.make_tensor_value_info("y", elem, [3, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


_AXIS = helper.make_tensor("axis", TensorProto.INT64, [], [1])


@pytest.mark.parametrize("op", ["Relu", "Sigmoid", "Neg", "Sin"])
def test_cumsum_then_unary(op):
    check_model(_model([N("CumSum", ["x", "axis"], ["c"]), N(op, ["c"], ["y"])],
                       TensorProto.FLOAT, [_AXIS]))


def test_cumsum_then_add_and_cast():
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    check_model(_model([N("CumSum", ["x", "axis"], ["c"]), N("Add", ["c", "one"], ["a"]),
                        N("Cast", ["a"], ["y"], to=TensorProto.FLOAT)],
                       TensorProto.FLOAT, [_AXIS, one]))


def test_position_ids_from_an_attention_mask():
    """Every Hugging Face decoder export: ``cumsum(mask) * mask - 1`` in int64."""
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    check_model(_model([N("CumSum", ["x", "axis"], ["c"]), N("Mul", ["c", "x"], ["p"]),
                        N("Sub", ["p", "one"], ["y"])], TensorProto.INT64, [_AXIS, one]))

"""A selection (Gather of a scalar index, a Slice to size-1 axes) after a fused operator.

Issue 17, item 1: composed into the producer's store (SmartMem's *eliminate 2nd*) or inlined
into an accumulator's write-back, the selection lost its index and every produced element was
stored to the selected place (the last write won). Each model here was wrong on main before
the fix; stock TVM and ONNX Runtime agree on all of them.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import check_model
from onnx import TensorProto, helper
from tvm import tirx

from tvm_fusion.layout.index_maps import LoadMap


def _ints(name, values, shape=None):
    return helper.make_tensor(name, TensorProto.INT64, [] if shape is None else shape, values)


def _floats(name, shape, seed=0):
    values = np.random.default_rng(seed).standard_normal(int(np.prod(shape)))
    return helper.make_tensor(name, TensorProto.FLOAT, shape, values.astype(np.float32))


def _model(nodes, inputs, out_shape, inits=()):
    graph = helper.make_graph(
        nodes, "selection",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _slice(src, starts, ends, axes):
    n = len(axes)
    return (helper.make_node("Slice", [src, "s", "e", "ax"], ["y"]),
            [_ints("s", starts, [n]), _ints("e", ends, [n]), _ints("ax", axes, [n])])


N = helper.make_node
_SLICE_CLS = _slice("a", [0], [1], [1])
_SLICE_SOFTMAX = _slice("a", [1, 2], [2, 3], [0, 1])
_SLICE_CONV = _slice("a", [2, 5], [3, 6], [1, 2])

CASES = {
    "relu_gather_row": _model(
        [N("Relu", ["x"], ["a"]), N("Gather", ["a", "i"], ["y"], axis=0)],
        [("x", [4, 8])], [8], [_ints("i", [2])]),
    "cls_pooling_gather": _model(
        [N("Add", ["x", "r"], ["a"]), N("Gather", ["a", "i"], ["y"], axis=1)],
        [("x", [2, 5, 64]), ("r", [2, 5, 64])], [2, 64], [_ints("i", [0])]),
    "cls_pooling_slice": _model(
        [N("Add", ["x", "r"], ["a"]), _SLICE_CLS[0]],
        [("x", [2, 5, 64]), ("r", [2, 5, 64])], [2, 1, 64], _SLICE_CLS[1]),
    "layernorm_gather": _model(
        [N("LayerNormalization", ["x", "g", "b"], ["a"], axis=-1),
         N("Gather", ["a", "i"], ["y"], axis=1)],
        [("x", [2, 5, 16])], [2, 16], [_ints("i", [3]), _floats("g", [16]), _floats("b", [16], 1)]),
    "min_gather": _model(
        [N("Min", ["x", "r"], ["a"]), N("Gather", ["a", "i"], ["y"], axis=0)],
        [("x", [4, 8]), ("r", [4, 8])], [8], [_ints("i", [1])]),
    "softmax_slice_one_element": _model(
        [N("Softmax", ["x"], ["a"], axis=-1), _SLICE_SOFTMAX[0]],
        [("x", [3, 8])], [1, 1], _SLICE_SOFTMAX[1]),
    "conv1d_slice_size1_axes": _model(
        [N("Conv", ["x", "w"], ["a"], pads=[1, 1]), _SLICE_CONV[0]],
        [("x", [1, 4, 10])], [1, 1, 1], [_floats("w", [6, 4, 3]), *_SLICE_CONV[1]]),
    "reducemax_gather_scalar": _model(
        [N("ReduceMax", ["x", "ax"], ["a"], keepdims=0), N("Gather", ["a", "i"], ["y"], axis=0)],
        [("x", [4, 16])], [], [_ints("ax", [1], [1]), _ints("i", [3])]),
    "reducesum_gather": _model(
        [N("ReduceSum", ["x", "ax"], ["a"], keepdims=0), N("Gather", ["a", "i"], ["y"], axis=1)],
        [("x", [4, 8, 16])], [4], [_ints("ax", [2], [1]), _ints("i", [2])]),
}


@pytest.mark.parametrize("options", [{}, {"layout": False}, {"schedule": False}],
                         ids=["default", "no-layout", "no-schedule"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_selection_as_graph_output(name, options):
    check_model(CASES[name], **options)


def _map(indices, out_shape, in_shape):
    vars_ = tuple(tirx.Var(f"v{i}", "int64") for i in range(len(out_shape)))
    return LoadMap(0, vars_, tuple(ix(*vars_) for ix in indices), tuple(out_shape),
                   tuple(in_shape), "float32")


def test_only_a_bijective_map_can_be_written_by_the_producer():
    """SmartMem's *eliminate 2nd* needs every source element copied exactly once."""
    two = tirx.const(2, "int64")
    assert _map([lambda i, j: j, lambda i, j: i], [8, 4], [4, 8]).is_bijection()  # transpose
    assert _map([lambda i: i // 8, lambda i: i % 8], [32], [4, 8]).is_bijection()  # reshape
    assert not _map([lambda j: two, lambda j: j], [8], [4, 8]).is_bijection()  # gather
    assert not _map([lambda i, j: j], [4, 8], [8]).is_bijection()  # broadcast
    assert not _map([lambda i: i * 2], [4], [8]).is_bijection()  # strided slice

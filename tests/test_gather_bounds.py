"""Gather indices (issue 25, item 4): negative indices are right, constant ones outside the data
are one line naming the Gather, and indices from the inputs can never read outside memory in
our fused kernels (``take`` gets ``mode="clip"``: TVM's ``fast`` mode has no bounds check)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tvm_fusion.compile import ModelError, compile_model, fuse, import_onnx, run
from tvm_fusion.models.graph import make_model, tensor, value_info
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.tir_utils import find_all


def _gather_model(indices=None) -> onnx.ModelProto:
    """table[8, 16] gathered by ``ids`` (an input) or by constant ``indices``, then * 2 + 1
    (so the take is fused with elementwise work), and a second Gather on axis 1."""
    table = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 7
    inits = [tensor("table", table), tensor("two", np.float32(2)), tensor("one", np.float32(1))]
    inputs = []
    if indices is None:
        inputs.append(value_info("ids", [5], TensorProto.INT64))
    else:
        inits.append(tensor("ids", np.asarray(indices, np.int64)))
    inits.append(tensor("cols", np.array([-1, 0, -16, 15], np.int64)))
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], name="embed", axis=0),
             helper.make_node("Mul", ["rows", "two"], ["m"], name="mul"),
             helper.make_node("Add", ["m", "one"], ["a"], name="add"),
             helper.make_node("Gather", ["a", "cols"], ["y"], name="pick", axis=1)]
    return make_model("gather", nodes, inputs, ["y"], inits)


def test_negative_indices_match_onnx_runtime():
    ids = np.array([-1, 0, 3, -8, 7], np.int64)
    runtime = _gather_model()
    constant = _gather_model(ids)
    want = onnx_reference(runtime, {"ids": ids})
    compare(run(compile_model(import_onnx(runtime), "llvm"), [ids]), want)
    compare(run(compile_model(import_onnx(constant), "llvm"), []), want)


def test_constant_index_out_of_range_is_one_line_naming_the_gather():
    with pytest.raises(ModelError, match=r"^Gather 'embed': index 8 is out of range for axis 0 "
                                         r"of 'table' \(size 8; ONNX allows -8\.\.7\)$"):
        import_onnx(_gather_model([0, 8, 1, 2, 3]))
    with pytest.raises(ModelError, match="index -9 is out of range"):
        import_onnx(_gather_model([0, -9, 1, 2, 3]))


def test_runtime_indices_are_clamped_inside_the_fused_kernel():
    """An id the data does not have (ONNX Runtime rejects it) reads the nearest row, inside the
    table, instead of memory past it; the kernel that gathers clamps its index."""
    import tvm

    model = _gather_model()
    fused = fuse(import_onnx(model), "llvm")
    takes = [f for f in fused.functions.values() if isinstance(f, tvm.tirx.PrimFunc)
             and any(isinstance(c, tvm.tirx.Max) for c in find_all(f.body, tvm.tirx.Max))]
    assert takes, "no kernel clamps its Gather index"
    ids = np.array([0, 1000, -1000, 7, 2], np.int64)
    got = run(compile_model(import_onnx(model), "llvm"), [ids])[0]
    want = onnx_reference(model, {"ids": np.clip(np.where(ids < 0, ids + 8, ids), 0, 7)})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)

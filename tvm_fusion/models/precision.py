"""The same model in a lower float precision: every float32 tensor of a graph built in code
becomes float16 or bfloat16 (initializers, graph inputs and outputs, typed values, ``Cast``
targets and tensor attributes), as exporting a model with ``.half()`` would give it.

bfloat16 is only legal ONNX where each operator's schema allows it (``MatMul``, ``Softmax``,
``LayerNormalization`` from opset 13-17; ``Conv`` and the pools only from opset 22): the
checker names the first operator that does not.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["LOW_PRECISION", "cast_model", "round_to"]

#: The float types a model can be cast to, by name.
LOW_PRECISION = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def _np_dtype(elem: int):
    if elem == TensorProto.BFLOAT16:
        import ml_dtypes  # numpy has no bfloat16; onnx and TVM both use ml_dtypes'

        return ml_dtypes.bfloat16
    return helper.tensor_dtype_to_np_dtype(elem)


def round_to(value: np.ndarray, dtype: str) -> np.ndarray:
    """``value`` rounded to ``dtype`` and back to float32: what a low-precision model computes
    with, so that a float32 reference can start from the same numbers."""
    return np.asarray(value).astype(_np_dtype(LOW_PRECISION[dtype])).astype(np.float32)


def _tensor(t: onnx.TensorProto, elem: int) -> onnx.TensorProto:
    arr = numpy_helper.to_array(t).astype(_np_dtype(elem))
    if elem == TensorProto.BFLOAT16:  # numpy_helper.from_array cannot write ml_dtypes' type
        bits = arr.view(np.uint16).astype(np.uint32) << 16
        out = helper.make_tensor(t.name, elem, arr.shape, bits.view(np.float32).ravel().tolist())
        return out
    return numpy_helper.from_array(arr, t.name)


def cast_model(model: onnx.ModelProto, dtype: str = "float16", opset: int | None = None,
               ) -> onnx.ModelProto:
    """A copy of ``model`` with every float32 tensor in ``dtype`` (``"float16"`` or
    ``"bfloat16"``); ``opset`` raises the default-domain opset (bfloat16 ``Conv`` needs 22)."""
    if dtype not in LOW_PRECISION:
        raise ValueError(f"unknown low precision {dtype!r}; expected one of "
                         f"{sorted(LOW_PRECISION)}")
    elem = LOW_PRECISION[dtype]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    for i, t in enumerate(graph.initializer):
        if t.data_type == TensorProto.FLOAT:
            graph.initializer[i].CopyFrom(_tensor(t, elem))
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = elem
    for node in graph.node:
        for attr in node.attribute:
            if attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = elem
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(_tensor(attr.t, elem))
    if opset is not None:
        for entry in out.opset_import:
            if entry.domain in ("", "ai.onnx"):
                entry.version = max(entry.version, opset)
    onnx.checker.check_model(out, full_check=True)
    return out

"""Stock TVM execution: the unfused baseline the fusion pipelines are compared against
(``tvm.compile(mod, "llvm")`` runs the "default" pipeline: no fusion on CPU)."""

from __future__ import annotations

import numpy as np
import onnx

from ..compile import compile_model, import_onnx, run
from ..feeds import graph_inputs

__all__ = ["TVM_UNSUPPORTED", "run_tvm_stock"]

#: Single-op models that TVM 0.27's ONNX frontend cannot import/compile, with the error it gives.
#: Every other op of :data:`SINGLE_OP_TYPES` imports, compiles and matches onnxruntime.
TVM_UNSUPPORTED: dict[str, str] = {
    # relax/frontend/onnx Upsample._impl_v9 reads ``scales`` from the attributes (Upsample-7
    # form), but Upsample-9 passes it as an input, so the import dies with
    # "TypeError: object of type 'NoneType' has no len()". The Upsample-7 form (opset 7/8,
    # scales attribute) does import, but resize2d is called with the default rounding ("round")
    # instead of floor, so nearest upsampling by 2 gives [0,0,1,2,2,2,3,3] for [0,1,2,3]: wrong.
    "Upsample": "import fails: TypeError: object of type 'NoneType' has no len() (Upsample-9 "
    "scales input unsupported; the Upsample-7 form imports but rounds instead of flooring)",
}


def run_tvm_stock(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Import with ``from_onnx`` (weights as constants), ``tvm.compile(mod, "llvm")``, run on CPU.

    This is the unfused TVM baseline the fusion pipelines are compared against.
    """
    executable = compile_model(import_onnx(model), "llvm", strategy="none")
    return run(executable, [feeds[vi.name] for vi in graph_inputs(model)])

"""The tvm_fusion pipeline on a CUDA target generates source that nvcc compiles to PTX.

Nothing runs without a GPU; this checks the fused kernels are valid CUDA.
"""

import shutil
import warnings

import pytest
import tvm

from tvm_fusion.compile import import_onnx
from tvm_fusion.models import get_builtin


def _cuda_module(module):
    if module.kind == "cuda":
        return module
    for imported in module.imports:
        found = _cuda_module(imported)
        if found is not None:
            return found
    return None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("name", ["encoder", "figure3"])
def test_fused_cuda_source_compiles_to_ptx(name):
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        executable = tvm.compile(import_onnx(get_builtin(name)), target,
                                 relax_pipeline="tvm_fusion")
    source = _cuda_module(executable.mod).inspect_source()
    assert "__global__" in source
    with target:
        ptx = tvm.support.nvcc.compile_cuda(source, target_format="ptx", compiler="nvcc")
    assert b".target sm_80" in bytes(ptx)

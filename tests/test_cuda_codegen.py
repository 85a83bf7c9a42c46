"""The tvm_fusion pipeline on a CUDA target generates source that nvcc compiles to PTX.

Nothing runs without a GPU; this checks the fused kernels are valid CUDA. nvcc comes with the
CUDA toolkit (``/usr/local/cuda/bin`` on this project's machines; ``pip install
nvidia-cuda-nvcc`` or Debian's non-free ``nvidia-cuda-toolkit`` elsewhere); without it the
tests skip and say so. The slow test covers every zoo model present (``$TVM_FUSION_MODELS``,
default ``models/``).
"""

import os
import re
import shutil
import warnings
from pathlib import Path

import onnx
import pytest
import tvm

from tvm_fusion.compile import import_onnx
from tvm_fusion.export_models import MODELS as ZOO
from tvm_fusion.models import get_builtin
from tvm_fusion.models.cnn import inverted_residual_net

MODELS_DIR = Path(os.environ.get("TVM_FUSION_MODELS", Path(__file__).parent.parent / "models"))
TARGET = {"kind": "cuda", "arch": "sm_80"}
needs_nvcc = pytest.mark.skipif(
    shutil.which("nvcc") is None,
    reason="nvcc not found on PATH: install the CUDA toolkit (pip install nvidia-cuda-nvcc, or "
           "Debian non-free's nvidia-cuda-toolkit) to compile the CUDA sources to PTX")


def _cuda_module(module):
    if module.kind == "cuda":
        return module
    for imported in module.imports:
        found = _cuda_module(imported)
        if found is not None:
            return found
    return None


def _ptx(model: onnx.ModelProto) -> tuple[str, bytes]:
    """The CUDA source of the registered pipeline's build, and nvcc's PTX of it."""
    target = tvm.target.Target(TARGET, host="llvm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        executable = tvm.compile(import_onnx(model), target, relax_pipeline="tvm_fusion")
    source = _cuda_module(executable.mod).inspect_source()
    with target:
        ptx = tvm.support.nvcc.compile_cuda(source, target_format="ptx", compiler="nvcc")
    return source, bytes(ptx)


def _kernels(source: str) -> set[str]:
    return set(re.findall(r"__global__ void(?: __launch_bounds__\(\d+\))? (\w+)\(", source))


def _entries(ptx: bytes) -> set[str]:
    return set(re.findall(r"\.entry (\w+)\(", ptx.decode()))


SMALL = {"encoder": lambda: get_builtin("encoder", seq=16, hidden=32, heads=2, ffn=64),
         "inverted_residual_net": lambda: inverted_residual_net(size=16)}


@needs_nvcc
@pytest.mark.parametrize("name", list(SMALL))
def test_fused_cuda_source_compiles_to_ptx(name):
    source, ptx = _ptx(SMALL[name]())
    assert "__global__" in source
    assert b".target sm_80" in ptx
    assert _kernels(source) and _entries(ptx) == _kernels(source)  # every kernel compiled


@needs_nvcc
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_cuda_source_compiles_to_ptx(name):
    """Issue 19: the CUDA source of every zoo model compiles to PTX (1–4 minutes a model on
    two cores, build and nvcc)."""
    path = MODELS_DIR / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} missing: run `python -m tvm_fusion.export_models --only {name}` "
                    "(needs pip install -e '.[models]', i.e. torch)")
    source, ptx = _ptx(onnx.load(path))
    assert b".target sm_80" in ptx
    assert _kernels(source) and _entries(ptx) == _kernels(source)

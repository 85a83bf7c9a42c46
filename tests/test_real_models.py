"""Real architectures from the model zoo (``python -m tvm_fusion.export_models``): slow, and
skipped when a model has not been exported (exporting needs ``pip install -e ".[models]"``)."""

import os
from pathlib import Path

import pytest

from tvm_fusion import export_models as zoo
from tvm_fusion.compile import load_onnx
from tvm_fusion.report import make_report

MODELS_DIR = Path(os.environ.get("TVM_FUSION_MODELS", Path(__file__).parent.parent / "models"))
# The five: two transformers, three CNNs.
MODELS = ["bert_base", "gpt2", "resnet50", "mobilenet_v2", "efficientnet_b0"]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_kernels_near_anchor_bound_and_numerics(name):
    path = MODELS_DIR / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} missing: run `python -m tvm_fusion.export_models --only {name}`")
    report = make_report(load_onnx(path), name, check=True)  # raises on a numerical mismatch
    assert report.fused_kernels <= 1.05 * report.anchor_bound + 2, report.fused_kernels
    assert report.fused_kernels <= report.stock_kernels
    assert report.irs_bytes_after < report.irs_bytes_before


# Every other zoo model (issue 19): each matches ONNX Runtime (the report's check raises
# otherwise) and is no more kernels than stock FuseOps.
OTHERS = sorted(set(zoo.MODELS) - set(MODELS))


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHERS)
def test_every_zoo_model_matches_and_fuses(name):
    path = MODELS_DIR / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} missing: run `python -m tvm_fusion.export_models --only {name}`")
    report = make_report(load_onnx(path), name, check=True)
    assert report.fused_kernels <= report.stock_kernels

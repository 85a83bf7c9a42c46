"""Real symbolic exports (issue 24): BERT, GPT-2 with its LM head, a Llama-style decoder and ViT
with a symbolic batch, in tiny configurations (``tvm_fusion.export_models.SMALL``: same
architectures, 2 layers, hidden 64-128), exported by torch.onnx (TorchScript and dynamo) and
torch.export, imported through tvm_fusion.frontend, built with tvm_fusion and with stock
``tvm.compile``, run at two sizes against PyTorch (and ONNX Runtime for ONNX files).

The default run imports every model's TorchScript export (seconds each); building them, and
the whole matrix (every exporter, both builds), is slow. ``scripts/dynamic_exports.py`` runs it
at full size with timings.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

torch = pytest.importorskip("torch")

from tvm_fusion import export_models as zoo  # noqa: E402
from tvm_fusion.compile import (  # noqa: E402
    compile_model,
    count_kernels,
    fuse,
    import_model,
    load_model,
)
from tvm_fusion.frontend import ImportReport  # noqa: E402
from tvm_fusion.numerics import onnx_reference  # noqa: E402

MODELS = sorted(zoo.SMALL)
TARGET = "llvm"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("symbolic")
    cache = {}

    def get(name: str, exporter: str):
        if (name, exporter) not in cache:
            spec = zoo.SMALL[name]
            result = zoo.export_symbolic(spec, exporter, folder)
            assert result.ok, result.error
            cache[name, exporter] = zoo.symbolic_path(folder, spec, exporter)
        return cache[name, exporter]

    return get


def _shapes_lost(mod) -> list[str]:
    main = mod["main"]
    defined = {v.name for p in main.params for v in relax.analysis.tir_vars_in_type(p.ty)}
    lost = []
    for block in main.body.blocks:
        for binding in block.bindings:
            var = binding.var
            if isinstance(binding, relax.MatchCast) or not isinstance(var.ty, relax.TensorType):
                continue
            if var.ty.shape is None or any(
                    v.name not in defined for v in relax.analysis.tir_vars_in_type(var.ty)):
                lost.append(var.name)
    return lost


def _outputs(value) -> list[np.ndarray]:
    if hasattr(value, "numpy"):
        return [value.numpy()]
    return [o for item in value for o in _outputs(item)]


def _check(spec, path, builds=("tvm_fusion", "stock")):
    model = load_model(path)
    report = ImportReport()
    mod = import_model(model, report=report)
    assert not _shapes_lost(mod)
    torch.manual_seed(zoo.SEED)
    net = zoo.calibrate(spec.build().eval(), spec)
    vms = {label: relax.VirtualMachine(compile_model(
        mod, TARGET, **({} if label == "tvm_fusion" else {"strategy": "none"})), tvm.cpu())
        for label in builds}
    for i in range(2):
        sizes = {dim: zoo.CHECK_SIZES[dim][i] for _, _, dim in spec.symbolic}
        feeds = zoo.random_inputs(spec, zoo.SEED + i, sizes)
        args = [feeds[i.name] for i in spec.inputs]  # by position: a program names its own
        expected = zoo._torch_outputs(net, tuple(torch.from_numpy(a) for a in args))
        references = [expected]
        if str(path).endswith(".onnx"):
            references.append(onnx_reference(model, feeds))
        for vm in vms.values():
            got = _outputs(vm["main"](*[tvm.runtime.tensor(a) for a in args]))
            for ref in references:
                for g, r in zip(got, ref, strict=True):
                    assert g.shape == r.shape
                    np.testing.assert_allclose(g, r, rtol=1e-4, atol=2e-5)
    return mod, report


@pytest.mark.parametrize("name", MODELS)
def test_torchscript_export_imports_with_every_shape(exports, name):
    model = load_model(exports(name, "torchscript"))
    report = ImportReport()
    mod = import_model(model, report=report)
    assert not _shapes_lost(mod)
    if name != "vit_b16":  # ViT's shape chains are TVM's own to fold; the others need ours
        assert report.repairs["shape_values"] > 0


@pytest.mark.slow  # about 20 s on a quiet 2-core machine
def test_bert_torchscript_builds_and_runs_at_two_sizes(exports):
    _check(zoo.SMALL["bert_base"], exports("bert_base", "torchscript"), builds=("tvm_fusion",))


@pytest.mark.slow
@pytest.mark.parametrize("exporter", zoo.SYMBOLIC_EXPORTERS)
@pytest.mark.parametrize("name", MODELS)
def test_symbolic_export_matrix(exports, name, exporter):
    mod, _ = _check(zoo.SMALL[name], exports(name, exporter))
    stock = count_kernels(fuse(mod, TARGET, strategy="tvm"))
    assert count_kernels(fuse(mod, TARGET)) < stock

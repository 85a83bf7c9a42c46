"""Every fused model computes what the stock build and the ONNX reference compute."""

import pytest
import tvm
from conftest import TARGET, check_model
from hypothesis import HealthCheck, given, settings

from tvm_fusion.compile import graph_input_names, import_onnx, run
from tvm_fusion.feeds import random_inputs
from tvm_fusion.models import BUILTIN_MODELS, get_builtin
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.testing.onnx_backend import load_backend_case, onnx_backend_model_dirs
from tvm_fusion.testing.random_dag import random_dag_models


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_models(name):
    check_model(get_builtin(name), rtol=1e-4, atol=1e-4)


def test_registered_pipeline_matches_sequential():
    """``relax_pipeline="tvm_fusion"`` and the Sequential drop-in give the same numbers."""
    import tvm_fusion

    model = get_builtin("encoder")
    mod = import_onnx(model)
    feeds = random_inputs(model)
    inputs = [feeds[k] for k in graph_input_names(model)]
    by_name = run(tvm.compile(mod, TARGET, relax_pipeline="tvm_fusion"), inputs)
    with TARGET:
        fused = tvm_fusion.transform.Sequential(TARGET)(mod)
    drop_in = run(tvm.compile(fused, TARGET), inputs)
    compare(by_name, drop_in, rtol=1e-6, atol=1e-6)
    compare(by_name, onnx_reference(model, feeds), rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # ~25 s; .ci/run runs it after the default run (the fuzzer's
# short run covers random graphs in the default run)
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(model=random_dag_models())
def test_random_dags(model):
    check_model(model, rtol=1e-4, atol=1e-4)


def _backend_cases():
    """The ``light`` suite holds whole networks (AlexNet … DenseNet, ~4 min): marked slow."""
    return [pytest.param(d, id=f"{d.parent.name}/{d.name}",
                         marks=[pytest.mark.slow] if d.parent.name == "light" else [])
            for d in onnx_backend_model_dirs()]


@pytest.mark.parametrize("case", _backend_cases())
def test_onnx_backend_models(case):
    """The onnx package's model tests pass through tvm_fusion wherever they pass through
    stock TVM: a case stock TVM cannot import, compile or match is skipped with its reason."""
    from tvm_fusion.compile import compile_model

    model, feeds, expected = load_backend_case(case)
    try:
        mod = import_onnx(model)
        inputs = [feeds[k] for k in graph_input_names(model)]
        stock = run(compile_model(mod, TARGET, strategy="tvm"), inputs)
        compare(stock, expected, rtol=1e-3, atol=1e-4)
    except Exception as err:  # stock TVM fails: not ours to pass
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        pytest.skip(f"stock TVM fails: {reason[:120]}")
    ours = run(compile_model(mod, TARGET), inputs)
    compare(ours, expected, rtol=1e-3, atol=1e-4)
    compare(ours, stock, rtol=1e-4, atol=1e-5)

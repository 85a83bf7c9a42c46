"""Shared fixtures: the TVM target and a helper that checks a model end to end."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tvm

from tvm_fusion.compile import compile_model, fuse, graph_input_names, import_onnx, run
from tvm_fusion.testing import compare, onnx_reference, random_inputs

TARGET = tvm.target.Target("llvm")

# Plans must not depend on a developer's own profiling database: point at one that is absent,
# so yellow cells fall back to the analytic default (which says so in the report).
os.environ["TVM_FUSION_DB"] = os.path.join(os.path.dirname(__file__), "no-such-profiling.db")


def check_model(model, rtol=1e-4, atol=1e-5, seed=0, **options):
    """Compile ``model`` with tvm_fusion and stock TVM; both must match the ONNX reference.

    Returns the fused module (after FuseTIR) for structural assertions.
    """
    mod = import_onnx(model)
    feeds = random_inputs(model, seed=seed)
    inputs = [feeds[name] for name in graph_input_names(model)]
    reference = onnx_reference(model, feeds)
    ours = run(compile_model(mod, TARGET, **options), inputs)
    stock = run(compile_model(mod, TARGET, strategy="tvm"), inputs)
    compare(ours, reference, rtol=rtol, atol=atol)
    compare(ours, stock, rtol=rtol, atol=atol)
    return fuse(mod, TARGET, **options)


@pytest.fixture
def rng():
    return np.random.default_rng(0)

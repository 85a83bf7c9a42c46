"""Shared fixtures: the TVM target and a helper that checks a model end to end."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tvm

from tvm_fusion.compile import compile_model, fuse, graph_input_names, import_onnx, run
from tvm_fusion.feeds import random_inputs
from tvm_fusion.numerics import compare, onnx_reference

TARGET = tvm.target.Target("llvm")


def host_has(feature: str) -> bool:
    """Whether this machine's CPU has ``feature`` (a /proc/cpuinfo flag: avx2, fma)."""
    try:
        with open("/proc/cpuinfo") as handle:
            return f" {feature}" in handle.read()
    except OSError:
        return False

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


# --------------------------------------------------------------- the emulated AArch64 device

def _arm64_script():
    """``scripts/arm64_device.py`` as a module."""
    from script_module import load_script

    return load_script("arm64_device")


@pytest.fixture(scope="session")
def arm64():
    """The module that sets up and starts emulated AArch64 RPC servers; the test is skipped,
    with the reason, when this machine cannot have one (no qemu-aarch64-static or cross g++,
    or the one-time setup could not download the userland)."""
    module = _arm64_script()
    reason = module.unavailable()
    if reason:
        pytest.skip(reason)
    try:
        module.setup()
    except RuntimeError as err:
        pytest.skip(str(err))
    return module


@pytest.fixture(scope="session")
def arm64_device(arm64):
    """A tracker and one emulated AArch64 server under key ``arm64`` for the whole session,
    stopped by process id at its end."""
    device = arm64.Device(key="arm64", servers=1)
    try:
        yield device
    finally:
        device.close()

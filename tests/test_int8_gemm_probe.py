"""The integer GEMM probe (``scripts/int8_gemm_probe.py``, issue 20): each ISA's exact int8
dot product builds from TIR, its k loop does only those instructions on registers (no vector
to or from the stack), and where this machine runs it, the int32 result equals numpy's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import tvm
from asm_inspect import AARCH64, ZEN3, innermost_loops

from tvm_fusion.tir_schedules.cpu_target import has_feature

ZEN4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 1})
DOTPROD = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                             "mattr": ["+neon", "+dotprod"], "num-cores": 1})
INSTRUCTION = {"vnni": "vpdpbusd", "pmaddwd": "vpmaddwd", "sdot": "sdot"}

_spec = importlib.util.spec_from_file_location(
    "int8_gemm_probe", Path(__file__).resolve().parent.parent / "scripts" / "int8_gemm_probe.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def _host_has(feature: str) -> bool:
    host = tvm.target.Target({"kind": "llvm",
                              "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    return has_feature(host, feature)


@pytest.mark.parametrize("target,form", [(ZEN4, "vnni"), (ZEN3, "pmaddwd"),
                                         (DOTPROD, "sdot")], ids=["avx512vnni", "avx2", "neon"])
def test_integer_dot_builds_on_registers(target, form):
    func, got, (mr, nr), _ = probe.build_gemm(target, 32, 100, 64)
    assert got == form
    lib = tvm.compile(tvm.IRModule({"gemm": func}), target=target)
    asm = lib.mod.inspect_source("asm")
    loops = [(dots, stack) for _, dots, stack in
             innermost_loops(asm, rf"\b{INSTRUCTION[form]}\b")]
    assert loops, f"no {INSTRUCTION[form]} loop"
    per_step = mr * nr // {"vnni": 16, "pmaddwd": 8, "sdot": 4}[form]  # one per accumulator
    for dots, stack in loops:  # LLVM may unroll the k loop: whole k steps
        assert dots % per_step == 0 and stack == 0, (dots, per_step, stack)


def test_plain_aarch64_has_no_exact_int8_dot():
    with pytest.raises(ValueError, match="no exact integer dot"):
        probe.build_gemm(AARCH64, 32, 100, 64)


@pytest.mark.parametrize("target,feature", [(ZEN4, "avx512vnni"), (ZEN3, "avx2")],
                         ids=["avx512vnni", "avx2"])
@pytest.mark.parametrize("shape", [(64, 3136, 576), (24, 100, 36)], ids=["layer1", "odd_n"])
def test_integer_gemm_is_exact(target, feature, shape):
    if not _host_has(feature):
        pytest.skip(f"this machine has no {feature}")
    m, n, k = shape
    func, form, (mr, nr), group = probe.build_gemm(target, m, n, k)
    lib = tvm.compile(tvm.IRModule({"gemm": func}), target=target)
    a, b, ref = probe.operands(form, m, n, k, nr, group)
    dev = tvm.cpu()
    c = tvm.runtime.tensor(np.zeros((m, b.shape[0] * nr), "int32"), dev)
    lib["gemm"](tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev), c)
    np.testing.assert_array_equal(c.numpy()[:, :n], ref)

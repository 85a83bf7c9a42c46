"""What a CPU schedule needs to know about an ``llvm`` target: SIMD lanes, registers, cores.

Read from the target, not from the machine compiling, so that a cross build for
``{"kind": "llvm", "mtriple": "aarch64-linux-gnu"}`` gets NEON-sized tiles. A bare ``"llvm"``
on x86 means baseline x86-64 (SSE2): LLVM only uses AVX/AVX-512 when the target names a CPU
(``"mcpu": "znver4"``) or features.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import tvm
from tvm.target import codegen

_FLOAT16 = ("float16", "bfloat16")


@dataclass(frozen=True)
class CpuParams:
    lanes: int  # fp32 lanes of one SIMD register
    registers: int  # SIMD registers the accumulator tile may use (about 3/4 of the file)
    cores: int  # threads the runtime will use; parallel loops are only worth it above one
    native_fp16: bool = False  # fp16 arithmetic in the vector unit (AVX512-FP16, ARMv8.2 FP16)

    def vector_bytes(self) -> int:
        return self.lanes * 4

    def for_dtype(self, dtype) -> CpuParams:
        """The parameters for a block computing in ``dtype``: lanes of one register of that
        element size (a 16-bit type has twice fp32's, int8 four times, 64-bit half). Without
        native fp16 arithmetic LLVM computes a 16-bit float vector in fp32 registers, two per
        vector, so the register tile gets half as many vectors."""
        bits = max(tvm.DataType(str(dtype)).bits, 8)
        lanes = max(1, self.lanes * 32 // bits)
        registers = self.registers
        if str(dtype) in _FLOAT16 and not (self.native_fp16 and str(dtype) == "float16"):
            registers = max(1, registers // 2)
        if (lanes, registers) == (self.lanes, self.registers):
            return self
        return dataclasses.replace(self, lanes=lanes, registers=registers)


def cpu_params(target: tvm.target.Target | None) -> CpuParams:
    """SIMD width and register budget of ``target``; cores from ``num-cores`` or the machine."""
    cores = os.cpu_count() or 1
    if target is None:
        return CpuParams(4, 12, cores)
    attrs = target.attrs
    if "num-cores" in attrs and int(attrs["num-cores"]) > 0:
        cores = int(attrs["num-cores"])
    triple = str(attrs.get("mtriple", "")) if "mtriple" in attrs else ""
    if triple.startswith(("aarch64", "arm64")):  # NEON: 128-bit, 32 registers
        return CpuParams(4, 24, cores, native_fp16=_has(target, "fullfp16"))
    if triple.startswith("arm"):
        return CpuParams(4, 12, cores)
    if triple.startswith(("riscv", "wasm")):
        return CpuParams(4, 12, cores)
    if _has(target, "avx512f"):
        return CpuParams(16, 24, cores, native_fp16=_has(target, "avx512fp16"))
    if _has(target, "avx2") or _has(target, "avx"):
        return CpuParams(8, 12, cores)
    return CpuParams(4, 12, cores)  # SSE2: what a bare "llvm" gets on x86-64


def _has(target: tvm.target.Target, feature: str) -> bool:
    try:
        with target:
            return bool(codegen.llvm_cpu_has_features(feature, target))
    except Exception:  # noqa: BLE001 (an LLVM without that query: assume the baseline)
        return False

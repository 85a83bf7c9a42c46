"""What a CPU schedule needs to know about an ``llvm`` target: SIMD lanes, registers, cores.

Read from the target, not from the machine compiling, so that a cross build for
``{"kind": "llvm", "mtriple": "aarch64-linux-gnu"}`` gets NEON-sized tiles. A bare ``"llvm"``
on x86 means baseline x86-64 (SSE2): LLVM only uses AVX/AVX-512 when the target names a CPU
(``"mcpu": "znver4"``) or features.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import tvm
from tvm.target import codegen

_FLOAT16 = ("float16", "bfloat16")


@dataclass(frozen=True)
class CpuParams:
    lanes: int  # fp32 lanes of one SIMD register
    registers: int  # SIMD registers the accumulator tile may use (about 3/4 of the file)
    cores: int  # threads the runtime will use; parallel loops are only worth it above one
    native_fp16: bool = False  # fp16 arithmetic in the vector unit (AVX512-FP16, ARMv8.2 FP16)
    l1d_bytes: int = 32 << 10  # L1 data cache per core (cache-sized tiles: attention)
    l2_bytes: int = 512 << 10  # L2 per core

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
        return replace(self, lanes=lanes, registers=registers)


def cpu_params(target: tvm.target.Target | None) -> CpuParams:
    """SIMD width and register budget of ``target``; cores from ``num-cores`` or the machine."""
    cores = os.cpu_count() or 1
    if target is None:
        return CpuParams(4, 12, cores)
    return replace(_simd_params(target, cores), **cache_sizes(target))


def _simd_params(target: tvm.target.Target, cores: int) -> CpuParams:
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


# L1d / L2 per core of CPUs a target names (``mcpu``); the host's are read from sysfs
_CACHES = {
    "znver2": (32 << 10, 512 << 10), "znver3": (32 << 10, 512 << 10),
    "znver4": (32 << 10, 1 << 20), "znver5": (48 << 10, 1 << 20),
    "skylake-avx512": (32 << 10, 1 << 20), "cascadelake": (32 << 10, 1 << 20),
    "icelake-server": (48 << 10, 1280 << 10), "sapphirerapids": (48 << 10, 2 << 20),
    "rocketlake": (48 << 10, 512 << 10), "tigerlake": (48 << 10, 1280 << 10),
    "alderlake": (48 << 10, 1280 << 10), "haswell": (32 << 10, 256 << 10),
    "skylake": (32 << 10, 256 << 10), "cortex-a76": (64 << 10, 512 << 10),
    "cortex-a78": (64 << 10, 512 << 10), "cortex-x1": (64 << 10, 1 << 20),
    "cortex-x3": (64 << 10, 1 << 20), "neoverse-n1": (64 << 10, 1 << 20),
    "neoverse-v1": (64 << 10, 1 << 20), "apple-m1": (128 << 10, 4 << 20),
}


def cache_sizes(target: tvm.target.Target) -> dict:
    """``l1d_bytes``/``l2_bytes`` of the CPU ``target`` names: the host's caches (sysfs) when
    it names the host CPU or none on the host's architecture, else a per-``mcpu`` table, else
    the defaults (32 KiB, 512 KiB)."""
    attrs = target.attrs
    mcpu = str(attrs["mcpu"]) if "mcpu" in attrs else ""
    triple = str(attrs["mtriple"]) if "mtriple" in attrs else ""
    if mcpu in _CACHES:
        l1, l2 = _CACHES[mcpu]
        return {"l1d_bytes": l1, "l2_bytes": l2}
    host = codegen.llvm_get_system_cpu() if hasattr(codegen, "llvm_get_system_cpu") else ""
    if (not mcpu or mcpu == host) and not triple:
        found = _host_caches()
        if found:
            return found
    return {}


def _host_caches() -> dict:
    """L1d and L2 of cpu0 from sysfs (Linux); empty elsewhere."""
    found = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return found
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "level")) as f:
                level = int(f.read())
            with open(os.path.join(base, entry, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        size = int(text[:-1]) << {"K": 10, "M": 20}.get(text[-1], 0) if text[-1] in "KM" else int(
            text)
        if level == 1 and kind in ("Data", "Unified"):
            found["l1d_bytes"] = size
        elif level == 2:
            found["l2_bytes"] = size
    return found


def _has(target: tvm.target.Target, feature: str) -> bool:
    try:
        with target:
            return bool(codegen.llvm_cpu_has_features(feature, target))
    except Exception:  # noqa: BLE001 (an LLVM without that query: assume the baseline)
        return False

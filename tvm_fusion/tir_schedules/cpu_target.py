"""What a CPU schedule needs to know about an ``llvm`` target: SIMD lanes, registers, cores,
caches, and the GEMM register tile and cache blocks they give.

Read from the target, not from the machine compiling, so that a cross build for
``{"kind": "llvm", "mtriple": "aarch64-linux-gnu"}`` gets NEON-sized tiles. A bare ``"llvm"``
on x86 means baseline x86-64 (SSE2): LLVM only uses AVX/AVX-512 when the target names a CPU
(``"mcpu": "znver4"``) or features.

Caches: TVM's target carries no cache sizes. When the target is the machine compiling (no
``mtriple`` or the host's, and no ``mcpu`` or the host's), they are read from
``/sys/devices/system/cpu/cpu0/cache``; otherwise from a small table per ``mcpu``
(:data:`CACHES`), else :data:`DEFAULT_CACHES` (32 KiB 8-way L1d, 512 KiB 8-way L2: the
smallest of the current desktop/server cores, so that blocks chosen from it fit everywhere).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import tvm
from tvm.target import codegen

from ..target import host_cpu

KIB = 1024
_FLOAT16 = ("float16", "bfloat16")


@dataclass(frozen=True)
class Cache:
    size: int  # bytes (per core)
    ways: int


# L1d and L2 per core of the CPUs LLVM names (vendor documentation).
CACHES: dict[str, tuple[Cache, Cache]] = {
    **{cpu: (Cache(32 * KIB, 8), Cache(512 * KIB, 8)) for cpu in ("znver1", "znver2", "znver3")},
    "znver4": (Cache(32 * KIB, 8), Cache(1024 * KIB, 8)),
    "znver5": (Cache(48 * KIB, 12), Cache(1024 * KIB, 16)),
    **{cpu: (Cache(32 * KIB, 8), Cache(256 * KIB, 4))
       for cpu in ("haswell", "broadwell", "skylake", "kabylake", "coffeelake")},
    **{cpu: (Cache(32 * KIB, 8), Cache(1024 * KIB, 16))
       for cpu in ("skylake-avx512", "cascadelake", "cooperlake")},
    **{cpu: (Cache(48 * KIB, 12), Cache(512 * KIB, 8))
       for cpu in ("icelake-client", "rocketlake")},
    **{cpu: (Cache(48 * KIB, 12), Cache(1280 * KIB, 20)) for cpu in ("icelake-server",
                                                                   "tigerlake")},
    **{cpu: (Cache(48 * KIB, 12), Cache(2048 * KIB, 16))
       for cpu in ("sapphirerapids", "emeraldrapids", "graniterapids")},
    "alderlake": (Cache(48 * KIB, 12), Cache(1280 * KIB, 10)),
    **{cpu: (Cache(64 * KIB, 4), Cache(512 * KIB, 8))
       for cpu in ("cortex-a76", "cortex-a77", "cortex-a78", "cortex-x1")},
    **{cpu: (Cache(64 * KIB, 4), Cache(1024 * KIB, 8))
       for cpu in ("cortex-x2", "cortex-x3", "cortex-x4", "neoverse-n1", "neoverse-n2",
                   "neoverse-v1", "neoverse-v2")},
    "cortex-a55": (Cache(32 * KIB, 4), Cache(128 * KIB, 4)),
    **{cpu: (Cache(128 * KIB, 8), Cache(4096 * KIB, 16)) for cpu in ("apple-m1", "apple-m2")},
}
DEFAULT_CACHES = (Cache(32 * KIB, 8), Cache(512 * KIB, 8))
CACHE_LINE_BYTES = 64  # x86-64 and the AArch64 cores above alike

# The GEMM register tile (rows × columns of C) per ISA: the shapes of MLAS's and BLIS's
# kernels, checked by the register model of `shared/specs/cpu-gemm.md` §1.1 (accumulators +
# B vectors + 1 broadcast of A ≤ registers; accumulators ≥ FMA pipes × latency). Measured on
# Zen 3: 4×24 90 % of peak, 6×16 84 %, 3×32 (17 registers: spills) 62 %.
GEMM_TILES = {"avx512": (12, 32), "avx2": (4, 24), "avx": (4, 24), "sse": (4, 12),
              "neon": (8, 12), "generic": (4, 12)}
# 512-bit FMAs a core issues per cycle, where it is not two (Intel's AVX-512 server cores):
# Zen 4 executes a 512-bit FMA as two 256-bit halves on its two FMA pipes, one a cycle.
# With two loads a cycle, it then loads two values (broadcasts or B vectors) per FMA for free
# (CpuParams.loads_per_fma).
FMA512_PER_CYCLE = {"znver4": 1}
# Registers per B vector that widening an 8-bit weight to float32 needs beside it: none where
# one instruction loads and sign-extends into the B register (x86 ``vpmovsxbd``/``pmovsxbd``),
# two where it goes 8 → 16 → 32 bits in steps (NEON ``sxtl``; SSE2's unpacks). Checked in the
# asm: the AArch64 8×12 tile spilled with int8 weights, 7×12 did not.
WIDENING_TEMPS = {"neon": 2, "sse": 2, "generic": 2}


@dataclass(frozen=True)
class CpuParams:
    lanes: int  # fp32 lanes of one SIMD register
    registers: int  # SIMD registers the accumulator tile may use (about 3/4 of the file)
    cores: int  # threads the runtime will use; parallel loops are only worth it above one
    native_fp16: bool = False  # fp16 arithmetic in the vector unit (AVX512-FP16, ARMv8.2 FP16)
    l1d_bytes: int = DEFAULT_CACHES[0].size  # L1 data cache per core
    l2_bytes: int = DEFAULT_CACHES[1].size  # L2 per core
    isa: str = "generic"  # key of GEMM_TILES
    vector_registers: int = 16  # the whole SIMD register file
    fma_chains: int = 8  # FMA pipes × FMA latency: independent accumulators needed
    l1d_ways: int = DEFAULT_CACHES[0].ways
    l2_ways: int = DEFAULT_CACHES[1].ways
    # loads the core issues beside each vector FMA at no cost (0: the conv plans' additive
    # model, loads cost as FMAs, as measured on Zen 3): with it a tile is FMA-bound while its
    # loads per k step are at most this many per FMA (layout/gemm_pack.py: _work)
    loads_per_fma: float = 0.0

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

    def accumulates(self, dtype) -> str:
        """The dtype a conv or matmul over ``dtype`` operands should sum in: its own where the
        vector unit computes in it, float32 for a 16-bit float it has no arithmetic for (fp16
        without AVX512-FP16 / ARMv8.2 FP16, bf16 everywhere): there LLVM would convert every
        fp16 multiply-add to fp32 and round it back, and a sum of many fp16 terms loses digits."""
        dtype = str(dtype)
        if dtype in _FLOAT16 and not (self.native_fp16 and dtype == "float16"):
            return "float32"
        return dtype

    def gemm_tile(self, nr: int | None = None, widened: bool = False,
                  block_scales: bool = False) -> tuple[int, int]:
        """(MR, NR) of the GEMM micro-kernel; with ``nr`` (a narrower packed panel, for an N
        below the ISA's NR) the rows that fit the registers beside it. ``widened``: B is an
        8-bit weight widened in registers (:data:`WIDENING_TEMPS` more per B vector), with
        ``block_scales`` one scale vector per B vector too (a block-wise weight): fewer rows
        where the accumulators would otherwise spill (AVX2 block-wise: 3×24)."""
        mr, wide = GEMM_TILES.get(self.isa, GEMM_TILES["generic"])
        vectors = max(1, (nr or wide) // self.lanes)
        if nr is not None and nr != wide:
            fit = (self.vector_registers - vectors - 1) // vectors
            mr = max(1, min(fit, -(-2 * self.fma_chains // vectors)))
        if widened:
            per_b = 1 + WIDENING_TEMPS.get(self.isa, 0) + int(block_scales)
            mr = max(1, min(mr, (self.vector_registers - 1 - vectors * per_b) // vectors))
        return mr, nr or wide

    def l1_rows_per_set(self, rows: int, stride: int) -> int:
        """The most of ``rows`` rows, ``stride`` bytes apart, whose lines at one offset fall
        in one L1 set: a weight read in place by the micro-kernel's MR rows whose row length
        is a multiple of the L1's way size (4 KiB: 1,024 floats, a 1×1 conv over 1,024
        channels) puts every row's line in the same set."""
        sets = max(1, self.l1d_bytes // (max(self.l1d_ways, 1) * CACHE_LINE_BYTES))
        counts: dict[int, int] = {}
        for r in range(rows):
            key = (r * stride // CACHE_LINE_BYTES) % sets
            counts[key] = counts.get(key, 0) + 1
        return max(counts.values(), default=0)

    def gemm_blocks(self, mr: int, nr: int) -> tuple[int, int]:
        """(KC, NC) for MLAS's loop order: the A sliver MR×KC and a B micro-panel KC×NR fill
        the L1 but one way (KC, a multiple of 16); the B block KC×NC half the L2 (NC, a
        multiple of NR). Low et al., TOMS 43(2) 2016; Zen 3 gives 256 × 240."""
        ways = max(self.l1d_ways, 1)
        l1 = self.l1d_bytes * (ways - 1) // ways
        kc = max(16, l1 // ((mr + nr) * 4) // 16 * 16)
        nc = max(nr, self.l2_bytes // 2 // (kc * 4) // nr * nr)
        return kc, nc


def cpu_params(target: tvm.target.Target | None) -> CpuParams:
    """SIMD width, register budget and GEMM tile of ``target``; cores from ``num-cores`` or
    the machine; caches from the machine when the target is the host, else from the CPU's
    name (:func:`_caches`)."""
    cores = os.cpu_count() or 1
    if target is None:
        return CpuParams(4, 12, cores, isa="sse", **_cache_fields(*_host_caches()))
    return replace(_simd_params(target, cores), **_cache_fields(*_caches(target)))


def _simd_params(target: tvm.target.Target, cores: int) -> CpuParams:
    attrs = target.attrs
    if "num-cores" in attrs and int(attrs["num-cores"]) > 0:
        cores = int(attrs["num-cores"])
    triple = str(attrs.get("mtriple", "")) if "mtriple" in attrs else ""
    if triple.startswith(("aarch64", "arm64")):  # NEON: 128-bit, 32 registers
        return CpuParams(4, 24, cores, native_fp16=has_feature(target, "fullfp16"), isa="neon",
                         vector_registers=32)
    if triple.startswith(("arm", "riscv", "wasm")):
        return CpuParams(4, 12, cores)
    if has_feature(target, "avx512f"):
        mcpu = str(attrs["mcpu"]) if "mcpu" in attrs else host_cpu()
        loads = 2.0 / FMA512_PER_CYCLE.get(mcpu, 2)  # two loads a cycle
        return CpuParams(16, 24, cores, native_fp16=has_feature(target, "avx512fp16"), isa="avx512",
                         vector_registers=32, loads_per_fma=loads)
    if has_feature(target, "avx2") or has_feature(target, "avx"):
        return CpuParams(8, 12, cores, isa="avx2" if has_feature(target, "fma") else "avx")
    return CpuParams(4, 12, cores, isa="sse")  # SSE2: what a bare "llvm" gets on x86-64


def _cache_fields(l1d: Cache, l2: Cache) -> dict:
    return {"l1d_bytes": l1d.size, "l1d_ways": l1d.ways, "l2_bytes": l2.size,
            "l2_ways": l2.ways}


def has_feature(target: tvm.target.Target, feature: str) -> bool:
    """Whether LLVM's model of ``target``'s CPU has ``feature`` (``"avx512vnni"``,
    ``"dotprod"``); False where LLVM cannot say."""
    try:
        with target:
            return bool(codegen.llvm_cpu_has_features(feature, target))
    except Exception:  # noqa: BLE001 (an LLVM without that query: assume the baseline)
        return False


def _caches(target: tvm.target.Target) -> tuple[Cache, Cache]:
    """L1d and L2 of the CPU ``target`` names: the host's (sysfs) when it is the host's CPU
    (no ``mcpu`` or the host's, on the host's architecture), else :data:`CACHES`, else
    :data:`DEFAULT_CACHES`."""
    attrs = target.attrs
    mcpu = str(attrs["mcpu"]) if "mcpu" in attrs else ""
    triple = str(attrs["mtriple"]) if "mtriple" in attrs else ""
    if _is_host(mcpu, triple):
        return _host_caches()
    return CACHES.get(mcpu, DEFAULT_CACHES)


def _is_host(mcpu: str, triple: str) -> bool:
    try:
        host_cpu = str(codegen.llvm_get_system_cpu())
        host_arch = str(codegen.llvm_get_system_triple()).split("-")[0]
    except Exception:  # noqa: BLE001 (a TVM without LLVM)
        return False
    if triple and triple.split("-")[0] != host_arch:
        return False
    return mcpu in ("", host_cpu)


def _host_caches() -> tuple[Cache, Cache]:
    """L1d and L2 of cpu0 from sysfs; the default for a level it does not list."""
    found = {}
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = [e for e in os.listdir(root) if e.startswith("index")]
    except OSError:
        return DEFAULT_CACHES
    for entry in entries:
        try:
            level = int(_read(root, entry, "level"))
            kind = _read(root, entry, "type")
            size = _parse_size(_read(root, entry, "size"))
            ways = int(_read(root, entry, "ways_of_associativity") or 0)
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and level in (1, 2) and size and ways:
            found[level] = Cache(size, ways)
    return found.get(1, DEFAULT_CACHES[0]), found.get(2, DEFAULT_CACHES[1])


def _read(root: str, entry: str, name: str) -> str:
    with open(os.path.join(root, entry, name)) as handle:
        return handle.read().strip()


def _parse_size(text: str) -> int:
    units = {"K": KIB, "M": KIB * KIB, "G": KIB ** 3}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)

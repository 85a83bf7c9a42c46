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
from dataclasses import dataclass

import tvm
from tvm.target import codegen

KIB = 1024


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

# The GEMM register tile (rows × columns of C) per ISA: the shapes of MLAS's and BLIS's
# kernels, checked by the register model of `shared/specs/cpu-gemm.md` §1.1 (accumulators +
# B vectors + 1 broadcast of A ≤ registers; accumulators ≥ FMA pipes × latency). Measured on
# Zen 3: 4×24 90 % of peak, 6×16 84 %, 3×32 (17 registers: spills) 62 %.
GEMM_TILES = {"avx512": (12, 32), "avx2": (4, 24), "avx": (4, 24), "sse": (4, 12),
              "neon": (8, 12), "generic": (4, 12)}


@dataclass(frozen=True)
class CpuParams:
    lanes: int  # fp32 lanes of one SIMD register
    registers: int  # SIMD registers the accumulator tile may use (about 3/4 of the file)
    cores: int  # threads the runtime will use; parallel loops are only worth it above one
    isa: str = "generic"  # key of GEMM_TILES
    vector_registers: int = 16  # the whole SIMD register file
    fma_chains: int = 8  # FMA pipes × FMA latency: independent accumulators needed
    l1d: Cache = DEFAULT_CACHES[0]
    l2: Cache = DEFAULT_CACHES[1]

    def vector_bytes(self) -> int:
        return self.lanes * 4

    def gemm_tile(self, nr: int | None = None) -> tuple[int, int]:
        """(MR, NR) of the GEMM micro-kernel; with ``nr`` (a narrower packed panel, for an N
        below the ISA's NR) the rows that fit the registers beside it."""
        mr, wide = GEMM_TILES.get(self.isa, GEMM_TILES["generic"])
        if nr is None or nr == wide:
            return mr, wide
        vectors = max(1, nr // self.lanes)
        fit = (self.vector_registers - vectors - 1) // vectors
        return max(1, min(fit, -(-2 * self.fma_chains // vectors))), nr

    def gemm_blocks(self, mr: int, nr: int) -> tuple[int, int]:
        """(KC, NC) for MLAS's loop order: the A sliver MR×KC and a B micro-panel KC×NR fill
        the L1 but one way (KC, a multiple of 16); the B block KC×NC half the L2 (NC, a
        multiple of NR). Low et al., TOMS 43(2) 2016; Zen 3 gives 256 × 240."""
        l1 = self.l1d.size * (self.l1d.ways - 1) // max(self.l1d.ways, 1)
        kc = max(16, l1 // ((mr + nr) * 4) // 16 * 16)
        nc = max(nr, self.l2.size // 2 // (kc * 4) // nr * nr)
        return kc, nc


def cpu_params(target: tvm.target.Target | None) -> CpuParams:
    """SIMD width and register budget of ``target``; cores from ``num-cores`` or the machine;
    caches from the machine when the target is the host, else from the CPU's name."""
    cores = os.cpu_count() or 1
    if target is None:
        return CpuParams(4, 12, cores, "sse", 16, 8, *_host_caches())
    attrs = target.attrs
    if "num-cores" in attrs and int(attrs["num-cores"]) > 0:
        cores = int(attrs["num-cores"])
    caches = _caches(target)
    triple = str(attrs.get("mtriple", "")) if "mtriple" in attrs else ""
    if triple.startswith(("aarch64", "arm64")):
        return CpuParams(4, 24, cores, "neon", 32, 8, *caches)  # NEON: 128-bit, 32 registers
    if triple.startswith("arm"):
        return CpuParams(4, 12, cores, "generic", 16, 8, *caches)
    if triple.startswith(("riscv", "wasm")):
        return CpuParams(4, 12, cores, "generic", 16, 8, *caches)
    if _has(target, "avx512f"):
        return CpuParams(16, 24, cores, "avx512", 32, 8, *caches)
    if _has(target, "avx2") or _has(target, "avx"):
        return CpuParams(8, 12, cores, "avx2" if _has(target, "fma") else "avx", 16, 8,
                         *caches)
    return CpuParams(4, 12, cores, "sse", 16, 8, *caches)  # SSE2: a bare "llvm" on x86-64


def _has(target: tvm.target.Target, feature: str) -> bool:
    try:
        with target:
            return bool(codegen.llvm_cpu_has_features(feature, target))
    except Exception:  # noqa: BLE001 (an LLVM without that query: assume the baseline)
        return False


def _caches(target: tvm.target.Target) -> tuple[Cache, Cache]:
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

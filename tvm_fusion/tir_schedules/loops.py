"""Loop helpers shared by the CPU rules: which loop carries which block iterator, tile sizes,
vectorising a loop group, and parallelising an outer nest only when it pays."""

from __future__ import annotations

import tvm
from tvm import s_tir
from tvm.s_tir.stmt import SBlockRealize

from .. import symbolic
from ..tir_utils import const_int, find_all
from .cpu_target import CpuParams
from .rounding import is_fence

# Below this much work (elements x ops) a parallel launch costs more than it saves.
PARALLEL_MIN_WORK = 1 << 15
# Parallel chunks per core: enough to even out unequal chunks, few enough that each is big.
CHUNKS_PER_CORE = 16


def loop_extent(sch: s_tir.Schedule, loop) -> int | None:
    """The loop's extent when it is a constant, else None (symbolic: nothing may assume a
    tile divides it)."""
    return const_int(sch.get(loop).extent)


def loop_size(sch: s_tir.Schedule, loop) -> int:
    """The loop's extent for cost decisions: a symbolic one at its representative size."""
    return symbolic.extent(sch.get(loop).extent)


def loops_by_var(sch: s_tir.Schedule, block_rv) -> dict | None:
    """``{iter var name: loop}``: for each iterator, the innermost loop its binding uses.

    A block fresh from legalisation binds each iterator to one loop; one placed by
    ``compute_at`` binds ``outer // k + ax`` (its own loop is the innermost one used). Unit
    iterators may be bound to constants. None when two iterators share an innermost loop
    (a transformation mixed them)."""
    loops = sch.get_loops(block_rv)
    if not loops:
        return {}
    realize = sch.get(loops[-1]).body
    block = sch.get(block_rv)
    if not isinstance(realize, SBlockRealize) or not realize.block.same_as(block):
        return None
    position = {sch.get(lp).loop_var.name: i for i, lp in enumerate(loops)}
    mapping, used = {}, set()
    for iv, value in zip(block.iter_vars, realize.iter_values):
        names = {v.name for v in find_all(value, tvm.ir.Var)} & set(position)
        if not names:
            if const_int(iv.dom.extent) != 1:
                return None
            continue
        inner = max(names, key=position.__getitem__)
        if inner in used:
            return None
        used.add(inner)
        mapping[iv.var.name] = loops[position[inner]]
    return mapping


def pick_vector_tile(extent: int, lanes: int, max_vectors: int = 2) -> int | None:
    """Lanes to vectorise a loop of ``extent`` with.

    Whole registers when a multiple of ``lanes`` divides the extent (up to ``max_vectors``);
    otherwise one register that is partly used (the largest divisor of the extent up to
    ``lanes``): LLVM widens a 7- or 14-lane vector to one register, but splits a 28-lane one
    into odd pieces and spills them.
    """
    if extent <= 1:
        return None
    for count in range(max_vectors, 0, -1):
        if extent % (count * lanes) == 0:
            return count * lanes
    divisors = [size for size in range(min(extent, lanes), 1, -1) if extent % size == 0]
    return divisors[0] if divisors else None


def lane_use(size: int | None, lanes: int) -> float:
    """Fraction of the vector registers' lanes a tile of ``size`` keeps busy."""
    if not size:
        return 0.0
    return size / (-(-size // lanes) * lanes)


def largest_divisor(extent: int, limit: int) -> int:
    for size in range(min(limit, extent), 0, -1):
        if extent % size == 0:
            return size
    return 1


def vectorize_inner(sch: s_tir.Schedule, loops: list, params: CpuParams,
                    max_vectors: int = 4) -> str:
    """Vectorise the innermost of ``loops`` when whole vectors divide it (split off up to
    ``max_vectors`` registers' worth). Any other inner loop is left serial: LLVM's own loop
    vectoriser handles its tail and its bounds checks (a pad's ``if_then_else``) with masks,
    whereas vectorising a fused, div/mod-indexed loop in TIR turns every lane into a gather.

    Except where LLVM cannot: a loop whose stores hold ``llvm.arithmetic.fence`` (the rounding
    kept before a quantize, :mod:`.rounding`) is no loop LLVM's vectoriser takes (the fence is
    not among its vectorisable intrinsics), so it would run one element at a time; it gets one
    partly used register of the largest divisor of its extent instead (a QDQ conv GEMM's
    quantize over 56-wide rows: 650 → 80 µs per 200,704 elements on Zen 4).
    """
    if not loops:
        return "no loop"
    extent = loop_extent(sch, loops[-1])
    if extent is None:
        return f"inner {extent} left to LLVM"
    if extent % params.lanes:
        size = pick_vector_tile(extent, params.lanes, 1) if _fenced(sch, loops[-1]) else None
        if size is None:
            return f"inner {extent} left to LLVM"
        inner = loops[-1]
        if size < extent:
            _, inner = sch.split(loops[-1], factors=[None, size])
        sch.vectorize(inner)
        return f"vector {size} (fenced: LLVM would not vectorise it)"
    size = pick_vector_tile(extent, params.lanes, max_vectors)
    inner = loops[-1]
    if size < extent:
        _, inner = sch.split(loops[-1], factors=[None, size])
    sch.vectorize(inner)
    return f"vector {size}"


def _fenced(sch: s_tir.Schedule, loop) -> bool:
    """Whether a store under ``loop`` computes through ``llvm.arithmetic.fence``."""
    return any(is_fence(call) for call in find_all(sch.get(loop).body, tvm.ir.Call))


def parallelize(sch: s_tir.Schedule, loops: list, work: int, params: CpuParams) -> str:
    """Run the outermost of ``loops`` in parallel when the work is worth it; where a stage
    attached between two of them breaks the nest, from the loop below it.

    Only as many outer loops are fused as give every core enough chunks to balance
    (``CHUNKS_PER_CORE``); the rest stay serial inside. Fusing the whole tile nest into one
    parallel loop makes every address a div/mod of one index, which LLVM cannot strength-reduce
    (a depthwise conv ran 7x slower that way).
    """
    if not loops:
        return "serial"
    chosen, extent = [], 1
    for loop in loops:
        if chosen and not sch.get(chosen[-1]).body.same_as(sch.get(loop)):
            # a stage attached between them (a padding computed once, at a unit loop above
            # the rows: fuzz seed 2478): fuse cannot cross it; the parallel loop starts below
            chosen, extent = [], 1
        chosen.append(loop)
        extent *= loop_size(sch, loop)
        if extent >= CHUNKS_PER_CORE * params.cores:
            break
    if params.cores <= 1 or extent <= 1 or work < PARALLEL_MIN_WORK:
        return "serial"
    fused = sch.fuse(*chosen) if len(chosen) > 1 else chosen[0]
    sch.parallel(fused)
    return f"parallel {extent}"

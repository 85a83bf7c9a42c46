"""The fusion guard: a fused kernel whose schedule does more than its operators apart is split.

DNNFusion's planner decides from mapping types and an oracle *before* any loop nest exists; the
schedules then decide what is inlined, kept or attached per row. The inliner already refuses a
producer that recomputing costs more than a buffer (``tir_schedules/inline.py``), and the CPU
rules keep at the root what they cannot attach (``tir_schedules/cpu.py``). What neither can fix
is a kernel whose loop nest still executes a stage more often than its own iteration space (a
LayerNorm's row statistics attached under a slice or gather that revisits rows, a reduction
under a broadcast) or whose arithmetic grows otherwise.

So after scheduling, every kernel built from several operators is estimated from its TIR
(:func:`~tvm_fusion.tir_schedules.work.executed_work`: loop extents × body) and compared with
its operators' own PrimFuncs before fusion, each paying its inputs and outputs in memory
traffic at the ``flops_per_byte`` ridge (the analytic oracle's, ``fusion_plan.py``): what fusion
saves is the intermediate traffic the parts pay and the fused kernel does not. A kernel whose
estimate exceeds its parts' by more than ``margin`` is planned apart again (one kernel per
operator), each of its producer → consumer pairs recorded with
:attr:`~.rejection.RejectReason.FUSION_LOSES`, and the decision itself
(:class:`GuardDecision`) kept on the run's ``ModulePlan`` for ``tvm-fusion report``.

**Scattered write-backs.** A kernel whose stores into its outputs step a cache line or more per
iteration of their innermost loop (``work.scattered_stores``: SmartMem's *eliminate 2nd* into a
tile whose vectors run along another axis) and store each element more than once (a K-blocked
GEMM tile's partial sums) moves a line per further store; apart, the tile stores contiguously
and a copy kernel changes the layout once. It is split when those lines exceed the
intermediate's round trip by more than ``margin`` (ConvNeXt-T's NHWC → NCHW residual epilogues:
6-7 % faster apart on Zen 4, docs/design.md). Once per element, the scatter is kept fused.

Splitting is how the recomputed producer is materialised: it becomes its own kernel's output,
written once, which its consumer reads. Scheduling the fused kernel again with the recomputed
stages computed once at its root was tried and measured slower than the split (``Tile(LayerNorm)``
of 64×768 rows: 1.4-3.6× ONNX Runtime's time in one kernel, 0.7× split), because the stages left
at the root lose the row schedule's vectorised statistics.

**Memory.** A kernel whose schedule keeps a whole intermediate in a buffer of its own (a
GEMM's result that a SwiGLU epilogue reads at two column offsets, so no output tile has its
inputs in one GEMM tile) saves no traffic on it: the intermediate is written and read back as
it would be between two kernels. It costs memory, though: a kernel's workspace is allocated
beside the planned storage, which TVM's ``StaticPlanBlockMemory`` cannot reuse for it, where
the same tensor between two kernels takes a planned token that dead tensors left (the Llama
decoder layer's merged gate/up GEMM: 1.41 MB of workspace on top of the plan, above stock
FuseOps' whole plan, before the rewriter stopped merging SwiGLU's projections). Such a kernel
is planned again as two blocks, the producer of the kept buffer
with its ancestors in the block, and the rest (:class:`MemoryDecision`, recorded with
:attr:`~.rejection.RejectReason.KEPT_INTERMEDIATE`); a buffer the schedule shrank to a tile
or a row is fusion working as meant and stays. This split is opt-in (``split_kept``, option
``guard_kept_intermediates``): on the zoo it saved nothing that the storage re-packing and the
rewriter's SwiGLU precondition had not already saved, raised YOLOv8-n's plan (6.68 → 6.88 MB)
and measured 1.09x MobileBERT's time (under heavy load: not conclusive).

An ``oracle`` (the profiling database's, ``tuning/oracle.py``) may answer with measured times
instead, through ``guard_times(fused, parts)``; the estimate is the default (no oracle of the
project has that method yet: the hook is where a measurement fits).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.s_tir import SBlock

from ..instrument import emit
from ..module_update import with_functions
from ..tir_schedules.cpu_target import CACHE_LINE_BYTES
from ..tir_schedules.fused_block import ScheduleFusedBlocks
from ..tir_schedules.records import KEPT_ATTR
from ..tir_schedules.work import executed_work, recomputed_blocks, scattered_stores
from ..tir_utils import compact_buffers, find_all, shape_numel
from .grouping import primitive_callees
from .plan_fusion import ModulePlan, PlanFusion, apply_plan
from .rejection import Rejection, RejectReason

__all__ = ["FusionGuard", "GuardDecision", "MemoryDecision", "judge_kernel", "scattered_rewrites",
           "whole_kept_buffers"]

# A fused kernel may cost this much more than its parts before it is split: the estimate counts
# scalar operations, and a schedule adds a little (partial sums, tile remainders).
DEFAULT_MARGIN = 0.25


@dataclass(frozen=True)
class GuardDecision:
    """One kernel the guard split."""

    function: str  # the fused PrimFunc
    operators: tuple[str, ...]  # its parts, by PrimFunc name
    fused_cost: float  # estimated (or measured) cost of the fused kernel
    apart_cost: float  # of its parts as separate kernels
    detail: str

    def describe(self) -> str:
        return (f"{self.function}: split into {len(self.operators)} kernels "
                f"({' + '.join(self.operators)}): {self.detail}")


@dataclass(frozen=True)
class MemoryDecision:
    """One kernel the guard split in two because it kept a whole intermediate."""

    function: str  # the fused PrimFunc
    operators: tuple[str, ...]  # its parts, by PrimFunc name
    producer: str  # the part whose result the kernel kept whole
    buffer: str  # the kept buffer
    nbytes: int

    def describe(self) -> str:
        return (f"{self.function}: split after {self.producer}: the kernel kept its whole "
                f"result {self.buffer!r} ({self.nbytes:,} B) as workspace beside the planned "
                f"storage, saving no traffic")


def whole_kept_buffers(fused: tirx.PrimFunc) -> dict[str, tuple[tuple[int, ...], str, int]]:
    """The buffers a scheduled kernel keeps (its ``tvm_fusion.kept_buffers``) that TVM's buffer
    compaction does not shrink: name -> (shape, dtype, bytes). Static shapes only."""
    kept = fused.attrs.get(KEPT_ATTR) if fused.attrs is not None else None
    if not kept:
        return {}
    names = {str(k) for k in kept}
    compacted = {}
    for block in find_all(compact_buffers(fused).body, SBlock):
        for buf in block.alloc_buffers:
            compacted[buf.name] = shape_numel(buf.shape)
    whole = {}
    for block in find_all(fused.body, SBlock):
        for buf in block.alloc_buffers:
            numel = shape_numel(buf.shape)
            if (buf.name in names and numel is not None and buf.scope() in ("global", "")
                    and compacted.get(buf.name) == numel):
                size = numel * ((buf.dtype.bits * buf.dtype.lanes + 7) // 8)
                whole[buf.name] = (tuple(int(d) for d in buf.shape), str(buf.dtype), size)
    return whole


def scattered_rewrites(func: tirx.PrimFunc) -> tuple[int, int, int]:
    """``(stores, elements, rewrites)`` of ``func``'s scattered write-back
    (:func:`~tvm_fusion.tir_schedules.work.scattered_stores`): ``rewrites`` are the stores
    beyond one per element, each moving a cache line again."""
    stores, elements = scattered_stores(func, CACHE_LINE_BYTES)
    return stores, elements, max(stores - elements, 0)


def judge_kernel(fused: tirx.PrimFunc, parts: list[tirx.PrimFunc], flops_per_byte: float,
                 margin: float = DEFAULT_MARGIN,
                 scheduled_parts: list[tirx.PrimFunc] | None = None
                 ) -> tuple[bool, float, float, str]:
    """``(loses, fused cost, apart cost, detail)`` for a scheduled fused kernel and its parts'
    PrimFuncs (one per call, so a part called twice counts twice). ``scheduled_parts``: the
    parts as the split would schedule them, one kernel each; their own scattered write-backs
    stay after a split and are not charged to the fusion (without them: none assumed)."""
    mine = executed_work(fused)
    apart = [executed_work(p) for p in parts]
    ops_apart = sum(w.ops for w in apart) or 1
    fused_cost = mine.cost(flops_per_byte)
    # A scattered write-back (one element per cache line) stored more than once per element (a
    # K-blocked tile's partial sums) moves a line each further time. Apart, the tile stores
    # contiguously and a copy kernel changes the layout once: the split trades those extra
    # lines for the intermediate's round trip (written, read back), the rest being equal. The
    # op counts above cannot see this: a packed GEMM's micro-kernel is opaque to them. A part
    # that scatters on its own (an NCHW conv GEMM whose tile runs along the channels, K-blocked)
    # keeps doing so apart: only the rewrites beyond the parts' own count against the fusion
    # (EfficientNet-B0's 1x1 conv + SiLU at 7x7: 8 rewrites per element fused and alone).
    stores, elements, rewrites = scattered_rewrites(fused)
    kept_apart = sum(scattered_rewrites(p)[2] for p in scheduled_parts or ()) if rewrites else 0
    rewrites = max(rewrites - kept_apart, 0)
    scatter_bytes = CACHE_LINE_BYTES * rewrites
    out = getattr(fused.params[-1].ty, "dtype", "float32") if fused.params else "float32"
    round_trip = 2 * max(tvm.DataType(str(out)).bits // 8, 1) * elements
    scatter_loses = scatter_bytes > round_trip * (1.0 + margin)
    fused_cost += flops_per_byte * scatter_bytes
    apart_cost = sum(w.cost(flops_per_byte) for w in apart)
    saved = sum(w.boundary_bytes for w in apart) - mine.boundary_bytes
    detail = (f"fused does {mine.ops / ops_apart:.1f}x the arithmetic of its parts "
              f"({mine.ops:,} vs {ops_apart:,} ops), saving {max(saved, 0):,} B of "
              f"intermediate traffic; estimate {fused_cost:,.0f} vs {apart_cost:,.0f} "
              f"at {flops_per_byte:g} ops/B")
    if rewrites:
        detail += (f"; scattered write-back: {stores:,} stores of one element per "
                   f"{CACHE_LINE_BYTES}-B line into {elements:,} elements "
                   f"({stores / max(elements, 1):.1f}x each: {scatter_bytes:,} B of lines "
                   f"vs {round_trip:,} B for the intermediate apart)")
    elif kept_apart:
        detail += (f"; scattered write-back: {stores:,} stores of one element per "
                   f"{CACHE_LINE_BYTES}-B line into {elements:,} elements, as many as its "
                   f"parts apart ({kept_apart:,} rewrites): none charged to the fusion")
    recomputed = sorted(recomputed_blocks(fused), key=lambda r: -r[1])
    if recomputed:
        detail += "; recomputed: " + ", ".join(f"{name!r} {factor:.1f}x its iterations"
                                              for name, factor in recomputed[:3])
    return (fused_cost > apart_cost * (1.0 + margin) or scatter_loses, fused_cost, apart_cost,
            detail)


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.FusionGuard")
class FusionGuard:
    """``PlanFusion`` → ``FuseTIR`` → ``ScheduleFusedBlocks``, then the guard: kernels that lose
    to their parts are planned apart and the module rebuilt once (their parts are kernels of
    one operator each: no fusion is left to lose).

    Parameters
    ----------
    planner
        The :class:`~.plan_fusion.PlanFusion` (strategy ``"dnnfusion"``) whose plan is guarded.
    schedule
        The CPU schedule pass (``ScheduleFusedBlocks``); ``None`` for an unscheduled build,
        where the guard judges the fused, unscheduled loop nests.
    flops_per_byte
        The ridge at which saved bytes pay for operations (the analytic oracle's).
    margin
        How much more than its parts a kernel may be estimated to cost.
    oracle
        Optional: ``oracle.guard_times(fused, parts) -> (fused_s, apart_s) | None`` answers
        with measurements where it has them.
    split_kept
        Also split kernels that keep a whole intermediate (:class:`MemoryDecision`; option
        ``guard_kept_intermediates``, off by default).
    """

    def __init__(self, planner: PlanFusion, schedule: ScheduleFusedBlocks | None = None,
                 flops_per_byte: float = 10.0, margin: float = DEFAULT_MARGIN, oracle=None,
                 split_kept: bool = False):
        self.planner = planner
        self.schedule = schedule
        self.flops_per_byte = float(flops_per_byte)
        self.margin = float(margin)
        self.oracle = oracle
        self.split_kept = bool(split_kept)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod, module_plan = self.planner.plan(mod)
        grouped = apply_plan(mod, module_plan)
        fused = relax.transform.FuseTIR()(grouped)
        built = self._schedule(fused)
        decisions = self._judge(grouped, built)
        losing = {d.function for d in decisions}
        memory = [d for d in self._kept_whole(grouped, built)
                  if d.function not in losing] if self.split_kept else []
        if decisions or memory:
            module_plan.guard = decisions + memory
            _split(module_plan, decisions)
            _split_after(module_plan, memory)
            grouped = apply_plan(mod, module_plan)
            refused = relax.transform.FuseTIR()(grouped)
            built = self._schedule(_reuse(refused, fused, built))
        emit("plans", module_plan)
        return built

    def _schedule(self, mod: tvm.IRModule) -> tvm.IRModule:
        return mod if self.schedule is None else self.schedule(mod)

    def _judge(self, grouped: tvm.IRModule, built: tvm.IRModule) -> list[GuardDecision]:
        decisions = []
        cache: dict[str, tirx.PrimFunc] = {}
        for name, callees, fused in _fused_kernels(grouped, built):
            parts = [grouped[c] for c in callees]
            if not all(isinstance(p, tirx.PrimFunc) for p in parts):
                continue
            scheduled = (self._scheduled_parts(grouped, callees, cache)
                         if scattered_rewrites(fused)[2] else None)
            loses, mine, apart, detail = judge_kernel(fused, parts, self.flops_per_byte,
                                                      self.margin, scheduled)
            measured = self._measured(fused, parts)
            if measured is not None:
                mine, apart = measured
                loses = mine > apart * (1.0 + self.margin)
                detail = f"measured {mine * 1e3:.3f} ms fused vs {apart * 1e3:.3f} ms apart"
            if loses:
                decisions.append(GuardDecision(name, callees, mine, apart, detail))
        return decisions

    def _kept_whole(self, grouped: tvm.IRModule, built: tvm.IRModule) -> list[MemoryDecision]:
        """Kernels keeping a whole intermediate: the part that produced it, found by its
        output buffer (FuseTIR names the intermediate ``<output>_intermediate``) and shape."""
        decisions = []
        for name, callees, fused in _fused_kernels(grouped, built):
            for buffer, (shape, dtype, nbytes) in whole_kept_buffers(fused).items():
                producers = {c for c in set(callees) if _produces(grouped[c], buffer, shape,
                                                                   dtype)}
                if len(producers) == 1:
                    decisions.append(MemoryDecision(name, tuple(callees), producers.pop(), buffer,
                                                    nbytes))
                    break  # one split per kernel and round
        return decisions

    def _scheduled_parts(self, grouped: tvm.IRModule, callees, cache: dict
                         ) -> list[tirx.PrimFunc]:
        """The parts of a kernel scheduled as the split would schedule them, one kernel each
        (``cache``: by name, a part shared by several kernels is scheduled once)."""
        todo = {c: grouped[c] for c in callees if c not in cache}
        if todo:
            mod = tvm.IRModule({tvm.ir.GlobalVar(c): f for c, f in todo.items()})
            done = self._schedule(mod)
            cache.update({c: done[c] for c in todo})
        return [cache[c] for c in callees]

    def _measured(self, fused, parts):
        times = getattr(self.oracle, "guard_times", None)
        return times(fused, parts) if times is not None else None


def _fused_kernels(grouped: tvm.IRModule, built: tvm.IRModule):
    """(name, callees, fused PrimFunc) of every kernel built from two or more operators."""
    for name, callees in primitive_callees(grouped).items():
        if len(callees) < 2:
            continue
        try:
            fused = built[name]
        except (ValueError, KeyError, tvm.error.TVMError):
            continue
        if isinstance(fused, tirx.PrimFunc):
            yield name, callees, fused


def _split(module_plan: ModulePlan, decisions: list[GuardDecision]) -> None:
    """Every planned block whose operators are a losing kernel's becomes one block per
    operator; each producer → consumer pair inside it is recorded as a rejection."""
    losing = {tuple(sorted(d.operators)): d for d in decisions}
    for plan in module_plan.plans.values():
        blocks = []
        for block in plan.blocks:
            ops = tuple(sorted(plan.ecg.nodes[i].op_name for i in block.members))
            decision = losing.get(ops)
            if decision is None or len(block.members) < 2:
                blocks.append(block)
                continue
            members = set(block.members)
            for m in block.members:
                node = plan.ecg.nodes[m]
                blocks.append(type(block)([m], node.mapping_type, m))
                for s in node.succs:
                    if s in members:
                        plan.rejections.append(Rejection(
                            node.describe(), plan.ecg.nodes[s].describe(),
                            RejectReason.FUSION_LOSES, f"{decision.function}: {decision.detail}"))
        plan.blocks = blocks


def _produces(part, buffer: str, shape: tuple, dtype: str) -> bool:
    """Whether ``buffer`` of a fused kernel is ``part``'s result, by FuseTIR's naming."""
    if not isinstance(part, tirx.PrimFunc) or not part.params:
        return False
    out = part.params[-1]
    if getattr(out.ty, "shape", None) is None:
        return False
    stem = f"{out.name}_intermediate"
    named = buffer == stem or (buffer.startswith(stem + "_") and buffer[len(stem) + 1:].isdigit())
    return (named and str(out.dtype) == dtype
            and tuple(int(d) for d in out.shape) == shape)


def _split_after(module_plan: ModulePlan, decisions: list[MemoryDecision]) -> None:
    """Every planned block of a kernel that kept a whole intermediate becomes two: the
    intermediate's producer with its ancestors in the block, then the rest (edges only run
    from the first to the second, so both stay convex); each pair across is recorded."""
    kept = {tuple(sorted(d.operators)): d for d in decisions}
    for plan in module_plan.plans.values():
        blocks = []
        for block in plan.blocks:
            ops = tuple(sorted(plan.ecg.nodes[i].op_name for i in block.members))
            decision = kept.get(ops) if len(block.members) > 1 else None
            producer = None
            if decision is not None:
                found = [m for m in block.members
                         if plan.ecg.nodes[m].op_name == decision.producer]
                producer = found[0] if len(found) == 1 else None
            if producer is None:
                blocks.append(block)
                continue
            members = set(block.members)
            first, todo = {producer}, [producer]
            while todo:
                for p in plan.ecg.nodes[todo.pop()].preds:
                    if p in members and p not in first:
                        first.add(p)
                        todo.append(p)
            second = [m for m in block.members if m not in first]
            if not second:
                blocks.append(block)
                continue
            for part in ([m for m in block.members if m in first], second):
                kind = max(plan.ecg.nodes[m].mapping_type for m in part)
                blocks.append(type(block)(part, kind, part[0]))
            for m in first:
                for s in plan.ecg.nodes[m].succs:
                    if s in members and s not in first:
                        plan.rejections.append(Rejection(
                            plan.ecg.nodes[m].describe(), plan.ecg.nodes[s].describe(),
                            RejectReason.KEPT_INTERMEDIATE, decision.describe()))
        plan.blocks = blocks


def _reuse(refused: tvm.IRModule, fused: tvm.IRModule, built: tvm.IRModule) -> tvm.IRModule:
    """``refused`` with every PrimFunc the first build already scheduled, unchanged, taken
    from it: only the split kernels' operators are scheduled again."""
    updates = {}
    known = {g.name_hint for g in fused.get_global_vars()}
    for gvar, func in refused.functions.items():
        name = gvar.name_hint
        if not isinstance(func, tirx.PrimFunc) or name not in known:
            continue
        if tvm_ffi.structural_equal(func, fused[name]):
            updates[gvar] = built[name]
    return with_functions(refused, updates)


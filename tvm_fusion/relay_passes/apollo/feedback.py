"""Apollo's upward feedback: plan → FuseTIR → schedule; a failing partition is split and re-planned.

The paper (§3, §4.1) lets the fusion phase reject a micro-graph whose loop fusion fails ("a
single fusion group cannot be generated") or takes too long, and leaves the re-partition
algorithm, the timeout and the record format open (notes §3.1). Ours:

* every fused PrimFunc is scheduled by ``ScheduleFusedBlocks``' machinery, timed; it *fails*
  when the schedule fell back (``tvm_fusion.schedule_fallback``), took longer than
  ``schedule_budget_s``, or an injected ``fail_hook(name, func)`` says so (tests);
* the failing partition is split by undoing its **last merge**: that merge's canonical signature
  (rule, both boundary operators with their Apollo types, PrimFunc names and shapes) goes into a
  :class:`Blocklist`, and the module is re-planned and rebuilt (at most ``rounds`` times);
* the blocklist is handed in by the build (a :class:`Blocklist`): in memory, or beside the
  profiling database (``tvm_fusion.tuning.blocklist``, table ``apollo_blocklist``) so the next
  build of any model with the same pattern never tries the merge again: the automatic analogue
  of the developer who removed the reshape rule from Table 1;
* every event is recorded (:class:`FeedbackEvent`) on the run's :class:`ApolloModulePlan`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import tvm
from tvm import relax, tirx

from ...instrument import emit
from ...tir_schedules.cpu_target import cpu_params
from ...tir_schedules.fused_block import (
    DONE_ATTR,
    FALLBACK_ATTR,
    is_schedulable,
    schedule_primfunc,
    schedule_with_fallback,
)
from ..fusion_guard import judge_kernel
from ..grouping import primitive_callees
from ..plan_fusion import ModulePlan, apply_plan, block_ecgs
from .partition import ApolloOptions, ApolloPlan, apollo_type, plan_apollo

BLOCKLIST_MODES = ("db", "memory")


@dataclass
class FeedbackEvent:
    """One partition the fusion phase sent back."""

    round: int
    function: str  # the fused PrimFunc
    reason: str  # why its schedule was not acceptable
    seconds: float  # time its schedule took
    split: str  # the merge undone ("" when the partition was a single operator)
    parts: tuple[int, int] = (0, 0)  # operators on each side of the split

    def describe(self) -> str:
        what = f"split {self.parts[0]}+{self.parts[1]} ops at {self.split}" if self.split else (
            "single operator: kept the fallback schedule")
        return f"round {self.round}: {self.function}: {self.reason} ({self.seconds:.2f} s) → {what}"


@dataclass
class ApolloModulePlan(ModulePlan):
    feedback: list[FeedbackEvent] = field(default_factory=list)
    rounds: int = 1


class Blocklist(Protocol):
    """Merge signatures the fusion phase rejected: the planner asks, the feedback loop adds.

    The build hands one in: :class:`MemoryBlocklist`, or the profiling database's
    (``tvm_fusion.tuning.blocklist.DatabaseBlocklist``), which outlives the process."""

    def forbids(self, signature: str) -> bool: ...

    def add(self, signature: str, reason: str) -> None: ...


class MemoryBlocklist:
    """A :class:`Blocklist` for one process: signature -> reason."""

    def __init__(self, entries: dict[str, str] | None = None):
        self.entries: dict[str, str] = dict(entries or {})

    def forbids(self, signature: str) -> bool:
        return signature in self.entries

    def add(self, signature: str, reason: str) -> None:
        self.entries[signature] = reason

    def __len__(self) -> int:
        return len(self.entries)


def plan_module_apollo(mod: tvm.IRModule, options: ApolloOptions | None = None,
                       broadcast_policy: str = "expanding_only",
                       blocklist: Blocklist | None = None) -> ApolloModulePlan:
    """Apollo on every dataflow block of every non-primitive Relax function."""
    options = options or ApolloOptions()
    start = time.perf_counter()
    result = ApolloModulePlan()
    for key, ecg in block_ecgs(mod, broadcast_policy):
        types = [apollo_type(n, _primfunc(mod, n.op_name)) for n in ecg.nodes]
        result.plans[key] = plan_apollo(ecg, types, options, blocklist)
    result.seconds = time.perf_counter() - start
    return result


def _primfunc(mod: tvm.IRModule, name: str) -> tirx.PrimFunc | None:
    try:
        func = mod[mod.get_global_var(name)]
    except (ValueError, tvm.error.TVMError, KeyError):
        return None
    return func if isinstance(func, tirx.PrimFunc) else None


# -------------------------------------------------------------------------- the loop

@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.ApolloFuse")
class ApolloFuse:
    """Apollo's partitioning → FuseTIR → schedule, with feedback: stands where a DNNFusion
    build runs PlanFusion, FuseTIR and ScheduleFusedBlocks.

    Parameters
    ----------
    options
        :class:`ApolloOptions`.
    schedule
        Schedule fused functions (CPU targets); without it only ``fail_hook`` can fail one.
    fast_math
        Passed to the CPU schedules.
    schedule_budget_s
        A schedule taking longer is a failure (the paper's "reasonable time").
    rounds
        At most this many plan/build rounds (the last one keeps its fallbacks).
    blocklist
        A :class:`Blocklist` (shared across runs, perhaps persisted) or ``None`` for a fresh
        :class:`MemoryBlocklist`.
    fail_hook
        ``fail_hook(function_name, primfunc) -> bool``: deliberately fail a schedule (tests).
    guard_flops_per_byte
        The fusion guard (:mod:`..fusion_guard`): a scheduled kernel estimated slower than its
        operators apart, at this ridge, fails like a schedule and its last merge is undone;
        ``None``: no guard.

    The run's :class:`ApolloModulePlan` (last round, with every event) goes to the active
    :class:`tvm_fusion.instrument.Collector`.
    """

    def __init__(self, options: ApolloOptions | None = None, broadcast_policy="expanding_only",
                 schedule: bool = True, fast_math: bool = True, schedule_budget_s: float = 60.0,
                 rounds: int = 4, blocklist: Blocklist | None = None,
                 fail_hook: Callable | None = None, guard_flops_per_byte: float | None = None):
        self.options = options or ApolloOptions()
        self.broadcast_policy = broadcast_policy
        self.schedule = schedule
        self.fast_math = fast_math
        self.budget = float(schedule_budget_s)
        self.rounds = max(int(rounds), 1)
        self.blocklist = blocklist if blocklist is not None else MemoryBlocklist()
        self.fail_hook = fail_hook
        self.guard = guard_flops_per_byte

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current()
        cpu = self.schedule and (target is None or target.kind.name in ("llvm", "c"))
        events: list[FeedbackEvent] = []
        for round_ in range(1, self.rounds + 1):
            plan = plan_module_apollo(mod, self.options, self.broadcast_policy, self.blocklist)
            grouped = apply_plan(mod, plan)
            callees = primitive_callees(grouped)
            fused = relax.transform.FuseTIR()(grouped)
            last = round_ == self.rounds
            fused, failures = self._schedule(fused, target, cpu, final=last)
            failures += self._guard(grouped, fused, callees, failures) if cpu else []
            new = 0
            for name, reason, seconds in failures:
                for event in self._split(plan, name, callees.get(name), reason, seconds, round_):
                    events.append(event)
                    new += bool(event.split)
            if not failures or new == 0 or last:
                break
        plan.feedback = events
        plan.rounds = round_
        emit("plans", plan)
        return fused

    def _schedule(self, mod, target, cpu: bool, final: bool):
        failures = []
        params = cpu_params(target) if cpu else None
        updates = {}
        for gvar, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            name = gvar.name_hint
            if self.fail_hook is not None and self.fail_hook(name, func):
                failures.append((name, "injected schedule failure (fail_hook)", 0.0))
                if cpu and is_schedulable(func):  # what a failed schedule gets: the plain fallback
                    try:
                        out = schedule_primfunc(func, params, inline=True, tile=False,
                                                fast=self.fast_math)
                    except Exception:  # noqa: BLE001
                        out = func.with_attr(DONE_ATTR, True)
                    updates[gvar] = out.with_attr(FALLBACK_ATTR, "injected schedule failure")
                continue
            if not cpu or not is_schedulable(func):
                continue
            start = time.perf_counter()
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                out = schedule_with_fallback(gvar, func, params, self.fast_math)
            seconds = time.perf_counter() - start
            updates[gvar] = out
            if out.attrs is not None and FALLBACK_ATTR in out.attrs:
                failures.append((name, f"schedule failed: {out.attrs[FALLBACK_ATTR]}", seconds))
            elif seconds > self.budget:
                failures.append((name, f"schedule took {seconds:.1f} s > budget "
                                 f"{self.budget:g} s", seconds))
        for gvar, func in updates.items():
            mod[gvar] = func
        if final and failures:
            for name, reason, _ in failures:
                warnings.warn(f"tvm_fusion apollo: {name}: {reason}; no feedback rounds left",
                              stacklevel=2)
        return mod, failures

    def _guard(self, grouped, fused, callees, failures) -> list[tuple[str, str, float]]:
        """Kernels whose schedule the fusion guard estimates slower than their operators apart
        (those already failing aside), as failures."""
        if self.guard is None:
            return []
        failed = {name for name, _, _ in failures}
        present = _names(fused)
        found = []
        for name, ops in callees.items():
            if len(ops) < 2 or name in failed or name not in present:
                continue
            loses, _, _, detail = judge_kernel(fused[name], [grouped[o] for o in ops],
                                               self.guard)
            if loses:
                found.append((name, f"fusion loses: {detail}", 0.0))
        return found

    def _split(self, plan: ApolloModulePlan, name: str, callees, reason: str, seconds: float,
               round_: int) -> list[FeedbackEvent]:
        """Undo the last merge of every partition that compiled to ``name``."""
        if callees is None:  # not a fused function: a single operator
            return [FeedbackEvent(round_, name, reason, seconds, "")]
        events, seen = [], set()
        for block_plan in plan.plans.values():
            if not isinstance(block_plan, ApolloPlan):
                continue
            for block, trace in zip(block_plan.blocks, block_plan.traces):
                ops = tuple(sorted(block_plan.ecg.nodes[i].op_name for i in block.members))
                if ops != callees or not trace:
                    continue
                last = trace[-1]
                if last.signature in seen:
                    continue
                seen.add(last.signature)
                self.blocklist.add(last.signature, reason)
                events.append(FeedbackEvent(round_, name, reason, seconds, last.signature,
                                            (len(last.left), len(last.right))))
        return events or [FeedbackEvent(round_, name, reason, seconds, "")]


def _names(mod: tvm.IRModule) -> set[str]:
    return {g.name_hint for g, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}

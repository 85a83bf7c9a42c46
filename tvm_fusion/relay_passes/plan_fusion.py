"""``PlanFusion``: the FuseOps replacement. Plans every dataflow block, then outlines the groups.

``strategy="dnnfusion"`` runs the DNNFusion planner on each block's ECG; ``"tvm"`` runs stock
``relax.transform.FuseOps`` so both can be compared in one run. Either way the result holds
``Primitive`` functions for ``FuseTIR``. The build's third strategy, ``"apollo"``, plans, fuses
and schedules in one pass with feedback (``relay_passes.apollo.ApolloFuse``), not here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import tvm
from tvm import relax

from ..instrument import emit
from .attention import find_attention
from .ecg import FuncCache, build_ecg
from .fusion_plan import FusionBlock, FusionPlan, PlanOptions, plan_dnnfusion
from .grouping import group_bindings, is_primitive
from .mapping_type import MappingType
from .optifx import blocks_holding, choose_chains, merge_chains_into_plan
from .widening import duplicate_widening

STRATEGIES = ("dnnfusion", "tvm", "apollo")  # the build's; PlanFusion takes the first two
_PLANNERS = STRATEGIES[:2]


@dataclass
class ModulePlan:
    """The plans of every dataflow block of a module, keyed by (function name, block index)."""

    plans: dict[tuple[str, int], FusionPlan] = field(default_factory=dict)
    seconds: float = 0.0  # ECG construction plus planning, all blocks

    @property
    def num_kernels(self) -> int:
        return sum(p.num_kernels for p in self.plans.values())

    @property
    def num_operators(self) -> int:
        return sum(len(p.ecg) for p in self.plans.values())

    @property
    def anchor_bound(self) -> int:
        return sum(p.ecg.anchor_bound() for p in self.plans.values())


def weight_param_names(func: relax.Function) -> frozenset[str]:
    """Parameters after the ``num_input`` attribute hold weights (``from_onnx`` convention)."""
    if func.attrs is None or "num_input" not in func.attrs:
        return frozenset()
    num_input = int(func.attrs["num_input"])
    return frozenset(p.name for p in list(func.params)[num_input:])


def plan_module(
    mod: tvm.IRModule,
    options: PlanOptions | None = None,
    broadcast_policy: str = "expanding_only",
) -> ModulePlan:
    """Plan every dataflow block of every non-primitive Relax function of a legalized module."""
    options = options or PlanOptions()
    start = time.perf_counter()
    result = ModulePlan()
    verdicts: dict = {}  # attention candidates already matched (one per distinct layer)
    for key, ecg in block_ecgs(mod, broadcast_policy):
        decisions = (find_attention(ecg, mod, key, verdicts)
                     if getattr(options, "attention", False) else [])
        fixed = [FusionBlock(sorted(d.candidate.members), MappingType.MANY_TO_MANY,
                             d.candidate.pv, "attention") for d in decisions if d.chosen]
        plan = plan_dnnfusion(ecg, options, fixed)
        plan.attention = decisions
        mode = getattr(options, "conv_chains", "off")
        if mode != "off":  # OptiFX: profitable conv→conv chains become one block each
            plan = merge_chains_into_plan(plan, choose_chains(
                ecg, mode, mod=mod, latency=_chain_latency(plan, options.oracle)))
        result.plans[key] = plan
    result.seconds = time.perf_counter() - start
    return result


def _chain_latency(plan: FusionPlan, oracle):
    """Measured times of a conv chain from the yellow-cell oracle's profiling database (the
    planned blocks holding the chain, merged vs as planned); None without a database."""
    if not hasattr(oracle, "merge_times"):
        return None

    def latency(cand):
        groups = [list(plan.blocks[b].members) for b in blocks_holding(plan, cand)]
        return oracle.merge_times(plan.ecg, groups) if len(groups) > 1 else None

    return latency


def block_ecgs(mod: tvm.IRModule, broadcast_policy: str = "expanding_only"):
    """``((function name, block index), ECG)`` of every dataflow block of every non-primitive
    Relax function: what every planner (DNNFusion, Apollo) plans."""
    cache = FuncCache(mod)
    for gvar, func in mod.functions.items():
        if not isinstance(func, relax.Function) or is_primitive(func):
            continue
        weights = weight_param_names(func)
        for index, block in enumerate(_dataflow_blocks(func)):
            yield (gvar.name_hint, index), build_ecg(mod, block, weights, broadcast_policy, cache)


def _dataflow_blocks(func: relax.Function) -> list[relax.DataflowBlock]:
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return []
    return [b for b in body.blocks if isinstance(b, relax.DataflowBlock)]


def apply_plan(mod: tvm.IRModule, module_plan: ModulePlan) -> tvm.IRModule:
    """Outline the planned groups as ``Primitive`` functions (ready for ``FuseTIR``)."""

    def groups_for(func_name: str, block_index: int, _block) -> list[list[int]]:
        plan = module_plan.plans.get((func_name, block_index))
        if plan is None:
            return []
        return [[plan.ecg.nodes[i].binding_index for i in b.members] for b in plan.blocks]

    return group_bindings(mod, groups_for)


@tvm.transform.module_pass(opt_level=0, name="PlanFusion")
class PlanFusion:
    """Group operators into fusion blocks; run ``FuseTIR`` afterwards.

    Parameters
    ----------
    strategy
        ``"dnnfusion"`` (DNNFusion's mapping-type planner) or ``"tvm"`` (stock FuseOps).
    options
        Planner knobs (:class:`PlanOptions`); only for ``"dnnfusion"``.
    broadcast_policy
        ``"expanding_only"`` or ``"strict"``; see :mod:`.mapping_type`.

    Each run's :class:`ModulePlan` goes to the active :class:`tvm_fusion.instrument.Collector`.
    """

    def __init__(self, strategy: str = "dnnfusion", options: PlanOptions | None = None,
                 broadcast_policy: str = "expanding_only"):
        if strategy == "apollo":
            raise ValueError("PlanFusion plans 'dnnfusion' or 'tvm'; Apollo plans, fuses and "
                             "schedules in one pass: relay_passes.apollo.ApolloFuse")
        if strategy not in _PLANNERS:
            raise ValueError(f"unknown strategy {strategy!r}; expected one of {_PLANNERS}")
        self.strategy = strategy
        self.options = options or PlanOptions()
        self.broadcast_policy = broadcast_policy

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if self.strategy == "tvm":
            return relax.transform.FuseOps()(mod)
        if self.options.prefer_epilogues:  # every reader of a dequantize gets its own copy
            mod = duplicate_widening(mod)
        bind = getattr(self.options.oracle, "bind", None)
        if bind is not None:  # a profiling oracle builds candidates from this module's PrimFuncs
            bind(mod)
        module_plan = plan_module(mod, self.options, self.broadcast_policy)
        emit("plans", module_plan)
        return apply_plan(mod, module_plan)

"""The build's entry points: ``Sequential(target, **options)``, the drop-in for a TVM build, and
the whole Relax pipeline, registered as ``"tvm_fusion"``.

``Sequential`` replaces the middle of stock TVM's Relax pipeline, ``LegalizeOps → … → FuseOps →
FuseTIR``: mathematical-property rewriting, the same legalisation, SmartMem's layout-transform
elimination, mapping-type annotation, DNNFusion planning (yellow cells from the profiling
database), TVM's own ``FuseTIR`` and, on CPU targets, one loop nest per fused block. Lowering
stays TVM's::

    with target:
        mod = tvm_fusion.transform.Sequential(target)(mod)
    ex = tvm.compile(mod, target)

``tvm.compile(mod, target, relax_pipeline="tvm_fusion")`` runs the whole build: library
dispatch, the tvm_fusion graph passes, the backend's schedules (DLight on GPUs, texture scopes
and texel schedules on Adreno's texture target), then TVM's own dataflow lowering and
finalisation. The pass order is :mod:`tvm_fusion.pipeline`'s; this module checks the options and
builds what the planners are handed (the profitability oracle, Apollo's blocklist).
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from . import pipeline
from .devices import require_codegen
from .native_log import filtered_stderr
from .options import OPTIONS, Options
from .pipeline import legalize_passes
from .relay_passes.apollo.feedback import Blocklist, MemoryBlocklist
from .relay_passes.fusion_plan import AnalyticOracle, PlanOptions
from .relay_passes.fusion_table import FusionTable
from .relay_passes.mapping_type import AnnotateMappingType
from .relay_passes.plan_fusion import PlanFusion
from .symbolic import symbolic_hints
from .target import to_target, warn_if_bare_llvm
from .tir_schedules.fused_block import ScheduleFusedBlocks
from .tuning.blocklist import DatabaseBlocklist
from .tuning.database import default_path
from .tuning.oracle import make_oracle

__all__ = [
    "Sequential", "PlanFusion", "AnnotateMappingType", "ScheduleFusedBlocks", "OPTIONS",
    "PIPELINE_NAME", "get_pipeline", "legalize_passes", "make_blocklist", "make_plan_options",
]

# The pass constructors users compose (PlanFusion, AnnotateMappingType, ScheduleFusedBlocks),
# stock TVM's steps before fusion (legalize_passes, ordered in pipeline.py) and the options'
# defaults (OPTIONS, checked in tvm_fusion.options) stay importable from here.

PIPELINE_NAME = "tvm_fusion"


def make_plan_options(options: Options) -> PlanOptions:
    """The planner knobs of ``options``.

    Yellow cells go to the profiling database (``profile``), then the latency model, then the
    analytic default; entries are keyed by the schedule that timed them, so a build without
    our schedules never trusts timings of one with them.
    """
    planning, profiling = options.planning, options.profiling
    if not options.scheduling.schedule:
        schedule_id = "unscheduled"
    else:
        schedule_id = None if options.scheduling.fast_math else "fused_block-exact"
    return PlanOptions(
        table=FusionTable(planning.table3),
        oracle=make_oracle(profiling.profile, profiling.profile_db, profiling.latency_model,
                           fallback=AnalyticOracle(profiling.flops_per_byte),
                           strategy=schedule_id),
        max_ops_per_block=planning.max_ops_per_block,
        seed_policy=planning.seed_policy,
        prefer_epilogues=planning.prefer_epilogues,
        conv_chains=options.optifx.conv_chains,
        attention=planning.attention,
    )


def make_blocklist(options: Options, target: tvm.target.Target) -> Blocklist:
    """Apollo's blocklist for a build: the profiling database's for ``target``'s kind
    (``apollo_blocklist="db"``: rejected merges stay rejected in later builds) or this build's
    own (``"memory"``)."""
    if options.apollo.apollo_blocklist == "db":
        return DatabaseBlocklist(options.profiling.profile_db or default_path(),
                                 str(target.kind.name))
    return MemoryBlocklist()


def Sequential(  # noqa: N802 (named like tvm.transform.Sequential, which it stands in for)
    target: tvm.target.Target | str | dict | None = None, options: Options | None = None, *,
    apollo_fail_hook: Callable | None = None, **kwargs
) -> tvm.transform.Pass:
    """The tvm_fusion graph passes, from high-level Relax to fused PrimFuncs.

    Parameters
    ----------
    target
        The build target (a ``Target``, a tag/kind string or a dict); defaults to
        ``Target.current()`` and then ``llvm``. Library dispatch (sort/scan/sampling) follows it.
        A bare ``llvm`` on x86-64 (SSE2) warns once: name the CPU
        (:func:`tvm_fusion.target.host_target` for this machine).
    options
        The build's :class:`~tvm_fusion.options.Options` (default: the defaults).
    apollo_fail_hook
        ``fail_hook(function_name, primfunc) -> bool``, handed to ``ApolloFuse``: fails the
        schedules it picks, to exercise the feedback loop (tests).
    **kwargs
        Options by their flat names (``layout=False``, ``preset="conservative"``), over
        ``options``; see docs/options.md. An unknown option, or a value of the wrong type or
        outside the accepted set, raises ``ValueError`` naming it.

    Returns
    -------
    tvm.transform.Pass
        A pass that composes with ``tvm.transform.Sequential`` and ``PassContext``.
    """
    opts = (options or Options()).replace(**kwargs)
    plan_options = make_plan_options(opts)
    resolved = None if target is None else to_target(target)
    hints = opts.planning.symbolic_hint or {}
    if resolved is not None:
        warn_if_bare_llvm(resolved)  # once per process: "llvm" on x86-64 is SSE2

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.Sequential")
    def _sequential(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        # legalisation (LegalizeOps, FoldConstant) logs native warnings that say nothing to a
        # user, such as topi take's once per Gather: kept out, the others replayed
        with filtered_stderr():
            tgt = resolved or tvm.target.Target.current() or tvm.target.Target("llvm")
            warn_if_bare_llvm(tgt)
            apollo = opts.planning.strategy == "apollo"
            blocklist = make_blocklist(opts, tgt) if apollo else None
            graph = pipeline.graph_phase(tgt, opts, plan_options, blocklist, apollo_fail_hook)
            with tgt, symbolic_hints(hints):  # symbolic dims' sizes for every cost decision
                return graph(mod)

    return _sequential


def get_pipeline(target: tvm.target.Target | None = None, **options) -> tvm.transform.Pass:
    """The whole tvm_fusion Relax pipeline for ``target`` (default: the current target):
    :func:`Sequential`, then :func:`tvm_fusion.pipeline.build`'s schedules and lowering."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        tgt = target or tvm.target.Target.current() or tvm.target.Target("llvm")
        require_codegen(tgt)  # before any pass: not blamed on a DLight probe build later
        with tgt:
            return pipeline.build(tgt, Sequential(tgt, **options))(mod)

    return _pipeline


def register() -> None:
    """Register ``"tvm_fusion"`` with ``relax.get_pipeline`` (idempotent)."""
    if PIPELINE_NAME not in relax.pipeline.PIPELINE_MAP:
        relax.register_pipeline(PIPELINE_NAME)(get_pipeline)



register()

"""Pass constructors; ``Sequential(target, **options)`` is the drop-in for a TVM build.

It replaces the middle of stock TVM's Relax pipeline, ``LegalizeOps → … → FuseOps → FuseTIR``:
mathematical-property rewriting, the same legalisation, SmartMem's layout-transform elimination,
mapping-type annotation, DNNFusion planning (yellow cells from the profiling database), TVM's own
``FuseTIR`` and, on CPU targets, one loop nest per fused block. Lowering stays TVM's::

    with target:
        mod = tvm_fusion.transform.Sequential(target)(mod)
    ex = tvm.compile(mod, target)
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from .layout.conv_pack import PackConvs
from .layout.smartmem import EliminateLayoutTransforms
from .native_log import filtered_stderr
from .options import OPTIONS, Options
from .relay_passes.fusion_plan import AnalyticOracle, PlanOptions
from .relay_passes.fusion_table import FusionTable
from .relay_passes.mapping_type import AnnotateMappingType
from .relay_passes.plan_fusion import PlanFusion
from .relay_passes.rewrite.math_properties import RewriteByMathProperties
from .symbolic import symbolic_hints
from .target import warn_if_bare_llvm
from .tir_schedules.fused_block import ScheduleFusedBlocks

__all__ = [
    "Sequential", "PlanFusion", "AnnotateMappingType", "ScheduleFusedBlocks", "OPTIONS",
    "legalize_passes", "make_plan_options",
]

# The options (names, types, accepted values, defaults) and their checking live in
# tvm_fusion.options; OPTIONS (name -> default) stays importable from here.


def make_plan_options(options: Options) -> PlanOptions:
    """The planner knobs of ``options``.

    Yellow cells go to the profiling database (``profile``), then the latency model, then the
    analytic default; entries are keyed by the schedule that timed them, so a build without
    our schedules never trusts timings of one with them.
    """
    from .tuning.oracle import make_oracle

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
    )


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
    resolved = _resolve_target(target)
    strategy = opts.planning.strategy
    hints = opts.planning.symbolic_hint or {}
    if resolved is not None:
        warn_if_bare_llvm(resolved)  # once per process: "llvm" on x86-64 is SSE2

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.Sequential")
    def _sequential(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        # legalisation (LegalizeOps, FoldConstant) logs native warnings that say nothing to a
        # user, such as topi take's once per Gather: kept out, the others replayed
        with filtered_stderr():
            return _passes(mod)

    def _passes(mod: tvm.IRModule) -> tvm.IRModule:
        tgt = resolved or tvm.target.Target.current() or tvm.target.Target("llvm")
        warn_if_bare_llvm(tgt)
        ours = strategy != "tvm"  # "tvm" is stock TVM's graph passes, kept pure
        rewriting, smartmem = opts.rewriting, opts.smartmem
        passes = []
        if ours and rewriting.rewrite:
            passes.append(RewriteByMathProperties(rewriting.rewrite_rules,
                                                  rewriting.allow_fp_reassociation))
        if strategy == "dnnfusion":  # §6 inter-block layout: packed convs on CPU
            # OptiFX's templates take NCHW region ops: with conv_chains on, "auto" keeps NCHW
            layout = smartmem.conv_layout
            if layout == "auto" and opts.optifx.conv_chains != "off":
                layout = "NCHW"
            passes.append(PackConvs(tgt, layout))
        passes += legalize_passes(tgt)
        if ours and smartmem.layout:
            passes.append(EliminateLayoutTransforms(tgt, smartmem.layout_policy,
                                                    smartmem.layout_copies,
                                                    smartmem.fuse_epilogues))
        passes.append(AnnotateMappingType(opts.planning.broadcast_policy))
        # ---- Apollo: plan → FuseTIR → schedule with feedback, in one pass (apollo_feedback.py)
        if strategy == "apollo":
            passes.append(_apollo_pass(opts, tgt, apollo_fail_hook))
            with tgt, symbolic_hints(hints):
                return tvm.transform.Sequential(passes)(mod)
        # ---- end Apollo
        passes += [
            PlanFusion(strategy, plan_options, opts.planning.broadcast_policy),
            relax.transform.FuseTIR(),
        ]
        if opts.scheduling.schedule and tgt.kind.name == "llvm":
            passes.append(ScheduleFusedBlocks(tgt, fast_math=opts.scheduling.fast_math))
        with tgt, symbolic_hints(hints):  # symbolic dims' sizes for every cost decision
            return tvm.transform.Sequential(passes)(mod)

    return _sequential


def _apollo_pass(opts: Options, target: tvm.target.Target,
                 fail_hook: Callable | None) -> tvm.transform.Pass:
    """Apollo's PlanFusion + FuseTIR + ScheduleFusedBlocks with the feedback loop."""
    from .relay_passes.apollo.feedback import ApolloFuse, Blocklist
    from .relay_passes.apollo.partition import ApolloOptions
    from .tuning.database import default_path

    apollo, scheduling = opts.apollo, opts.scheduling
    blocklist = Blocklist(opts.profiling.profile_db or default_path(), str(target.kind.name),
                          persist=apollo.apollo_blocklist == "db")
    options = ApolloOptions(rules=apollo.apollo_rules, layers=apollo.apollo_layers,
                            max_branches=apollo.apollo_max_branches,
                            stitch_bytes=apollo.apollo_stitch_bytes)
    return ApolloFuse(options, opts.planning.broadcast_policy, schedule=scheduling.schedule,
                      fast_math=scheduling.fast_math,
                      schedule_budget_s=apollo.apollo_schedule_budget_s,
                      rounds=apollo.apollo_feedback_rounds, blocklist=blocklist,
                      fail_hook=fail_hook)


def legalize_passes(target: tvm.target.Target) -> list:
    """Stock TVM's steps before fusion: library dispatch (sort/scan lowered to TIR for the
    target), inference-mode decomposition (batch norm becomes scale and shift), legalisation,
    TVM's op patterns (read by the ``"tvm"`` strategy), constant folding and binding clean-up."""
    return relax.pipeline.library_dispatch_passes(target) + [
        relax.transform.DecomposeOpsForInference(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.CanonicalizeBindings(),  # tuple-then-get-item (from decompositions)
        relax.transform.DeadCodeElimination(),
    ]


def _resolve_target(target) -> tvm.target.Target | None:
    if target is None or isinstance(target, tvm.target.Target):
        return target
    try:
        return tvm.target.Target(target)
    except Exception as err:  # TVM's message is long; keep the cause, name the option
        raise ValueError(f"invalid target {target!r}: {str(err).splitlines()[0]}") from None

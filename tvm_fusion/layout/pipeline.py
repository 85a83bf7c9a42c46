"""Where the layout passes sit in a build, for CPU and for Adreno OpenCL (textures or not).

``EliminateLayoutTransforms`` runs on legalized Relax, before planning; texture scopes and GPU
schedules after ``FuseTIR``; the TIR pipeline that lowers textures correctly at the end::

    legalize_passes(tgt) → EliminateLayoutTransforms → AnnotateMappingType → PlanFusion
        → FuseTIR → [CPU: ScheduleFusedBlocks] [OpenCL: AnnotateTextureScopes,
        ScheduleTextureKernels] → TVM's dataflow lowering → tir_pipeline="tvm_fusion_adreno"

:func:`graph_passes` is ``tvm_fusion.transform.Sequential(layout=...)``; given one of SmartMem's
options explicitly it assembles the elimination and the planner alone, for SmartMem's
measurements (:mod:`.measure`).
"""

from __future__ import annotations

import importlib

import tvm
from tvm import relax

from ..options import Options
from .smartmem import EliminateLayoutTransforms
from .texture import AnnotateTextureScopes, ScheduleTextureKernels
from .texture_lower import OUR_PIPELINE, register_tir_pipelines

# SmartMem's options: given explicitly, graph_passes assembles the passes itself (below)
_SMARTMEM_OPTIONS = ("layout_policy", "layout_copies", "fuse_epilogues")


def _target(target) -> tvm.target.Target:
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, str) and target.startswith("qcom/"):
        importlib.import_module("tvm.backend.adreno")  # registers the qcom/* tags
    return tvm.target.Target(target)


def is_opencl(target: tvm.target.Target) -> bool:
    return target.kind.name == "opencl"


def graph_passes(target, layout: bool = True, fuse: bool = True, **options) -> tvm.transform.Pass:
    """The tvm_fusion graph passes with SmartMem's elimination (``layout=True``) or without.

    ``fuse=False`` stops after legalisation (and elimination): one kernel per operator, for
    kernel-level tests. ``options`` are tvm_fusion's options by flat name (docs/options.md);
    with one of SmartMem's (``layout_policy``, ``layout_copies``, ``fuse_epilogues``) given, the
    elimination runs before the planner alone (no rewriting, no conv packing, under
    ``strategy="tvm"`` too), the way SmartMem's measurements compare it.
    """
    from .. import transform

    tgt = _target(target)
    opts = Options.from_kwargs(**options)
    smartmem = opts.smartmem
    eliminate = EliminateLayoutTransforms(tgt, smartmem.layout_policy, smartmem.layout_copies,
                                          smartmem.fuse_epilogues)
    if fuse and not any(k in options for k in _SMARTMEM_OPTIONS):
        return transform.Sequential(tgt, opts, layout=layout)

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.layout.GraphPasses")
    def _passes(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        passes = transform.legalize_passes(tgt) + ([eliminate] if layout else [])
        if fuse:
            plan = transform.make_plan_options(Options.from_kwargs(**{
                k: v for k, v in opts.to_kwargs().items()
                if k in ("strategy", "broadcast_policy", "seed_policy", "max_ops_per_block",
                         "table3", "flops_per_byte")}))
            broadcast = opts.planning.broadcast_policy
            passes += [transform.AnnotateMappingType(broadcast),
                       transform.PlanFusion(opts.planning.strategy, plan, broadcast),
                       relax.transform.FuseTIR()]
            if opts.scheduling.schedule and tgt.kind.name == "llvm":
                passes.append(transform.ScheduleFusedBlocks(
                    tgt, fast_math=opts.scheduling.fast_math))
        with tgt:
            return tvm.transform.Sequential(passes)(mod)

    return _passes


def opencl_passes(target) -> list:
    """After ``FuseTIR`` on an OpenCL target: texture scopes (with the ``texture`` key) and
    the texel-per-thread schedules."""
    tgt = _target(target)
    return [AnnotateTextureScopes(tgt), ScheduleTextureKernels()]


def opencl_module(mod: tvm.IRModule, target, layout: bool = True, fuse: bool = True,
                  **options) -> tvm.IRModule:
    """The Relax module our OpenCL build would lower, after every tvm_fusion pass: what
    :class:`.opencl_runner.OpenCLRunner` runs on PoCL."""
    tgt = _target(target)
    passes = [graph_passes(tgt, layout, fuse, **options)] + opencl_passes(tgt)
    with tgt:
        return tvm.transform.Sequential(passes)(mod)


def compile_opencl(mod: tvm.IRModule, target, layout: bool = True, **options):
    """``tvm.compile`` for an Adreno OpenCL target with our passes and TIR lowering (a VM
    executable whose OpenCL source ``inspect_source`` shows; the wheel cannot run it)."""
    from tvm.relax.backend.gpu_generic import pipeline as backend

    register_tir_pipelines()
    tgt = _target(target)
    if tgt.host is None:
        tgt = tvm.target.Target(tgt, host="llvm")

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.layout.OpenCLPipeline")
    def _pipeline(m: tvm.IRModule, _ctx) -> tvm.IRModule:
        passes = ([graph_passes(tgt, layout, True, **options)] + opencl_passes(tgt)
                  + backend.dataflow_lower_passes(tgt) + backend.finalize_passes(tgt))
        with tgt:
            return tvm.transform.Sequential(passes)(m)

    return tvm.compile(mod, tgt, relax_pipeline=_pipeline, tir_pipeline=OUR_PIPELINE)

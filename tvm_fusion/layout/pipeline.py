"""SmartMem's and Adreno's entry points: the graph passes with or without the elimination, the
Relax module an OpenCL build lowers, and the OpenCL build itself.

Thin wrappers over the build (:mod:`tvm_fusion.transform`); the pass order is
:mod:`tvm_fusion.pipeline`'s::

    legalize_passes(tgt) → EliminateLayoutTransforms → AnnotateMappingType → PlanFusion
        → FuseTIR → [CPU: ScheduleFusedBlocks] [OpenCL: AnnotateTextureScopes,
        ScheduleTextureKernels] → TVM's dataflow lowering → [Adreno: LowerTextures]

``compile_opencl`` on ``qcom/adreno-opencl-texture`` is
``tvm.compile(mod, target, relax_pipeline="tvm_fusion")`` (the registered pipeline's Adreno
backend); it keeps that backend on an Adreno target without textures too.
"""

from __future__ import annotations

import tvm

from .. import pipeline, transform
from ..options import Options
from ..target import to_target
from .smartmem import EliminateLayoutTransforms

# SmartMem's options: given explicitly, graph_passes takes SmartMem's own path (below)
_SMARTMEM_OPTIONS = ("layout_policy", "layout_copies", "fuse_epilogues")
# the planner's knobs SmartMem's own path honours (the others keep their defaults)
_PLAN_KEYS = ("strategy", "broadcast_policy", "seed_policy", "max_ops_per_block", "table3",
              "flops_per_byte")



def graph_passes(target, layout: bool = True, fuse: bool = True, **options) -> tvm.transform.Pass:
    """The tvm_fusion graph passes with SmartMem's elimination (``layout=True``) or without.

    ``fuse=False`` stops after legalisation (and elimination): one kernel per operator, for
    kernel-level tests. ``options`` are tvm_fusion's options by flat name (docs/options.md);
    with one of SmartMem's (``layout_policy``, ``layout_copies``, ``fuse_epilogues``) given, or
    ``fuse=False``, the elimination runs right after legalisation and before the planner alone
    (no rewriting, no conv packing, under ``strategy="tvm"`` too), the way SmartMem's
    measurements compare it (:func:`tvm_fusion.pipeline.smartmem_phase`).
    """
    tgt = to_target(target)
    opts = Options.from_kwargs(**options)
    if fuse and not any(k in options for k in _SMARTMEM_OPTIONS):
        return transform.Sequential(tgt, opts, layout=layout)
    smartmem = opts.smartmem
    eliminate = EliminateLayoutTransforms(tgt, smartmem.layout_policy, smartmem.layout_copies,
                                          smartmem.fuse_epilogues) if layout else None

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.layout.GraphPasses")
    def _passes(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        plan = blocklist = None
        if fuse:
            plan = transform.make_plan_options(Options.from_kwargs(**{
                k: v for k, v in opts.to_kwargs().items() if k in _PLAN_KEYS}))
            if opts.planning.strategy == "apollo":
                blocklist = transform.make_blocklist(opts, tgt)
        with tgt:
            return pipeline.smartmem_phase(tgt, eliminate, opts if fuse else None, plan,
                                           blocklist)(mod)

    return _passes


def opencl_module(mod: tvm.IRModule, target, layout: bool = True, fuse: bool = True,
                  **options) -> tvm.IRModule:
    """The Relax module our OpenCL build would lower, after every tvm_fusion pass: what
    :class:`.opencl_runner.OpenCLRunner` runs on PoCL."""
    tgt = to_target(target)
    graph = graph_passes(tgt, layout, fuse, **options)
    with tgt:
        return pipeline.build(tgt, graph, "adreno", lower=False)(mod)


def compile_opencl(mod: tvm.IRModule, target, layout: bool = True, **options):
    """``tvm.compile`` for an Adreno OpenCL target with our passes and TIR lowering (a VM
    executable whose OpenCL source ``inspect_source`` shows; the wheel cannot run it)."""
    tgt = to_target(target)
    if tgt.host is None:
        tgt = tvm.target.Target(tgt, host="llvm")

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.layout.OpenCLPipeline")
    def _pipeline(m: tvm.IRModule, _ctx) -> tvm.IRModule:
        with tgt:
            return pipeline.build(tgt, graph_passes(tgt, layout, True, **options), "adreno")(m)

    return tvm.compile(mod, tgt, relax_pipeline=_pipeline)

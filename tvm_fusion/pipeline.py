"""The order of the passes: every pass list of a tvm_fusion build is assembled here, and only here.

A build runs four phases; each function below returns one of them for a target::

    graph      graph_phase      rewriting → Gather index clamping → [CPU: fp16 sums in
                                fp32 → GEMM weight packing] → conv packing →
                                TVM's legalisation → SmartMem's
                                elimination → mapping types → planning (DNNFusion, Apollo
                                or stock FuseOps) → FuseTIR →
                                [CPU: ScheduleFusedBlocks → DNNFusion: the fusion guard]
    schedule   schedule_passes  CPU: nothing more; GPU: OptiFX's template, else DLight;
                                Adreno: texture scopes, texel-per-thread schedules
    lowering   lowering         TVM's own dataflow lowering and finalisation for the target
    textures   (in build)       Adreno: the texture part of the TIR lowering, so that
                                ``tvm.compile``'s default TIR pipeline emits image2d code

:func:`build` puts the phases after a graph phase together; :func:`smartmem_phase` is the graph
phase SmartMem's measurements use (its elimination alone).

The backends (:func:`backend_of`): ``"cpu"`` (``llvm``, ``c``), ``"gpu"`` (CUDA, Vulkan,
generic OpenCL...: DLight) and ``"adreno"`` (OpenCL with the ``texture`` key,
``qcom/adreno-opencl-texture``). The passes come configured by the layer above
(``tvm_fusion.transform``): it checks the options and builds the objects the planners ask (the
profitability oracle in ``plan_options``, Apollo's blocklist), so nothing here reads a database.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu_backend
from tvm.relax.backend.cuda import pipeline as cuda_backend
from tvm.relax.backend.gpu_generic import pipeline as gpu_backend

from .layout.conv_pack import PackConvs
from .layout.gemm_pack import PackMatmulWeights
from .layout.int8_conv import IntegerQdqConvs
from .layout.smartmem import EliminateLayoutTransforms
from .layout.texture import AnnotateTextureScopes, ScheduleTextureKernels, wants_texture
from .layout.texture_lower import LowerTextures
from .options import Options
from .relay_passes.accumulate import AccumulateInFloat32, widened_legalizations
from .relay_passes.apollo.feedback import ApolloFuse, Blocklist
from .relay_passes.apollo.partition import ApolloOptions
from .relay_passes.batch_views import UnflattenBatchMatmul
from .relay_passes.compound_extents import BindCompoundExtents
from .relay_passes.fusion_guard import FusionGuard
from .relay_passes.fusion_plan import PlanOptions
from .relay_passes.index_masks import RecomputeIndexMasks
from .relay_passes.legalize_repairs import LegalizeNonFiniteFull
from .relay_passes.mapping_type import AnnotateMappingType
from .relay_passes.plan_fusion import PlanFusion
from .relay_passes.repack_storage import RepackStorage
from .relay_passes.rewrite.math_properties import RewriteByMathProperties
from .relay_passes.safe_softmax import FoldSafeSoftmax
from .relay_passes.take_bounds import ClampTakeIndices
from .tir_schedules.fused_block import ScheduleFusedBlocks
from .tir_schedules.gpu import apply_gpu_schedules
from .tir_schedules.noalias import MarkSingleBufferNoAlias

__all__ = ["BACKENDS", "apply_gpu_schedules", "backend_of", "build", "graph_phase",
           "legalize_passes", "lowering", "schedule_passes", "smartmem_phase"]

BACKENDS = ("cpu", "gpu", "adreno")


def backend_of(target: tvm.target.Target) -> str:
    """Which of :data:`BACKENDS` builds for ``target``."""
    if target.kind.name == "opencl" and wants_texture(target):
        return "adreno"
    return "gpu" if "gpu" in target.keys else "cpu"


# ------------------------------------------------------------------------------ graph phase

def legalize_passes(target: tvm.target.Target) -> list:
    """Stock TVM's steps before fusion: library dispatch (sort/scan lowered to TIR for the
    target), inference-mode decomposition (batch norm becomes scale and shift), legalisation
    (on a CPU without fp16 arithmetic, fp16 reductions summed in float32:
    ``relay_passes/accumulate.py``), TVM's op patterns (read by the ``"tvm"`` strategy),
    constant folding and binding clean-up."""
    return relax.pipeline.library_dispatch_passes(target) + [
        relax.transform.DecomposeOpsForInference(),
        relax.transform.LegalizeOps(widened_legalizations(target) or None),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.CanonicalizeBindings(),  # tuple-then-get-item (from decompositions)
        relax.transform.DeadCodeElimination(),
    ]


def graph_phase(target: tvm.target.Target, opts: Options, plan_options: PlanOptions,
                blocklist: Blocklist | None = None,
                apollo_fail_hook: Callable | None = None) -> tvm.transform.Pass:
    """``transform.Sequential``'s passes, from high-level Relax to fused PrimFuncs; the caller
    runs them under the target and the symbolic hints.

    ``plan_options`` holds the planner's knobs and profitability oracle; ``blocklist`` and
    ``apollo_fail_hook`` are Apollo's (strategy ``"apollo"``)."""
    strategy, rewriting, smartmem = opts.planning.strategy, opts.rewriting, opts.smartmem
    ours = strategy != "tvm"  # "tvm" is stock TVM's graph passes, kept pure
    # TVM's legalisation of full(-inf) raises (its FoldConstant's too): every strategy
    passes = [LegalizeNonFiniteFull()]
    if ours:  # torch.export's attention: bmm over batch·heads, safe softmax (nine operators)
        passes += [UnflattenBatchMatmul(), FoldSafeSoftmax()]
    pack = opts.scheduling.pack_weights and target.kind.name == "llvm"
    if pack and ours and opts.scheduling.integer_qdq_convs:
        # before anything folds a QDQ conv's weight dequantize into float32
        passes.append(IntegerQdqConvs(target))
    if pack and ours and rewriting.rewrite:
        # weight-only quantized weights first: the rewriting's FoldConstant would fold their
        # dequantize into float32 weights (four times the bytes, layout/weight_quant.py)
        passes.append(PackMatmulWeights(target, quantized_only=True))
    if ours and rewriting.rewrite:
        passes.append(RewriteByMathProperties(rewriting.rewrite_rules,
                                              rewriting.allow_fp_reassociation))
    if ours:  # Gather indices from the inputs: clamped, never read outside the data
        passes.append(ClampTakeIndices())
    # fp16/bf16 convs and matmuls sum in float32 where the CPU has no 16-bit arithmetic (the
    # pass leaves other targets alone): every strategy ("tvm" included, like the packing), so
    # that a kernel is the same whatever the grouping; after the rewriting (its algebra is the
    # model's, in the model's types), before the packing, which takes the float32 sums
    passes.append(AccumulateInFloat32(target))
    if pack:
        # every strategy our CPU schedules run for ("tvm" included: the baseline of every
        # benchmark), so that a GEMM is the same kernel whatever the grouping; before the
        # conv packing, whose legalisation of the packed convs legalises every other op too
        # dense NCHW convs with constant weights become the same packed GEMM (im2col panels)
        # under conv_layout "auto"; "NCHWc"/"NCHW" keep them convs (packed / direct), and so
        # do OptiFX's conv chains, whose templates take the convs as convs, and Apollo, which
        # plans (and classifies) the graph as imported
        convs = (opts.smartmem.conv_layout == "auto" and opts.optifx.conv_chains == "off"
                 and strategy != "apollo")
        passes.append(PackMatmulWeights(target, convs=convs))
    if strategy == "dnnfusion":  # §6 inter-block layout: packed convs on CPU
        # OptiFX's templates take NCHW region ops: with conv_chains on, "auto" keeps NCHW
        layout = smartmem.conv_layout
        if layout == "auto" and opts.optifx.conv_chains != "off":
            layout = "NCHW"
        passes.append(PackConvs(target, layout))
    if ours:  # `past + 1` extents (a decode step's cache) named by variables of their own
        passes.append(BindCompoundExtents())
    passes += legalize_passes(target)
    if ours:  # again: CanonicalizeBindings folded the names into `past + 1` in Relax's types
        passes.append(BindCompoundExtents())
    if strategy == "dnnfusion" and opts.planning.attention:
        # a mask computed from indices once for every layer: a copy per reader, which each
        # attention block takes in and reads as an index expression (skipping masked tiles)
        passes.append(RecomputeIndexMasks())
    if ours and smartmem.layout:
        passes.append(EliminateLayoutTransforms(target, smartmem.layout_policy,
                                                smartmem.layout_copies, smartmem.fuse_epilogues))
    passes.append(AnnotateMappingType(opts.planning.broadcast_policy))
    passes += _fusion_passes(target, opts, plan_options, blocklist, apollo_fail_hook)
    return tvm.transform.Sequential(passes, name="tvm_fusion.graph")


def smartmem_phase(target: tvm.target.Target, eliminate: tvm.transform.Pass | None,
                   opts: Options | None = None, plan_options: PlanOptions | None = None,
                   blocklist: Blocklist | None = None) -> tvm.transform.Pass:
    """SmartMem's elimination (``eliminate``, or none) right after legalisation, then planning
    when ``opts`` are given: no rewriting and no conv packing, and the elimination under any
    strategy, so that SmartMem's measurements see its effect alone. Without ``opts`` it stops
    after the elimination: one kernel per operator, for kernel-level tests."""
    passes = legalize_passes(target) + ([eliminate] if eliminate is not None else [])
    if opts is not None:
        passes.append(AnnotateMappingType(opts.planning.broadcast_policy))
        passes += _fusion_passes(target, opts, plan_options, blocklist)
    return tvm.transform.Sequential(passes, name="tvm_fusion.smartmem_graph")


def _fusion_passes(target: tvm.target.Target, opts: Options, plan_options: PlanOptions | None,
                   blocklist: Blocklist | None, apollo_fail_hook: Callable | None = None
                   ) -> list:
    """Planning, FuseTIR and the CPU schedules; Apollo does all three in one pass, with its
    fusion phase's feedback (relay_passes/apollo/feedback.py)."""
    broadcast, scheduling = opts.planning.broadcast_policy, opts.scheduling
    if opts.planning.strategy == "apollo":
        apollo = opts.apollo
        options = ApolloOptions(rules=apollo.apollo_rules, layers=apollo.apollo_layers,
                                max_branches=apollo.apollo_max_branches,
                                stitch_bytes=apollo.apollo_stitch_bytes)
        return [ApolloFuse(options, broadcast, schedule=scheduling.schedule,
                           fast_math=scheduling.fast_math,
                           schedule_budget_s=apollo.apollo_schedule_budget_s,
                           rounds=apollo.apollo_feedback_rounds, blocklist=blocklist,
                           fail_hook=apollo_fail_hook,
                           guard_flops_per_byte=(opts.profiling.flops_per_byte
                                                 if scheduling.fusion_guard else None))]
    planner = PlanFusion(opts.planning.strategy, plan_options, broadcast)
    schedule = (ScheduleFusedBlocks(target, fast_math=scheduling.fast_math)
                if scheduling.schedule and target.kind.name == "llvm" else None)
    if schedule is not None and scheduling.fusion_guard and opts.planning.strategy == "dnnfusion":
        # the guard plans, fuses and schedules, then splits the kernels that lose
        return [FusionGuard(planner, schedule, flops_per_byte=opts.profiling.flops_per_byte,
                            oracle=getattr(plan_options, "oracle", None),
                            split_kept=scheduling.guard_kept_intermediates)]
    return [planner, relax.transform.FuseTIR()] + ([schedule] if schedule is not None else [])


# ----------------------------------------------------------------- schedules and lowering

def schedule_passes(target: tvm.target.Target, backend: str | None = None) -> list:
    """The backend's schedules after the graph phase (CPU schedules run inside it). Adreno:
    texture scopes (where the target has the ``texture`` key) and the texel-per-thread
    schedules."""
    backend = backend or backend_of(target)
    if backend == "adreno":
        return [AnnotateTextureScopes(target), ScheduleTextureKernels()]
    return [apply_gpu_schedules] if backend == "gpu" else []


def _tvm_backend(target: tvm.target.Target):
    """TVM's backend module for a target (``cpu_generic`` is imported directly: 0.27's
    ``relax.pipeline.dataflow_lower_passes(llvm)`` is broken)."""
    if target.kind.name == "cuda":
        return cuda_backend
    return gpu_backend if "gpu" in target.keys else cpu_backend


def _lowering_passes(target: tvm.target.Target) -> list:
    """TVM's lowering, with the storage tokens of ``StaticPlanBlockMemory`` re-packed where
    that takes fewer bytes (``relay_passes/repack_storage.py``), then ``tirx.noalias`` on the
    VM's shape functions: without it TVM 0.27's LLVM codegen can emit every kernel of a
    symbolic-shape module as possibly aliased (``tir_schedules/noalias.py``)."""
    backend = _tvm_backend(target)
    return (backend.dataflow_lower_passes(target)
            + _after_memory_plan(backend.finalize_passes(target), RepackStorage())
            + [MarkSingleBufferNoAlias()])


def _after_memory_plan(passes: list, extra: tvm.transform.Pass) -> list:
    """``passes`` with ``extra`` right after TVM's ``StaticPlanBlockMemory``."""
    out = []
    for p in passes:
        out.append(p)
        if p.info.name == "StaticPlanBlockMemory":
            out.append(extra)
    return out


def lowering(target: tvm.target.Target) -> tvm.transform.Pass:
    """TVM's own dataflow lowering and finalisation for ``target``, as one pass: what follows
    the schedules in a build, and what measurement and tuning lower scheduled modules with."""
    return tvm.transform.Sequential(_lowering_passes(target), name="tvm_fusion.lowering")


def build(target: tvm.target.Target, graph: tvm.transform.Pass, backend: str | None = None,
          schedule: list | None = None, lower: bool = True) -> tvm.transform.Pass:
    """A whole Relax build from ``graph`` on: the backend's schedules (``schedule`` replaces
    them), TVM's lowering and, for Adreno, the texture part of the TIR lowering; ``lower=False``
    stops before lowering (the module the build would lower). Run it under ``target``."""
    backend = backend or backend_of(target)
    if schedule is None:
        schedule = schedule_passes(target, backend)
    passes = [graph, *schedule]
    if lower:
        passes += _lowering_passes(target)
        if backend == "adreno":
            passes.append(LowerTextures())
    return tvm.transform.Sequential(passes, name="tvm_fusion.build")


def memory_planning(target: tvm.target.Target, repack: bool = True) -> tvm.transform.Pass:
    """TVM's lowering of a fused module up to and including ``StaticPlanBlockMemory`` and, as a
    tvm_fusion build does (``repack``), the re-packing of its tokens: where the storage its
    activations will take is decided (``tvm_fusion.memory`` reads it). ``repack=False`` is
    TVM's own plan, as its default pipeline builds it."""
    backend = _tvm_backend(target)
    plan = [relax.transform.StaticPlanBlockMemory()] + ([RepackStorage()] if repack else [])
    return tvm.transform.Sequential(backend.dataflow_lower_passes(target) + plan,
                                    name="tvm_fusion.memory_planning")

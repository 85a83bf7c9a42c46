"""Whole Relax pipelines with tvm_fusion in place of FuseOps, registered as ``"tvm_fusion"``.

``tvm.compile(mod, target, relax_pipeline="tvm_fusion")`` runs library dispatch, the
tvm_fusion graph passes, the target's default TIR schedules where stock TVM has them (DLight on
GPUs), then TVM's own dataflow lowering and finalisation.
"""

from __future__ import annotations

import warnings

import tvm
from tvm import relax

from .devices import require_codegen
from .transform import Sequential

PIPELINE_NAME = "tvm_fusion"


def backend_pipeline(target: tvm.target.Target):
    """TVM's backend module for a target (``cpu_generic`` is imported directly: 0.27's
    ``relax.pipeline.dataflow_lower_passes(llvm)`` is broken)."""
    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline as backend
    elif "gpu" in target.keys:
        from tvm.relax.backend.gpu_generic import pipeline as backend
    else:
        from tvm.relax.backend.cpu_generic import pipeline as backend
    return backend


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.ApplyGPUSchedules")
def apply_gpu_schedules(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """GPU schedules of every fused PrimFunc, one function at a time: a fused conv chain
    (OptiFX) gets the overlapped-tile template, checked by ``verify_gpu_code``; everything
    else stock DLight rules.

    DLight's rules were written for FuseOps' groups; on a larger DNNFusion block a rule can fail
    (0.27's GEMV ``normalize`` asserts) or produce TIR that does not lower. Such a function is
    retried with fewer rules and a warning names it, rather than failing the whole build.
    """
    from tvm.s_tir import dlight as dl

    from .tir_schedules.fused_block import probe_build
    from .tir_schedules.optifx import try_schedule_conv_chain_gpu

    rule_sets = [
        [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
         dl.gpu.Fallback()],
        [dl.gpu.Matmul(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()],
        [dl.gpu.GeneralReduction(), dl.gpu.Fallback()],
        [dl.gpu.Fallback()],
    ]
    mod = mod.clone()  # a pass leaves the module it was given as it was
    for gvar, func in list(mod.functions.items()):
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        chain = try_schedule_conv_chain_gpu(gvar, func, tvm.target.Target.current())
        if chain is not None:
            try:
                mod[gvar] = probe_build(chain)
                continue
            except Exception:  # noqa: BLE001 (any lowering failure: DLight takes it)
                pass
        for attempt, rules in enumerate(rule_sets):
            try:  # a fresh module each time: passes may rewrite a uniquely owned one in place
                scheduled = dl.ApplyDefaultSchedule(*rules)(tvm.IRModule({gvar: func}))
                # Some schedules only fail when lowered (0.27's Matmul rule on a conv with a
                # prologue leaves a buffer used before its definition): lower to be sure.
                mod[gvar] = probe_build(scheduled[gvar])
                break
            except Exception as err:  # noqa: BLE001 (DLight raises bare AssertionErrors)
                if attempt == len(rule_sets) - 1:
                    raise ValueError(f"no DLight rule schedules {gvar.name_hint}: {err}") from None
                warnings.warn(f"DLight rule failed on {gvar.name_hint} "
                              f"({type(err).__name__}); retrying with fewer rules", stacklevel=1)
    return mod


def get_pipeline(target: tvm.target.Target | None = None, **options) -> tvm.transform.Pass:
    """The full tvm_fusion Relax pipeline for ``target`` (default: the current target)."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        tgt = target or tvm.target.Target.current() or tvm.target.Target("llvm")
        require_codegen(tgt)  # before any pass: not blamed on a DLight probe build later
        backend = backend_pipeline(tgt)
        passes = [Sequential(tgt, **options)]
        if "gpu" in tgt.keys:
            passes.append(apply_gpu_schedules)
        passes += backend.dataflow_lower_passes(tgt) + backend.finalize_passes(tgt)
        with tgt:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def register() -> None:
    """Register ``"tvm_fusion"`` with ``relax.get_pipeline`` (idempotent)."""
    if PIPELINE_NAME not in relax.pipeline.PIPELINE_MAP:
        relax.register_pipeline(PIPELINE_NAME)(get_pipeline)


register()

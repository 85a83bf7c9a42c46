"""Whole Relax pipelines with tvm_fusion in place of FuseOps, registered as ``"tvm_fusion"``.

``tvm.compile(mod, target, relax_pipeline="tvm_fusion")`` runs library dispatch, the
tvm_fusion graph passes, the target's default TIR schedules where stock TVM has them (DLight on
GPUs), then TVM's own dataflow lowering and finalisation.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .transform import Sequential

PIPELINE_NAME = "tvm_fusion"


def _backend(target: tvm.target.Target):
    """TVM's backend module for a target (``cpu_generic`` is imported directly: 0.27's
    ``relax.pipeline.dataflow_lower_passes(llvm)`` is broken)."""
    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline as backend
    elif "gpu" in target.keys:
        from tvm.relax.backend.gpu_generic import pipeline as backend
    else:
        from tvm.relax.backend.cpu_generic import pipeline as backend
    return backend


def _gpu_schedules() -> list:
    from tvm.s_tir import dlight as dl

    return [dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                    dl.gpu.GeneralReduction(), dl.gpu.Fallback())]


def get_pipeline(target: tvm.target.Target | None = None, **options) -> tvm.transform.Pass:
    """The full tvm_fusion Relax pipeline for ``target`` (default: the current target)."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        tgt = target or tvm.target.Target.current() or tvm.target.Target("llvm")
        backend = _backend(tgt)
        passes = [Sequential(tgt, **options)]
        if "gpu" in tgt.keys:
            passes += _gpu_schedules()
        passes += backend.dataflow_lower_passes(tgt) + backend.finalize_passes(tgt)
        with tgt:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def register() -> None:
    """Register ``"tvm_fusion"`` with ``relax.get_pipeline`` (idempotent)."""
    if PIPELINE_NAME not in relax.pipeline.PIPELINE_MAP:
        relax.register_pipeline(PIPELINE_NAME)(get_pipeline)


register()

"""``ScheduleFusedBlocks(target)``: every fused PrimFunc becomes one loop nest per anchor, then
gets the target's schedule.

Two steps per PrimFunc, on one :class:`tvm.s_tir.Schedule`:

1. :func:`~.inline.inline_producers` inlines One-to-One/Reorganize/Shuffle/One-to-Many
   producers (data movement becomes index changes) unless recomputation costs more than a
   buffer; each survivor's reason is recorded;
2. the CPU rules (:mod:`.cpu`) tile the Many-to-Many anchor with its epilogue stored from the
   accumulator, compute row statistics per row, vectorise and parallelise. On a target
   without fp16 arithmetic, fp16 epilogues then compute in float32 and round once at the
   store, and paddings read through casts are kept in float32 (:mod:`.half_in_float32`).

Recorded on each function (for ``tvm-fusion report`` and the tests; names in :mod:`.records`):

* ``tvm_fusion.kept_buffers``: ``{buffer: reason}`` for every intermediate still allocated;
* ``tvm_fusion.schedule``: one line per stage saying which rule did what;
* ``tvm_fusion.schedule_fallback``: present when the full schedule failed, with the error; the
  function then gets inlining plus a plain parallel/vectorised loop per stage (or nothing),
  and a warning is issued. A schedule failure never fails the build.
"""

from __future__ import annotations

import warnings

import tvm
from tvm import s_tir, tirx

from ..module_update import with_functions
from ..tir_utils import has_extern_call, iter_sblocks, refresh_access_regions
from .analysis import alloc_buffers
from .attention import try_schedule_attention
from .constant_mask import constant_arguments
from .cpu import schedule_cpu
from .cpu_gemm import emit_packed_gemms, has_packed_gemm, prepare_packed_gemms
from .cpu_target import CpuParams, cpu_params
from .deinterleave import deinterleave_in_func
from .fast_math import fast_math
from .half_in_float32 import HALF, WIDE, half_in_float32
from .ieee import protect_negations
from .inline import inline_producers
from .optifx import try_schedule_conv_chain
from .order import hoist_independent_stages
from .records import (
    DONE_ATTR,
    FALLBACK_ATTR,
    KEPT_ATTR,
    SCHEDULE_ATTR,
    ScheduleFailedWarning,
    alloc_buffers_of,
    first_line,
    kept_reasons,
    restore_symbol,
)
from .rounding import fence_producers
from .symbolic_indices import simplify_symbolic_indices


def schedule_primfunc(func: tirx.PrimFunc, params: CpuParams, inline: bool = True,
                      tile: bool = True, fast: bool = True,
                      packed_gemm: bool = True) -> tirx.PrimFunc:
    """One fused PrimFunc, inlined and scheduled, with the record attributes attached.

    ``fast`` replaces float32 exp/erf/tanh/sigmoid by vectorisable approximations
    (:mod:`.fast_math`). ``packed_gemm``: packed-weight GEMMs get the template nest of
    :mod:`.cpu_gemm` (with ``tile``); otherwise the register-tile rule."""
    base = hoist_independent_stages(refresh_access_regions(
        fence_producers(protect_negations(func))))
    base = simplify_symbolic_indices(base).with_attr("global_symbol", "main")
    sch = s_tir.Schedule(base)
    kept, inlined = inline_producers(sch) if inline else ({}, [])
    if inline:  # inlining composes the indices of reshapes over symbolic sizes: simplify them
        simplified = simplify_symbolic_indices(sch.mod["main"])
        if not simplified.same_as(sch.mod["main"]):
            sch = s_tir.Schedule(simplified)
    sites, gemm_notes = prepare_packed_gemms(sch, params) if tile and packed_gemm else ([], [])
    skip = {s.gemm for s in sites} | {s.writeback for s in sites}
    notes = schedule_cpu(sch, params, tile=tile, kept=kept, skip=skip)
    result, emitted = sch.mod["main"], []
    if sites:
        result, emitted = emit_packed_gemms(result, sites, params)
    else:  # a strided window's padding (emit_packed_gemms rewrites the GEMMs' own)
        result, emitted = deinterleave_in_func(result, params.lanes)
    notes = emitted + gemm_notes + notes
    if params.accumulates(HALF) == WIDE:  # no fp16 arithmetic: fp16 math in float32
        result, half_notes = half_in_float32(result)
        notes += half_notes
    if fast:  # last: TVM's inliners cannot analyse the Let bindings it introduces
        result = fast_math(result)
    reasons = kept_reasons(result, kept, notes)
    attrs = {KEPT_ATTR: reasons, SCHEDULE_ATTR: notes + [f"inlined {n}" for n in inlined],
             DONE_ATTR: True}
    return restore_symbol(result, func).with_attrs(attrs)


def schedule_with_fallback(gvar, func: tirx.PrimFunc, params: CpuParams,
                           fast: bool, constants: dict | None = None) -> tirx.PrimFunc:
    """The attention template for a fused attention, OptiFX's overlapped tiles for a conv chain,
    else the per-block rules; when those fail, the register-tile rule for a packed GEMM, or
    inlining with plain parallel/vector loops (or nothing), the error recorded and warned.
    ``constants``: the arguments every call passes as the same constant
    (:func:`~.constant_mask.constant_arguments`)."""
    attention = try_schedule_attention(gvar, func, params, fast, constants)
    if attention is not None:
        try:
            return probe_build(attention)
        except Exception as err:  # noqa: BLE001 (a lowering failure: the usual rules take it)
            warnings.warn(f"tvm_fusion: attention kernel of {gvar.name_hint} does not lower "
                          f"({type(err).__name__}: {first_line(err)}); using the per-operator "
                          f"rules", ScheduleFailedWarning, stacklevel=2)
    declined: list[str] = []
    chained = try_schedule_conv_chain(gvar, func, params, fast, declined)
    if chained is not None:
        return chained
    try:
        out = probe_build(schedule_primfunc(func, params, fast=fast))
        if declined:
            out = out.with_attr(SCHEDULE_ATTR, declined + list(out.attrs[SCHEDULE_ATTR]))
        return out
    except Exception as err:  # noqa: BLE001 (TVM raises several types; all mean "not this")
        reason = f"{type(err).__name__}: {first_line(err)}"
    if has_packed_gemm(func):  # the packed GEMM kernel failed: the register-tile rule
        try:
            out = probe_build(schedule_primfunc(func, params, fast=fast, packed_gemm=False))
            notes = list(out.attrs[SCHEDULE_ATTR])
            warnings.warn(f"tvm_fusion: packed GEMM kernel of {gvar.name_hint} failed "
                          f"({reason}); using register tiles", ScheduleFailedWarning,
                          stacklevel=2)
            return out.with_attr(SCHEDULE_ATTR, [f"packed GEMM kernel not used ({reason})"]
                                 + notes)
        except Exception as err:  # noqa: BLE001
            reason = f"{reason}; then {type(err).__name__}: {first_line(err)}"
    warnings.warn(f"tvm_fusion: schedule of {gvar.name_hint} failed ({reason}); "
                  f"using inlining with plain parallel/vector loops", ScheduleFailedWarning,
                  stacklevel=2)
    for inline, tile in ((True, False), (False, False)):
        try:
            out = probe_build(schedule_primfunc(func, params, inline=inline, tile=tile, fast=fast))
            return out.with_attr(FALLBACK_ATTR, reason)
        except Exception:  # noqa: BLE001
            continue
    return func.with_attrs({FALLBACK_ATTR: reason + "; left unscheduled", DONE_ATTR: True})


def probe_build(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` if TVM's TIR lowering accepts it, else the lowering's exception. TVM 0.27 can
    fail late on a valid schedule (vectorising ``(i - 1) // 196 + v`` under a floormod divides
    by zero in its constant folder, ViT's patch embedding); the user's build must not."""
    target = tvm.target.Target.current() or tvm.target.Target("llvm")
    host = target.host or (target if _is_llvm(target) else tvm.target.Target("llvm"))
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    mod = tvm.tirx.transform.BindTarget(target.with_host(host))(mod)
    # TIR's whole lowering, not code generation: the failures seen are all in lowering, and
    # LLVM compiling every kernel twice (here and in the build) cost ~40 % of a build.
    pipeline, _host_passes, _device_passes = tvm.tirx.get_tir_pipeline("default")  # build's
    pipeline(mod)
    return func


def _is_llvm(target: tvm.target.Target) -> bool:
    return target.kind.name in ("llvm", "c")


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.ScheduleFusedBlocks")
class ScheduleFusedBlocks:
    """Inline and schedule every PrimFunc of the module for a CPU target.

    Parameters
    ----------
    target
        An ``llvm`` target (x86 or ``mtriple`` aarch64...). ``None`` uses ``Target.current()``.
        Non-CPU targets are left alone (GPU targets use DLight, see ``pipeline.py``).
    fast_math
        Replace float32 exp/erf/tanh/sigmoid by vectorisable approximations (about 1e-7
        relative error); without it LLVM calls libm once per lane.
    """

    def __init__(self, target: tvm.target.Target | None = None, fast_math: bool = True):
        self.target = target
        self.fast_math = fast_math

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = self.target or tvm.target.Target.current()
        if target is not None and not _is_llvm(target):
            return mod
        params = cpu_params(target)
        constants = constant_arguments(mod)
        updates = {}
        for gvar, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc) or not is_schedulable(func):
                continue
            updates[gvar] = schedule_with_fallback(gvar, func, params, self.fast_math,
                                                   constants.get(gvar.name_hint))
        return with_functions(mod, updates)


def is_schedulable(func: tirx.PrimFunc) -> bool:
    """Not scheduled yet, and with blocks to schedule (externs and scans have none)."""
    attrs = func.attrs or {}
    if DONE_ATTR in attrs or "tirx.is_scheduled" in attrs:
        return False
    return not has_extern_call(func.body) and any(True for _ in iter_sblocks(func))


__all__ = ["ScheduleFusedBlocks", "schedule_primfunc", "schedule_with_fallback",
           "is_schedulable", "probe_build", "KEPT_ATTR", "SCHEDULE_ATTR", "FALLBACK_ATTR",
           "DONE_ATTR", "ScheduleFailedWarning", "alloc_buffers", "alloc_buffers_of"]

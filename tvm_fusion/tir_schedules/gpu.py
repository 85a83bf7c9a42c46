"""GPU schedules of fused PrimFuncs: the generated kernel for a fused attention, OptiFX's
overlapped-tile template for a fused conv chain, stock DLight rules for everything else, one
function at a time."""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import tvm
from tvm import s_tir
from tvm.s_tir import dlight as dl

from ..tir_utils import compact_buffers, find_all
from .attention_gpu import try_schedule_attention_gpu
from .fused_block import probe_build
from .optifx import try_schedule_conv_chain_gpu


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.ApplyGPUSchedules")
def apply_gpu_schedules(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """GPU schedules of every fused PrimFunc, one function at a time: a fused attention gets
    the generated online-softmax kernel (:mod:`.attention_gpu`), a fused conv chain (OptiFX)
    the overlapped-tile template, checked by ``verify_gpu_code``; everything else stock DLight
    rules.

    DLight's rules were written for FuseOps' groups; on a larger DNNFusion block a rule can fail
    (0.27's GEMV ``normalize`` asserts) or produce TIR that does not lower. Such a function is
    retried with fewer rules and a warning names it, rather than failing the whole build.
    """
    rule_sets = [  # all of DLight's rules, then fewer for a function the full set fails on
        [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
         dl.gpu.Fallback()],
        [dl.gpu.Matmul(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()],
        [dl.gpu.GeneralReduction(), dl.gpu.Fallback()],
        [dl.gpu.Fallback()],
    ]
    mod = mod.clone()  # a pass leaves the module it was given as it was
    if _may_tensorize(mod, tvm.target.Target.current()):
        import_tensor_intrinsics()
    for gvar, func in list(mod.functions.items()):
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        attention = try_schedule_attention_gpu(gvar, func, tvm.target.Target.current())
        if attention is not None:
            try:
                mod[gvar] = probe_build(attention)
                continue
            except Exception as err:  # noqa: BLE001 (a lowering failure: DLight takes it)
                warnings.warn(f"GPU attention kernel of {gvar.name_hint} does not lower "
                              f"({type(err).__name__}); DLight schedules it", stacklevel=1)
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
                mod[gvar] = _within_shared_memory(probe_build(scheduled[gvar]), gvar)
                break
            except Exception as err:  # noqa: BLE001 (DLight raises bare AssertionErrors)
                if attempt == len(rule_sets) - 1:
                    raise ValueError(f"no DLight rule schedules {gvar.name_hint}: {err}") from None
                warnings.warn(f"DLight rule failed on {gvar.name_hint} "
                              f"({type(err).__name__}); retrying with fewer rules", stacklevel=1)
    return mod


_TENSOR_INTRIN = "tvm.s_tir.tensor_intrin"
_STATIC_SHARED = 48 << 10  # CUDA's static shared memory per block (more needs an opt-in)


def _within_shared_memory(func: tvm.tirx.PrimFunc, gvar) -> tvm.tirx.PrimFunc:
    """``func`` if its static shared memory fits the target, else ``ValueError``: DLight's
    GeneralReduction keeps a whole fused intermediate in shared memory when a consumer (a
    concatenate) cannot be inlined (ViT's patch embedding on a DNNFusion block: 602,112 bytes,
    which ptxas rejects); the next, smaller rule set then schedules it."""
    target = tvm.target.Target.current()
    attrs = dict(target.attrs) if target is not None else {}
    limit = min(int(attrs.get("max_shared_memory_per_block", _STATIC_SHARED)), _STATIC_SHARED)
    try:
        used = _static_shared_bytes(func)
    except Exception:  # noqa: BLE001 (a symbolic extent, a pass refusing: not this check's call)
        return func
    if used > limit:
        raise ValueError(f"{gvar.name_hint} needs {used} bytes of shared memory, over {limit}")
    return func


def _static_shared_bytes(func: tvm.tirx.PrimFunc) -> int:
    """Bytes of static ``shared`` buffers (not ``shared.dyn``) ``func`` allocates, compacted to
    what one block uses."""
    total = 0
    for block in find_all(compact_buffers(func).body, s_tir.SBlock):
        for buf in block.alloc_buffers:
            if buf.scope() == "shared":
                size = 1
                for extent in buf.shape:
                    size *= int(extent)
                total += size * buf.dtype.bits // 8
    return total


def _may_tensorize(mod: tvm.IRModule, target: tvm.target.Target | None) -> bool:
    """Whether DLight's Matmul rule will import TVM's tensor intrinsics for ``mod``: always on
    Metal (its simdgroup path), on CUDA for fp16/int8 operands (tensor cores)."""
    if target is None or _TENSOR_INTRIN in sys.modules:
        return False
    if target.kind.name == "metal":
        return True
    if target.kind.name != "cuda":
        return False
    return any(str(getattr(param, "dtype", "")) in ("float16", "int8")
               for func in mod.functions.values() if isinstance(func, tvm.tirx.PrimFunc)
               for param in func.params)


def import_tensor_intrinsics() -> None:
    """Import ``tvm.s_tir.tensor_intrin`` (TVMScript intrinsics DLight's Matmul rule loads on
    first use) in seconds instead of minutes.

    Each of its ~500 ``@T.prim_func`` calls ``inspect.stack()``, which looks up the source file
    of every frame on the stack; for the import machinery's frozen frames that lookup scans all
    of ``sys.modules`` (about 2,000 entries once TVM is imported), so the first Metal build
    spent 3.5 minutes importing (measured on a 2-core VM). TVMScript reads only the innermost
    three frames' source lines and the frames themselves, so during the import the others are
    listed without their source lines."""
    if _TENSOR_INTRIN in sys.modules:
        return
    with _shallow_inspect_stack():
        importlib.import_module(_TENSOR_INTRIN)


@contextmanager
def _shallow_inspect_stack(full_frames: int = 3) -> Iterator[None]:
    def stack(context: int = 1) -> list:
        frame, frames = sys._getframe(1), []
        while frame is not None:
            if len(frames) < full_frames:
                info = inspect.getframeinfo(frame, context)
                extra = {"positions": info.positions} if hasattr(info, "positions") else {}
                frames.append(inspect.FrameInfo(frame, *info[:5], **extra))  # 3.11+: positions
            else:
                code = frame.f_code
                frames.append(inspect.FrameInfo(frame, code.co_filename, frame.f_lineno,
                                                code.co_name, None, None))
            frame = frame.f_back
        return frames

    original = inspect.stack
    inspect.stack = stack
    try:
        yield
    finally:
        inspect.stack = original

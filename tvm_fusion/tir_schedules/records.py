"""What a CPU schedule records on the PrimFunc it scheduled, shared by the per-block rules
(:mod:`.fused_block`) and OptiFX's chain template (:mod:`.optifx`), so neither imports the other's
internals.

* ``tvm_fusion.kept_buffers`` (:data:`KEPT_ATTR`): ``{buffer: reason}`` for every intermediate
  still allocated;
* ``tvm_fusion.schedule`` (:data:`SCHEDULE_ATTR`): one line per stage saying which rule did what;
* ``tvm_fusion.schedule_fallback`` (:data:`FALLBACK_ATTR`): the error when the full schedule
  failed and a simpler one was used;
* ``tvm_fusion.scheduled`` (:data:`DONE_ATTR`): scheduled already, so later passes leave it.
"""

from __future__ import annotations

from tvm import tirx

KEPT_ATTR = "tvm_fusion.kept_buffers"
SCHEDULE_ATTR = "tvm_fusion.schedule"
FALLBACK_ATTR = "tvm_fusion.schedule_fallback"
DONE_ATTR = "tvm_fusion.scheduled"


class ScheduleFailedWarning(UserWarning):
    """A fused function fell back to a simpler schedule; the reason is on the function."""


def restore_symbol(result: tirx.PrimFunc, original: tirx.PrimFunc) -> tirx.PrimFunc:
    """``result`` with ``original``'s ``global_symbol`` (schedules work on a ``main``)."""
    symbol = original.attrs.get("global_symbol") if original.attrs else None
    if symbol is None:
        return result.without_attr("global_symbol")
    return result.with_attr("global_symbol", symbol)


def alloc_buffers_of(func: tirx.PrimFunc) -> dict:
    return {b.name: b for b in func.body.block.alloc_buffers}


def kept_reasons(func: tirx.PrimFunc, kept: dict[str, str], notes: list[str]) -> dict:
    """A reason for every intermediate the function still allocates."""
    reasons = {}
    for name, buf in alloc_buffers_of(func).items():
        if name in kept:
            reasons[name] = kept[name]
        elif buf.scope() == "local":
            reasons[name] = "accumulator tile (local scope, registers after unrolling)"
        else:
            reasons[name] = ("result of a Many-to-Many (reduction) stage: a reduction cannot be "
                             "inlined; computed per row/tile where its consumers allow")
    return reasons


def first_line(err: BaseException) -> str:
    """The line of a TVM schedule error that says what went wrong (its banner lines skipped)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    for line in lines:
        if not line.startswith(("ScheduleError", "The IR", "Access path", "Error message")):
            return line[:200]
    return lines[-1][:200] if lines else type(err).__name__

"""Which schedule each kernel took, as tests read it: the notes a CPU schedule records on the
PrimFunc it scheduled (:data:`tvm_fusion.tir_schedules.records.SCHEDULE_ATTR`)."""

from __future__ import annotations

import tvm

from ..tir_schedules.records import SCHEDULE_ATTR


def schedule_notes(mod: tvm.IRModule) -> str:
    """Every scheduled PrimFunc's notes in ``mod``, one a line."""
    return "\n".join(str(note) for func in mod.functions.values()
                     if isinstance(func, tvm.tirx.PrimFunc)
                     for note in (func.attrs or {}).get(SCHEDULE_ATTR, []))

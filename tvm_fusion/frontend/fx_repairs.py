"""Converters for FX (ATen) operators that TVM 0.27's ExportedProgram importer lacks or gets
wrong; each names the TVM behaviour it works around. A converter is ``fn(importer, node)``."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ALL_FX_REPAIRS", "CONVERTERS", "REPAIRS"]

CONVERTERS: dict[str, Callable] = {}


def _converter(*targets: str, repair: str):
    def register(fn):
        fn.repair = repair
        for target in targets:
            CONVERTERS[target] = fn
        return fn
    return register


REPAIRS = frozenset(fn.repair for fn in CONVERTERS.values())
# every repair of the ExportedProgram import; "pin_shapes" is torch's shapes pinned (fx_import)
ALL_FX_REPAIRS = frozenset({"pin_shapes", *REPAIRS})

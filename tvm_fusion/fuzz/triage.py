"""Which single option change makes a failing case pass: a first hint at the root cause.

A wrong result that ``schedule=False`` fixes points at the CPU scheduler, one that
``layout=False`` fixes at SmartMem's layout elimination, ``fast_math=False`` at the
approximations, and so on. The fuzzer's report groups failures by this signature.
"""

from __future__ import annotations

from collections.abc import Callable

from .differential import Case, Outcome

#: The toggles tried, each on top of the case's own options.
TOGGLES: dict[str, dict] = {
    "schedule=False": {"schedule": False},
    "fast_math=False": {"fast_math": False},
    "layout=False": {"layout": False},
    "rewrite=False": {"rewrite": False},
    "conv_layout=NCHW": {"conv_layout": "NCHW"},
    "strategy=apollo": {"strategy": "apollo"},
    "strategy=tvm": {"strategy": "tvm"},
}


def triage(case: Case, check: Callable[[Case], Outcome]) -> dict[str, str]:
    """The class of ``case`` under each toggle that changes its options."""
    result = {}
    for name, change in TOGGLES.items():
        if all(case.options.get(k) == v for k, v in change.items()):
            continue
        result[name] = check(case.replace(options={**case.options, **change})).cls
    return result


def fixed_by(result: dict[str, str]) -> list[str]:
    return [name for name, cls in result.items() if cls == "ok"]

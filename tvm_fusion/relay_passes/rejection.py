"""Why two operators ended up in different kernels: a typed reason plus the detail text.

Every planner (DNNFusion's, OptiFX's chain merging, attention blocks, Apollo's partition)
records each producer → consumer pair it did not fuse as a :class:`Rejection`. Tests assert on the
:class:`RejectReason`; ``tvm-fusion report --why`` and the plan pictures print both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RejectReason(str, enum.Enum):
    """What stopped a fusion; the value is the name the report and its JSON use."""

    RED_CELL = "red_cell"  # DNNFusion's Table 3: this pair of mapping types never fuses
    NO_RULE = "no_rule"  # Apollo: no rule of its table joins these two operator types
    OPAQUE = "opaque"  # an operator that is never fused (library call, extern code)
    ALREADY_FUSED = "already_fused"  # the operator already belongs to another block
    EPILOGUE = "epilogue"  # left to be the epilogue of its own Many-to-Many producer
    PROLOGUE = "prologue"  # a widening operator (dequantize) left to its consumers' kernels
    BLOCK_LIMIT = "block_limit"  # the block (or packed kernel) is at its size limit
    CYCLE = "cycle"  # the kernel would depend on itself through an outside operator
    DIMENSIONS = "dimensions"  # Apollo's stitching: loop dimensions or row tiles differ
    WORKING_SET = "working_set"  # Apollo's Layer III: the packed kernel's data exceeds the cache
    PROFITABILITY = "profitability"  # the cost model or a measurement says fusing is slower
    OVERLAP = "overlap"  # OptiFX: the conv chain overlaps a better one
    SCHEDULE_FAILURE = "schedule_failure"  # Apollo's feedback: the fused schedule failed
    SCORES_ESCAPE = "scores_escape"  # attention: the scores/probabilities are read outside
    ATTENTION_TEMPLATE = "attention_template"  # attention: the template refuses the fused code
    FUSION_LOSES = "fusion_loses"  # the fusion guard: the scheduled kernel does more than its parts
    KEPT_INTERMEDIATE = "kept_intermediate"  # the guard: the kernel kept a whole intermediate


def describe(reason: RejectReason | str, detail: str) -> str:
    """``[red_cell] Table 3 red: block M2M then M2M``: how a rejection is printed."""
    return f"[{RejectReason(reason).value}] {detail}"


@dataclass(frozen=True)
class Rejection:
    """Why ``first`` and ``second`` (producer, consumer) ended up in different kernels."""

    first: str
    second: str
    reason: RejectReason
    detail: str

    def describe(self) -> str:
        return describe(self.reason, self.detail)


__all__ = ["RejectReason", "Rejection", "describe"]

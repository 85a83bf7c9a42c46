"""SmartMem's operator classes (ASPLOS'24 §3.1, Table 3) and its pair tables (Tables 5 and 6).

Two questions per operator, answered from its TIR rather than its name:

* does its speed depend on the layout of its input (**ILD**: it reuses input elements, i.e. it
  reduces or reads a stencil; or it reads operands in *different* layouts, the paper's
  operand-dependent placement of ``Add(A^l1, B^l2)``) or not (**ILI**: it touches each element
  once, in whatever order its operands share);
* can it write any layout its consumer wants (**Variable**: it computes) or is its output layout
  a function of its input's (**Fixed**: it only moves data: every block stores a load, a
  constant or a choice between them).

Among Fixed operators, a whole-tensor permutation or re-indexing (Reshape, Transpose,
DepthToSpace: DNNFusion's Reorganize and Shuffle) is ILD; selection or replication (Slice,
Gather, Pad, Concat, broadcast) is ILI. Both are eliminated alike; the split only matters for a
Fixed operator that nothing can absorb.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..relay_passes.mapping_type import Classification, MappingType


class LayoutClass(enum.Enum):
    """Table 3's quadrants, plus Opaque (code the analysis cannot read: never touched)."""

    ILD_VARIABLE = "ILD&Variable"
    ILI_VARIABLE = "ILI&Variable"
    ILD_FIXED = "ILD&Fixed"
    ILI_FIXED = "ILI&Fixed"
    OPAQUE = "Opaque"

    @property
    def fixed(self) -> bool:
        return self in (LayoutClass.ILD_FIXED, LayoutClass.ILI_FIXED)

    @property
    def variable(self) -> bool:
        return self in (LayoutClass.ILD_VARIABLE, LayoutClass.ILI_VARIABLE)

    @property
    def complexity(self) -> int:
        """§3.2's optimisation-complexity order: ILD&Var > ILI&Var > ILD&Fixed > ILI&Fixed."""
        return _COMPLEXITY[self]


_COMPLEXITY = {LayoutClass.ILD_VARIABLE: 3, LayoutClass.ILI_VARIABLE: 2,
               LayoutClass.ILD_FIXED: 1, LayoutClass.ILI_FIXED: 0, LayoutClass.OPAQUE: -1}


def layout_class(mapping: Classification, pure_copy: bool) -> tuple[LayoutClass, str]:
    """The class of an operator from its DNNFusion mapping type (computed from TIR at the call
    site) and whether every block of it is a pure copy. Returns the class and why."""
    kind = mapping.mapping_type
    if kind is MappingType.OPAQUE:
        return LayoutClass.OPAQUE, mapping.reason
    if pure_copy:
        if kind in (MappingType.REORGANIZE, MappingType.SHUFFLE):
            return LayoutClass.ILD_FIXED, f"pure copy, {kind.short}: re-indexes the whole tensor"
        return LayoutClass.ILI_FIXED, f"pure copy, {kind.short}: selects or replicates elements"
    if kind is MappingType.MANY_TO_MANY:
        return LayoutClass.ILD_VARIABLE, f"reuses input elements ({mapping.reason})"
    if kind in (MappingType.REORGANIZE, MappingType.SHUFFLE):
        return LayoutClass.ILD_VARIABLE, (
            f"computes on operands read in another layout ({kind.short})")
    return LayoutClass.ILI_VARIABLE, f"computes once per element ({kind.short})"


class Action(enum.Enum):
    """Table 5's cells, lowest optimisation opportunity first."""

    KEEP_BOTH = "keep both"
    TRY_FUSE = "try fuse"
    ELIMINATE_FIRST = "eliminate 1st"
    ELIMINATE_SECOND = "eliminate 2nd"
    ELIMINATE_BOTH = "eliminate both"


class Search(enum.Enum):
    """Table 6's layout-search policy for the pair."""

    BOTH = "search both"
    FUSED = "search fused"
    FIRST = "search 1st"
    SECOND = "search 2nd"
    NONE = "no search"


@dataclass(frozen=True)
class PairDecision:
    action: Action
    result: LayoutClass | None  # Table 6's resulting type; None where both are eliminated
    search: Search


_V, _IV = LayoutClass.ILD_VARIABLE, LayoutClass.ILI_VARIABLE
_DF, _IF = LayoutClass.ILD_FIXED, LayoutClass.ILI_FIXED
_A, _S = Action, Search

# (first, second) -> Table 5 action, Table 6 result type and search policy, as printed.
TABLES_5_6: dict[tuple[LayoutClass, LayoutClass], PairDecision] = {
    (_V, _V): PairDecision(_A.KEEP_BOTH, _V, _S.BOTH),
    (_V, _IV): PairDecision(_A.TRY_FUSE, _V, _S.FUSED),
    (_V, _DF): PairDecision(_A.ELIMINATE_SECOND, _V, _S.FIRST),
    (_V, _IF): PairDecision(_A.ELIMINATE_SECOND, _V, _S.FIRST),
    (_IV, _V): PairDecision(_A.TRY_FUSE, _V, _S.FUSED),
    (_IV, _IV): PairDecision(_A.TRY_FUSE, _IV, _S.NONE),
    (_IV, _DF): PairDecision(_A.ELIMINATE_SECOND, _IV, _S.NONE),
    (_IV, _IF): PairDecision(_A.ELIMINATE_SECOND, _IV, _S.NONE),
    (_DF, _V): PairDecision(_A.ELIMINATE_FIRST, _V, _S.SECOND),
    (_DF, _IV): PairDecision(_A.ELIMINATE_FIRST, _IV, _S.NONE),
    (_DF, _DF): PairDecision(_A.ELIMINATE_BOTH, None, _S.NONE),
    (_DF, _IF): PairDecision(_A.ELIMINATE_BOTH, None, _S.NONE),
    (_IF, _V): PairDecision(_A.ELIMINATE_FIRST, _V, _S.SECOND),
    (_IF, _IV): PairDecision(_A.ELIMINATE_FIRST, _IV, _S.NONE),
    (_IF, _DF): PairDecision(_A.ELIMINATE_BOTH, None, _S.NONE),
    (_IF, _IF): PairDecision(_A.ELIMINATE_BOTH, None, _S.NONE),
}


def pair_decision(first: LayoutClass, second: LayoutClass) -> PairDecision:
    """Tables 5 and 6 for a producer→consumer pair; an Opaque side keeps both, unsearched."""
    if LayoutClass.OPAQUE in (first, second):
        return PairDecision(Action.KEEP_BOTH, None, Search.NONE)
    return TABLES_5_6[(first, second)]


def tables_markdown() -> str:
    """Tables 5 and 6 as one Markdown table (action; result type, search)."""
    order = [_V, _IV, _DF, _IF]
    lines = ["| first \\ second | " + " | ".join(c.value for c in order) + " |",
             "|---" * (len(order) + 1) + "|"]
    for first in order:
        cells = []
        for second in order:
            d = TABLES_5_6[(first, second)]
            result = d.result.value if d.result else "N/A"
            cells.append(f"{d.action.value}; {result}, {d.search.value}")
        lines.append(f"| {first.value} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

"""DNNFusion Table 3 as data: the fused mapping type and the colour of every (first, second) pair.

Rows are the first (producer) operator, columns the second (consumer). Colours are lost in the
paper's text; they are rebuilt in ``docs/design.md`` from the prose and from the count "23
code generation rules, one per green or yellow cell": 13 green, 10 yellow, exactly 2 red.
Every colour can be overridden, e.g. ``FusionTable({("O2M", "O2M"): "green"})``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from .mapping_type import MappingType

O2O = MappingType.ONE_TO_ONE
O2M = MappingType.ONE_TO_MANY
M2M = MappingType.MANY_TO_MANY
REORG = MappingType.REORGANIZE
SHUF = MappingType.SHUFFLE


class Colour(enum.Enum):
    """``fuse_through`` (green), ``fuse_depend`` (yellow: ask the profitability oracle),
    ``fuse_break`` (red)."""

    GREEN = "green"
    YELLOW = "yellow"
    RED = "red"

    @property
    def paper_name(self) -> str:
        return {"green": "fuse_through", "yellow": "fuse_depend", "red": "fuse_break"}[self.value]

    @classmethod
    def parse(cls, value: str | Colour) -> Colour:
        if isinstance(value, Colour):
            return value
        text = str(value).strip().lower()
        for member in cls:
            if text in (member.value, member.paper_name):
                return member
        raise ValueError(f"unknown Table 3 colour {value!r}; expected green, yellow or red")


@dataclass(frozen=True)
class Cell:
    fused: MappingType | None  # None for red (×) cells
    colour: Colour


_G, _Y, _R = Colour.GREEN, Colour.YELLOW, Colour.RED

# (first, second) -> (fused type, colour); the paper's cell text, colours as rebuilt.
DEFAULT_TABLE3: dict[tuple[MappingType, MappingType], Cell] = {
    (O2O, O2O): Cell(O2O, _G), (O2O, O2M): Cell(O2M, _G), (O2O, M2M): Cell(M2M, _G),
    (O2O, REORG): Cell(REORG, _G), (O2O, SHUF): Cell(SHUF, _G),
    (O2M, O2O): Cell(O2M, _G), (O2M, O2M): Cell(O2M, _Y), (O2M, M2M): Cell(None, _R),
    (O2M, REORG): Cell(O2M, _Y), (O2M, SHUF): Cell(O2M, _Y),
    (M2M, O2O): Cell(M2M, _G), (M2M, O2M): Cell(M2M, _Y), (M2M, M2M): Cell(None, _R),
    (M2M, REORG): Cell(M2M, _Y), (M2M, SHUF): Cell(M2M, _Y),
    (REORG, O2O): Cell(REORG, _G), (REORG, O2M): Cell(O2M, _Y), (REORG, M2M): Cell(M2M, _Y),
    (REORG, REORG): Cell(REORG, _G), (REORG, SHUF): Cell(REORG, _G),
    (SHUF, O2O): Cell(SHUF, _G), (SHUF, O2M): Cell(O2M, _Y), (SHUF, M2M): Cell(M2M, _Y),
    (SHUF, REORG): Cell(REORG, _G), (SHUF, SHUF): Cell(SHUF, _G),
}


class FusionTable:
    """Table 3 with optional colour overrides.

    Parameters
    ----------
    overrides
        ``{(first, second): colour}``; types may be enum members or names such as ``"O2M"``,
        colours ``"green" | "yellow" | "red"`` or the paper's ``fuse_through`` etc. Turning a red
        cell green or yellow fuses into the more complex of the two types.
    """

    def __init__(self, overrides: Mapping | None = None):
        self.cells = dict(DEFAULT_TABLE3)
        for (first, second), colour in (overrides or {}).items():
            key = (MappingType.parse(first), MappingType.parse(second))
            if MappingType.OPAQUE in key:
                raise ValueError("Table 3 has no Opaque row or column: opaque ops never fuse")
            colour = Colour.parse(colour)
            fused = self.cells[key].fused or max(key)
            self.cells[key] = Cell(None if colour is Colour.RED else fused, colour)

    def lookup(self, first: MappingType, second: MappingType) -> Cell:
        """The cell for ``first`` feeding ``second``; Opaque on either side is red."""
        if MappingType.OPAQUE in (first, second):
            return Cell(None, Colour.RED)
        return self.cells[(first, second)]

    def counts(self) -> dict[Colour, int]:
        counts = {c: 0 for c in Colour}
        for cell in self.cells.values():
            counts[cell.colour] += 1
        return counts

    def to_markdown(self) -> str:
        """The table as the paper prints it, with colours in words."""
        order = [O2O, O2M, M2M, REORG, SHUF]
        lines = ["| first \\ second | " + " | ".join(t.short for t in order) + " |",
                 "|---" * (len(order) + 1) + "|"]
        for first in order:
            row = []
            for second in order:
                cell = self.cells[(first, second)]
                text = cell.fused.short if cell.fused is not None else "×"
                row.append(f"{text} ({cell.colour.value})")
            lines.append(f"| {first.short} | " + " | ".join(row) + " |")
        return "\n".join(lines)

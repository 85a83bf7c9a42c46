"""Fuzz results on disk: one JSON line per case, failing models as .onnx + a JSON sidecar.

Every file is written through a temporary file and ``os.replace``, so an interrupted run leaves
whole files only, and a resumed run (``--resume``) can trust what it finds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx

from ..atomic import atomic_write_bytes, atomic_write_text
from .differential import Case, Outcome


def options_to_json(options: dict) -> dict:
    """``table3``'s tuple keys become ``[first, second, colour]`` rows (JSON has no tuples)."""
    out = dict(options)
    if isinstance(out.get("table3"), dict):
        out["table3"] = [[a, b, c] for (a, b), c in out["table3"].items()]
    return out


def options_from_json(options: dict) -> dict:
    out = dict(options)
    if isinstance(out.get("table3"), list):
        out["table3"] = {(a, b): c for a, b, c in out["table3"]}
    return out


def record(case: Case, outcome: Outcome, **extra) -> dict:
    """The JSON line of one case."""
    return {
        "seed": case.seed,
        "class": outcome.cls,
        "stage": outcome.stage,
        "error": outcome.error,
        "max_err": outcome.max_err,
        "stock_err": outcome.stock_err,
        "seconds": outcome.seconds,
        **({"stock_bytes": outcome.stock_bytes, "ours_bytes": outcome.ours_bytes}
           if outcome.ours_bytes is not None else {}),
        **({"fallbacks": outcome.fallbacks} if outcome.fallbacks else {}),
        "options": options_to_json(case.options),
        "special": case.special,
        "target": case.target,
        "symbolic": case.symbolic,
        "nodes": len(case.model.graph.node),
        "ops": [n.op_type for n in case.model.graph.node],
        **extra,
    }


class Store:
    """An output folder: ``cases.jsonl`` and ``failures/seed<N>-<class>.onnx`` (+ ``.json``)."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.lines_path = self.out / "cases.jsonl"
        self._lines: list[str] = []
        if self.lines_path.exists():
            self._lines = [ln for ln in self.lines_path.read_text().splitlines() if ln.strip()]

    def done_seeds(self) -> set[int]:
        return {json.loads(ln)["seed"] for ln in self._lines}

    def records(self) -> list[dict]:
        return [json.loads(ln) for ln in self._lines]

    def add(self, rec: dict) -> None:
        self._lines.append(json.dumps(rec, sort_keys=True))
        atomic_write_text(self.lines_path, "\n".join(self._lines) + "\n")

    def save_failure(self, case: Case, outcome: Outcome, original: Case | None = None,
                     **extra) -> Path:
        """Write the (minimised) model and its sidecar; return the .onnx path."""
        stem = self.out / "failures" / f"seed{case.seed:06d}-{outcome.cls}"
        save_case(stem.with_suffix(".onnx"), case, outcome, **extra)
        if original is not None and original.model is not case.model:
            atomic_write_bytes(f"{stem}.orig.onnx", original.model.SerializeToString())
        return stem.with_suffix(".onnx")


def save_case(path: str | os.PathLike, case: Case, outcome: Outcome, **extra) -> None:
    """``path`` (.onnx) and its sidecar ``path`` with .json: what :func:`load_case` reads."""
    path = Path(path)
    atomic_write_bytes(path, case.model.SerializeToString())
    side = record(case, outcome, **extra)
    side["shapes"] = case.shapes if case.symbolic else None
    atomic_write_text(path.with_suffix(".json"), json.dumps(side, indent=1, sort_keys=True) + "\n")


def load_case(path: str | os.PathLike) -> tuple[Case, dict]:
    """The case stored at ``path`` (.onnx + .json sidecar) and the sidecar itself."""
    path = Path(path)
    side = json.loads(path.with_suffix(".json").read_text())
    case = Case(seed=int(side["seed"]), model=onnx.load(str(path)),
                options=options_from_json(side.get("options") or {}),
                special=bool(side.get("special")), target=side.get("target") or "llvm",
                symbolic=bool(side.get("symbolic")), shapes=side.get("shapes"))
    return case, side

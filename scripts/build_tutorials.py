"""Build the tutorial notebooks from their plain-Python sources, executed, outputs included.

Each notebook is authored as ``tutorials/src/NN_name.py`` in the "percent" format: a line
``# %%`` starts a code cell, ``# %% [markdown]`` a Markdown cell whose lines are comments
(``# `` is stripped). Anything before the first marker is a header for the reader of the
source and is not part of the notebook. The source is converted with ``nbformat`` into
``tutorials/NN_name.ipynb`` and executed top to bottom with ``nbclient`` (kernel ``python3``,
working directory the repository root), so the committed notebook carries its outputs (tables,
printed reports, figures as PNG).

::

    python scripts/build_tutorials.py                   # rebuild every notebook
    python scripts/build_tutorials.py 01_drop_in        # rebuild some (names, with or without .py)
    python scripts/build_tutorials.py --check           # committed notebooks match their sources?
    python scripts/build_tutorials.py --no-execute ...  # convert only (no outputs)

``--check`` exits 1 when a notebook's cells differ from its source, a notebook is missing or
has no source, or a code cell has not been executed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
SOURCES = TUTORIALS / "src"
KERNEL = "python3"
CELL_TIMEOUT_S = 300

_MARKER = "# %%"
_MARKDOWN = "# %% [markdown]"


def parse_source(text: str) -> list[tuple[str, str]]:
    """``[(cell_type, source), ...]`` of a percent-format Python file."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        stripped = line.rstrip()
        if stripped.startswith(_MARKDOWN):
            cells.append(("markdown", []))
        elif stripped == _MARKER or stripped.startswith(_MARKER + " "):
            cells.append(("code", []))
        elif cells:
            cells[-1][1].append(line.rstrip())
    out = []
    for kind, lines in cells:
        if kind == "markdown":
            lines = [_uncomment(line) for line in lines]
        while lines and not lines[0].strip():
            lines.pop(0)
        while lines and not lines[-1].strip():
            lines.pop()
        if lines:
            out.append((kind, "\n".join(lines)))
    return out


def _uncomment(line: str) -> str:
    if line.startswith("# "):
        return line[2:]
    if line.startswith("#"):
        return line[1:]
    if line.strip():
        raise ValueError(f"markdown cell line is not a comment: {line!r}")
    return ""


def make_notebook(source: Path) -> nbformat.NotebookNode:
    """The unexecuted notebook of one source file (stable cell ids, so diffs stay small)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": KERNEL},
        "language_info": {"name": "python"},
    }
    for i, (kind, text) in enumerate(parse_source(source.read_text())):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        nb.cells.append(make(text, id=f"{source.stem[:2]}-{i:03d}"))
    return nb


def execute(nb: nbformat.NotebookNode, cwd: Path = ROOT,
            timeout: int = CELL_TIMEOUT_S) -> nbformat.NotebookNode:
    """Run every cell in a fresh ``python3`` kernel; raises ``CellExecutionError`` on error."""
    from nbclient import NotebookClient

    # The kernel inherits the environment: committed outputs must not depend on a personal
    # profiling database (an absent one makes yellow cells use the analytic default).
    os.environ.setdefault("TVM_FUSION_DB", str(TUTORIALS / ".no-profiling.db"))
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"  # figures as PNG
    client = NotebookClient(nb, timeout=timeout, kernel_name=KERNEL, record_timing=False,
                            resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return nb


def notebook_path(source: Path) -> Path:
    return TUTORIALS / (source.stem + ".ipynb")


def sources(names: list[str] | None = None) -> list[Path]:
    every = sorted(SOURCES.glob("[0-9][0-9]_*.py"))
    if not names:
        return every
    wanted = {Path(n).stem for n in names}
    unknown = wanted - {s.stem for s in every}
    if unknown:
        raise SystemExit(f"no tutorial source for {', '.join(sorted(unknown))} in {SOURCES}")
    return [s for s in every if s.stem in wanted]


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def check() -> list[str]:
    """Problems with the committed notebooks (empty when all is well)."""
    problems = []
    srcs = sources()
    for src in srcs:
        path = notebook_path(src)
        if not path.exists():
            problems.append(f"{path.relative_to(ROOT)} is missing: "
                            f"python scripts/build_tutorials.py {src.stem}")
            continue
        committed = nbformat.read(path, as_version=4)
        if _cells(committed) != _cells(make_notebook(src)):
            problems.append(f"{path.relative_to(ROOT)} differs from {src.relative_to(ROOT)}: "
                            f"python scripts/build_tutorials.py {src.stem}")
        unexecuted = [i for i, c in enumerate(committed.cells)
                      if c.cell_type == "code" and c.execution_count is None]
        if unexecuted:
            problems.append(f"{path.relative_to(ROOT)}: code cells {unexecuted} were not executed")
    known = {notebook_path(s) for s in srcs}
    for path in sorted(TUTORIALS.glob("*.ipynb")):
        if path not in known:
            problems.append(f"{path.relative_to(ROOT)} has no source: author it as "
                            f"tutorials/src/{path.stem}.py and build it with this script")
    return problems


def build(src: Path, run: bool = True) -> float:
    start = time.perf_counter()
    nb = make_notebook(src)
    if run:
        execute(nb)
    nbformat.validate(nb)
    out = notebook_path(src)
    tmp = out.with_suffix(".ipynb.tmp")
    nbformat.write(nb, tmp)
    tmp.replace(out)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="tutorials to build (default: all)")
    parser.add_argument("--check", action="store_true",
                        help="verify the committed notebooks match their sources; build nothing")
    parser.add_argument("--no-execute", action="store_true", help="convert only")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(p, file=sys.stderr)
        if not problems:
            print(f"{len(sources())} notebooks match their sources")
        return 1 if problems else 0
    for src in sources(args.names):
        seconds = build(src, run=not args.no_execute)
        print(f"{notebook_path(src).relative_to(ROOT)}: {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

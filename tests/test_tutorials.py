"""The tutorial notebooks: every ``tutorials/*.ipynb`` runs top to bottom without error, and the
committed notebooks are the ones their sources build, executed, with their figures.

Notebooks are found by globbing, so a new tutorial is tested as soon as it is committed. They
are authored as ``tutorials/src/NN_name.py`` and built with ``scripts/build_tutorials.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # a hung cell fails the test instead of the whole run
NOTEBOOK_BUDGET_S = 240  # each notebook should run in well under 2 minutes on 2 cores

nbformat = pytest.importorskip("nbformat")


def _build_script():
    return load_script("build_tutorials")


@pytest.mark.slow  # ~4 min for all; .ci/run runs them after the default run
@pytest.mark.timeout(NOTEBOOK_BUDGET_S * 2)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, monkeypatch, tmp_path):
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from nbclient import NotebookClient

    # Plans must not depend on a developer's profiling database (the kernel inherits this);
    # a notebook that measures writes a fresh one outside the checkout.
    monkeypatch.setenv("TVM_FUSION_DB", str(tmp_path / "profiling.db"))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    seconds = time.perf_counter() - start
    images = sum("image/png" in out.get("data", {})
                 for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)
    assert images >= 1, f"{path.name} produced no figure"
    assert seconds < NOTEBOOK_BUDGET_S, f"{path.name} took {seconds:.0f} s"


def test_committed_notebooks_match_their_sources():
    problems = _build_script().check()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_shows_its_results(path):
    """Outputs are committed: every code cell ran, no cell errored, and a figure is there."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "not executed"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} has no rendered figure"


def test_percent_format_parser():
    parse = _build_script().parse_source
    text = ("# header, not a cell\n# %% [markdown]\n# # Title\n#\n# text\n\n# %%\nx = 1\n\n"
            "# %%\n\n# %% [markdown]\n# more\n")
    assert parse(text) == [("markdown", "# Title\n\ntext"), ("code", "x = 1"),
                           ("markdown", "more")]
    with pytest.raises(ValueError, match="not a comment"):
        parse("# %% [markdown]\nx = 1\n")


def test_every_tutorial_is_listed_in_the_index():
    index = (ROOT / "tutorials" / "README.md").read_text()
    missing = [p.name for p in NOTEBOOKS if p.name not in index]
    assert not missing, f"tutorials/README.md does not list {missing}"


"""The docs point at things that exist: relative links, repository paths, modules, scripts.

A page that names a file, module or script that has moved or never existed (a ``docs/platform.md``,
a module renamed by a refactoring) misleads the next reader; these checks make such a page fail
here instead. Paths and commands are checked in code blocks too (what a reader copies); links
only in the prose.
"""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "tutorials" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]
# Text that names repository paths: the pages, the packaging and the package's own messages.
SOURCES = [*PAGES, ROOT / "setup.py", *sorted((ROOT / "tvm_fusion").rglob("*.py"))]
# Placeholders that stand for a family of files, not one path (a `rev:path` of git is skipped).
PLACEHOLDERS = {"docs/plans/X.html", "tutorials/src/NN_name.py"}

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w/.:-])((?:docs|tutorials|scripts)/[\w./*-]+"
                       r"\.(?:md|png|html|ipynb|py))")
# `relay_passes/ecg.py`, `tvm_fusion/layout/`: a path inside the package, written from its root
PACKAGE_PATH = re.compile(r"`(?:tvm_fusion/)?((?:relay_passes|layout|tir_schedules|tuning|fuzz)"
                          r"/[\w/.*]*)`")
MODULE_RUN = re.compile(r"python -m (tvm_fusion[\w.]*)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"\s", "-", text)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    prose = re.sub(r"```.*?```|`[^`\n]*`", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve()
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+\s+(.*)$", dest.read_text(encoding="utf-8"), re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{_rel(page)}: links that do not resolve: {broken}"


@pytest.mark.parametrize("source", SOURCES, ids=_rel)
def test_named_repository_paths_exist(source):
    text = source.read_text(encoding="utf-8")
    missing = [p for p in REPO_PATH.findall(text)
               if p not in PLACEHOLDERS and not any(ROOT.glob(p))]
    missing += [p for p in PACKAGE_PATH.findall(text) if not any((ROOT / "tvm_fusion").glob(p))]
    assert not missing, f"{_rel(source)} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_python_m_modules_exist(page):
    missing = [m for m in MODULE_RUN.findall(page.read_text(encoding="utf-8"))
               if importlib.util.find_spec(m.rstrip(".")) is None]
    assert not missing, f"{_rel(page)}: `python -m` of modules that do not exist: {missing}"

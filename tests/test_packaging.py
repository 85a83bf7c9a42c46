"""What an installed wheel promises: its messages point at things it ships, its requirements
stay CPU-only, its metadata carries the license and the README.

A wheel holds ``tvm_fusion/`` and nothing else of the repository, so an error or help text that
says "run scripts/x.py" sends an installed user to a file they do not have.
"""

import ast
import importlib.util
import re
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tvm_fusion"


def _docstring_nodes(tree: ast.Module) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree)
                     if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
    return {id(n.body[0].value) for n in nodes
            if n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}


def _messages(path: Path) -> list[str]:
    """The string literals of a module a user can see: everything but docstrings, and the module
    docstring where an argparse parser shows it as the command's help."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    skip = _docstring_nodes(tree)
    inside_fstring = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr)
                      for v in n.values}
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            texts.append("".join(v.value if isinstance(v, ast.Constant) else "{}"
                                 for v in node.values))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in skip and id(node) not in inside_fstring):
            texts.append(node.value)
    if "ArgumentParser" in source and "__doc__" in source and ast.get_docstring(tree):
        texts.append(ast.get_docstring(tree))
    return texts


def _package_messages() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), text) for p in sorted(PACKAGE.rglob("*.py"))
            for text in _messages(p)]


def test_messages_name_nothing_outside_the_package():
    """No message names a repository script; every ``python -m`` it names can be run."""
    scripts = [(f, t) for f, t in _package_messages() if re.search(r"\bscripts/", t)]
    assert not scripts, f"messages that name a repository script: {scripts}"
    modules = {(f, m) for f, t in _package_messages()
               for m in re.findall(r"python -m ([\w.]+)", t)}
    missing = [(f, m) for f, m in modules if importlib.util.find_spec(m) is None]
    assert not missing, f"`python -m` of modules that do not exist: {missing}"


def _setup_arguments() -> dict[str, ast.expr]:
    """setup.py's ``setup(...)`` keywords as expressions, module constants substituted: read
    from the source, so the test does not depend on the setuptools this Python has (an old
    one drops keywords it does not know, such as ``license_expression``)."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    constants = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                 for target in node.targets if isinstance(target, ast.Name)}
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
               and isinstance(n.func, ast.Name) and n.func.id == "setup"]
    return {k.arg: constants.get(k.value.id, k.value) if isinstance(k.value, ast.Name)
            else k.value for k in call.keywords}


def _literal(name: str):
    return ast.literal_eval(_setup_arguments()[name])


def test_requirements_pull_no_cuda_wheels():
    """``xgboost`` on Linux brings nvidia-nccl-cu12 (~470 MB); xgboost-cpu is the same module."""
    reqs = [Requirement(r) for r in _literal("install_requires")]
    linux = {"sys_platform": "linux", "platform_system": "Linux"}
    on_linux = {r.name for r in reqs if r.marker is None or r.marker.evaluate(linux)}
    assert "xgboost-cpu" in on_linux and "xgboost" not in on_linux
    assert not any(name.startswith("nvidia-") for name in on_linux)


def test_metadata_has_license_readme_and_urls():
    args = _setup_arguments()
    assert _literal("license_expression") == "Apache-2.0"
    assert _literal("license_files") == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").lstrip().startswith("Apache License")
    assert "'README.md'" in ast.unparse(args["long_description"])
    assert _literal("long_description_content_type") == "text/markdown"
    assert _literal("project_urls") and _literal("classifiers")
    assert _literal("python_requires") == ">=3.10"

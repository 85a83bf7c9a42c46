"""``scripts/<name>.py`` imported as a module: scripts/ is not a package, and several tests
check a script's functions (the AArch64 device set-up, the GPU bundle, the generated docs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

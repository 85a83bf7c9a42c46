"""Built modules kept on disk between runs of ``tvm-fusion bench --cache DIR``.

Why: a side-by-side timing must run on a quiet machine, and building 25 models twice takes
most of an hour; with a cache the builds can run beforehand, beside other work, and the quiet
run only loads them. A build is keyed by everything that decides its code: the model file's
bytes, the variant's compile options, the target, the CPU parameters the schedules read from
it (the host's caches included), TVM's version and the source of every ``tvm_fusion`` module
(an edited schedule never reuses an old build).
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

import tvm

from .atomic import atomic_write_with
from .tir_schedules.cpu_target import cpu_params

PACKAGE = Path(__file__).resolve().parent


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """SHA-256 over TVM's version and every ``tvm_fusion`` source file (path and bytes)."""
    digest = hashlib.sha256(tvm.__version__.encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build_key(model_path: str | os.PathLike, options: dict, target: tvm.target.Target) -> str:
    """The cache file name of one build (hex digest)."""
    digest = hashlib.sha256(Path(model_path).read_bytes())
    params = repr(cpu_params(target)) if target.kind.name == "llvm" else ""
    digest.update(json.dumps({"options": options, "target": str(target), "cpu": params,
                              "code": code_fingerprint()}, sort_keys=True,
                             default=str).encode())
    return digest.hexdigest()[:32]


def load_or_build(cache_dir: str | os.PathLike | None, model_path, options: dict,
                  target: tvm.target.Target, build):
    """The executable for ``(model_path, options, target)``: loaded from ``cache_dir`` when a
    build with the same key is there, else ``build()``, exported there atomically (a crash
    mid-write leaves no torn library)."""
    if cache_dir is None:
        return build()
    folder = Path(cache_dir)
    path = folder / f"{build_key(model_path, options, target)}.so"
    if path.exists():
        return tvm.runtime.load_module(str(path))
    executable = build()
    atomic_write_with(path, executable.export_library, suffix=".so")
    return executable

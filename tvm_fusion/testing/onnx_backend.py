"""The installed onnx package's backend test data as extra end-to-end cases."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..feeds import graph_inputs

__all__ = ["load_backend_case", "onnx_backend_model_dirs"]


def _backend_data_root() -> Path:
    return Path(onnx.__file__).parent / "backend" / "test" / "data"


def onnx_backend_model_dirs(
    suites: Iterable[str] = ("light", "pytorch-converted", "pytorch-operator", "simple"),
) -> list[Path]:
    """The installed onnx package's backend test cases, sorted.

    For ``pytorch-converted``, ``pytorch-operator``, ``simple`` (and ``node``, ``real`` if
    asked) each entry is a directory with ``model.onnx`` and ``test_data_set_0/``. The ``light``
    suite has no such directories: its entries are the ``light_<name>.onnx`` files themselves
    (weight-free stand-ins of real CNNs whose expected output is ``light_<name>_output_0.pb``);
    :func:`load_backend_case` accepts both forms.
    """
    root = _backend_data_root()
    cases: list[Path] = []
    for suite in suites:
        sdir = root / suite
        if not sdir.is_dir():
            raise ValueError(f"no backend test suite {suite!r} under {root}")
        for p in sorted(sdir.iterdir()):
            if p.is_dir() and (p / "model.onnx").is_file() and (p / "test_data_set_0").is_dir():
                cases.append(p)
            elif p.is_file() and re.fullmatch(r"light_.+(?<!_output_\d)\.onnx", p.name):
                cases.append(p)
    return cases


def _read_tensor(path: Path) -> np.ndarray:
    t = onnx.TensorProto()
    t.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(t)


def _numbered(d: Path, prefix: str) -> list[Path]:
    files = [p for p in d.glob(f"{prefix}_*.pb") if re.fullmatch(rf"{prefix}_\d+\.pb", p.name)]
    return sorted(files, key=lambda p: int(p.stem.rsplit("_", 1)[1]))


def load_backend_case(
    path: str | Path,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[np.ndarray]]:
    """Load one backend case: (model, feeds by graph-input name, expected outputs).

    ``.pb`` inputs are matched to the non-initializer graph inputs by position (their stored
    names are often empty). For a ``light_*.onnx`` file the inputs are generated the way
    ``onnx.backend.test.runner`` does (``arange(n) / n``, unknown dims as 1), which is what its
    stored output was computed from. Caveat: the light models' weights are ConstantOfShape
    fills, so their stored outputs are constant (a uniform 1/1000 softmax): they check import,
    compile, run and shapes, but say little about numerics.
    """
    path = Path(path)
    if path.is_file():
        model = onnx.load(str(path))
        feeds = {}
        for vi in graph_inputs(model):
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else 1 for d in vi.type.tensor_type.shape.dim
            )
            n = int(np.prod(shape))
            feeds[vi.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
        prefix = path.with_suffix("")
        expected = [
            _read_tensor(Path(f"{prefix}_output_{i}.pb")) for i in range(len(model.graph.output))
        ]
        return model, feeds, expected
    model = onnx.load(str(path / "model.onnx"))
    data = path / "test_data_set_0"
    in_files = _numbered(data, "input")
    inputs = graph_inputs(model)
    if len(in_files) > len(inputs):
        raise ValueError(f"{path}: {len(in_files)} input files for {len(inputs)} graph inputs")
    feeds = {vi.name: _read_tensor(f) for vi, f in zip(inputs, in_files, strict=False)}
    expected = [_read_tensor(f) for f in _numbered(data, "output")]
    return model, feeds, expected


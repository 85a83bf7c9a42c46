"""A ``torch.export``\\ ed program saved with ``torch.export.save`` (``.pt2``), as the commands
take a model: its inputs (with the program's symbolic sizes), its Relax import, its reference.

The commands feed models through ONNX graph inputs (:mod:`tvm_fusion.feeds`); a program's user
inputs are described the same way, as an inputs-only ONNX graph (:attr:`TorchProgram.signature`)
whose symbolic dimensions are the program's own symbols (``s53``), so ``--input-shape``,
random feeds and the run sizes work unchanged. torch is imported only when a program is loaded.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from .errors import FrontendError

# file name endings taken as torch.export programs
PROGRAM_SUFFIXES = (".pt2",)
# the representative run size of a symbol, kept inside the program's range for it
DEFAULT_SIZE = 128

__all__ = ["PROGRAM_SUFFIXES", "TorchProgram", "is_program_path", "load_program"]


def is_program_path(path: str | os.PathLike) -> bool:
    return os.fspath(path).endswith(PROGRAM_SUFFIXES)


@dataclass
class TorchProgram:
    """A loaded ``ExportedProgram`` with what the commands need of a model."""

    program: object
    path: str
    signature: onnx.ModelProto
    ranges: dict = field(default_factory=dict)  # symbol -> (lower, upper or None)

    @property
    def nodes(self) -> int:
        """Operators in the program (FX ``call_function`` nodes)."""
        return sum(1 for n in self.program.graph.nodes if n.op == "call_function")

    def default_sizes(self) -> dict[str, int]:
        """Each symbol's run size when none is given: :data:`DEFAULT_SIZE` (1 for a symbol
        whose range starts at 1 and is at most 64: a batch), inside the program's range."""
        sizes = {}
        for name, (low, high) in self.ranges.items():
            size = 1 if low <= 1 and high is not None and high <= 64 else DEFAULT_SIZE
            sizes[name] = max(low, min(size, high if high is not None else size))
        return sizes

    def import_module(self, repairs=None, report=None):
        from .fx_import import ALL_FX_REPAIRS, from_exported_program  # imports torch

        return from_exported_program(self.program, report=report,
                                     repairs=ALL_FX_REPAIRS if repairs is None else repairs)

    def reference(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The program's outputs on ``feeds`` (by input name), run by PyTorch."""
        import torch

        names = [vi.name for vi in self.signature.graph.input]
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.program.module()(*[torch.from_numpy(np.ascontiguousarray(feeds[n]))
                                          for n in names])
        flat: list = []

        def visit(value):
            if isinstance(value, torch.Tensor):
                flat.append(value.detach().numpy())
            elif isinstance(value, (list, tuple)):
                for item in value:
                    visit(item)
            elif isinstance(value, dict):
                for item in value.values():
                    visit(item)
            elif hasattr(value, "to_tuple"):  # a transformers ModelOutput
                visit(value.to_tuple())
        visit(out)
        return flat


def load_program(path: str | os.PathLike) -> TorchProgram:
    """Load a ``torch.export.save``\\ d program; errors name the file and the cause."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FrontendError(path, "no such file")
    try:
        import torch
    except ImportError:
        raise FrontendError(path, "a torch.export program needs PyTorch: pip install "
                                  "'tvm_fusion[models]'") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.export.load(path)
    except Exception as err:  # noqa: BLE001 (torch raises many kinds)
        text = str(err).strip().splitlines()
        raise FrontendError(path, f"not a torch.export program ({text[0] if text else ''})"
                            ) from None
    return TorchProgram(program, path, _signature(program), _ranges(program))


def _ranges(program) -> dict:
    ranges = {}
    for symbol, rng in getattr(program, "range_constraints", {}).items():
        low, high = _int_or_none(rng.lower), _int_or_none(rng.upper)
        low = 0 if low is None else low
        ranges[str(symbol)] = (max(low, 1), high)
    return ranges


def _int_or_none(bound) -> int | None:
    """A range bound as an int; None for torch's infinity (``int_oo``, which ``int()`` and
    ``float()`` both refuse in their own ways)."""
    try:
        value = int(bound)
    except Exception:  # noqa: BLE001 (sympy's infinities raise TypeError or AttributeError)
        return None
    return value if abs(value) < 2**62 else None


def _signature(program) -> onnx.ModelProto:
    """The program's user inputs as ONNX graph inputs (symbolic sizes as ``dim_param``)."""
    import torch

    user = [s.arg.name for s in program.graph_signature.input_specs
            if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    inputs = []
    for name in user:
        val = placeholders[name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise FrontendError(f"FX input {name!r}", "is not a tensor (only tensor inputs "
                                                      "are supported)")
        dims = [int(d) if isinstance(d, int) else str(d.node.expr) for d in val.shape]
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(str(val.dtype).replace("torch.", "")))
        inputs.append(helper.make_tensor_value_info(name, elem, dims))
    graph = helper.make_graph([], "torch_program", inputs, [])
    return helper.make_model(graph)

"""Model import that survives symbolic exports: TVM 0.27's importers plus repairs.

``from_onnx`` and ``from_exported_program`` call TVM's own importers and repair what they leave
behind, so that every tensor whose shape the model determines has a ``ShapeExpr`` (symbolic
where the export is): docs/frontend.md lists the repairs and the TVM behaviour each works
around. What cannot be imported raises :class:`FrontendError`, one line naming the node.
"""

from .errors import FrontendError
from .fx_repairs import ALL_FX_REPAIRS
from .onnx_import import ALL_REPAIRS, ImportReport, from_onnx
from .torch_program import TorchProgram, is_program_path, load_program

__all__ = ["ALL_FX_REPAIRS", "ALL_REPAIRS", "FrontendError", "ImportReport", "TorchProgram",
           "from_exported_program", "from_onnx", "is_program_path", "load_program"]


def from_exported_program(program, **options):
    """:func:`tvm_fusion.frontend.fx_import.from_exported_program` (TVM's ExportedProgram
    importer with torch's shapes pinned and the FX repairs)."""
    # deferred: TVM's torch frontend imports PyTorch (seconds, and an optional dependency)
    from .fx_import import from_exported_program as import_program

    return import_program(program, **options)

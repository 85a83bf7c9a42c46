"""Model import that survives symbolic exports: TVM 0.27's importers plus repairs.

``from_onnx`` and ``from_exported_program`` call TVM's own importers and repair what they leave
behind, so that every tensor whose shape the model determines has a ``ShapeExpr`` (symbolic
where the export is): see docs/frontend.md for the repairs and the TVM behaviour each works
around. What cannot be imported raises :class:`FrontendError`, one line naming the node.
"""

from .errors import FrontendError
from .fx_import import ALL_FX_REPAIRS, from_exported_program
from .onnx_import import ALL_REPAIRS, ImportReport, from_onnx

__all__ = ["ALL_FX_REPAIRS", "ALL_REPAIRS", "FrontendError", "ImportReport",
           "from_exported_program", "from_onnx"]

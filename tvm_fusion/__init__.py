"""tvm_fusion: operator fusion for Apache TVM beyond FuseOps' fixed rules.

DNNFusion's mapping-type fusion (PLDI'21), Apollo's partition-based fusion, OptiFX's conv→conv
fusion and SmartMem's layout-transform elimination, as passes that compose with
``tvm.transform.Sequential`` (docs/architecture.md says where each one lives). The graph-level
passes live in ``tvm_fusion.relay_passes``: the name is the project's fixed layout; since TVM
0.20 removed Relay, they are written over Relax, Relay's successor.
"""

from . import pipeline, transform
from .compile import compile_model
from .transform import Sequential
from .visualize import visualize  # the function; the module stays tvm_fusion.visualize's home

__version__ = "0.1.0"
version = __version__

__all__ = ["Sequential", "compile_model", "pipeline", "transform", "version", "visualize",
           "__version__"]

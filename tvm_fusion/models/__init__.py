"""Every ONNX model this package builds in code, and the one helper they are built with.

* :mod:`.graph`: :class:`~.graph.GraphBuilder` and :func:`~.graph.make_model`, the graph
  builder every model here (and the test and fuzz generators) uses;
* :mod:`.builtin`: the built-in demo models the CLI names (BERT encoder layer, DNNFusion's
  Figure 3);
* :mod:`.conv_chains`: SISO/SIMO/MISO conv chains for OptiFX's tests and benchmarks;
* :mod:`.recompute`: where a fused loop nest may recompute (the fusion guard's cases);
* :mod:`.swin`: Swin-T's window-attention block, SmartMem's layout-heavy example;
* :mod:`.symbolic`: models with symbolic batch and sequence dimensions.
"""

from .builtin import BUILTIN_MODELS, figure3_graph, get_builtin, transformer_encoder_layer

__all__ = ["BUILTIN_MODELS", "figure3_graph", "get_builtin", "transformer_encoder_layer"]

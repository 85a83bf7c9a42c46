"""The one way this package builds an ONNX model: a graph's inputs, initializers, nodes and
outputs, then the model with its opset and IR version, checked.

Every model builder (:mod:`tvm_fusion.models`, :mod:`tvm_fusion.testing`,
:mod:`tvm_fusion.fuzz`) goes through :class:`GraphBuilder` or :func:`make_model`, so the
choices that make two builds of a model byte-identical (initializer dtypes, opset, IR version,
producer fields) are made in one place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
FLOAT = TensorProto.FLOAT

__all__ = ["FLOAT", "IR_VERSION", "OPSET", "GraphBuilder", "live_nodes", "make_model", "tensor",
           "value_info"]


def value_info(name: str, shape, elem: int = FLOAT, doc: str = "") -> onnx.ValueInfoProto:
    """A tensor's name, element type and shape (``None``: unknown rank; a string dim is
    symbolic); ``doc`` is the value-domain hint :func:`tvm_fusion.feeds.random_inputs` reads."""
    return helper.make_tensor_value_info(name, elem, shape, doc_string=doc)


def tensor(name: str, value, dtype=None) -> onnx.TensorProto:
    """An initializer; float64 values become float32 unless ``dtype`` says otherwise."""
    arr = np.asarray(value, dtype=dtype)
    if dtype is None and arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    return numpy_helper.from_array(arr, name)


def live_nodes(nodes: Sequence[onnx.NodeProto], outputs: Iterable[str]) -> list[onnx.NodeProto]:
    """The nodes some output depends on, in their order (a random graph drops dead ones)."""
    need, kept = set(outputs), []
    for node in reversed(nodes):
        if need.intersection(node.output):
            kept.append(node)
            need.update(i for i in node.input if i)
    return kept[::-1]


def make_model(name: str, nodes: Sequence[onnx.NodeProto],
               inputs: Sequence[onnx.ValueInfoProto],
               outputs: Sequence[onnx.ValueInfoProto | str],
               initializers: Sequence[onnx.TensorProto] = (), *, opset: int = OPSET,
               ir_version: int | None = IR_VERSION, producer: str = "", doc: str = "",
               graph_value_info: Sequence[onnx.ValueInfoProto] = (),
               check: bool = True) -> onnx.ModelProto:
    """The model of one graph in the default domain at ``opset``.

    An output given by name alone gets its type and shape from ONNX shape inference.
    ``ir_version=None`` keeps the installed onnx package's default. ``check`` runs
    ``onnx.checker.check_model(full_check=True)``.
    """
    graph = helper.make_graph(list(nodes), name, list(inputs), [], list(initializers),
                              value_info=list(graph_value_info))
    fields = {k: v for k, v in (("producer_name", producer), ("doc_string", doc)) if v}
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **fields)
    if ir_version is not None:
        model.ir_version = ir_version
    inferred = {}
    if any(isinstance(o, str) for o in outputs):
        inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    model.graph.output.extend(inferred[o] if isinstance(o, str) else o for o in outputs)
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


class GraphBuilder:
    """A graph under construction. Builders add their own naming and bookkeeping on top;
    :meth:`fresh` gives the numbered names most of them use."""

    def __init__(self, name: str, *, opset: int = OPSET, ir_version: int | None = IR_VERSION):
        self.name = name
        self.opset = opset
        self.ir_version = ir_version
        self.inputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []
        self.outputs: list[onnx.ValueInfoProto | str] = []
        self._count = 0

    def fresh(self, prefix: str) -> str:
        """``prefix`` and the next number of one counter shared by every name."""
        self._count += 1
        return f"{prefix}{self._count}"

    def add_input(self, name: str, shape, elem: int = FLOAT, doc: str = "") -> str:
        self.inputs.append(value_info(name, shape, elem, doc))
        return name

    def add_initializer(self, name: str, value, dtype=None) -> str:
        self.initializers.append(tensor(name, value, dtype))
        return name

    def add_node(self, op: str, inputs: Sequence[str], outputs: Sequence[str],
                 name: str | None = None, **attrs) -> list[str]:
        self.nodes.append(helper.make_node(op, list(inputs), list(outputs), name=name, **attrs))
        return list(outputs)

    def add_output(self, name: str, shape=None, elem: int = FLOAT) -> str:
        """A graph output; without ``shape`` its type and shape come from shape inference."""
        self.outputs.append(name if shape is None else value_info(name, shape, elem))
        return name

    def model(self, *, producer: str = "", doc: str = "", check: bool = True,
              prune: bool = False) -> onnx.ModelProto:
        """The model (:func:`make_model`); ``prune`` drops the nodes no output depends on and
        the inputs and initializers nothing then reads."""
        nodes, inputs, inits = self.nodes, self.inputs, self.initializers
        if prune:
            names = [o if isinstance(o, str) else o.name for o in self.outputs]
            nodes = live_nodes(self.nodes, names)
            used = {i for n in nodes for i in n.input} | set(names)
            inputs = [vi for vi in inputs if vi.name in used]
            inits = [t for t in inits if t.name in used]
        return make_model(self.name, nodes, inputs, self.outputs, inits, opset=self.opset,
                          ir_version=self.ir_version, producer=producer, doc=doc, check=check)

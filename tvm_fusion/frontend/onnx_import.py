"""ONNX → Relax through TVM 0.27's importer, with the repairs symbolic exports need.

:class:`RepairingImporter` is TVM's ``ONNXGraphImporter`` with its node loop replaced (TVM's
converter table is a function returning a fresh dict, so converters are not registered there
but consulted here first, which is what the importer's class allows). Per node:

1. small integer tensors are evaluated as values (:mod:`.shape_values`): a shape chain is
   folded into symbolic expressions and emits nothing;
2. an operator with a repair (:mod:`.onnx_repairs`) is converted by it when it applies;
3. everything else goes to TVM's own converter, as ``from_onnx`` would.

A node that fails is named in one line (:class:`.errors.FrontendError`), with TVM's reason.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend as tvm_onnx

from ..onnx_names import name_bindings
from . import onnx_repairs
from .errors import FrontendError, reason_of
from .shape_values import (
    MAX_ELEMENTS,
    VALUE_OPS,
    ShapeAnalyzer,
    as_values,
    evaluate,
    is_concrete,
    to_numpy,
)

# Every repair by name; ``from_onnx(repairs=...)`` takes a subset (the tests switch one off to
# show what it fixes). "shape_values" is the folding of shape chains (:mod:`.shape_values`).
# "int4_weights": 4-bit initializers widened to 8 bits (onnx_repairs.widen_int4_initializers).
ALL_REPAIRS = frozenset({"shape_values", "int4_weights", *onnx_repairs.REPAIRS})

# TVM's converters that take ShapeExpr inputs (``ONNXGraphImporter._construct_nodes``); any
# other converter gets a symbolic value as a tensor.
_SHAPE_COMPATIBLE = {"Reshape", "Resize", "ConstantOfShape", "Gather", "Slice", "Shape", "Expand",
                     "Concat", "Equal", "Where", "Cast", "CastLike", "Squeeze"}
_RETURN_TUPLE = {"Optional", "OptionalGetElement", "SequenceConstruct", "SequenceEmpty",
                 "SequenceErase", "SequenceInsert", "ConcatFromSequence", "SplitToSequence"}
_BOOL_OUT = {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or"}
# Of those, the ones that get a symbolic value as a ShapeExpr/PrimValue: they need a shape.
# Cast, Equal and Where of a value are values themselves (shape_values) unless they leave
# the integers (a Cast to float): then a tensor is what TVM's converter can take on (a
# PrimValue cast to float reached Sqrt as a PrimValue, which Relax cannot take).
_TAKES_SHAPES = _SHAPE_COMPATIBLE - {"Cast", "CastLike", "Equal", "Where"}

__all__ = ["ALL_REPAIRS", "ImportReport", "RepairingImporter", "from_onnx"]


@dataclass
class ImportReport:
    """What an import did: repairs applied (name → count) and tensors left without a shape
    (ONNX node → why: a data-dependent size, or a shape TVM could not infer)."""

    repairs: Counter = field(default_factory=Counter)
    opaque: dict = field(default_factory=dict)

    def used(self) -> list[str]:
        return sorted(self.repairs)


class RepairingImporter(tvm_onnx.ONNXGraphImporter):
    """TVM's ONNX importer with symbolic shape values and converter repairs."""

    def __init__(self, shape_dict, dtype_dict, keep_params_in_input=False, sanitize=True,
                 repairs=ALL_REPAIRS, report: ImportReport | None = None):
        super().__init__(shape_dict, dtype_dict, keep_params_in_input=keep_params_in_input,
                         sanitize=sanitize)
        unknown = set(repairs) - ALL_REPAIRS
        if unknown:
            raise ValueError(f"unknown repair {sorted(unknown)[0]!r}; known: "
                             f"{', '.join(sorted(ALL_REPAIRS))}")
        self.repairs = frozenset(repairs)
        self.report = report if report is not None else ImportReport()
        self.analyzer = ShapeAnalyzer()
        # ONNX tensor name -> (object array of ints/bools/PrimExprs, dtype)
        self._values: dict[str, tuple[np.ndarray, str]] = {}
        # per converted node: (its name, the expressions it became), for onnx_names
        self.results: list[tuple[str, list]] = []

    # -- TVM's hooks --------------------------------------------------------------------------

    def _check_for_unsupported_ops(self, graph):
        missing = sorted({n.op_type for n in graph.node} - set(tvm_onnx._get_convert_map())
                         - set(onnx_repairs.CONVERTERS) - {"If", "Constant"})
        if missing:
            node = next(n for n in graph.node if n.op_type == missing[0])
            raise FrontendError(_where(node), f"operator {missing[0]} is not supported by "
                                              f"TVM's ONNX importer" + (
                f" (nor {', '.join(missing[1:])})" if len(missing) > 1 else ""))

    def _construct_nodes(self, graph):
        for var in self._inputs.values():
            for dim in getattr(var.ty, "shape", None) or []:
                for free in tirx.analysis.undefined_vars(dim, []):
                    self.analyzer.add_dim(free)
        for node in graph.node:
            failure = None
            try:
                self._convert_node(node)
            except FrontendError:
                raise
            except Exception as err:  # noqa: BLE001 (TVM's converters raise anything)
                failure = FrontendError(_where(node), reason_of(err))
            if failure is not None:  # raised outside the handler: TVM's error is not kept as
                raise failure  # its context (its frames hold the half-built function)
        for out in graph.output:  # graph outputs that are values get a tensor
            if out.name in self._values and out.name not in self._nodes:
                self._nodes[out.name] = self.materialize(out.name)

    # -- one node -----------------------------------------------------------------------------

    def _convert_node(self, node: onnx.NodeProto) -> None:
        op = node.op_type
        attr = self._parse_attr(node.attribute)
        attr["tvm_custom"] = {"name": node.name, "num_outputs": len(node.output)}
        if op == "If":
            self._convert_if(node, attr)
            return
        if "shape_values" in self.repairs and self._fold_values(node, attr):
            return
        inputs = tvm_onnx.onnx_input()
        values = []
        for name in node.input:
            values.append(self.value(name) if name else None)
            inputs.append(self._input_expr(name, op) if name else None)
        out = None
        converter = onnx_repairs.CONVERTERS.get(op)
        if converter is not None and converter.repair in self.repairs:
            out = converter(self, node, attr, inputs, values)
            if out is not None:
                out = self.bb.normalize(out)
                self.report.repairs[converter.repair] += 1
        if out is None:
            for i, inp in enumerate(inputs):
                if isinstance(inp, relax.Expr) and isinstance(inp.ty, relax.ShapeType) and (
                        op not in _SHAPE_COMPATIBLE):
                    inputs[i] = self.bb.normalize(relax.op.shape_to_tensor(inp))
            out = self._convert_operator(op, inputs, attr, self.opset)
        self._bind_outputs(node, out)

    def _bind_outputs(self, node, out) -> None:
        outputs = list(node.output)
        if node.op_type in _RETURN_TUPLE:
            results = [out]
        elif isinstance(out, relax.Tuple):
            results = list(out.fields)
        elif isinstance(out, relax.Expr) and isinstance(out.ty, relax.TupleType):
            results = [self.bb.emit(relax.TupleGetItem(out, i)) for i in range(len(out.ty.fields))]
        else:
            results = [out]
        if len(outputs) > len(results):
            raise FrontendError(_where(node), f"{len(outputs)} outputs expected, the converter "
                                              f"gave {len(results)}")
        self.results.append((_node_name(node), [*results, out] if results != [out] else results))
        for name, result in zip(outputs, results):
            self._nodes[name] = result
            ty = getattr(result, "ty", None)
            if isinstance(ty, relax.TensorType) and ty.shape is None and name:
                self.report.opaque.setdefault(_where(node), "TVM inferred no shape")

    def _convert_if(self, node, attr) -> None:
        """TVM's own handling of ``If`` (branches as subgraphs), as in its node loop."""
        cond = self._input_expr(node.input[0], "If")
        then_expr = self._convert_subgraph(self.bb, attr["then_branch"])
        else_expr = self._convert_subgraph(self.bb, attr["else_branch"])
        result = self.bb.emit(relax.If(cond, relax.SeqExpr([], then_expr),
                                       relax.SeqExpr([], else_expr)))
        self.results.append((_node_name(node), [result]))
        if len(node.output) == 1:
            self._nodes[node.output[0]] = result
        else:
            for i, name in enumerate(node.output):
                self._nodes[name] = self.bb.emit(relax.TupleGetItem(result, i))

    # -- values -------------------------------------------------------------------------------

    def _fold_values(self, node, attr) -> bool:
        """Evaluate the node's outputs as values; True when they all were (nothing emitted)."""
        op = node.op_type
        if op in ("Shape", "Size"):
            dims = self.static_dims(node.input[0])
            if dims is None:
                return False
            if op == "Size":
                total = 1
                for d in dims:
                    total = total * d
                outs = [as_values(self.analyzer.simplify(total)) if not isinstance(total, int)
                        else as_values(total)]
            else:
                start, end = attr.get("start", 0), attr.get("end")
                arr = np.empty(len(dims), dtype=object)
                arr[:] = dims
                outs = [arr[start:end]]
            dtypes = ["int64"]
        elif op in VALUE_OPS:
            values = [self.value(name) if name else None for name in node.input]
            if any(v is None for v, name in zip(values, node.input) if name):
                return False  # an input that is data, not a value
            outs = evaluate(op, attr, values, self.analyzer)
            if outs is None:
                return False
            dtypes = [self._value_dtype(node, attr)]
        else:
            return False
        for name, arr, dtype in zip(node.output, outs, dtypes * len(node.output)):
            self._values[name] = (arr, dtype)
            self._nodes.pop(name, None)
            if is_concrete(arr):
                self._nodes[name] = relax.const(to_numpy(arr, dtype), dtype)
        if not all(is_concrete(arr) for arr in outs):
            self.report.repairs["shape_values"] += 1
        return True

    def _value_dtype(self, node, attr) -> str:
        if node.op_type == "Cast":
            return tvm_onnx.get_type(attr["to"])
        if node.op_type in _BOOL_OUT:
            return "bool"
        if node.op_type == "ConstantOfShape":
            return str(onnx.numpy_helper.to_array(attr["value"]).dtype)
        source = node.input[1] if node.op_type == "Where" else node.input[0]
        if node.op_type == "Range":
            source = node.input[0]
        known = self._values.get(source)
        if known is not None:
            return known[1]
        return str(self._nodes[source].ty.dtype)

    def value(self, name: str) -> np.ndarray | None:
        """The value of ONNX tensor ``name`` (object array), or None when it is not known."""
        if name in self._values:
            return self._values[name][0]
        expr = self._nodes.get(name)
        if isinstance(expr, tvm.ir.GenericConst):
            dtype = str(expr.ty.dtype)
            if (dtype.startswith(("int", "uint")) or dtype == "bool") and (
                    int(np.prod(expr.value.shape)) <= MAX_ELEMENTS):
                array = expr.value.numpy()
                values = np.array(array.tolist(), dtype=object).reshape(array.shape)
                self._values[name] = (values, dtype)
                return values
        elif isinstance(expr, relax.ShapeExpr):
            return as_values(np.array([self.analyzer.simplify(v) for v in expr.values] or [],
                                      dtype=object))
        return None

    def static_dims(self, name: str) -> list | None:
        """The dimensions (ints or PrimExprs) of tensor ``name``, when its shape is known."""
        if name in self._values:
            return list(self._values[name][0].shape)
        ty = getattr(self._nodes.get(name), "ty", None)
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            return None
        return [self.analyzer.simplify(d) for d in ty.shape]

    def materialize(self, name: str) -> relax.Expr:
        """The tensor of a symbolic value (computed at run time from the shape variables)."""
        values, dtype = self._values[name]
        flat = [tirx.Select(v, tirx.IntImm("int64", 1), tirx.IntImm("int64", 0))
                if not isinstance(v, (int, bool)) and str(v.ty) == "bool" else v
                for v in values.flat]
        flat = [int(v) if isinstance(v, (bool, np.bool_)) else v for v in flat]
        tensor = self.bb.normalize(relax.op.shape_to_tensor(relax.ShapeExpr(flat)))
        if values.shape != (len(flat),):
            tensor = self.bb.normalize(relax.op.reshape(tensor, list(values.shape)))
        if dtype != "int64":
            tensor = self.bb.normalize(relax.op.astype(tensor, dtype))
        self._nodes[name] = tensor
        return tensor

    def _input_expr(self, name: str, op: str) -> relax.Expr:
        """The Relax expression TVM's converter for ``op`` gets for input ``name``."""
        if name in self._nodes:
            return self._nodes[name]
        values, dtype = self._values[name]
        if op in _TAKES_SHAPES and dtype == "int64" and values.ndim == 1:
            return relax.ShapeExpr(list(values.flat))
        if op in _TAKES_SHAPES and dtype == "int64" and values.ndim == 0:
            return relax.prim_value(values[()])
        return self.materialize(name)


def _node_name(node: onnx.NodeProto) -> str:
    """What :mod:`tvm_fusion.onnx_names` calls a node: its name, else ``Op → its output``."""
    if node.name:
        return node.name
    outputs = [o for o in node.output if o]
    return f"{node.op_type} → {outputs[0]}" if outputs else node.op_type


def _where(node: onnx.NodeProto) -> str:
    name = node.name or (node.output[0] if node.output else "?")
    return f"ONNX node {name!r} ({node.op_type})"


def from_onnx(model: onnx.ModelProto, shape_dict: dict | None = None, *,
              dtype_dict="float32", opset: int | None = None, keep_params_in_input=False,
              repairs=ALL_REPAIRS, report: ImportReport | None = None,
              node_names: bool = False) -> tvm.IRModule:
    """Import an ONNX model with TVM's importer and the repairs (:data:`ALL_REPAIRS`).

    Arguments are ``tvm.relax.frontend.onnx.from_onnx``'s; ``repairs`` selects repairs (all by
    default; an empty set is stock TVM's import through this loop) and ``report`` (an
    :class:`ImportReport`) receives which ones applied; ``node_names=True`` spans every binding
    with the name of the ONNX node it came from (:mod:`tvm_fusion.onnx_names`). Raises
    :class:`FrontendError` naming the node that cannot be imported."""
    if model.ir_version < 3:
        raise FrontendError("ONNX model", f"IR version {model.ir_version} is older than 3")
    importer = RepairingImporter(shape_dict, dtype_dict, keep_params_in_input=keep_params_in_input,
                                 repairs=repairs, report=report)
    if opset is None:
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    if "int4_weights" in importer.repairs:
        model, widened = onnx_repairs.widen_int4_initializers(model)
        importer.report.repairs["int4_weights"] += widened
    printed = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
        warnings.simplefilter("ignore")
        mod = importer.from_onnx(model.graph, opset)
    return name_bindings(mod, importer.results) if node_names else mod

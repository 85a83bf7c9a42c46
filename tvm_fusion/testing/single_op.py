"""One ONNX model per operator of DNNFusion's Table 2 (plus the ops the passes rely on), with
the mapping type the classifier must give it: the fixtures of the mapping-type and
single-operator tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..feeds import HINT_BOUND, HINT_POSITIVE, HINT_UNIT
from ..models.graph import IR_VERSION, OPSET, make_model, tensor, value_info

__all__ = ["SINGLE_OP_EXPECTED", "SINGLE_OP_TYPES", "single_op_model"]


def _vi(name: str, shape, elem: int = TensorProto.FLOAT, hint: str = "") -> onnx.ValueInfoProto:
    return value_info(name, shape, elem, doc=hint)


class _Spec:
    """What one single-op model needs: inputs, initializers, outputs, attributes, opset."""

    def __init__(self, inputs, outputs, inits=(), attrs=None, opset=OPSET, node_inputs=None):
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.inits = list(inits)
        self.attrs = dict(attrs or {})
        self.opset = opset
        self.node_inputs = node_inputs  # default: the graph inputs, then the initializers


def _w(rng: np.random.Generator, shape, fan_in: int) -> np.ndarray:
    return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)


_X4 = [2, 8, 4, 4]  # default activation shape for elementwise ops


def _unary(hint: str = "") -> Callable[..., _Spec]:
    def build(rng, shape=None):
        shape = list(shape or _X4)
        return _Spec([_vi("x", shape, hint=hint)], [_vi("y", shape)])

    return build


def _binary(hint_b: str = "", hint_a: str = "", out_elem: int = TensorProto.FLOAT):
    def build(rng, shape=None):
        shape = list(shape or _X4)
        return _Spec(
            [_vi("a", shape, hint=hint_a), _vi("b", shape, hint=hint_b)],
            [_vi("y", shape, out_elem)],
        )

    return build


def _spec_cast(rng, shape=None):
    shape = list(shape or _X4)
    return _Spec(
        [_vi("x", shape)], [_vi("y", shape, TensorProto.INT32)], attrs={"to": TensorProto.INT32}
    )


def _spec_clip(rng, shape=None):
    shape = list(shape or _X4)
    inits = [tensor("min", np.float32(-0.5)), tensor("max", np.float32(0.5))]
    return _Spec([_vi("x", shape)], [_vi("y", shape)], inits)


def _spec_batchnorm(rng, shape=None):
    shape = list(shape or _X4)
    c = shape[1]
    inits = [
        tensor("scale", 1 + 0.1 * rng.standard_normal(c)),
        tensor("bias", 0.1 * rng.standard_normal(c)),
        tensor("mean", 0.1 * rng.standard_normal(c)),
        tensor("var", 0.5 + rng.random(c)),
    ]
    return _Spec([_vi("x", shape)], [_vi("y", shape)], inits, {"epsilon": 1e-5})


def _spec_concat(rng, shape=None):
    return _Spec(
        [_vi("a", [2, 4, 4, 4]), _vi("b", [2, 6, 4, 4])],
        [_vi("y", [2, 10, 4, 4])],
        attrs={"axis": 1},
    )


def _spec_leakyrelu(rng, shape=None):
    spec = _unary()(rng, shape)
    spec.attrs["alpha"] = 0.1
    return spec


def _spec_not(rng, shape=None):
    shape = list(shape or _X4)
    return _Spec([_vi("x", shape, TensorProto.BOOL)], [_vi("y", shape, TensorProto.BOOL)])


def _spec_prelu(rng, shape=None):
    shape = list(shape or _X4)
    slope = tensor("slope", 0.25 * rng.random((shape[1], 1, 1)))
    return _Spec([_vi("x", shape)], [_vi("y", shape)], [slope])


def _spec_slice(rng, shape=None):
    inits = [
        tensor("starts", [1, 0], np.int64),
        tensor("ends", [7, 8], np.int64),
        tensor("axes", [2, 3], np.int64),
        tensor("steps", [1, 2], np.int64),
    ]
    return _Spec([_vi("x", [2, 8, 8, 8])], [_vi("y", [2, 8, 6, 4])], inits)


def _spec_split(rng, shape=None):
    return _Spec(
        [_vi("x", [2, 8, 4, 4])],
        [_vi("y0", [2, 3, 4, 4]), _vi("y1", [2, 5, 4, 4])],
        [tensor("split", [3, 5], np.int64)],
        {"axis": 1},
    )


def _spec_where(rng, shape=None):
    shape = list(shape or _X4)
    return _Spec(
        [_vi("cond", shape, TensorProto.BOOL), _vi("a", shape), _vi("b", shape)], [_vi("y", shape)]
    )


def _spec_greater(rng, shape=None):
    return _binary(out_elem=TensorProto.BOOL)(rng, shape)


def _spec_expand(rng, shape=None):
    return _Spec([_vi("x", [4, 1])], [_vi("y", [2, 4, 5])], [tensor("shape", [2, 4, 5], np.int64)])


def _spec_gather(rng, shape=None):
    return _Spec(
        [_vi("data", [10, 8]), _vi("indices", [3, 4], TensorProto.INT64, hint=f"{HINT_BOUND}=10")],
        [_vi("y", [3, 4, 8])],
        attrs={"axis": 0},
    )


def _spec_resize(rng, shape=None):
    return _Spec(
        [_vi("x", [1, 4, 4, 4])],
        [_vi("y", [1, 4, 8, 8])],
        [tensor("scales", [1, 1, 2, 2], np.float32)],
        {"mode": "nearest"},
        node_inputs=["x", "", "scales"],  # roi is unused for nearest
    )


def _spec_upsample(rng, shape=None):
    # Upsample is deprecated since opset 10 (replaced by Resize); opset 9 is the newest version
    # where it is a valid operator, so this one model is built at opset 9.
    return _Spec(
        [_vi("x", [1, 4, 4, 4])],
        [_vi("y", [1, 4, 8, 8])],
        [tensor("scales", [1, 1, 2, 2], np.float32)],
        {"mode": "nearest"},
        opset=9,
    )


def _spec_avgpool(rng, shape=None):
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1]}
    return _Spec([_vi("x", [1, 8, 8, 8])], [_vi("y", [1, 8, 8, 8])], attrs=attrs)


def _spec_maxpool(rng, shape=None):
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}
    return _Spec([_vi("x", [1, 8, 8, 8])], [_vi("y", [1, 8, 4, 4])], attrs=attrs)


def _spec_conv(rng, shape=None):
    inits = [tensor("w", _w(rng, (16, 8, 3, 3), 72)), tensor("b", 0.1 * rng.standard_normal(16))]
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    return _Spec([_vi("x", [1, 8, 8, 8])], [_vi("y", [1, 16, 8, 8])], inits, attrs)


def _spec_convtranspose(rng, shape=None):
    inits = [tensor("w", _w(rng, (8, 4, 3, 3), 72)), tensor("b", 0.1 * rng.standard_normal(4))]
    attrs = {
        "kernel_shape": [3, 3],
        "strides": [2, 2],
        "pads": [1, 1, 1, 1],
        "output_padding": [1, 1],
    }
    return _Spec([_vi("x", [1, 8, 4, 4])], [_vi("y", [1, 4, 8, 8])], inits, attrs)


def _spec_cumsum(rng, shape=None):
    return _Spec([_vi("x", [2, 8, 6])], [_vi("y", [2, 8, 6])], [tensor("axis", 2, np.int64)])


def _spec_einsum(rng, shape=None):
    return _Spec(
        [_vi("a", [2, 4, 5]), _vi("b", [2, 5, 3])],
        [_vi("y", [2, 4, 3])],
        attrs={"equation": "bij,bjk->bik"},
    )


def _spec_gemm(rng, shape=None):
    # transB=1 with a [N, K] weight is how PyTorch exports nn.Linear through Gemm.
    inits = [tensor("w", _w(rng, (6, 8), 8)), tensor("c", 0.1 * rng.standard_normal(6))]
    attrs = {"alpha": 1.0, "beta": 1.0, "transB": 1}
    return _Spec([_vi("a", [4, 8])], [_vi("y", [4, 6])], inits, attrs)


def _spec_matmul(rng, shape=None):
    return _Spec([_vi("a", [2, 4, 8])], [_vi("y", [2, 4, 6])], [tensor("w", _w(rng, (8, 6), 8))])


def _spec_instnorm(rng, shape=None):
    shape = list(shape or _X4)
    c = shape[1]
    inits = [
        tensor("scale", 1 + 0.1 * rng.standard_normal(c)),
        tensor("bias", 0.1 * rng.standard_normal(c)),
    ]
    return _Spec([_vi("x", shape)], [_vi("y", shape)], inits, {"epsilon": 1e-5})


def _spec_layernorm(rng, shape=None):
    inits = [
        tensor("scale", 1 + 0.1 * rng.standard_normal(16)),
        tensor("bias", 0.1 * rng.standard_normal(16)),
    ]
    return _Spec(
        [_vi("x", [2, 4, 16])], [_vi("y", [2, 4, 16])], inits, {"axis": -1, "epsilon": 1e-5}
    )


def _spec_reduce_attr(rng, shape=None):
    # ReduceMean/ReduceProd keep ``axes`` as an attribute up to opset 17.
    return _Spec([_vi("x", _X4)], [_vi("y", [2, 1, 4, 4])], attrs={"axes": [1], "keepdims": 1})


def _spec_reducesum(rng, shape=None):
    # ReduceSum takes ``axes`` as an input since opset 13.
    return _Spec(
        [_vi("x", _X4)], [_vi("y", [2, 8, 4])], [tensor("axes", [3], np.int64)], {"keepdims": 0}
    )


def _spec_softmax(rng, shape=None):
    return _Spec([_vi("x", [2, 4, 16])], [_vi("y", [2, 4, 16])], attrs={"axis": -1})


def _spec_flatten(rng, shape=None):
    return _Spec([_vi("x", _X4)], [_vi("y", [2, 128])], attrs={"axis": 1})


def _spec_reshape(rng, shape=None):
    return _Spec([_vi("x", _X4)], [_vi("y", [2, 8, 16])], [tensor("shape", [2, 8, 16], np.int64)])


def _spec_squeeze(rng, shape=None):
    return _Spec([_vi("x", [2, 1, 8, 1])], [_vi("y", [2, 8])], [tensor("axes", [1, 3], np.int64)])


def _spec_unsqueeze(rng, shape=None):
    return _Spec([_vi("x", [2, 8, 4])], [_vi("y", [2, 1, 8, 4])], [tensor("axes", [1], np.int64)])


def _spec_depthtospace(rng, shape=None):
    return _Spec([_vi("x", [1, 16, 4, 4])], [_vi("y", [1, 4, 8, 8])], attrs={"blocksize": 2})


def _spec_spacetodepth(rng, shape=None):
    return _Spec([_vi("x", [1, 4, 8, 8])], [_vi("y", [1, 16, 4, 4])], attrs={"blocksize": 2})


def _spec_transpose(rng, shape=None):
    return _Spec([_vi("x", _X4)], [_vi("y", [2, 4, 4, 8])], attrs={"perm": [0, 2, 3, 1]})


def _spec_gelu(rng, shape=None):
    # Gelu is an opset-20 operator; the model is built at opset 20 (IR version 9).
    shape = list(shape or _X4)
    return _Spec([_vi("x", shape)], [_vi("y", shape)], opset=20)


def _spec_pad(rng, shape=None):
    inits = [
        tensor("pads", [0, 0, 1, 2, 0, 0, 1, 2], np.int64),
        tensor("value", np.float32(0.5)),
    ]
    return _Spec([_vi("x", [1, 4, 4, 4])], [_vi("y", [1, 4, 6, 8])], inits, {"mode": "constant"})


def _spec_add_broadcast(rng, shape=None):
    # A true expansion: every input element is read by several outputs ([4,1] + [1,5] -> [4,5]).
    return _Spec([_vi("a", [4, 1]), _vi("b", [1, 5])], [_vi("y", [4, 5])])


def _spec_add_bias(rng, shape=None):
    # A per-channel constant bias: the output has the activation's shape, so no expansion.
    bias = tensor("bias", 0.1 * rng.standard_normal((1, 8, 1, 1)))
    return _Spec([_vi("x", [1, 8, 4, 4])], [_vi("y", [1, 8, 4, 4])], [bias])


# op_type -> (ONNX op actually emitted, spec builder)
_SINGLE_OPS: dict[str, tuple[str, Callable[..., _Spec]]] = {
    # Table 2, One-to-One
    "Add": ("Add", _binary()),
    "Asin": ("Asin", _unary(HINT_UNIT)),
    "BatchNormalization": ("BatchNormalization", _spec_batchnorm),
    "Cast": ("Cast", _spec_cast),
    "Ceil": ("Ceil", _unary()),
    "Clip": ("Clip", _spec_clip),
    "Concat": ("Concat", _spec_concat),
    "Cos": ("Cos", _unary()),
    "Erf": ("Erf", _unary()),
    "Exp": ("Exp", _unary()),
    "Greater": ("Greater", _spec_greater),
    "LeakyRelu": ("LeakyRelu", _spec_leakyrelu),
    "Log": ("Log", _unary(HINT_POSITIVE)),
    "Not": ("Not", _spec_not),
    "PRelu": ("PRelu", _spec_prelu),
    "Reciprocal": ("Reciprocal", _unary(HINT_POSITIVE)),
    "Relu": ("Relu", _unary()),
    "Round": ("Round", _unary()),
    "Sigmoid": ("Sigmoid", _unary()),
    "Sin": ("Sin", _unary()),
    "Slice": ("Slice", _spec_slice),
    "Split": ("Split", _spec_split),
    "Sqrt": ("Sqrt", _unary(HINT_POSITIVE)),
    "Tanh": ("Tanh", _unary()),
    "Where": ("Where", _spec_where),
    # Table 2, One-to-Many
    "Expand": ("Expand", _spec_expand),
    "Gather": ("Gather", _spec_gather),
    "Resize": ("Resize", _spec_resize),
    "Upsample": ("Upsample", _spec_upsample),
    "AddBroadcast": ("Add", _spec_add_broadcast),
    # Table 2, Many-to-Many
    "AveragePool": ("AveragePool", _spec_avgpool),
    "Conv": ("Conv", _spec_conv),
    "ConvTranspose": ("ConvTranspose", _spec_convtranspose),
    "CumSum": ("CumSum", _spec_cumsum),
    "Einsum": ("Einsum", _spec_einsum),
    "Gemm": ("Gemm", _spec_gemm),
    "InstanceNormalization": ("InstanceNormalization", _spec_instnorm),
    "MaxPool": ("MaxPool", _spec_maxpool),
    "ReduceProd": ("ReduceProd", _spec_reduce_attr),
    "ReduceMean": ("ReduceMean", _spec_reduce_attr),
    "Softmax": ("Softmax", _spec_softmax),
    # Table 2, Reorganize
    "Flatten": ("Flatten", _spec_flatten),
    "Reshape": ("Reshape", _spec_reshape),
    "Squeeze": ("Squeeze", _spec_squeeze),
    "Unsqueeze": ("Unsqueeze", _spec_unsqueeze),
    # Table 2, Shuffle
    "DepthToSpace": ("DepthToSpace", _spec_depthtospace),
    "SpaceToDepth": ("SpaceToDepth", _spec_spacetodepth),
    "Transpose": ("Transpose", _spec_transpose),
    # Not in Table 2 but used by the paper (Table 4, §4.2, Table 5) or by the passes
    "Mul": ("Mul", _binary()),
    "Sub": ("Sub", _binary()),
    "Div": ("Div", _binary(hint_b=HINT_POSITIVE)),
    "Pow": ("Pow", _binary(hint_a=HINT_POSITIVE)),
    "MatMul": ("MatMul", _spec_matmul),
    "ReduceSum": ("ReduceSum", _spec_reducesum),
    "LayerNormalization": ("LayerNormalization", _spec_layernorm),
    "Gelu": ("Gelu", _spec_gelu),
    "Pad": ("Pad", _spec_pad),
    "AddBias": ("Add", _spec_add_bias),
}


#: Every op_type :func:`single_op_model` accepts, in Table 2 order.
SINGLE_OP_TYPES: tuple[str, ...] = tuple(_SINGLE_OPS)

O2O, O2M, M2M, REORG, SHUF = "ONE_TO_ONE", "ONE_TO_MANY", "MANY_TO_MANY", "REORGANIZE", "SHUFFLE"

_TABLE2_AND_EXTRAS = {
    O2O: (
        # Table 2, One-to-One
        "Add Asin BatchNormalization Cast Ceil Clip Concat Cos Erf Exp Greater LeakyRelu Log Not "
        "PRelu Reciprocal Relu Round Sigmoid Sin Slice Split Sqrt Tanh Where "
        # element-wise ops the paper uses in Table 4 / §6 / §4.4.1 (spec §1.3)
        "Mul Sub Div Pow "
        # Gelu is element-wise: one input element -> one output element
        "Gelu "
        # A per-channel constant bias is not an expansion (spec §8.1, "expanding_only" policy)
        "AddBias "
        # Pad copies each input element to exactly one output element at an offset (an
        # injective, Slice-like index map); the border elements are constants that read no input.
        # Nothing is replicated or reduced, so it is O2O like Slice/Concat.
        "Pad"
    ),
    # Table 2, One-to-Many; AddBroadcast is "Elementwise w/ broadcast" as a true expansion
    O2M: "Expand Gather Resize Upsample AddBroadcast",
    M2M: (
        # Table 2, Many-to-Many
        "AveragePool Conv ConvTranspose CumSum Einsum Gemm InstanceNormalization MaxPool "
        "ReduceProd ReduceMean Softmax "
        # MatMul like GEMM (Table 5), ReduceSum (§4.2), LayerNormalization like InstanceNorm
        "MatMul ReduceSum LayerNormalization"
    ),
    REORG: "Flatten Reshape Squeeze Unsqueeze",
    SHUF: "DepthToSpace SpaceToDepth Transpose",
}

#: The DNNFusion mapping type (paper Table 2, spec §1.3/§8.1) the classifier must give each model.
SINGLE_OP_EXPECTED: dict[str, str] = {
    op: kind for kind, ops in _TABLE2_AND_EXTRAS.items() for op in ops.split()
}
assert set(SINGLE_OP_EXPECTED) == set(_SINGLE_OPS)


def single_op_model(op_type: str, seed: int = 0, **kwargs) -> onnx.ModelProto:
    """A one-node ONNX model for ``op_type`` (a key of :data:`SINGLE_OP_EXPECTED`).

    Static shapes; weights are initializers; inputs whose domain is restricted carry a
    ``doc_string`` hint (``positive``/``unit_interval``/``bound=N``) that
    :func:`tvm_fusion.feeds.random_inputs` honours. Opset 17 / IR 8, except Upsample (opset 9:
    it was removed after 9) and Gelu (opset 20 / IR 9: it was added in 20). Keyword arguments:
    ``shape`` (main input shape, for elementwise/normalisation ops), ``opset``, and anything
    else overrides a node attribute.
    """
    try:
        onnx_op, build = _SINGLE_OPS[op_type]
    except KeyError:
        raise ValueError(
            f"unknown single-op model {op_type!r}; valid: {', '.join(SINGLE_OP_TYPES)}"
        ) from None
    rng = np.random.default_rng(seed)
    shape = kwargs.pop("shape", None)
    opset = kwargs.pop("opset", None)
    spec = build(rng, shape=shape) if shape is not None else build(rng)
    spec.attrs.update(kwargs)
    if opset is not None:
        spec.opset = opset
    node_inputs = spec.node_inputs
    if node_inputs is None:
        node_inputs = [vi.name for vi in spec.inputs] + [t.name for t in spec.inits]
    node = helper.make_node(
        onnx_op, node_inputs, [vi.name for vi in spec.outputs], name=op_type.lower(), **spec.attrs
    )
    # Not checked here: tests/test_models_and_testing.py checks every op's model, and a model
    # built with overrides is its caller's to check.
    return make_model(f"single_{op_type}", [node], spec.inputs, spec.outputs, spec.inits,
                      opset=spec.opset, ir_version=IR_VERSION if spec.opset <= 17 else 9,
                      producer="tvm_fusion", check=False)

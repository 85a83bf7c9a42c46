"""Table 2 of DNNFusion is the oracle: every operator classified from its TIR alone."""

import pytest
import tvm
from tvm import relax

from tvm_fusion.compile import import_onnx
from tvm_fusion.relay_passes.ecg import build_ecg
from tvm_fusion.relay_passes.mapping_type import (
    MAPPING_TYPE_ATTR,
    AnnotateMappingType,
    MappingType,
    classify_primfunc,
)
from tvm_fusion.testing.single_op import SINGLE_OP_EXPECTED, single_op_model
from tvm_fusion.testing.stock import TVM_UNSUPPORTED
from tvm_fusion.transform import legalize_passes

_LLVM = tvm.target.Target("llvm")
_LEGALIZE = tvm.transform.Sequential(legalize_passes(_LLVM))


def _model_type(model) -> MappingType:
    """The most complex mapping type among the operators one ONNX node imports to.

    Some ONNX nodes import as several Relax ops (DepthToSpace is reshape, transpose, reshape);
    the node's type is that of its most complex part, as for a multi-input operator (§3.1).
    """
    with _LLVM:
        mod = _LEGALIZE(import_onnx(model))
    ecg = build_ecg(mod, mod["main"].body.blocks[0])
    assert len(ecg) > 0, "the model imported to no operator"
    return max(node.mapping_type for node in ecg.nodes)


@pytest.mark.parametrize("op_type", sorted(SINGLE_OP_EXPECTED))
def test_table2_operator(op_type):
    if op_type in TVM_UNSUPPORTED:
        pytest.skip(f"TVM 0.27 cannot import {op_type}: {TVM_UNSUPPORTED[op_type]}")
    expected = MappingType[SINGLE_OP_EXPECTED[op_type]]
    assert _model_type(single_op_model(op_type)) == expected


def _legalized(fn, *types):
    bb = relax.BlockBuilder()
    params = [relax.Var(f"a{i}", t) for i, t in enumerate(types)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(fn(*params))
        bb.emit_func_output(out)
    with _LLVM:
        return _LEGALIZE(bb.get())


def _t(*shape, dtype="float32"):
    return relax.TensorType(shape, dtype)


@pytest.mark.parametrize("name, fn, types, expected", [
    # operators outside Table 2, classified by their access pattern alone
    ("tile", lambda x: relax.op.tile(x, (2, 1)), [_t(2, 6)], MappingType.ONE_TO_MANY),
    ("repeat", lambda x: relax.op.repeat(x, 2, axis=0), [_t(2, 6)], MappingType.ONE_TO_MANY),
    ("flip", lambda x: relax.op.flip(x, 1), [_t(2, 6)], MappingType.ONE_TO_ONE),
    ("argmax", lambda x: relax.op.argmax(x, axis=1), [_t(2, 6)], MappingType.MANY_TO_MANY),
    ("cumsum", lambda x: relax.op.cumsum(x, axis=1), [_t(2, 5)], MappingType.MANY_TO_MANY),
    ("sort", lambda x: relax.op.sort(x), [_t(2, 6)], MappingType.OPAQUE),
    ("gather_elements", lambda x, i: relax.op.gather_elements(x, i, axis=1),
     [_t(4, 4), _t(4, 2, dtype="int64")], MappingType.ONE_TO_MANY),
    ("scatter", lambda x, i, u: relax.op.scatter_elements(x, i, u),
     [_t(4, 4), _t(2, 4, dtype="int64"), _t(2, 4)], MappingType.OPAQUE),
])
def test_unseen_operators(name, fn, types, expected):
    mod = _legalized(fn, *types)
    funcs = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert funcs, name
    found = max(classify_primfunc(f).mapping_type for f in funcs)
    assert found == expected, name


def test_broadcast_policy():
    """A bias broadcast is One-to-One by default and One-to-Many under the literal reading."""
    mod = _legalized(relax.op.add, _t(1, 8, 4, 4), _t(1, 8, 1, 1))
    func = next(f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    assert classify_primfunc(func).mapping_type == MappingType.ONE_TO_ONE
    strict = classify_primfunc(func, broadcast_policy="strict")
    assert strict.mapping_type == MappingType.ONE_TO_MANY
    expand = _legalized(relax.op.add, _t(4, 1), _t(1, 5))
    func = next(f for f in expand.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    assert classify_primfunc(func).mapping_type == MappingType.ONE_TO_MANY
    # x[1,1] + W[4,5] with W a weight: the only activation is expanded
    small = _legalized(relax.op.add, _t(1, 1), _t(4, 5))
    func = next(f for f in small.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    assert classify_primfunc(func, const_inputs={1}).mapping_type == MappingType.ONE_TO_MANY
    with pytest.raises(ValueError, match="broadcast_policy"):
        classify_primfunc(func, broadcast_policy="loose")


def test_annotate_pass_records_attr():
    mod = _legalized(lambda x: relax.op.permute_dims(x, [1, 0]), _t(2, 6))
    mod = AnnotateMappingType()(mod)
    func = next(f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    assert str(func.attrs[MAPPING_TYPE_ATTR]) == "SHUFFLE"


def test_parse_names():
    assert MappingType.parse("O2M") is MappingType.ONE_TO_MANY
    assert MappingType.parse("many_to_many") is MappingType.MANY_TO_MANY
    with pytest.raises(ValueError, match="unknown mapping type"):
        MappingType.parse("two-to-two")

"""Static-length causal masks: folded to a constant, read back as an index expression.

With a static sequence length FoldConstant turns the causal mask into a constant tensor; the
attention template reads a constant that is exactly ``where(j > i + o, a, b)`` as that
expression (tir_schedules/constant_mask.py), so its tiles are skipped as for a symbolic
length. Anything else stays data. Every build is checked against ONNX Runtime and stock TVM.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from conftest import TARGET
from onnx import numpy_helper

from tvm_fusion.compile import compile_model, fuse, graph_input_names, import_onnx, run
from tvm_fusion.feeds import random_inputs
from tvm_fusion.models.attention import attention_model
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.tir_schedules.attention import ATTENTION_ATTR
from tvm_fusion.tir_schedules.constant_mask import causal_offset
from tvm_fusion.tir_schedules.records import SCHEDULE_ATTR

SEQ, HEADS = 150, 8
LOWEST = np.finfo(np.float32).min


def _notes(model) -> str:
    mod = fuse(import_onnx(model), TARGET, attention=True)
    (func,) = [f for f in mod.functions.values()
               if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and ATTENTION_ATTR in f.attrs]
    return "\n".join(str(n) for n in func.attrs[SCHEDULE_ATTR])


def _outputs(model, feeds):
    mod = import_onnx(model)
    inputs = [feeds[n] for n in graph_input_names(model)]
    ours = run(compile_model(mod, TARGET), inputs)
    stock = run(compile_model(mod, TARGET, strategy="tvm"), inputs)
    return ours, stock, onnx_reference(model, feeds)


def _check(model):
    ours, stock, ort = _outputs(model, random_inputs(model, seed=0))
    compare(ours, ort)
    compare(ours, stock)


def _with_constant_mask(mask: np.ndarray) -> onnx.ModelProto:
    """The Llama test model at length ``SEQ`` with its ``Trilu`` mask replaced by ``mask``
    (an initializer, added to the scores)."""
    model = attention_model("llama", seq=SEQ, heads=HEADS)
    graph = model.graph
    trilu = next(n for n in graph.node if n.op_type == "Trilu")
    add = next(n for n in graph.node if n.op_type == "Add" and trilu.output[0] in n.input)
    add.input[list(add.input).index(trilu.output[0])] = "constant_mask"
    graph.initializer.append(numpy_helper.from_array(mask.astype(np.float32), "constant_mask"))
    while True:  # the mask's dead producers
        used = {x for n in graph.node for x in n.input} | {o.name for o in graph.output}
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            return model
        for n in dead:
            graph.node.remove(n)


def _causal(value, offset=0, below=0.0, shape=(SEQ, SEQ)):
    i, j = np.arange(SEQ)[:, None], np.arange(SEQ)[None, :]
    return np.broadcast_to(np.where(j > i + offset, value, below), shape).astype(np.float32)


def test_static_causal_mask_skips_tiles():
    """transformers' ``full(min).triu(1)`` at a static length: folded, read as ``j > i``."""
    model = attention_model("llama", seq=SEQ)
    notes = _notes(model)
    assert "1 masked-tile test(s)" in notes
    assert "read as causal" in notes and "j > i + 0" in notes
    _check(model)


RNG = np.random.default_rng(3)
PER_HEAD = np.stack([_causal(LOWEST, offset=h) for h in range(HEADS)])[None]


@pytest.mark.parametrize("name, mask, causal", [
    ("broadcast over batch and heads", _causal(LOWEST, shape=(1, 1, SEQ, SEQ)), True),
    ("the same plane for every head", _causal(-1e9, shape=(1, HEADS, SEQ, SEQ)), True),
    ("a sliding offset", _causal(-1e4, offset=5), True),
    ("masked below the diagonal", _causal(0.0, offset=-1, below=LOWEST), True),
    ("a plane per head", PER_HEAD, False),
    ("random values", RNG.standard_normal((SEQ, SEQ)), False),
    ("causal plus one other value", np.where(np.eye(SEQ) > 0, 1.0, _causal(LOWEST)), False),
])
def test_constant_masks(name, mask, causal):
    model = _with_constant_mask(mask)
    notes = _notes(model)
    assert ("read as causal" in notes) is causal, name
    assert ("1 masked-tile test(s)" in notes) is causal, name
    _check(model)


def test_fully_masked_row_gives_nan_as_unfused():
    """``-inf`` on and above the diagonal (offset -1): row 0 is masked entirely, and its tiles
    are skipped; the unfused softmax gives ``0/0 = NaN`` there, and so does the kernel."""
    model = _with_constant_mask(_causal(-np.inf, offset=-1))
    assert "j > i + -1" in _notes(model)
    ours, stock, ort = _outputs(model, random_inputs(model, seed=0))
    ours, stock, ort = ours[0], stock[0], ort[0]
    assert np.isnan(ours[0, 0]).all() and not np.isnan(ours[0, 1:]).any()
    for ref in (stock, ort):
        assert np.array_equal(np.isnan(ours), np.isnan(ref))
        both = np.isfinite(ours)
        np.testing.assert_allclose(ours[both], ref[both], rtol=1e-4, atol=1e-5)


def test_causal_offset_reads_the_pattern_bit_for_bit():
    i, j = np.arange(6)[:, None], np.arange(9)[None, :]
    for o in (-3, -1, 0, 2):
        off, a, b = causal_offset(np.where(j > i + o, -np.inf, 0.0).astype(np.float32))
        assert off == o and a == -np.inf and b == 0.0
    keep = j <= i  # a boolean keep mask: True below, False above
    assert causal_offset(keep)[:2] == (0, False)
    assert causal_offset(np.zeros((4, 4), np.float32)) is None  # one value: nothing to skip
    # masked below the diagonal: the same pattern, the values swapped (both sides are tested)
    assert causal_offset(np.where(j < i, -1e9, 0.0)) == (-1, 0.0, -1e9)
    assert causal_offset(np.where((i + j) % 2 == 0, -1e9, 0.0)) is None  # a checkerboard
    signed = np.where(j > i, -1e9, 0.0).astype(np.float32)
    signed[3, 1] = -0.0  # equal as a number, not as bits: stays data
    assert causal_offset(signed) is None
    nan = np.where(j > i, np.nan, 0.0)
    assert causal_offset(nan)[0] == 0  # NaN is a value: its tiles are never skipped

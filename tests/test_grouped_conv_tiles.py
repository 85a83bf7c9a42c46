"""Grouped convs tile with the channel in its group as the reuse axis (``cpu_tile.
split_channel_groups``), and global pools sum in vector partial sums (``cpu._split_lanes``).

A grouped conv reads its input at ``ff // G · C + rc``: before the split no iterator was free
of the input, so it tiled like a depthwise conv and loaded every input vector once per output
channel. Each case is checked against ONNX Runtime and the unscheduled build; the notes say
which schedule was taken; AVX-512 and AArch64 are compiled only.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from asm_inspect import AARCH64, AVX512, ZEN3
from conftest import TARGET, host_has
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion.compile import compile_model, fuse, import_onnx, run
from tvm_fusion.feeds import random_inputs
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.testing.notes import schedule_notes


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _act(kind: str, src: str, dst: str) -> list:
    if kind == "Silu":
        return [helper.make_node("Sigmoid", [src], ["s"]),
                helper.make_node("Mul", [src, "s"], [dst])]
    return [helper.make_node(kind, [src], [dst])]


def _grouped(cin, cout, size, group, stride=1, act="Relu", batch=1, kernel=3):
    rng = np.random.default_rng(0)
    pad = kernel // 2
    out = (size + 2 * pad - kernel) // stride + 1
    w = rng.standard_normal((cout, cin // group, kernel, kernel)) / np.sqrt(cin // group * 9)
    inits = [numpy_helper.from_array(w.astype("float32"), "w"),
             numpy_helper.from_array(rng.standard_normal(cout).astype("float32"), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[kernel, kernel],
                              pads=[pad] * 4, strides=[stride, stride], group=group)]
    nodes += _act(act, "c", "y")
    return _model(nodes, [_vi("x", [batch, cin, size, size])],
                  [_vi("y", [batch, cout, out, out])], inits)


def _check(model, target, **feeds_override):
    """Numerics on ``target`` (AVX2 code runs only where the CPU has it); returns the notes."""
    if target is ZEN3 and not (host_has("avx2") and host_has("fma")):
        pytest.skip("this CPU has no AVX2/FMA")
    mod = import_onnx(model)
    feeds = random_inputs(model, shape_overrides=feeds_override or None)
    got = run(compile_model(mod, target, conv_layout="NCHW"), [feeds["x"]])
    plain = run(compile_model(mod, target, conv_layout="NCHW", schedule=False), [feeds["x"]])
    compare(got, plain, rtol=1e-4, atol=1e-5)
    compare(got, onnx_reference(model, feeds), rtol=1e-4, atol=1e-4)
    return schedule_notes(fuse(mod, target, conv_layout="NCHW"))


@pytest.mark.parametrize("cin, cout, size, group, stride, act", [
    (48, 48, 14, 6, 1, "Relu"),  # RegNetY's 8 channels a group
    (48, 48, 15, 6, 2, "Relu"),  # stride 2, odd map
    (24, 36, 9, 3, 1, "HardSwish"),  # 12 output channels a group from 8 inputs
    (20, 30, 12, 5, 1, "Silu"),  # 6 a group: does not divide the vector width
    (30, 30, 13, 3, 2, "Relu"),  # 10 a group, odd map, stride 2
])
def test_grouped_conv_reuses_input_across_its_group(cin, cout, size, group, stride, act):
    notes = _check(_grouped(cin, cout, size, group, stride, act), ZEN3)
    per_group = cout // group
    assert f"split into {group} groups × {per_group} channels" in notes, notes
    assert "tile conv" in notes, notes


def test_grouped_conv_on_the_baseline_target():
    """SSE's 4 lanes: the same split, numerics on the default test target."""
    notes = _check(_grouped(8, 16, 10, 2), TARGET)
    assert "split into 2 groups × 8 channels" in notes, notes


def test_grouped_conv_symbolic_batch():
    model = _grouped(16, 16, 12, 2, act="Silu", batch="batch")
    notes = _check(model, ZEN3, batch=2)
    assert "split into 2 groups" in notes, notes


def test_depthwise_dense_and_prime_groups_are_not_split():
    """One channel a group (depthwise) reads the input at ``ff``; a dense conv at ``rc``; a
    group of 13 channels has no register tile (13 is prime), so the split would not pay."""
    for model in (_grouped(8, 8, 12, 8), _grouped(8, 8, 12, 1), _grouped(26, 26, 13, 2, 2)):
        assert "groups ×" not in _check(model, ZEN3)


@pytest.mark.parametrize("target", [AVX512, AARCH64], ids=["avx512", "aarch64"])
def test_grouped_conv_cross_compiles(target):
    if "aarch64" in str(target) and "aarch64" not in str(tvm.target.codegen.llvm_get_targets()):
        pytest.skip("LLVM built without the AArch64 backend")
    model = _grouped(48, 48, 14, 6, act="Silu")
    notes = schedule_notes(fuse(import_onnx(model), target, conv_layout="NCHW"))
    assert "split into 6 groups × 8 channels" in notes and "tile conv" in notes, notes
    asm = "\n".join(m.inspect_source("asm") for m in compile_model(
        import_onnx(model), target, conv_layout="NCHW").mod.imports)
    assert ("fmla" if "aarch64" in str(target) else "vfmadd") in asm


ZEN4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 1})


def _check_lanes(model, target, batch=1):
    """Numerics of the default build (the packing pass rewrites the conv) against ONNX
    Runtime and the unscheduled build; returns the notes. AVX-512 and AVX2 code runs only
    where the CPU has it (compiled only otherwise)."""
    mod = import_onnx(model)
    notes = schedule_notes(fuse(mod, target))
    flag = "avx512f" if "znver4" in str(target) else "avx2"
    if not host_has(flag):
        return notes
    feeds = random_inputs(model, shape_overrides={"x": [batch, *[
        d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim][1:]]})
    got = run(compile_model(mod, target), [feeds["x"]])
    compare(got, run(compile_model(mod, target, schedule=False), [feeds["x"]]),
            rtol=1e-4, atol=1e-5)
    compare(got, onnx_reference(model, feeds), rtol=1e-4, atol=1e-4)
    return notes


@pytest.mark.parametrize("cin, cout, size, group, stride, act, batch", [
    (64, 64, 7, 2, 1, "Relu", 1),  # ResNeXt-50's last stage: 32 channels a group at 7×7
    (64, 64, 13, 2, 2, "Silu", 1),  # stride 2: 7-wide rows of a 13×13 map
    (64, 64, 7, 2, 1, "HardSwish", 2),  # two images
])
def test_narrow_rows_vectorise_the_group_s_channels(cin, cout, size, group, stride, act,
                                                    batch):
    """A grouped conv whose output row fills at most half a register (7 of AVX-512's 16
    lanes) and whose groups hold whole registers of output channels vectorises the channels
    (``gemm_pack.grouped_conv2d_lanes``: the weight laid out [group, c, kh, kw, channel] at
    compile time, each input value one broadcast) with an output row of 7 positions as the
    register tile: ResNeXt-50's 3×3 of 32 channels a group at 7×7, 0.72 → 0.99× ONNX
    Runtime's speed on Zen 4. AVX2's 7 of 8 lanes keep the row, split into groups."""
    model = _grouped(cin, cout, size, group, stride, act, batch=batch)
    notes = _check_lanes(model, ZEN4, batch)
    assert "group_conv2d_lanes: tile matmul: v_o×32 lanes" in notes, notes
    assert "×7 registers" in notes and "group_conv2d_nchw: data movement" in notes, notes
    notes = _check_lanes(model, ZEN3, batch)
    assert "group_conv2d_lanes" not in notes and f"split into {group} groups" in notes, notes


def test_channels_in_lanes_only_where_the_row_wastes_lanes():
    """14-wide rows fill 14 of 16 lanes (ResNeXt's 16 channels a group at 14×14), 8
    channels a group are no whole AVX-512 register (RegNetY's): both keep the direct conv.
    AArch64 (4 lanes: the 7-wide row is no whole vector either) takes the channels and
    builds."""
    for model in (_grouped(32, 32, 14, 2), _grouped(48, 48, 7, 6)):
        assert "group_conv2d_lanes" not in schedule_notes(fuse(import_onnx(model), ZEN4))
    if "aarch64" not in str(tvm.target.codegen.llvm_get_targets()):
        pytest.skip("LLVM built without the AArch64 backend")
    model = _grouped(64, 64, 7, 2)
    notes = schedule_notes(fuse(import_onnx(model), AARCH64))
    assert "group_conv2d_lanes: tile matmul: v_o×8 lanes" in notes, notes
    asm = "\n".join(m.inspect_source("asm") for m in compile_model(
        import_onnx(model), AARCH64).mod.imports)
    assert "fmla" in asm


@pytest.mark.parametrize("channels, size, stride, kernel, act, batch", [
    (32, 7, 1, 7, "Relu", 1),  # ConvNeXt-T's last stage: 7×7 at 7×7
    (48, 14, 2, 3, "Silu", 1),  # MobileNetV2's 3×3/2 into 7×7
    (32, 7, 1, 5, "HardSwish", 2),  # EfficientNet's 5×5 at 7×7, two images
])
def test_depthwise_with_narrow_rows_vectorises_its_channels(channels, size, stride, kernel,
                                                            act, batch):
    """A depthwise conv whose output row fills at most half a register and whose channels
    fill whole ones takes a register of channels as its vector axis
    (``gemm_pack.depthwise_conv2d_lanes``, as ONNX Runtime's NCHWc kernels): the input
    copied per block of channels, padded, the weight packed at compile time, 7 output
    columns as window rows sharing their loads. ConvNeXt's 7×7 depthwise conv over 768
    channels at 7×7: 0.71 → 1.02× ONNX Runtime's speed on Zen 4. AVX2's 7 of 8 lanes keep
    the row."""
    model = _grouped(channels, channels, size, channels, stride, act, batch=batch,
                     kernel=kernel)
    notes = _check_lanes(model, ZEN4, batch)
    assert "depthwise_conv2d_lanes: tile depthwise: v_lane×16 lanes, v_ow×7 window rows" \
        in notes, notes
    assert "pad_lanes staged per slab" in notes, notes
    notes = _check_lanes(model, ZEN3, batch)
    assert "depthwise_conv2d_lanes" not in notes and "tile depthwise: v_xx×7 lanes" in notes, \
        notes


def test_depthwise_in_lanes_only_where_the_row_wastes_lanes():
    """14-wide rows (14 of 16 lanes) and channels that fill no whole register keep the
    direct depthwise conv; AArch64 (a 7-wide row is no whole 4-lane vector) takes the
    channels and builds."""
    for model in (_grouped(32, 32, 14, 32), _grouped(24, 24, 7, 24)):
        assert "depthwise_conv2d_lanes" not in schedule_notes(fuse(import_onnx(model), ZEN4))
    if "aarch64" not in str(tvm.target.codegen.llvm_get_targets()):
        pytest.skip("LLVM built without the AArch64 backend")
    model = _grouped(32, 32, 7, 32, kernel=7)
    notes = schedule_notes(fuse(import_onnx(model), AARCH64))
    assert "depthwise_conv2d_lanes: tile depthwise: v_lane×4 lanes" in notes, notes
    asm = "\n".join(m.inspect_source("asm") for m in compile_model(
        import_onnx(model), AARCH64).mod.imports)
    assert "fmla" in asm


# ------------------------------------------------------------------ global pools


def _pool(channels, h, w, batch=1):
    return _model([helper.make_node("GlobalAveragePool", ["x"], ["y"])],
                  [_vi("x", [batch, channels, h, w])], [_vi("y", [batch, channels, 1, 1])])


@pytest.mark.parametrize("shape, sums", [
    ((8, 56, 56), "8 partial sums"),  # 3136 = 392 vectors
    ((5, 14, 14), "4 partial sums"),  # 196 = 4 · 49: half vectors
    ((3, 7, 7), None),  # 49: no vector divides it, serial
    ((4, 13, 17), None),
    ((2, 1, 64), "8 partial sums"),  # a unit row fused into the run
])
def test_global_pool_sums_in_vector_partials(shape, sums):
    notes = _check(_pool(*shape), ZEN3)
    if sums is None:
        assert "partial sums" not in notes, notes
    else:
        assert sums in notes, notes


def test_global_pool_symbolic_batch_and_cross_targets():
    model = _pool(6, 28, 28, batch="batch")
    assert "8 partial sums" in _check(model, ZEN3, batch=3)
    notes = schedule_notes(fuse(import_onnx(_pool(6, 28, 28)), AVX512))
    assert "16 partial sums" in notes, notes
    if "aarch64" in str(tvm.target.codegen.llvm_get_targets()):
        notes = schedule_notes(fuse(import_onnx(_pool(6, 28, 28)), AARCH64))
        assert "4 partial sums" in notes, notes


@pytest.mark.parametrize("channels, size, kernel, act, on_zen4", [
    (24, 56, 3, "Relu", True),  # MobileNetV2's 3×3/2 at 56×56: 27 interior columns a phase
    (24, 28, 3, "Relu", False),  # 13 a phase: fewer than AVX-512's 16 lanes, AVX2's 8 do
    (20, 16, 5, "Silu", False),  # EfficientNet's 5×5/2: 8 a phase
])
def test_stride2_depthwise_padding_is_copied_deinterleaved(channels, size, kernel, act,
                                                           on_zen4):
    """A stride-2 depthwise conv pads each channel into even/odd columns
    (``deinterleave_strided``); that padding, stored through the layout's
    ``(q·2 + ph) % 2, (q·2 + ph) // 2``, is copied as the conv GEMM's phases are: the
    interior columns with the two phases unrolled and no bounds test, the edges apart
    (MobileNetV2's 3×3/2 over 96 channels at 112×112 on Zen 4, one thread: 0.525 →
    0.399 ms), where each phase has at least a vector's lanes of interior columns (LLVM
    vectorises the copy by whole vectors; 13 columns on AVX-512 were copied one float at a
    time). Values as ONNX Runtime's and the unscheduled build's."""
    model = _grouped(channels, channels, size, channels, 2, act, kernel=kernel)
    for target, rewritten in ((ZEN4, on_zen4), (ZEN3, True)):
        notes = _check_lanes(model, target)
        assert "pad_temp: stride-2 input split into even/odd columns" in notes, notes
        assert ("pad_temp: 2 column phases copied deinterleaved" in notes) == rewritten, notes

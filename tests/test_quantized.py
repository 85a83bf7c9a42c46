"""QDQ int8 models (issue 19, item 2): QuantizeLinear/DequantizeLinear around convs, MatMul
and Gemm fuse into the anchor's kernel, dequantize as a prologue and quantize as an epilogue,
so the kernels exchange int8 tensors; int8 outputs equal stock TVM's exactly.

Built on the host CPU's target: with FMA, LLVM contracts a multiply feeding an add across what
were two stages (tvm_fusion.tir_schedules.rounding), the case that made int8 outputs one off.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto
from tvm import relax, tirx

from tvm_fusion.compile import compile_model, count_kernels, fuse, graph_input_names, import_onnx
from tvm_fusion.compile import run as run_vm
from tvm_fusion.feeds import random_inputs
from tvm_fusion.layout.int8_conv import NOTES_ATTR, form_of, plan_int8_convs
from tvm_fusion.models.quantized import (
    conv_net,
    matmul_net,
    qdq_conv_net,
    qdq_deep_conv,
    qdq_matmul_net,
)
from tvm_fusion.numerics import check_outputs, onnx_reference
from tvm_fusion.relay_passes.widening import duplicate_widening
from tvm_fusion.target import host_target
from tvm_fusion.testing.notes import schedule_notes
from tvm_fusion.tir_schedules.cpu_target import has_feature
from tvm_fusion.tir_schedules.rounding import converts_to_int, fence_producers, is_fence
from tvm_fusion.tir_utils import buffer_stores, find_all

TARGET = host_target()


def _three_ways(model: onnx.ModelProto, **options):
    """(tvm_fusion's outputs, stock TVM's, ONNX Runtime's, fused module, stock module); the
    modules are planned and fused without schedules (the kernels are the same)."""
    mod = import_onnx(model)
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[n] for n in graph_input_names(model)]
    ours = run_vm(compile_model(mod, TARGET, **options), inputs)
    stock = run_vm(compile_model(mod, TARGET, strategy="tvm"), inputs)
    return (ours, stock, onnx_reference(model, feeds),
            fuse(mod, TARGET, schedule=False, **options),
            fuse(mod, TARGET, strategy="tvm", schedule=False))


@functools.cache
def _built(name: str, per_channel: bool, int8_output: bool = True,
           act: int = TensorProto.INT8):
    build = {"qdq_conv_net": qdq_conv_net, "qdq_matmul_net": qdq_matmul_net}[name]
    return _three_ways(build(per_channel=per_channel, int8_output=int8_output, act=act))


def _float_intermediates(mod: tvm.IRModule) -> int:
    """Kernel results of ``main`` that another kernel reads and that are float32."""
    calls, used = {}, set()
    for binding in mod["main"].body.blocks[0].bindings:
        value = binding.value
        if isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_tir")):
            calls[binding.var] = str(binding.var.ty.dtype) if isinstance(
                binding.var.ty, relax.TensorType) else "tuple"
            used |= set(relax.analysis.free_vars(value.args[1]))
    return sum(1 for v, dtype in calls.items() if v in used and dtype == "float32")


# the host sums QDQ convs in integers (x86: VNNI or vpmaddwd), layout/int8_conv.py
INTEGER_CONVS = form_of(TARGET) is not None

# (builder, stock kernels, tvm_fusion kernels): the input's QuantizeLinear/DequantizeLinear
# pair is the first anchor's prologue in tvm_fusion (the integer conv kernel quantizes a
# graph input as it packs it), a kernel of its own in stock FuseOps.
NETS = [(qdq_conv_net, 6, 5), (qdq_matmul_net, 3, 2)]


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
@pytest.mark.parametrize("build,stock_kernels,ours_kernels", NETS,
                         ids=[n[0].__name__ for n in NETS])
def test_int8_outputs_equal_stock_tvm_and_kernels_fewer(build, stock_kernels, ours_kernels,
                                                        per_channel):
    ours, stock, ref, fused, stock_mod = _built(build.__name__, per_channel)
    assert ours[0].dtype == np.int8
    if INTEGER_CONVS and build is qdq_conv_net:  # integer sums: a tie may round apart
        assert np.abs(ours[0].astype(int) - stock[0].astype(int)).max() <= 1
    else:
        np.testing.assert_array_equal(ours[0], stock[0])
    # ONNX Runtime computes the same float stages; half-way ties round the same way there
    assert np.abs(ours[0].astype(int) - ref[0].astype(int)).max() <= 1
    assert (count_kernels(stock_mod), count_kernels(fused)) == (stock_kernels, ours_kernels)


def test_kernels_exchange_int8_in_the_conv_net():
    """Each conv kernel ends at its QuantizeLinear and the next starts with the
    DequantizeLinear (the residual's second reader gets its own copy): what passes between
    kernels is int8. Stock FuseOps puts both into the producer and passes float32."""
    _, _, _, fused, stock = _built("qdq_conv_net", False)
    assert _float_intermediates(stock) == 5
    assert _float_intermediates(fused) == 0


@pytest.mark.parametrize("act", [
    TensorProto.INT8, pytest.param(TensorProto.UINT8, marks=pytest.mark.slow)], ids=["s8", "u8"])
def test_float_output_through_qdq_matches_stock_exactly(act):
    ours, stock, ref, _, _ = _built("qdq_conv_net", True, False, act)
    if INTEGER_CONVS:  # one quantization step at most (0.0627 at the output's scale)
        np.testing.assert_allclose(ours[0], stock[0], atol=0.063, rtol=0)
    else:
        np.testing.assert_array_equal(ours[0], stock[0])
        assert check_outputs(ours, stock, ref) == []


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_deep_qdq_conv_takes_the_packed_gemm_with_an_int8_epilogue(per_channel):
    """A conv whose reduction spans several K blocks and whose epilogue quantizes to int8:
    the packed GEMM nest keeps the running sums of earlier K blocks in a float32 buffer of
    its own (the int8 output cannot hold them) instead of the kernel falling back to
    per-element register tiles (ResNet-18 int8: 49x slower than stock FuseOps)."""
    model = qdq_deep_conv(per_channel=per_channel)
    ours, stock, ref, _, _ = _three_ways(model, integer_qdq_convs=False)
    assert ours[0].dtype == np.int8
    # a different summation order may move a value across a rounding boundary: one step
    assert np.abs(ours[0].astype(int) - stock[0].astype(int)).max() <= 1
    assert np.abs(ours[0].astype(int) - ref[0].astype(int)).max() <= 1
    scheduled = fuse(import_onnx(model), TARGET, integer_qdq_convs=False)
    conv = next(f for gv, f in scheduled.functions.items()
                if isinstance(f, tirx.PrimFunc) and "conv2d" in gv.name_hint)
    notes = [str(n) for n in conv.attrs["tvm_fusion.schedule"]]
    packed = [n for n in notes if "packed GEMM" in n]
    assert packed and not any("not used" in n for n in packed), notes
    kc = int(re.search(r"KC (\d+)", packed[0]).group(1))
    assert kc < 9 * 128  # several K blocks: the case the float32 running sums are for
    partial = {str(st.buffer.dtype) for st in buffer_stores(conv.body)
               if st.buffer.name == "c_partial"}
    assert partial == {"float32"}


@pytest.fixture(scope="module")
def ort_qdq(tmp_path_factory):
    """conv_net and matmul_net quantized by onnxruntime.quantization.quantize_static (QDQ
    format, int8 activations and weights), per tensor and per channel."""
    quantization = pytest.importorskip("onnxruntime.quantization")
    folder = tmp_path_factory.mktemp("qdq")
    made = {}
    for name, build in (("conv", conv_net), ("matmul", matmul_net)):
        model = build()
        src = folder / f"{name}.onnx"
        onnx.save(model, src)
        feeds = [random_inputs(model, seed=s) for s in range(4)]

        class Reader(quantization.CalibrationDataReader):
            def __init__(self, feeds=feeds):
                self.data = iter(feeds)

            def get_next(self):
                return next(self.data, None)

        for per_channel in (False, True):
            out = folder / f"{name}_{per_channel}.onnx"
            quantization.quantize_static(
                str(src), str(out), Reader(), quant_format=quantization.QuantFormat.QDQ,
                activation_type=quantization.QuantType.QInt8,
                weight_type=quantization.QuantType.QInt8, per_channel=per_channel)
            made[name, per_channel] = onnx.load(out)
    return made


# conv: ONNX Runtime's QDQ conv net; with integer convs the residual's Add and its
# QuantizeLinear (the 1x1 conv GEMM's epilogue in the float path) are a kernel of their own
_ORT_CONV = 6 if INTEGER_CONVS else 5


@pytest.mark.parametrize("name,per_channel,stock_kernels,ours_kernels", [
    ("conv", True, 6, _ORT_CONV), ("matmul", False, 3, 2),
    pytest.param("conv", False, 6, _ORT_CONV, marks=pytest.mark.slow),
    pytest.param("matmul", True, 3, 2, marks=pytest.mark.slow)])
def test_onnxruntime_quantize_static_models(ort_qdq, name, per_channel, stock_kernels,
                                            ours_kernels):
    model = ort_qdq[name, per_channel]
    ops = {n.op_type for n in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    ours, stock, ref, fused, stock_mod = _three_ways(model)
    if name == "matmul" or not INTEGER_CONVS:
        np.testing.assert_array_equal(ours[0], stock[0])
    check_outputs(ours, stock, ref)
    assert (count_kernels(stock_mod), count_kernels(fused)) == (stock_kernels, ours_kernels)


# ------------------------------------------------------------------------------ the fence

def _dq_add_quantize(shape=(64,)) -> tvm.IRModule:
    """Two dequantized int8 tensors added and quantized again (a QDQ residual), legalized."""
    a = relax.Var("a", relax.TensorType(shape, "int8"))
    b = relax.Var("b", relax.TensorType(shape, "int8"))
    bb = relax.BlockBuilder()
    scale, zp = relax.const(0.03125 / 3, "float32"), relax.const(0, "int8")
    with bb.function("main", [a, b]):
        with bb.dataflow():
            da = bb.emit(relax.op.dequantize(a, scale, zp, axis=0))
            db = bb.emit(relax.op.dequantize(b, scale, zp, axis=0))
            s = bb.emit(relax.op.add(da, db))
            q = bb.emit_output(relax.op.quantize(s, relax.const(0.0625 / 3, "float32"), zp,
                                                 axis=0, out_dtype="int8"))
        bb.emit_func_output(q)
    return relax.transform.LegalizeOps()(bb.get())


def test_fence_producers_only_where_floats_become_integers():
    mod = _dq_add_quantize()
    fused = relax.transform.FuseTIR()(relax.transform.FuseOps()(
        relax.transform.AnnotateTIROpPattern()(mod)))
    func = next(f for f in fused.functions.values() if isinstance(f, tirx.PrimFunc))
    assert converts_to_int(func)
    fences = [c for c in find_all(fence_producers(func).body, tvm.ir.Call) if is_fence(c)]
    assert len(fences) == 3  # the two dequantizes and the add; the quantize stores an int
    add = mod["add"]  # float in, float out: nothing to keep
    assert not converts_to_int(add)
    assert fence_producers(add).same_as(add)


def test_fused_quantize_of_a_sum_of_dequantized_values_rounds_as_onnx_defines():
    """Half-way ties everywhere: (qa + qb) * s / (2 s) is about k + 0.5 for odd qa + qb, and
    whether the two products are rounded before the sum decides the int8 value. ONNX (and
    ONNX Runtime) round each stage; the fused kernel must too. Stock TVM's separate loops get
    contracted by LLVM here (5 of 64 values differ from the ONNX semantics), so the
    reference is numpy's stage-by-stage float32 arithmetic."""
    mod = _dq_add_quantize()
    rng = np.random.default_rng(0)
    a, b = (rng.integers(-60, 60, 64).astype("int8") for _ in range(2))
    ours = run_vm(compile_model(mod, TARGET), [a, b])[0]
    s, s2 = np.float32(0.03125 / 3), np.float32(0.0625 / 3)
    total = a.astype(np.float32) * s + b.astype(np.float32) * s
    y = total / s2
    expected = np.clip(np.rint(y), -128, 127)  # QuantizeLinear rounds half to even
    np.testing.assert_array_equal(ours, expected.astype(np.int8))


@pytest.mark.parametrize("mcpu", ["znver4", "znver3"])
def test_fenced_rows_that_whole_vectors_do_not_divide_are_vectorised_in_tir(mcpu):
    """A QDQ residual over rows of 56 (ResNet-18's layer 1; not whole int8 vectors): LLVM's
    loop vectoriser does not take a loop holding ``llvm.arithmetic.fence``, so left to it
    the fenced loop divided, rounded and converted one element at a time (vdivss: the
    quantize epilogue of a QDQ conv GEMM took 650 µs per 200,704 elements on Zen 4, 80 µs
    vectorised). The schedule vectorises it with one partly used register instead; the
    int8 values are those of the scalar loop, half-way ties included."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 1})
    mod = _dq_add_quantize((3, 56))
    notes = schedule_notes(fuse(mod, target))
    assert "fenced: LLVM would not vectorise it" in notes, notes
    executable = compile_model(mod, target)
    asm = "\n".join(m.inspect_source("asm") for m in executable.mod.imports)
    assert re.search(r"\bvdivps\b", asm) and not re.search(r"\bvdivss\b", asm)
    rng = np.random.default_rng(0)
    a, b = (rng.integers(-60, 60, (3, 56)).astype("int8") for _ in range(2))
    s, s2 = np.float32(0.03125 / 3), np.float32(0.0625 / 3)
    expected = np.clip(np.rint((a.astype(np.float32) * s + b.astype(np.float32) * s) / s2),
                       -128, 127).astype(np.int8)
    if mcpu == "znver4" and not _host_runs(target):
        pytest.skip("this machine does not run znver4 code")
    np.testing.assert_array_equal(run_vm(executable, [a, b])[0], expected)


def _host_runs(target) -> bool:
    host = tvm.target.Target({"kind": "llvm",
                              "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    return all(has_feature(host, f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512vnni")
               if has_feature(target, f))


def test_each_reader_of_a_dequantize_gets_its_own_copy():
    """relay_passes.widening: one DequantizeLinear read by two matmuls becomes two, so both
    kernels can start with it and read the int8 tensor; a float32 op read twice is left."""
    x = relax.Var("x", relax.TensorType((4, 8), "int8"))
    y = relax.Var("y", relax.TensorType((4, 8), "float32"))
    bb = relax.BlockBuilder()
    w = relax.const(np.ones((8, 8), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            d = bb.emit(relax.op.dequantize(x, relax.const(0.5, "float32"),
                                            relax.const(0, "int8"), axis=0))
            r = bb.emit(relax.op.nn.relu(y))
            a = bb.emit(relax.op.matmul(d, w))
            b = bb.emit(relax.op.matmul(d, w))
            out = bb.emit_output(relax.op.add(relax.op.add(a, b), relax.op.add(r, r)))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())

    def calls(m, name):
        return sum(1 for b in m["main"].body.blocks[0].bindings
                   if isinstance(b.value, relax.Call) and len(b.value.args) > 0
                   and getattr(b.value.args[0], "name_hint", "").startswith(name))

    assert (calls(mod, "dequantize"), calls(mod, "relu")) == (1, 1)
    copied = duplicate_widening(mod)
    assert (calls(copied, "dequantize"), calls(copied, "relu")) == (2, 1)
    inputs = [np.arange(32, dtype="int8").reshape(4, 8), np.ones((4, 8), "float32")]
    np.testing.assert_array_equal(run_vm(tvm.compile(copied, "llvm"), inputs)[0],
                                  run_vm(tvm.compile(mod, "llvm"), inputs)[0])


# --------------------------------------------------- integer sums (layout/int8_conv.py)

def _qdq_conv(x_shape, w_shape, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1),
              act=TensorProto.INT8, out=TensorProto.INT8, per_channel=False, relu=False,
              bias=True, group=1, w_zero=0, batch=None, seed=0) -> onnx.ModelProto:
    """x (float32) → QuantizeLinear → DequantizeLinear → Conv(DequantizeLinear(W int8),
    bias) [→ Relu] → QuantizeLinear: one QDQ conv with an int8/uint8 output."""
    from onnx import helper, numpy_helper
    rng = np.random.default_rng(seed)
    act_np = np.int8 if act == TensorProto.INT8 else np.uint8
    out_np = np.int8 if out == TensorProto.INT8 else np.uint8
    m = w_shape[0]
    w = rng.integers(-127, 128, w_shape).astype(np.int8)
    sw = (rng.random(m) * 0.02 + 0.005 if per_channel else np.array(0.01)).astype(np.float32)
    sx = np.float32(8 / 255)
    zx = act_np(-3 if act == TensorProto.INT8 else 125)
    fan_in = int(np.prod(w_shape[1:]))
    sy = np.float32(sx * 0.01 * 64 * np.sqrt(fan_in) / 127)
    zy = out_np(5 if out == TensorProto.INT8 else 100)
    inits = [numpy_helper.from_array(np.asarray(v), n) for n, v in [
        ("sx", sx), ("zx", np.asarray(zx)), ("w", w), ("sw", sw),
        ("zw", np.full(sw.shape, w_zero, np.int8)), ("sy", sy), ("zy", np.asarray(zy))]]
    conv_in = ["xd", "wd"]
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wd"], axis=0)]
    if bias:
        sb = (sx * sw).astype(np.float32) * np.ones(m, np.float32)
        inits += [numpy_helper.from_array(rng.integers(-3000, 3000, m).astype(np.int32), "b"),
                  numpy_helper.from_array(sb, "sb"),
                  numpy_helper.from_array(np.zeros(m, np.int32), "zb")]
        nodes.append(helper.make_node("DequantizeLinear", ["b", "sb", "zb"], ["bd"], axis=0))
        conv_in.append("bd")
    nodes.append(helper.make_node("Conv", conv_in, ["c"], strides=list(strides),
                                  pads=list(pads), dilations=list(dilations), group=group))
    last = "c"
    if relu:
        nodes.append(helper.make_node("Relu", ["c"], ["r"]))
        last = "r"
    nodes.append(helper.make_node("QuantizeLinear", [last, "sy", "zy"], ["y"]))
    x_dims = [batch or x_shape[0], *x_shape[1:]]
    graph = helper.make_graph(
        nodes, "qdq_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)],
        [helper.make_tensor_value_info("y", out, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


# (x shape, W shape, conv attributes, activation, output)
_CONVS = {
    "3x3_pad1": ((1, 8, 16, 16), (16, 8, 3, 3), dict(pads=(1, 1, 1, 1), relu=True), {}),
    "odd_3x3_stride2_u8": ((2, 7, 13, 11), (19, 7, 3, 3),
                           dict(strides=(2, 2), pads=(1, 1, 1, 1), act=TensorProto.UINT8,
                                out=TensorProto.UINT8, per_channel=True), {}),
    "1x1": ((1, 5, 9, 10), (3, 5, 1, 1), dict(per_channel=True, bias=False), {}),
    "1x1_stride2": ((1, 6, 12, 12), (10, 6, 1, 1), dict(strides=(2, 2)), {}),
    "7x7_stride2_stem": ((1, 3, 20, 20), (9, 3, 7, 7),
                         dict(strides=(2, 2), pads=(3, 3, 3, 3), relu=True,
                              out=TensorProto.UINT8), {}),
    "uneven_dilated": ((1, 9, 14, 15), (20, 9, 3, 2),
                       dict(strides=(1, 2), pads=(2, 0, 1, 1), dilations=(2, 1),
                            act=TensorProto.UINT8, per_channel=True), {}),
}


@pytest.mark.skipif(not INTEGER_CONVS, reason="the host has no integer conv form")
@pytest.mark.parametrize("case", list(_CONVS))
def test_qdq_convs_sum_in_integers_and_agree_with_onnxruntime(case):
    """Each conv becomes the integer kernel (the note says so) and its quantized outputs are
    ONNX Runtime's, one step apart at most (a value within float32 rounding of a tie)."""
    x_shape, w_shape, attrs, _ = _CONVS[case]
    model = _qdq_conv(x_shape, w_shape, **attrs)
    _, notes = plan_int8_convs(import_onnx(model), TARGET)
    assert len(notes) == 1 and "integer sums" in notes[0], notes
    ours, _, ref, fused, _ = _three_ways(model)
    assert ours[0].dtype == ref[0].dtype
    diff = np.abs(ours[0].astype(int) - ref[0].astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff > 0).sum()
    assert [str(n) for n in fused.attrs[NOTES_ATTR]] == notes


def _exact_reference(x, w, zx, conv):
    """The integer conv sums Σ w·(q − zx) of layout.int8_conv.Int8Conv ``conv``, int64."""
    t, l, b, r = conv.padding
    xp = np.pad(x.astype(np.int64) - zx, ((0, 0), (0, 0), (t, b), (l, r)))
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel, conv.strides, conv.dilation
    oh, ow = conv.out_hw
    acc = np.zeros((x.shape[0], w.shape[0], oh, ow), np.int64)
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh,
                       j * dw:j * dw + sw * (ow - 1) + 1:sw]
            acc += np.einsum("bchw,mc->bmhw", patch, w[:, :, i, j].astype(np.int64))
    return acc


@pytest.mark.parametrize("mcpu", ["znver4", "znver3"], ids=["avx512vnni", "avx2"])
@pytest.mark.parametrize("case", ["odd_3x3_stride2_u8", "uneven_dilated", "1x1"])
def test_integer_conv_kernel_sums_exactly(mcpu, case):
    """The kernel's int32 sums are exact: with unit scales, no bias and an output scale of
    1, every output is the exact sum (clipped), whatever the extreme inputs."""
    from tvm_fusion.layout.int8_conv import (
        Int8Conv,
        build_kernel,
        choose_tiling,
        k_offsets,
        pack_weight_words,
    )
    from tvm_fusion.tir_schedules.cpu_target import cpu_params
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 1})
    if not _host_runs(target):
        pytest.skip("this machine does not run this code")
    x_shape, w_shape, attrs, _ = _CONVS[case]
    act = "uint8" if attrs.get("act") == TensorProto.UINT8 else "int8"
    pads = attrs.get("pads", (0, 0, 0, 0))
    conv = Int8Conv(*x_shape, w_shape[0], tuple(w_shape[2:]), attrs.get("strides", (1, 1)),
                    (pads[0], pads[1], pads[2], pads[3]), attrs.get("dilations", (1, 1)),
                    act, "int8", False)
    form = form_of(target)
    tiling = choose_tiling(conv, cpu_params(target), form)
    rng = np.random.default_rng(1)
    lo, hi = (-128, 128) if act == "int8" else (0, 256)
    x = rng.choice([lo, hi - 1, 0, 7], x_shape).astype(act)
    w = rng.choice([-128, 127, 1, -5], w_shape).astype(np.int8)
    zx = lo + 3
    exact = _exact_reference(x, w, zx, conv)
    rows = tiling.row_tiles * tiling.mr
    zc = np.zeros(rows, np.int64)
    if form == "vnni":
        zc[:w.shape[0]] = (zx + (128 if act == "int8" else 0)) * w.reshape(
            w.shape[0], -1).astype(np.int64).sum(1)
    # output scale 2^k large enough that no value clips: exact sums, shifted down exactly
    shift = 2.0 ** int(np.ceil(np.log2(np.abs(exact).max() / 100 + 1)))
    func = build_kernel(conv, tiling, zx, shift, 0).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
    dev = tvm.cpu()
    ones = np.ones(rows, np.float32)
    args = [tvm.runtime.tensor(v, dev) for v in (
        x, pack_weight_words(w, conv, tiling), k_offsets(conv, tiling), zc.astype(np.int32),
        ones, np.zeros(rows, np.float32), np.zeros(exact.shape, np.int8))]
    lib["main"](*args)
    np.testing.assert_array_equal(args[-1].numpy(),
                                  np.clip(np.rint(exact / shift), -128, 127).astype(np.int8))


def test_qdq_convs_the_integer_kernel_does_not_take_keep_the_float_path_with_a_reason():
    notes = plan_int8_convs(import_onnx(qdq_conv_net(per_channel=True)), TARGET)[1]
    if INTEGER_CONVS:
        assert sum("integer sums" in n for n in notes) == 3
        assert any("float path (groups=16)" in n for n in notes), notes
    arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                             "mattr": ["+neon", "+dotprod"]})
    model = _qdq_conv((1, 8, 16, 16), (16, 8, 3, 3), pads=(1, 1, 1, 1))
    new, notes = plan_int8_convs(import_onnx(model), arm)
    assert len(notes) == 1 and "float path (no integer dot product form" in notes[0]
    assert not any(isinstance(f, tirx.PrimFunc) for f in new.functions.values())
    if not INTEGER_CONVS:
        return
    zero_point = _qdq_conv((1, 8, 16, 16), (16, 8, 3, 3), w_zero=2)
    assert "weight's zero point is not 0" in plan_int8_convs(import_onnx(zero_point),
                                                             TARGET)[1][0]
    symbolic = _qdq_conv((1, 8, 16, 16), (16, 8, 3, 3), pads=(1, 1, 1, 1), batch="n")
    notes = plan_int8_convs(import_onnx(symbolic), TARGET)[1]
    assert "float path (a symbolic shape)" in notes[0], notes
    # and the symbolic model still builds and runs (the float path)
    feeds = random_inputs(symbolic, seed=0, shape_overrides={"n": 2})
    out = run_vm(compile_model(import_onnx(symbolic), TARGET), [feeds["x"]])[0]
    assert out.dtype == np.int8


def test_report_lists_the_qdq_convs_and_why_one_keeps_float_sums():
    from tvm_fusion.report import format_report, make_report
    report = make_report(qdq_conv_net(per_channel=True), "qdq", target=TARGET, check=False)
    text = format_report(report)
    if not INTEGER_CONVS:
        assert "QDQ convs: 0 of 4" in text
        return
    assert "QDQ convs: 3 of 4 with integer sums, the rest float32:" in text, text
    assert "conv2d [16, 1, 3, 3]: float path (groups=16)" in text
    # the model's own operators before fusion: the four convs among them
    assert report.compute_intensive == 4


def test_every_conv_of_the_zoo_qdq_resnet18_sums_in_integers():
    """models/resnet18_int8.onnx (ONNX Runtime's quantize_static, QDQ): all 20 convs (the
    7x7/2 stem, 3x3, 1x1/2 downsamples, per-channel weight scales) take the integer kernel."""
    import os
    from pathlib import Path
    models = Path(os.environ.get("TVM_FUSION_MODELS", Path(__file__).parent.parent / "models"))
    path = models / "resnet18_int8.onnx"
    if not path.exists():
        pytest.skip(f"{path} missing: python -m tvm_fusion.export_models --only resnet18_int8")
    if not INTEGER_CONVS:
        pytest.skip("the host has no integer conv form")
    _, notes = plan_int8_convs(import_onnx(onnx.load(path)), TARGET)
    assert len(notes) == 20 and all("integer sums" in n for n in notes), notes


def test_an_added_constant_that_broadcasts_along_the_width_is_no_bias():
    """conv(...) + c with c of shape [W] (W = the channel count here) adds along the width:
    not a per-channel bias, so the conv keeps the float path; with c [C, 1, 1] it is one."""
    from onnx import helper, numpy_helper
    results = {}
    for name, shape in (("width", [8]), ("channels", [8, 1, 1])):
        model = _qdq_conv((1, 4, 8, 8), (8, 4, 3, 3), pads=(1, 1, 1, 1), bias=False)
        graph = model.graph
        conv = next(n for n in graph.node if n.op_type == "Conv")
        conv.output[0] = "c0"
        graph.initializer.append(numpy_helper.from_array(
            np.linspace(-1, 1, 8).astype(np.float32).reshape(shape), "k"))
        index = list(graph.node).index(conv)
        graph.node.insert(index + 1, helper.make_node("Add", ["c0", "k"], ["c"]))
        notes = plan_int8_convs(import_onnx(model), TARGET)[1]
        results[name] = notes
        if INTEGER_CONVS:
            ours, _, ref, _, _ = _three_ways(model)
            assert np.abs(ours[0].astype(int) - ref[0].astype(int)).max() <= 1
    if INTEGER_CONVS:
        assert "not a per-channel constant" in results["width"][0], results
        assert "integer sums" in results["channels"][0], results

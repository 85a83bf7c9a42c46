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
from tvm_fusion.tir_schedules.cpu_target import _has
from tvm_fusion.tir_schedules.rounding import converts_to_int, fence_producers, is_fence
from tvm_fusion.tir_utils import buffer_stores, find_all

TARGET = host_target()


def _three_ways(model: onnx.ModelProto):
    """(tvm_fusion's outputs, stock TVM's, ONNX Runtime's, fused module, stock module); the
    modules are planned and fused without schedules (the kernels are the same)."""
    mod = import_onnx(model)
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[n] for n in graph_input_names(model)]
    ours = run_vm(compile_model(mod, TARGET), inputs)
    stock = run_vm(compile_model(mod, TARGET, strategy="tvm"), inputs)
    return (ours, stock, onnx_reference(model, feeds), fuse(mod, TARGET, schedule=False),
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


# (builder, stock kernels, tvm_fusion kernels): the input's QuantizeLinear/DequantizeLinear
# pair is the first anchor's prologue in tvm_fusion, a kernel of its own in stock FuseOps.
NETS = [(qdq_conv_net, 6, 5), (qdq_matmul_net, 3, 2)]


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
@pytest.mark.parametrize("build,stock_kernels,ours_kernels", NETS,
                         ids=[n[0].__name__ for n in NETS])
def test_int8_outputs_equal_stock_tvm_and_kernels_fewer(build, stock_kernels, ours_kernels,
                                                        per_channel):
    ours, stock, ref, fused, stock_mod = _built(build.__name__, per_channel)
    assert ours[0].dtype == np.int8
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
    np.testing.assert_array_equal(ours[0], stock[0])
    assert check_outputs(ours, stock, ref) == []


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_deep_qdq_conv_takes_the_packed_gemm_with_an_int8_epilogue(per_channel):
    """A conv whose reduction spans several K blocks and whose epilogue quantizes to int8:
    the packed GEMM nest keeps the running sums of earlier K blocks in a float32 buffer of
    its own (the int8 output cannot hold them) instead of the kernel falling back to
    per-element register tiles (ResNet-18 int8: 49x slower than stock FuseOps)."""
    model = qdq_deep_conv(per_channel=per_channel)
    ours, stock, ref, _, _ = _three_ways(model)
    assert ours[0].dtype == np.int8
    # a different summation order may move a value across a rounding boundary: one step
    assert np.abs(ours[0].astype(int) - stock[0].astype(int)).max() <= 1
    assert np.abs(ours[0].astype(int) - ref[0].astype(int)).max() <= 1
    scheduled = fuse(import_onnx(model), TARGET)
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


@pytest.mark.parametrize("name,per_channel,stock_kernels,ours_kernels", [
    ("conv", True, 6, 5), ("matmul", False, 3, 2),
    pytest.param("conv", False, 6, 5, marks=pytest.mark.slow),
    pytest.param("matmul", True, 3, 2, marks=pytest.mark.slow)])
def test_onnxruntime_quantize_static_models(ort_qdq, name, per_channel, stock_kernels,
                                            ours_kernels):
    model = ort_qdq[name, per_channel]
    ops = {n.op_type for n in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    ours, stock, ref, fused, stock_mod = _three_ways(model)
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
    return all(_has(host, f) for f in ("avx512f", "avx512bw", "avx512vl")
               if _has(target, f))


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

"""Weight-only quantized GEMMs (issue 21, item 4): an int8 weight read through
``DequantizeLinear`` stays int8 in the packed panels, is widened to float32 in the GEMM's
micro-kernel, and its per-channel scale is applied after the K loop (``layout/weight_quant.py``,
``layout/gemm_pack.py``, ``tir_schedules/cpu_gemm.py``). Checked: numerics against stock TVM
and ONNX Runtime, and that no float32 copy of the weight exists anywhere (constants, function
parameters, buffers of the lowered TIR)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from asm_inspect import AARCH64, AVX512, ZEN3, assembly, fma_loops
from conftest import TARGET
from onnx import TensorProto, helper, numpy_helper
from tvm import relax, s_tir
from tvm.ir.expr import GenericConst

from tvm_fusion.compile import compile_model, fuse, import_onnx, run
from tvm_fusion.frontend import ALL_REPAIRS, FrontendError, from_onnx
from tvm_fusion.models.graph import make_model, value_info
from tvm_fusion.models.weight_only import weight_only_matmul, weight_only_mlp
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.testing.notes import schedule_notes
from tvm_fusion.tir_schedules.cpu_target import cpu_params
from tvm_fusion.tir_utils import find_all

# Odd sizes: N = 97 leaves a tail panel, K = 67 an odd k loop
HIDDEN, INTER = 67, 97


def _x(m, k, seed=1):
    return np.random.default_rng(seed).standard_normal((m, k)).astype("float32")


def _compare_all(model, xs, target=TARGET, **options):
    """Ours = ONNX Runtime = stock TVM on each input of ``xs`` (one build each; fp32 sums in
    other orders: ~1e-6 relative)."""
    mod = import_onnx(model)
    ours, stock = compile_model(mod, target, **options), compile_model(mod, "llvm", "none")
    for x in xs if isinstance(xs, list) else [xs]:
        got = run(ours, [x])
        scale = float(np.abs(onnx_reference(model, {"x": x})[0]).max())
        tol = dict(rtol=1e-5, atol=1e-5 * scale)
        compare(got, onnx_reference(model, {"x": x}), **tol)
        compare(got, run(stock, [x]), **tol)
    return fuse(mod, target, **options)


def _lowered_buffers(func: tvm.tirx.PrimFunc) -> list:
    """Every buffer of ``func`` after TVM's allocation planning and compaction: parameters,
    block allocations and allocation statements (the GEMM template's)."""
    passes = [s_tir.transform.LowerInitBlock(),
              s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
              s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.CompactBufferAllocation()]
    low = tvm.transform.Sequential(passes)(
        tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))["main"]
    bufs = [p for p in low.params if hasattr(p, "shape")]  # parameters are buffers
    bufs += [b for blk in find_all(low.body, tvm.s_tir.SBlock) for b in blk.alloc_buffers]
    bufs += [a.buffer for a in find_all(low.body, tvm.tirx.AllocBuffer)]
    return bufs


def _numel(buf) -> int | None:
    dims = [d for d in buf.shape]
    if not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    return int(np.prod([int(d) for d in dims]))


def _float32_weight_copies(mod, weight_elems: int) -> list[str]:
    """Float32 constants, parameters or buffers with at least a weight's elements."""
    found = []

    def visit(expr):
        if isinstance(expr, GenericConst) and str(expr.ty.dtype) == "float32" \
                and expr.value.numpy().size >= weight_elems:
            found.append(f"constant {list(expr.ty.shape)}")
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
        elif isinstance(func, tvm.tirx.PrimFunc):
            for buf in _lowered_buffers(func):
                size = _numel(buf)
                if str(buf.ty.dtype) == "float32" and size is not None and size >= weight_elems:
                    found.append(f"buffer {buf.name} {list(buf.shape)}")
    return found


@pytest.mark.parametrize("variant", [
    {}, {"transposed": True}, {"zero_point": True}, {"dtype": np.uint8},
])
def test_mlp_matches_stock_tvm_and_onnxruntime(variant):
    """Llama's MLP, three int8 per-channel projections: one build (symbolic M) for a GEMV, a
    tail of rows and several row tiles."""
    model = weight_only_mlp("M", HIDDEN, INTER, **variant)
    mod = _compare_all(model, [_x(m, HIDDEN) for m in (1, 5, 33)])
    notes = schedule_notes(mod)
    dtype = "uint8" if variant.get("dtype") is np.uint8 else "int8"
    assert notes.count(f"{dtype} weights widened in registers") == 3, notes


@pytest.mark.parametrize("strategy", ["dnnfusion", "tvm"])
def test_weight_never_materialised_in_float32(strategy):
    """The module holds the int8 panels and per-channel scales, never a float32 weight: no
    such constant, and no float32 parameter or buffer of the weight's size in any lowered
    PrimFunc (the GEMM's accumulator is a register tile)."""
    model = weight_only_mlp(4, 64, 160)
    mod = _compare_all(model, _x(4, 64), strategy=strategy)
    assert not _float32_weight_copies(mod, 64 * 160), _float32_weight_copies(mod, 64 * 160)
    int8 = [c for f in mod.functions.values() if isinstance(f, relax.Function)
            for c in _constants(f) if str(c.ty.dtype) == "int8"]
    assert len(int8) == 3 and all(c.value.numpy().size >= 64 * 160 for c in int8)


def _constants(func) -> list:
    out = []
    relax.analysis.post_order_visit(
        func, lambda e: out.append(e) if isinstance(e, GenericConst) else None)
    return out


def test_float32_path_unchanged_beside_it():
    """A float32 weight in the same build is packed as float32, as before."""
    model = weight_only_matmul(3, 40, 50, float_weights=True)
    mod = _compare_all(model, _x(3, 40))
    assert "packed GEMM" in schedule_notes(mod) and "widened" not in schedule_notes(mod)


def test_scale_along_k_keeps_the_float32_path():
    """A scale per input channel does not factor out of the sum over K: that weight is left
    to FoldConstant and the float32 packed GEMM (still correct)."""
    model = weight_only_matmul(3, 40, 50)
    node = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
    scale = next(i for i in model.graph.initializer if i.name == node.input[1])
    values = np.random.default_rng(0).uniform(0.01, 0.02, 40).astype("float32")
    scale.CopyFrom(numpy_helper.from_array(values, scale.name))
    node.attribute[0].i = 0
    mod = _compare_all(model, _x(3, 40))
    assert "widened" not in schedule_notes(mod)


@pytest.mark.parametrize("block", [None, 32], ids=["per_channel", "block_wise"])
@pytest.mark.parametrize("target", [ZEN3, AVX512, AARCH64], ids=["avx2", "avx512", "aarch64"])
def test_widening_micro_kernel_keeps_its_accumulators_in_registers(target, block):
    """Compile only: the int8 tile's k loop (2·MR·NR/lanes FMAs per iteration) moves no vector
    to or from the stack, widening B in registers or reading the converted block. The tile
    comes from ``CpuParams.gemm_tile(widened=...)``: AArch64's
    8×12 spilled with int8 weights (7×12 does not), AVX2's 4×24 with block scales (3×24)."""
    if "aarch64" in str(target) and "aarch64" not in str(
            tvm.target.codegen.llvm_get_targets()):
        pytest.skip("LLVM built without the AArch64 backend")
    params = cpu_params(target)
    mr, nr = params.gemm_tile(widened=True, block_scales=block is not None)
    # 3·MR rows widen B in the k loop (streaming); 6·MR rows convert each B block once into
    # float32 and run the float32 k loop on it (staged)
    for rows in (3 * mr, 6 * mr):
        loops = fma_loops(assembly(weight_only_matmul(rows, 300, 4 * nr, block=block), target))
        # (LLVM may unroll the staged loop once more: a multiple of the pair's FMAs)
        main = [loop for loop in loops if loop[1] % (2 * mr * nr // params.lanes) == 0]
        assert main and all(stack == 0 for _, _, stack in main), (rows, mr, nr, loops)


def test_per_tensor_scale_and_avx2_codegen():
    """One scale for the whole weight; compiled for Zen 3 (AVX2): the int8 lanes are widened
    and converted in the k loop."""
    model = weight_only_matmul(6, 48, 48)
    node = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
    scale = next(i for i in model.graph.initializer if i.name == node.input[1])
    scale.CopyFrom(numpy_helper.from_array(np.float32(0.01), scale.name))
    del node.attribute[:]
    mod = _compare_all(model, _x(6, 48), target=ZEN3)
    assert "int8 weights widened in registers" in schedule_notes(mod)
    asm = compile_model(import_onnx(model), ZEN3).mod.imports[0].inspect_source("asm")
    assert "vpmovsxbd" in asm and "vcvtdq2ps" in asm


@pytest.mark.parametrize("variant", [
    {"block": 32}, {"block": 16, "transposed": True, "zero_point": True},
])
def test_block_wise_weights_scaled_in_the_k_loop(variant):
    """Opset 21's block-wise DequantizeLinear (TVM 0.27's importer refuses it; the frontend's
    ``blocked_dequantize`` repair imports it): the integers stay packed, each block's scale is
    applied in the k loop (K = 67: a last block of 3), and no float32 copy of a weight is left."""
    model = weight_only_mlp("M", HIDDEN, INTER, **variant)
    with pytest.raises(FrontendError, match="blocked quantization"):
        from_onnx(model, repairs=ALL_REPAIRS - {"blocked_dequantize"})
    mod = _compare_all(model, [_x(m, HIDDEN) for m in (1, 6)])
    block = variant["block"]
    assert schedule_notes(mod).count(f"scaled per block of {block} k") == 3, schedule_notes(mod)
    assert not _float32_weight_copies(mod, HIDDEN * INTER)


def _int4_matmul(k, n, dtype):
    """``x · dq(W)`` with W an int4/uint4 initializer per output channel (opset 21)."""
    rng = np.random.default_rng(0)
    signed = dtype == TensorProto.INT4
    q = rng.integers(-8, 8, (k, n)) if signed else rng.integers(0, 16, (k, n))
    inits = [helper.make_tensor("wq", dtype, [k, n], q.flatten().tolist()),
             numpy_helper.from_array(rng.uniform(0.01, 0.1, n).astype("float32"), "ws")]
    inputs = ["wq", "ws"]
    if not signed:
        inits.append(helper.make_tensor("wz", dtype, [n], [8] * n))
        inputs.append("wz")
    nodes = [helper.make_node("DequantizeLinear", inputs, ["w"], axis=1),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    return make_model("int4", nodes, [value_info("x", ["M", k])], ["y"], inits, opset=21,
                      ir_version=10)


@pytest.mark.parametrize("dtype", [TensorProto.INT4, TensorProto.UINT4])
def test_int4_weights_imported_as_8_bit(dtype):
    """TVM 0.27 cannot read a 4-bit initializer (``TensorCopyFromBytes: size mismatch``); the
    ``int4_weights`` repair widens it to 8 bits, and the packed GEMM keeps those."""
    model = _int4_matmul(40, 30, dtype)
    with pytest.raises(Exception, match="size mismatch"):
        from_onnx(model, repairs=ALL_REPAIRS - {"int4_weights"})
    mod = _compare_all(model, [_x(3, 40)])
    assert "8 weights widened in registers" in schedule_notes(mod)


def test_tile_for_a_widened_weight():
    """The register model with the widening's registers: x86 widens into the B register, a
    block-wise weight needs a scale vector per B vector, NEON widens in two steps."""
    assert cpu_params(ZEN3).gemm_tile(widened=True) == (4, 24)
    assert cpu_params(ZEN3).gemm_tile(widened=True, block_scales=True) == (3, 24)
    assert cpu_params(AVX512).gemm_tile(widened=True, block_scales=True) == (12, 32)
    assert cpu_params(AARCH64).gemm_tile(widened=True) == (7, 12)
    assert cpu_params(ZEN3).gemm_tile() == (4, 24)  # float32 unchanged


def test_gemm_transb_with_bias_two_threads_staged_block():
    """ONNX Gemm (transB, bias) on an int8 weight [N, K] with zero points, for two threads:
    40 rows convert each B block once into float32 (beyond the 4 streaming row tiles), the
    N blocks run in parallel, each with its own block."""
    rng = np.random.default_rng(3)
    k, n = 50, 100
    w = rng.standard_normal((n, k)) / np.sqrt(k)
    lo, hi = w.min(axis=1), w.max(axis=1)
    scale = ((hi - lo) / 255).astype("float32")
    zp = np.clip(np.round(-lo / scale), 0, 255).astype(np.uint8)
    q = np.clip(np.round(w / scale[:, None]) + zp[:, None], 0, 255).astype(np.uint8)
    inits = [numpy_helper.from_array(q, "wq"), numpy_helper.from_array(scale, "ws"),
             numpy_helper.from_array(zp, "wz"),
             numpy_helper.from_array(rng.standard_normal(n).astype("float32"), "b")]
    nodes = [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0),
             helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)]
    model = make_model("gemm_uint8", nodes, [value_info("x", [40, k])], ["y"], inits)
    two = tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
    mod = _compare_all(model, [_x(40, k)], target=two)
    notes = schedule_notes(mod)
    assert "uint8 weights widened in registers" in notes and "parallel" in notes, notes

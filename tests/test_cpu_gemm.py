"""The packed-weight CPU GEMM (issue 20, item 1): constant matmul weights packed at compile time
(``layout/gemm_pack.py``), the MLAS-order template nest with its epilogue
(``tir_schedules/gemm_template.py``, ``cpu_gemm.py``), on odd shapes, symbolic and batched M,
both strategies that get our schedules, and the code LLVM makes of it for AVX2, AVX-512 and
AArch64."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import tvm
from asm_inspect import AARCH64, AVX512, ZEN3, assembly, fma_loops
from conftest import TARGET, host_has
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.ir.expr import GenericConst
from tvm.script import tirx as T

from tvm_fusion.compile import compile_model, fuse, import_onnx, run
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.testing.notes import schedule_notes
from tvm_fusion.tir_schedules.cpu_target import CpuParams, cpu_params
from tvm_fusion.tir_schedules.fused_block import FALLBACK_ATTR, SCHEDULE_ATTR, schedule_primfunc
from tvm_fusion.tir_schedules.gemm_template import Blocking, parallel_plan
from tvm_fusion.tir_schedules.records import ScheduleFailedWarning


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _w(name, shape, seed=0):
    data = np.random.default_rng(seed).standard_normal(shape).astype("float32")
    return numpy_helper.from_array(data, name)


def _model(nodes, inputs, outputs, inits):
    graph = helper.make_graph(nodes, "gemm", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    return model


def _matmul(m, k, n):
    return _model([helper.make_node("MatMul", ["x", "W"], ["y"])], [_vi("x", [m, k])],
                  [_vi("y", [m, n])], [_w("W", [k, n])])


def _feeds(model, **shapes):
    rng = np.random.default_rng(1)
    out = {}
    for value in model.graph.input:
        dims = [d.dim_value or shapes[d.dim_param] for d in value.type.tensor_type.shape.dim]
        out[value.name] = rng.standard_normal(dims).astype("float32")
    return out


def _check(model, target=TARGET, feeds=None, stock=False, **options):
    """Our build agrees with ONNX Runtime (and with stock TVM when asked); returns the fused
    module for structural checks."""
    feeds = feeds or _feeds(model)
    mod = import_onnx(model)
    inputs = list(feeds.values())
    reference = onnx_reference(model, feeds)
    # K terms of magnitude ~1: the fp32 sums differ by ~1e-7·sqrt(K)·|terms| between orders
    got = run(compile_model(mod, target, **options), inputs)
    compare(got, reference, rtol=1e-4, atol=2e-4)
    if stock:
        compare(got, run(compile_model(mod, target, strategy="tvm"), inputs), rtol=1e-4,
                atol=2e-4)
    return fuse(mod, target, **options)


# ------------------------------------------------------------------------------ numerics

_SHAPES = [(m, n, 17) for m in (1, 3, 17, 197) for n in (1, 33, 100, 1000)] + [
    (m, n, 768) for m in (1, 17, 197) for n in (1, 33, 1000)]
# the default run: every M tail, N and K kind once; the whole grid under -m slow
_FAST_SHAPES = {(1, 1000, 768), (3, 33, 17), (17, 100, 17), (197, 1, 768), (197, 1000, 17),
                (17, 33, 768)}


@pytest.mark.parametrize("m, n, k", [s if s in _FAST_SHAPES else
                                     pytest.param(*s, marks=pytest.mark.slow)
                                     for s in _SHAPES])
def test_odd_shapes_match_onnxruntime(m, n, k):
    """M tails of every size, N below one panel, a zero-padded last panel, K with one block
    (17) and with several (768 on a 32 KiB L1: three)."""
    mod = _check(_matmul(m, k, n), stock=m * n * k < 1e6)
    assert "packed GEMM" in schedule_notes(mod)


def test_avx2_tile_on_this_target():
    """The 4×24 tile and Zen 3's blocks, numerically right where the CPU runs AVX2."""
    if not host_has("avx2"):
        pytest.skip("this CPU has no AVX2")
    mod = _check(_matmul(37, 600, 130), target=ZEN3)
    assert "packed GEMM 4×24 tile, KC 256" in schedule_notes(mod)


@pytest.mark.parametrize("strategy", ["dnnfusion", "tvm", "apollo"])
def test_gemm_transb_bias_gelu_residual_epilogue(strategy):
    """ONNX Gemm (transB=1) + GELU + residual: one nest; the epilogue at the final store."""
    m, k, n = 19, 300, 70
    model = _model([helper.make_node("Gemm", ["x", "W", "b"], ["y"], transB=1),
                    helper.make_node("Gelu", ["y"], ["g"]),
                    helper.make_node("Add", ["g", "r"], ["z"])],
                   [_vi("x", [m, k]), _vi("r", [m, n])], [_vi("z", [m, n])],
                   [_w("W", [n, k]), _w("b", [n], 2)])
    mod = _check(model, strategy=strategy, schedule=True)
    notes = schedule_notes(mod)
    assert "packed GEMM" in notes and "at the last K block" in notes, notes


def test_transpose_after_the_gemm_is_its_store_index():
    """The transposed output is stored from the accumulator: one kernel, no copy after it
    (SmartMem's elimination or the planner may name the block otherwise)."""
    model = _model([helper.make_node("MatMul", ["x", "W"], ["y"]),
                    helper.make_node("Relu", ["y"], ["r"]),
                    helper.make_node("Transpose", ["r"], ["z"], perm=[0, 2, 1])],
                   [_vi("x", [2, 9, 40])], [_vi("z", [2, 30, 9])], [_w("W", [40, 30])])
    mod = _check(model)
    notes = schedule_notes(mod)
    assert "epilogue" in notes and "at the last K block" in notes, notes
    assert sum(isinstance(f, tvm.tirx.PrimFunc) for f in mod.functions.values()) == 1


@pytest.mark.parametrize("strategy", ["dnnfusion", "tvm"])
def test_swiglu(strategy):
    """silu(x·Wg) · (x·Wu): under stock grouping the up GEMM's epilogue reads the gate GEMM's
    result; DNNFusion's rewriting concatenates the weights and the product reads both halves."""
    m, k, n = 11, 96, 40
    model = _model([helper.make_node("MatMul", ["x", "Wg"], ["g"]),
                    helper.make_node("MatMul", ["x", "Wu"], ["u"]),
                    helper.make_node("Sigmoid", ["g"], ["s"]),
                    helper.make_node("Mul", ["g", "s"], ["silu"]),
                    helper.make_node("Mul", ["silu", "u"], ["z"])],
                   [_vi("x", [m, k])], [_vi("z", [m, n])], [_w("Wg", [k, n]), _w("Wu", [k, n], 3)])
    mod = _check(model, strategy=strategy, schedule=True)
    assert "packed GEMM" in schedule_notes(mod)


@T.prim_func(s_tir=True)
def _gate_up(x: T.Buffer((5, 16), "float32"), wg: T.Buffer((3, 16, 8), "float32"),
             wu: T.Buffer((3, 16, 8), "float32"), out: T.Buffer((5, 20), "float32")):
    gate = T.sblock_alloc_buffer((5, 20))
    up = T.sblock_alloc_buffer((5, 20))
    for i, j, k in T.grid(5, 20, 16):
        with T.sblock("gate"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                gate[vi, vj] = T.float32(0)
            gate[vi, vj] = gate[vi, vj] + x[vi, vk] * wg[vj // 8, vk, vj % 8]
    for i, j, k in T.grid(5, 20, 16):
        with T.sblock("up"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                up[vi, vj] = T.float32(0)
            up[vi, vj] = up[vi, vj] + x[vi, vk] * wu[vj // 8, vk, vj % 8]
    for i, j in T.grid(5, 20):
        with T.sblock("swiglu"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = gate[vi, vj] * T.sigmoid(gate[vi, vj]) * up[vi, vj]


def test_swiglu_of_two_gemms_in_one_function():
    """Both projections in one fused function (8-column panels: AVX2's vector). The gate
    GEMM's write-back comes after the up GEMM, so silu(gate)·up is stored from the gate
    GEMM's accumulator there; the up GEMM's nest must not take the gate's write-back as
    its epilogue."""
    params = cpu_params(ZEN3)
    func = schedule_primfunc(_gate_up, params, fast=False)
    notes = "\n".join(func.attrs[SCHEDULE_ATTR])
    assert notes.count("packed GEMM") == 2 and "epilogue swiglu" in notes, notes
    rng = np.random.default_rng(0)
    x, wg, wu = (rng.standard_normal(s).astype("float32") for s in ((5, 16), (16, 20), (16, 20)))

    def pack(w):
        padded = np.zeros((16, 24), "float32")
        padded[:, :20] = w
        return np.ascontiguousarray(padded.reshape(16, 3, 8).transpose(1, 0, 2))

    lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                         tvm.target.Target("llvm"))
    out = tvm.runtime.empty((5, 20), "float32")
    lib["main"](*(tvm.runtime.tensor(a) for a in (x, pack(wg), pack(wu))), out)
    gate, up = x @ wg, x @ wu
    np.testing.assert_allclose(out.numpy(), gate / (1 + np.exp(-gate)) * up, rtol=1e-5,
                               atol=1e-5)



def _two_gemms_of_one_name():
    """Two packed GEMMs of one function whose result buffers are both ``matmul_packed`` (as
    FuseTIR leaves each operator's internal buffer; TE names them the same way)."""
    x = tvm.te.placeholder((5, 16), name="x")
    wg, wu = (tvm.te.placeholder((3, 16, 8), name=n) for n in ("wg", "wu"))

    def gemm(w):
        k = tvm.te.reduce_axis((0, 16), name="k")
        return tvm.te.compute((5, 20), lambda i, j: tvm.te.sum(x[i, k] * w[j // 8, k, j % 8],
                                                                 axis=k), name="matmul_packed")
    g, u = gemm(wg), gemm(wu)
    out = tvm.te.compute((5, 20), lambda i, j: g[i, j] * u[i, j], name="out")
    return tvm.te.create_prim_func([x, wg, wu, out])


def test_two_gemms_writing_buffers_of_one_name_are_both_packed():
    """cache_write names each write-back after the buffer it writes: both are
    ``matmul_packed_local``. Looked up by name, one GEMM's nest went in both places, whose
    lowering failed ('acc0 has duplicate definitions') and the block fell back to register
    tiles (fuzz seeds 1908, 2274); each write-back is now marked with its GEMM's name."""
    func = _two_gemms_of_one_name()
    assert [b.name for b in func.body.block.alloc_buffers] == ["matmul_packed"] * 2
    func = schedule_primfunc(func, cpu_params(ZEN3), fast=False)
    notes = "\n".join(func.attrs[SCHEDULE_ATTR])
    assert notes.count("packed GEMM") == 2, notes
    lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                         tvm.target.Target("llvm"))
    rng = np.random.default_rng(0)
    x, wg, wu = (rng.standard_normal(s).astype("float32") for s in ((5, 16), (16, 20), (16, 20)))

    packed = [np.zeros((3, 16, 8), "float32") for _ in range(2)]  # 8-column panels
    for p, w in zip(packed, (wg, wu)):
        for j in range(20):
            p[j // 8, :, j % 8] = w[:, j]
    out = tvm.runtime.empty((5, 20), "float32")
    lib["main"](*(tvm.runtime.tensor(a) for a in (x, *packed)), out)
    np.testing.assert_allclose(out.numpy(), (x @ wg) * (x @ wu), rtol=1e-5, atol=1e-5)


def test_two_conv_gemms_in_one_block_are_both_packed():
    """A 1×1 conv then a padded 3×3 conv in one block (M2M→M2M green): both conv GEMMs write
    a buffer named ``matmul_packed`` and both get the packed GEMM kernel, no fallback."""
    model = _model([helper.make_node("Conv", ["x", "w1"], ["h"], kernel_shape=[1, 1]),
                    helper.make_node("Conv", ["h", "w2"], ["y"], kernel_shape=[3, 3],
                                     pads=[1, 1, 1, 1])],
                   [_vi("x", [1, 4, 6, 6])], [_vi("y", [1, 16, 6, 6])],
                   [_w("w1", [32, 4, 1, 1]), _w("w2", [16, 32, 3, 3], 1)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScheduleFailedWarning)
        mod = _check(model, table3={("M2M", "M2M"): "green"})
    notes = schedule_notes(mod)
    assert "matmul_packed: packed GEMM" in notes and "matmul_packed1: packed GEMM" in notes, notes


def test_symbolic_rows_one_build_several_sizes():
    """A symbolic sequence length and a batch dimension folded into M: one build, run at
    lengths that take each runtime path: one row tile (all of K in one pass), a few (B
    streamed panel by panel), many (K and N blocks), with and without an M tail."""
    model = _model([helper.make_node("MatMul", ["x", "W"], ["y"]),
                    helper.make_node("Add", ["y", "b"], ["z"])],
                   [_vi("x", [2, "seq", 600])], [_vi("z", [2, "seq", 33])],
                   [_w("W", [600, 33]), _w("b", [33], 2)])
    mod = import_onnx(model)
    executable = compile_model(mod, TARGET)
    for seq in (1, 2, 7, 8, 23):
        feeds = _feeds(model, seq=seq)
        got = run(executable, list(feeds.values()))
        compare(got, onnx_reference(model, feeds), rtol=1e-4, atol=2e-4)
    assert "packed GEMM" in schedule_notes(fuse(mod, TARGET))


def test_batched_a_with_transposed_rows_is_copied_row_major():
    """A read through a transpose and reshape (attention heads merged before the output
    projection): copied once so the kernel's broadcasts walk along k."""
    model = _model([helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1, 3]),
                    helper.make_node("Reshape", ["t", "shape"], ["r"]),
                    helper.make_node("MatMul", ["r", "W"], ["z"])],
                   [_vi("x", [1, 4, 13, 16])], [_vi("z", [1, 13, 30])],
                   [_w("W", [64, 30]), numpy_helper.from_array(np.array([1, 13, 64]), "shape")])
    notes = schedule_notes(_check(model))
    assert "A copied row-major first" in notes, notes


@pytest.mark.parametrize("cores, mode", [(2, "parallel N blocks"), (2, "parallel row ranges")])
def test_threads(cores, mode):
    """N blocks in parallel when N has enough panels, else row ranges."""
    n = 300 if mode == "parallel N blocks" else 20
    target = tvm.target.Target({"kind": "llvm", "num-cores": cores})
    notes = schedule_notes(_check(_matmul(301, 64, n), target=target))
    assert mode in notes, notes


@pytest.mark.parametrize("cores", [2, 3, 4])
def test_n_blocks_are_a_whole_number_per_thread(cores):
    """A parallel loop gives each thread a contiguous share of its iterations: BERT's merged
    Q/K/V GEMM (N = 2304, 72 panels of 32) in the cache's blocks of 25 panels made 3 blocks,
    so on 2 threads one thread did two; now the blocks are a multiple of the threads, each at
    most the cache's size, the result identical (test_threads)."""
    blk = Blocking(mr=12, nr=32, lanes=16, kc=160, nc=800)
    mode, shared = parallel_plan(2304, blk, cores, 128)
    blocks = -(-72 // shared)
    assert mode == "parallel N blocks" and shared <= 25 and blocks % cores == 0, (shared, blocks)
    assert parallel_plan(2304, blk, 1, 128) == ("one thread", 25)


# ------------------------------------------------------------------------------ the weight

def test_packed_weight_is_the_only_constant():
    """Gemm transB: the weight is folded into one packed constant [⌈N/NR⌉, K, NR], zero past
    column N; no unpacked copy (neither W nor Wᵀ) stays in the module."""
    n, k = 50, 32
    weight = np.random.default_rng(0).standard_normal((n, k)).astype("float32")
    model = _model([helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)], [_vi("x", [5, k])],
                   [_vi("y", [5, n])], [numpy_helper.from_array(weight, "W")])
    mod = fuse(import_onnx(model), ZEN3)
    consts = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: consts.append(e)
                                    if isinstance(e, GenericConst) else None)
    shapes = [tuple(int(d) for d in c.ty.shape) for c in consts]
    assert shapes == [(3, k, 24)], shapes
    packed = consts[0].value.numpy()
    expected = np.zeros((k, 72), "float32")
    expected[:, :n] = weight.T
    np.testing.assert_array_equal(packed, expected.reshape(k, 3, 24).transpose(1, 0, 2))


def test_gemm_after_packed_convs_is_packed_too():
    """A CNN's classifier: the conv packing legalises every op of the module, so the GEMM
    weights are packed before it (found on ViT: its patch-embedding conv left every GEMM of
    the encoder unpacked)."""
    model = _model([helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3],
                                     pads=[1, 1, 1, 1]),
                    helper.make_node("Flatten", ["c"], ["f"]),
                    helper.make_node("Gemm", ["f", "W", "b"], ["y"], transB=1)],
                   [_vi("x", [1, 8, 6, 6])], [_vi("y", [1, 10])],
                   [_w("w", [16, 8, 3, 3]), _w("W", [10, 576], 1), _w("b", [10], 2)])
    mod = _check(model, conv_layout="NCHWc")
    notes = schedule_notes(mod)
    assert "conv2d_NCHWc" in notes and "packed GEMM" in notes, notes


def test_weights_stay_unpacked_when_asked_or_not_constant():
    model = _matmul(8, 16, 24)
    assert "packed GEMM" not in schedule_notes(fuse(import_onnx(model), TARGET, pack_weights=False))
    activations = _model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                         [_vi("x", [8, 16]), _vi("w", [16, 24])], [_vi("y", [8, 24])], [])
    assert "packed GEMM" not in schedule_notes(_check(activations))
    # a transposed activation (found by the fuzzer: the pass looked through its binding)
    transposed = _model([helper.make_node("Softmax", ["w"], ["s"]),
                         helper.make_node("Transpose", ["s"], ["t"], perm=[1, 0]),
                         helper.make_node("MatMul", ["x", "t"], ["y"])],
                        [_vi("x", [8, 16]), _vi("w", [24, 16])], [_vi("y", [8, 24])], [])
    assert "packed GEMM" not in schedule_notes(_check(transposed))


def test_failed_kernel_falls_back_to_register_tiles(monkeypatch):
    """Anything the template cannot take never fails the build: the register-tile rule runs
    and the reason is noted."""
    import tvm_fusion.tir_schedules.fused_block as fb

    def broken(*_args, **_kwargs):
        raise RuntimeError("template exploded")

    monkeypatch.setattr(fb, "emit_packed_gemms", broken)
    mod = _check(_matmul(9, 20, 30))
    notes = schedule_notes(mod)
    assert "packed GEMM kernel not used (RuntimeError: template exploded)" in notes, notes
    assert not any(FALLBACK_ATTR in (f.attrs or {}) for f in mod.functions.values()
                   if isinstance(f, tvm.tirx.PrimFunc))


# ------------------------------------------------------------------------- target parameters

def test_tile_and_blocks_come_from_the_target():
    zen3 = cpu_params(tvm.target.Target({"kind": "llvm", "mcpu": "znver3",
                                         "mtriple": "x86_64-linux-gnu"}))
    assert (zen3.isa, zen3.gemm_tile()) == ("avx2", (4, 24))
    assert zen3.gemm_blocks(4, 24) == (256, 240)  # the measured best of the design note
    assert cpu_params(AVX512).gemm_tile() == (12, 32)
    assert cpu_params(AARCH64).gemm_tile() == (8, 12)
    zen5 = cpu_params(tvm.target.Target({"kind": "llvm", "mcpu": "znver5",
                                         "mtriple": "x86_64-linux-gnu"}))
    assert zen5.gemm_blocks(12, 32) == (256, 512)
    # the caches attention's tiles read too
    assert (zen5.l1d_bytes, zen5.l1d_ways, zen5.l2_bytes) == (48 << 10, 12, 1 << 20)
    # a narrower panel (N of one vector) gets the rows that fit the registers beside it
    params = CpuParams(8, 12, 1, isa="avx2")
    assert params.gemm_tile(8) == (14, 8) and params.gemm_tile(16) == (6, 16)


# ------------------------------------------------------------------------------ the code

@pytest.mark.parametrize("target", [ZEN3, AVX512, AARCH64], ids=["avx2", "avx512", "aarch64"])
def test_micro_kernel_keeps_its_accumulators_in_registers(target):
    """Compile only (the AVX-512 and AArch64 code cannot run here): the main tile's k loop
    (two k steps per iteration: 2·MR·NR/lanes FMAs) moves no vector to or from the stack,
    over several K blocks and with the epilogue's partial sums (a spill would)."""
    if "aarch64" in str(target) and "aarch64" not in str(
            tvm.target.codegen.llvm_get_targets()):
        pytest.skip("LLVM built without the AArch64 backend")
    params = cpu_params(target)
    mr, nr = params.gemm_tile()
    fma_per_pair = 2 * mr * nr // params.lanes
    for m, k in ((3 * mr, 300), (5 * mr, 1000)):
        loops = fma_loops(assembly(_matmul(m, k, 4 * nr), target))
        main = [loop for loop in loops if loop[1] == fma_per_pair]
        assert main, loops
        assert all(stack == 0 for _, _, stack in main), (m, k, main)


@pytest.mark.parametrize("target", [ZEN3, AVX512, AARCH64], ids=["avx2", "avx512", "aarch64"])
def test_c_tile_is_prefetched_for_writing(target):
    """Every tile prefetches its lines of C for writing before its k loop (the partial sums
    it reloads after the loop were stored a pass over M earlier): prefetchw on x86, a store
    prefetch on AArch64."""
    if "aarch64" in str(target) and "aarch64" not in str(
            tvm.target.codegen.llvm_get_targets()):
        pytest.skip("LLVM built without the AArch64 backend")
    mr, nr = cpu_params(target).gemm_tile()
    asm = assembly(_matmul(3 * mr, 1000, 4 * nr), target)
    write = r"prefetchw\b" if "aarch64" not in str(target) else r"prfm\s+pstl1keep"
    assert len(re.findall(write, asm)) >= mr, asm.count("prefetch")



"""Dense NCHW convs as the packed GEMM (``layout/gemm_pack.py``: the weight as A, the im2col
matrix packed per call into panels as B): which convs take it, the panel plan, and the same
numbers as ONNX Runtime on odd channels, strides, dilations, padding and batches."""

import numpy as np
import pytest
import tvm
from asm_inspect import AARCH64, AVX512, ZEN3, assembly, fma_loops
from conftest import TARGET
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion.compile import compile_model, count_kernels, fuse, import_onnx, run
from tvm_fusion.layout.gemm_pack import fold_conv3d, pack_rows, plan_conv_gemm
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.testing.notes import schedule_notes
from tvm_fusion.tir_schedules.cpu_target import cpu_params

AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 1})
NEON = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu"})
ZEN4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 1})
SKX = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 1})


def conv_model(c_in, c_out, size, k, stride=1, pad=0, dilation=1, groups=1, batch=1,
               pads=None):
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((c_out, c_in // groups, k, k)).astype("float32")
    bias = rng.standard_normal(c_out).astype("float32")
    node = helper.make_node("Conv", ["x", "W", "B"], ["y"], kernel_shape=[k, k],
                            strides=[stride] * 2, pads=pads or [pad] * 4,
                            dilations=[dilation] * 2, group=groups)
    relu = helper.make_node("Relu", ["y"], ["z"])
    graph = helper.make_graph(
        [node, relu], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c_in, size, size])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _check(model, target, batch=1, **options):
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    shape[0] = shape[0] or batch
    x = np.random.default_rng(3).standard_normal(shape).astype("float32")
    got = run(compile_model(import_onnx(model), target, **options), [x])
    compare(got, onnx_reference(model, {"x": x}), rtol=1e-4, atol=1e-4)


CASES = {
    "1x1": (16, 24, 9, 1),  # flat positions, a tail panel (81 columns)
    "1x1-stride2": (16, 8, 10, 1, 2),
    "3x3-pad": (8, 16, 12, 3, 1, 1),
    "3x3-stride2-odd": (17, 33, 13, 3, 2, 1),
    "3x3-dilated": (8, 12, 11, 3, 1, 2, 2),
    "7x7-stride2-3ch": (3, 16, 20, 7, 2, 3),
    "4x4-stride4": (3, 8, 16, 4, 4),
    "odd-7x7-map": (5, 7, 7, 3, 1, 1),
    "multi-k-block": (40, 16, 8, 3, 1, 1),  # K = 360: two K blocks of packed panels
    "positions-as-rows": (16, 40, 5, 3, 1, 1),  # 25 positions < 40 channels
    "positions-as-rows-1x1-odd": (17, 33, 5, 1),
    # stride 1 on the padded input's flat positions (ConvGemm.padded_flat)
    "padded-flat-batch": (6, 24, 17, 3, 1, 1, 1, 1, 2),  # across two images
    "padded-flat-5x5-batch": (6, 24, 25, 5, 1, 2, 1, 1, 2),
    "padded-flat-dilated": (6, 24, 25, 3, 1, 2, 2),
    # no padding: the gather reads the input itself (a parameter) through its flat view
    "2x2-no-pad-batch": (8, 16, 9, 2, 1, 0, 1, 1, 2),
    "positions-as-rows-no-pad": (6, 40, 6, 3, 1, 0),
    # the flat output positions through a table of column offsets (ConvGemm.gathered): many
    # output channels over 12- and 11-wide rows that whole panels would pad to 16 (AVX2)
    "gathered-stride2": (8, 160, 24, 3, 2, 1),
    "gathered-dilated-batch": (17, 96, 12, 3, 1, 2, 2, 1, 2),  # across two images
    "gathered-odd": (17, 161, 21, 3, 2, 1),  # 121 positions: a tail panel of 9
}


@pytest.mark.parametrize("target", [TARGET, AVX2], ids=["llvm", "avx2"])
@pytest.mark.parametrize("name", list(CASES))
def test_conv_as_packed_gemm_matches_onnxruntime(name, target):
    model = conv_model(*CASES[name])
    notes = schedule_notes(fuse(import_onnx(model), target))
    assert "packed GEMM" in notes, notes
    if name.startswith("padded-flat"):
        c_in, c_out, size, k, _, pad, *rest = CASES[name]
        dilation, batch = (rest + [1, 1, 1])[0], (rest + [1, 1, 1])[2]
        plan = plan_conv_gemm([batch, c_in, size, size], (k, k), (1, 1), (pad,) * 4,
                              (dilation,) * 2, cpu_params(target), c_out)
        assert plan.padded_flat, plan
    _check(model, target)


def test_batch_and_asymmetric_padding():
    model = conv_model(6, 10, 9, 3, 1, batch=3, pads=[0, 1, 2, 1])
    notes = schedule_notes(fuse(import_onnx(model), AVX2))
    assert "B packed per block" in notes, notes  # the im2col stage runs inside the GEMM
    _check(model, AVX2)


def _symbolic(model, *axes):
    """``model`` with its input's ``axes`` symbolic."""
    for axis in axes:
        model.graph.input[0].type.tensor_type.shape.dim[axis].dim_param = f"d{axis}"
    return model


def _check_sizes(model, target, shapes):
    """One build of ``model`` run at each input shape, against ONNX Runtime."""
    executable = compile_model(import_onnx(model), target)
    for shape in shapes:
        x = np.random.default_rng(len(shapes)).standard_normal(shape).astype("float32")
        compare(run(executable, [x]), onnx_reference(model, {"x": x}), rtol=1e-4, atol=1e-4)


def test_grouped_convs_keep_the_direct_conv():
    grouped = conv_model(8, 8, 10, 3, 1, 1, groups=8)
    assert "packed GEMM" not in schedule_notes(fuse(import_onnx(grouped), AVX2))
    _check(grouped, AVX2)
    symbolic = _symbolic(conv_model(8, 8, 10, 3, 2, 1, groups=4), 0)
    assert "packed GEMM" not in schedule_notes(fuse(import_onnx(symbolic), AVX2))
    _check_sizes(symbolic, AVX2, [(1, 8, 10, 10), (3, 8, 10, 10)])


# a symbolic batch: one image's plan, the GEMM once per image (its columns and panels those of
# one image), the weight as packed at compile time; positions as rows take the images as rows
SYMBOLIC_BATCH = ["1x1", "1x1-stride2", "3x3-stride2-odd", "7x7-stride2-3ch", "odd-7x7-map",
                  "multi-k-block", "positions-as-rows-1x1-odd", "padded-flat-5x5-batch",
                  "padded-flat-dilated", "gathered-stride2", "gathered-dilated-batch"]


@pytest.mark.parametrize("target", [TARGET, AVX2], ids=["llvm", "avx2"])
@pytest.mark.parametrize("name", SYMBOLIC_BATCH)
def test_symbolic_batch_conv_as_packed_gemm(name, target):
    c_in, _, size, *_ = CASES[name]
    model = _symbolic(conv_model(*CASES[name][:8]), 0)
    notes = schedule_notes(fuse(import_onnx(model), target))
    assert "packed GEMM" in notes, notes
    if not name.startswith("positions-as-rows"):
        assert "one GEMM per image" in notes and "B packed per block" in notes, notes
    _check_sizes(model, target, [(1, c_in, size, size), (3, c_in, size, size)])


def test_symbolic_map_keeps_the_direct_conv():
    """A symbolic height or width changes the plan (rows, panels) with the size: the direct
    conv's schedule, which takes symbolic maps, runs it."""
    model = _symbolic(conv_model(5, 12, 9, 3, 2, 1), 0, 2, 3)
    assert "packed GEMM" not in schedule_notes(fuse(import_onnx(model), AVX2))
    _check_sizes(model, AVX2, [(1, 5, 9, 9), (2, 5, 13, 6)])


@pytest.mark.parametrize("layout", ["NCHWc", "NCHW"])
def test_gemm_route_only_under_auto(layout):
    model = conv_model(16, 16, 8, 3, 1, 1)
    notes = schedule_notes(fuse(import_onnx(model), AVX2, conv_layout=layout))
    assert "packed GEMM" not in notes, notes


def test_gemm_followed_by_a_pool_in_one_kernel():
    """A conv GEMM and a max pool forced into one kernel: the pool's rule must not move the
    GEMM's write-back under its loops (the template replaces that nest: the pool was lost)."""
    from tvm_fusion.models.conv_chains import chain_model
    model = chain_model(8, 12, [("conv", 8, 3, 1, 1, 1, None), ("maxpool", 3, 2, 1)])
    forced = {"table3": {("M2M", "M2M"): "green"}}
    notes = schedule_notes(fuse(import_onnx(model), TARGET, **forced))
    assert "packed GEMM" in notes and "pool" in notes, notes
    x = np.random.default_rng(1).standard_normal((1, 8, 12, 12)).astype("float32")
    got = run(compile_model(import_onnx(model), TARGET, **forced), [x])
    compare(got, run(compile_model(import_onnx(model), TARGET, conv_layout="NCHW"), [x]),
            rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", [AVX2, NEON], ids=["avx2", "neon"])
@pytest.mark.parametrize("out_w", [7, 14, 28, 31, 56, 112])
def test_panels_hold_whole_output_rows(target, out_w):
    params = cpu_params(target)
    size = 2 * out_w  # stride 2: output rows padded to whole panels
    plan = plan_conv_gemm([1, 8, size, size], (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), params)
    assert not plan.padded_flat and plan.out_w == out_w
    assert plan.nr % params.lanes == 0 and plan.row % plan.nr == 0
    assert plan.row - out_w < plan.nr  # at most one partly used panel per row
    flat = plan_conv_gemm([2, 8, out_w, out_w], (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), params)
    assert flat.flat and flat.row == out_w
    # more channels than positions: the positions are the rows where their columns would
    # cost much more than the positions themselves (AVX2: 7×7, 49 positions in 56 columns of
    # a narrow 8-wide tile), columns otherwise (14×14 and up)
    wide = plan_conv_gemm([1, 8, out_w, out_w], (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), params,
                          out_channels=out_w * out_w + 1)
    if params.isa == "avx2":
        assert wide.positions_as_rows == (out_w == 7), wide
    if not wide.positions_as_rows and not wide.gathered:  # gathered: many channels only
        assert wide == plan_conv_gemm([1, 8, out_w, out_w], (3, 3), (1, 1), (1, 1, 1, 1),
                                      (1, 1), params)


@pytest.mark.parametrize("target", [AVX2, NEON], ids=["avx2", "neon"])
@pytest.mark.parametrize("out_w", [7, 14, 28, 31, 56, 112])
def test_stride_one_takes_the_fewer_columns(target, out_w):
    """Stride 1: the padded input's flat positions (a row costs its padded width) or rows
    padded to whole panels, whichever computes fewer panel columns."""
    params = cpu_params(target)
    plan = plan_conv_gemm([2, 8, out_w, out_w], (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), params)
    panels = -(-plan.columns(2) // plan.nr) * plan.nr
    by_rows = 2 * out_w * -(-out_w // plan.nr) * plan.nr
    if plan.padded_flat:
        assert plan.row == out_w + 2 and plan.image == (out_w + 2) ** 2
        assert panels <= by_rows + plan.nr
    if out_w == 56 and params.isa != "sse":  # 58 columns a row against 64
        assert plan.padded_flat


def squeeze_excite_model(channels: int, reduced: int, size: int):
    """EfficientNet's squeeze-excite: a global average pool, a 1×1 conv + SiLU and a 1×1 conv
    + sigmoid on the 1×1 map, the gate multiplied into the input."""
    rng = np.random.default_rng(5)
    consts = {"W1": (reduced, channels, 1, 1), "B1": (reduced,), "W2": (channels, reduced, 1, 1),
              "B2": (channels,)}
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["p"]),
             helper.make_node("Conv", ["p", "W1", "B1"], ["r"]),
             helper.make_node("Sigmoid", ["r"], ["rs"]),
             helper.make_node("Mul", ["r", "rs"], ["a"]),
             helper.make_node("Conv", ["a", "W2", "B2"], ["e"]),
             helper.make_node("Sigmoid", ["e"], ["g"]), helper.make_node("Mul", ["x", "g"], ["y"])]
    graph = helper.make_graph(
        nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size,
                                                                             size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rng.standard_normal(s).astype("float32"), n)
         for n, s in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("target", [TARGET, AVX2], ids=["llvm", "avx2"])
def test_squeeze_excite_convs_on_one_position_stay_fused(target):
    """The 1×1 convs of a squeeze-excite run on one position (M = 1 with the positions as
    rows): one row tile, one thread. With two row ranges (the second empty) and every row-tail
    tile under a runtime test, the fusion guard counted 17-117x the arithmetic of the parts and
    split EfficientNet-B0's conv + SiLU kernels (117 kernels against stock's 100)."""
    model = squeeze_excite_model(40, 10, 6)
    mod = fuse(import_onnx(model), target)
    notes = schedule_notes(mod)
    assert "one thread" in notes and "row ranges" not in notes, notes
    assert count_kernels(mod) <= count_kernels(fuse(import_onnx(model), target, strategy="tvm"))
    _check(model, target)


@pytest.mark.parametrize("target", [ZEN3, AVX512, AARCH64], ids=["avx2", "avx512", "aarch64"])
def test_every_tile_of_a_conv_keeps_its_accumulators_in_registers(target):
    """Compile only: 32 output channels are 6-row tiles and a 2-row tail on AVX2 (whose
    accumulators a heap workspace once kept in memory while the k loop read the packed B
    block), 12 + 12 + 8 rows on AVX-512, 8-row tiles on AArch64: no FMA loop of the conv
    moves a vector to or from the stack."""
    if "aarch64" in str(target) and "aarch64" not in str(
            tvm.target.codegen.llvm_get_targets()):
        pytest.skip("LLVM built without the AArch64 backend")
    loops = fma_loops(assembly(conv_model(16, 32, 40, 3, 2, 1), target))
    assert loops and all(stack == 0 for _, _, stack in loops), loops


@pytest.mark.parametrize("case", [(16, 32, 40, 3, 2, 1), (1024, 48, 4, 1)],
                         ids=["16x16-stride2", "16x16-row-slivers"])
def test_zen4_conv_tile_keeps_its_accumulators_in_registers(case):
    """Compile only: Zen 4's conv panels of 16 (a 16×16 tile, 16 accumulators and a
    16-row tail; the weight read in place, or packed in slivers of 16 rows) move no vector to
    or from the stack in any FMA loop."""
    loops = fma_loops(assembly(conv_model(*case), ZEN4))
    assert loops and all(stack == 0 for _, _, stack in loops), loops


@pytest.mark.parametrize("target, size", [(ZEN3, 12), (AVX512, 12), (AARCH64, 13)],
                         ids=["avx2", "avx512", "aarch64"])
def test_gathered_conv_keeps_its_accumulators_in_registers(target, size):
    """Compile only: the gathered plan (a dilated 3×3, 128 output channels on a map whose
    rows the target's panels would pad: 12 → 16 on AVX2 and AVX-512, 13 → 16 on AArch64)
    packs its B block through the column offsets and runs the same micro-kernel, no FMA loop
    moving a vector to or from the stack."""
    if "aarch64" in str(target) and "aarch64" not in str(
            tvm.target.codegen.llvm_get_targets()):
        pytest.skip("LLVM built without the AArch64 backend")
    model = conv_model(17, 128, size, 3, 1, 2, 2)
    assert plan_conv_gemm([1, 17, size, size], (3, 3), (1, 1), (2,) * 4, (2, 2),
                          cpu_params(target), 128).gathered
    loops = fma_loops(assembly(model, target))
    assert loops and all(stack == 0 for _, _, stack in loops), loops


@pytest.mark.parametrize("case", [(16, 32, 20, 3, 2, 1), (8, 16, 12, 3, 1, 1),
                                  (16, 40, 5, 3, 1, 1)], ids=["stride2", "padded-flat",
                                                               "positions-as-rows"])
def test_im2col_gathers_through_a_table_of_k_offsets(case):
    """The window's divisions of k (k // 9, k % 3…) are done once per call into a table:
    the packing of B (or the copy of A, positions as rows) reads the padded input at a
    panel's (a row's) offset plus the table's, and the numbers stay ONNX Runtime's."""
    model = conv_model(*case)
    func = [f for f in fuse(import_onnx(model), AVX2).functions.values()
            if isinstance(f, tvm.tirx.PrimFunc) and "packed GEMM" in schedule_notes(
                tvm.IRModule({"f": f}))][0]
    assert "k_offsets" in func.script(), func.script()
    _check(model, AVX2)


@pytest.mark.parametrize("case", [(3, 32, 32, 3, 2, 1), (144, 24, 16, 1), (16, 32, 32, 3, 2, 1)],
                         ids=["stem-3x3s2", "1x1-144>24", "3x3s2-16>32"])
def test_few_row_tiles_read_b_in_place(case):
    """At most two row tiles (≤ 32 output channels on Zen 4's 16×16 tile): the micro-kernels
    read B from the (padded) input through the k table where its packing would have, no
    ``b_block``; 64 channels (four tiles) still pack it. The numbers stay ONNX Runtime's."""
    def script(model):
        return "\n".join(f.script() for f in fuse(import_onnx(model), ZEN4).functions.values()
                         if isinstance(f, tvm.tirx.PrimFunc))
    model = conv_model(*case)
    text = script(model)
    assert "k_offsets" in text and "b_block" not in text, text
    wide = conv_model(case[0], 64, *case[2:])
    assert "b_block" in script(wide)
    _check(model, ZEN4)
    _check(model, AVX2)  # AVX2's 6×16 tile: 32 channels are 6 tiles, packed


# positions as rows of a 1x1 conv (NCHW): (c_in, c_out, size, batch, target); batch > 1 puts
# slivers across two images
SLIVER_CASES = {
    "zen4-960>160@7": (960, 160, 7, 1, ZEN4),  # MobileNetV2's: 4 slivers of 12 rows + 1
    "zen4-40>96@3-batch2": (40, 96, 3, 2, ZEN4),
    "avx2-33>64@5": (33, 64, 5, 1, AVX2),
    "avx2-33>64@5-batch2": (33, 64, 5, 2, AVX2),
    "avx2-40>96@5-batch2": (40, 96, 5, 2, AVX2),
    "neon-40>96@3-batch2": (40, 96, 3, 2, NEON),
    "neon-64>128@5": (64, 128, 5, 1, NEON),
}


@pytest.mark.parametrize("case", list(SLIVER_CASES))
def test_positions_as_rows_copy_contiguous_runs_into_row_slivers(case):
    """A 1x1 conv's positions as rows read its NCHW input transposed: ``A[m, k] = x[k, m]``.
    Copied row-major, that was a gather per value (``vgatherqps`` on AVX-512, ~15 % of
    MobileNetV2's 960→160 conv at 7×7); it is copied as the micro-kernel reads it, slivers
    ``a_slivers[m // MR, k, m % MR]``, each sliver's MR rows one run of MR consecutive floats
    per k (the last sliver only its rows, 49 = 4·12 + 1), and only a sliver across two images
    through the gather. The numbers stay ONNX Runtime's (odd maps, batch 2)."""
    c_in, c_out, size, batch, target = SLIVER_CASES[case]
    model = conv_model(c_in, c_out, size, 1, batch=batch)
    script = "\n".join(f.script() for f in fuse(import_onnx(model), target).functions.values()
                       if isinstance(f, tvm.tirx.PrimFunc))
    assert "a_slivers" in script and "a_rows" not in script, script
    if case == "zen4-960>160@7":  # the 4 full slivers: consecutive floats, no table per row
        assert "x_flat[s * T.int64(12) + lane + a_k_offsets[kk]]" in script, script
    if target is NEON:
        return  # AArch64: the plan builds (the TIR above); not run here
    _check(model, target)


@pytest.mark.parametrize("target", [AVX2, NEON], ids=["avx2", "neon"])
def test_gathered_positions_where_row_panels_would_pad_many_channels(target):
    """The flat output positions, packed through a table of column offsets, where whole
    panels per row would compute many padding columns for many output channels (the dilated
    3×3 256→256 at 28×28: 784 columns against 896); not where the rows fit their panels
    (32-wide rows) or the padded input's flat positions pad less (56 + 2 columns a row),
    nor for few output channels (the gather's cost per packed value is then a larger share)."""
    params = cpu_params(target)

    def plan(c_out, size, dilation=1, stride=1):
        return plan_conv_gemm([1, 64, size, size], (3, 3), (stride, stride), (dilation,) * 4,
                              (dilation, dilation), params, c_out)
    dilated = plan(256, 28, 2)
    assert dilated.gathered and dilated.row == 28 and dilated.columns(1) == 784, dilated
    assert dilated.columns(3) == 3 * 784
    assert not plan(320, 32).gathered
    assert not plan(64, 56).gathered and plan(64, 56).padded_flat
    assert not plan(16, 28, 2).gathered  # few channels: rows padded to panels


def test_gathered_packing_reads_through_column_and_k_offsets():
    """The gathered plan's B block is packed from the padded input at a column's offset
    (a table filled once per call) plus a k's, and the numbers stay ONNX Runtime's with the
    bias and ReLU as the write-back's epilogue."""
    model = conv_model(*CASES["gathered-stride2"])
    func = [f for f in fuse(import_onnx(model), AVX2).functions.values()
            if isinstance(f, tvm.tirx.PrimFunc) and "packed GEMM" in schedule_notes(
                tvm.IRModule({"f": f}))][0]
    script = func.script()
    assert "col_offsets" in script and "k_offsets" in script, script
    _check(model, AVX2)


def test_weight_is_packed_in_slivers_of_the_micro_kernel_rows():
    """Where the weight's rows, read in place, would share L1 sets (a row of 1,024 floats is
    4 KiB, the way size of a 32 KiB 8-way L1: the tile's 16 rows in one set), it is packed at
    compile time as ``[⌈N/MR⌉, K, MR]``, the tile's MR rows side by side for each k (zero
    rows past N), and read in place by the micro-kernel (no row-major copy); rows that spread
    over the sets (AVX2's 4, or 17·9 floats apart) stay ``W[N, K]``."""
    w = np.arange(15, dtype="float32").reshape(5, 3)
    packed = pack_rows(w, 2)
    assert packed.shape == (3, 3, 2)
    assert packed[1, 2, 1] == w[3, 2] and packed[2, 0, 0] == w[4, 0] and packed[2, 0, 1] == 0
    params = cpu_params(ZEN4)
    assert params.l1_rows_per_set(16, 4096) == 16 and params.l1_rows_per_set(16, 4 * 153) == 1
    assert cpu_params(AVX2).l1_rows_per_set(4, 4096) == 4  # half the ways: in place
    model = conv_model(1024, 40, 5, 1)  # 40 output channels: a partial sliver
    mod = fuse(import_onnx(model), ZEN4)
    func = next(f for f in mod.functions.values()
                if isinstance(f, tvm.tirx.PrimFunc) and "packed GEMM" in schedule_notes(
                    tvm.IRModule({"f": f})))
    notes = schedule_notes(tvm.IRModule({"f": func}))
    assert "A copied row-major" not in notes, notes
    plan = plan_conv_gemm([1, 1024, 5, 5], (1, 1), (1, 1), (0,) * 4, (1, 1), params, 40)
    mr, _ = params.gemm_tile(plan.nr)
    sliver = f"T.Buffer((T.int64({-(-40 // mr)}), T.int64(1024), T.int64({mr}))"
    assert sliver in func.script(), func.script()
    _check(model, ZEN4)
    small = fuse(import_onnx(conv_model(*CASES["3x3-stride2-odd"])), AVX2)
    assert "T.Buffer((T.int64(33), T.int64(153))" in small.script()


def test_stride2_phases_are_copied_deinterleaved():
    """A strided conv's column-phase padding is copied with the interior columns unrolled
    over the phases, no bounds test (LLVM loads them as one interleaved group instead of
    a masked gather per phase), and the edge columns apart; the values are the padding's."""
    for case, phases in (("3x3-stride2-odd", 2), ("7x7-stride2-3ch", 2)):
        model = conv_model(*CASES[case])
        mod = fuse(import_onnx(model), ZEN4)
        notes = schedule_notes(mod)
        assert f"{phases} column phases copied deinterleaved" in notes, notes
        _check(model, ZEN4)
        _check(model, AVX2)


def test_avx512_conv_panels_follow_the_fma_bound_model():
    """On a core that loads two values per 512-bit FMA for free (Zen 4), 12x32 and 16x16 are
    both FMA-bound, so a conv's panel width follows its padding and row tiles: 80-wide rows
    and 32 channels take 16 (80 = 5 panels; 2 tiles of 16 rows, where 12x32 pads to 96 and
    leaves 8 rows), 256-wide rows of 64 channels keep 32 (tie: the wider), as do 784 flat
    positions (2 % of padding saved); the dilated 3x3 at 28x28 gathers its 784 positions in
    panels of 16. AVX2 (the additive model) keeps its
    plans."""
    zen4 = cpu_params(ZEN4)
    assert zen4.loads_per_fma == 2.0 and cpu_params(AVX2).loads_per_fma == 0.0
    assert cpu_params(SKX).loads_per_fma == 1.0
    yolo = plan_conv_gemm([1, 16, 160, 160], (3, 3), (2, 2), (1,) * 4, (1, 1), zen4, 32)
    assert yolo.nr == 16 and not yolo.gathered
    unet = plan_conv_gemm([1, 64, 256, 256], (3, 3), (1, 1), (1,) * 4, (1, 1), zen4, 64)
    assert unet.nr == 32
    dil = plan_conv_gemm([1, 256, 28, 28], (3, 3), (1, 1), (2,) * 4, (2, 2), zen4, 256)
    assert dil.gathered and dil.nr == 16
    # a 2 % padding saved is not worth the narrower tile's loads (_NARROWER_GAIN)
    assert plan_conv_gemm([1, 512, 28, 28], (1, 1), (1, 1), (0,) * 4, (1, 1), zen4, 128).nr == 32
    assert plan_conv_gemm([1, 1024, 14, 14], (1, 1), (1, 1), (0,) * 4, (1, 1), zen4, 256).nr == 16
    haswell = plan_conv_gemm([1, 16, 160, 160], (3, 3), (2, 2), (1,) * 4, (1, 1),
                             cpu_params(AVX2), 32)
    assert haswell.nr == 16 and not haswell.gathered


def test_b_block_is_packed_k_by_k_across_its_panels():
    """The GEMM nest packs a conv's B block k outer, panels inner: for each k, the block's
    consecutive panels come from one stretch of the padded input (one stream), where panel by
    panel each read KC input rows at once (18 % of the U-Net's 3×3 conv at 256×256)."""
    from tvm_fusion.tir_utils import buffer_stores, find_all

    mod = fuse(import_onnx(conv_model(16, 24, 40, 3, 1, 1)), AVX2)
    func = next(f for f in mod.functions.values()
                if isinstance(f, tvm.tirx.PrimFunc) and "packed GEMM" in schedule_notes(
                    tvm.IRModule({"f": f})))
    packs = [loop for loop in find_all(func.body, tvm.tirx.For)
             if any(st.buffer.name == "b_block" for st in buffer_stores(loop.body))
             and not any(isinstance(inner, tvm.tirx.For) and inner.loop_var.name == "ir"
                         for inner in find_all(loop.body, tvm.tirx.For))]
    outer = [loop for loop in packs if not any(
        loop is not other and any(x.same_as(loop) for x in find_all(other.body, tvm.tirx.For))
        for other in packs)]
    assert outer and all(loop.loop_var.name == "kk" for loop in outer), func.script()
    assert all(loop.body.loop_var.name == "jr" for loop in outer
               if isinstance(loop.body, tvm.tirx.For)), func.script()


def conv1d_model(c_in, c_out, length, k, stride=1, pads=(0, 0), dilation=1, groups=1,
                 batch=1):
    """One ONNX Conv on a 3-D (N, C, W) input (+ bias, ReLU): ``relax.nn.conv1d``."""
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((c_out, c_in // groups, k)).astype("float32")
    bias = rng.standard_normal(c_out).astype("float32")
    node = helper.make_node("Conv", ["x", "W", "B"], ["y"], kernel_shape=[k], strides=[stride],
                            pads=list(pads), dilations=[dilation], group=groups)
    relu = helper.make_node("Relu", ["y"], ["z"])
    graph = helper.make_graph(
        [node, relu], "conv1d",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c_in, length])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


CONV1D_CASES = {
    # (c_in, c_out, length, k, stride, pads, dilation, groups, batch)
    "wav2vec2-first": (1, 16, 97, 10, 5),  # one input channel, kernel 10, stride 5
    "k3-stride2-odd": (16, 24, 199, 3, 2),  # stride 2: the input written as column phases
    "k3-pad-asym": (8, 12, 101, 3, 1, (1, 2)),  # stride 1: the padded input's positions
    "dilated-batch": (8, 12, 101, 3, 1, (2, 2), 2, 1, 2),
    "k2-stride2-positions-as-rows": (32, 64, 9, 2, 2),  # 4 positions < 64 channels
    "1x1-odd": (16, 24, 81, 1),  # the input itself, flat
    "k4-stride3-pad-batch": (6, 10, 50, 4, 3, (1, 0), 1, 1, 3),
}


@pytest.mark.parametrize("target", [TARGET, AVX2], ids=["llvm", "avx2"])
@pytest.mark.parametrize("name", list(CONV1D_CASES))
def test_conv1d_as_packed_gemm_matches_onnxruntime(name, target):
    """A 1-D conv (NCW) is the 2-D conv's GEMM on one row of height 1 (kernel 1 × kw), with
    an NCW store: the direct conv1d schedule ran wav2vec2's feature extractor 8x slower than
    ONNX Runtime."""
    model = conv1d_model(*CONV1D_CASES[name])
    notes = schedule_notes(fuse(import_onnx(model), target))
    assert "packed GEMM" in notes, notes
    _check(model, target)


def test_grouped_conv1d_keeps_the_direct_conv():
    grouped = conv1d_model(8, 8, 30, 5, 1, (2, 2), groups=4)
    assert "packed GEMM" not in schedule_notes(fuse(import_onnx(grouped), AVX2))
    _check(grouped, AVX2)


@pytest.mark.parametrize("case", [(96, 96, 49, 64, 1, (32, 32), 1, 2),  # wav2vec2's pos conv
                                  (64, 96, 37, 17, 2, (1, 2), 1, 2, 2)],
                         ids=["pos-conv-k64", "stride2-batch"])
def test_grouped_conv1d_with_wide_groups_runs_a_gemm_per_group(case):
    """Groups of at least two vectors of channels and two K blocks of reduction each run the
    packed GEMM on their channel range of the input (one GEMM per group, concatenated):
    wav2vec2's positional conv (16 groups of 48 channels, kernel 128) ran the direct conv at
    0.22x ONNX Runtime."""
    model = conv1d_model(*case)
    notes = schedule_notes(fuse(import_onnx(model), AVX2))
    assert notes.count("packed GEMM") == case[7], notes
    _check(model, AVX2)


def test_grouped_conv2d_with_wide_groups_runs_a_gemm_per_group():
    """7×7 over 32 channels a group (K = 1,568) runs a GEMM per group; 3×3 (K = 288, under
    two of AVX2's K blocks of 256: ResNeXt's groups) keeps the direct conv."""
    model = conv_model(64, 64, 15, 7, 2, 3, groups=2)
    assert schedule_notes(fuse(import_onnx(model), AVX2)).count("packed GEMM") == 2
    _check(model, AVX2)
    short = conv_model(64, 64, 7, 3, 1, 1, groups=2)
    assert "packed GEMM" not in schedule_notes(fuse(import_onnx(short), AVX2))


def conv3d_model(c_in, c_out, size, kernel, strides=(1, 1, 1), pads=(0, 0, 0),
                 dilation=(1, 1, 1), batch=1, residual=False, groups=1):
    """One ONNX Conv on an NCDHW input (+ bias, ReLU; with ``residual`` the input added
    before the ReLU, as r3d_18's blocks do): ``relax.nn.conv3d``."""
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((c_out, c_in // groups, *kernel)).astype("float32")
    bias = rng.standard_normal(c_out).astype("float32")
    node = helper.make_node("Conv", ["x", "W", "B"], ["y"], kernel_shape=list(kernel),
                            strides=list(strides), pads=list(pads) * (2 if len(pads) == 3 else 1),
                            dilations=list(dilation), group=groups)
    nodes = [node, helper.make_node("Add", ["y", "x"], ["s"]),
             helper.make_node("Relu", ["s"], ["z"])] if residual else [
        node, helper.make_node("Relu", ["y"], ["z"])]
    graph = helper.make_graph(
        nodes, "conv3d",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c_in, *size])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


CONV3D_CASES = {
    # (c_in, c_out, (D, H, W), kernel, strides, pads (one end, or all six), dilation, batch)
    "3x3x3-pad": (5, 7, (6, 9, 8), (3, 3, 3), (1, 1, 1), (1, 1, 1)),  # r3d's blocks
    "3x3x3-stride2-odd": (5, 7, (7, 9, 11), (3, 3, 3), (2, 2, 2), (1, 1, 1)),
    "3x7x7-stem": (3, 16, (4, 20, 20), (3, 7, 7), (1, 2, 2), (1, 3, 3)),
    "1x3x3-spatial": (6, 10, (5, 9, 9), (1, 3, 3), (1, 1, 1), (0, 1, 1)),  # R(2+1)D's
    "1x3x3-stride122": (6, 17, (5, 12, 12), (1, 3, 3), (1, 2, 2), (0, 1, 1)),
    "3x1x1-temporal": (6, 10, (5, 9, 9), (3, 1, 1), (1, 1, 1), (1, 0, 0)),
    "3x1x1-stride211": (9, 10, (7, 5, 6), (3, 1, 1), (2, 1, 1), (1, 0, 0)),
    "1x1x1-stride2": (6, 10, (5, 9, 9), (1, 1, 1), (2, 2, 2), (0, 0, 0)),  # downsample
    "3x3x3-no-pad": (6, 10, (5, 9, 9), (3, 3, 3)),  # the depth slices as their own stage
    "2x3x3-front-pad-dilated": (6, 10, (5, 9, 9), (2, 3, 3), (1, 1, 1), (1, 0, 0, 0, 0, 0),
                                (2, 1, 1)),
    "positions-as-rows": (16, 40, (3, 4, 4), (3, 3, 3), (1, 1, 1), (1, 1, 1)),
    "batch2-odd": (3, 5, (3, 7, 6), (3, 3, 3), (1, 2, 1), (1, 1, 0), (1, 1, 1), 2),
}


def _check_stock(model, target, batch=1, **options):
    """``model`` built by tvm_fusion against ONNX Runtime and stock TVM (its own grouping and
    legalised kernels: no packing, no schedules of ours)."""
    shape = [d.dim_value or batch for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(3).standard_normal(shape).astype("float32")
    got = run(compile_model(import_onnx(model), target, **options), [x])
    compare(got, onnx_reference(model, {"x": x}), rtol=1e-4, atol=1e-4)
    stock = run(compile_model(import_onnx(model), target, strategy="tvm", schedule=False,
                              pack_weights=False), [x])
    compare(got, stock, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(CONV3D_CASES))
def test_conv3d_as_packed_gemm_matches_onnxruntime_and_stock(name):
    """An NCDHW conv is the 2-D conv GEMM (``fold_conv3d``): a k×1×1 conv over the depth as
    rows of H·W, any other over one image per output depth with the depth taps as channels;
    the kernel is named conv3d and its store writes NCDHW."""
    model = conv3d_model(*CONV3D_CASES[name])
    mod = fuse(import_onnx(model), AVX2)
    notes = schedule_notes(mod)
    assert "packed GEMM" in notes, notes
    names = [g.name_hint for g, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert any("conv3d_gemm" in n for n in names), names  # not TOPI's conv3d
    _check_stock(model, AVX2)


@pytest.mark.parametrize("kernel, pads", [((3, 3, 3), (1, 1, 1)), ((1, 3, 3), (0, 1, 1)),
                                          ((3, 1, 1), (1, 0, 0))],
                         ids=["3x3x3", "1x3x3", "3x1x1"])
def test_fold_conv3d(kernel, pads):
    """The 2-D conv each 3-D conv is read as: a temporal k×1×1 conv keeps the batch and takes
    the depth as rows of H·W; every other takes one image per output depth, the kd depth
    taps as channels, and the 2-D kernel, stride and padding."""
    fold, shape, kernel2, strides2, padding2, _ = fold_conv3d(
        [2, 8, 5, 6, 7], kernel, (1, 1, 1), pads * 2, (1, 1, 1))
    if kernel == (3, 1, 1):
        assert fold.as_rows and shape == [2, 8, 5, 42] and kernel2 == (3, 1)
        assert padding2 == (1, 0, 1, 0)
    else:
        assert not fold.as_rows and fold.out_d == 5
        assert shape == [2 * 5, 8 * kernel[0], 6, 7] and kernel2 == kernel[1:]
        assert strides2 == (1, 1) and padding2 == (1, 1, 1, 1)


def test_conv3d_residual_block_folds_bias_add_and_relu_into_the_gemm():
    """r3d_18's block tail: conv3d + bias + the block's input + ReLU is one kernel whose GEMM
    stores through the whole epilogue (8-wide rows: every GEMM column is an output; with
    columns computed and never stored, 2-D or 3-D, the epilogue is a loop of its own in the
    same kernel)."""
    model = conv3d_model(7, 7, (6, 9, 8), (3, 3, 3), (1, 1, 1), (1, 1, 1), residual=True)
    mod = fuse(import_onnx(model), AVX2)
    notes = schedule_notes(mod)
    assert "packed GEMM" in notes and "epilogue" in notes, notes
    assert count_kernels(mod) == 1, count_kernels(mod)
    _check_stock(model, AVX2)


@pytest.mark.parametrize("name", ["3x3x3-pad", "1x3x3-stride122", "3x1x1-temporal",
                                  "positions-as-rows"])
def test_symbolic_batch_conv3d_as_packed_gemm(name):
    c_in, _, size, *_ = CONV3D_CASES[name]
    model = _symbolic(conv3d_model(*CONV3D_CASES[name]), 0)
    notes = schedule_notes(fuse(import_onnx(model), AVX2))
    assert "packed GEMM" in notes, notes
    if name != "positions-as-rows":
        assert "one GEMM per image" in notes, notes
    _check_sizes(model, AVX2, [(1, c_in, *size), (3, c_in, *size)])


def test_grouped_conv3d_keeps_the_direct_conv():
    model = conv3d_model(8, 8, (4, 6, 6), (3, 3, 3), (1, 1, 1), (1, 1, 1), groups=2)
    assert "packed GEMM" not in schedule_notes(fuse(import_onnx(model), AVX2))
    _check_stock(model, AVX2)


@pytest.mark.parametrize("target", [ZEN3, AARCH64], ids=["avx2", "aarch64"])
def test_conv3d_gemm_keeps_its_accumulators_in_registers(target):
    """Compile only, AArch64 included: the 3-D conv's GEMM is the 2-D conv's micro-kernel."""
    if "aarch64" in str(target) and "aarch64" not in str(
            tvm.target.codegen.llvm_get_targets()):
        pytest.skip("LLVM built without the AArch64 backend")
    loops = fma_loops(assembly(conv3d_model(16, 32, (4, 28, 28), (3, 3, 3), (1, 2, 2),
                                            (1, 1, 1)), target))
    assert loops and all(stack == 0 for _, _, stack in loops), loops

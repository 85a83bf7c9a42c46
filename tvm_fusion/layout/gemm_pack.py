"""Constant GEMM weights packed at compile time into the panels the CPU GEMM kernel streams.

``R.matmul(x, B)`` whose ``B`` is a 2-D constant (an ONNX MatMul with an initializer) or the
transpose of one (ONNX Gemm with ``transB=1``, PyTorch's ``x @ W.T``) becomes

    y = call_tir(matmul_packed, (x, Bp))    # y[..., i, j] = Σ_k x[..., i, k] ·
                                            #     Bp[j // NR, k, j % NR]

with ``Bp[⌈N/NR⌉, K, NR]`` zero-padded to whole panels of NR columns (the target's GEMM
register tile, :meth:`~tvm_fusion.tir_schedules.cpu_target.CpuParams.gemm_tile`; a narrower
panel, whole vectors, when N is smaller). Each k-step of a panel is NR contiguous floats and a
panel's K rows follow each other, which is the order the micro-kernel reads them
(``tir_schedules/gemm_template.py``). ``Bp`` is a new constant computed here from ``W``'s
data, so the module holds the packed weight only (what MLAS's ``MlasGemmPackB`` does at
session creation); packing in numpy, not as a TIR function folded by ``FoldConstant``, keeps
the pass at milliseconds (folding built one LLVM function per weight shape: seconds per model).

A weight-only quantized weight (``R.dequantize`` of an int8/uint8 constant per output channel,
or the frontend's block-wise form: :mod:`.weight_quant`) is packed as integers into the same
panels; ``matmul_packed`` widens them to float32 as it reads them (less the zero point, times a
block's scale), and a per-channel scale becomes an elementwise multiply after it, an epilogue.
Those are packed by a first run (``quantized_only``) before the rewriting's ``FoldConstant``.

``matmul_packed`` is an ordinary reduction for legalisation, TVM's op patterns and fusion: the
epilogues fuse into it as into a matmul; ``ScheduleFusedBlocks`` recognises its read of ``Bp``
and emits the packed GEMM nest (``tir_schedules/cpu_gemm.py``).

A dense NCHW convolution with a constant weight and static channels and map
(``relax.nn.conv2d``, groups 1, float32) is the same GEMM, as MLAS computes it (im2col +
SGEMM): the weight ``W[N, C·kh·kw]`` is the A operand (rows: output channels, contiguous in
k), and the im2col matrix of the input, packed per call straight into NR-column panels, is B
(columns: the output positions of every image)::

    Bp[p // NR, k, p % NR] = x_pad[b(p), c(k), oh(p)·sh + r(k)·dh, ow(p)·sw + s(k)·dw]
    C[co, p] = Σ_k W[co, k] · Bp[p // NR, k, p % NR]          # matmul_packed
    y[b, co, oh, ow] = C[co, b·OH·OW + oh·OW + ow]

so each output row is stored contiguously, partial sums included, and the micro-kernel runs at
GEMM speed whatever the kernel size, stride, dilation or channel count; the packing is one pass
over K × positions floats (the input itself for a 1×1 conv). A stride-1 conv may take the
positions of the zero-padded input instead (``ConvGemm.padded_flat``: a row costs its padded
width, and a panel reads consecutive floats across rows), and any conv with many output
channels the flat output positions themselves (``ConvGemm.gathered``: no padding column, each
packed value gathered through a table of column offsets). A symbolic batch takes one image's
plan: every stage gets a leading batch axis, ``C[b, co, p]`` is one GEMM per image over its
own panels (the schedule loops over the images around the per-image nest), and the weight is
the same constant; with the positions as rows the images are more rows. A symbolic channel
count, height or width keeps the direct conv (its schedule handles symbolic maps). A 1-D (NCW)
conv is the same GEMM on one row of height 1; a grouped conv whose groups are wide and long
enough for the micro-kernel (wav2vec2's positional conv) is one such GEMM per group, on its
channel range of the input (both with a static batch). A 3-D (NCDHW) conv is read as a 2-D
conv of this GEMM (:func:`fold_conv3d`): a temporal ``kd×1×1`` conv over ``D`` rows of ``H·W``,
any other over one image per output depth whose channels are the input's × the ``kd`` taps
in depth.

A grouped or depthwise conv too narrow or short for a GEMM per group keeps the direct conv,
except where its output row would fill at most half of a register and its channels fill
whole ones (7×7 maps on AVX-512): then a register of output channels is the vector axis
(:func:`grouped_conv2d_lanes`, :func:`depthwise_conv2d_lanes`), the weight laid out for it
here, the way ONNX Runtime's NCHWc kernels compute them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.ir.expr import GenericConst

from ..tir_schedules.cpu_target import CpuParams, cpu_params
from .weight_quant import QuantizedWeight, pack_columns, quantized_weight

PACKED_GEMM = "matmul_packed"
# 16-bit float operands summed in float32 (``out_dtype="float32"``, as
# relay_passes/accumulate.py sets it where the CPU has no fp16 arithmetic): the weight is
# widened to float32 when packed, the activation as it is read
_HALF = ("float16", "bfloat16")
_UNSET = ("", "void", "None")


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


def _sums_in_float32(x_dtype: str, w_dtype: str, out_dtype) -> bool:
    """The packed GEMM computes this call: float32 operands summed in float32, or 16-bit float
    operands of one type with ``out_dtype`` float32."""
    out_dtype = str(out_dtype)
    if x_dtype == w_dtype == "float32":
        return out_dtype in (*_UNSET, "float32")
    return x_dtype == w_dtype and x_dtype in _HALF and out_dtype == "float32"


def _widen(value: tirx.PrimExpr) -> tirx.PrimExpr:
    """``value`` as float32 (a 16-bit activation read by the float32 GEMM)."""
    if isinstance(value, te.tensor.TensorSlice):  # x[...] of a placeholder
        value = value.asobject()
    return value if str(value.ty.dtype) == "float32" else value.astype("float32")


def _i64(v) -> tirx.PrimExpr:
    return tirx.const(v, "int64")


def _zero_padded(x: te.Tensor, top: int, left: int, height: int, width: int):
    """``fcompute`` of ``x`` (NCHW) padded with zeros: ``top`` rows and ``left`` columns before
    its ``height`` × ``width`` map, zeros after it too."""

    def padded(b, ci, ih, iw):
        inside = [ih >= _i64(top), ih < _i64(height + top), iw >= _i64(left),
                  iw < _i64(width + left)]
        return tirx.if_then_else(tirx.all(*inside), x[b, ci, ih - _i64(top), iw - _i64(left)],
                                 tirx.const(0, x.dtype))

    return padded


def conv_out_extent(size, padding: int, kernel: int, stride: int, dilation: int):
    """Output positions of a conv along one axis (``padding``: both sides together)."""
    return (size + padding - dilation * (kernel - 1) - 1) // stride + 1


def conv_out_hw(hw, kernel: tuple[int, int], strides: tuple[int, int],
                padding: tuple[int, int, int, int], dilation: tuple[int, int]) -> tuple:
    """``(out_h, out_w)`` of a 2-D conv; ``padding`` is (top, left, bottom, right)."""
    top, left, bottom, right = padding
    return (conv_out_extent(hw[0], top + bottom, kernel[0], strides[0], dilation[0]),
            conv_out_extent(hw[1], left + right, kernel[1], strides[1], dilation[1]))


def panel_width(n: int, params: CpuParams) -> int:
    """NR of the panels for N columns: the ISA's tile, or fewer whole vectors when N is
    smaller (a 1- or 17-column B is not padded to 24)."""
    _, nr = params.gemm_tile()
    lanes = params.lanes
    return min(nr, -(-n // lanes) * lanes)


def packed_matmul(x: te.Tensor, bp: te.Tensor, n: int, zp: te.Tensor | None = None,
                  scale: te.Tensor | None = None, block: int = 0) -> te.Tensor:
    """``x[..., K] · B`` for ``B`` packed as ``bp[⌈n/NR⌉, K, NR]``. An integer ``bp`` (a
    weight-only quantized B) is widened to float32 as it is read, less its zero point (float32,
    ``zp[⌈n/NR⌉, NR]`` per column or ``[⌈n/NR⌉, ⌈K/block⌉, NR]`` per block) when there is one;
    a block-wise weight is then multiplied by its block's ``scale[⌈n/NR⌉, ⌈K/block⌉, NR]``
    (a per-column scale is applied after the sum, by the caller)."""
    nr = int(bp.shape[2])
    k = te.reduce_axis((0, x.shape[-1]), name="k")

    def value(*idx):
        j = idx[-1]
        panel = tirx.floordiv(j, tirx.const(nr, _dtype(j)))
        lane = tirx.floormod(j, tirx.const(nr, _dtype(j)))
        b = bp[panel, k, lane]
        if str(bp.dtype) != "float32":
            kb = tirx.floordiv(k.var, tirx.const(block or 1, _dtype(k.var)))
            b = b.astype("float32")
            if zp is not None:
                b = b - (zp[panel, lane] if len(zp.shape) == 2 else zp[panel, kb, lane])
            if scale is not None:
                b = b * scale[panel, kb, lane]
        return te.sum(_widen(x[(*idx[:-1], k)]) * b, axis=k)

    return te.compute((*x.shape[:-1], tirx.const(n, "int64")), value, name=PACKED_GEMM)


@dataclass(frozen=True)
class ConvGemm:
    """How a conv maps onto the GEMM: its sizes, the panel width ``nr`` and what the columns
    are: the flat output positions (``flat``: a 1×1 stride-1 conv without padding, the input
    itself, row after row), the flat positions of the zero-padded input (``padded_flat``: a
    stride-1 conv; ``row`` = the padded width, the columns past ``out_w`` computed and never
    stored), the flat output positions gathered through a table of column offsets
    (``gathered``; ``row`` = ``out_w``), or output rows padded to whole panels (``row``
    columns each)."""

    kernel: tuple[int, int]
    strides: tuple[int, int]
    padding: tuple[int, int, int, int]  # top, left, bottom, right
    dilation: tuple[int, int]
    out_h: int
    out_w: int
    nr: int
    flat: bool
    # the output positions are the GEMM's rows and the weight, packed at compile time, is B:
    # for maps with fewer positions than output channels (7×7 with 512 channels), whose
    # position panels would be few and narrow
    positions_as_rows: bool = False
    out_channels: int = 0
    padded_flat: bool = False
    in_h: int = 0  # the input's height and width (padded_flat's columns follow the input)
    in_w: int = 0
    # the columns are the flat output positions, no padding per row: packing gathers each
    # column's window through a table of column offsets (any stride, dilation, map width)
    gathered: bool = False
    # the weight (A) packed at compile time in slivers of this many rows, ``Ap[⌈N/MR⌉, K, MR]``
    # (0: ``W[N, K]`` as it is); out_channels then says N
    a_mr: int = 0

    @property
    def row(self) -> int:
        """Columns per output row: the padded input's width (padded_flat), the row padded to
        whole panels, or (flat) the row itself."""
        if self.padded_flat:
            return self.in_w + self.padding[1] + self.padding[3]
        return self.out_w if self.flat or self.gathered else -(-self.out_w // self.nr) * self.nr

    @property
    def image(self) -> int:
        """Columns from one image to the next."""
        if self.padded_flat:
            return (self.in_h + self.padding[0] + self.padding[2]) * self.row
        return self.out_h * self.row

    def columns(self, batch: int) -> int:
        """The GEMM's columns for ``batch`` images (the last image's rows past ``out_h``, in
        padded_flat, are not columns)."""
        return (batch - 1) * self.image + self.out_h * self.row


def plan_conv_gemm(shape: list[int], kernel: tuple[int, int], strides: tuple[int, int],
                   padding: tuple[int, int, int, int], dilation: tuple[int, int],
                   params: CpuParams, out_channels: int = 0) -> ConvGemm | None:
    """The GEMM form of an NCHW conv over an input of ``shape``, or None (an empty output).

    Panels of a padded row hold whole output rows, so that packing a panel reads one input row
    at consecutive (or strided) columns, with no division per element; the panel width trades
    the padding of the last panel of a row against the micro-kernel's efficiency (its FMAs per
    loaded value, from the target's tile for that width). A stride-1 conv may instead take the
    flat positions of the padded input (each panel then reads consecutive floats across rows,
    and a row costs its padded width, ``out_w + (kw-1)·dw``, instead of whole panels: 58
    columns for a 3×3 conv's 56-wide rows where panels of 16 take 64) when that makes fewer
    columns, rounded to its best panel width, at no more modelled cost. A map with fewer
    positions than output channels whose columns would be mostly padding takes the positions
    as the GEMM's rows (``positions_as_rows``)."""
    batch, _, height, width = shape
    kh, kw = kernel
    top, left, bottom, right = padding
    out_h, out_w = conv_out_hw((height, width), (kh, kw), strides, padding, dilation)
    if out_h <= 0 or out_w <= 0 or 0 in shape:
        return None
    plan = _plan_by_columns(shape, kernel, strides, padding, dilation, params, out_h, out_w,
                            out_channels)
    positions = batch * out_h * out_w
    # positions as rows where their columns would cost much more than the positions in the
    # ISA's widest panels (padding, a narrow tile): 7×7 maps (1.5x: 49 positions in 56
    # columns of 8 or 72 of 24; the 3×3 512→512 0.53x ONNX Runtime as columns, 0.88x as
    # rows), not 14×14 or 16×16 (1.1-1.2x: as columns 0.81 -> 0.86x, 0.89 -> 1.12x, the
    # U-Net's 3×3 1024→1024 0.79 -> 0.85x against rows)
    _, widest = params.gemm_tile()
    ideal = _work(params, widest, widest, out_channels) / widest * positions  # no padding
    if positions < out_channels and _work(params, plan.nr, plan.columns(batch),
                                          out_channels) >= _COSTLIER_COLUMNS * ideal:
        nr = panel_width(out_channels, params)
        if params.loads_per_fma:  # the width whose tile does these rows best
            widths = range(params.lanes, widest + 1, params.lanes)
            nr = _widest_unless(widths, lambda w: _work(params, w, out_channels, positions))
        return ConvGemm(kernel, strides, padding, dilation, out_h, out_w, nr, False, True,
                        out_channels)
    return plan


# Positions as rows when the column plan's modelled work is at least this many times the
# positions' in the widest panels
_COSTLIER_COLUMNS = 1.3
# Instructions per value packed through a per-column gather (ConvGemm.gathered): the column's
# offset moved to a scalar register, a load inserted into the vector, its share of the store;
# against the micro-kernel's out_channels / lanes FMAs per packed value
GATHER_COST = 3
# The gathered plan only where its modelled work is at most this share of the others': the
# dilated 3x3 256 at 28x28 (0.92: 0.77 -> 0.83x ONNX Runtime), not ConvNeXt's 2x2/2 96->192
# at 56x56 (0.94: 1.08 -> 1.02x, within the noise of one run)
_GATHER_GAIN = 0.93


def _work(params: CpuParams, nr: int, columns: int, rows: int = 0) -> float:
    """Work of ``columns`` in panels of ``nr``, per FMA of the tile: the micro-kernel's loads
    (MR broadcasts, NR/lanes vectors of B) beside its FMAs, the last panel's padding.

    Where the target's core loads values beside its FMAs for free
    (``CpuParams.loads_per_fma``, Zen 4's AVX-512), a k step costs the larger of its FMAs
    and its loads over that rate, and the GEMM's ``rows`` (output channels, or positions)
    count: full tiles of MR rows and the tail's tiles of 2^i rows, each at its own rate, per
    row computed. Elsewhere loads cost as FMAs and the rows are not counted (the model the
    AVX2 plans were measured with)."""
    mr, _ = params.gemm_tile(nr)
    vectors = nr // params.lanes
    padded = -(-columns // nr) * nr
    if not params.loads_per_fma or rows <= 0:
        fmas = mr * vectors
        return padded * (fmas + mr + vectors) / fmas
    tiles = [mr] * (rows // mr) + [1 << b for b in range((rows % mr).bit_length())
                                   if (rows % mr) >> b & 1]
    cycles = sum(max(t * vectors, (t + vectors) / params.loads_per_fma) for t in tiles)
    return padded * cycles / (rows * vectors)


# With loads_per_fma, a panel narrower than the ISA's tile only where its modelled work is at
# most this share of the widest's: AVX-512's 16x16 takes 17 loads per 16 FMAs, at the edge of
# Zen 4's two a cycle, and measured slower than 12x32 where it only saved a 2 % padding (a 1x1
# 512->128 conv at 28x28, 784 columns against 800: 1.43 against 1.15 ms), faster where it
# saved 7 % or more (ResNet-50's 1x1 1024->256 at 14x14, its stem, YOLOv8n's 3x3/2)
_NARROWER_GAIN = 0.95


def _widest_unless(widths, work) -> int:
    """The widest of ``widths`` unless a narrower one's ``work(w)`` is at most
    :data:`_NARROWER_GAIN` of its (then the least work, the wider on a tie)."""
    widest = max(widths)
    best = min(widths, key=lambda w: (work(w), -w))
    return best if work(best) <= _NARROWER_GAIN * work(widest) else widest


def _plan_by_columns(shape: list[int], kernel: tuple[int, int], strides: tuple[int, int],
                     padding: tuple[int, int, int, int], dilation: tuple[int, int],
                     params: CpuParams, out_h: int, out_w: int,
                     out_channels: int = 0) -> ConvGemm:
    """The plan with the output positions as the GEMM's columns (:func:`plan_conv_gemm`)."""
    batch, _, height, width = shape
    kh, kw = kernel
    flat = (kh, kw) == (1, 1) and strides == (1, 1) and not any(padding)
    if flat:
        nr = panel_width(shape[0] * out_h * out_w, params)
        if params.loads_per_fma:
            columns = shape[0] * out_h * out_w
            nr = _widest_unless(range(params.lanes, nr + 1, params.lanes),
                                lambda w: _work(params, w, columns, out_channels))
        return ConvGemm(kernel, strides, padding, dilation, out_h, out_w, nr, flat)
    _, widest = params.gemm_tile()

    def cost(nr: int, columns: int) -> float:
        """Work of ``columns`` (per image) in panels of ``nr``, per FMA of the tile."""
        return _work(params, nr, columns, out_channels)

    widths = range(params.lanes, widest + 1, params.lanes)
    nr = min(widths, key=lambda w: (cost(w, out_w) * out_h, -w))
    if params.loads_per_fma:
        nr = _widest_unless(widths, lambda w: cost(w, out_w))
    rows = ConvGemm(kernel, strides, padding, dilation, out_h, out_w, nr, flat)
    best, best_cost = rows, cost(nr, out_w) * out_h * batch
    if strides == (1, 1):
        flat_pad = ConvGemm(kernel, strides, padding, dilation, out_h, out_w, nr, flat,
                            padded_flat=True, in_h=height, in_w=width)
        columns = flat_pad.columns(batch)
        nr_flat = min(widths, key=lambda w: (cost(w, columns), -w))
        if params.loads_per_fma:
            nr_flat = _widest_unless(widths, lambda w: cost(w, columns))
        # fewer columns, not only a wider modelled tile: with as many or more columns (a
        # dilated 3x3 at 28x28: 896 both ways; 31-wide rows: 1,023 against 992) panels of 24
        # measured slower than the rows' 16 (0.79 -> 0.72x, 1.32 -> 1.11x ONNX Runtime)
        if (-(-columns // nr_flat) * nr_flat < batch * out_h * rows.row
                and cost(nr_flat, columns) < best_cost):
            best = replace(flat_pad, nr=nr_flat)
            best_cost = cost(nr_flat, columns)
    # the flat output positions, gathered: no column is computed for nothing, but packing
    # a value costs a gather (GATHER_COST instructions) where the other plans copy vectors.
    # In the rows' panel width: panels of 24 measured slower than 16 here too (the dilated
    # 3x3 at 28x28 0.83 against 0.87x ONNX Runtime, the U-Net's 3x3 320 at 32x32 0.76
    # against 0.82x)
    positions = batch * out_h * out_w
    per_value = GATHER_COST
    if params.loads_per_fma:
        # a hardware gather (AVX-512's vgatherdps) issues its lanes as loads at the core's
        # load rate, 1 / loads_per_fma FMA-times per value; its panel width is the model's
        # for the positions (784 = 49 panels of 16, where 32 pads it to 800)
        per_value = 1 / params.loads_per_fma
        nr = min(widths, key=lambda w: (cost(w, positions), -w))
    padded = -(-positions // nr) * nr
    gathered = cost(nr, positions) + per_value * params.lanes / max(out_channels, 1) * padded
    if gathered < _GATHER_GAIN * best_cost:
        return ConvGemm(kernel, strides, padding, dilation, out_h, out_w, nr, flat,
                        gathered=True)
    return best


def channels_in_lanes(shape: list[int], kernel: tuple[int, int], strides: tuple[int, int],
                      padding: tuple[int, int, int, int], dilation: tuple[int, int],
                      per_group: int, params: CpuParams) -> bool:
    """Whether a grouped NCHW conv (a static batch, too narrow or short a group for a GEMM
    per group) should vectorise its output channels instead of its output row
    (:func:`grouped_conv2d_lanes`): its channels per group fill whole registers, its output
    row fills at most half of the registers the direct conv's tile would load it in, and an
    output row or column gives a register tile (``rows`` × the channel vectors within the
    tile budget). ResNeXt-50's last grouped 3×3 (32 channels a group, 7×7 map) on AVX-512:
    7 of 16 lanes as rows, 2 whole registers × 7 positions as channels. AVX2's 7 of 8 lanes
    keep the row (its 12 accumulator registers hold 3 tiles of 2 vectors: no divisor of 7)."""
    from ..tir_schedules.loops import lane_use, largest_divisor, pick_vector_tile

    lanes = params.lanes
    if per_group % lanes or any(not isinstance(d, int) for d in shape):
        return False
    kh, kw = kernel
    out_h, out_w = conv_out_hw(shape[2:], kernel, strides, padding, dilation)
    if out_h <= 0 or out_w <= 0:
        return False
    if lane_use(pick_vector_tile(out_w, lanes), lanes) > 0.5:
        return False
    vectors = (pick_vector_tile(per_group, lanes) or lanes) // lanes
    rows = max(largest_divisor(out_h, params.registers // vectors),
               largest_divisor(out_w, params.registers // vectors))
    return rows > 1


def grouped_conv2d_lanes(x: te.Tensor, w: te.Tensor, strides: tuple[int, int],
                         padding: tuple[int, int, int, int], dilation: tuple[int, int]):
    """A grouped NCHW conv with the output channels of a group as the vector axis: the weight
    (packed at compile time) is ``w[group, c, kh, kw, channel in group]``, each input value is
    one broadcast reused across a vector of channels, and the tile's register axis is an
    output row or column (``cpu_tile.plan_tile`` finds both). The sums are stored to NCHW by a
    permuting stage, which the tile folds into its write-back::

        acc[b, g, oh, ow, o] = Σ x_pad[b, g·C + c, oh·sh + r·dh, ow·sw + s·dw] · w[g, c, r, s, o]
        y[b, g·N + o, oh, ow] = acc[b, g, oh, ow, o]
    """
    batch, _, height, width = (int(d) for d in x.shape)
    groups, channels, kh, kw, per_group = (int(d) for d in w.shape)
    top, left, bottom, right = padding
    out_h, out_w = conv_out_hw((height, width), (kh, kw), strides, padding, dilation)
    padded = x
    if any(padding):
        padded = te.compute((batch, groups * channels, height + top + bottom,
                             width + left + right),
                            _zero_padded(x, top, left, height, width), name="pad_temp")
    c = te.reduce_axis((0, channels), name="rc")
    r = te.reduce_axis((0, kh), name="ry")
    s = te.reduce_axis((0, kw), name="rx")
    acc = te.compute(
        (batch, groups, out_h, out_w, per_group),
        lambda b, g, oh, ow, o: te.sum(
            _widen(padded[b, g * channels + c, oh * strides[0] + r * dilation[0],
                          ow * strides[1] + s * dilation[1]]) * w[g, c, r, s, o],
            axis=[c, r, s]), name="group_conv2d_lanes")
    return te.compute((batch, groups * per_group, out_h, out_w),
                      lambda b, co, oh, ow: acc[b, co // per_group, oh, ow, co % per_group],
                      name="group_conv2d_nchw")


def depthwise_in_lanes(shape: list[int], kernel: tuple[int, int], strides: tuple[int, int],
                       padding: tuple[int, int, int, int], dilation: tuple[int, int],
                       params: CpuParams) -> bool:
    """Whether a depthwise NCHW conv (a static shape) should vectorise its channels
    (:func:`depthwise_conv2d_lanes`): they fill whole registers and its output row fills at
    most half of the register the direct conv's window rows would load it in (ConvNeXt's
    7×7 depthwise conv at 7×7: 7 of AVX-512's 16 lanes, each row loaded as 4 + 2 + 1 pieces;
    AVX2's 7 of 8 keep the row)."""
    from ..tir_schedules.loops import lane_use, pick_vector_tile

    lanes = params.lanes
    if shape[1] % lanes or any(not isinstance(d, int) for d in shape):
        return False
    out_w = conv_out_hw(shape[2:], kernel, strides, padding, dilation)[1]
    return out_w > 1 and lane_use(pick_vector_tile(out_w, lanes), lanes) <= 0.5


def depthwise_conv2d_lanes(x: te.Tensor, w: te.Tensor, strides: tuple[int, int],
                           padding: tuple[int, int, int, int], dilation: tuple[int, int]):
    """A depthwise NCHW conv with a register of channels as the vector axis, as ONNX Runtime's
    NCHWc kernels compute it: the input copied once, zero-padded, into blocks of ``lanes``
    channels (``x_lanes[b, block, h, w, lane]``), the weight packed at compile time as
    ``w[block, kh, kw, lane]``, every load a whole register. The window rows of the tile are
    consecutive output columns (their windows overlap: unrolled, they share the loads); the
    sums are stored to NCHW by a permuting stage folded into the write-back::

        acc[b, k, oh, ow, l] = Σ x_lanes[b, k, oh·sh + r·dh, ow·sw + s·dw, l] · w[k, r, s, l]
        y[b, k·L + l, oh, ow] = acc[b, k, oh, ow, l]
    """
    batch, channels, height, width = (int(d) for d in x.shape)
    blocks, kh, kw, lanes = (int(d) for d in w.shape)
    top, left, bottom, right = padding
    out_h, out_w = conv_out_hw((height, width), (kh, kw), strides, padding, dilation)
    pad = _zero_padded(x, top, left, height, width)
    x_lanes = te.compute((batch, blocks, height + top + bottom, width + left + right, lanes),
                         lambda b, k, h, col, lane: pad(b, k * lanes + lane, h, col),
                         name="pad_lanes")
    r = te.reduce_axis((0, kh), name="ry")
    s = te.reduce_axis((0, kw), name="rx")
    acc = te.compute(
        (batch, blocks, out_h, out_w, lanes),
        lambda b, k, oh, ow, lane: te.sum(
            _widen(x_lanes[b, k, oh * strides[0] + r * dilation[0],
                           ow * strides[1] + s * dilation[1], lane]) * w[k, r, s, lane],
            axis=[r, s]), name="depthwise_conv2d_lanes")
    return te.compute((batch, channels, out_h, out_w),
                      lambda b, c, oh, ow: acc[b, c // lanes, oh, ow, c % lanes],
                      name="depthwise_conv2d_nchw")


class _RowOfNcw:
    """An NCW tensor read as NCHW with one row (H = 1): a 1-D conv is the 2-D conv's GEMM on
    a single output row, its kernel ``1 × kw`` (the height index, always 0, is dropped)."""

    def __init__(self, x: te.Tensor):
        self.tensor = x
        self.dtype = x.dtype
        self.shape = (x.shape[0], x.shape[1], tirx.const(1, "int64"), x.shape[2])

    def __getitem__(self, index):
        b, ci, _, iw = index
        return self.tensor[b, ci, iw]

    @staticmethod
    def store(gemm_value, batch, out_channels: int, plan: ConvGemm) -> te.Tensor:
        """The NCW output, ``gemm_value(b, co, 0, ow)``."""
        return te.compute((batch, _i64(out_channels), _i64(plan.out_w)),
                          lambda b, co, ow: gemm_value(b, co, _i64(0), ow),
                          name="conv1d_ncw_store")


@dataclass(frozen=True)
class DepthFold:
    """How an NCDHW conv reads as the NCHW conv of the GEMM (:func:`fold_conv3d`).

    ``as_rows``: a ``kd × 1 × 1`` conv with stride and padding in depth only (R(2+1)D's
    temporal convs) is the 2-D conv of a ``kd × 1`` kernel over ``D`` rows of ``H·W``
    (the input and output as they are, reshaped in place). Otherwise each output depth ``od``
    is an image of its own, whose channels are the input's channels × the ``kd`` taps in
    depth: image ``b·OD + od``, channel ``c·kd + q`` is the input's depth slice
    ``od·sd + q·dd − front`` (zeros in the depth padding), and the conv is the 2-D conv of the
    ``kh × kw`` kernel over those images, the weight flattened as it is (``c, q, r, s``)."""

    kernel: int
    stride: int
    dilation: int
    front: int
    out_d: int
    as_rows: bool

    def view(self, x):
        return _DepthAsRows(x) if self.as_rows else _DepthSlices(x, self)


def fold_conv3d(shape: list[int], kernel: tuple[int, int, int], strides: tuple[int, int, int],
                padding: tuple[int, ...], dilation: tuple[int, int, int]):
    """An NCDHW conv over an input of ``shape`` as the NCHW conv that ``conv2d_gemm`` runs:
    (its :class:`DepthFold`, then the 2-D input shape, kernel, strides, padding (top, left,
    bottom, right) and dilation), or None for an empty output. ``padding``: front, top, left,
    back, bottom, right."""
    batch, channels, depth, height, width = shape
    (kd, kh, kw), (sd, sh, sw), (dd, dh, dw) = kernel, strides, dilation
    front, top, left, back, bottom, right = padding
    out_d = conv_out_extent(depth, front + back, kd, sd, dd)
    if out_d <= 0:
        return None
    if (kh, kw, sh, sw) == (1, 1, 1, 1) and not any((top, left, bottom, right)):
        fold = DepthFold(kd, sd, dd, front, out_d, True)
        return (fold, [batch, channels, depth, height * width], (kd, 1), (sd, 1),
                (front, 0, back, 0), (dd, 1))
    fold = DepthFold(kd, sd, dd, front, out_d, False)
    return (fold, [batch * out_d, channels * kd, height, width], (kh, kw), (sh, sw),
            (top, left, bottom, right), (dh, dw))


class _DepthAsRows:
    """An NCDHW tensor read as NCHW: the depth as the height, each ``H × W`` map one row."""

    gathers = False  # a reshape: the GEMM's packing reads it as it reads the input

    def __init__(self, x: te.Tensor):
        self.tensor = x
        self.dtype = x.dtype
        self.width = x.shape[4]
        self.shape = (x.shape[0], x.shape[1], x.shape[2], _i64(int(x.shape[3]) * int(
            x.shape[4])))

    def __getitem__(self, index):
        b, ci, d, hw = index
        return self.tensor[b, ci, d, tirx.floordiv(hw, self.width),
                           tirx.floormod(hw, self.width)]

    def store(self, gemm_value, batch, out_channels: int, plan: ConvGemm) -> te.Tensor:
        """The NCDHW output, ``y[b, co, od, oh, ow] = gemm_value(b, co, od, oh·W + ow)``."""
        height, width = int(self.tensor.shape[3]), int(self.width)
        return te.compute(
            (batch, _i64(out_channels), _i64(plan.out_h), _i64(height), _i64(width)),
            lambda b, co, od, oh, ow: gemm_value(b, co, od, oh * _i64(width) + ow),
            name="conv3d_ncdhw_store")


class _DepthSlices:
    """An NCDHW tensor read as NCHW images, one per output depth, with the ``kd`` depth taps
    as channels (:class:`DepthFold`)."""

    def __init__(self, x: te.Tensor, fold: DepthFold):
        self.tensor, self.fold = x, fold
        self.dtype = x.dtype
        batch, channels, self.depth, height, width = x.shape
        images = (_i64(int(batch) * fold.out_d) if isinstance(batch, tirx.IntImm)
                  else batch * _i64(fold.out_d))
        self.shape = (images, _i64(int(channels) * fold.kernel), height, width)
        # reads outside the input (the depth padding) or more than one slice a channel: a
        # gather the GEMM's packing should not do per value
        self.gathers = fold.kernel > 1 or fold.front > 0 or (
            (fold.out_d - 1) * fold.stride + (fold.kernel - 1) * fold.dilation
            >= int(self.depth))

    def __getitem__(self, index):
        image, ci, ih, iw = index
        fold = self.fold
        b, od = tirx.floordiv(image, _i64(fold.out_d)), tirx.floormod(image, _i64(fold.out_d))
        c, q = ci, _i64(0)
        if fold.kernel > 1:
            c, q = tirx.floordiv(ci, _i64(fold.kernel)), tirx.floormod(ci, _i64(fold.kernel))
        d = od * _i64(fold.stride) + q * _i64(fold.dilation) - _i64(fold.front)
        load = self.tensor[b, c, d, ih, iw]
        if not self.gathers:
            return load
        inside = tirx.all(d >= _i64(0), d < self.depth)
        return tirx.if_then_else(inside, load, tirx.const(0, self.dtype))

    def store(self, gemm_value, batch, out_channels: int, plan: ConvGemm) -> te.Tensor:
        """The NCDHW output, ``y[b, co, od, oh, ow] = gemm_value(b·OD + od, co, oh, ow)``."""
        out_d = _i64(self.fold.out_d)
        return te.compute(
            (self.tensor.shape[0], _i64(out_channels), out_d, _i64(plan.out_h),
             _i64(plan.out_w)),
            lambda b, co, od, oh, ow: gemm_value(b * out_d + od, co, oh, ow),
            name="conv3d_ncdhw_store")

    def materialised(self) -> te.Tensor:
        """The images as a tensor of their own (the depth's im2col), for a 2-D plan that
        would read its input per value packed (no 2-D padding stage to gather into)."""
        return te.compute(self.shape, lambda *index: self[index], name="conv3d_slices")


class _ChannelRange:
    """Channels ``[start, start + count)`` of an NCHW / NCW tensor: one group's input of a
    grouped conv, read in place."""

    def __init__(self, x: te.Tensor, start: int, count: int):
        self.tensor = x
        self.start = start
        self.dtype = x.dtype
        self.shape = (x.shape[0], tirx.const(count, "int64"), *x.shape[2:])

    def __getitem__(self, index):
        b, ci, *rest = index
        return self.tensor[(b, ci + tirx.const(self.start, "int64"), *rest)]


def _store(gemm_value, batch: tirx.PrimExpr, out_channels: int, plan: ConvGemm,
           view=None) -> te.Tensor:
    """The conv's NCHW output, ``gemm_value(b, co, oh, ow)``, or the one of the tensor that
    ``view`` reads as NCHW (NCW, NCDHW: its ``store``); ``batch`` may be symbolic."""
    if view is not None:
        return view.store(gemm_value, batch, out_channels, plan)
    return te.compute((batch, _i64(out_channels), _i64(plan.out_h), _i64(plan.out_w)),
                      gemm_value, name="conv2d_nchw_store")


def conv2d_gemm(x: te.Tensor, w: te.Tensor, plan: ConvGemm,
                channels: tuple[int, int] | None = None,
                depth: DepthFold | None = None) -> te.Tensor:
    """NCHW ``conv2d(x, W)`` as the packed GEMM (module docstring): ``w`` is ``W[N, C·kh·kw]``
    (the A operand). ``x``'s channels and map must be static; a symbolic batch runs ``plan``
    (one image's) once per image: every stage gets a leading batch axis, the GEMM is
    ``C[b, co, p]`` over one image's columns, and its schedule loops over the images
    around the per-image nest (``tir_schedules/cpu_gemm.py``). A 3-D (NCW) ``x`` is a 1-D
    conv, planned as one row of height 1 (kernel ``1 × kw``), with an NCW output; a 5-D
    (NCDHW) ``x`` is a 3-D conv read as the 2-D conv that ``depth`` describes
    (:func:`fold_conv3d`), with an NCDHW output. ``channels`` (start, count): the conv of those
    input channels only (one group of a grouped conv)."""
    view = None
    if channels is not None:
        x = _ChannelRange(x, *channels)
    if len(x.shape) == 3:
        x = view = _RowOfNcw(x)
    elif depth is not None:
        x = view = depth.view(x)
        if view.gathers and not any(plan.padding):
            x = view.materialised()  # no padding stage of the 2-D plan reads the view
    if plan.positions_as_rows:  # the batch is a row dimension of this form
        return _conv2d_gemm_by_positions(x, w, plan, view)
    batch = x.shape[0]
    per_image = not isinstance(batch, tirx.IntImm)
    images = 1 if per_image else int(batch)
    channels, height, width = (int(d) for d in x.shape[1:])
    out_channels = int(w.shape[0])
    (kh, kw), (sh, sw), (dh, dw) = plan.kernel, plan.strides, plan.dilation
    top, left, bottom, right = plan.padding
    nr, row, out_h, out_w = plan.nr, plan.row, plan.out_h, plan.out_w
    columns = plan.columns(images)
    k_total = channels * kh * kw
    a_mr = plan.a_mr
    if a_mr:
        out_channels = plan.out_channels

    def weight(co, k):
        if not a_mr:
            return w[co, k]
        return w[tirx.floordiv(co, _i64(a_mr)), k, tirx.floormod(co, _i64(a_mr))]

    def stage(shape, value, name):
        """``value(img, *index)`` over ``shape``, with a leading batch axis (``img`` its
        index) when the batch is symbolic, else once (``img`` None)."""
        if per_image:
            return te.compute((batch, *shape), value, name=name)
        return te.compute(shape, lambda *index: value(None, *index), name=name)

    def lead(img) -> tuple:
        return () if img is None else (img,)

    def image(img, b):
        """The image a column reads: ``b``, from its index, or (per image, where that is 0
        or masked) ``img``."""
        return b if img is None else img

    def window(k):
        return (tirx.floordiv(k, _i64(kh * kw)),
                tirx.floormod(tirx.floordiv(k, _i64(kw)), _i64(kh)), tirx.floormod(k, _i64(kw)))

    if plan.padded_flat:
        # the padded input channel-major, [C, B·Hp·Wp + reach] as rows of Wp: column t reads
        # src[c, t + r·dh·Wp + s·dw], consecutive floats across rows and images; written
        # row by row (a division per row, not per element)
        image_size = plan.image
        length = -(-columns // nr) * nr + (kh - 1) * dh * row + (kw - 1) * dw
        padded_h = image_size // row

        def padded_rows(img, ci, h, w):
            b, ih = tirx.floordiv(h, _i64(padded_h)), tirx.floormod(h, _i64(padded_h)) - _i64(top)
            iw = w - _i64(left)
            inside = [b < _i64(images), ih >= _i64(0), ih < _i64(height), iw >= _i64(0),
                      iw < _i64(width)]
            return tirx.if_then_else(tirx.all(*inside), x[image(img, b), ci, ih, iw],
                                     tirx.const(0, x.dtype))
        src = stage((_i64(channels), _i64(-(-length // row)), _i64(row)), padded_rows, "conv2d_pad")

        def pack(img, pj, k, lane):
            ci, r, s = window(k)
            t = pj * _i64(nr) + lane + r * _i64(dh * row) + s * _i64(dw)
            return src[(*lead(img), ci, tirx.floordiv(t, _i64(row)), tirx.floormod(t, _i64(row)))]
    elif plan.flat:
        positions = out_h * out_w

        def pack(img, pj, k, lane):
            j = pj * _i64(nr) + lane
            b, pos = tirx.floordiv(j, _i64(positions)), tirx.floormod(j, _i64(positions))
            load = x[image(img, b), k, tirx.floordiv(pos, _i64(width)),
                     tirx.floormod(pos, _i64(width))]
            if columns % nr == 0:
                return load
            return tirx.if_then_else(j < _i64(columns), load, tirx.const(0, x.dtype))
    else:
        # zero padding, widened on the right so that every column of a padded row reads
        # inside it (those columns are computed and never stored)
        pad_w = max(width + left + right, (row - 1) * sw + dw * (kw - 1) + 1)
        # a stride sw > 1: the padded input is written as sw column phases, column iw at
        # (iw % sw, iw // sw), so that a panel reads consecutive columns of one phase
        # instead of gathering every sw-th element
        phase_w = -(-pad_w // sw)
        batch_dim = batch if per_image else _i64(images)

        padded = _zero_padded(x, top, left, height, width)

        src = x
        if sw > 1:
            src = te.compute(
                (batch_dim, _i64(channels), _i64(height + top + bottom), _i64(sw), _i64(phase_w)),
                lambda b, ci, ih, ph, q: padded(b, ci, ih, q * _i64(sw) + ph), name="conv2d_pad")
        elif any(plan.padding) or pad_w > width:
            src = te.compute((batch_dim, _i64(channels), _i64(height + top + bottom), _i64(pad_w)),
                             padded, name="conv2d_pad")
        blocks = row // nr

        def pack(img, pj, k, lane):
            image_row, block = tirx.floordiv(pj, _i64(blocks)), tirx.floormod(pj, _i64(blocks))
            b, oh = tirx.floordiv(image_row, _i64(out_h)), tirx.floormod(image_row, _i64(out_h))
            return window_at(image(img, b), oh, block * _i64(nr) + lane, k)

        def window_at(b, oh, ow, k):
            """The input under tap ``k`` of output position (b, oh, ow)."""
            ci, r, s = window(k)
            ih = oh * _i64(sh) + r * _i64(dh)
            if sw > 1:  # column ow·sw + s·dw: phase s·dw % sw
                offset = s * _i64(dw)
                return src[b, ci, ih, tirx.floormod(offset, _i64(sw)),
                           ow + tirx.floordiv(offset, _i64(sw))]
            return src[b, ci, ih, ow + s * _i64(dw)]

        if plan.gathered:
            positions = out_h * out_w

            def pack(img, pj, k, lane):  # noqa: F811 (the gathered plan's columns)
                # the padding lanes of the last panel read the last position again
                j = tirx.min(pj * _i64(nr) + lane, _i64(columns - 1))
                b, pos = tirx.floordiv(j, _i64(positions)), tirx.floormod(j, _i64(positions))
                return window_at(image(img, b), tirx.floordiv(pos, _i64(out_w)),
                                 tirx.floormod(pos, _i64(out_w)), k)

    panels = stage((_i64(-(-columns // nr)), _i64(k_total), _i64(nr)),
                   lambda *index: _widen(pack(*index)), "conv2d_im2col")
    k = te.reduce_axis((0, _i64(k_total)), name="k")
    gemm = stage(
        (_i64(out_channels), _i64(columns)),
        lambda img, co, j: te.sum(weight(co, k) * panels[(*lead(img), tirx.floordiv(j, _i64(nr)), k,
                                                     tirx.floormod(j, _i64(nr)))], axis=k),
        PACKED_GEMM)
    if per_image:
        return _store(lambda b, co, oh, ow: gemm[b, co, oh * _i64(row) + ow], batch,
                      out_channels, plan, view)
    return _store(lambda b, co, oh, ow: gemm[co, b * _i64(plan.image) + oh * _i64(row) + ow],
                  _i64(images), out_channels, plan, view)


def _conv2d_gemm_by_positions(x: te.Tensor, bp: te.Tensor, plan: ConvGemm,
                              view=None) -> te.Tensor:
    """The conv with the output positions as rows: ``C[b, oh, ow, co] = Σ_k A · Bp`` where A
    reads the input through the window (copied once, row-major, by the GEMM nest) and ``bp``
    is ``W[N, K]`` packed as a transposed weight; the NCHW store is folded into the write-back."""
    batch = x.shape[0]  # may be symbolic: the images are more rows
    height, width = (int(d) for d in x.shape[2:])
    (kh, kw), (sh, sw), (dh, dw) = plan.kernel, plan.strides, plan.dilation
    top, left, _, _ = plan.padding
    nr = int(bp.shape[2])
    n = int(plan.out_channels)
    k_total = int(bp.shape[1])

    k = te.reduce_axis((0, _i64(k_total)), name="k")
    src = x
    if any(plan.padding):
        # the zero-padded input (small: these maps have fewer positions than channels), so
        # that the window reads it without bounds tests: the GEMM nest's copy of A is then
        # a gather whose offsets split into a row's and a k's
        bottom, right = plan.padding[2], plan.padding[3]

        padded = _zero_padded(x, top, left, height, width)
        src = te.compute((batch, x.shape[1], _i64(height + top + bottom),
                          _i64(width + left + right)), padded, name="conv2d_pad")

    def value(b, oh, ow, j):
        ci = tirx.floordiv(k, _i64(kh * kw))
        r = tirx.floormod(tirx.floordiv(k, _i64(kw)), _i64(kh))
        s = tirx.floormod(k, _i64(kw))
        load = _widen(src[b, ci, oh * _i64(sh) + r * _i64(dh), ow * _i64(sw) + s * _i64(dw)])
        return te.sum(load * bp[tirx.floordiv(j, _i64(nr)), k, tirx.floormod(j, _i64(nr))], axis=k)

    gemm = te.compute((batch, _i64(plan.out_h), _i64(plan.out_w), _i64(n)), value, name=PACKED_GEMM)
    return _store(lambda b, j, oh, ow: gemm[b, oh, ow, j], batch, n, plan, view)


@dataclass(frozen=True)
class TransposedConv:
    """A 2-D transposed conv (ONNX ConvTranspose, ``relax.nn.conv2d_transpose``) as a GEMM
    and a col2im: ``cols[b, (co, r, s), ih, iw] = Σ_ci W[ci, co, r, s] · x[b, ci, ih, iw]``
    is a 1×1 conv with ``C_out·kh·kw`` output channels (the packed GEMM over the input's flat
    positions), and each output adds the taps that land on it::

        y[b, co, oh, ow] = Σ cols[b, (co, r, s), ih, iw]
                           over oh + top = ih·sh + r·dh, ow + left = iw·sw + s·dw

    which is what MLAS's ConvTranspose does (SGEMM + col2im), against the zero-dilated input
    and a direct conv of TOPI's (``sh·sw`` times the arithmetic, most of it on zeros)."""

    kernel: tuple[int, int]
    strides: tuple[int, int]
    padding: tuple[int, int]  # top, left (bottom, right and output_padding: out_h, out_w)
    dilation: tuple[int, int]
    in_h: int
    in_w: int
    out_h: int
    out_w: int

    @property
    def one_tap(self) -> bool:
        """Every output reads exactly one tap (a 2×2/2 upsampling: kernel = stride, no
        dilation, no output_padding past the input): the col2im is a permutation of the
        GEMM's columns, which folds into its write-back."""
        return all(k == s and (d == 1 or k == 1) and out + pad <= size * s
                   for k, s, d, pad, size, out in zip(
                       self.kernel, self.strides, self.dilation, self.padding,
                       (self.in_h, self.in_w), (self.out_h, self.out_w)))


def _taps(o, pad: int, kernel: int, stride: int, dilation: int, size: int) -> list:
    """The (tap, input index, condition) that reach output index ``o`` along one axis:
    ``o + pad = i·stride + r·dilation``. Without dilation those are ``r = (o + pad) % stride
    + j·stride`` for ``j < ⌈kernel/stride⌉`` (one test each), else every tap is tested."""
    t = o + _i64(pad)
    if dilation == 1:
        out = []
        for j in range(-(-kernel // stride)):
            r = tirx.floormod(t, _i64(stride)) + _i64(j * stride)
            i = tirx.floordiv(t, _i64(stride)) - _i64(j)
            out.append((r, i, [r < _i64(kernel), i >= _i64(0), i < _i64(size)]))
        return out
    out = []
    for r in range(kernel):
        shifted = t - _i64(r * dilation)
        i = tirx.floordiv(shifted, _i64(stride))
        out.append((_i64(r), i, [tirx.floormod(shifted, _i64(stride)) == _i64(0), i >= _i64(0),
                              i < _i64(size)]))
    return out


def conv2d_transpose_gemm(x: te.Tensor, w: te.Tensor, plan: ConvGemm,
                          conv: TransposedConv) -> te.Tensor:
    """NCHW ``conv2d_transpose(x, W)`` as the packed GEMM of a 1×1 conv and a col2im
    (:class:`TransposedConv`): ``w`` is ``W`` as ``[C_out·kh·kw, C_in]`` (the A operand; or
    packed as B, ``plan.positions_as_rows``), ``plan`` the 1×1 conv's over ``x``."""
    cols = conv2d_gemm(x, w, plan)
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel, conv.strides, conv.dilation
    top, left = conv.padding
    out_channels = int(cols.shape[1]) // (kh * kw)

    def value(b, co, oh, ow):
        terms = []
        for r, ih, row_ok in _taps(oh, top, kh, sh, dh, conv.in_h):
            for s, iw, col_ok in _taps(ow, left, kw, sw, dw, conv.in_w):
                load = cols[b, co * _i64(kh * kw) + r * _i64(kw) + s, ih, iw]
                terms.append(load if conv.one_tap else tirx.if_then_else(
                    tirx.all(*row_ok, *col_ok), load, tirx.const(0, cols.dtype)))
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return total

    return te.compute((cols.shape[0], _i64(out_channels), _i64(conv.out_h), _i64(conv.out_w)),
                      value, name="conv2d_transpose_col2im")


def pack_rows(w: np.ndarray, mr: int) -> np.ndarray:
    """``w[N, K]`` as ``[⌈N/MR⌉, K, MR]`` slivers of MR rows (zero rows past N): the
    micro-kernel's MR broadcasts per k then read consecutive floats, one stream, where the
    rows of ``w`` are MR streams K floats apart."""
    n, k = w.shape
    out = np.zeros((-(-n // mr) * mr, k), w.dtype)
    out[:n] = w
    return np.ascontiguousarray(out.reshape(-1, mr, k).transpose(0, 2, 1))


def pack_weight(w: np.ndarray, nr: int, transposed: bool) -> np.ndarray:
    """``B[K, N]`` (or ``W[N, K]`` when ``transposed``) as ``Bp[⌈N/NR⌉, K, NR]``, zeros past
    column N."""
    b = w.T if transposed else w
    k, n = b.shape
    panels = -(-n // nr)
    padded = np.zeros((k, panels * nr), dtype=w.dtype)
    padded[:, :n] = b
    return np.ascontiguousarray(padded.reshape(k, panels, nr).transpose(1, 0, 2))


@relax.expr_functor.mutator
class _Packer(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, params: CpuParams, convs: bool,
                 quantized_only: bool):
        super().__init__(mod)
        self.params = params
        self.convs = convs and not quantized_only
        self.quantized_only = quantized_only
        self.packed = 0

    def _bound(self, var):
        return self.lookup_binding(var)

    def _constant_weight(self, expr) -> tuple[relax.Expr | QuantizedWeight | None, bool]:
        """(the 2-D float32 constant or per-channel quantized weight, transposed) behind
        ``expr``, or (None, False)."""
        if isinstance(expr, tvm.ir.Var):
            bound = self.lookup_binding(expr)
            if bound is not None:
                expr = bound
        transposed = False
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == \
                "relax.permute_dims":
            axes = expr.attrs.axes
            if axes is not None and [int(a) for a in axes] != [1, 0]:
                return None, False
            transposed, expr = True, expr.args[0]
            if isinstance(expr, tvm.ir.Var):
                bound = self.lookup_binding(expr)
                expr = expr if bound is None else bound
        quantized = quantized_weight(expr, transposed, self._bound)
        if quantized is not None:
            return quantized, transposed
        if not isinstance(expr, GenericConst):
            return None, False
        shape = [int(s) for s in expr.ty.shape]
        if len(shape) != 2 or str(expr.ty.dtype) not in ("float32", *_HALF) or 0 in shape:
            return None, False
        return expr, transposed

    def _constant(self, expr) -> GenericConst | None:
        if isinstance(expr, tvm.ir.Var):
            bound = self.lookup_binding(expr)
            expr = expr if bound is None else bound
        return expr if isinstance(expr, GenericConst) else None

    def _conv(self, call: relax.Call) -> relax.Expr:
        """A dense NCHW conv (or NCW 1-D conv, as one row of height 1; an NCDHW 3-D conv, as
        the 2-D conv of :func:`fold_conv3d`) with a constant weight as the packed GEMM, else
        ``call``."""
        attrs = call.attrs
        x, w = call.args
        weight = self._constant(w)
        one_d = call.op.name == "relax.nn.conv1d"
        three_d = call.op.name == "relax.nn.conv3d"
        layouts = (("NCW", "OIW", "NCW") if one_d else ("NCDHW", "OIDHW", "NCDHW") if three_d
                   else ("NCHW", "OIHW", "NCHW"))
        groups = int(attrs.groups)
        if three_d and groups != 1:
            return call  # grouped 3-D convs: the direct conv, for now
        if (weight is None
                or (str(attrs.data_layout), str(attrs.kernel_layout),
                    str(attrs.out_layout)) != layouts
                or not _sums_in_float32(str(getattr(x.ty, "dtype", "")),
                                        str(weight.ty.dtype), attrs.out_dtype)):
            return call
        shape = getattr(x.ty, "shape", None)
        shape = None if shape is None else list(shape)
        if shape is None or len(shape) != len(layouts[0]) or not all(
                isinstance(d, tirx.IntImm) for d in shape[1:]):
            return call  # a symbolic channel or map: the direct conv's schedule takes it
        if not isinstance(shape[0], tirx.IntImm) and (one_d or groups > 1):
            return call  # a symbolic batch: 2-D convs without groups only, for now
        # a symbolic batch: the plan of one image, repeated per image (conv2d_gemm)
        per_image = not isinstance(shape[0], tirx.IntImm)
        shape = [int(d) if isinstance(d, tirx.IntImm) else 1 for d in shape]
        w_np = weight.value.numpy().astype(np.float32)  # 16-bit weights widened once, here
        padding = [int(p) for p in attrs.padding]
        strides = tuple(int(s) for s in attrs.strides)
        dilation = tuple(int(d) for d in attrs.dilation)
        if one_d:  # height 1: kernel 1 × kw, no vertical padding, stride or dilation
            shape.insert(2, 1)
            w_np = w_np[:, :, None, :]
            left, right = padding if len(padding) == 2 else padding * 2
            padding, strides, dilation = [0, left, 0, right], (1, *strides), (1, *dilation)
        depth = None
        if three_d:
            if len(padding) == 3:
                padding = padding * 2
            folded = fold_conv3d(shape, w_np.shape[2:], strides, tuple(padding), dilation)
            if folded is None or 0 in w_np.shape:
                return call
            depth, shape, kernel, strides, padding, dilation = folded
            shape = [1 if per_image else shape[0], *shape[1:]]  # per image: one 2-D image
            w_np = w_np.reshape(w_np.shape[0], shape[1], *kernel)  # (c, q) as the channels
            padding = list(padding)
        n, channels, kh, kw = w_np.shape
        if channels * groups != shape[1] or 0 in w_np.shape or n % groups:
            return call
        n //= groups
        # a grouped conv: one GEMM per group when a group's channels fill the micro-kernel
        # and its reduction spans at least two of the GEMM's K blocks (wav2vec2's positional
        # conv: 16 groups of 48 channels × 128 taps, 0.22 -> 1.24x ONNX Runtime); narrower or
        # shorter groups keep the direct conv (ResNeXt's 32 channels × 3×3, K = 288: 32
        # small GEMMs measured 0.54 -> 0.41x; depthwise convs)
        kc, _ = self.params.gemm_blocks(*self.params.gemm_tile())
        if groups > 1 and (min(channels, n) < 2 * self.params.lanes
                           or channels * kh * kw < 2 * kc):
            if len(padding) == 2:
                padding = padding * 2
            if not one_d and n == 1 and channels == 1 and depthwise_in_lanes(
                    shape, (kh, kw), strides, tuple(padding), dilation, self.params):
                self.packed += 1  # the weight laid out [channel block, kh, kw, lane]
                lanes = self.params.lanes
                w_lanes = np.ascontiguousarray(
                    w_np.reshape(groups // lanes, lanes, kh, kw).transpose(0, 2, 3, 1))
                return self.builder_.call_te(
                    depthwise_conv2d_lanes, x, relax.const(w_lanes), strides,
                    tuple(padding), dilation, primfunc_name_hint="depthwise_conv2d_lanes")
            if one_d or not channels_in_lanes(shape, (kh, kw), strides, tuple(padding),
                                              dilation, n, self.params):
                return call
            self.packed += 1  # the weight laid out [group, c, kh, kw, channel in group]
            lanes_w = np.ascontiguousarray(
                w_np.reshape(groups, n, channels, kh, kw).transpose(0, 2, 3, 4, 1))
            return self.builder_.call_te(
                grouped_conv2d_lanes, x, relax.const(lanes_w), strides, tuple(padding),
                dilation, primfunc_name_hint="group_conv2d_lanes")
        if len(padding) == 2:
            padding = padding * 2
        shape[1] = channels
        plan = plan_conv_gemm(shape, (kh, kw), strides, tuple(padding), dilation, self.params,
                              n)
        if plan is None:
            return call
        self.packed += 1
        outputs = []
        for g in range(groups):
            w2 = np.ascontiguousarray(w_np[g * n:(g + 1) * n].reshape(n, channels * kh * kw))
            used = plan
            if plan.positions_as_rows:
                w2 = pack_weight(w2, plan.nr, True)
            else:
                # rows whose lines share L1 sets (a row length a multiple of the way size)
                # would evict one another: the micro-kernel's rows packed, one stream
                mr, _ = self.params.gemm_tile(plan.nr)
                if self.params.l1_rows_per_set(mr, 4 * w2.shape[1]) > self.params.l1d_ways // 2:
                    w2 = pack_rows(w2, mr)
                    used = replace(plan, a_mr=mr, out_channels=n)
            w2 = relax.const(w2)
            part = (None if groups == 1 else (g * channels, channels))
            conv = self.builder_.call_te(
                lambda data, weights, part=part, used=used: conv2d_gemm(data, weights, used,
                                                                        part, depth),
                x, w2, primfunc_name_hint="conv3d_gemm" if three_d else "conv2d_gemm")
            if groups == 1:
                return conv
            outputs.append(self.builder_.emit(conv))
        return relax.op.concat(outputs, axis=1)

    def _conv_transpose(self, call: relax.Call) -> relax.Expr:
        """A 2-D NCHW transposed conv (groups 1) with a constant weight as the packed GEMM of
        a 1×1 conv and a col2im (:func:`conv2d_transpose_gemm`), else ``call``."""
        attrs = call.attrs
        x, w = call.args
        weight = self._constant(w)
        if (weight is None or int(attrs.groups) != 1
                or (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
                != ("NCHW", "IOHW", "NCHW")
                or str(attrs.out_dtype) not in ("", "void", "None", "float32")
                or str(getattr(x.ty, "dtype", "")) != "float32"
                or str(weight.ty.dtype) != "float32"):
            return call
        shape = getattr(x.ty, "shape", None)
        if shape is None or len(shape) != 4 or not all(
                isinstance(d, tirx.IntImm) for d in list(shape)[1:]):
            return call  # a symbolic channel count or map: TOPI's conv takes it
        batch, channels, height, width = (int(d) if isinstance(d, tirx.IntImm) else 1
                                          for d in shape)
        w_np = weight.value.numpy()
        if w_np.ndim != 4 or w_np.shape[0] != channels or 0 in w_np.shape:
            return call
        _, out_channels, kh, kw = w_np.shape
        out_shape = [int(d) for d in list(call.ty.shape)[2:]]
        padding = [int(p) for p in attrs.padding]
        padding = padding * 2 if len(padding) == 2 else padding
        conv = TransposedConv((kh, kw), tuple(int(v) for v in attrs.strides),
                              (padding[0], padding[1]), tuple(int(d) for d in attrs.dilation),
                              height, width, *out_shape)
        rows = out_channels * kh * kw
        plan = plan_conv_gemm([batch, channels, height, width], (1, 1), (1, 1), (0, 0, 0, 0),
                              (1, 1), self.params, rows)
        if plan is None or min(out_shape) <= 0:
            return call
        # A[(co, r, s), ci]: the GEMM's rows are the output channels' taps
        w2 = np.ascontiguousarray(w_np.transpose(1, 2, 3, 0).reshape(rows, channels))
        w2 = relax.const(pack_weight(w2, plan.nr, True) if plan.positions_as_rows else w2)
        self.packed += 1
        return self.builder_.call_te(
            lambda data, weights: conv2d_transpose_gemm(data, weights, plan, conv), x, w2,
            primfunc_name_hint="conv2d_transpose_gemm")

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (TVM's visitor name)
        call = self.visit_expr_post_order(call)
        if getattr(call.op, "name", "") == "relax.nn.conv2d_transpose" and self.convs:
            return self._conv_transpose(call)
        if getattr(call.op, "name", "") in ("relax.nn.conv2d", "relax.nn.conv1d",
                                            "relax.nn.conv3d") and self.convs:
            return self._conv(call)
        if getattr(call.op, "name", "") != "relax.matmul" or len(call.args) != 2:
            return call
        x, b = call.args
        x_ty = x.ty
        x_dtype = str(getattr(x_ty, "dtype", ""))
        if x_dtype not in ("float32", *_HALF) or getattr(x_ty, "shape", None) is None:
            return call
        if len(x_ty.shape) < 1:
            return call
        weight, transposed = self._constant_weight(b)
        if weight is None:
            return call
        quantized = isinstance(weight, QuantizedWeight)
        if self.quantized_only and not quantized:
            return call
        w_dtype = "float32" if quantized else str(weight.ty.dtype)
        if not _sums_in_float32(x_dtype, w_dtype, call.attrs.out_dtype):
            return call
        # 16-bit float weights widened to float32 once, here
        data = weight.q if quantized else weight.value.numpy().astype(np.float32)
        rows, cols = data.shape
        n, k = (rows, cols) if transposed else (cols, rows)
        x_k = x_ty.shape[-1]
        if not isinstance(x_k, tirx.IntImm) or int(x_k) != k:
            return call
        nr = panel_width(n, self.params)
        bp = relax.const(pack_weight(data, nr, transposed))
        self.packed += 1
        if not quantized:
            return self.builder_.call_te(packed_matmul, x, bp, n,
                                         primfunc_name_hint=PACKED_GEMM)
        # integers packed as they are; the per-channel scale after the K loop, an
        # elementwise epilogue that fuses into the GEMM's store (layout/weight_quant.py)
        zp = (None if weight.zero_point is None
              else relax.const(pack_columns(weight.zero_point, nr)))
        if weight.block:  # block-wise: each block's scale inside the sum
            return self.builder_.call_te(
                packed_matmul, x, bp, n, zp, relax.const(pack_columns(weight.scale, nr)),
                weight.block, primfunc_name_hint=PACKED_GEMM)
        acc = self.builder_.emit(self.builder_.call_te(
            packed_matmul, x, bp, n, zp, primfunc_name_hint=PACKED_GEMM))
        return relax.op.multiply(acc, relax.const(weight.scale))


def PackMatmulWeights(target: tvm.target.Target,  # noqa: N802 (a pass)
                      convs: bool = True,
                      quantized_only: bool = False) -> tvm.transform.Pass:
    """Pack constant matmul weights into GEMM panels on ``llvm`` targets (other targets are
    left alone): one packed constant per weight. With ``convs``, dense NCHW convs with a
    constant weight become the packed GEMM too (:func:`conv2d_gemm`). ``quantized_only``:
    only the weight-only quantized matmul weights (run before anything that folds constants;
    no convs)."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.PackMatmulWeights")
    def _pack(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if target.kind.name != "llvm":
            return mod
        packer = _Packer(mod, cpu_params(target), convs, quantized_only)
        changed = False
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                packer.packed = 0
                new = packer.visit_expr(func)
                if packer.packed:
                    packer.builder_.update_func(gvar, new)
                    changed = True
        if not changed:
            return mod
        # the pass's own clean-up: the unpacked weight (or its transpose) dropped
        return relax.transform.DeadCodeElimination()(packer.builder_.get())

    return _pack


__all__ = ["PACKED_GEMM", "ConvGemm", "DepthFold", "PackMatmulWeights", "TransposedConv",
           "channels_in_lanes", "conv2d_gemm", "conv2d_transpose_gemm", "depthwise_conv2d_lanes",
           "depthwise_in_lanes", "fold_conv3d",
           "grouped_conv2d_lanes", "pack_weight", "packed_matmul", "panel_width",
           "plan_conv_gemm"]

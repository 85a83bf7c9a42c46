"""QDQ int8 convs with integer sums (x86: AVX512-VNNI ``vpdpbusd``, or ``vpmaddwd``).

A QDQ conv, as ``onnxruntime.quantization.quantize_static(quant_format=QDQ)`` writes it and
the ONNX frontend imports it::

    y = quantize([relu](conv2d(dequantize(xq, sx, zx), dequantize(Wq, sw, 0)) [+ bias]), sy, zy)

is replaced, before anything folds the weight's dequantize into float32, by one kernel of its
own (``call_tir`` of a PrimFunc built here, marked scheduled) that reads the int8/uint8
activation ``xq`` and writes the int8/uint8 ``y``:

1. *Packing* (per call, per image): the input becomes ``sh·sw`` phase planes of its padded
   map, ``[⌈C/G⌉, sh, sw, Hq, Wq]`` words of ``G`` channels (the padding holds the zero point,
   the dequantized 0). Tap ``(r, s)`` of output position ``(oh, ow)`` is then word
   ``base(c, r, s) + oh·Wq + ow`` of that buffer: consecutive output columns read consecutive
   words, with any stride, dilation or padding (ConvGemm's ``padded_flat`` plan, split into
   phases for a stride), and no im2col matrix is written.
2. *GEMM*: rows are the output channels (the weight, packed at compile time in slivers of MR
   rows, ``Ap[⌈M/MR⌉, K/G, MR]`` words of G int8 weights, K = ⌈C/G⌉·kh·kw groups, channels
   past C zero), columns the flat positions ``oh·Wq + ow`` in panels of NR; each k step is
   ``acc[r, :] += dot(B[base(k) + col0 : + NR], broadcast(Ap[.., k, r]))`` in int32 lanes,
   exact (no saturation), the whole K in registers (no partial sums).
3. *Epilogue*, vectorised over the panel: ``(acc − zc[co]) · (sx·sw[co]) + bias[co]`` in
   float32, ReLU, then ONNX's QuantizeLinear (divide by ``sy``, round half to even, add
   ``zy``, saturate) into a padded int8 tile, cropped to the output (columns ``ow ≥ OW`` of
   the padded rows and rows/channels past the tails are never stored).

Forms, from the target's features (:func:`form_of`):

* ``vnni`` (AVX512-VNNI): G = 4, u8 × s8 into int32 lanes. An int8 activation ``q`` enters
  as ``u = q + 128`` (uint8 as it is) and ``Σ w·(q − zx) = Σ w·u − z'·Σ w`` with
  ``z' = zx + 128`` (or ``zx``): ``zc = z'·Σ w``, a constant per output channel; the padding
  holds ``u = z'``, whose terms cancel in the same way.
* ``pmaddwd`` (AVX2, AVX-512 without VNNI): G = 2, s16 pairs summed into int32 (exact). The
  activation enters as ``q − zx`` (−255..255) and the padding as 0: ``zc = 0``.

AArch64 (``sdot``) keeps the float path for now. Rejected (the float32 packed GEMM, with
the reason in :func:`plan_int8_convs`): a symbolic shape, groups, a weight zero point other
than 0, per-channel activation scales, another layout, an intermediate read elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.ir.expr import GenericConst
from tvm.script import tirx as T

from ..tir_schedules.cpu_target import CpuParams, cpu_params, has_feature
from ..tir_schedules.records import SCHEDULE_ATTR
from .gemm_pack import conv_out_hw

INT8_CONV = "conv2d_int8"
NOTES_ATTR = "tvm_fusion.int8_convs"

# per form: (k values per int32 word, element type of B's lanes, intrinsic by int32 lanes)
FORMS = {
    "vnni": (4, "uint8", {16: "llvm.x86.avx512.vpdpbusd.512",
                          8: "llvm.x86.avx512.vpdpbusd.256"}),
    "pmaddwd": (2, "int16", {16: "llvm.x86.avx512.pmaddw.d.512", 8: "llvm.x86.avx2.pmadd.wd"}),
}


def form_of(target: tvm.target.Target) -> str | None:
    """The integer dot product the conv kernel uses on ``target``, or None (float path)."""
    if target.kind.name != "llvm":
        return None
    params = cpu_params(target)
    if params.isa == "avx512":
        return "vnni" if has_feature(target, "avx512vnni") else "pmaddwd"
    if params.isa == "avx2":
        return "pmaddwd"
    return None


@dataclass(frozen=True)
class Int8Conv:
    """One QDQ conv's static description (NCHW, OIHW, groups 1)."""

    batch: int
    channels: int
    height: int
    width: int
    out_channels: int
    kernel: tuple[int, int]
    strides: tuple[int, int]
    padding: tuple[int, int, int, int]  # top, left, bottom, right
    dilation: tuple[int, int]
    act_dtype: str  # int8 / uint8
    out_dtype: str  # int8 / uint8
    relu: bool

    @property
    def out_hw(self) -> tuple[int, int]:
        return conv_out_hw((self.height, self.width), self.kernel, self.strides, self.padding,
                           self.dilation)


@dataclass(frozen=True)
class Tiling:
    form: str
    group: int  # k per word
    lanes: int  # int32 lanes per register
    mr: int
    nr: int
    hq: int  # phase plane height, width
    wq: int
    cg: int  # channel groups
    kg: int  # k groups (words) of the reduction
    panels: int
    row_tiles: int
    words: int  # the packed input's words per image


def choose_tiling(conv: Int8Conv, params: CpuParams, form: str) -> Tiling:
    """The register tile (MR output channels × NR positions) with the least modelled work:
    padded rows × padded columns, each k step's loads (NR/lanes vectors and MR broadcasts,
    two a cycle) beside its MR·NR/lanes dot products."""
    group = FORMS[form][0]
    lanes = params.lanes
    sh, sw = conv.strides
    top, left, bottom, right = conv.padding
    hp, wp = conv.height + top + bottom, conv.width + left + right
    hq, wq = -(-hp // sh), -(-wp // sw)
    out_h, _ = conv.out_hw
    columns = out_h * wq
    # pmaddwd's product takes a register before its add
    temps = 1 if form == "pmaddwd" else 0
    best = None
    # pmaddwd: at least two vectors per row (AVX2 on Zen 4, layer-1 3x3: 6x16 and 5x16 152
    # GOP/s, 13x8 128, 3x24 141; the model puts them within 3 % of each other)
    for nv in range(2 if form == "pmaddwd" else 1, 5):
        fit = (params.vector_registers - nv - 1 - temps) // nv
        for mr in range(1, min(fit, 16) + 1):
            nr = nv * lanes
            work = (-(-conv.out_channels // mr) * mr) * (-(-columns // nr) * nr)
            if form == "pmaddwd":
                # issue-bound: per k step a multiply and an add per vector, MR broadcasts,
                # NV loads and ~4 of the loop's own, per vector computed
                cost = work * (2 * mr * nv + mr + nv + 4) / (mr * nv)
            else:  # vpdpbusd takes its broadcast from memory: one a cycle, loads beside
                cost = work * max(1.0, (mr + nv) / 2 / (mr * nv)) * (1 + 0.5 / (mr * nv))
            key = (cost, -mr * nv)
            if best is None or key < best[0]:
                best = (key, mr, nr)
    _, mr, nr = best
    cg = -(-conv.channels // group)
    kh, kw = conv.kernel
    panels = -(-columns // nr)
    dh, dw = conv.dilation
    plane = hq * wq
    reach = max(_offset(r * dh, s * dw, sh, sw, wq, plane, 0) for r in range(kh)
                for s in range(kw))
    words = max(cg * sh * sw * plane, (cg - 1) * sh * sw * plane + reach + panels * nr) + 1
    return Tiling(form, group, lanes, mr, nr, hq, wq, cg, cg * kh * kw, panels,
                  -(-conv.out_channels // mr), words)


def _offset(rr: int, ss: int, sh: int, sw: int, wq: int, plane: int, c: int) -> int:
    """Word offset of tap (rr, ss) (dilated) of channel group ``c`` in the phase planes."""
    phase = (c * sh + rr % sh) * sw + ss % sw
    return phase * plane + (rr // sh) * wq + ss // sw


def pack_weight_words(w: np.ndarray, conv: Int8Conv, tiling: Tiling) -> np.ndarray:
    """``W[M, C, kh, kw]`` int8 as ``Ap[⌈M/MR⌉, K/G, MR]`` int32 words of G weights (k group
    order: channel group, r, s; channels past C and rows past M zero)."""
    m, c, kh, kw = w.shape
    g, mr = tiling.group, tiling.mr
    cp = tiling.cg * g
    full = np.zeros((tiling.row_tiles * mr, cp, kh, kw), np.int64)
    full[:m, :c] = w
    # [rows, cg, g, kh, kw] -> [rows, cg, kh, kw, g]
    full = full.reshape(-1, tiling.cg, g, kh, kw).transpose(0, 1, 3, 4, 2)
    elem = np.int8 if g == 4 else np.int16
    words = np.ascontiguousarray(full.astype(elem)).view(np.int32).reshape(-1, tiling.kg)
    return np.ascontiguousarray(words.reshape(tiling.row_tiles, mr, tiling.kg)
                                .transpose(0, 2, 1))


def k_offsets(conv: Int8Conv, tiling: Tiling) -> np.ndarray:
    """The packed input's word offset of each k group (channel group, r, s)."""
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel, conv.strides, conv.dilation
    plane = tiling.hq * tiling.wq
    return np.array([_offset(r * dh, s * dw, sh, sw, tiling.wq, plane, c)
                     for c in range(tiling.cg) for r in range(kh) for s in range(kw)],
                    np.int32)


def build_kernel(conv: Int8Conv, tiling: Tiling, zx: int, sy: float, zy: int,
                 cores: int = 1, quantize_input: tuple[float, int] | None = None
                 ) -> tirx.PrimFunc:
    """The kernel: ``(xq, Ap, koff, zc, scale, bias) -> y`` (module docstring).
    ``quantize_input`` (scale, zero point): ``x`` is the float32 tensor that a QuantizeLinear
    read by this conv alone turns into ``xq``, quantized here as the input is packed (ONNX's
    ``clip(round(x / s) + z)``), so that it is no kernel of its own."""
    group, b_dtype, intrins = FORMS[tiling.form]
    intrin = intrins[tiling.lanes]
    lanes, mr, nr = tiling.lanes, tiling.mr, tiling.nr
    nv = nr // lanes
    b_lanes = lanes * group
    bsz, c_in, h_in, w_in = conv.batch, conv.channels, conv.height, conv.width
    m = conv.out_channels
    out_h, out_w = conv.out_hw
    sh, sw = conv.strides
    top, left, _, _ = conv.padding
    hq, wq, cg, kg = tiling.hq, tiling.wq, tiling.cg, tiling.kg
    panels, row_tiles, words = tiling.panels, tiling.row_tiles, tiling.words
    cols = panels * nr
    rows = row_tiles * mr
    vnni = tiling.form == "vnni"
    act = conv.act_dtype
    # the packed value of a quantized activation q: u = q + 128 (int8) / q (uint8) for vnni,
    # q - zx for pmaddwd; and the padding's (the dequantized 0)
    shift = 128 if (vnni and act == "int8") else 0
    pad_value = (zx + shift) if vnni else 0
    lo, hi = (-128, 127) if conv.out_dtype == "int8" else (0, 255)
    out_dtype = conv.out_dtype
    relu = conv.relu
    bits = 32 // group
    mask = (1 << bits) - 1
    over_panels = T.parallel if cores > 1 else T.serial
    planes = cg * sh * sw * hq * wq

    act_lo, act_hi = (-128, 127) if act == "int8" else (0, 255)
    x_dtype = act if quantize_input is None else "float32"

    def element(x, b, c, ih, iw):
        inside = tirx.all(c < c_in, ih >= 0, ih < h_in, iw >= 0, iw < w_in)
        load = x[b, T.min(c, c_in - 1), T.max(T.min(ih, h_in - 1), 0),
                 T.max(T.min(iw, w_in - 1), 0)]
        if quantize_input is not None:
            s_in, z_in = quantize_input
            q_in = T.round(load / T.float32(s_in)) + T.float32(z_in)
            load = T.min(T.max(q_in, T.float32(act_lo)), T.float32(act_hi))
        if vnni:
            value = T.Cast("int32", load) + shift
        else:
            value = T.Cast("int32", load) - zx
        return T.Select(inside, value, T.int32(pad_value)) & mask

    def word(x, b, g, ph, pw, hh, ww):
        ih = hh * sh + ph - top
        iw = ww * sw + pw - left
        out = element(x, b, g * group, ih, iw)
        for i in range(1, group):
            out = out | (element(x, b, g * group + i, ih, iw) << (bits * i))
        return out

    def dot(acc, b_vec, a_word):
        a_vec = T.reinterpret(f"{'int8' if vnni else 'int16'}x{b_lanes}",
                              T.broadcast(a_word, lanes))
        b_vec = T.reinterpret(f"{b_dtype}x{b_lanes}", b_vec)
        if vnni:
            return T.call_llvm_pure_intrin(f"int32x{lanes}", intrin, acc, b_vec, a_vec)
        return acc + T.call_llvm_pure_intrin(f"int32x{lanes}", intrin, b_vec, a_vec)

    def requant(acc, zc, scale, bias):
        value = T.Cast("float32", acc - zc) * scale + bias
        if relu:
            value = T.max(value, T.float32(0))
        q = T.round(value / T.float32(sy)) + T.float32(zy)
        q = T.min(T.max(q, T.float32(lo)), T.float32(hi))
        return T.Cast(out_dtype, q)

    @T.prim_func
    def kernel(x: T.Buffer((bsz, c_in, h_in, w_in), x_dtype),
               ap: T.Buffer((row_tiles, kg, mr), "int32"),
               koff: T.Buffer((kg,), "int32"),
               zc: T.Buffer((rows,), "int32"),
               scale: T.Buffer((rows,), "float32"),
               bias: T.Buffer((rows,), "float32"),
               y: T.Buffer((bsz, m, out_h, out_w), out_dtype)):
        T.func_attr({"tirx.noalias": True})
        xq = T.alloc_buffer((words,), "int32")
        yp = T.alloc_buffer((rows, cols), out_dtype)
        for b in range(bsz):
            for w_i in range(words - planes):
                xq[planes + w_i] = T.int32(pad_value)
            for g, ph, pw, hh in T.grid(cg, sh, sw, hq):
                for ww in T.vectorized(wq):
                    xq[((g * sh + ph) * sw + pw) * (hq * wq) + hh * wq + ww] = word(
                        x, b, g, ph, pw, hh, ww)
            for jp in over_panels(panels):
                for it in range(row_tiles):
                    acc = T.alloc_buffer((mr, nr), "int32", scope="local")
                    for r in T.unroll(mr):
                        for v in T.unroll(nv):
                            acc[r, T.ramp(v * lanes, 1, lanes)] = T.broadcast(T.int32(0),
                                                                              lanes)
                    for kk in range(kg):
                        for r in T.unroll(mr):
                            for v in T.unroll(nv):
                                acc[r, T.ramp(v * lanes, 1, lanes)] = dot(
                                    acc[r, T.ramp(v * lanes, 1, lanes)],
                                    xq[T.ramp(koff[kk] + jp * nr + v * lanes, 1, lanes)],
                                    ap[it, kk, r])
                    for r in T.unroll(mr):
                        for c in T.vectorized(nr):
                            yp[it * mr + r, jp * nr + c] = requant(
                                acc[r, c], zc[it * mr + r], scale[it * mr + r],
                                bias[it * mr + r])
            for co, oh in T.grid(m, out_h):
                for ow in T.vectorized(out_w):
                    y[b, co, oh, ow] = yp[co, oh * wq + ow]

    # no global symbol: the module names it (one kernel per conv shape)
    if "global_symbol" in (kernel.attrs or {}):
        kernel = kernel.without_attr("global_symbol")
    return kernel


# ------------------------------------------------------------------- the Relax rewrite

def _op(expr) -> str:
    return getattr(getattr(expr, "op", None), "name", "")


def _scalar(expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, GenericConst) else None


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target, uses: dict):
        super().__init__(mod)
        self.target = target
        self.params = cpu_params(target)
        self.form = form_of(target)
        self.uses = uses
        self.notes: list[str] = []
        self.count = 0

    def _bound(self, expr):
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            if bound is not None:
                return bound
        return expr

    def _single(self, var) -> bool:
        return not isinstance(var, relax.Var) or self.uses.get(var, 0) <= 1

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (TVM's visitor)
        call = self.visit_expr_post_order(call)
        if _op(call) != "relax.quantize":
            return call
        found = self._match(call)
        if isinstance(found, str):
            if found:
                self.notes.append(found)
            return call
        return found

    def _match(self, q: relax.Call):
        """The integer kernel's call for quantize ``q``, a reason (str) where a QDQ conv keeps
        the float path, or "" where ``q`` quantizes no conv."""
        value, relu, bias = q.args[0], False, None
        chain = []
        node = self._bound(value)
        if _op(node) == "relax.nn.relu":
            chain.append(value)
            relu, value = True, node.args[0]
            node = self._bound(value)
        if _op(node) == "relax.add":
            chain.append(value)
            a, b = node.args
            if _op(self._bound(a)) != "relax.nn.conv2d":
                a, b = b, a
            value, bias = a, b
            node = self._bound(value)
        if _op(node) != "relax.nn.conv2d":
            return ""
        chain.append(value)
        w_shape = node.args[1].ty.shape
        name = f"conv2d {'?' if w_shape is None else [int(d) for d in w_shape]}"
        dq_x, dq_w = (self._bound(a) for a in node.args)
        if _op(dq_x) != "relax.dequantize" or _op(dq_w) != "relax.dequantize":
            return ""  # not a QDQ conv
        why = self._reject(q, node, dq_x, dq_w, chain)
        if why:
            return f"{name}: float path ({why})"
        bias_v = self._bias(bias, int(node.args[1].ty.shape[0])) if bias is not None else 0.0
        if bias_v is None:
            return f"{name}: float path (the added term is not a per-channel constant)"
        return self._emit(q, node, dq_x, dq_w, relu, bias_v, name)

    def _reject(self, q, conv, dq_x, dq_w, chain) -> str:
        if self.form is None:
            return f"no integer dot product form on {self.target.attrs.get('mcpu', self.target)}"
        if not all(self._single(v) for v in chain):
            return "an intermediate is read elsewhere"
        attrs = conv.attrs
        if int(attrs.groups) != 1:
            return f"groups={int(attrs.groups)}"
        if (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout)) != (
                "NCHW", "OIHW", "NCHW"):
            return "layout"
        if str(attrs.out_dtype) not in ("", "void", "None", "float32"):
            return f"out_dtype {attrs.out_dtype}"
        if any(str(d.attrs.out_dtype) != "float32" for d in (dq_x, dq_w)):
            return "dequantized to another type than float32"
        xq = dq_x.args[0]
        shape = getattr(xq.ty, "shape", None)
        if shape is None or len(shape) != 4 or not all(
                isinstance(d, tirx.IntImm) for d in shape):
            return "a symbolic shape"
        if str(xq.ty.dtype) not in ("int8", "uint8"):
            return f"{xq.ty.dtype} activation"
        w = self._bound(dq_w.args[0])
        if not isinstance(w, GenericConst) or str(w.ty.dtype) != "int8":
            return "the weight is not an int8 constant"
        sx, zx = (_scalar(self._bound(a)) for a in dq_x.args[1:])
        if sx is None or zx is None or sx.size != 1 or zx.size != 1:
            return "the activation's scale or zero point is not one constant"
        sw, zw = (_scalar(self._bound(a)) for a in dq_w.args[1:])
        m = int(w.ty.shape[0])
        if sw is None or zw is None or sw.size not in (1, m) or np.any(zw != 0):
            return "the weight's zero point is not 0 (or its scale not per tensor/channel)"
        if sw.size == m and m > 1 and int(dq_w.attrs.axis) != 0:
            return "the weight's scales are not per output channel"
        sy, zy = (_scalar(self._bound(a)) for a in q.args[1:])
        if sy is None or zy is None or sy.size != 1 or zy.size != 1:
            return "the output's scale or zero point is not one constant"
        if str(q.attrs.out_dtype) not in ("int8", "uint8"):
            return f"quantized to {q.attrs.out_dtype}"
        k = int(w.ty.shape[1]) * int(w.ty.shape[2]) * int(w.ty.shape[3])
        if k * 255 * 128 >= 2 ** 31:
            return f"K={k}: int32 sums could overflow"
        return ""

    def _bias(self, expr, m: int):
        """The added per-channel constant as float32 [m], or None. Its shape as the add sees
        it must broadcast along the channels only (``[1, m, 1, 1]``, ``[m, 1, 1]``, or one
        value): a 1-D ``[m]`` would broadcast along the width."""
        shape = getattr(expr.ty, "shape", None)
        if shape is None or not all(isinstance(d, tirx.IntImm) for d in shape):
            return None
        dims = [1] * (4 - len(shape)) + [int(d) for d in shape]
        if len(dims) != 4 or dims[0] != 1 or dims[2:] != [1, 1] or dims[1] not in (1, m):
            return None
        node = self._bound(expr)
        if _op(node) == "relax.reshape":
            node = self._bound(node.args[0])
        if isinstance(node, GenericConst):
            v = node.value.numpy().astype(np.float32)
        elif _op(node) == "relax.dequantize":
            vals = [_scalar(self._bound(a)) for a in node.args]
            if any(v is None for v in vals):
                return None
            data, scale, zp = vals
            # as the dequantize's legalisation computes it, in float32
            v = ((data.astype(np.float32) - zp.astype(np.float32)) * scale.astype(np.float32))
        else:
            return None
        v = np.asarray(v, np.float32)
        if v.size == 1:
            return np.full(m, v.reshape(()), np.float32)
        return v.reshape(m) if v.size == m and dims[1] == m else None

    def _input_quantize(self, xq, dq_var, spec: Int8Conv):
        """((scale, zero point), the float32 tensor) when ``xq`` is a QuantizeLinear of a
        float32 tensor read by this conv's dequantize alone (a graph input's): the kernel
        quantizes as it packs; else (None, ``xq``)."""
        node = self._bound(xq)
        if (_op(node) != "relax.quantize" or not self._single(xq) or not self._single(dq_var)
                or not isinstance(xq, relax.Var) or not isinstance(dq_var, relax.Var)
                or str(node.attrs.out_dtype) != spec.act_dtype):
            return None, xq
        x = node.args[0]
        shape = getattr(x.ty, "shape", None)
        # a graph input only: a kernel's result would then be written as float32 where its
        # fused QuantizeLinear wrote int8 (no kernel fewer, four times the bytes)
        if (not isinstance(x, relax.Var) or self.lookup_binding(x) is not None
                or str(getattr(x.ty, "dtype", "")) != "float32" or shape is None
                or [int(d) if isinstance(d, tirx.IntImm) else None for d in shape]
                != [spec.batch, spec.channels, spec.height, spec.width]):
            return None, xq
        params = _quantize_params(node, self._bound)
        return (params, x) if params is not None else (None, xq)

    def _emit(self, q, conv, dq_x, dq_w, relu, bias, name):
        xq = dq_x.args[0]
        w = self._bound(dq_w.args[0]).value.numpy()
        attrs = conv.attrs
        padding = [int(p) for p in attrs.padding]
        padding = padding * 2 if len(padding) == 2 else padding
        b, c, h, wd = (int(d) for d in xq.ty.shape)
        spec = Int8Conv(b, c, h, wd, w.shape[0], tuple(w.shape[2:]),
                        tuple(int(s) for s in attrs.strides), tuple(padding),
                        tuple(int(d) for d in attrs.dilation), str(xq.ty.dtype),
                        str(q.attrs.out_dtype), relu)
        out_h, out_w = spec.out_hw
        if out_h <= 0 or out_w <= 0 or w.shape[1] != c:
            return f"{name}: float path (empty output or channel mismatch)"
        sx, zx = (_scalar(self._bound(a)).reshape(()) for a in dq_x.args[1:])
        sw = _scalar(self._bound(dq_w.args[1])).astype(np.float32)
        sy, zy = (_scalar(self._bound(a)).reshape(()) for a in q.args[1:])
        m = w.shape[0]
        tiling = choose_tiling(spec, self.params, self.form)
        rows = tiling.row_tiles * tiling.mr
        zx_i = int(zx)
        zc = np.zeros(rows, np.int64)
        if self.form == "vnni":
            zprime = zx_i + (128 if spec.act_dtype == "int8" else 0)
            zc[:m] = zprime * w.reshape(m, -1).astype(np.int64).sum(axis=1)
        # sx·sw in float32, as the float path's dequantized product would scale it
        scale = np.zeros(rows, np.float32)
        scale[:m] = np.float32(sx) * np.broadcast_to(sw.reshape(-1), (m,)).astype(np.float32)
        bias_p = np.zeros(rows, np.float32)
        bias_p[:m] = bias
        quantize_input, x_in = self._input_quantize(xq, conv.args[0], spec)
        func = build_kernel(spec, tiling, zx_i, float(np.float32(sy)), int(zy),
                            self.params.cores, quantize_input)
        note = (f"{name}: integer sums ({self.form}, {tiling.mr}×{tiling.nr} int32 tile, "
                f"k in words of {tiling.group}, {tiling.panels} panels, "
                f"{spec.strides[0]}×{spec.strides[1]} phases); requantised to "
                f"{spec.out_dtype}{', ReLU' if relu else ''}"
                + ("; its input's QuantizeLinear inlined" if quantize_input else ""))
        func = func.with_attr({SCHEDULE_ATTR: [note], "tirx.is_scheduled": True})
        gvar = self.builder_.add_func(func, INT8_CONV)
        self.notes.append(note)
        self.count += 1
        args = [x_in, relax.const(pack_weight_words(w, spec, tiling)),
                relax.const(k_offsets(spec, tiling)), relax.const(zc.astype(np.int32)),
                relax.const(scale), relax.const(bias_p)]
        return relax.call_tir(gvar, args, relax.TensorType(
            [b, m, out_h, out_w], spec.out_dtype))


def _quantize_params(q: relax.Call, lookup) -> tuple[float, int] | None:
    scale, zp = (_scalar(lookup(a)) for a in q.args[1:])
    if scale is None or zp is None or scale.size != 1 or zp.size != 1:
        return None
    return float(np.float32(scale.reshape(()))), int(zp.reshape(()))


def _uses(func: relax.Function) -> dict:
    """How many bindings (and the function's result) read each var."""
    counts: dict = {}
    exprs = [b.value for block in getattr(func.body, "blocks", []) for b in block.bindings]
    exprs.append(getattr(func.body, "body", func.body))
    for expr in exprs:
        for var in relax.analysis.free_vars(expr):
            counts[var] = counts.get(var, 0) + 1
    return counts


def plan_int8_convs(mod: tvm.IRModule, target: tvm.target.Target
                    ) -> tuple[tvm.IRModule, list[str]]:
    """``mod`` with its QDQ convs as integer kernels where they apply, and one note per QDQ
    conv: its kernel, or why it keeps the float path."""
    rewriter = _Rewriter(mod, target, {})
    changed = False
    for gvar, func in list(mod.functions.items()):
        if not isinstance(func, relax.Function):
            continue
        rewriter.uses = _uses(func)
        before = rewriter.count
        new = rewriter.visit_expr(func)
        if rewriter.count > before:
            rewriter.builder_.update_func(gvar, new)
            changed = True
    if not changed:
        return mod, rewriter.notes
    return relax.transform.DeadCodeElimination()(rewriter.builder_.get()), rewriter.notes


def IntegerQdqConvs(target: tvm.target.Target) -> tvm.transform.Pass:  # noqa: N802
    """QDQ convs as integer-summing kernels on x86 ``llvm`` targets (:func:`plan_int8_convs`);
    the notes go to the module's ``tvm_fusion.int8_convs`` attribute."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.IntegerQdqConvs")
    def _run(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if target.kind.name != "llvm":
            return mod
        new, notes = plan_int8_convs(mod, target)
        if notes:
            new = new.with_attr(NOTES_ATTR, notes)
        return new

    return _run


__all__ = ["FORMS", "INT8_CONV", "IntegerQdqConvs", "Int8Conv", "NOTES_ATTR", "Tiling",
           "build_kernel", "choose_tiling", "form_of", "k_offsets", "pack_weight_words",
           "plan_int8_convs"]

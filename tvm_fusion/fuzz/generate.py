"""Random ONNX graphs (and option sets) for differential fuzzing, reproducible from a seed.

Unlike :func:`tvm_fusion.testing.random_dag.random_dag_models` (the fusion planner's property
tests, a few well-behaved ops), this generator aims at what the ONNX frontend imports and what
issue 17 found broken: selections to scalars and size-1 axes *as graph outputs*, scans, gathers
with constant indices, pads, resizes, normalisations, (batched, transposed) matmuls and Gemm,
convs of every kind, int64 index arithmetic, casts, multi-output nodes, outputs also consumed
inside the graph, transcendental chains and reductions. Each emitter appends one node or a short
pattern; shapes come from ONNX shape inference after every node (a node it rejects is dropped),
so an emitter never computes a shape by hand and cannot get one wrong. Graphs are built with
:class:`tvm_fusion.models.graph.GraphBuilder`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..models.graph import GraphBuilder, make_model, value_info
from ..models.precision import cast_model
from .differential import Case
from .feeds import make_feeds

OPSET = 18
#: The most elements of one value: the generated graphs stay cheap to build and run.
MAX_ELEMENTS = 4096
IR_VERSION = 8
FLOAT, INT64, FLOAT16, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.FLOAT16, \
    TensorProto.BOOL

#: Non-default values each option takes on a share of the cases (tvm_fusion.options.Options).
OPTION_VALUES: dict[str, list] = {
    "strategy": ["apollo", "tvm"],
    "layout": [False],
    "rewrite": [False],
    "schedule": [False],
    "fast_math": [False],
    "conv_layout": ["NCHW", "NCHWc"],
    "conv_chains": ["cost_model", "paper_1.05"],
    "seed_policy": ["paper"],
    "broadcast_policy": ["strict"],
    "prefer_epilogues": [False],
    "max_ops_per_block": [1, 2, 3],
    "allow_fp_reassociation": [False],
    "layout_policy": ["vector"],
    "layout_copies": [0, 2],
    "flops_per_byte": [0.1, 1000.0],
    "profile": ["off"],
    "apollo_rules": ["paper"],
    "apollo_layers": [1, 2],
    "apollo_max_branches": [2],
    "apollo_blocklist": ["memory"],
    "table3": ["random", "random", "m2m_green"],  # drawn per case (see draw_options)
    "fuse_epilogues": [False],  # last: options added later leave the earlier draws alone
}
#: The Table 3 cells docs/options.md allows to turn green that broke modules (issue 17 item 5).
M2M_GREEN = {("O2M", "M2M"): "green", ("M2M", "M2M"): "green", ("M2M", "O2M"): "green"}
MAPPING_TYPES = ("O2O", "O2M", "M2M", "Reorg", "Shuffle")
COLOURS = ("green", "yellow", "red")


def draw_options(rng: np.random.Generator, share: float = 0.15) -> dict:
    """Each option of :data:`OPTION_VALUES` takes one of its non-default values with
    probability ``share``; the rest stay at their defaults (left out of the dict)."""
    options: dict = {}
    for key, values in OPTION_VALUES.items():
        if rng.random() >= share:
            continue
        value = values[int(rng.integers(len(values)))]
        if value == "m2m_green":
            value = dict(M2M_GREEN)
        elif key == "table3":  # mostly green: fusing more is what went wrong (issue 17 item 5)
            value = {
                (str(rng.choice(MAPPING_TYPES)), str(rng.choice(MAPPING_TYPES))):
                    str(rng.choice(COLOURS, p=[0.6, 0.2, 0.2]))
                for _ in range(int(rng.integers(1, 5)))
            }
        options[key] = value
    return options


class Builder(GraphBuilder):
    """A growing ONNX graph whose value shapes come from ONNX shape inference."""

    def __init__(self, rng: np.random.Generator, opset: int = OPSET):
        super().__init__("fuzz", opset=opset)
        self.require_opset(opset)
        self.rng = rng
        self.info: dict[str, tuple[tuple[int, ...], int]] = {}  # value -> (shape, elem type)
        self.produced: list[str] = []  # node outputs in creation order

    def require_opset(self, opset: int) -> None:
        """Build at ``opset`` or newer, with the IR version that opset needs."""
        self.opset = max(self.opset, opset)
        self.ir_version = IR_VERSION if self.opset <= 18 else 10

    def input(self, shape, elem: int = FLOAT, hint: str = "") -> str:
        name = self.add_input(self.fresh("in"), list(shape), elem, hint)
        self.info[name] = (tuple(shape), elem)
        return name

    def const(self, value, dtype=np.float32) -> str:
        arr = np.asarray(value, dtype=dtype)
        name = self.add_initializer(self.fresh("c"), arr, arr.dtype)
        self.info[name] = (arr.shape, helper.np_dtype_to_tensor_dtype(arr.dtype))
        return name

    def shape(self, t: str) -> tuple[int, ...]:
        return self.info[t][0]

    def elem(self, t: str) -> int:
        return self.info[t][1]

    def add(self, op: str, inputs: list[str], n_out: int = 1, like: str | None = None,
            **attrs) -> list[str] | None:
        """Append a node; ``None`` (and nothing appended) if shape inference rejects it or
        leaves an output shape unknown. ``like`` names a value whose shape and type the
        (single) output has, for function ops that ONNX shape inference does not expand
        (GroupNormalization)."""
        outs = [self.fresh(op.lower()[:6]) for _ in range(n_out)]
        try:
            node = helper.make_node(op, inputs, outs, **attrs)
        except ValueError:  # e.g. an empty perm for a rank-0 value
            return None
        model = make_model(
            "probe", [*self.nodes, node], self.inputs, [], self.initializers, opset=self.opset,
            ir_version=self.ir_version, check=False,
            # known shapes, so values after a function op inference leaves untyped are typed
            graph_value_info=[value_info(p, list(self.shape(p)), self.elem(p))
                              for p in self.produced])
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        except Exception:  # noqa: BLE001 - onnx raises several untyped errors
            return None
        found = {vi.name: vi for vi in inferred.graph.value_info}
        infos = {}
        for o in outs:
            vi = found.get(o)
            if vi is None and like is not None:
                infos[o] = self.info[like]
                continue
            if vi is None or not vi.type.HasField("tensor_type"):
                return None
            dims = vi.type.tensor_type.shape.dim
            if not all(d.HasField("dim_value") for d in dims):
                return None
            shape = tuple(d.dim_value for d in dims)
            if math.prod(shape) > MAX_ELEMENTS or math.prod(shape) == 0:
                return None
            infos[o] = (shape, vi.type.tensor_type.elem_type)
        self.nodes.append(node)
        self.info.update(infos)
        self.produced.extend(outs)
        return outs

    def add1(self, op: str, inputs: list[str], like: str | None = None,
             **attrs) -> str | None:
        outs = self.add(op, inputs, like=like, **attrs)
        return outs[0] if outs else None


# ---------------------------------------------------------------------------------------------
# Emitters: each reads tensor ``t`` (float) and returns the tensor to continue from, or None.
# ---------------------------------------------------------------------------------------------
UNARY = ["Relu", "Sigmoid", "Tanh", "Exp", "Log", "Erf", "Neg", "Abs", "Sqrt", "Reciprocal",
         "Floor", "Ceil", "Round", "Sin", "Cos", "Softplus", "Softsign", "Sign", "LeakyRelu",
         "Elu", "Selu", "HardSigmoid", "HardSwish", "Atan", "IsNaN", "IsInf", "Identity"]
TRANSCENDENTAL = ["Exp", "Tanh", "Sigmoid", "Erf", "Log", "Softmax"]


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _axis(rng, rank: int) -> int:
    """A random axis, negative half the time (both spellings must work)."""
    ax = int(rng.integers(rank))
    return ax - rank if rng.random() < 0.3 else ax


def emit_unary(b: Builder, t: str):
    op = _pick(b.rng, UNARY)
    out = b.add1(op, [t])
    if out and b.elem(out) == BOOL:  # IsNaN/IsInf: back to float through Where
        out = b.add1("Where", [out, b.const(1.5), t])
    return out


def emit_chain(b: Builder, t: str):
    """A chain of transcendental operators (issue 17 items 3 and 4)."""
    for _ in range(int(b.rng.integers(2, 6))):
        op = _pick(b.rng, TRANSCENDENTAL)
        attrs = {"axis": -1} if op == "Softmax" else {}
        t = b.add1(op, [t], **attrs) or t
    return t


def emit_long_chain(b: Builder, t: str):
    """6-9 chained Tanh/Sigmoid/Erf: compile time exploded with chain length (issue 17 item
    4), so these cases are the ones the per-case time limit exists for. Drawn rarely."""
    for _ in range(int(b.rng.integers(6, 10))):
        t = b.add1(_pick(b.rng, ["Tanh", "Tanh", "Sigmoid", "Erf"]), [t]) or t
    return t


def emit_anchor_pair(b: Builder, t: str):
    """Two Many-to-Many anchors with an optional elementwise op between them (MatMul/Gemm ->
    Abs -> ReduceLogSumExp/Softmax/MatMul): the cells ``table3`` overrides decide (item 5)."""
    first = emit_matmul(b, t) if b.rng.random() < 0.6 else emit_gemm(b, t)
    if first is None:
        return None
    mid = b.add1(_pick(b.rng, ["Abs", "Relu", "Tanh", "Neg"]), [first]) \
        if b.rng.random() < 0.7 else first
    mid = mid or first
    r = len(b.shape(mid))
    kind = _pick(b.rng, ["reduce", "softmax", "matmul"])
    if kind == "reduce":
        return b.add1(_pick(b.rng, ["ReduceLogSumExp", "ReduceSum", "ReduceMax", "ReduceMean"]),
                      [mid, b.const([r - 1], np.int64)], keepdims=int(b.rng.integers(2)))
    if kind == "softmax":
        return b.add1("Softmax", [mid], axis=-1)
    return emit_matmul(b, mid)


def _partner(b: Builder, t: str):
    """A float tensor or constant that broadcasts with ``t``."""
    sh = b.shape(t)
    cands = [p for p in b.produced + [vi.name for vi in b.inputs]
             if p != t and b.elem(p) == FLOAT and _broadcasts(sh, b.shape(p))]
    if cands and b.rng.random() < 0.5:
        return _pick(b.rng, cands)
    choices = [(), (sh[-1],) if sh else (), sh]
    if len(sh) >= 2:
        choices.append((sh[-2], 1))
        choices.append(tuple(1 if i != 1 else d for i, d in enumerate(sh)))
    return b.const(b.rng.standard_normal(_pick(b.rng, choices)))


def _broadcasts(a, c) -> bool:
    if len(c) > len(a):
        return False
    return all(y in (1, x) for x, y in zip(a[::-1], c[::-1]))


def emit_binary(b: Builder, t: str):
    op = _pick(b.rng, ["Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "Sum", "Mean"])
    p = _partner(b, t)
    if op in ("Div", "Pow"):  # keep divisors away from 0 and bases positive (finite inputs)
        p = b.add1("Add", [b.add1("Abs", [p]) or p, b.const(0.5)]) or p
        if op == "Pow":
            t, p = b.add1("Add", [b.add1("Abs", [t]) or t, b.const(0.1)]) or t, b.const(
                b.rng.uniform(0.5, 2.0))
    operands = [t, p] if b.rng.random() < 0.7 else [p, t]
    return b.add1(op, operands)


def emit_where(b: Builder, t: str):
    op = _pick(b.rng, ["Greater", "Less", "Equal", "GreaterOrEqual"])
    cond = b.add1(op, [t, b.const(0.0)])
    if cond is None:
        return None
    if b.rng.random() < 0.3:
        cond = b.add1("Not", [cond]) or cond
    return b.add1("Where", [cond, t, _partner(b, t)])


REDUCE = ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean", "ReduceLogSumExp", "ReduceProd",
          "ReduceSumSquare", "ReduceL2"]


def emit_reduce(b: Builder, t: str):
    r = len(b.shape(t))
    op = _pick(b.rng, REDUCE)
    n_axes = int(b.rng.integers(1, r + 1)) if r else 0
    axes = sorted(b.rng.choice(r, n_axes, replace=False).tolist()) if r else []
    keep = int(b.rng.integers(2))
    inputs = [t, b.const(axes, np.int64)] if axes or b.rng.random() < 0.5 else [t]
    out = b.add1(op, inputs, keepdims=keep)
    if out and b.rng.random() < 0.4 and keep:  # broadcast back: x - reduce(x)
        out = b.add1(_pick(b.rng, ["Sub", "Add", "Mul"]), [t, out]) or out
    return out


def emit_argmax(b: Builder, t: str):
    r = len(b.shape(t))
    if not r:
        return None
    idx = b.add1(_pick(b.rng, ["ArgMax", "ArgMin"]), [t], axis=_axis(b.rng, r),
                 keepdims=int(b.rng.integers(2)))
    return b.add1("Cast", [idx], to=FLOAT) if idx else None


def emit_softmax(b: Builder, t: str):
    r = len(b.shape(t))
    if not r:
        return None
    return b.add1(_pick(b.rng, ["Softmax", "LogSoftmax"]), [t], axis=_axis(b.rng, r))


def emit_cumsum(b: Builder, t: str):
    """CumSum, then (usually) an elementwise operator (issue 17 item 2)."""
    r = len(b.shape(t))
    if not r:
        return None
    out = b.add1("CumSum", [t, b.const(_axis(b.rng, r), np.int64)],
                 exclusive=int(b.rng.integers(2)), reverse=int(b.rng.integers(2)))
    if out and b.rng.random() < 0.7:
        out = b.add1(_pick(b.rng, ["Relu", "Sigmoid", "Neg", "Sin"]), [out]) or out
    return out


def emit_gather(b: Builder, t: str):
    """Gather with constant indices: a scalar (drops the axis), a list, negative entries."""
    sh = b.shape(t)
    if not sh:
        return None
    ax = int(b.rng.integers(len(sh)))
    d = sh[ax]
    kind = b.rng.integers(3)
    if kind == 0:
        idx = b.const(int(b.rng.integers(-d, d)), np.int64)
    elif kind == 1:
        idx = b.const(b.rng.integers(-d, d, int(b.rng.integers(1, 4))), np.int64)
    else:
        idx = b.const(b.rng.integers(0, d, (2, 2)), np.int64)
    return b.add1("Gather", [t, idx], axis=ax)


def emit_gather_elements(b: Builder, t: str):
    sh = b.shape(t)
    if not sh:
        return None
    ax = int(b.rng.integers(len(sh)))
    idx = b.const(b.rng.integers(0, sh[ax], sh), np.int64)
    return b.add1("GatherElements", [t, idx], axis=ax)


def emit_slice(b: Builder, t: str):
    """Slice, often to one element on some axes (a size-1 axis)."""
    sh = b.shape(t)
    if not sh:
        return None
    axes = sorted(b.rng.choice(len(sh), int(b.rng.integers(1, len(sh) + 1)), replace=False))
    starts, ends, steps = [], [], []
    for ax in axes:
        d = sh[ax]
        s = int(b.rng.integers(d))
        if b.rng.random() < 0.5:  # one element
            starts.append(s), ends.append(s + 1), steps.append(1)
        elif b.rng.random() < 0.3 and d > 1:  # reversed
            starts.append(d - 1), ends.append(-d - 1), steps.append(-int(b.rng.integers(1, 3)))
        else:
            starts.append(s), ends.append(d), steps.append(int(b.rng.integers(1, 3)))
    return b.add1("Slice", [t, b.const(starts, np.int64), b.const(ends, np.int64),
                            b.const([int(a) for a in axes], np.int64),
                            b.const(steps, np.int64)])


def emit_pad(b: Builder, t: str):
    sh = b.shape(t)
    if not sh:
        return None
    mode = _pick(b.rng, ["constant", "reflect", "edge"])
    pads = []
    for _ in range(2):
        for d in sh:
            hi = min(2, d - 1) if mode == "reflect" else 2
            pads.append(int(b.rng.integers(0, hi + 1)) if hi > 0 else 0)
    inputs = [t, b.const(pads, np.int64)]
    if mode == "constant" and b.rng.random() < 0.5:
        inputs.append(b.const(np.float32(b.rng.standard_normal())))
    return b.add1("Pad", inputs, mode=mode)


def emit_resize(b: Builder, t: str):
    sh = b.shape(t)
    if len(sh) not in (3, 4):
        return None
    mode = _pick(b.rng, ["nearest", "linear"])
    ctm = _pick(b.rng, ["asymmetric", "half_pixel", "align_corners"] if mode == "linear"
                else ["asymmetric", "half_pixel"])
    scales = [1.0, 1.0] + [float(_pick(b.rng, [2.0, 0.5, 1.5])) for _ in sh[2:]]
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm}
    if mode == "nearest":
        attrs["nearest_mode"] = _pick(b.rng, ["floor", "round_prefer_floor"])
    return b.add1("Resize", [t, "", b.const(scales)], **attrs)


def emit_norm(b: Builder, t: str):
    sh = b.shape(t)
    kind = _pick(b.rng, ["LayerNormalization", "InstanceNormalization", "BatchNormalization",
                         "GroupNormalization", "MeanVarianceNormalization"])
    rng = b.rng
    if kind == "LayerNormalization":
        if not sh:
            return None
        ax = int(rng.integers(len(sh)))
        nshape = sh[ax:]
        return b.add1(kind, [t, b.const(1 + 0.1 * rng.standard_normal(nshape)),
                             b.const(0.1 * rng.standard_normal(nshape))],
                      axis=ax, epsilon=1e-5)
    if len(sh) < 3 and kind != "BatchNormalization" or len(sh) < 2:
        return None
    c = sh[1]
    if kind == "InstanceNormalization":
        return b.add1(kind, [t, b.const(1 + 0.1 * rng.standard_normal(c)),
                             b.const(0.1 * rng.standard_normal(c))], epsilon=1e-5)
    if kind == "BatchNormalization":
        return b.add1(kind, [t, b.const(1 + 0.1 * rng.standard_normal(c)),
                             b.const(0.1 * rng.standard_normal(c)),
                             b.const(0.1 * rng.standard_normal(c)),
                             b.const(0.5 + rng.random(c))], epsilon=1e-5)
    if kind == "MeanVarianceNormalization":
        return b.add1(kind, [t], axes=list(range(2, len(sh))))
    # GroupNormalization-18 (per-group scale) fails the checker as deprecated: the case moves
    # to opset 21 (per-channel scale), whose other operators mean what they meant in 18.
    b.require_opset(21)
    groups = [g for g in range(1, c + 1) if c % g == 0]
    g = _pick(rng, groups)
    return b.add1(kind, [t, b.const(1 + 0.1 * rng.standard_normal(c)),
                         b.const(0.1 * rng.standard_normal(c))], like=t, num_groups=g,
                  epsilon=1e-5)


def emit_matmul(b: Builder, t: str):
    """MatMul with a weight, with itself transposed (attention scores), or batched weights."""
    sh = b.shape(t)
    if len(sh) < 2:
        return None
    rng = b.rng
    kind = rng.integers(3)
    if kind == 0:
        n = int(rng.integers(1, 9))
        return b.add1("MatMul", [t, b.const(rng.standard_normal((sh[-1], n)) / sh[-1] ** 0.5)])
    if kind == 1:
        perm = list(range(len(sh)))
        perm[-1], perm[-2] = perm[-2], perm[-1]
        tt = b.add1("Transpose", [t], perm=perm)
        return b.add1("MatMul", [t, tt] if rng.random() < 0.5 else [tt, t]) if tt else None
    n = int(rng.integers(1, 6))
    w = rng.standard_normal((*sh[:-2], sh[-1], n)) / sh[-1] ** 0.5
    return b.add1("MatMul", [t, b.const(w)])


def emit_gemm(b: Builder, t: str):
    sh = b.shape(t)
    if len(sh) != 2:
        t = b.add1("Flatten", [t], axis=1 if len(sh) > 1 else 0)
        if t is None:
            return None
        sh = b.shape(t)
        if len(sh) != 2:
            return None
    rng = b.rng
    ta, tb = int(rng.integers(2)), int(rng.integers(2))
    if ta:
        t = b.add1("Transpose", [t], perm=[1, 0])
        if t is None:
            return None
    k = sh[1]
    n = int(rng.integers(1, 9))
    w = rng.standard_normal((n, k) if tb else (k, n)) / k ** 0.5
    inputs = [t, b.const(w)]
    if rng.random() < 0.6:
        inputs.append(b.const(rng.standard_normal(_pick(rng, [(n,), (1, n), (sh[0], n)]))))
    return b.add1("Gemm", inputs, transA=ta, transB=tb, alpha=float(_pick(rng, [1.0, 0.5])),
                  beta=float(_pick(rng, [1.0, 2.0])))


def emit_conv(b: Builder, t: str):
    """Conv (1-D/2-D; grouped, depthwise, strided, dilated, padded) or ConvTranspose."""
    sh = b.shape(t)
    if len(sh) not in (3, 4):
        return None
    rng = b.rng
    cin, spatial = sh[1], sh[2:]
    nd = len(spatial)
    kind = _pick(rng, ["dense", "dense", "grouped", "depthwise", "transpose", "wide",
                        "wide"])
    if kind == "wide":
        return _emit_wide_conv(b, t)
    k = [int(_pick(rng, [1, 2, 3])) for _ in range(nd)]
    k = [min(kk, s) for kk, s in zip(k, spatial)]
    strides = [int(_pick(rng, [1, 1, 2])) for _ in range(nd)]
    dil = [int(_pick(rng, [1, 1, 2])) if kk * 2 - 1 <= s else 1 for kk, s in zip(k, spatial)]
    pads = [int(rng.integers(0, kk)) for kk in k] * 2
    if kind == "transpose":
        cout = int(rng.integers(1, 5))
        w = rng.standard_normal((cin, cout, *k)) / (cin * math.prod(k)) ** 0.5
        inputs = [t, b.const(w)]
        if rng.random() < 0.5:
            inputs.append(b.const(0.1 * rng.standard_normal(cout)))
        return b.add1("ConvTranspose", inputs, kernel_shape=k, strides=strides, pads=pads,
                      output_padding=[int(rng.integers(s)) for s in strides])
    if kind == "depthwise":
        group, cout = cin, cin * int(_pick(rng, [1, 2]))
    elif kind == "grouped":
        divs = [g for g in range(2, cin + 1) if cin % g == 0]
        if not divs:
            return None
        group = _pick(rng, divs)
        cout = group * int(rng.integers(1, 3))
    else:
        group, cout = 1, int(rng.integers(1, 9))
    w = rng.standard_normal((cout, cin // group, *k)) / (cin // group * math.prod(k)) ** 0.5
    inputs = [t, b.const(w)]
    if rng.random() < 0.6:
        inputs.append(b.const(0.1 * rng.standard_normal(cout)))
    return b.add1("Conv", inputs, kernel_shape=k, strides=strides, dilations=dil, pads=pads,
                  group=group)


def _emit_wide_conv(b: Builder, t: str):
    """A 1×1 Conv widening ``t`` to 48–1024 channels per group, then a k×k Conv (one or two
    groups) whose reduction spans several of the packed GEMM's K blocks and whose groups fill
    its micro-kernel: the paths small channel counts never reach (a QDQ conv's int8 epilogue
    keeping float32 partial sums between K blocks; one GEMM per group), both found by the
    zoo's QDQ ResNet-18 and wav2vec2, not by the fuzzer."""
    rng = b.rng
    batch, cin, *spatial = b.shape(t)
    groups = int(_pick(rng, [1, 2]))
    per_group = min(1024, MAX_ELEMENTS // (groups * batch * math.prod(spatial)) // 16 * 16)
    if per_group < 48:
        return None
    wide = groups * per_group
    w = rng.standard_normal((wide, cin, *[1] * len(spatial))) / cin ** 0.5
    x = b.add1("Conv", [t, b.const(w)], kernel_shape=[1] * len(spatial))
    if x is None:
        return None
    k = [3] * len(spatial)  # padded by 1: a 3-tap window even over a 1-wide axis
    cout = groups * int(_pick(rng, [16, 32]))
    w = rng.standard_normal((cout, per_group, *k)) / (per_group * math.prod(k)) ** 0.5
    return b.add1("Conv", [x, b.const(w), b.const(0.1 * rng.standard_normal(cout))],
                  kernel_shape=k, pads=[1] * 2 * len(k), group=groups)



def emit_gemm_pair(b: Builder, t: str):
    """Two or three GEMMs that one block can hold (under Table 3's M2M→M2M green, which
    :func:`draw_case` sets with them): a 1×1 conv then a padded k×k conv (one GEMM per group,
    1–3 groups), a conv of 2–3 groups alone (one GEMM per group and their concat), MatMul →
    activation → MatMul, two MatMuls of one input combined (SwiGLU's gate and up), Gemm →
    Gemm. The conv GEMMs' results are buffers of one name (``matmul_packed``); two of them in
    one block sent one GEMM's nest to both write-backs (fuzz seeds 1908, 2274)."""
    rng = b.rng
    sh = b.shape(t)
    kind = _pick(rng, ["conv_conv", "conv_conv", "grouped", "matmul_matmul", "gate_up",
                       "gemm_gemm"])
    if kind in ("conv_conv", "grouped"):
        if len(sh) not in (3, 4):
            kind = "matmul_matmul"
        elif kind == "grouped":
            groups = int(_pick(rng, [2, 3]))
            per = int(_pick(rng, [8, 16, 48]))
            spatial = sh[2:]
            k = [min(3, s) for s in spatial]
            w = rng.standard_normal((groups * per, sh[1], *[1] * len(spatial))) / sh[1] ** 0.5
            x = b.add1("Conv", [t, b.const(w)], kernel_shape=[1] * len(spatial))
            if x is None:
                return None
            cout = groups * int(_pick(rng, [4, 16]))
            w = rng.standard_normal((cout, per, *k)) / (per * math.prod(k)) ** 0.5
            return b.add1("Conv", [x, b.const(w)], kernel_shape=k,
                          pads=[kk // 2 for kk in k] * 2, group=groups)
        else:
            groups = int(_pick(rng, [1, 1, 2, 3]))
            spatial = sh[2:]
            per = int(_pick(rng, [4, 16, 64]))
            w = rng.standard_normal((groups * per, sh[1], *[1] * len(spatial))) / sh[1] ** 0.5
            x = b.add1("Conv", [t, b.const(w), b.const(0.1 * rng.standard_normal(groups * per))],
                       kernel_shape=[1] * len(spatial))
            if x is None:
                return None
            if rng.random() < 0.5:
                x = b.add1(_pick(rng, ["Relu", "Sigmoid", "Abs"]), [x]) or x
            k = [int(_pick(rng, [1, 3])) for _ in spatial]
            cout = groups * int(_pick(rng, [2, 8, 16]))
            w = rng.standard_normal((cout, per, *k)) / (per * math.prod(k)) ** 0.5
            return b.add1("Conv", [x, b.const(w)], kernel_shape=k,
                          pads=[kk // 2 for kk in k] * 2, group=groups)
    if len(sh) < 2:
        return None
    kdim = sh[-1]
    if kind == "gemm_gemm":
        t = b.add1("Flatten", [t], axis=1) if len(sh) != 2 else t
        if t is None:
            return None
        kdim = b.shape(t)[1]
        hidden = int(_pick(rng, [8, 16, 40]))
        x = b.add1("Gemm", [t, b.const(rng.standard_normal((hidden, kdim)) / kdim ** 0.5),
                            b.const(0.1 * rng.standard_normal(hidden))], transB=1)
        if x is None:
            return None
        n = int(_pick(rng, [3, 16, 24]))
        return b.add1("Gemm", [x, b.const(rng.standard_normal((hidden, n)) / hidden ** 0.5)])
    hidden = int(_pick(rng, [8, 16, 40]))
    wa = rng.standard_normal((kdim, hidden)) / kdim ** 0.5
    if kind == "gate_up":
        gate = b.add1("MatMul", [t, b.const(wa)])
        up = b.add1("MatMul", [t, b.const(rng.standard_normal((kdim, hidden)) / kdim ** 0.5)])
        if gate is None or up is None:
            return None
        act = b.add1(_pick(rng, ["Sigmoid", "Tanh", "Relu"]), [gate])
        return b.add1(_pick(rng, ["Mul", "Add"]), [act or gate, up])
    x = b.add1("MatMul", [t, b.const(wa)])
    if x is None:
        return None
    x = b.add1(_pick(rng, ["Relu", "Tanh", "Neg"]), [x]) or x
    n = int(_pick(rng, [4, 16, 24]))
    return b.add1("MatMul", [x, b.const(rng.standard_normal((hidden, n)) / hidden ** 0.5)])


def emit_pool(b: Builder, t: str):
    sh = b.shape(t)
    if len(sh) not in (3, 4):
        return None
    op = _pick(b.rng, ["MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"])
    if op.startswith("Global"):
        return b.add1(op, [t])
    nd = len(sh) - 2
    k = [min(int(_pick(b.rng, [2, 3])), s) for s in sh[2:]]
    attrs = {"kernel_shape": k, "strides": [int(_pick(b.rng, [1, 2])) for _ in range(nd)]}
    if op == "AveragePool":
        attrs["count_include_pad"] = int(b.rng.integers(2))
        attrs["pads"] = [int(b.rng.integers(0, kk)) for kk in k] * 2
    return b.add1(op, [t], **attrs)


def emit_reorg(b: Builder, t: str):
    """Reshape, Flatten, Transpose, Squeeze/Unsqueeze, Expand, Tile, DepthToSpace."""
    sh = b.shape(t)
    rng = b.rng
    op = _pick(rng, ["Reshape", "Flatten", "Transpose", "Unsqueeze", "Squeeze", "Expand",
                     "Tile"])
    if op == "Reshape":
        n = math.prod(sh)
        divs = [d for d in range(1, n + 1) if n % d == 0]
        d = _pick(rng, divs)
        new = [d, n // d] if rng.random() < 0.6 else [1, d, -1]
        return b.add1("Reshape", [t, b.const(new, np.int64)])
    if op == "Flatten":
        return b.add1("Flatten", [t], axis=int(rng.integers(len(sh) + 1)))
    if op == "Transpose":
        return b.add1("Transpose", [t], perm=[int(p) for p in rng.permutation(len(sh))])
    if op == "Unsqueeze":
        return b.add1("Unsqueeze", [t, b.const([_axis(rng, len(sh) + 1)], np.int64)])
    if op == "Squeeze":
        ones = [i for i, d in enumerate(sh) if d == 1]
        return b.add1("Squeeze", [t, b.const([_pick(rng, ones)], np.int64)]) if ones else None
    if op == "Expand":
        target = [d if d != 1 else int(rng.integers(1, 4)) for d in sh]
        if rng.random() < 0.3:
            target = [2, *target]
        return b.add1("Expand", [t, b.const(target, np.int64)])
    reps = [int(_pick(rng, [1, 1, 2])) for _ in sh]
    return b.add1("Tile", [t, b.const(reps, np.int64)])


def emit_concat(b: Builder, t: str):
    sh = b.shape(t)
    if not sh:
        return None
    ax = int(b.rng.integers(len(sh)))
    other = [p for p in b.produced + [vi.name for vi in b.inputs]
             if b.elem(p) == FLOAT and len(b.shape(p)) == len(sh)
             and all(x == y for i, (x, y) in enumerate(zip(sh, b.shape(p))) if i != ax)]
    if ax == 0 and b.elem(t) == FLOAT and b.rng.random() < 0.3:
        # a constant block along axis 0, as a decode step appends to its cache: with a
        # symbolic dim 0 (make_symbolic) the result's extent is ``N + rows``
        p = b.const(b.rng.standard_normal([int(b.rng.integers(1, 4)), *sh[1:]]))
    else:
        p = _pick(b.rng, other)  # t itself qualifies: concat(t, t) reads one value twice
    return b.add1("Concat", [t, p] if b.rng.random() < 0.5 else [p, t], axis=ax)


def emit_split(b: Builder, t: str):
    """Split (multi-output); both halves are used, so multi-output lowering is exercised."""
    sh = b.shape(t)
    axes = [i for i, d in enumerate(sh) if d >= 2]
    if not axes:
        return None
    ax = _pick(b.rng, axes)
    first = int(b.rng.integers(1, sh[ax]))
    outs = b.add("Split", [t, b.const([first, sh[ax] - first], np.int64)], n_out=2, axis=ax)
    if not outs:
        return None
    return outs[0] if b.rng.random() < 0.5 else outs[1]


def emit_topk(b: Builder, t: str):
    sh = b.shape(t)
    if not sh:
        return None
    ax = int(b.rng.integers(len(sh)))
    k = int(b.rng.integers(1, sh[ax] + 1))
    outs = b.add("TopK", [t, b.const([k], np.int64)], n_out=2, axis=ax,
                 largest=int(b.rng.integers(2)), sorted=1)
    if not outs:
        return None
    if b.rng.random() < 0.5:  # use the indices too: values + float(indices)
        idx = b.add1("Cast", [outs[1]], to=FLOAT)
        return b.add1("Add", [outs[0], idx]) if idx else outs[0]
    return outs[0]


def emit_cast(b: Builder, t: str):
    """Round trips through float16, int64 (finite inputs only: float->int of NaN/inf is UB)
    and bool."""
    kind = _pick(b.rng, ["f16", "int", "bool", "castlike"])
    if kind == "int" and b.special:
        kind = "f16"
    if kind == "f16":
        h = b.add1("Cast", [t], to=FLOAT16)
        if h is None:
            return None
        h = b.add1(_pick(b.rng, ["Relu", "Neg", "Abs", "Tanh", "Sigmoid"]), [h]) or h
        return b.add1("Cast", [h], to=FLOAT)
    if kind == "int":
        scaled = b.add1("Mul", [t, b.const(4.0)])
        i = b.add1("Cast", [scaled], to=INT64) if scaled else None
        if i is None:
            return None
        i = b.add1(_pick(b.rng, ["Add", "Mul", "Sub", "Div", "Mod"]),
                   [i, b.const(int(b.rng.integers(1, 4)), np.int64)]) or i
        return b.add1("Cast", [i], to=FLOAT)
    if kind == "castlike":
        return b.add1("CastLike", [t, b.const(0.0)])
    g = b.add1("Cast", [t], to=BOOL)
    return b.add1("Cast", [g], to=FLOAT) if g else None


def emit_index_arith(b: Builder, t: str):
    """int64 index arithmetic: the decoder position-ids pattern ``CumSum(mask) * mask - 1``
    (issue 17 item 2) or arithmetic on bounded indices feeding a Gather."""
    sh = b.shape(t)
    if not sh:
        return None
    rng = b.rng
    if rng.random() < 0.5:
        mask = b.input(sh[-1:], INT64, hint="bound=2")
        pos = b.add1("CumSum", [mask, b.const(0, np.int64)])
        pos = b.add1("Mul", [pos, mask]) if pos else None
        pos = b.add1("Sub", [pos, b.const(1, np.int64)]) if pos else None
        f = b.add1("Cast", [pos], to=FLOAT) if pos else None
        return b.add1("Add", [t, f]) if f else None
    d = sh[0]
    idx = b.input([int(rng.integers(1, 4))], INT64, hint=f"bound={d}")
    j = b.add1("Add", [idx, b.const(d, np.int64)])  # in [d, 2d): valid after Mod
    j = b.add1("Mod", [j, b.const(d, np.int64)]) if j else None
    return b.add1("Gather", [t, j], axis=0) if j else None


def emit_attention(b: Builder, t: str):
    """Self-attention of a packed Q/K/V projection (one ``Split`` of one MatMul, so the fused
    block has a single input: a kernel without a root block failed TVM's Relax lowering), with
    a rotate-half on Q and K (RoPE's index arithmetic once fell back silently), an optional
    constant causal mask (read back as ``j > i`` by the CPU template) and the products written
    either as ``MatMul`` or as torch.export's ``bmm`` (Expand and Reshape around each product),
    the softmax optionally torch.export's safe one (a row of only -inf gives 0)."""
    sh = b.shape(t)
    if len(sh) != 3:
        return None
    rng = b.rng

    def node(op, inputs, **attrs):  # any step shape inference rejects ends the family
        out = b.add1(op, inputs, **attrs) if all(i is not None for i in inputs) else None
        if out is None:
            raise ValueError(f"attention: {op} rejected")
        return out

    def ints(values):
        return b.const(values, np.int64)

    _, seq, width = sh
    heads, dim = int(_pick(rng, [1, 2])), int(_pick(rng, [2, 4]))
    hd = heads * dim
    qkv = node("MatMul", [t, b.const(rng.standard_normal((width, 3 * hd)) / width ** 0.5)])
    parts = b.add("Split", [qkv, ints([hd] * 3)], n_out=3, axis=2)
    if not parts:
        return None
    q, k, v = (node("Transpose", [node("Reshape", [p, ints([0, 0, heads, dim])])],
                    perm=[0, 2, 1, 3]) for p in parts)
    if rng.random() < 0.5:  # rotate-half: cat(-x[..., d/2:], x[..., :d/2])
        half = dim // 2
        q, k = (node("Concat", [
            node("Neg", [node("Slice", [x, ints([half]), ints([dim]), ints([3])])]),
            node("Slice", [x, ints([0]), ints([half]), ints([3])])], axis=3) for x in (q, k))
    mask = None
    if rng.random() < 0.5:  # the lowest float: the GPU kernel's running max once started above
        value = _pick(rng, [-1e9, -np.inf, np.finfo(np.float32).min])
        mask = np.triu(np.full((seq, seq), value, np.float32), 1)
    bmm = rng.random() < 0.5
    safe = rng.random() < 0.5  # torch.export's _safe_softmax (relay_passes/safe_softmax.py)
    if mask is not None and seq > 1 and (safe or np.isfinite(mask[0, 1])):
        # a query row masked entirely: uniform weights by a finite value, 0 from a safe
        # softmax by -inf (softmax alone: NaN)
        mask[0, :] = mask[0, 1]

    def matmul(x, y):
        """``x @ y``, or as torch.export writes it (``bmm``): each operand expanded to its own
        shape and reshaped ``[b, heads, m, n] → [b·heads, m, n]``, the product reshaped back."""
        if not bmm:
            return node("MatMul", [x, y])
        lead = list(b.shape(x)[:2])
        flat = [node("Reshape", [node("Expand", [t, ints(b.shape(t))]),
                                 ints([lead[0] * lead[1], *b.shape(t)[2:]])]) for t in (x, y)]
        prod = node("MatMul", flat)
        return node("Reshape", [prod, ints(lead + list(b.shape(prod)[1:]))])

    scores = matmul(q, node("Transpose", [k], perm=[0, 1, 3, 2]))
    scores = node("Mul", [scores, b.const(dim ** -0.5)])
    if mask is not None:
        scores = node("Add", [scores, b.const(mask)])
    probs = node("Softmax", [scores], axis=-1)
    if safe:  # where(no score above -inf in the row, 0, softmax)
        finite = node("Not", [node("Equal", [scores, b.const(np.float32(-np.inf))])])
        any_finite = node("ReduceMax", [node("Cast", [finite], to=TensorProto.INT8),
                                        ints([-1])], keepdims=1)
        empty = node("Not", [node("Cast", [any_finite], to=TensorProto.BOOL)])
        probs = node("Where", [empty, b.const(np.float32(0.0)), probs])
    out = node("Transpose", [matmul(probs, v)], perm=[0, 2, 1, 3])
    return node("Reshape", [out, ints([0, 0, hd])])

EMITTERS: dict[str, Callable[[Builder, str], str | None]] = {
    "unary": emit_unary, "chain": emit_chain, "long_chain": emit_long_chain,
    "anchor_pair": emit_anchor_pair,
    "binary": emit_binary, "where": emit_where,
    "reduce": emit_reduce, "argmax": emit_argmax, "softmax": emit_softmax,
    "cumsum": emit_cumsum, "gather": emit_gather, "gather_elements": emit_gather_elements,
    "slice": emit_slice, "pad": emit_pad, "resize": emit_resize, "norm": emit_norm,
    "matmul": emit_matmul, "gemm": emit_gemm, "conv": emit_conv, "pool": emit_pool,
    "reorg": emit_reorg, "concat": emit_concat, "split": emit_split, "topk": emit_topk,
    "cast": emit_cast, "index_arith": emit_index_arith, "attention": emit_attention,
}
# emit_gemm_pair is not among them: draw_case appends it on a share of its own (drawn from
# its own stream), so that adding it left every other seed's graph as it was


def _selection_output(b: Builder, t: str) -> str | None:
    """A one-element selection of ``t`` used as a graph output (issue 17 item 1)."""
    sh = b.shape(t)
    if not sh:
        return None
    if b.rng.random() < 0.5:
        ax = int(b.rng.integers(len(sh)))
        return b.add1("Gather", [t, b.const(int(b.rng.integers(sh[ax])), np.int64)], axis=ax)
    axes = sorted(b.rng.choice(len(sh), int(b.rng.integers(1, len(sh) + 1)), replace=False))
    starts = [int(b.rng.integers(sh[a])) for a in axes]
    return b.add1("Slice", [t, b.const(starts, np.int64),
                            b.const([s + 1 for s in starts], np.int64),
                            b.const([int(a) for a in axes], np.int64)])


def generate_model(seed: int, special: bool = False, max_nodes: int = 12,
                   gemm_pair: np.random.Generator | None = None) -> onnx.ModelProto:
    """A random, checker-valid ONNX model reproducible from ``seed``.

    ``special`` says the inputs will carry NaN/inf: float->int casts (undefined behaviour in
    C, so in both compilers) are then not drawn. ``gemm_pair``: a random stream of its own
    with which :func:`emit_gemm_pair` appends two or three GEMMs to the last value (the rest
    of the graph is the seed's graph without them).
    """
    rng = np.random.default_rng([seed, 17])
    b = Builder(rng)
    b.special = special
    rank = int(_pick(rng, [2, 3, 3, 4, 4, 4]))
    shape = [int(_pick(rng, [1, 2, 3, 4, 5, 8])) for _ in range(rank)]
    if rank >= 3:
        shape[1] = int(_pick(rng, [1, 2, 3, 4, 6, 8]))
    x = b.input(shape)
    if rng.random() < 0.3:  # a second input, a broadcast partner
        b.input([d if rng.random() < 0.7 else 1 for d in shape])
    families = list(EMITTERS)
    heavy = ("unary", "binary", "reduce", "conv", "matmul", "gather", "slice", "norm")
    weights = np.array([3 if f in heavy else 0.25 if f == "long_chain" else 2
                        for f in families], float)
    target = int(rng.integers(3, max_nodes + 1))
    cur, tries = x, 0
    while len(b.nodes) < target and tries < 4 * max_nodes:
        tries += 1
        floats = [p for p in b.produced if b.elem(p) == FLOAT and b.shape(p)]
        if floats and rng.random() < 0.3:
            cur = _pick(rng, floats)  # branch from an earlier value: a DAG, not a chain
        fam = rng.choice(families, p=weights / weights.sum())
        if len(b.shape(cur)) in (3, 4) and rng.random() < 0.15:
            fam = _pick(rng, ["conv", "pool", "resize", "norm"])  # spatial ops need rank 3-4
        try:
            out = EMITTERS[fam](b, cur)
        except (IndexError, ValueError):  # an emitter met a shape it does not handle
            out = None
        if out is not None and b.elem(out) == FLOAT:
            cur = out
    if gemm_pair is not None:
        own, b.rng = b.rng, gemm_pair
        try:
            out = emit_gemm_pair(b, cur)
        except (IndexError, ValueError):
            out = None
        b.rng = own
        if out is not None and b.elem(out) == FLOAT:
            cur = out
    if not b.nodes:
        cur = b.add1("Relu", [x])
    outputs = [cur]
    # Outputs that are also consumed inside the graph, and one-element selections as outputs.
    read = {i for n in b.nodes for i in n.input}
    inner = [p for p in b.produced if p in read and p != cur]
    if inner and rng.random() < 0.4:
        outputs.append(_pick(rng, inner))
    if rng.random() < 0.35:
        src = _pick(rng, [p for p in b.produced if b.elem(p) == FLOAT and b.shape(p)] or [cur])
        sel = _selection_output(b, src)
        if sel:
            outputs.append(sel)
    for o in dict.fromkeys(outputs):
        b.add_output(o, list(b.shape(o)), b.elem(o))
    return b.model(prune=True)


def make_symbolic(model: onnx.ModelProto, axis: int = 0, name: str = "N") -> onnx.ModelProto:
    """The same model with dim ``axis`` of its first graph input named ``name`` (the feeds keep
    their concrete sizes; ``--symbolic-share``, the slow ``test_symbolic_run``). A graph that
    ties the dim to a constant size is rejected by stock TVM too: a ``skipped`` case."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name for t in out.graph.initializer}
    for vi in out.graph.input:
        if vi.name in inits:
            continue
        dims = vi.type.tensor_type.shape.dim
        if len(dims) > axis:
            dims[axis].dim_param = name
        break
    return out


#: Operators whose constant weight (input 1) and activation (input 0) a QDQ case quantizes.
QDQ_ANCHORS = ("Conv", "MatMul", "Gemm")


def _qdq_anchors(model: onnx.ModelProto, inits: dict) -> list:
    found = []
    for n in model.graph.node:
        if n.op_type not in QDQ_ANCHORS or len(n.input) < 2 or n.input[1] not in inits:
            continue
        w = inits[n.input[1]]
        trans_a = any(a.name == "transA" and a.i for a in n.attribute)
        if w.ndim >= 2 and w.dtype == np.float32 and not trans_a:
            found.append(n)
    return found


def _calibrate(model: onnx.ModelProto, names: list[str], seed: int) -> dict | None:
    """The float model's values of ``names`` on the case's own inputs (ONNX Runtime)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_empty_tensor_value_info(v)
                              for v in dict.fromkeys(names) if v not in known)
    try:
        import onnxruntime as ort

        sess = ort.InferenceSession(probe.SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        values = dict(zip([o.name for o in sess.get_outputs()],
                          sess.run(None, make_feeds(model, seed))))
    except Exception:  # noqa: BLE001 - no calibration, no QDQ case
        return None
    return values if all(np.isfinite(values[v]).all() for v in names) else None


class _QdqWriter:
    """Appends QDQ nodes and their int8/uint8 initializers to a copy of a graph."""

    def __init__(self, graph, signed: bool):
        self.graph, self.signed = graph, signed
        self.qtype = np.int8 if signed else np.uint8
        self.count = 0

    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"qdq_{stem}{self.count}"

    def const(self, value, dtype) -> str:
        name = self.fresh("c")
        self.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(value, dtype),
                                                                   name))
        return name

    def qparams(self, value) -> tuple[np.float32, int]:
        lo, hi = min(float(value.min()), 0.0), max(float(value.max()), 0.0)
        if self.signed:
            return np.float32(max(abs(lo), abs(hi)) / 127.0 or 1.0), 0
        scale = (hi - lo) / 255.0 or 1.0
        return np.float32(scale), int(np.clip(np.round(-lo / scale), 0, 255))

    def pair(self, name: str, value, out: str | None = None) -> tuple[list, str, float]:
        """QuantizeLinear → DequantizeLinear of ``name`` (the DequantizeLinear writes
        ``out``): the nodes, the dequantized name and the scale."""
        scale, zp = self.qparams(value)
        s, z = self.const(scale, np.float32), self.const(zp, self.qtype)
        q, dq = self.fresh("q"), out or self.fresh("dq")
        return [helper.make_node("QuantizeLinear", [name, s, z], [q]),
                helper.make_node("DequantizeLinear", [q, s, z], [dq])], dq, float(scale)

    def weight(self, w: np.ndarray, axis: int | None) -> tuple[onnx.NodeProto, str, object]:
        """``w`` as int8 through DequantizeLinear, per tensor (``axis`` None) or per channel."""
        out = self.fresh("w")
        if axis is None:
            s_w = np.float32(max(float(np.abs(w).max()), 1e-8) / 127)
            q = np.clip(np.round(w / s_w), -127, 127)
            return helper.make_node("DequantizeLinear", [
                self.const(q, np.int8), self.const(s_w, np.float32),
                self.const(0, np.int8)], [out]), out, s_w
        moved = np.moveaxis(np.abs(w), axis, 0).reshape(w.shape[axis], -1)
        s_w = (np.maximum(moved.max(axis=1), 1e-8) / 127).astype(np.float32)
        shape = [1] * w.ndim
        shape[axis] = -1
        q = np.clip(np.round(w / s_w.reshape(shape)), -127, 127)
        return helper.make_node("DequantizeLinear", [
            self.const(q, np.int8), self.const(s_w, np.float32),
            self.const(np.zeros(w.shape[axis]), np.int8)], [out], axis=axis), out, s_w

    def bias(self, b: np.ndarray, scale) -> tuple[onnx.NodeProto, str]:
        out = self.fresh("b")
        return helper.make_node("DequantizeLinear", [
            self.const(np.round(b / scale), np.int32), self.const(scale, np.float32),
            self.const(np.zeros(b.shape), np.int32)], [out], axis=0), out


def _with_nodes(out: onnx.ModelProto, nodes: list) -> onnx.ModelProto | None:
    """``out`` with ``nodes`` as its graph and only the initializers they read; None when the
    ONNX checker refuses the result."""
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    used = {i for n in out.graph.node for i in n.input}
    kept = [t for t in out.graph.initializer if t.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    try:
        onnx.checker.check_model(out, full_check=True)
    except Exception:  # noqa: BLE001 - the checker's own errors
        return None
    return out


def qdq_wrap(model: onnx.ModelProto, rng: np.random.Generator, seed: int
             ) -> onnx.ModelProto | None:
    """The model as ``onnxruntime.quantization.quantize_static`` writes it in QDQ format,
    around its Conv/MatMul/Gemm nodes with a constant weight: QuantizeLinear →
    DequantizeLinear on the activation and on the output, the weight int8 through
    DequantizeLinear (per tensor, or per output channel), a Conv/Gemm bias int32 with scale
    ``s_x · s_w``; activations int8 or uint8 (asymmetric). Scales come from the float model's
    values on the case's own inputs. None when nothing qualifies or calibration fails."""
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    anchors = _qdq_anchors(model, inits)
    if not anchors:
        return None
    values = _calibrate(model, [n.input[0] for n in anchors] + [n.output[0] for n in anchors],
                        seed)
    if values is None:
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    qdq = _QdqWriter(out.graph, signed=bool(rng.random() < 0.5))
    per_channel = bool(rng.random() < 0.5)
    names = {n.output[0] for n in anchors}
    nodes = []
    for node in list(out.graph.node):
        if node.output[0] not in names:
            nodes.append(node)
            continue
        pre, x_dq, s_x = qdq.pair(node.input[0], values[node.input[0]])
        w = inits[node.input[1]]
        trans_b = any(a.name == "transB" and a.i for a in node.attribute)
        axis = 0 if node.op_type == "Conv" or (node.op_type == "Gemm" and trans_b) \
            else w.ndim - 1
        w_node, w_dq, s_w = qdq.weight(w, axis if per_channel else None)
        pre.append(w_node)
        inputs = [x_dq, w_dq, *node.input[2:]]
        bias = inits.get(node.input[2]) if len(node.input) > 2 else None
        if node.op_type in ("Conv", "Gemm") and bias is not None and bias.ndim == 1:
            scale = (np.float32(s_x) * np.broadcast_to(s_w, bias.shape)).astype(np.float32)
            if np.all(scale > 0):
                b_node, inputs[2] = qdq.bias(bias, scale)
                pre.append(b_node)
        raw = qdq.fresh("f")
        anchor = helper.make_node(node.op_type, inputs, [raw], name=node.name)
        anchor.attribute.extend(node.attribute)
        post, _, _ = qdq.pair(raw, values[node.output[0]], out=node.output[0])
        nodes += [*pre, anchor, *post]
    return _with_nodes(out, nodes)


def weight_only_wrap(model: onnx.ModelProto, rng: np.random.Generator
                     ) -> onnx.ModelProto | None:
    """The model with the 2-D constant weights of its MatMul/Gemm nodes weight-only
    quantized: int8 (symmetric) or uint8 (a zero point per channel) through
    DequantizeLinear, one scale per output channel, activations left in float32 (the
    packed GEMM's int8 path, ``layout/weight_quant.py``). None when nothing qualifies."""
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    anchors = [n for n in _qdq_anchors(model, inits)
               if n.op_type != "Conv" and inits[n.input[1]].ndim == 2]
    if not anchors:
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    signed = bool(rng.random() < 0.5)
    writer = _QdqWriter(out.graph, signed=signed)
    names = {n.output[0] for n in anchors}
    nodes = []
    for node in list(out.graph.node):
        if node.output[0] in names:
            w = inits[node.input[1]]
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            axis = 0 if node.op_type == "Gemm" and trans_b else 1
            moved = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
            lo, hi = moved.min(axis=1), moved.max(axis=1)
            if signed:
                scale = np.maximum(np.maximum(-lo, hi), 1e-8) / 127
                zp = np.zeros(w.shape[axis])
            else:
                scale = np.maximum(hi - lo, 1e-8) / 255
                zp = np.clip(np.round(-lo / scale), 0, 255)
            shape = [1, 1]
            shape[axis] = -1
            q = np.round(w / scale.reshape(shape)) + zp.reshape(shape)
            q = np.clip(q, -127, 127) if signed else np.clip(q, 0, 255)
            deq = writer.fresh("w")
            nodes.append(helper.make_node("DequantizeLinear", [
                writer.const(q, writer.qtype), writer.const(scale, np.float32),
                writer.const(zp, writer.qtype)], [deq], axis=axis))
            node.input[1] = deq
        nodes.append(node)
    return _with_nodes(out, nodes)


def to_float16(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """The model with every float32 tensor in float16 (None where ONNX does not allow it:
    Resize's scales, an operator without fp16)."""
    try:
        return cast_model(model, "float16")
    except Exception:  # noqa: BLE001 - the checker's own errors
        return None


def draw_case(seed: int, target: str = "llvm", special_share: float = 0.3,
              option_share: float = 0.15, symbolic_share: float = 0.0, max_nodes: int = 12,
              fp16_share: float = 0.1, qdq_share: float = 0.3,
              weight_only_share: float = 0.15, gemm_block_share: float = 0.1):
    """The whole case of ``seed``: model, option set, input-value mode (and the symbolic hook);
    on ``qdq_share`` of the cases the Conv/MatMul/Gemm nodes are QDQ-wrapped (int8), on
    ``fp16_share`` the whole graph is cast to float16, on ``weight_only_share`` of the cases
    left in float32 the MatMul/Gemm weights are weight-only quantized (int8 per channel). On
    ``gemm_block_share`` the graph ends in two or three GEMMs (:func:`emit_gemm_pair`) and
    Table 3's M2M→M2M cell is green, so that one block holds them (found only under random
    Table 3 overrides before: seeds 1908 and 2274 of 550).

    Each part has its own random stream, so changing one share leaves the others' draws alone.
    """
    rng = np.random.default_rng([seed, 1])
    special = bool(rng.random() < special_share)
    options = draw_options(np.random.default_rng([seed, 2]), option_share)
    symbolic = bool(np.random.default_rng([seed, 3]).random() < symbolic_share)
    pair = np.random.default_rng([seed, 6])
    gemm_block = bool(pair.random() < gemm_block_share)
    model = generate_model(seed, special=special, max_nodes=max_nodes,
                           gemm_pair=pair if gemm_block else None)
    if gemm_block:
        table3 = dict(options.get("table3") or {})
        table3[("M2M", "M2M")] = "green"
        options["table3"] = table3
    precision = np.random.default_rng([seed, 4])
    float32 = model
    if not special and precision.random() < qdq_share:  # NaN to int8 is undefined
        model = qdq_wrap(model, precision, seed) or model
    elif precision.random() < fp16_share:
        model = to_float16(model) or model
    weight_only = np.random.default_rng([seed, 5])
    if model is float32 and weight_only.random() < weight_only_share:
        model = weight_only_wrap(model, weight_only) or model
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
              for vi in model.graph.input}
    if symbolic:
        model = make_symbolic(model)
    return Case(seed=seed, model=model, options=options, special=special, target=target,
                symbolic=symbolic, shapes=shapes)

"""Self-attention blocks in the shapes the exporters produce, built in code: the inputs of the
attention-fusion tests and of ``scripts/bench_attention.py``.

Each builder returns the attention of one layer, from the projected Q, K and V (or from the
hidden state, ``project=True``) to the merged heads, written node by node the way the PyTorch
exporter writes the model it is named after:

* ``bert``: heads split by Reshape/Transpose (K transposed straight to ``[b, h, d, s]``),
  ``Div`` by √d, an additive mask input ``[b, 1, 1, s]``, Softmax, MatMul, heads merged;
* ``gpt2``: Q/K/V from one Split, a causal mask built from the scores' own shape
  (``Trilu`` of ones, ``Cast`` to bool, ``Where(keep, s, -1e4·…)``), as older exports do;
* ``llama``: grouped-query attention: K and V have ``kv_heads`` heads, repeated to the query
  heads by ``Unsqueeze → Expand → Reshape`` (transformers' ``repeat_kv``), ``Mul`` by the
  scaling, a causal additive mask (``Trilu`` of ``min`` sized by ``Shape``), an fp32 Softmax
  between ``Cast``s when the model is fp16;
* ``vit``: no mask, ``Mul`` of Q by the scale before the MatMul;
* ``swin``: window attention with a relative-position bias gathered from its table (see
  :mod:`.swin` for the whole block).

``seq`` is an int or a name (a symbolic ``dim_param``). Masks and biases that an exporter
computes from the shape are computed in the graph, so one compiled module serves every length.
Weights come from a seeded generator; fp16 models keep fp16 inputs and outputs.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto

from .graph import GraphBuilder, value_info

__all__ = ["ATTENTION_MODELS", "attention_model", "bert_attention", "gpt2_attention",
           "llama_attention", "llama_decoder_layer", "swin_attention", "vit_attention"]

_ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
_NP = {"float32": np.float32, "float16": np.float16}


class _Builder(GraphBuilder):
    """Numbered names, seeded weights, constants in the model's dtype."""

    def __init__(self, name: str, dtype: str, seed: int):
        super().__init__(name)
        if dtype not in _ELEM:
            raise ValueError(f"dtype must be one of {sorted(_ELEM)}, got {dtype!r}")
        self.dtype = dtype
        self.elem = _ELEM[dtype]
        self.rng = np.random.default_rng(seed)
        self.tensors: set[str] = set()  # additive masks computed in the graph

    def const(self, value, dtype=None) -> str:
        dtype = dtype or _NP[self.dtype]
        return self.add_initializer(self.fresh("c"), np.asarray(value, dtype=dtype), dtype)

    def ints(self, value) -> str:
        return self.const(value, np.int64)

    def weight(self, n_in: int, n_out: int) -> str:
        return self.const(self.rng.standard_normal((n_in, n_out)) / math.sqrt(n_in))

    def node(self, op: str, *inputs: str, **attrs) -> str:
        return self.add_node(op, inputs, [self.fresh(op.lower())], **attrs)[0]

    def softmax(self, s: str, safe: bool = False) -> str:
        """Softmax over the last axis; ``safe``: PyTorch's ``_safe_softmax`` as torch.export
        decomposes it, a row of only ``-inf`` giving 0 instead of NaN."""
        p = self.node("Softmax", s, axis=-1)
        if not safe:
            return p
        finite = self.node("Not", self.node("Equal", s, self.const(-np.inf)))
        any_finite = self.node("ReduceMax", self.node("Cast", finite, to=TensorProto.INT8),
                               axes=[-1], keepdims=1)
        empty = self.node("Not", self.node("Cast", any_finite, to=TensorProto.BOOL))
        return self.node("Where", empty, self.const(0.0), p)

    def heads(self, t: str, heads: int, dim: int, perm) -> str:
        """``[b, s, heads·dim]`` → Reshape ``[b, s, heads, dim]`` → Transpose ``perm``."""
        r = self.node("Reshape", t, self.ints([0, 0, heads, dim]))
        return self.node("Transpose", r, perm=perm)

    def merge(self, ctx: str, width: int) -> str:
        """``[b, h, s, d]`` → Transpose → Reshape ``[b, s, h·d]`` (the heads merged)."""
        t = self.node("Transpose", ctx, perm=[0, 2, 1, 3])
        return self.node("Reshape", t, self.ints([0, 0, width]))

    def repeat_kv(self, t: str, rep: int, heads: int, head_dim: int) -> str:
        """transformers' ``repeat_kv``: ``[b, kv, s, d]`` unsqueezed to ``[b, kv, 1, s, d]``,
        expanded to ``[b, kv, rep, s, d]`` (sizes read by ``Shape``), reshaped to
        ``[b, heads, s, d]``."""
        if rep == 1:
            return t
        shape = self.node("Shape", t)
        dims = [self.node("Slice", shape, self.ints([i]), self.ints([i + 1])) for i in range(4)]
        target = self.node("Concat", dims[0], dims[1], self.ints([rep]), dims[2], dims[3],
                           axis=0)
        e = self.node("Expand", self.node("Unsqueeze", t, self.ints([2])), target)
        return self.node("Reshape", e, self.ints([0, heads, -1, head_dim]))

    def rotary(self, t: str, cos: str, sin: str, head_dim: int) -> str:
        """``t·cos + rotate_half(t)·sin`` on ``[b, h, s, d]`` (``rotate_half`` by Slice, Neg,
        Concat), as transformers applies rotary embeddings."""
        half = head_dim // 2
        lo = self.node("Slice", t, self.ints([0]), self.ints([half]), self.ints([3]))
        hi = self.node("Slice", t, self.ints([half]), self.ints([head_dim]), self.ints([3]))
        rot = self.node("Concat", self.node("Neg", hi), lo, axis=3)
        return self.node("Add", self.node("Mul", t, cos), self.node("Mul", rot, sin))

    def causal_attention(self, q: str, k: str, v: str, head_dim: int, mask: str) -> str:
        """Llama's ``softmax(q·kᵀ·head_dim**-0.5 + mask)·v`` on ``[b, h, s, d]`` heads, the
        softmax in float32 (``mask``: see :func:`llama_attention`; another name is an additive
        mask tensor of the graph)."""
        b = self
        dtype = self.dtype
        s = b.node("MatMul", q, b.node("Transpose", k, perm=[0, 1, 3, 2]))
        s = b.node("Mul", s, b.const(head_dim ** -0.5))
        if dtype == "float16":
            s = b.node("Cast", s, to=TensorProto.FLOAT)
        neg = np.finfo(np.float32).min
        if mask == "triu":
            # transformers' older causal mask: full((q, kv), min).triu(1), added to the scores
            shape = b.node("Shape", s)
            qk = b.node("Slice", shape, b.ints([2]), b.ints([4]))
            full = b.node("Expand", b.const(neg, np.float32), qk)
            s = b.node("Add", s, b.node("Trilu", full, b.ints(1), upper=1))
        elif mask == "where":
            ones = b.node("Add", b.node("Mul", s, b.const(0.0, np.float32)),
                          b.const(1.0, np.float32))
            keep = b.node("Cast", b.node("Trilu", ones, upper=0), to=TensorProto.BOOL)
            s = b.node("Where", keep, s, b.const(-np.inf, np.float32))
        elif mask in self.tensors:
            s = b.node("Add", s, mask)
        elif mask != "none":
            raise ValueError(f"mask must be 'triu', 'where' or 'none', got {mask!r}")
        p = b.node("Softmax", s, axis=-1)
        if dtype == "float16":
            p = b.node("Cast", p, to=TensorProto.FLOAT16)
        return b.node("MatMul", p, v)

    def finish(self, out: str, out_shape) -> onnx.ModelProto:
        """The model, ``out`` (the last node's output) renamed ``y``."""
        assert self.nodes[-1].output[0] == out
        self.nodes[-1].output[0] = "y"
        self.outputs.append(value_info("y", out_shape, self.elem))
        return self.model()


def _qkv_inputs(b: _Builder, batch, seq, widths, project: bool, hidden: int) -> list[str]:
    """The projected ``q, k, v`` (graph inputs), or projections of one input ``x``."""
    if project:
        x = b.add_input("x", [batch, seq, hidden], b.elem)
        return [b.node("MatMul", x, b.weight(hidden, w)) for w in widths]
    return [b.add_input(n, [batch, seq, w], b.elem) for n, w in zip("qkv", widths)]


def bert_attention(batch=1, seq=64, heads=4, head_dim=16, dtype="float32", project=False,
                   mask_rows=False, safe_softmax=False, seed=0) -> onnx.ModelProto:
    """BERT: additive mask input ``mask [b, 1, 1, s]`` (0 attend, large negative masked); with
    ``mask_rows`` one mask per query row, ``[b, 1, s, s]`` (a row of ``-inf`` masks a row);
    ``safe_softmax`` as torch.export writes ``scaled_dot_product_attention``'s."""
    b = _Builder("bert_attention", dtype, seed)
    width = heads * head_dim
    q, k, v = _qkv_inputs(b, batch, seq, [width] * 3, project, width)
    q = b.heads(q, heads, head_dim, [0, 2, 1, 3])
    k = b.heads(k, heads, head_dim, [0, 2, 3, 1])
    v = b.heads(v, heads, head_dim, [0, 2, 1, 3])
    s = b.node("Div", b.node("MatMul", q, k), b.const(math.sqrt(head_dim)))
    rows = seq if mask_rows else 1
    s = b.node("Add", s, b.add_input("mask", [batch, 1, rows, seq], b.elem, doc="additive_mask"))
    p = b.softmax(s, safe_softmax)
    out = b.merge(b.node("MatMul", p, v), width)
    return b.finish(out, [batch, seq, width])


def gpt2_attention(batch=1, seq=64, heads=4, head_dim=16, dtype="float32", project=False,
                   seed=0) -> onnx.ModelProto:
    """GPT-2: one ``c_attn`` output split three ways; causal ``Where`` built from Trilu."""
    b = _Builder("gpt2_attention", dtype, seed)
    width = heads * head_dim
    if project:
        x = b.add_input("x", [batch, seq, width], b.elem)
        qkv = b.node("MatMul", x, b.weight(width, 3 * width))
    else:
        qkv = b.add_input("qkv", [batch, seq, 3 * width], b.elem)
    q, k, v = b.add_node("Split", [qkv, b.ints([width] * 3)],
                         [b.fresh("q"), b.fresh("k"), b.fresh("v")], axis=2)
    q = b.heads(q, heads, head_dim, [0, 2, 1, 3])
    k = b.heads(k, heads, head_dim, [0, 2, 3, 1])
    v = b.heads(v, heads, head_dim, [0, 2, 1, 3])
    s = b.node("Div", b.node("MatMul", q, k), b.const(math.sqrt(head_dim)))
    ones = b.node("Add", b.node("Mul", s, b.const(0.0)), b.const(1.0))
    keep = b.node("Cast", b.node("Trilu", ones, upper=0), to=TensorProto.BOOL)
    s = b.node("Where", keep, s, b.const(-1e4))
    p = b.node("Softmax", s, axis=-1)
    out = b.merge(b.node("MatMul", p, v), width)
    return b.finish(out, [batch, seq, width])


def llama_attention(batch=1, seq=64, heads=8, kv_heads=2, head_dim=16, dtype="float32",
                    project=False, mask="triu", kv_seq=None, rope=False,
                    seed=0) -> onnx.ModelProto:
    """Llama: GQA (K, V with ``kv_heads`` heads, ``repeat_kv`` by Unsqueeze/Expand/Reshape),
    ``Mul`` by ``head_dim**-0.5``, a causal mask and an fp32 softmax.

    ``mask``: ``"triu"``, an additive ``[s, s]`` mask ``Trilu(Expand(min, [s, s]), 1)`` sized
    by ``Shape`` of the scores (transformers' ``full(min).triu(1)``); ``"where"``,
    ``Where(keep, s, -inf)`` with ``keep`` from ``Trilu`` of ones; ``"none"``. (A mask from
    ``Range`` comparisons, as transformers 5 builds it, has no static shape after TVM 0.27's
    ONNX import: its ``Range`` takes a size read at run time.)

    ``kv_seq`` (an int or a name) makes K and V a cache of that length, the decode shape
    (``seq=1``: one new token against the cache); it needs ``mask="none"``.

    ``rope``: rotary position embeddings on Q and K as transformers applies them
    (``q·cos + rotate_half(q)·sin``, ``rotate_half`` by Slice, Neg, Concat), with ``cos`` and
    ``sin`` ``[batch, seq, head_dim]`` graph inputs (the decoder layer receives them).
    """
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    b = _Builder("llama_attention", dtype, seed)
    width, kv_width = heads * head_dim, kv_heads * head_dim
    rep = heads // kv_heads
    if kv_seq is not None:
        if mask != "none" or project:
            raise ValueError("a key/value cache (kv_seq) takes mask='none' and project=False")
        q = b.add_input("q", [batch, seq, width], b.elem)
        k = b.add_input("k", [batch, kv_seq, kv_width], b.elem)
        v = b.add_input("v", [batch, kv_seq, kv_width], b.elem)
    else:
        q, k, v = _qkv_inputs(b, batch, seq, [width, kv_width, kv_width], project, width)
    q = b.heads(q, heads, head_dim, [0, 2, 1, 3])
    k = b.heads(k, kv_heads, head_dim, [0, 2, 1, 3])
    v = b.heads(v, kv_heads, head_dim, [0, 2, 1, 3])

    if rope:
        cos = b.node("Unsqueeze", b.add_input("cos", [batch, seq, head_dim], b.elem),
                     b.ints([1]))
        sin = b.node("Unsqueeze", b.add_input("sin", [batch, seq, head_dim], b.elem),
                     b.ints([1]))
        q, k = b.rotary(q, cos, sin, head_dim), b.rotary(k, cos, sin, head_dim)
    k, v = b.repeat_kv(k, rep, heads, head_dim), b.repeat_kv(v, rep, heads, head_dim)
    out = b.merge(b.causal_attention(q, k, v, head_dim, mask), width)
    return b.finish(out, [batch, seq, width])


def llama_decoder_layer(batch=1, seq=64, hidden=256, heads=8, kv_heads=2, head_dim=32,
                        intermediate=688, past=None, layers=1, mask="triu", eps=1e-5,
                        seed=0) -> onnx.ModelProto:
    """One Llama decoder layer as transformers computes it, fp32:
    ``h = x + o(attn(rope(q(n₁)), rope(k(n₁)), v(n₁)))``, ``y = h + down(silu(gate(n₂)) ·
    up(n₂))`` with ``n₁ = rms(x)``, ``n₂ = rms(h)`` (RMSNorm written out: Pow, ReduceMean,
    Add, Sqrt, Div, Mul, Mul by its weight), grouped-query attention with ``repeat_kv`` and the
    ``triu`` causal mask of :func:`llama_attention`, ``cos``/``sin`` ``[batch, seq,
    head_dim]`` inputs (a model computes them once for all its layers).

    ``past`` (an int or a name) is the decode shape: inputs ``past_k``/``past_v`` ``[batch,
    kv_heads, past, head_dim]`` (the key/value cache, before ``repeat_kv``), the new token's K
    and V concatenated after them, and outputs ``present_k``/``present_v`` besides ``y``; it
    needs ``seq=1`` (one query attends to the whole cache, so no mask).

    ``layers`` stacks that many layers (own weights; ``cos``, ``sin`` and the mask shared).
    ``mask="range"`` computes the causal mask once, before the layers, as
    ``torch.onnx.export(dynamo=True)`` writes transformers' (``Range`` of the length read by
    ``Shape``, ``LessOrEqual`` of its two views, ``Where(keep, 0, min)``), and every layer adds
    that one tensor; ``"triu"`` builds it inside each layer.
    """
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    if past is not None and (seq != 1 or layers != 1):
        raise ValueError(f"a key/value cache (past={past!r}) takes seq=1 and one layer, got "
                         f"seq={seq!r}, layers={layers}")
    if mask not in ("triu", "range"):
        raise ValueError(f"mask must be 'triu' or 'range', got {mask!r}")
    b = _Builder("llama_decoder_layer", "float32", seed)
    width, kv_width = heads * head_dim, kv_heads * head_dim

    def rms_norm(t: str) -> str:
        var = b.node("ReduceMean", b.node("Pow", t, b.const(2.0)), axes=[-1], keepdims=1)
        inv = b.node("Div", b.const(1.0), b.node("Sqrt", b.node("Add", var, b.const(eps))))
        gain = b.const(1.0 + 0.1 * b.rng.standard_normal(hidden))
        return b.node("Mul", gain, b.node("Mul", t, inv))

    x = b.add_input("x", [batch, seq, hidden])
    cos = b.node("Unsqueeze", b.add_input("cos", [batch, seq, head_dim]), b.ints([1]))
    sin = b.node("Unsqueeze", b.add_input("sin", [batch, seq, head_dim]), b.ints([1]))
    if past is not None:
        mask = "none"
    elif mask == "range":
        length = b.node("Squeeze", b.node("Slice", b.node("Shape", x), b.ints([1]),
                                          b.ints([2])), b.ints([0]))
        pos = b.node("Range", b.ints(0), length, b.ints(1))
        keep = b.node("LessOrEqual", b.node("Unsqueeze", pos, b.ints([0])),
                      b.node("Unsqueeze", pos, b.ints([1])))  # key j <= query i
        mask = b.node("Where", keep, b.const(0.0), b.const(np.finfo(np.float32).min))
        b.tensors.add(mask)
    presents = []
    for _ in range(layers):
        n1 = rms_norm(x)
        q, k, v = (b.node("MatMul", n1, b.weight(hidden, w))
                   for w in (width, kv_width, kv_width))
        q = b.rotary(b.heads(q, heads, head_dim, [0, 2, 1, 3]), cos, sin, head_dim)
        k = b.rotary(b.heads(k, kv_heads, head_dim, [0, 2, 1, 3]), cos, sin, head_dim)
        v = b.heads(v, kv_heads, head_dim, [0, 2, 1, 3])
        if past is not None:
            cache = [batch, kv_heads, past, head_dim]
            k = b.node("Concat", b.add_input("past_k", cache), k, axis=2)
            v = b.node("Concat", b.add_input("past_v", cache), v, axis=2)
            presents = [k, v]
        rep = heads // kv_heads
        k, v = b.repeat_kv(k, rep, heads, head_dim), b.repeat_kv(v, rep, heads, head_dim)
        ctx = b.causal_attention(q, k, v, head_dim, mask)
        h = b.node("Add", x, b.node("MatMul", b.merge(ctx, width), b.weight(width, hidden)))
        n2 = rms_norm(h)
        gate = b.node("MatMul", n2, b.weight(hidden, intermediate))
        up = b.node("MatMul", n2, b.weight(hidden, intermediate))
        act = b.node("Mul", b.node("Mul", gate, b.node("Sigmoid", gate)), up)
        x = b.node("Add", h, b.node("MatMul", act, b.weight(intermediate, hidden)))
    b.add_node("Identity", [x], ["y"])
    b.outputs.append(value_info("y", [batch, seq, hidden]))
    for name, t in zip(("present_k", "present_v"), presents):
        b.add_node("Identity", [t], [name])
        total = past + 1 if isinstance(past, int) else f"{past} + 1"
        b.outputs.append(value_info(name, [batch, kv_heads, total, head_dim]))
    return b.model()


def vit_attention(batch=1, seq=50, heads=4, head_dim=16, dtype="float32", project=False,
                  seed=0) -> onnx.ModelProto:
    """ViT (timm): no mask, Q scaled by ``Mul`` before ``Q·Kᵀ``."""
    b = _Builder("vit_attention", dtype, seed)
    width = heads * head_dim
    q, k, v = _qkv_inputs(b, batch, seq, [width] * 3, project, width)
    q = b.node("Mul", b.heads(q, heads, head_dim, [0, 2, 1, 3]), b.const(head_dim ** -0.5))
    k = b.node("Transpose", b.heads(k, heads, head_dim, [0, 2, 1, 3]), perm=[0, 1, 3, 2])
    v = b.heads(v, heads, head_dim, [0, 2, 1, 3])
    p = b.node("Softmax", b.node("MatMul", q, k), axis=-1)
    out = b.merge(b.node("MatMul", p, v), width)
    return b.finish(out, [batch, seq, width])


def swin_attention(windows=4, window=7, heads=3, head_dim=16, dtype="float32", shifted=True,
                   seed=0) -> onnx.ModelProto:
    """Swin window attention on ``qkv [windows, tokens, 3·C]``: heads split by one Reshape →
    Transpose → Gather, ``q·scale @ kᵀ``, the relative-position bias gathered from its table,
    and with ``shifted`` the shifted-window mask added through ``Reshape [1, nW, h, N, N]``."""
    from .swin import relative_position_index

    b = _Builder("swin_attention", dtype, seed)
    tokens, width = window * window, heads * head_dim
    qkv = b.add_input("qkv", [windows, tokens, 3 * width], b.elem)
    qkv = b.node("Reshape", qkv, b.ints([windows, tokens, 3, heads, head_dim]))
    qkv = b.node("Transpose", qkv, perm=[2, 0, 3, 1, 4])
    q, k, v = (b.node("Gather", qkv, b.ints(i), axis=0) for i in range(3))
    q = b.node("Mul", q, b.const(head_dim ** -0.5))
    s = b.node("MatMul", q, b.node("Transpose", k, perm=[0, 1, 3, 2]))
    table = b.const(0.1 * b.rng.standard_normal(((2 * window - 1) ** 2, heads)))
    bias = b.node("Gather", table, b.ints(relative_position_index(window)), axis=0)
    bias = b.node("Transpose", b.node("Reshape", bias, b.ints([tokens, tokens, heads])),
                  perm=[2, 0, 1])
    s = b.node("Add", s, b.node("Unsqueeze", bias, b.ints([0])))
    if shifted:
        m = np.where(b.rng.random((windows, tokens, tokens)) < 0.3, -100.0, 0.0)
        s = b.node("Reshape", s, b.ints([1, windows, heads, tokens, tokens]))
        s = b.node("Add", s, b.node("Unsqueeze", b.const(m), b.ints([0, 2])))
        s = b.node("Reshape", s, b.ints([-1, heads, tokens, tokens]))
    p = b.node("Softmax", s, axis=-1)
    out = b.merge(b.node("MatMul", p, v), width)
    return b.finish(out, [windows, tokens, width])


ATTENTION_MODELS = {"bert": bert_attention, "gpt2": gpt2_attention, "llama": llama_attention,
                    "vit": vit_attention, "swin": swin_attention}


def attention_model(kind: str, **kwargs) -> onnx.ModelProto:
    """The attention block ``kind`` (:data:`ATTENTION_MODELS`) with the builder's keywords."""
    try:
        builder = ATTENTION_MODELS[kind]
    except KeyError:
        raise ValueError(f"unknown attention model {kind!r}; expected one of "
                         f"{', '.join(ATTENTION_MODELS)}") from None
    return builder(**kwargs)

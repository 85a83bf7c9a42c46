"""Built-in demo models, built in code so that no model files are needed.

The models are the fixed regression inputs of the fusion passes: a BERT-style encoder layer in the
shape PyTorch/TinyBERT exports it (decomposed LayerNorm and Gelu, which is where DNNFusion's
O2O/M2M chains come from), and the graph of Figure 3 of the DNNFusion paper, whose expected
fusion plan is known. Weights come from a seeded ``numpy`` generator, so every call returns the
same model (fp32, opset 17, IR version 8).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx

from .graph import GraphBuilder

__all__ = [
    "BUILTIN_MODELS",
    "figure3_graph",
    "get_builtin",
    "transformer_encoder_layer",
]


class _Builder(GraphBuilder):
    """Named nodes whose output is the node's name, unique names, seeded weights."""

    def __init__(self, name: str, seed: int):
        super().__init__(name)
        self.rng = np.random.default_rng(seed)
        self._names: set[str] = set()

    def _claim(self, name: str) -> str:
        assert name not in self._names, name
        self._names.add(name)
        return name

    def const(self, name: str, value) -> str:
        return self.add_initializer(self._claim(name), value)

    def weight(self, name: str, shape: tuple[int, ...], fan_in: int) -> str:
        """Random weight scaled by 1/sqrt(fan_in) so activations stay O(1) through the layer."""
        w = self.rng.standard_normal(shape) / math.sqrt(fan_in)
        return self.const(name, w.astype(np.float32))

    def node(self, op: str, inputs: list[str], name: str, n_out: int = 1,
             **attrs) -> str | list[str]:
        outs = [name] if n_out == 1 else [f"{name}_{i}" for i in range(n_out)]
        self.add_node(op, inputs, outs, name=self._claim(name), **attrs)
        return outs[0] if n_out == 1 else outs

    def model(self, doc: str) -> onnx.ModelProto:
        return super().model(producer="tvm_fusion.models", doc=doc)


def _layer_norm(g: _Builder, x: str, hidden: int, prefix: str) -> str:
    """LayerNorm written out node by node, exactly as TinyBERT's PyTorch export has it."""
    mean = g.node("ReduceMean", [x], f"{prefix}.mean", axes=[-1], keepdims=1)
    centered = g.node("Sub", [x, mean], f"{prefix}.sub")
    sq = g.node("Pow", [centered, g.const(f"{prefix}.two", np.float32(2.0))], f"{prefix}.pow")
    var = g.node("ReduceMean", [sq], f"{prefix}.var", axes=[-1], keepdims=1)
    var_eps = g.node("Add", [var, g.const(f"{prefix}.eps", np.float32(1e-12))], f"{prefix}.add_eps")
    std = g.node("Sqrt", [var_eps], f"{prefix}.sqrt")
    normed = g.node("Div", [centered, std], f"{prefix}.div")
    gamma = g.const(f"{prefix}.gamma", 1.0 + 0.1 * g.rng.standard_normal(hidden))
    beta = g.const(f"{prefix}.beta", 0.1 * g.rng.standard_normal(hidden))
    scaled = g.node("Mul", [normed, gamma], f"{prefix}.mul_gamma")
    return g.node("Add", [scaled, beta], f"{prefix}.add_beta")


def _linear(g: _Builder, x: str, n_in: int, n_out: int, prefix: str) -> str:
    """PyTorch ``nn.Linear`` export: MatMul with a [in, out] weight, then Add(bias)."""
    w = g.weight(f"{prefix}.weight", (n_in, n_out), n_in)
    b = g.const(f"{prefix}.bias", 0.02 * g.rng.standard_normal(n_out))
    mm = g.node("MatMul", [x, w], f"{prefix}.matmul")
    return g.node("Add", [mm, b], f"{prefix}.add_bias")


def transformer_encoder_layer(
    seq: int = 64,
    hidden: int = 128,
    heads: int = 4,
    ffn: int = 512,
    mask_input: bool = True,
    seed: int = 0,
) -> onnx.ModelProto:
    """One BERT encoder layer as PyTorch exports it (post-LN, decomposed LayerNorm and Gelu).

    Inputs are ``x`` [1, seq, hidden] and, when ``mask_input``, an additive attention mask
    ``mask`` [1, 1, 1, seq] (0 = attend, -1e4 = masked; its ``doc_string`` carries the
    ``additive_mask`` hint that :func:`tvm_fusion.feeds.random_inputs` honours). With
    ``mask_input=False`` the mask is a constant that masks the last quarter of the positions.
    The output ``y`` has the shape of ``x``. Decomposed LayerNorm (ReduceMean, Sub, Pow,
    ReduceMean, Add, Sqrt, Div, Mul, Add) and Gelu (Div, Erf, Add, Mul, Mul) are what make the
    DNNFusion TinyBERT example "Sub + Pow + ReduceMean + Add + Sqrt" appear.
    """
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
    d = hidden // heads
    g = _Builder("transformer_encoder_layer", seed)
    x = g.add_input("x", [1, seq, hidden])
    if mask_input:
        mask = g.add_input("mask", [1, 1, 1, seq], doc="additive_mask")
    else:
        m = np.zeros((1, 1, 1, seq), np.float32)
        m[..., seq - seq // 4 :] = -1e4
        mask = g.const("attention.mask", m)

    heads_shape = g.const("attention.heads_shape", np.array([1, seq, heads, d], np.int64))
    merged_shape = g.const("attention.merged_shape", np.array([1, seq, hidden], np.int64))

    def split_heads(t: str, name: str, perm: list[int]) -> str:
        r = g.node("Reshape", [t, heads_shape], f"attention.{name}.reshape")
        return g.node("Transpose", [r], f"attention.{name}.transpose", perm=perm)

    q = split_heads(_linear(g, x, hidden, hidden, "attention.query"), "q", [0, 2, 1, 3])
    # K goes straight to [1, heads, d, seq]: PyTorch folds permute(0,2,1,3) + transpose(-1,-2).
    k_t = split_heads(_linear(g, x, hidden, hidden, "attention.key"), "k", [0, 2, 3, 1])
    v = split_heads(_linear(g, x, hidden, hidden, "attention.value"), "v", [0, 2, 1, 3])

    scores = g.node("MatMul", [q, k_t], "attention.qk")
    scaled = g.node(
        "Div", [scores, g.const("attention.sqrt_d", np.float32(math.sqrt(d)))], "attention.scale"
    )
    masked = g.node("Add", [scaled, mask], "attention.add_mask")
    probs = g.node("Softmax", [masked], "attention.softmax", axis=-1)
    ctx = g.node("MatMul", [probs, v], "attention.context")
    ctx = g.node("Transpose", [ctx], "attention.context.transpose", perm=[0, 2, 1, 3])
    ctx = g.node("Reshape", [ctx, merged_shape], "attention.context.reshape")
    attn_out = _linear(g, ctx, hidden, hidden, "attention.output")
    h1 = _layer_norm(g, g.node("Add", [attn_out, x], "attention.residual"), hidden, "ln1")

    f = _linear(g, h1, hidden, ffn, "ffn.in")
    # Gelu(x) = x * 0.5 * (1 + erf(x / sqrt(2))), node order as the PyTorch exporter emits it.
    e = g.node("Div", [f, g.const("gelu.sqrt2", np.float32(math.sqrt(2.0)))], "gelu.div")
    e = g.node("Erf", [e], "gelu.erf")
    e = g.node("Add", [e, g.const("gelu.one", np.float32(1.0))], "gelu.add_one")
    e = g.node("Mul", [f, e], "gelu.mul")
    act = g.node("Mul", [e, g.const("gelu.half", np.float32(0.5))], "gelu.mul_half")
    f2 = _linear(g, act, ffn, hidden, "ffn.out")
    out = _layer_norm(g, g.node("Add", [f2, h1], "ffn.residual"), hidden, "ln2")
    g.nodes[-1].output[0] = "y"  # the last LayerNorm Add writes the graph output directly
    assert out == g.nodes[-1].name

    g.add_output("y", [1, seq, hidden])
    return g.model(transformer_encoder_layer.__doc__)


def figure3_graph(channels: int = 16, size: int = 8, seed: int = 0) -> onnx.ModelProto:
    """The DNNFusion paper's Figure 3 graph: GEMM -> Add -> Conv -> {Relu, Mul, Sub}.

    Graph (every tensor is [1, C, S, S], C=``channels``, S=``size``)::

        X --MatMul(W[S,S])--> G --Add(Y)--> A --Conv3x3(pad 1, no bias)--> V
        V --Relu--> out_relu;   V --Mul(Z)--> out_mul;   V --Sub(Z2)--> out_sub

    The MatMul is a real GEMM on the last axis (M2M), not a 1x1 conv. Inputs are X, Y, Z, Z2;
    W and the conv weight are initializers. All operators produce identical output shapes, so
    the intermediate-result sizes tie.

    Intended DNNFusion plan (paper §4.3):

    * seed = Add (the first O2O op in topological order among equal-IRS O2O ops);
    * successors: Add absorbs Conv (O2O+M2M -> M2M, green), then Relu, Mul and Sub
      (M2M+O2O -> M2M, green);
    * predecessor: the block (now M2M) versus the GEMM (M2M) is ``fuse_break`` (red), so the
      GEMM stays alone;
    * result: blocks {Add, Conv, Relu, Mul, Sub} (type M2M) and {MatMul}.
    """
    g = _Builder("figure3", seed)
    shape = [1, channels, size, size]
    for name in ("X", "Y", "Z", "Z2"):
        g.add_input(name, shape)
    w = g.weight("W", (size, size), size)
    wc = g.weight("conv.weight", (channels, channels, 3, 3), channels * 9)
    gemm = g.node("MatMul", ["X", w], "gemm")
    add = g.node("Add", [gemm, "Y"], "add")
    conv = g.node("Conv", [add, wc], "conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    g.add_node("Relu", [conv], ["out_relu"], name="relu")
    g.add_node("Mul", [conv, "Z"], ["out_mul"], name="mul")
    g.add_node("Sub", [conv, "Z2"], ["out_sub"], name="sub")
    for name in ("out_relu", "out_mul", "out_sub"):
        g.add_output(name, shape)
    return g.model(figure3_graph.__doc__)


BUILTIN_MODELS: dict[str, Callable[..., onnx.ModelProto]] = {
    "encoder": transformer_encoder_layer,
    "figure3": figure3_graph,
}


def get_builtin(name: str, **kwargs) -> onnx.ModelProto:
    """Build the built-in model ``name`` (keyword arguments go to its builder)."""
    try:
        builder = BUILTIN_MODELS[name]
    except KeyError:
        valid = ", ".join(sorted(BUILTIN_MODELS))
        raise ValueError(f"unknown built-in model {name!r}; valid names: {valid}") from None
    return builder(**kwargs)

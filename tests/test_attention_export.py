"""Attention in torch.export programs: ``bmm`` with its broadcasts and batch reshapes.

torch.export decomposes ``matmul`` on 4-d tensors into ``bmm``: every operand is broadcast to
its own shape and reshaped ``(b, h, s, x) → (b·h, s, x)``, and the product reshaped back. The
softmax therefore reaches ``P·V`` through a ``broadcast_to`` and a reshape; the planner walks
through such views (not only casts) and the fused TIR is matched as for the ONNX exports.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from conftest import TARGET
from tvm import relax

from tvm_fusion.compile import compile_model
from tvm_fusion.instrument import Collector
from tvm_fusion.tir_utils import find_all

torch = pytest.importorskip("torch")


class _Attention(torch.nn.Module):
    """Self-attention on ``x [1, s, heads·dim]``: Q/K/V projections, explicit ``matmul`` and
    softmax (what torch.export turns into ``bmm``), optional GQA (``repeat_kv`` by
    ``expand``/``reshape``) and causal mask (from ``arange`` comparisons, sized by ``s``)."""

    def __init__(self, heads=4, kv_heads=4, dim=8, causal=False):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        width = heads * dim
        self.heads, self.kv_heads, self.dim, self.causal = heads, kv_heads, dim, causal
        self.wq = torch.nn.Parameter(torch.randn(width, width, generator=gen) / width ** 0.5)
        self.wkv = torch.nn.Parameter(
            torch.randn(width, 2 * kv_heads * dim, generator=gen) / width ** 0.5)

    def forward(self, x):
        b, s, _ = x.shape
        q = (x @ self.wq).view(b, s, self.heads, self.dim).transpose(1, 2)
        k, v = (x @ self.wkv).view(b, s, 2 * self.kv_heads, self.dim).transpose(1, 2).chunk(
            2, dim=1)
        rep = self.heads // self.kv_heads
        if rep > 1:
            k, v = (t[:, :, None].expand(b, self.kv_heads, rep, s, self.dim).reshape(
                b, self.heads, s, self.dim) for t in (k, v))
        scores = q @ k.transpose(-1, -2) * self.dim ** -0.5
        if self.causal:
            pos = torch.arange(s)
            scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        return (p @ v).transpose(1, 2).reshape(b, s, self.heads * self.dim)


def _program(net, symbolic: bool, seq: int = 16):
    x = torch.randn(1, seq, net.heads * net.dim)
    shapes = ({1: torch.export.Dim("seq", min=2, max=512)},) if symbolic else None
    return torch.export.export(net.eval(), (x,), dynamic_shapes=shapes)


@pytest.mark.parametrize("symbolic", [True, False], ids=["symbolic", "static"])
@pytest.mark.parametrize("config", [{}, {"kv_heads": 2, "causal": True}],
                         ids=["mha", "gqa_causal"])
def test_bmm_attention_is_one_block_and_matches(symbolic, config):
    from tvm_fusion.frontend import from_exported_program

    net = _Attention(**config)
    sizes = (7, 200) if symbolic else (16,)
    mod = from_exported_program(_program(net, symbolic, seq=16))
    collector = Collector()
    with tvm.transform.PassContext(instruments=[collector]):
        ours = relax.VirtualMachine(compile_model(mod, TARGET), tvm.cpu())
    decisions = [d for p in collector.plans[0].plans.values() for d in p.attention]
    assert [d.chosen for d in decisions] == [True], [d.reason for d in decisions]
    stock = relax.VirtualMachine(compile_model(mod, TARGET, strategy="none"), tvm.cpu())
    for seq in sizes:
        x = torch.randn(1, seq, net.heads * net.dim, generator=torch.Generator().manual_seed(seq))
        want = net(x).detach().numpy()
        for vm in (ours, stock):
            got = vm["main"](tvm.runtime.tensor(x.numpy()))
            got = got[0] if not hasattr(got, "numpy") else got
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)


def test_rotate_half_reads_are_simplified_per_branch():
    """RoPE's rotate-half through torch.export's reshapes reads ``x[((kd - 16) // 128 + i) %
    seq % seq, …]`` where ``kd >= 16``: knowing the branch, the row is ``i`` (else two
    divisions by the symbolic ``seq`` per element packed)."""
    from tvm import sym, tirx

    from tvm_fusion.tir_schedules.attention_match import simplify_loads

    i, kd = tirx.Var("i", "int64"), tirx.Var("kd", "int64")
    seq = tirx.Var("seq", "int64")
    x = tirx.decl_buffer((seq, 32), "float32", name="x")
    ranges = {i: seq, kd: tirx.const(32, "int64")}
    ana = sym.Analyzer()
    for var, ext in ranges.items():
        ana.bind(var, tvm.ir.Range(0, ext))

    def row(shift):
        return tirx.floormod(tirx.floormod(tirx.floordiv(kd + shift, 128) + i, seq), seq)

    expr = tirx.if_then_else(kd >= 16, x[row(-16), kd - 16], x[row(16), kd + 16])
    got = simplify_loads(expr, ana, ranges)
    assert [str(ld.indices[0]) for ld in find_all(got, tvm.ir.expr.TensorLoad)] == ["i", "i"]

"""Random ``torch.export`` programs with a symbolic batch (and sometimes sequence), checked
tvm_fusion against stock TVM and PyTorch itself.

The ONNX fuzzer (:mod:`.generate`) never sees what torch.export writes: ``bmm`` of flattened
views, the decomposed *safe* softmax of ``scaled_dot_product_attention``, ``nn.MultiheadAttention``
sequence-first, sizes as symbols (``s77``) rather than graph inputs. A case is a small
transformer-like stack drawn from :data:`BLOCKS` over a ``(batch, seq, width)`` activation,
with random weights; it is exported with ``Dim``\\ s, saved as a ``.pt2``, loaded as a user's
program is (:func:`tvm_fusion.compile.load_model`) and run at two sizes from one build.
torch is imported only here.
"""

from __future__ import annotations

import math
import os
import tempfile
import traceback
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..tir_schedules.records import ScheduleFailedWarning

__all__ = ["BLOCKS", "TorchCase", "check_program", "draw_program"]

BLOCKS = ("linear", "activation", "norm", "attention", "mha", "glu", "conv1d", "softmax",
          "residual")


@dataclass
class TorchCase:
    seed: int
    blocks: list
    width: int
    seq: int
    symbolic_seq: bool
    module: object = None  # the torch.nn.Module


@dataclass
class TorchResult:
    seed: int
    status: str  # ok | wrong | crash (ours fails) | skipped (torch cannot export it)
    blocks: list
    error: str = ""
    max_err: float = 0.0
    sizes: list = field(default_factory=list)
    stock: str = ""  # how stock TVM failed or disagreed, if it did
    # schedules of our build that failed and fell back (ScheduleFailedWarning): right values,
    # slower kernels, as in the ONNX fuzzer's records
    fallbacks: list = field(default_factory=list)


def _pick(rng, values):
    return values[int(rng.integers(len(values)))]


def draw_program(seed: int) -> TorchCase:
    """A random stack of 2–5 blocks (seeded; odd widths and sequence lengths)."""
    import torch
    from torch import nn
    from torch.nn import functional as F  # noqa: N812

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    width = int(_pick(rng, [8, 12, 16, 24, 30, 48]))
    seq = int(_pick(rng, [5, 7, 16, 17, 33]))
    names = [str(_pick(rng, BLOCKS)) for _ in range(int(rng.integers(2, 6)))]

    class Activation(nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.kind = kind

        def forward(self, x):
            if self.kind == "gelu_tanh":
                return F.gelu(x, approximate="tanh")
            return getattr(F, self.kind)(x)

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class Attention(nn.Module):
        """SDPA over heads; causal, an additive -inf mask, or none."""

        def __init__(self, d, heads, mask):
            super().__init__()
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.heads, self.mask = heads, mask

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(x).split(d, dim=-1)
            q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)
                       for t in (q, k, v))
            if self.mask == "causal":
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            elif self.mask == "additive":
                m = torch.full((s, s), float("-inf"), device=x.device).triu(1)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
            elif self.mask == "explicit":  # eager attention, as transformers' "eager"
                w = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
                o = w.softmax(-1) @ v
            else:
                o = F.scaled_dot_product_attention(q, k, v)
            return self.out(o.transpose(1, 2).reshape(b, s, d))

    class MHA(nn.Module):
        def __init__(self, d, heads, batch_first):
            super().__init__()
            self.attn = nn.MultiheadAttention(d, heads, batch_first=batch_first)
            self.batch_first = batch_first

        def forward(self, x):
            if not self.batch_first:
                x = x.transpose(0, 1)
            y = self.attn(x, x, x, need_weights=False)[0]
            return y if self.batch_first else y.transpose(0, 1)

    class GLU(nn.Module):
        def __init__(self, d, hidden):
            super().__init__()
            self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
            self.down = nn.Linear(hidden, d, bias=False)

        def forward(self, x):
            return self.down(F.silu(self.gate(x)) * self.up(x))

    class Conv1d(nn.Module):
        def __init__(self, d, k, groups):
            super().__init__()
            self.conv = nn.Conv1d(d, d, k, padding=k // 2, groups=groups)

        def forward(self, x):
            return self.conv(x.transpose(1, 2)).transpose(1, 2)

    class Residual(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(
                2 * d, d)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    class Softmax(nn.Module):
        def forward(self, x):
            return x.softmax(-1)

    layers, d, blocks = [], width, []
    for name in names:
        heads = int(_pick(rng, [h for h in (1, 2, 3, 4) if d % h == 0]))
        if name == "linear":
            out = int(_pick(rng, [8, 16, 24, 30, 48]))
            layer, label = nn.Linear(d, out, bias=bool(rng.random() < 0.7)), f"linear{out}"
            d = out
        elif name == "activation":
            kind = str(_pick(rng, ["relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh",
                                   "hardswish"]))
            layer, label = Activation(kind), kind
        elif name == "norm":
            rms = bool(rng.random() < 0.5)
            layer, label = (RMSNorm(d), "rmsnorm") if rms else (nn.LayerNorm(d), "layernorm")
        elif name == "attention":
            mask = str(_pick(rng, ["none", "causal", "additive", "explicit"]))
            layer, label = Attention(d, heads, mask), f"sdpa_{mask}_h{heads}"
        elif name == "mha":
            first = bool(rng.random() < 0.5)
            layer, label = MHA(d, heads, first), f"mha_h{heads}_{'bf' if first else 'sf'}"
        elif name == "glu":
            hidden = int(_pick(rng, [16, 40, 64]))
            layer, label = GLU(d, hidden), f"swiglu{hidden}"
        elif name == "conv1d":
            k = int(_pick(rng, [1, 3, 5]))
            groups = int(_pick(rng, [g for g in (1, 2, d) if d % g == 0]))
            layer, label = Conv1d(d, k, groups), f"conv1d_k{k}_g{groups}"
        elif name == "softmax":
            layer, label = Softmax(), "softmax"
        else:
            layer, label = Residual(d), "residual_mlp"
        layers.append(layer)
        blocks.append(label)
    module = nn.Sequential(*layers).eval()
    return TorchCase(seed, blocks, width, seq, bool(rng.random() < 0.5), module)


def _export(case: TorchCase, path: str):
    import torch
    from torch.export import Dim

    x = torch.randn(2, case.seq, case.width)
    dims = {0: Dim("batch", min=1, max=64)}
    if case.symbolic_seq:
        dims[1] = Dim("seq", min=2, max=512)
    program = torch.export.export(case.module, (x,), dynamic_shapes={"input": dims})
    torch.export.save(program, path)


def check_program(case: TorchCase, target="llvm", rtol: float = 1e-4,
                  atol: float = 1e-5) -> TorchResult:
    """Export, import, build with tvm_fusion (and stock TVM), run at two sizes from one build,
    compare with PyTorch, which is the reference: ``skipped`` only when torch cannot export
    the case; stock TVM failing or disagreeing is recorded (``stock``), not a reason to skip.
    The build sees a profiling database of its own, not the machine's
    (:func:`~.differential.private_database`)."""
    from .differential import private_database

    with private_database():
        return _check_program(case, target, rtol, atol)


def _check_program(case: TorchCase, target, rtol: float, atol: float) -> TorchResult:
    import torch
    import tvm

    from ..compile import compile_model, import_model, load_model

    result = TorchResult(case.seed, "ok", case.blocks)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.pt2")
        try:
            _export(case, path)
        except Exception as err:  # noqa: BLE001 (torch's own export limits)
            result.status, result.error = "skipped", f"export: {type(err).__name__}"
            return result
        try:
            mod = import_model(load_model(path))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ScheduleFailedWarning)
                vms = {"ours": tvm.relax.VirtualMachine(compile_model(mod, target), tvm.cpu())}
        except Exception as err:  # noqa: BLE001
            result.status = "crash"
            result.error = _first_line(err) + "\n" + traceback.format_exc(limit=-3)
            return result
        result.fallbacks = [_first_line(w.message) for w in caught
                            if issubclass(w.category, ScheduleFailedWarning)]
        try:
            vms["stock"] = tvm.relax.VirtualMachine(
                compile_model(mod, target, strategy="none"), tvm.cpu())
        except Exception as err:  # noqa: BLE001 (recorded: not evidence against us)
            result.stock = f"build: {_first_line(err)}"
    second = case.seq + 6 if case.symbolic_seq else case.seq
    for batch, seq in ((1, case.seq), (3, second)):
        x = torch.randn(batch, seq, case.width,
                        generator=torch.Generator().manual_seed(case.seed + batch))
        with torch.no_grad():
            want = case.module(x).numpy()
        tol = (atol + rtol) * max(1.0, float(np.abs(want).max()))
        result.sizes.append([batch, seq])
        for name, vm in vms.items():
            try:
                out = vm["main"](tvm.runtime.tensor(x.numpy()))
                err = float(np.abs((out if hasattr(out, "numpy") else out[0]).numpy()
                                   - want).max())
            except Exception as exc:  # noqa: BLE001
                if name == "stock":
                    result.stock = f"run: {_first_line(exc)}"
                    continue
                result.status, result.error = "crash", f"run: {_first_line(exc)}"
                return result
            if name == "stock":
                if not err <= tol:
                    result.stock = f"max err {err:.3g} at {batch}x{seq}"
                continue
            result.max_err = max(result.max_err, err)
            if not err <= tol:  # NaN fails too
                result.status, result.error = "wrong", f"max err {err:.3g} at {batch}x{seq}"
                return result
    return result


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]

"""The torch.export program fuzzer (tvm_fusion/fuzz/torch_programs.py) and what it found."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from conftest import TARGET
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion.compile import compile_model
from tvm_fusion.fuzz.torch_programs import BLOCKS, check_program, draw_program
from tvm_fusion.relay_passes.legalize_repairs import LegalizeNonFiniteFull


def test_draws_are_seeded_and_cover_every_block():
    pytest.importorskip("torch")
    assert draw_program(5).blocks == draw_program(5).blocks
    seen = " ".join(label for seed in range(60) for label in draw_program(seed).blocks)
    prefixes = {"linear": "linear", "activation": "relu", "norm": "norm", "attention": "sdpa_",
                "mha": "mha_", "glu": "swiglu", "conv1d": "conv1d_", "softmax": "softmax",
                "residual": "residual_mlp"}
    assert set(prefixes) == set(BLOCKS)
    assert all(prefix in seen for prefix in prefixes.values())


@I.ir_module
class FullMinusInf:
    @R.function
    def main(x: R.Tensor(("n", 7, 7), "float32")):
        with R.dataflow():
            mask = R.full(R.shape([7, 7]), R.const(-np.inf, "float32"), dtype="float32")
            upper = R.triu(mask, 1)
            out = R.add(x, upper)
            R.output(out)
        return out


def test_full_of_minus_inf_is_legalised_and_builds():
    """TVM 0.27's own legalisation raises on it (``'float' in PrimType``)."""
    after = LegalizeNonFiniteFull()(FullMinusInf)
    first = after["main"].body.blocks[0].bindings[0].value
    assert first.op.same_as(tvm.ir.Op.get("relax.call_tir"))
    ex = compile_model(FullMinusInf, TARGET)
    x = np.zeros((2, 7, 7), "float32")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_array_equal(got, np.broadcast_to(np.triu(np.full((7, 7), -np.inf), 1),
                                                       (2, 7, 7)))


@pytest.mark.slow
def test_seed_2_sdpa_with_a_full_minus_inf_mask():
    """Found by the fuzzer: ``torch.full((s, s), -inf).triu(1)`` as SDPA's mask (stock TVM
    does not build it)."""
    pytest.importorskip("torch")
    result = check_program(draw_program(2))
    assert result.status == "ok", result.error
    assert "sdpa_additive" in " ".join(result.blocks)


@pytest.mark.slow
def test_a_few_seeds():
    pytest.importorskip("torch")
    for seed in range(8):
        result = check_program(draw_program(seed))
        assert result.status in ("ok", "skipped"), (seed, result.blocks, result.error)


@pytest.mark.slow
def test_seed_30_narrow_gemm_over_batch_times_sequence_rows():
    """Found by the fuzzer: SwiGLU's down projection (N = 16) over rows ``batch·seq``, both
    symbolic, split into parallel row ranges on a 2-core target: TVM 0.27's lowering bound a
    variable twice (``rmod``) and the build failed. Such a GEMM keeps its rows on one thread."""
    pytest.importorskip("torch")
    result = check_program(draw_program(30), target={"kind": "llvm", "num-cores": 2})
    assert result.status == "ok", result.error

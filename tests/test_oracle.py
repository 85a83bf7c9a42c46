"""The yellow-cell oracle chain: database, measurement, model, analytic default.

A seeded database flips a yellow decision; measuring fills the database and planning from it
gives the same plan much faster; two processes measure into one database at once; the model
answers when nothing else can and says it is a prediction.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from tvm_fusion.compile import count_kernels, import_onnx, run
from tvm_fusion.models import transformer_encoder_layer
from tvm_fusion.relay_passes.fusion_plan import AnalyticOracle, PlanOptions
from tvm_fusion.relay_passes.mapping_type import AnnotateMappingType
from tvm_fusion.relay_passes.plan_fusion import apply_plan
from tvm_fusion.relay_passes.rejection import RejectReason
from tvm_fusion.transform import legalize_passes
from tvm_fusion.tuning.candidate import FUSED
from tvm_fusion.tuning.cost_model import LatencyModel
from tvm_fusion.tuning.database import Measurement, ProfilingDatabase
from tvm_fusion.tuning.measure import (
    LocalRunner,
    Measurer,
    RPCRunner,
    TimingConfig,
    build_variant,
    resolve_strategy,
    target_key,
)
from tvm_fusion.tuning.oracle import ProfilingOracle, make_oracle, plan_module_profiled

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = tvm.target.Target("llvm")
FAST = TimingConfig(number=1, repeat=3, min_repeat_ms=2)


def _legalized(model: onnx.ModelProto) -> tvm.IRModule:
    with TARGET:
        return tvm.transform.Sequential(legalize_passes(TARGET))(import_onnx(model))


def _weight(k, m) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((k, m)).astype("float32")


def _transpose_matmul(k=48, n=64, m=32) -> onnx.ModelProto:
    """``Transpose → MatMul``: Shuffle then Many-to-Many, a yellow cell of Table 3."""
    w = numpy_helper.from_array(_weight(k, m), "w")
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t", "w"], ["y"])]
    graph = helper.make_graph(
        nodes, "transpose_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n, m])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


class _Recording(ProfilingOracle):
    """Remembers every question the planner asks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked = []

    def decide(self, ecg, block, node, producer_first):
        self.asked.append((ecg, list(block), node, producer_first))
        return super().decide(ecg, block, node, producer_first)


def _only_plan(module_plan):
    (plan,) = module_plan.plans.values()
    return plan


def _groups(module_plan):
    return {k: [b.members for b in p.blocks] for k, p in module_plan.plans.items()}


def _seed(db, oracle, cand, fused_s, split_s):
    m = oracle.measurer
    for variant, seconds in ((FUSED, fused_s), (cand.split_variant, split_s)):
        db.record(Measurement(target_key(m.target), m.device_key, m.strategy.id, cand.hash,
                              variant, [seconds] * 3, description=cand.describe()))


# ------------------------------------------------------------------ a seeded database flips it

def test_seeded_database_flips_a_yellow_decision(tmp_path):
    mod = _legalized(_transpose_matmul())
    db = ProfilingDatabase(tmp_path / "p.db")

    first = _Recording(db, mode="db", target=TARGET)
    plan = _only_plan(plan_module_profiled(mod, first))
    (yellow,) = plan.yellow
    assert "transpose" in yellow.first and "matmul" in yellow.second
    assert yellow.decision.fuse and yellow.decision.source == "analytic"
    assert "no database entry; no model" in yellow.decision.detail
    assert plan.num_kernels == 1
    cand = first.candidate(*first.asked[0])

    _seed(db, first, cand, fused_s=2e-3, split_s=1e-3)  # the database says fusing is slower
    oracle = ProfilingOracle(db, mode="db", target=TARGET)
    module_plan = plan_module_profiled(mod, oracle)
    plan = _only_plan(module_plan)
    (yellow,) = plan.yellow
    assert not yellow.decision.fuse and yellow.decision.source == "db"
    assert "fused 2000.0 us vs split 1000.0 us" in yellow.decision.detail
    assert plan.num_kernels == 2
    assert any(r.reason is RejectReason.PROFITABILITY and r.detail.startswith("yellow, db says")
               for r in plan.rejections)
    assert count_kernels(relax.transform.FuseTIR()(apply_plan(mod, module_plan))) == 2
    assert oracle.counts == {"db": 1}
    phone = ProfilingOracle(db, mode="db", target=TARGET, device_key="phone-7")
    plan_module_profiled(mod, phone)  # entries are per device: the phone has none
    assert phone.counts == {"analytic": 1}

    other = ProfilingDatabase(tmp_path / "q.db")  # and the other way round it fuses
    _seed(other, first, cand, fused_s=1e-3, split_s=2e-3)
    plan = _only_plan(plan_module_profiled(mod, ProfilingOracle(other, "db", target=TARGET)))
    assert plan.num_kernels == 1 and plan.yellow[0].decision.source == "db"


@pytest.mark.parametrize("strategy", ["unscheduled", "default"])
def test_candidate_module_keeps_constants_and_variants_agree(tmp_path, strategy):
    mod = _legalized(_transpose_matmul())
    oracle = _Recording(ProfilingDatabase(tmp_path / "p.db"), "db", target=TARGET)
    plan_module_profiled(mod, oracle)
    cand = oracle.candidate(*oracle.asked[0])
    main = cand.standalone()["main"]
    assert [p.name for p in main.params] == ["x"]  # the weight stayed a constant
    assert cand.variants == ("fused", "split:1")
    inputs = cand.random_inputs()
    chosen = resolve_strategy(None if strategy == "default" else strategy, TARGET)
    outs = [run(build_variant(cand, v, TARGET, chosen), inputs)[0] for v in cand.variants]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    expected = inputs[0].transpose(0, 2, 1) @ _weight(48, 32)
    np.testing.assert_allclose(outs[0], expected, rtol=1e-4, atol=1e-4)
    fused = cand.variant_module(FUSED)
    assert count_kernels(fused) == 1 and count_kernels(cand.variant_module("split:1")) == 2

    # the key ignores PrimFunc attributes (AnnotateMappingType adds one) and Relax names
    annotated = AnnotateMappingType()(mod)
    again = _Recording(ProfilingDatabase(tmp_path / "p.db"), "db", target=TARGET)
    plan_module_profiled(annotated, again)
    assert again.candidate(*again.asked[0]).hash == cand.hash


# ------------------------------------------------------- measure, then plan from the database

# The encoder layer's doubtful pairs are those of its attention chain (Q.K^T, softmax, .V):
# with the attention block on, it is planned as one block and nothing is left to measure.
NO_ATTENTION = PlanOptions(attention=False)


@pytest.fixture(scope="module")
def encoder_db(tmp_path_factory):
    """The encoder layer planned once with measurement into a fresh database."""
    path = tmp_path_factory.mktemp("encoder") / "p.db"
    mod = _legalized(transformer_encoder_layer())
    db = ProfilingDatabase(path)
    oracle = ProfilingOracle(db, "measure", target=TARGET, runner=LocalRunner(TARGET, FAST))
    start = time.perf_counter()
    module_plan = plan_module_profiled(mod, oracle, NO_ATTENTION)
    return {"mod": mod, "db": db, "plan": module_plan, "oracle": oracle,
            "seconds": time.perf_counter() - start}


def test_planning_from_the_database_is_identical_and_faster(encoder_db):
    measured = encoder_db["oracle"]
    assert measured.counts["measure"] >= 3 and measured.measurer.measured >= 6
    db_oracle = ProfilingOracle(encoder_db["db"], "db", target=TARGET)
    start = time.perf_counter()
    replanned = plan_module_profiled(encoder_db["mod"], db_oracle, NO_ATTENTION)
    seconds = time.perf_counter() - start
    assert _groups(replanned) == _groups(encoder_db["plan"])
    assert set(db_oracle.counts) == {"db"}
    assert encoder_db["seconds"] >= 10 * seconds, (encoder_db["seconds"], seconds)
    for old, new in zip(_only_plan(encoder_db["plan"]).yellow, _only_plan(replanned).yellow):
        assert old.decision.fuse == new.decision.fuse
        assert old.decision.source in ("measure", "db") and new.decision.source == "db"


def test_cache_hits_never_measure_again(encoder_db, monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("measured a variant the database has")

    monkeypatch.setattr(Measurer, "measure", refuse)
    oracle = ProfilingOracle(encoder_db["db"], "measure", target=TARGET)
    replanned = plan_module_profiled(encoder_db["mod"], oracle, NO_ATTENTION)
    assert set(oracle.counts) == {"db"} and oracle.measurer.measured == 0
    assert _groups(replanned) == _groups(encoder_db["plan"])


def test_model_answers_when_the_database_cannot(encoder_db, tmp_path):
    model = LatencyModel.train(encoder_db["db"], folds=3, rounds=50)
    v = model.validation
    assert v["folds"] == 3 and v["n_entries"] == len(encoder_db["db"])
    assert np.isfinite(v["median_ape"]) and v["n_pairs"] > 0
    assert 0.0 <= v["verdict_accuracy"] <= 1.0 or v["n_pairs"] == 0
    model.save(tmp_path / "model.json")
    loaded = LatencyModel.load(tmp_path / "model.json")
    entry = next(encoder_db["db"].entries())
    assert loaded.predict(entry.features) == pytest.approx(model.predict(entry.features))

    mod = _legalized(_transpose_matmul())
    empty = ProfilingDatabase(tmp_path / "empty.db")
    for mode in ("db", "off"):
        plan = _only_plan(plan_module_profiled(
            mod, ProfilingOracle(empty, mode, model=loaded, target=TARGET)))
        decision = plan.yellow[0].decision
        assert decision.source == "model"
        assert decision.detail.startswith("predicted, not measured")
        assert "held-out" in decision.detail
    with pytest.raises(ValueError, match="at least 10"):
        LatencyModel.train(empty)


def test_off_mode_ignores_the_database_and_failures_are_named(tmp_path):
    mod = _legalized(_transpose_matmul())
    db = ProfilingDatabase(tmp_path / "p.db")
    recorder = _Recording(db, "db", target=TARGET)
    plan_module_profiled(mod, recorder)
    _seed(db, recorder, recorder.candidate(*recorder.asked[0]), 2e-3, 1e-3)
    plan = _only_plan(plan_module_profiled(mod, ProfilingOracle(db, "off", target=TARGET)))
    assert plan.yellow[0].decision.source == "analytic" and plan.num_kernels == 1

    class Broken(LocalRunner):
        def prepare(self, executable, inputs):
            raise RuntimeError("device fell off the table")

    oracle = ProfilingOracle(tmp_path / "q.db", "measure", target=TARGET,
                             runner=Broken(TARGET, FAST))
    decision = _only_plan(plan_module_profiled(mod, oracle)).yellow[0].decision
    assert decision.source == "analytic"
    assert "measuring fused of" in decision.detail and "fell off the table" in decision.detail
    with pytest.raises(ValueError, match="unknown profile mode"):
        ProfilingOracle(db, "sometimes")
    with pytest.raises(ValueError, match="needs a profiling database"):
        ProfilingOracle(None, "measure")


def test_make_oracle_from_options(tmp_path):
    mod = _legalized(_transpose_matmul())
    assert isinstance(make_oracle("off"), AnalyticOracle)  # profiling off costs nothing
    missing = tmp_path / "missing.db"
    oracle = make_oracle("db", missing)
    decision = _only_plan(plan_module_profiled(mod, oracle)).yellow[0].decision
    assert decision.source == "analytic"
    assert f"no profiling database at {missing}" in decision.detail
    assert not missing.exists()  # looking up never creates the file
    with TARGET:
        oracle = make_oracle("measure", tmp_path / "new.db", runner=LocalRunner(TARGET, FAST))
        decision = _only_plan(plan_module_profiled(mod, oracle)).yellow[0].decision
    assert decision.source == "measure" and (tmp_path / "new.db").exists()
    with pytest.raises(ValueError, match="profile='sometimes'"):
        make_oracle("sometimes")


def test_rpc_runner_measures_through_a_session(tmp_path):
    mod = _legalized(_transpose_matmul())
    runner = RPCRunner(tvm.rpc.LocalSession(), device_key="rpc-local-test", config=FAST)
    oracle = ProfilingOracle(tmp_path / "p.db", "measure", target=TARGET, runner=runner)
    decision = _only_plan(plan_module_profiled(mod, oracle)).yellow[0].decision
    assert decision.source == "measure" and "rpc-local-test" in decision.detail
    entries = list(oracle.database.entries())
    assert len(entries) == 2 and {e.method for e in entries} == {"rpc"}


# ----------------------------------------------------------- two processes measuring at once

_MEASURING_CHILD = """
    import json, sys
    import tvm
    from tvm_fusion.models import transformer_encoder_layer
    from tvm_fusion.compile import import_onnx
    from tvm_fusion.transform import legalize_passes
    from tvm_fusion.tuning.measure import LocalRunner, TimingConfig
    from tvm_fusion.relay_passes.fusion_plan import PlanOptions
    from tvm_fusion.tuning.oracle import ProfilingOracle, make_oracle, plan_module_profiled
    target = tvm.target.Target("llvm")
    with target:
        mod = tvm.transform.Sequential(legalize_passes(target))(
            import_onnx(transformer_encoder_layer(seq=int(sys.argv[2]))))
    runner = LocalRunner(target, TimingConfig(number=1, repeat=3, min_repeat_ms=2))
    oracle = ProfilingOracle(sys.argv[1], "measure", target=target, runner=runner)
    plan = plan_module_profiled(mod, oracle, PlanOptions(attention=False))
    print(json.dumps({"log": oracle.measurer.log, "counts": dict(oracle.counts)}))
"""


@pytest.mark.slow
def test_two_processes_measuring_into_one_database(tmp_path):
    path = tmp_path / "shared.db"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    children = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_MEASURING_CHILD),
                                  str(path), str(seq)], cwd=REPO, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for seq in (64, 64)]  # the same model: both miss, both measure, both merge
    reports = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-2000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    with ProfilingDatabase(path) as db:
        assert db.check() == "ok"
        stored = {(e.kernel_hash, e.variant): e for e in db.entries()}
        for report in reports:
            assert report["log"], report
            for kernel, variant, run_id in report["log"]:
                assert run_id in stored[(kernel, variant)].runs  # nothing lost
        for entry in stored.values():
            assert entry.count == 3 * len(entry.runs)
        # keys are stable across processes: this one finds every candidate the children timed
        oracle = ProfilingOracle(db, "db", target=TARGET)
        plan_module_profiled(_legalized(transformer_encoder_layer(seq=64)), oracle, NO_ATTENTION)
        assert set(oracle.counts) == {"db"}

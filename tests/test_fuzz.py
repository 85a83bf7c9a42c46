"""The differential fuzzer (tvm_fusion.fuzz): a short run, its minimiser, worker and store.

The short run checks a fixed seed range (``TVM_FUSION_FUZZ_SEEDS=A:B`` picks another) against
stock TVM and ONNX Runtime; seeds that hit a bug already reported in issue 17 are xfail (not
strict) with the item in the reason, so the lead can drop each entry as its fix lands.
The long run (``-m slow``) is the issue's acceptance run: >= 2,000 graphs, none wrong, crashed
or timed out.
"""

from __future__ import annotations

import dataclasses
import math
import os
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion.fuzz import Case, differential, draw_case
from tvm_fusion.fuzz.differential import Outcome, check_case_memory, mismatch
from tvm_fusion.fuzz.feeds import SPECIAL_VALUES, make_feeds
from tvm_fusion.fuzz.minimise import minimise
from tvm_fusion.fuzz.run import fuzz, summarise
from tvm_fusion.fuzz.store import Store, load_case, options_from_json, options_to_json, save_case
from tvm_fusion.fuzz.worker import Worker


def _seed_range() -> range:
    text = os.environ.get("TVM_FUSION_FUZZ_SEEDS", "0:60")
    lo, hi = (int(v) for v in text.split(":"))
    return range(lo, hi)


_ITEM1 = "issue 17 item 1: one-element selection (Gather scalar / Slice) as a graph output"
_ITEM2 = "issue 17 item 2: CumSum then an elementwise op: FuseTIR 'Inconsistent buffers'"
_ITEM3 = "issue 17 item 3: fast_math gives non-IEEE results for NaN/inf inputs"
#: Seeds of the short run that hit a known bug (issue 17 items 1-5 or found by the fuzzer and
#: reported with it), with the cause. A fixed seed simply passes; then remove its entry, so
#: that a relapse fails.
KNOWN: dict[int, str] = {}  # every bug the short run found is fixed
#: Each short-run seed's outcome class, for the check after the run.
OUTCOMES: dict[int, str] = {}


@pytest.fixture(scope="module")
def worker():
    with Worker(timeout=60.0) as w:
        yield w


@pytest.mark.parametrize("seed", list(_seed_range()))
def test_short_run(seed, worker):
    case = draw_case(seed)
    outcome = worker.check(case)
    OUTCOMES[seed] = outcome.cls
    if seed in KNOWN and outcome.cls in ("wrong", "crash", "timeout"):
        pytest.xfail(KNOWN[seed])
    assert outcome.cls in ("ok", "skipped"), (
        f"seed {seed} ({outcome.cls}, options {case.options}, special={case.special}): "
        f"{outcome.error}; reproduce with scripts/fuzz.py --seeds {seed}:{seed + 1}")


def test_short_run_mostly_builds():
    """A fault in the harness itself (every build failing the same way) would make each case
    "skipped", and the run above would pass; most cases must really be compared."""
    if len(OUTCOMES) < len(list(_seed_range())):
        pytest.skip("needs the whole short run")
    assert sum(cls == "ok" for cls in OUTCOMES.values()) >= len(OUTCOMES) // 2, OUTCOMES


@pytest.mark.slow
def test_long_run(tmp_path):
    """Issue 17's acceptance run: 2,000 graphs, no wrong result, crash or timeout."""
    store = Store(tmp_path)
    with Worker(timeout=60.0) as w:
        counts = fuzz(range(100_000, 102_000), store, w, do_minimise=False)
    assert sum(counts.values()) == 2000
    bad = {k: v for k, v in counts.items() if k in ("wrong", "crash", "timeout")}
    assert not bad, (counts, summarise(store.records())["groups"])


#: Seeds of the symbolic run that hit a bug not fixed yet (kept in tests/regressions as xfail).
KNOWN_SYMBOLIC = {
    259: "FuseTIR's SymbolicMatcher on min() extents (symbolic_split_min_extent_fusetir)"}


@pytest.mark.slow
def test_symbolic_run(tmp_path):
    """300 graphs whose first input's dim 0 is symbolic: no wrong result, crash or timeout
    beyond :data:`KNOWN_SYMBOLIC` (the first such run found four crashes, now regressions)."""
    store = Store(tmp_path)
    with Worker(timeout=60.0) as w:
        counts = fuzz(range(300), store, w, symbolic_share=1.0, do_minimise=False)
    assert sum(counts.values()) == 300
    bad = [r for r in store.records() if r["class"] in ("wrong", "crash", "timeout")
           and r["seed"] not in KNOWN_SYMBOLIC]
    assert not bad, [(r["seed"], r["class"], r["error"]) for r in bad]


# ---------------------------------------------------------------------------------------------
# Generator and feeds
# ---------------------------------------------------------------------------------------------
def test_cases_are_reproducible_and_valid():
    for seed in range(60):
        a, b = draw_case(seed), draw_case(seed)
        assert a.model.SerializeToString() == b.model.SerializeToString()
        assert a.options == b.options and a.special == b.special
        onnx.checker.check_model(a.model, full_check=True)


def test_generator_covers_the_issue_operators():
    ops = set()
    for seed in range(300):
        ops.update(n.op_type for n in draw_case(seed).model.graph.node)
    wanted = {"Gather", "Slice", "CumSum", "Pad", "Resize", "LayerNormalization",
              "InstanceNormalization", "BatchNormalization", "GroupNormalization", "MatMul",
              "Gemm", "Conv", "ConvTranspose", "Cast", "Split", "TopK", "Exp", "Tanh",
              "Sigmoid", "Erf", "Log", "Softmax", "ReduceSum", "ReduceMax", "ReduceMin",
              "ReduceMean", "ReduceLogSumExp", "Mod"}
    assert wanted <= ops, wanted - ops


def test_generator_draws_qdq_and_fp16_cases():
    """Issue 19, item 2: a share of the cases QDQ-wraps its convs and matmuls (int8 or uint8
    activations, weights per tensor or per channel, int32 biases) and a share is cast to
    float16; each is a valid model."""
    kinds = {"qdq": 0, "fp16": 0, "per_channel": 0, "uint8": 0, "bias": 0}
    for seed in range(300):  # shares of a few percent: enough draws to see each kind
        model = draw_case(seed).model
        ops = [n for n in model.graph.node]
        inits = {t.name: t.data_type for t in model.graph.initializer}
        if any(n.op_type == "QuantizeLinear" for n in ops):
            kinds["qdq"] += 1
            onnx.checker.check_model(model, full_check=True)
            dqs = [n for n in ops if n.op_type == "DequantizeLinear"]
            kinds["per_channel"] += any(inits.get(n.input[0]) == TensorProto.INT8 and any(
                a.name == "axis" for a in n.attribute) for n in dqs)
            kinds["uint8"] += any(inits.get(n.input[2]) == TensorProto.UINT8 for n in dqs
                                  if len(n.input) > 2)
            kinds["bias"] += any(inits.get(n.input[0]) == TensorProto.INT32 for n in dqs)
        elif any(vi.type.tensor_type.elem_type == TensorProto.FLOAT16
                 for vi in model.graph.input):
            kinds["fp16"] += 1
            onnx.checker.check_model(model, full_check=True)
    assert all(count >= 3 for count in kinds.values()), kinds


def test_generator_draws_wide_convs():
    """Convs whose reduction spans several K blocks of the packed GEMM (Zen 3: KC = 256; the
    generic x86 target 448) and whose groups fill the micro-kernel: the int8-epilogue and
    per-group GEMM paths the zoo's QDQ ResNet-18 and wav2vec2 found, reached by the fuzzer."""
    kinds = {"deep": 0, "grouped": 0, "qdq": 0}
    for seed in range(300):
        model = draw_case(seed).model
        weights = {t.name: list(t.dims) for t in model.graph.initializer}
        weights.update({n.output[0]: weights[n.input[0]] for n in model.graph.node
                        if n.op_type == "DequantizeLinear" and n.input[0] in weights})
        for node in model.graph.node:
            if node.op_type != "Conv" or node.input[1] not in weights:
                continue
            out_ch, per_group, *k = weights[node.input[1]]
            if per_group * math.prod(k) >= 2 * 448:
                kinds["deep"] += 1
                kinds["grouped"] += any(a.name == "group" and a.i > 1 for a in node.attribute)
                kinds["qdq"] += node.input[1] not in {t.name for t in model.graph.initializer}
    assert kinds["deep"] >= 10 and kinds["grouped"] >= 2 and kinds["qdq"] >= 1, kinds



def test_generator_draws_gemm_blocks():
    """Two or three GEMMs at the end of the graph with Table 3's M2M→M2M green, so that one
    block holds them (fuzz seeds 1908 and 2274: conv GEMMs writing buffers of one name fell
    back to register tiles), on ``gemm_block_share`` of the cases; the other cases are the
    graphs they were."""
    gemms = {"Conv", "MatMul", "Gemm"}
    drawn = paired = 0
    for seed in range(100):
        case = draw_case(seed, qdq_share=0.0, fp16_share=0.0, weight_only_share=0.0)
        plain = draw_case(seed, qdq_share=0.0, fp16_share=0.0, weight_only_share=0.0,
                          gemm_block_share=0.0)
        if case.model.SerializeToString() == plain.model.SerializeToString() and \
                case.options == plain.options:
            continue
        drawn += 1
        assert case.options["table3"][("M2M", "M2M")] == "green", case.options
        added = sum(n.op_type in gemms for n in case.model.graph.node) - \
            sum(n.op_type in gemms for n in plain.model.graph.node)
        paired += added >= 2
    assert 4 <= drawn <= 20 and paired >= drawn * 2 // 3, (drawn, paired)


def test_generator_draws_weight_only_quantized_matmuls():
    """Issue 21, item 4: a share of the float32 cases reads its MatMul/Gemm weights through
    an int8 or uint8 DequantizeLinear per output channel, activations left in float32 (no
    QuantizeLinear); each is a valid model."""
    kinds = {"weight_only": 0, "uint8": 0, "gemm": 0}
    for seed in range(300):
        model = draw_case(seed).model
        ops = list(model.graph.node)
        if any(n.op_type == "QuantizeLinear" for n in ops):
            continue
        inits = {t.name: t.data_type for t in model.graph.initializer}
        dqs = {n.output[0]: n for n in ops if n.op_type == "DequantizeLinear"}
        read = [n for n in ops if n.op_type in ("MatMul", "Gemm") and n.input[1] in dqs]
        if read:
            kinds["weight_only"] += 1
            onnx.checker.check_model(model, full_check=True)
            kinds["uint8"] += any(inits[dqs[n.input[1]].input[0]] == TensorProto.UINT8
                                  for n in read)
            kinds["gemm"] += any(n.op_type == "Gemm" for n in read)
    assert all(count >= 3 for count in kinds.values()), kinds


def test_special_feeds_plant_edge_values_and_depend_on_name_only():
    model = _chain_model()  # one input of 60 elements
    plain = make_feeds(model, 7)["x"]
    special = make_feeds(model, 7, special=True)["x"]
    assert np.isfinite(plain).all()
    planted = ~np.isclose(special, plain, equal_nan=False)
    assert 0 < planted.sum() < special.size
    assert set(special[planted].tolist()) <= set(SPECIAL_VALUES.tolist()) | {float("nan")}
    # An input's values depend on the seed and its name, not on the other inputs.
    renamed = _chain_model()
    renamed.graph.input.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2]))
    assert np.array_equal(make_feeds(renamed, 7)["x"], plain)


def test_mismatch_is_dtype_and_nan_aware():
    ref = [np.array([np.nan, np.inf, 1.0], np.float32)]
    assert mismatch([ref[0].copy()], ref)[0] is None
    assert mismatch([np.array([0.0, np.inf, 1.0], np.float32)], ref)[0] is not None
    assert mismatch([np.array([np.nan, np.inf, 1.00001], np.float32)], ref)[0] is None
    assert mismatch([np.array([1, 2], np.int64)], [np.array([1, 3], np.int64)])[0] is not None
    half = np.array([1.0, 2.0], np.float16)
    assert mismatch([half + np.float16(0.001)], [half])[0] is None  # 1 ulp of fp16


def test_memory_check_keeps_both_plans_and_fails_a_build_above_stock(monkeypatch):
    """``check_case_memory`` (``scripts/fuzz.py --memory``, issue 20 item 3): an ``ok`` case
    carries both planned byte counts; a default build above stock is a ``memory`` failure."""
    relu = _chain_model()  # its Relu alone: the whole chain is 16 B above stock (a Softmax row)
    del relu.graph.node[1:]
    relu.graph.output.pop(0)
    case = Case(seed=0, model=relu)
    outcome = check_case_memory(case)
    assert outcome.cls == "ok", outcome
    assert 0 < outcome.ours_bytes <= outcome.stock_bytes
    plain, measured = outcome.ours_bytes, differential.planned_memory

    def ours_grows(mod, target, repack=True):  # the tvm_fusion build is measured re-packed
        plan = measured(mod, target, repack)
        return dataclasses.replace(plan, workspace=plan.workspace + 4096) if repack else plan

    monkeypatch.setattr(differential, "planned_memory", ours_grows)
    outcome = check_case_memory(case)
    assert (outcome.cls, outcome.stage) == ("memory", "memory")
    assert outcome.ours_bytes == plain + 4096 > outcome.stock_bytes
    assert "above stock FuseOps'" in outcome.error
    assert outcome.signature() == "memory"


# ---------------------------------------------------------------------------------------------
# Minimiser: a synthetic failure predicate must shrink a graph to the nodes that matter
# ---------------------------------------------------------------------------------------------
def _chain_model() -> onnx.ModelProto:
    """x -> Relu -> Tanh -> Softmax -> Sigmoid -> Neg -> Abs, plus a side branch Exp -> Add."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Tanh", ["a"], ["b"]),
        helper.make_node("Softmax", ["b"], ["c"], axis=-1),
        helper.make_node("Sigmoid", ["c"], ["d"]),
        helper.make_node("Neg", ["d"], ["e"]),
        helper.make_node("Exp", ["x"], ["f"]),
        helper.make_node("Add", ["e", "f"], ["g"]),
        helper.make_node("Mul", ["g", "w"], ["y"]),
    ]
    w = numpy_helper.from_array(np.full((4,), 0.5, np.float32), "w")
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5, 4]),
         helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, 5, 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _softmax_feeds_sigmoid(case: Case) -> bool:
    """The synthetic bug: a Sigmoid reading a Softmax, with schedule=False."""
    made = {o: n.op_type for n in case.model.graph.node for o in n.output}
    hit = any(n.op_type == "Sigmoid" and made.get(n.input[0]) == "Softmax"
              for n in case.model.graph.node)
    return hit and case.options.get("schedule") is False



def test_each_case_plans_with_a_database_of_its_own(monkeypatch):
    """Apollo writes the blocklist entries it learns through to the profiling database: at a
    fixed path the first write created it, later cases planned with it and concurrent fuzz
    processes crashed reading it ("disk I/O error", seeds 2518, 2528, 2541). Each case now
    gets a file of its own, gone afterwards, and the caller's setting is restored."""
    seen = []

    def build(case, inputs, **options):
        seen.append(os.environ["TVM_FUSION_DB"])
        with open(seen[-1], "w") as f:  # what a blocklist write does
            f.write("")
        raise RuntimeError("no build here")

    monkeypatch.setattr(differential, "_build_and_run", build)
    monkeypatch.setenv("TVM_FUSION_DB", "/caller/choice.db")
    for _ in range(2):
        assert differential.check_case(draw_case(3)).cls == "skipped"
    assert len(set(seen)) == 2 and not any(os.path.exists(p) for p in seen), seen
    assert os.environ["TVM_FUSION_DB"] == "/caller/choice.db"


def test_a_packed_gemm_that_falls_back_is_recorded(monkeypatch):
    """A build whose packed GEMM kernel failed (and ran on register tiles) has the right
    values and a slower kernel: the case stays ``ok`` and names the fallback (a C prefetch
    of never-allocated partial sums once sent every one-K-block fp16 conv there)."""
    from tvm_fusion.tir_schedules import fused_block

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((32, 24)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 24])], [weight])
    case = Case(seed=0, model=helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17)]))
    assert differential.check_case(case).fallbacks == []
    real = fused_block.schedule_primfunc

    def packed_gemm_fails(func, params, fast=True, packed_gemm=True, **kwargs):
        if packed_gemm and fused_block.has_packed_gemm(func):
            raise RuntimeError("template broke")
        return real(func, params, fast=fast, packed_gemm=packed_gemm, **kwargs)

    monkeypatch.setattr(fused_block, "schedule_primfunc", packed_gemm_fails)
    outcome = differential.check_case(case)
    assert outcome.cls == "ok", outcome
    assert any("packed GEMM kernel" in f and "template broke" in f for f in outcome.fallbacks)


def test_minimiser_keeps_only_what_the_failure_needs():
    case = Case(seed=0, model=_chain_model(),
                options={"schedule": False, "layout": False, "rewrite": False}, special=True)
    assert _softmax_feeds_sigmoid(case)
    small, checks = minimise(case, _softmax_feeds_sigmoid)
    assert [n.op_type for n in small.model.graph.node] == ["Softmax", "Sigmoid"]
    assert small.options == {"schedule": False}
    assert small.special is False
    (vi,) = small.model.graph.input
    assert [d.dim_value for d in vi.type.tensor_type.shape.dim] == [1, 1, 1]
    onnx.checker.check_model(small.model, full_check=True)
    assert checks < 100


def test_minimiser_rejects_candidates_that_lose_the_failure():
    case = Case(seed=0, model=_chain_model())

    def needs_all(c: Case) -> bool:
        dims = [[d.dim_value for d in vi.type.tensor_type.shape.dim]
                for vi in c.model.graph.input]
        return len(c.model.graph.node) == 8 and len(c.model.graph.output) == 2 and \
            dims == [[3, 5, 4]]

    small, _ = minimise(case, needs_all)
    assert small.model.SerializeToString() == case.model.SerializeToString()


# ---------------------------------------------------------------------------------------------
# Worker: a hang or a dead process costs one case and is blamed on the right stage
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def fake_checkers(tmp_path, monkeypatch):
    (tmp_path / "fuzz_fake_checkers.py").write_text(textwrap.dedent("""
        import os, time
        from tvm_fusion.fuzz.differential import Outcome

        def hang_in_ours(case, on_stage):
            on_stage("reference"); on_stage("stock"); on_stage("ours"); time.sleep(600)

        def hang_in_stock(case, on_stage):
            on_stage("reference"); on_stage("stock"); time.sleep(600)

        def die_in_ours(case, on_stage):
            on_stage("ours"); os._exit(7)

        def fine(case, on_stage):
            return Outcome("ok", "ours")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))  # spawn children inherit sys.path
    return "fuzz_fake_checkers"


@pytest.mark.slow  # ~20 s of waiting for hangs; .ci/run runs it after the default run
def test_worker_classifies_hangs_and_deaths(fake_checkers):
    case = Case(seed=0, model=_chain_model())
    with Worker(timeout=1.0, checker=f"{fake_checkers}:hang_in_ours") as w:
        out = w.check(case)
        assert (out.cls, out.stage) == ("timeout", "ours")
    with Worker(timeout=1.0, checker=f"{fake_checkers}:hang_in_stock") as w:
        assert w.check(case).cls == "skipped"
    with Worker(timeout=5.0, checker=f"{fake_checkers}:die_in_ours") as w:
        out = w.check(case)
        assert out.cls == "crash" and "exit code 7" in out.error
    with Worker(timeout=5.0, checker=f"{fake_checkers}:fine") as w:
        assert w.check(case).cls == "ok"


# ---------------------------------------------------------------------------------------------
# Store
# ---------------------------------------------------------------------------------------------
def test_store_round_trips_cases_and_options(tmp_path):
    options = {"table3": {("O2M", "M2M"): "green"}, "schedule": False}
    assert options_from_json(options_to_json(options)) == options
    case = Case(seed=5, model=_chain_model(), options=options, special=True)
    save_case(tmp_path / "r.onnx", case, Outcome("wrong", "ours", "output 0 ...", 1.5),
              cause="synthetic")
    loaded, side = load_case(tmp_path / "r.onnx")
    assert loaded.options == options and loaded.special and loaded.seed == 5
    assert side["class"] == "wrong" and side["cause"] == "synthetic"
    store = Store(tmp_path / "out")
    store.add({"seed": 3, "class": "ok"})
    assert Store(tmp_path / "out").done_seeds() == {3}


def _attention_case(seed):
    from tvm_fusion.fuzz.generate import Builder, emit_attention

    rng = np.random.default_rng(seed)
    b = Builder(rng)
    x = b.input([1, int(rng.integers(2, 9)), 8])
    out = emit_attention(b, x)
    assert out is not None
    b.add_output(out, list(b.shape(out)))
    return b.model(prune=True)


@pytest.mark.parametrize("seed", [0, 3, 7, 11])
def test_attention_family_builds_and_matches(seed):
    """The fuzzer's attention family (packed Q/K/V, rotate-half, constant causal mask, MatMul
    or torch.export's bmm): the cases of this session's attention fixes, checked like any
    generated graph."""
    from conftest import check_model

    check_model(_attention_case(seed))


@pytest.mark.parametrize("seed", [3, 11])
def test_attention_family_bmm_is_one_attention_block(seed):
    """The bmm form (Expand to the same shape, Reshape of the leading axes around each
    MatMul) is planned as one attention block, as the MatMul form is."""
    import tvm
    from conftest import TARGET

    from tvm_fusion.compile import fuse, import_onnx
    from tvm_fusion.instrument import Collector

    model = _attention_case(seed)
    assert "Expand" in {n.op_type for n in model.graph.node}  # the seed draws the bmm form
    collector = Collector()
    with tvm.transform.PassContext(instruments=[collector]):
        fuse(import_onnx(model), TARGET)
    decisions = [d for p in collector.plans[0].plans.values() for d in p.attention]
    assert [d.chosen for d in decisions] == [True], [d.reason for d in decisions]

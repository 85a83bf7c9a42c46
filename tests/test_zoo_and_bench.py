"""Smoke versions of the zoo table and the benchmark on two small models (the full runs are
documented commands in docs/benchmarks.md)."""

import json

import onnx
import pytest

from tvm_fusion.cli import main
from tvm_fusion.models import get_builtin


@pytest.fixture
def zoo(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("encoder", "figure3"):
        onnx.save(get_builtin(name), folder / f"{name}.onnx")
    return folder


def test_zoo_table(zoo, tmp_path, capsys):
    out = tmp_path / "zoo"
    assert main(["report", "--zoo", "--models-dir", str(zoo), "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads((out / "zoo.json").read_text())}
    # attention: Q·Kᵀ, softmax and ·V one kernel (docs/attention.md)
    assert rows["encoder"]["fused_kernels"] == 9 and rows["encoder"]["stock_kernels"] == 19
    assert rows["figure3"]["fused_kernels"] == 2
    assert rows["encoder"]["compute_intensive"] + rows["encoder"]["memory_intensive"] == 50
    assert rows["encoder"]["max_error_vs_onnx"] < 1e-4
    assert (out / "zoo_kernels.png").stat().st_size > 1000
    assert "| encoder | 50 |" in (out / "zoo.md").read_text()


def test_bench_side_by_side(zoo, tmp_path):
    out = tmp_path / "bench"
    args = ["bench", str(zoo / "figure3.onnx"), str(zoo / "encoder.onnx"), "--repeat", "2",
            "--warmup", "1", "--variants", "tvm-default,tvm_fusion,onnxruntime,pytorch",
            "--out", str(out)]
    assert main(args) == 0
    data = json.loads((out / "bench.json").read_text())
    rows = {(r["model"], r["variant"]): r for r in data["rows"]}
    for model in ("figure3", "encoder"):
        assert rows[(model, "tvm_fusion")]["median_ms"] > 0
        assert rows[(model, "tvm_fusion")]["max_error"] < 1e-4
        assert rows[(model, "onnxruntime")]["max_error"] < 1e-4  # optimised vs plain ORT
        # builtin models have no PyTorch definition: skipped, with the reason
        assert rows[(model, "pytorch")]["note"].startswith("skipped")
    assert (out / "bench.png").exists() and (out / "bench.md").exists()


def test_bench_rejects_unknown_variant(zoo, capsys):
    assert main(["bench", str(zoo / "figure3.onnx"), "--variants", "tensorrt"]) == 2
    assert "unknown bench variant 'tensorrt'" in capsys.readouterr().err


def test_medians_in_turns_alternates_the_order():
    """ABBA rounds: a drifting machine biases neither variant."""
    from tvm_fusion.bench import medians_in_turns

    order = []
    medians = medians_in_turns({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                               warmup=0, repeat=4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert set(medians) == {"a", "b"} and all(v >= 0 for v in medians.values())


def test_bench_cpu_clock_needs_one_thread(zoo, capsys, monkeypatch):
    """The calling thread's CPU time is a call's whole time only with one thread per runtime."""
    monkeypatch.setenv("TVM_NUM_THREADS", "2")
    assert main(["bench", str(zoo / "figure3.onnx"), "--clock", "cpu"]) == 2
    assert "TVM_NUM_THREADS=1" in capsys.readouterr().err


def test_medians_in_turns_reads_the_given_clock():
    from tvm_fusion.bench import medians_in_turns

    ticks = iter(range(100))
    medians = medians_in_turns({"a": lambda: None}, warmup=0, repeat=3,
                               clock=lambda: next(ticks))
    assert medians == {"a": 1000.0}  # every call read the fake clock once before, once after


def test_bench_cache_builds_once_then_loads(zoo, tmp_path, monkeypatch):
    """--build-only fills the cache; the timing run loads those builds (no compile) with the
    same numerics; an edited model is a new key."""
    from tvm_fusion import bench

    cache, model = tmp_path / "cache", zoo / "figure3.onnx"
    assert main(["bench", str(model), "--variants", "tvm-fuseops-sched,tvm_fusion",
                 "--cache", str(cache), "--build-only", "--out", str(tmp_path / "b")]) == 0
    assert len(list(cache.glob("*.so"))) == 2

    def no_compile(*args, **kwargs):
        raise AssertionError("a cached build was compiled again")

    monkeypatch.setattr(bench, "compile_model", no_compile)
    out = tmp_path / "t"
    assert main(["bench", str(model), "--variants", "tvm-fuseops-sched,tvm_fusion,onnxruntime",
                 "--cache", str(cache), "--repeat", "1", "--warmup", "0", "--out", str(out)]) == 0
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert all(r["median_ms"] > 0 and r["max_error"] < 1e-4 for r in rows)

    edited = onnx.load(model)
    edited.doc_string = "another model"
    onnx.save(edited, tmp_path / "figure3.onnx")
    with pytest.raises(AssertionError, match="compiled again"):
        bench.bench_model(tmp_path / "figure3.onnx", variants=("tvm_fusion",), repeat=1,
                          warmup=0, cache_dir=cache)


def test_bench_build_only_needs_a_cache(zoo, capsys):
    assert main(["bench", str(zoo / "figure3.onnx"), "--build-only"]) == 2
    assert "--cache" in capsys.readouterr().err

"""The command line: the demo runs, bad input is one line and exit code 2."""

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tvm_fusion.cli import main


def _run(*args):
    return subprocess.run([sys.executable, "-m", "tvm_fusion.cli", *args],
                          capture_output=True, text=True, timeout=600)


def test_demo_figure3(capsys):
    assert main(["demo", "--model", "figure3", "--why"]) == 0
    out = capsys.readouterr().out
    assert "kernels: stock TVM 5, tvm_fusion 2" in out
    assert "Table 3 red" in out


def test_report_json_and_compile(tmp_path, capsys):
    from tvm_fusion.models import get_builtin

    path = tmp_path / "encoder.onnx"
    onnx.save(get_builtin("encoder"), path)
    assert main(["report", str(path), "--json"]) == 0
    assert '"fused_kernels": 9' in capsys.readouterr().out  # attention: one kernel, not three
    lib = tmp_path / "encoder.so"
    assert main(["compile", str(path), "-o", str(lib)]) == 0
    assert lib.stat().st_size > 0


def _unsupported_model(path):
    node = helper.make_node("NoSuchOp", ["x"], ["y"], domain="example.custom")
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "xy"]
    graph = helper.make_graph([node], "g", vi[:1], vi[1:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("example.custom", 1)])
    onnx.save(model, path)


@pytest.mark.parametrize("case, expected", [
    ("garbage", "not a valid ONNX model"),
    ("missing", "no such file"),
    pytest.param("unsupported", "NoSuchOp", marks=pytest.mark.slow),
    ("option", "unknown tvm_fusion option 'bogus'"),
    ("strategy", "strategy='fastest' is not one of"),
    pytest.param("target", "invalid target", marks=pytest.mark.slow),
])
def test_bad_input_is_one_line_exit_2(tmp_path, case, expected):
    path = tmp_path / "m.onnx"
    args = ["report", str(path)]
    if case == "garbage":
        path.write_bytes(b"this is not protobuf \x00\xff" * 10)
    elif case == "unsupported":
        _unsupported_model(path)
    elif case in ("option", "strategy", "target"):
        from tvm_fusion.models import get_builtin

        onnx.save(get_builtin("figure3"), path)
        args += {"option": ["-O", "bogus=1"], "strategy": ["--strategy", "fastest"],
                 "target": ["--target", "no-such-target"]}[case]
    result = _run(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr


# ---- issue 17 item 6: strict options, one-line errors, a check that knows dtypes and ties

def _tiny_model(path, opset=17, dtype=TensorProto.FLOAT, nodes=None, shape=(2, 3),
                out_shape=None, initializers=()):
    """``y = Relu(x)`` (or ``nodes``) on a tiny tensor: cheap to import, build and check."""
    nodes = nodes or [helper.make_node("Relu", ["x"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, shape)],
                              [helper.make_tensor_value_info("y", dtype, out_shape or shape)],
                              initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _one_line_exit_2(result, expected):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, expected", [
    (["-O", "rewrite=maybe"], "option rewrite='maybe' is not a boolean; accepted: true or false"),
    (["-O", "max_ops_per_block=2.5"],
     "option max_ops_per_block='2.5' is not an integer; accepted: an integer >= 1"),
    pytest.param(["-O", "max_ops_per_block=abc"],
                 "option max_ops_per_block='abc' is not an integer", marks=pytest.mark.slow),
    pytest.param(["-O", "flops_per_byte=abc"], "option flops_per_byte='abc' is not a number",
                 marks=pytest.mark.slow),
    (["-O", 'table3={"O2M,M2M": "blue"}'], "option table3: unknown colour 'blue'; accepted"),
    pytest.param(["-O", "table3=O2M:M2X=green"], "option table3: unknown mapping type 'M2X'",
                 marks=pytest.mark.slow),
    pytest.param(["-O", "record=[]"],
                 "unknown tvm_fusion option 'record' (plans are collected by",
                 marks=pytest.mark.slow),
    pytest.param(["-O", "preset=fastest"],
                 "option preset='fastest' is not one of: conservative, default",
                 marks=pytest.mark.slow),
    (["--target", '{"kind": "llvm",'], "--target: invalid target '{\"kind\": \"llvm\",': "
                                        "not valid JSON (Expecting property name"),
])
def test_bad_option_values_are_one_line_exit_2(tmp_path, args, expected):
    # checked before the model is read: a missing file would be the other error
    _one_line_exit_2(_run("report", str(tmp_path / "never_read.onnx"), *args), expected)


def test_option_values_by_type():
    """What each -O syntax becomes (in-process: the parsing, not a build)."""
    from tvm_fusion.cli import _options, _parser

    def options(*argv):
        return _options(_parser().parse_args(["report", "m.onnx", *argv]))

    assert options("-O", "fast_math=False", "-O", "layout=0", "-O", "rewrite=TRUE",
                   "-O", "max_ops_per_block=8", "-O", "flops_per_byte=2") == {
        "fast_math": False, "layout": False, "rewrite": True, "max_ops_per_block": 8,
        "flops_per_byte": 2.0}
    assert options("-O", "table3=O2M:O2M=green,M2M:O2M=red")["table3"] == {
        ("O2M", "O2M"): "green", ("M2M", "O2M"): "red"}
    assert options("-O", 'table3={"O2M,O2M": "green"}')["table3"] == {("O2M", "O2M"): "green"}
    # --strategy wins when given; otherwise -O strategy is kept (it used to be overwritten)
    assert options("-O", "strategy=apollo")["strategy"] == "apollo"
    assert options("-O", "strategy=apollo", "--strategy", "tvm")["strategy"] == "tvm"
    assert "strategy" not in options()
    # a preset is kept by name (the build expands it); the flags and -O options win over it
    assert options("-O", "preset=aggressive", "--profile", "off") == {
        "preset": "aggressive", "profile": "off"}


def test_options_that_used_to_be_misread_now_work(tmp_path):
    path = _tiny_model(tmp_path / "relu.onnx")
    result = _run("report", str(path), "--no-check", "--json", "-O", "fast_math=False",
                  "-O", "layout=False", "-O", "table3=O2M:O2M=green",
                  "-O", 'table3={"O2M,O2M": "green"}')
    assert result.returncode == 0, result.stderr
    assert '"fused_kernels": 1' in result.stdout


@pytest.mark.slow
def test_compile_creates_missing_output_folders(tmp_path):
    path = _tiny_model(tmp_path / "relu.onnx")
    lib = tmp_path / "does" / "not" / "exist" / "relu.so"
    result = _run("compile", str(path), "-o", str(lib))
    assert result.returncode == 0, result.stderr
    assert lib.stat().st_size > 0
    _one_line_exit_2(_run("compile", str(path), "-o", str(tmp_path)), "is a folder")


@pytest.mark.slow
def test_opset_newer_than_onnx_defines_is_one_line(tmp_path):
    path = _tiny_model(tmp_path / "future.onnx", opset=onnx.defs.onnx_opset_version() + 1)
    _one_line_exit_2(_run("report", str(path)), "is newer than any this onnx")


@pytest.mark.slow
def test_report_of_several_models_goes_on_past_a_bad_one(tmp_path):
    """One bad file among several: one line naming it, the other models reported, exit 2."""
    good = [_tiny_model(tmp_path / f"{n}.onnx") for n in ("a", "c")]
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    unsupported = tmp_path / "unsupported.onnx"
    _unsupported_model(unsupported)
    result = _run("report", str(good[0]), str(bad), str(unsupported), str(good[1]), "--no-check")
    assert result.returncode == 2, result.stderr
    errors = [line[line.index("tvm-fusion: error:"):] for line in result.stderr.splitlines()
              if "tvm-fusion: error:" in line]  # (after the progress bar's text, if any)
    assert len(errors) == 2, result.stderr
    assert "bad.onnx" in errors[0] and "not a valid ONNX model" in errors[0]
    assert "unsupported.onnx" in errors[1]
    assert "Traceback" not in result.stderr
    assert result.stdout.count("model a:") == 1 and result.stdout.count("model c:") == 1


@pytest.mark.slow
def test_report_checks_fp16_with_fp16_tolerances(tmp_path):
    """MatMul -> Tanh -> Mul in fp16: TVM (stock and ours, bit-identical) and ONNX Runtime
    differ by a few fp16 ulps (max 0.047 at 17.2), which fp32 tolerances called a failure."""
    from onnx import numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float16), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Tanh", ["m"], ["t"]),
             helper.make_node("Mul", ["t", "m"], ["y"])]
    path = _tiny_model(tmp_path / "fp16.onnx", dtype=TensorProto.FLOAT16, nodes=nodes,
                       shape=(8, 64), out_shape=(8, 32), initializers=[w])
    result = _run("report", str(path))
    assert result.returncode == 0, result.stderr
    assert "numerics:" in result.stdout


def test_check_outputs_by_dtype_and_ties():
    from tvm_fusion.report import check_outputs

    ref = np.linspace(-4, 4, 64, dtype=np.float16)
    two_ulp = np.nextafter(np.nextafter(ref, np.float16(np.inf)), np.float16(np.inf))
    far = ref + np.float16(1)
    assert check_outputs([two_ulp], [far], [ref]) == []  # fp16 tolerance, no help from stock
    with pytest.raises(AssertionError, match="output 0 .*float32.* out of tolerance"):
        as32 = [a.astype(np.float32) for a in (two_ulp, ref, ref)]  # stock TVM exact
        check_outputs(*[[a] for a in as32])
    # ... unless stock TVM's own error is as large (its fp16 accumulation, a QDQ tie)
    notes = check_outputs([two_ulp.astype(np.float32)], [two_ulp.astype(np.float32) + 1e-3],
                          [ref.astype(np.float32)])
    assert len(notes) == 1 and "no larger than stock TVM's own" in notes[0]
    # TopK indices: a tie broken another way than ONNX Runtime, as stock TVM does
    vals = np.zeros((2, 2), np.float32)
    idx_ort, idx_tvm = np.array([[0, 1], [2, 3]]), np.array([[1, 0], [2, 3]])
    notes = check_outputs([vals, idx_tvm], [vals, idx_tvm], [vals, idx_ort])
    assert len(notes) == 1 and notes[0].startswith("output 1 differs from ONNX Runtime")
    # ... but an index that neither stock TVM nor the reference has is a failure
    with pytest.raises(AssertionError, match=r"output 1 .*int64.*differs from it by at most 1"):
        check_outputs([vals, idx_tvm], [vals, idx_ort], [vals, idx_ort])


def test_reference_that_cannot_run_is_one_line(tmp_path, monkeypatch):
    from tvm_fusion import report
    from tvm_fusion.compile import ModelError

    def refuse(model, feeds):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : no kernel\nmore C++ detail")

    monkeypatch.setattr(report, "reference_outputs", refuse)
    model = onnx.load(_tiny_model(tmp_path / "relu.onnx"))
    with pytest.raises(ModelError, match=r"cannot run the model \(\[ONNXRuntimeError\].*"
                                         r"no kernel\); --no-check skips the check$"):
        report.make_report(model, "relu")


@pytest.mark.parametrize("error, code, expected", [
    (ValueError("bad input\nsecond line"), 2, "tvm-fusion: error: bad input"),
    (PermissionError(13, "Permission denied"), 2, "tvm-fusion: error: [Errno 13]"),
    (RuntimeError("Traceback (most recent call last):\n  0: f\nInternalError: boom"), 1,
     "tvm-fusion: error: InternalError: boom (internal error RuntimeError; "
     "TVM_FUSION_TRACEBACK=1"),
    (KeyError("k"), 1, "tvm-fusion: error: 'k' (internal error KeyError"),
])
def test_every_error_is_one_line(monkeypatch, capsys, error, code, expected):
    import tvm_fusion.cli as cli
    from tvm_fusion.tuning import db_cli, tune_cli

    def fail(_args):
        raise error

    monkeypatch.delenv("TVM_FUSION_TRACEBACK", raising=False)
    for module, command in ((cli, "_cmd_demo"), (cli, "_cmd_report"), (cli, "_cmd_compile"),
                            (cli, "_cmd_bench"), (tune_cli, "_cmd_tune"), (db_cli, "_cmd_stats")):
        monkeypatch.setattr(module, command, fail)
    for argv in (["demo"], ["report", "m.onnx"], ["compile", "m.onnx", "-o", "m.so"],
                 ["bench", "m.onnx"], ["db", "stats"],
                 ["tune", "m.onnx", "--tracker", "h:1", "--key", "k", "--work-dir", "w"]):
        assert main(argv) == code
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(expected), err


# ---- issue 19 item 5: a missing device, runtime or code generator; rank-0 inputs

def _run_env(*args, **env):
    import os

    return subprocess.run([sys.executable, "-m", "tvm_fusion.cli", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})


def _scalar_model(path, nodes, out_shape=(2, 3), scalar_dtype=TensorProto.FLOAT,
                  initializers=()):
    """``x`` [2, 3] and a rank-0 input ``s`` feeding ``nodes``."""
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                     helper.make_tensor_value_info("s", scalar_dtype, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_shape))],
        initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_report_on_a_gpu_target_without_the_gpu_is_one_line(tmp_path):
    import tvm

    if _can_run_cuda():
        pytest.skip("this TVM and machine can run CUDA")
    # the PyPI wheel has no CUDA runtime at all; a CUDA build of TVM may lack only the GPU
    cause = ("has no CUDA runtime (device_api.cuda is not registered)"
             if tvm.get_global_func("device_api.cuda", allow_missing=True) is None
             else "no CUDA device on this machine")
    path = _tiny_model(tmp_path / "relu.onnx")
    for target in ("cuda", '{"kind": "cuda", "arch": "sm_80"}'):
        # the kind is read off the text: no nvcc warnings from building a Target come first
        result = _run("report", str(path), "--target", target)
        _one_line_exit_2(result, "the report runs the model to check it: pass --no-check")
        assert cause in result.stderr
    _one_line_exit_2(_run("bench", str(path), "--target", "cuda"), cause)


def _can_run_cuda() -> bool:
    import tvm

    return (tvm.get_global_func("device_api.cuda", allow_missing=True) is not None
            and tvm.cuda(0).exist)


def test_bench_onnxruntime_variant_without_onnxruntime_is_one_line(tmp_path):
    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "onnxruntime.py").write_text("raise ImportError('No module named onnxruntime')\n")
    import os

    path = _tiny_model(tmp_path / "relu.onnx")
    pythonpath = os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH")) if p)
    _one_line_exit_2(_run_env("bench", str(path), "--variants", "tvm_fusion,onnxruntime",
                              "--out", str(tmp_path / "out"), PYTHONPATH=pythonpath),
                     "bench variant 'onnxruntime' needs onnxruntime, which cannot be imported "
                     "(No module named onnxruntime): pip install onnxruntime, or leave it out")


def test_bench_default_variants_skip_a_missing_onnxruntime(tmp_path, monkeypatch):
    from tvm_fusion import bench

    monkeypatch.setattr(bench, "onnxruntime_missing", lambda: "No module named 'onnxruntime'")
    (row,) = bench.bench_model(_tiny_model(tmp_path / "relu.onnx"), variants=["onnxruntime"],
                               repeat=1, warmup=0)
    assert row.median_ms is None and "onnxruntime cannot be imported" in row.note


def test_rank0_inputs_build_check_and_name_their_errors(tmp_path):
    from onnx import numpy_helper

    ones = numpy_helper.from_array(np.array([1, 1], dtype=np.int64), "shape11")
    ok = _scalar_model(tmp_path / "scalar.onnx", [
        helper.make_node("Mul", ["x", "s"], ["m"]),
        helper.make_node("Reshape", ["s", "shape11"], ["r"]),
        helper.make_node("Add", ["m", "r"], ["y"])], initializers=[ones])
    result = _run("report", str(ok))
    assert result.returncode == 0, result.stderr
    assert "numerics:" in result.stdout
    _one_line_exit_2(_run("report", str(ok), "--input-shape", "s=1"),
                     "input shape s=1: s is a scalar (rank 0), it has no shape to give")
    # a rank-0 tensor as Reshape's shape: the model is invalid (ONNX Runtime refuses it too);
    # the line names the operator and ONNX's reason, not TVM's importer internals
    bad = _scalar_model(tmp_path / "bad.onnx", [helper.make_node("Reshape", ["x", "s"], ["y"])],
                        out_shape=(6,), scalar_dtype=TensorProto.INT64)
    _one_line_exit_2(_run("report", str(bad)), "invalid ONNX model at ONNX node 'y' (Reshape): "
                                               "shape input must be 1D tensor")


@pytest.mark.parametrize("kind", ["vulkan", pytest.param("metal", marks=pytest.mark.slow)])
def test_a_target_without_a_code_generator_is_named(tmp_path, kind):
    import tvm

    from tvm_fusion.compile import import_onnx

    path = _tiny_model(tmp_path / "relu.onnx")
    mod = import_onnx(onnx.load(path))
    target = tvm.target.Target({"kind": kind})
    if tvm.get_global_func(f"target.build.{kind}", allow_missing=True) is not None:
        tvm.compile(mod, target, relax_pipeline="tvm_fusion")  # this wheel has it: it builds
        return
    name = {"vulkan": "Vulkan", "metal": "Metal"}[kind]
    with pytest.raises(ValueError, match=f"has no {name} code generator"):
        tvm.compile(mod, target, relax_pipeline="tvm_fusion")
    _one_line_exit_2(_run("compile", str(path), "--target", kind, "-o", str(tmp_path / "m.so")),
                     f"the installed TVM ({tvm.__version__}) has no {name} code generator "
                     f"(target.build.{kind} is not registered)")


def test_devices_read_the_kind_without_building_a_target(tmp_path):
    import tvm

    from tvm_fusion.devices import require_codegen, require_device, target_kind
    from tvm_fusion.report import make_report

    assert target_kind("cuda -arch=sm_80") == "cuda"
    assert target_kind('{"kind": "vulkan"}') == "vulkan"
    assert target_kind({"kind": "metal"}) == "metal"
    assert target_kind(tvm.target.Target("llvm")) == "llvm"
    assert target_kind('{"kind": ') == ""  # to_target names the bad JSON
    require_device("llvm")
    require_codegen({"kind": "llvm", "mcpu": "znver4"})
    if not _can_run_cuda():  # the library says it too, before any build
        model = onnx.load(_tiny_model(tmp_path / "relu.onnx"))
        with pytest.raises(ValueError, match=r"CUDA (runtime|device).*pass check=False"):
            make_report(model, "relu", "cuda")


def test_compile_tuned_keeps_the_tuning_target_when_none_is_given(monkeypatch, tmp_path):
    """``compile --tuned DIR`` with no ``--target`` builds for the target DIR was tuned for (a
    phone's), not for this machine's CPU, which is every other command's default."""
    from tvm_fusion import cli
    from tvm_fusion.tuning import tune_cli

    seen = {}
    monkeypatch.setattr(tune_cli, "compile_tuned_cmd",
                        lambda model, tuned, out, target, options: seen.update(target=target))
    out = str(tmp_path / "model.so")
    assert cli.main(["compile", "m.onnx", "--tuned", str(tmp_path), "-o", out]) == 0
    assert seen["target"] is None
    assert cli.main(["compile", "m.onnx", "--tuned", str(tmp_path), "-o", out,
                     "--target", "llvm"]) == 0
    assert seen["target"] == "llvm"

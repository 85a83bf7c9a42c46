"""The command line: the demo runs, bad input is one line and exit code 2."""

import subprocess
import sys

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
    assert '"fused_kernels": 11' in capsys.readouterr().out
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
    ("unsupported", "NoSuchOp"),
    ("option", "unknown tvm_fusion option 'bogus'"),
    ("strategy", "strategy='fastest' is not one of"),
    ("target", "invalid target"),
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

"""The text report stays readable (issue 25, item 4): TVM's native warnings that say nothing to
a user stay out of it, and ``--why`` prints one line per rejection pattern with a count."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_cli import _run

from tvm_fusion.models import get_builtin
from tvm_fusion.report import group_rejections, operator_kind


def _two_gathers(path):
    """An embedding table read by two Gathers: TVM legalises each as take(mode="fast"), which
    logs "Fast mode segfaults when there are out-of-bounds indices" from C++ per Gather."""
    table = numpy_helper.from_array(np.arange(128, dtype=np.float32).reshape(16, 8), "emb")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["a"], name="g0", axis=0),
         helper.make_node("Gather", ["emb", "ids"], ["b"], name="g1", axis=0),
         helper.make_node("Add", ["a", "b"], ["y"], name="add")],
        "gathers", [helper.make_tensor_value_info("ids", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [table])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.mark.slow
def test_take_fast_mode_warning_kept_out_of_report(tmp_path):
    path = tmp_path / "gathers.onnx"
    _two_gathers(path)
    proc = _run("report", str(path))  # with the check: stock and tvm_fusion builds both run
    assert proc.returncode == 0, proc.stderr
    assert "Fast mode segfaults" not in proc.stdout + proc.stderr
    assert proc.stdout.startswith("model gathers:")


def test_other_native_lines_still_reach_stderr(capfd):
    import os

    from tvm_fusion.native_log import filtered_stderr

    with filtered_stderr():
        os.write(2, b"[x] Warning: Fast mode segfaults when there are out-of-bounds indices\n")
        os.write(2, b"a warning that matters\n")
    assert capfd.readouterr().err == "a warning that matters\n"


def test_why_groups_repeated_rejections(tmp_path):
    path = tmp_path / "encoder.onnx"
    onnx.save(get_builtin("encoder"), path)
    proc = _run("report", str(path), "--no-check", "--why")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "rejected pairs:" in line)
    end = next(i for i, line in enumerate(lines) if "yellow" in line)
    # (the attention block, docs/attention.md, leaves 11 of the 14 pairs Table 3 alone rejects)
    assert lines[start].startswith("  rejected pairs: 11, in 9 patterns")
    body = lines[start + 1:end]
    assert len(body) == 9
    # both LayerNorms' mean-subtract -> power rejection: one line, counted twice
    assert ("      2x fused_mean_subtract[M2M] -> power[O2O]: [red_cell] Table 3 red: block M2M "
            "then M2M" in body)
    assert sum(int(line.split("x", 1)[0]) for line in body) == 11
    assert not any("lv" in line.split(":")[0] for line in body)  # no Relax variables


def test_group_rejections_counts_patterns():
    rows = [{"first": f"lv{i}=fused_matmul{i}_add[M2M]", "second": f"lv{i + 1}=softmax[M2M]",
             "reason": "red_cell", "detail": "Table 3 red"} for i in range(3)]
    rows.append({"first": "lv9=conv2d[M2M]", "second": "lv10=relu1[O2O]", "reason": "cycle",
                 "detail": "cycle"})
    assert group_rejections(rows) == {
        ("fused_matmul_add[M2M]", "softmax[M2M]", "[red_cell] Table 3 red"): 3,
        ("conv2d[M2M]", "relu[O2O]", "[cycle] cycle"): 1}
    assert operator_kind("fused_mean_add4_tir_sqrt_divide_multiply_add2[M2M]") == \
        "fused_mean_add_tir_sqrt_divide_multiply_add[M2M]"

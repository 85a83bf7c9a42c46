"""The plan's picture (issue 25): one offline HTML file, one cluster per kernel of the report,
every rejection reason on its edge, stock FuseOps' kernels as the second view."""

import html
import re

import onnx
import pytest

from tvm_fusion.cli import main
from tvm_fusion.models import get_builtin
from tvm_fusion.relay_passes.rejection import describe
from tvm_fusion.report import make_report
from tvm_fusion.visualize import picture


@pytest.fixture(scope="module", params=["encoder", "figure3"])
def drawn(request):
    artifacts: dict = {}
    report = make_report(get_builtin(request.param), request.param, "llvm", check=False,
                         artifacts=artifacts)
    page = picture(artifacts["plan"], artifacts["stock_mod"], request.param,
                   report.fused_kernels).html
    return report, page


def _view(page: str, name: str) -> str:
    start = page.index(f'data-view="{name}"')
    return page[start:page.index("</svg>", start)]


def test_page_is_one_offline_file(drawn):
    _, page = drawn
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "http" not in page and "src=" not in page and "@import" not in page
    assert not re.search(r"url\((?!#)", page)  # only the in-page arrow marker
    assert page.count("<script") == 2  # the kernel counts (JSON) and the toggle, both inline


def test_one_cluster_per_fused_kernel(drawn):
    report, page = drawn
    ours = _view(page, "tvm_fusion")
    assert ours.count('class="cluster"') == report.fused_kernels
    assert f'data-kernels="{report.fused_kernels}"' in ours
    # every operator of the report's blocks is drawn inside its kernel's cluster
    assert ours.count('class="op"') == sum(len(b.operators) for b in report.blocks)


def test_every_rejection_reason_is_on_an_edge_and_in_the_table(drawn):
    report, page = drawn
    assert report.rejections
    ours = _view(page, "tvm_fusion")
    table = page[page.index("<table>"):page.index("</table>")]
    for r in report.rejections:
        reason = html.escape(describe(r["reason"], r["detail"]), quote=True)
        assert f": {reason}</title>" in ours, r
        assert f"<td>{reason}</td>" in table, r
    assert table.count("<tr data-edge=") == ours.count('class="cut"')


def test_stock_view_has_its_kernel_count(drawn):
    report, page = drawn
    stock = _view(page, "stock")
    assert f'data-kernels="{report.stock_kernels}"' in stock
    assert stock.count('class="cluster"') == report.stock_kernels
    assert f'"stock": {report.stock_kernels}' in page
    assert f"stock FuseOps {report.stock_kernels} kernels" in page
    assert 'id="toggle"' in page


def test_report_html_flag_writes_the_page(tmp_path, capsys):
    model = tmp_path / "figure3.onnx"
    onnx.save(get_builtin("figure3"), model)
    out = tmp_path / "sub" / "plan.html"
    assert main(["report", str(model), "--no-check", "--html", str(out)]) == 0
    page = out.read_text()
    assert _view(page, "tvm_fusion").count('class="cluster"') == 2
    assert not list(out.parent.glob(".*.tmp"))  # the atomic write left no temp file
    capsys.readouterr()
    assert main(["report", str(model), "--no-check", "--html", str(tmp_path)]) == 2
    assert "--html" in capsys.readouterr().err
    assert main(["report", str(model), str(model), "--html", str(out)]) == 2


def test_visualize_renders_inline_and_saves_the_same_document(tmp_path):
    import tvm_fusion

    shown = tvm_fusion.visualize(get_builtin("figure3"), "llvm", title="figure3")
    assert shown._repr_html_() == shown.html
    path = tmp_path / "plan.html"
    shown.save(path)
    assert path.read_text() == shown._repr_html_()
    assert "tvm_fusion 2 kernels" in shown.html and "stock FuseOps 5 kernels" in shown.html


def test_operators_carry_their_onnx_node_names(drawn):
    """TVM's importer drops ONNX node names; the picture gets them back (tvm_fusion.onnx_names):
    operators show the nodes they came from, the search box finds them."""
    report, page = drawn
    view = _view(page, "tvm_fusion")
    names = re.findall(r'<text[^>]*class="onnx">([^<]*)</text>', view)
    # conv packing's layout transforms come from no ONNX node; operators rewriting created
    # (a packed Q/K/V projection) carry a name only where they replace a named one
    inserted = len(re.findall(r'<g class="op"[^>]*><title>[^<]*(inserted by a pass|created by '
                              r'rewriting)', view))
    ops = view.count('<g class="op"') - inserted
    assert len(names) >= 0.8 * ops, f"{len(names)} of {ops} operators have an ONNX name"
    expected = {"encoder": "attention.softmax", "figure3": "conv"}[report.name]
    assert any(expected in html.unescape(n) for n in names)
    assert 'data-name="' in view and expected in view.lower()


def test_onnx_names_ride_on_spans_and_change_nothing_else():
    """The named import is TVM's import (structurally equal), each binding spanned by its ONNX
    node; a node's helper bindings (a Conv's bias reshape) take that node's name."""
    import tvm

    from tvm_fusion.compile import import_onnx
    from tvm_fusion.models.cnn import inverted_residual_net
    from tvm_fusion.onnx_names import node_names

    model = inverted_residual_net(size=16)
    named = import_onnx(model, node_names=True)
    tvm.ir.assert_structural_equal(named, import_onnx(model))
    bindings = [b for block in named["main"].body.blocks for b in block.bindings]
    onnx_nodes = {n.name for n in model.graph.node}
    assert all(node_names(b.var) and set(node_names(b.var)) <= onnx_nodes for b in bindings)
    convs = [b for b in bindings if node_names(b.var) == ["/features.0/Conv"]]
    assert len(convs) >= 2  # the conv and its bias


def test_smartmem_removed_layout_operators_are_listed():
    """Swin's window attention: SmartMem folds its reshapes, transposes and Gathers into the
    loads of the operators that read them; the page lists each with its ONNX node and the
    operator that now does its indexing, as many as the elimination's record counts."""
    from tvm_fusion.models.swin import swin_window_attention

    artifacts: dict = {}
    model = swin_window_attention(resolution=14, channels=32, heads=2, window=7)
    report = make_report(model, "swin", "llvm", check=False, artifacts=artifacts)
    eliminated = sum(b.eliminated for b in artifacts["layout_blocks"])
    page = picture(artifacts["plan"], artifacts["stock_mod"], "swin", report.fused_kernels,
                   artifacts["layout_blocks"]).html
    table = page[page.index('<table id="removed">'):]
    table = table[:table.index("</table>")]
    assert eliminated >= 10 and table.count('<tr class="removed"') == eliminated
    assert f"{eliminated} layout operators removed" in page
    assert "Transpose" in table and "eliminate 1st" in table


def test_profiled_pairs_show_their_times():
    """A yellow cell decided by timings (the profiling database) shows fused vs apart on its
    edge and in its table; the analytic default shows nothing there."""
    import tvm

    from tvm_fusion.compile import fuse, import_onnx
    from tvm_fusion.instrument import Collector
    from tvm_fusion.relay_passes.fusion_plan import Decision, YellowDecision
    from tvm_fusion.visualize import plan_graph, render_html

    collector = Collector()
    with tvm.transform.PassContext(instruments=[collector]):
        fuse(import_onnx(get_builtin("encoder")), "llvm")
    plan = next(iter(collector.plans[0].plans.values()))
    a = next(n for n in plan.ecg.nodes if n.succs)
    b = plan.ecg.nodes[a.succs[0]]
    plan.yellow.append(YellowDecision(a.describe(), b.describe(), Decision(
        True, "db", "fused 10.0 us vs split 14.0 us (median of 20/20 runs)")))
    graph = plan_graph(collector.plans[0])
    assert [(verdict, detail) for _, _, verdict, detail in graph.profiled] == [
        ("fused", "db: fused 10.0 us vs split 14.0 us (median of 20/20 runs)")]
    page = render_html(graph, graph)
    assert _view(page, "tvm_fusion").count('class="profiled"') == 1
    assert "1 pairs a profile decided" in page
    assert "fused 10.0 us vs split 14.0 us" in page

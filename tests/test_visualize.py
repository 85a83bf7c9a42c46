"""The plan's picture (issue 25): one offline HTML file, one cluster per kernel of the report,
every rejection reason on its edge, stock FuseOps' kernels as the second view, laid out by
Graphviz's dot, kernels collapsible to one node. Without ``dot`` those tests skip (``.ci/run``
installs Debian's ``graphviz``); the one-line error without it is tested everywhere."""

import html
import os
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import onnx
import pytest

from tvm_fusion import graph_layout
from tvm_fusion.cli import main
from tvm_fusion.export_models import MODELS as ZOO
from tvm_fusion.models import get_builtin
from tvm_fusion.relay_passes.rejection import describe
from tvm_fusion.report import make_report
from tvm_fusion.target import host_target
from tvm_fusion.visualize import picture

needs_dot = pytest.mark.skipif(shutil.which("dot") is None,
                               reason="no Graphviz dot on PATH (apt-get install graphviz)")


@pytest.fixture(scope="module", params=["encoder", "figure3"])
def drawn(request):
    if shutil.which("dot") is None:
        pytest.skip("no Graphviz dot on PATH (apt-get install graphviz)")
    artifacts: dict = {}
    report = make_report(get_builtin(request.param), request.param, "llvm", check=False,
                         artifacts=artifacts)
    page = picture(artifacts["plan"], artifacts["stock_mod"], request.param,
                   report.fused_kernels).html
    return report, page


def _view(page: str, name: str) -> str:
    start = page.index(f'data-view="{name}"')
    return page[start:page.index("</svg>", start)]


def _svg(page: str, name: str) -> ET.Element:
    """One view's ``<svg>`` as XML (the page writes it well-formed)."""
    at = page.index(f'data-view="{name}"')
    return ET.fromstring(page[page.rindex("<svg", 0, at):page.index("</svg>", at) + 6])


def _box(rect: ET.Element) -> tuple[float, float, float, float]:
    return tuple(float(rect.get(k)) for k in ("x", "y", "width", "height"))


def _inside(inner, outer) -> bool:
    (x, y, w, h), (X, Y, W, H) = inner, outer
    return X <= x and Y <= y and x + w <= X + W + 0.1 and y + h <= Y + H + 0.1


def _apart(a, b) -> bool:
    return a[0] + a[2] <= b[0] or b[0] + b[2] <= a[0] or a[1] + a[3] <= b[1] or b[1] + b[3] <= a[1]


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


@needs_dot
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


@needs_dot
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


@needs_dot
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


@needs_dot
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


def test_views_are_laid_out_by_dot(drawn):
    """Both views come from Graphviz's dot: clusters never overlap, every operator sits inside
    its kernel's cluster, edges are dot's splines (cubic segments) ending in an arrow."""
    _, page = drawn
    for name in ("tvm_fusion", "stock"):
        svg = _svg(page, name)
        assert svg.get("data-layout") == "dot"
        clusters = {g.get("data-kernel"): _box(g.find("rect"))
                    for g in svg.iter("g") if g.get("class") == "cluster"}
        boxes = list(clusters.values())
        assert all(_apart(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
        ops = [g for g in svg.iter("g") if g.get("class") == "op"]
        assert ops and all(_inside(_box(g.find("rect")), clusters[g.get("data-kernel")])
                           for g in ops)
        paths = [p for p in svg.iter("path") if p.get("class") in ("cut", "in", "link")]
        assert paths and all(re.fullmatch(r"M[-\d.,]+(L[-\d.,]+)?(C[-\d., ]+)+(L[-\d.,]+)?",
                                          p.get("d")) for p in paths)
        assert all(p.get("marker-end") == "url(#arrow)" for p in paths)


def test_kernels_collapse_to_one_node(drawn):
    """Each kernel of several operators has its fold: one node (hidden until its cluster is
    clicked) over exactly the cluster's box, saying how many operators it holds and naming
    them; a one-operator kernel has none. The page carries the controls."""
    report, page = drawn
    svg = _svg(page, "tvm_fusion")
    clusters = {g.get("data-kernel"): g for g in svg.iter("g") if g.get("class") == "cluster"}
    folds = {g.get("data-kernel"): g for g in svg.iter("g") if g.get("class") == "fold"}
    several = {k for k, g in clusters.items() if int(g.get("data-ops")) > 1}
    assert several and set(folds) == several
    sizes = {str(i): len(b.operators) for i, b in enumerate(report.blocks)}
    for k, fold in folds.items():
        assert _box(fold.find("rect")) == _box(clusters[k].find("rect"))
        lines = [t.text for t in fold.iter("text")]
        assert lines[1].startswith(f"{sizes[k]} operators, one kernel")
        ops = [g for g in svg.iter("g") if g.get("class") == "op" and g.get("data-kernel") == k]
        assert len(ops) == sizes[k]
    assert list(svg)[-1].get("class") == "fold"  # folds are drawn last: over edges and ops
    for control in ('id="collapse"', 'id="expand"', 'id="search"', 'id="hits"'):
        assert control in page


def test_search_covers_names_variables_and_onnx_nodes(drawn):
    _, page = drawn
    svg = _svg(page, "tvm_fusion")
    for g in (g for g in svg.iter("g") if g.get("class") == "op"):
        name = g.get("data-name")
        label = g.find("text").text.rstrip("…")
        assert name == name.lower() and label.lower() in name
        onnx_text = g.find("text[@class='onnx']")
        if onnx_text is not None:
            assert onnx_text.text.rstrip("…").lower() in name


def test_graph_layout_places_clusters_apart():
    """graph_layout alone: a cluster of two nodes and one of one node (given to dot as a node
    with room for its header), an edge inside and one between."""
    sizes = {0: (100.0, 30.0), 1: (100.0, 30.0), 2: (100.0, 30.0)}
    clusters = {0: ([0, 1], "#0 M2M"), 1: ([2], "#1 O2O")}
    assert "subgraph cluster_0" in graph_layout.to_dot(sizes, clusters, {})
    if shutil.which("dot") is None:
        pytest.skip("no Graphviz dot on PATH (apt-get install graphviz)")
    laid = graph_layout.layout(sizes, clusters, {7: (0, 1), 8: (1, 2)})
    assert set(laid.clusters) == {0, 1} and set(laid.edges) == {7, 8}
    assert _apart(laid.clusters[0], laid.clusters[1])
    for n, k in ((0, 0), (1, 0), (2, 1)):
        assert _inside((*laid.nodes[n], *sizes[n]), laid.clusters[k])
    assert laid.nodes[0][1] < laid.nodes[1][1] < laid.nodes[2][1]  # top to bottom
    assert laid.clusters[1][3] >= 30 + graph_layout.HEAD  # the one-node cluster has its header


def test_without_dot_one_line_naming_the_package(tmp_path, monkeypatch, capsys):
    """No Graphviz: visualize raises, report --html exits 2 with one line naming the package,
    before any planning (nothing printed, nothing written)."""
    import tvm_fusion

    model = tmp_path / "figure3.onnx"
    onnx.save(get_builtin("figure3"), model)
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot there
    with pytest.raises(graph_layout.GraphvizMissing, match="apt-get install graphviz"):
        tvm_fusion.visualize(str(model))
    out = tmp_path / "plan.html"
    assert main(["report", str(model), "--no-check", "--html", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "Graphviz" in err[0] and "apt-get install graphviz" in err[0]


ZOO_DIR = Path(os.environ.get("TVM_FUSION_MODELS", Path(__file__).parent.parent / "models"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_page_draws_one_cluster_per_kernel_of_the_report(name):
    """Issue 25: on every zoo model present, the page's clusters are the report's kernels."""
    path = ZOO_DIR / f"{name}.onnx"
    if shutil.which("dot") is None or not path.exists():
        pytest.skip(f"needs Graphviz dot and {path} (python -m tvm_fusion.export_models)")
    artifacts: dict = {}
    report = make_report(onnx.load(path), name, host_target(), check=False,
                         artifacts=artifacts)
    page = picture(artifacts["plan"], artifacts["stock_mod"], name, report.fused_kernels).html
    assert _view(page, "tvm_fusion").count('class="cluster"') == report.fused_kernels
    assert _view(page, "stock").count('class="cluster"') == report.stock_kernels

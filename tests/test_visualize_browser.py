"""The plan's page in a real browser (issue 25, items 2 and 5): headless Chromium opens the
encoder's page, and a GPT-2-sized one; a check script appended to a copy of each counts the drawn
clusters, clicks a rejected edge and reads the reason its table row shows, collapses a kernel
to one node and expands it, searches by ONNX node name, and writes the results into the DOM,
which ``--dump-dom`` prints. Console errors are caught in the page (``window.onerror``,
``console.error``) and in Chromium's log. A screenshot of the page goes to a tmp folder.

Pages written elsewhere (``tvm-fusion report X.onnx --html X.html``: the zoo's GPT-2, a GPT-2
with its head from ``scripts/export_gpt2_lm_head.py``) are checked the same way, open time
included, when named in ``TVM_FUSION_PLAN_PAGES`` (paths separated by ``:``).

Slow-marked (a browser start is a few seconds); skipped, with the reason, without Chromium or
Graphviz (``.ci/run`` installs Debian's ``chromium`` and ``graphviz``).
"""

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tvm_fusion.models import get_builtin
from tvm_fusion.relay_passes.rejection import describe
from tvm_fusion.report import make_report
from tvm_fusion.visualize import Cluster, Graph, kernel_graph, plan_graph, render_html

pytestmark = pytest.mark.slow

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)
FLAGS = ["--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--enable-logging=stderr", "--v=0"]
OPEN_S, WRITE_S = 3.0, 10.0  # issue 25: a GPT-2 page writes in under 10 s, opens in under 3 s
GPT2_LAYERS = 48  # encoder layers tiled: about GPT-2's operator count with its head (~900)
EXTRA_PAGES = [Path(p) for p in os.environ.get("TVM_FUSION_PLAN_PAGES", "").split(":") if p]

# first thing in <head>: collect errors before the page's own script runs
_CATCH = """<script>window.__errors=[];
window.addEventListener('error',function(e){window.__errors.push(String(e.message));});
(function(){var f=console.error;console.error=function(){
  window.__errors.push(Array.prototype.join.call(arguments,' '));
  return f.apply(console,arguments);};
})();</script>"""

# last thing in <body>, after the page's script: check, then write the results into the DOM
_CHECK = """<script>(function(){
  var r={};
  function shown(el){return !!el&&getComputedStyle(el).display!=='none';}
  function box(el){var b=el.getBBox();return [b.x,b.y,b.width,b.height].map(Math.round);}
  try{
    var ours=document.querySelector('svg.view[data-view="tvm_fusion"]');
    ours.getBBox(); document.body.getBoundingClientRect();  // force layout of the drawing
    r.open_ms=performance.now();
    r.layout=ours.getAttribute('data-layout');
    r.clusters=ours.querySelectorAll('g.cluster').length;
    r.drawn_kernels=Number(ours.getAttribute('data-kernels'));
    var cut=ours.querySelector('path.cut');
    r.edge_title=cut.querySelector('title').textContent;
    cut.dispatchEvent(new MouseEvent('click',{bubbles:true}));
    var row=document.querySelector('tr.sel');
    r.row_reason=row?row.cells[2].textContent:null;
    r.edge_selected=cut.classList.contains('sel');
    // collapse the first kernel of several operators by a click on it, then expand it
    var multi=Array.prototype.find.call(ours.querySelectorAll('g.cluster'),
      function(g){return Number(g.getAttribute('data-ops'))>1;});
    var k=multi.getAttribute('data-kernel');
    var fold=ours.querySelector('g.fold[data-kernel="'+k+'"]');
    r.fold_hidden_before=!shown(fold);
    multi.querySelector('rect').dispatchEvent(new MouseEvent('click',{bubbles:true}));
    r.fold_shown=shown(fold);
    r.fold_covers_cluster=JSON.stringify(box(fold.querySelector('rect')))===
      JSON.stringify(box(multi.querySelector('rect')));
    var member=ours.querySelector('g.op[data-kernel="'+k+'"] rect');
    member.scrollIntoView({block:'center',inline:'center'});
    var inside=member.getBoundingClientRect();
    var top=document.elementFromPoint(inside.x+inside.width/2,inside.y+inside.height/2);
    r.fold_on_top=!top||!!top.closest('g.fold');  // off-screen points give null
    fold.dispatchEvent(new MouseEvent('click',{bubbles:true}));
    r.fold_hidden_after=!shown(fold);
    // search by ONNX node name: hits marked, a collapsed kernel holding one is marked, Enter
    // expands it and makes the operator current
    // the query: the ONNX node of an operator in a kernel of several (the first found)
    var op=Array.prototype.find.call(ours.querySelectorAll('g.op'),function(g){
      var c=ours.querySelector('g.cluster[data-kernel="'+g.getAttribute('data-kernel')+'"]');
      return g.querySelector('text.onnx')&&Number(c.getAttribute('data-ops'))>1;});
    var query=op.querySelector('text.onnx').textContent.split(', ')[0].replace('…','');
    r.query=query;query=query.toLowerCase();
    var search=document.getElementById('search'),hk=op.getAttribute('data-kernel');
    var hfold=ours.querySelector('g.fold[data-kernel="'+hk+'"]');
    ours.querySelector('g.cluster[data-kernel="'+hk+'"] rect').dispatchEvent(
      new MouseEvent('click',{bubbles:true}));
    search.value=query;search.dispatchEvent(new Event('input'));
    r.hits=ours.querySelectorAll('g.op.hit').length;
    r.hits_match=Array.prototype.every.call(ours.querySelectorAll('g.op.hit'),
      function(g){return g.getAttribute('data-name').indexOf(query)>=0;});
    r.hits_text=document.getElementById('hits').textContent;
    r.fold_marked=hfold.classList.contains('hit');
    // Enter steps through the hits in page order (another kernel's may come first) until it
    // reaches the collapsed kernel's, which it expands
    for(var n=0;n<r.hits;n++){
      search.dispatchEvent(new KeyboardEvent('keydown',{key:'Enter'}));
      var cur=ours.querySelector('g.op.cur');
      if(cur&&cur.getAttribute('data-kernel')===hk){break;}}
    r.current=ours.querySelectorAll('g.op.cur').length;
    r.expanded_for_hit=!shown(hfold);
    document.getElementById('collapse').click();
    r.collapsed_all=ours.querySelectorAll('g.fold.shown').length;
    r.folds=ours.querySelectorAll('g.fold').length;
    document.getElementById('expand').click();
    r.expanded_all=ours.querySelectorAll('g.fold.shown').length===0;
    document.getElementById('toggle').click();
    r.visible_after_toggle=document.querySelector('svg.view:not([style*="none"])')
      .getAttribute('data-view');
  }catch(e){window.__errors.push('check: '+e);}
  r.errors=window.__errors;
  var pre=document.createElement('pre');pre.id='test-results';
  pre.textContent=JSON.stringify(r);document.body.appendChild(pre);
})();</script>"""


def _checked_copy(text: str, folder: Path, name: str) -> Path:
    checked = text.replace("<head>", "<head>" + _CATCH, 1)
    checked = checked[:checked.rindex("</body>")] + _CHECK + "</body></html>\n"
    path = folder / f"{name}.checked.html"
    path.write_text(checked)
    return path


def _tiled(graph: Graph, copies: int) -> Graph:
    """``copies`` of a plan's graph, each reading the one before: a layer stack."""
    out = Graph(graph.title)
    for i in range(copies):
        base, kernels = len(out.nodes), len(out.clusters)
        if i:
            out.edges.append((base - 1, base, "[red_cell] the layer before's output"
                              if graph.title == "tvm_fusion" else ""))
        out.nodes += graph.nodes
        out.edges += [(base + a, base + b, why) for a, b, why in graph.edges]
        out.clusters += [Cluster(kernels + c.kernel, c.kind, [base + m for m in c.members],
                                 c.note) for c in graph.clusters]
    return out


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("no headless Chromium on PATH (apt-get install chromium)")
    if shutil.which("dot") is None:
        pytest.skip("no Graphviz dot on PATH (apt-get install graphviz)")
    artifacts: dict = {}
    report = make_report(get_builtin("encoder"), "encoder", "llvm", check=False,
                         artifacts=artifacts)
    ours, stock = plan_graph(artifacts["plan"]), kernel_graph(artifacts["stock_mod"])
    folder = tmp_path_factory.mktemp("browser")
    text = render_html(ours, stock, "encoder", report.fused_kernels, report.stock_kernels)
    (folder / "plan.html").write_text(text)
    start = time.perf_counter()
    big = render_html(_tiled(ours, GPT2_LAYERS), _tiled(stock, GPT2_LAYERS), "tiled encoder")
    write_s = time.perf_counter() - start
    return {"encoder": (_checked_copy(text, folder, "encoder"), report.fused_kernels,
                        report.rejections, None),
            "gpt2_sized": (_checked_copy(big, folder, "gpt2_sized"),
                           report.fused_kernels * GPT2_LAYERS, None, write_s),
            "folder": folder}


def _chromium(*args, timeout=180):
    return subprocess.run([CHROMIUM, *FLAGS, *args], capture_output=True, text=True,
                          timeout=timeout)


def _open(path: Path) -> dict:
    start = time.perf_counter()
    proc = _chromium("--dump-dom", "--window-size=1400,900", path.as_uri())
    wall = time.perf_counter() - start
    found = re.search(r'<pre id="test-results">(.*?)</pre>', proc.stdout, re.S)
    assert found, f"no results in the DOM (rc {proc.returncode}): {proc.stderr[-2000:]}"
    r = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&")
                   .replace("&lt;", "<").replace("&gt;", ">"))
    print(f"\n{path.name}: opened in {r.get('open_ms', -1):.0f} ms in the page; chromium ran "
          f"{wall:.1f} s; {r.get('clusters')} clusters")
    console = [line for line in proc.stderr.splitlines()
               if "CONSOLE" in line and ("Uncaught" in line or "rror" in line)]
    assert console == []
    return r


def _check_page(r: dict, kernels: int) -> None:
    assert r["errors"] == []
    assert r["layout"] == "dot"
    assert r["clusters"] == r["drawn_kernels"] == kernels
    # clicking a rejected edge selects it and shows its reason in the table
    assert r["edge_selected"]
    assert r["row_reason"] and r["edge_title"].endswith(": " + r["row_reason"])
    # a click on a kernel collapses it to one node drawn over its operators; a click expands
    assert r["fold_hidden_before"] and r["fold_shown"] and r["fold_covers_cluster"]
    assert r["fold_on_top"] and r["fold_hidden_after"]
    assert r["folds"] and r["collapsed_all"] == r["folds"] and r["expanded_all"]
    # the search finds operators by ONNX node name; Enter expands the kernel holding one
    assert r["hits"] >= 1 and r["hits_match"] and r["hits_text"].startswith(f"{r['hits']} found")
    assert r["current"] == 1 and r["fold_marked"] and r["expanded_for_hit"]
    assert r["visible_after_toggle"] == "stock"
    assert r["open_ms"] < OPEN_S * 1000


def test_encoder_page_in_headless_chromium(pages):
    path, kernels, rejections, _ = pages["encoder"]
    r = _open(path)
    _check_page(r, kernels)
    assert r["row_reason"] in {describe(x["reason"], x["detail"]) for x in rejections}
    assert r["query"] in {n.name for n in get_builtin("encoder").graph.node}


def test_gpt2_sized_page_writes_and_opens_in_time(pages):
    """The encoder's plan tiled into a GPT-2-sized stack (about 900 operators): laid out by dot
    and written in under 10 s, opened in under 3 s, every interaction working."""
    path, kernels, _, write_s = pages["gpt2_sized"]
    print(f"\nGPT-2-sized page ({GPT2_LAYERS} encoder layers): written in {write_s:.2f} s")
    assert write_s < WRITE_S
    _check_page(_open(path), kernels)


@pytest.mark.parametrize("page", EXTRA_PAGES, ids=[p.stem for p in EXTRA_PAGES])
def test_written_page_opens_in_time(page, pages):
    """A page named in TVM_FUSION_PLAN_PAGES (``report --html``'s): the same checks, the kernel
    count from the page's header."""
    text = page.read_text()
    kernels = json.loads(re.search(r'id="kernel-counts">([^<]*)<', text).group(1))["tvm_fusion"]
    _check_page(_open(_checked_copy(text, pages["folder"], page.stem)), kernels)


def test_screenshot(pages):
    folder = pages["folder"]
    shot = folder / "plan.png"
    proc = _chromium(f"--screenshot={shot}", "--window-size=1400,900",
                     (folder / "plan.html").as_uri())
    assert shot.exists() and shot.stat().st_size > 10_000, proc.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"\nscreenshot: {shot}")

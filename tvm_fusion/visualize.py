"""The fusion plan as a picture: one self-contained HTML page (inline SVG, a little inline JS).

Why a page: a plan is a graph, and ``report --why`` lists it as text that the reader has to
cross-reference by block number. The page draws the operator graph with each fusion block as a
cluster, puts the reason on every edge the planner cut, and toggles to stock FuseOps' kernels of
the same model, so "which operators became one kernel, and why not these two" is one look.

Nothing is fetched when the page opens (no script, font or style from a URL): it works offline
and can be attached to an issue. The layout is computed when the page is written, by Graphviz's
``dot`` (:mod:`tvm_fusion.graph_layout`): a layered layout, top to bottom, with each kernel a
cluster and edges routed around the clusters; the page draws from dot's coordinates. A click on
a kernel collapses it to one node (and back); the search box finds operators by PrimFunc name,
Relax variable or ONNX node. Operators are named by their lowered PrimFunc names and, below
them, the ONNX nodes they came from (:mod:`tvm_fusion.onnx_names`: TVM's importer drops the
names, so the model is imported with them carried as spans).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field

import onnx
import tvm
from tvm import relax

from . import graph_layout
from .atomic import atomic_write_text
from .compile import count_kernels, fuse, import_onnx, load_onnx
from .instrument import Collector
from .onnx_names import node_names

# anchor mapping type -> cluster fill (light) and stroke (dark)
COLOURS = {
    "O2O": ("#e3f2e1", "#3b8a3e"),
    "Reorg": ("#e6f0fa", "#3a6ea5"),
    "Shuffle": ("#efe6f7", "#7a4fa3"),
    "O2M": ("#fff3d6", "#b8860b"),
    "M2M": ("#fde2e1", "#c0392b"),
    "Opaque": ("#e8e8e8", "#555555"),
    "kernel": ("#eef1f5", "#5a6b7d"),
}
PROFILE_SOURCES = ("db", "measure", "model")  # a yellow verdict from timings, not the default
NODE_W, NODE_H = 240, 32  # an operator's box: its PrimFunc name and its ONNX nodes
LABEL_CHARS = 36  # what fits NODE_W at 11px monospace; the full name is in the tooltip


@dataclass
class Node:
    label: str  # PrimFunc (or Relax op) name
    var: str  # the Relax variable it binds (names repeat: a label needs it to be unique)
    detail: str  # tooltip text
    onnx: list[str] = field(default_factory=list)  # the ONNX nodes it came from

    @property
    def onnx_text(self) -> str:
        return ", ".join(self.onnx)


@dataclass
class Cluster:
    kernel: int
    kind: str  # mapping type short name, or "kernel" for stock FuseOps
    members: list[int]  # node ids, topological order
    note: str = ""


@dataclass
class Graph:
    """A graph to draw: nodes, data edges (with the reason when cut), clusters (kernels)."""

    title: str
    nodes: list[Node] = field(default_factory=list)
    edges: list[tuple[int, int, str]] = field(default_factory=list)  # (src, dst, reason or "")
    clusters: list[Cluster] = field(default_factory=list)
    # yellow cells a profile (database, measurement or the latency model) decided:
    # (src, dst, "fused" or "kept apart", its detail: the times of fused vs apart)
    profiled: list[tuple[int, int, str, str]] = field(default_factory=list)
    removed: list = field(default_factory=list)  # SmartMem's RemovedLayoutOp records


# ------------------------------------------------------------------------------ from the plans


def plan_graph(module_plan) -> Graph:
    """tvm_fusion's view: every ECG operator, every block of every planned dataflow block."""
    graph = Graph("tvm_fusion")
    for (func, block_index), plan in module_plan.plans.items():
        ecg = plan.ecg
        base = len(graph.nodes)
        block_of = {i: b for b, blk in enumerate(plan.blocks) for i in blk.members}
        for n in ecg.nodes:
            onnx_nodes = node_names(n.var)
            origin = (f"; ONNX: {', '.join(onnx_nodes)}" if onnx_nodes else
                      "; no ONNX node: inserted by a pass" if "layout_transform" in n.op_name
                      else "; created by rewriting" if n.name.startswith("rw") else "")
            graph.nodes.append(Node(n.op_name, n.name,
                                    f"{n.name} = {n.op_name} [{n.mapping_type.short}] "
                                    f"({func}, dataflow block {block_index}){origin}; "
                                    f"{n.reason}", onnx_nodes))
        reasons = _rejection_index(plan)
        for (a, b), yellow in _pair_index(plan, plan.yellow).items():
            decision = yellow.decision
            if decision.source in PROFILE_SOURCES:
                graph.profiled.append((base + a, base + b,
                                       "fused" if decision.fuse else "kept apart",
                                       f"{decision.source}: {decision.detail}"))
        for n in ecg.nodes:
            for s in n.succs:
                cut = block_of.get(n.index) != block_of.get(s)
                reason = (reasons.get((n.index, s), "not tried by the planner")
                          if cut else "")
                graph.edges.append((base + n.index, base + s, reason))
        for blk in plan.blocks:
            saved = sum(ecg.nodes[i].irs_bytes for i in blk.members
                        if ecg.ir_removable(i, block_of))
            graph.clusters.append(Cluster(len(graph.clusters), blk.mapping_type.short,
                                          [base + i for i in blk.members],
                                          f"{_bytes(saved)} not written" if saved else ""))
    return graph


def _rejection_index(plan) -> dict[tuple[int, int], str]:
    """Each rejection's reason on the producer -> consumer edge it is about."""
    return {edge: r.describe() for edge, r in _pair_index(plan, plan.rejections).items()}


def _pair_index(plan, records) -> dict[tuple[int, int], object]:
    """Records (rejections, yellow decisions) name operators by ``describe()`` strings, which
    may repeat (Relax reuses variable names such as ``lv``); resolve each to the producer ->
    consumer edge it is about (the first record of an edge wins)."""
    by_text: dict[str, list[int]] = {}
    for n in plan.ecg.nodes:
        by_text.setdefault(n.describe(), []).append(n.index)
    out: dict[tuple[int, int], object] = {}
    for r in records:
        for a in by_text.get(r.first, []):
            for b in by_text.get(r.second, []):
                if b in plan.ecg.nodes[a].succs:
                    out.setdefault((a, b), r)
    return out


def kernel_graph(mod, title: str = "stock FuseOps") -> Graph:
    """A fused module's kernels (one per ``call_tir``/``call_dps_packed``) and the data edges
    between them, followed through the bindings that launch nothing (tuples, reshapes)."""
    graph = Graph(title)
    for gvar, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        producers: dict = {}  # Relax var -> kernel node ids it carries

        def uses(expr, producers=producers):
            found: set[int] = set()

            def visit(e):
                if isinstance(e, relax.Var) and e in producers:
                    found.update(producers[e])

            relax.analysis.post_order_visit(expr, visit)
            return found

        for block in getattr(func.body, "blocks", []):
            for binding in block.bindings:
                value = getattr(binding, "value", None)
                if value is None:
                    continue
                srcs = uses(value)
                if _is_launch(value):
                    callee = value.args[0]
                    name = getattr(callee, "name_hint", None) or str(callee)
                    idx = len(graph.nodes)
                    graph.nodes.append(Node(name, binding.var.name, f"{binding.var.name} = {name} "
                                                  f"({gvar.name_hint})",
                                            node_names(binding.var)))
                    graph.clusters.append(Cluster(len(graph.clusters), "kernel", [idx]))
                    graph.edges += [(s, idx, "") for s in sorted(srcs)]
                    producers[binding.var] = {idx}
                elif srcs:
                    producers[binding.var] = srcs
    return graph


def _is_launch(expr) -> bool:
    return (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)
            and expr.op.name in ("relax.call_tir", "relax.call_dps_packed"))


# ------------------------------------------------------------------------------------ layout


def layout(graph: Graph) -> graph_layout.Layout:
    """Graphviz's dot lays the graph out when the page is written: each operator a fixed box
    (its text is drawn here), each kernel a cluster whose label line is the header."""
    sizes = {i: (NODE_W, NODE_H) for i in range(len(graph.nodes))}
    clusters = {c.kernel: (c.members, _head(c)) for c in graph.clusters}
    edges = {k: (a, b) for k, (a, b, _) in enumerate(graph.edges)}
    return graph_layout.layout(sizes, clusters, edges)


# ------------------------------------------------------------------------------------- render


def render_svg(graph: Graph, view: str, hidden: bool = False) -> str:
    """One view: ``<svg data-view=... data-kernels=N data-layout="dot">`` with a
    ``<g class="cluster">`` per kernel; a cut edge is a ``<path class="cut">`` whose
    ``<title>`` is the reason; a kernel of several operators has a ``<g class="fold">``, the
    one node it collapses to (hidden until its cluster is clicked)."""
    laid = layout(graph)
    cluster_of = {n: c.kernel for c in graph.clusters for n in c.members}
    parts = [f'<svg class="view" data-view="{view}" data-kernels="{len(graph.clusters)}" '
             f'data-layout="dot" width="{laid.width:.0f}" height="{laid.height:.0f}" '
             f'viewBox="0 0 {laid.width:.0f} {laid.height:.0f}"'
             + (' style="display:none"' if hidden else "") + ">",
             '<defs><marker id="arrow" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="6" '
             'markerHeight="6" orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#666"/>'
             "</marker></defs>"]
    folds = []
    for c in graph.clusters:
        x, y, w, h = laid.clusters[c.kernel]
        fill, stroke = COLOURS.get(c.kind, COLOURS["kernel"])
        names = ", ".join(graph.nodes[n].label + (f" ({graph.nodes[n].onnx_text})"
                                                  if graph.nodes[n].onnx else "")
                          for n in c.members)
        title = f"<title>{_e(_head(c))}: {_e(names)}</title>"
        box = f'x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="6"'
        many = len(c.members) > 1
        parts.append(
            f'<g class="cluster" data-kernel="{c.kernel}" data-ops="{len(c.members)}">{title}'
            f'<rect {box} fill="{fill}" stroke="{stroke}" stroke-width="1.5"/>'
            f'<text x="{x + 6:.1f}" y="{y + 14:.1f}" class="head" fill="{stroke}">'
            f"{_e(_head(c))}" + (" ▾" if many else "") + "</text></g>")
        if many:  # the node it collapses to: drawn over its operators and the edges into them
            lines = [f"{len(c.members)} operators, one kernel (click to expand):"]
            room = max(1, int((h - 38) // 13))
            labels = [graph.nodes[n].label for n in c.members]
            lines += [_short(t) for t in labels[:room]]
            if len(labels) > room:
                lines[-1] = f"… and {len(labels) - room + 1} more"
            text = "".join(f'<text x="{x + 8:.1f}" y="{y + 32 + 13 * i:.1f}">{_e(t)}</text>'
                           for i, t in enumerate(lines))
            folds.append(
                f'<g class="fold" data-kernel="{c.kernel}">{title}<rect {box} fill="{fill}" '
                f'stroke="{stroke}" stroke-width="3"/><text x="{x + 6:.1f}" y="{y + 14:.1f}" '
                f'class="head" fill="{stroke}">{_e(_head(c))} ▸</text>{text}</g>')
    path_of: dict[tuple[int, int], str] = {}
    for k, (a, b, reason) in enumerate(graph.edges):
        d = laid.edges.get(k)
        if not d:
            continue
        path_of.setdefault((a, b), d)
        same = cluster_of.get(a) == cluster_of.get(b)
        cls = "cut" if reason else ("in" if same else "link")
        title = (f"<title>{_e(graph.nodes[a].label)} → {_e(graph.nodes[b].label)}: "
                 f"{_e(reason)}</title>") if reason else ""
        data = f' data-edge="{k}"' if reason else ""
        parts.append(f'<path class="{cls}"{data} d="{d}" marker-end="url(#arrow)">{title}</path>')
    for k, (a, b, verdict, detail) in enumerate(graph.profiled):
        if a not in laid.nodes or b not in laid.nodes:
            continue
        (ax, ay), (bx, by) = laid.nodes[a], laid.nodes[b]
        d = path_of.get((a, b)) or (f"M{ax + NODE_W / 2:.1f},{ay + NODE_H:.1f} "
                                    f"L{bx + NODE_W / 2:.1f},{by:.1f}")
        parts.append(f'<path class="profiled" data-profiled="{k}" d="{d}"><title>'
                     f"{_e(graph.nodes[a].label)} → {_e(graph.nodes[b].label)}: {_e(verdict)} "
                     f"({_e(detail)})</title></path>")
    for n, node in enumerate(graph.nodes):
        if n not in laid.nodes:
            continue
        x, y = laid.nodes[n]
        search = f"{node.label} {node.var} {node.onnx_text}".lower()
        origin = (f'<text x="{x + 5:.1f}" y="{y + 26:.1f}" class="onnx">'
                  f"{_e(_short(node.onnx_text))}</text>") if node.onnx else ""
        parts.append(f'<g class="op" data-kernel="{cluster_of.get(n, "")}" '
                     f'data-name="{_e(search)}"><title>{_e(node.detail)}</title>'
                     f'<rect x="{x:.1f}" y="{y:.1f}" width="{NODE_W}" height="{NODE_H}" rx="3" '
                     f'fill="#fff" stroke="#999"/><text x="{x + 5:.1f}" y="{y + 13:.1f}">'
                     f"{_e(_short(node.label))}</text>{origin}</g>")
    parts += folds
    parts.append("</svg>")
    return "\n".join(parts)


def render_html(ours: Graph, stock: Graph, title: str = "fusion plan",
                fused_kernels: int | None = None, stock_kernels: int | None = None) -> str:
    """The whole page: header with both kernel counts, the toggle, both views, the table of
    cut edges with their reasons."""
    fused_kernels = len(ours.clusters) if fused_kernels is None else fused_kernels
    stock_kernels = len(stock.clusters) if stock_kernels is None else stock_kernels
    rows = []
    for k, (a, b, reason) in enumerate(ours.edges):
        if not reason:
            continue
        rows.append(f'<tr data-edge="{k}"><td>{_cell(ours.nodes[a])}</td>'
                    f"<td>{_cell(ours.nodes[b])}</td><td>{_e(reason)}</td></tr>")
    legend = " ".join(f'<span class="key" style="background:{f};border-color:{s}">{_e(k)}</span>'
                      for k, (f, s) in COLOURS.items() if k != "kernel")
    profiled = [f'<tr data-profiled="{k}"><td>{_cell(ours.nodes[a])}</td>'
                f"<td>{_cell(ours.nodes[b])}</td><td>{_e(verdict)}: {_e(detail)}</td></tr>"
                for k, (a, b, verdict, detail) in enumerate(ours.profiled)]
    removed = [f'<tr class="removed" data-find="{_e((r.into_onnx or (r.into,))[0].lower())}">'
               f"<td>{_e(r.op)}" + (f'<br><span class="onnx">{_e(", ".join(r.onnx))}</span>'
                                    if r.onnx else "")
               + f"</td><td>{_e(r.into)}" + (f'<br><span class="onnx">'
                                              f'{_e(", ".join(r.into_onnx))}</span>'
                                              if r.into_onnx else "")
               + f"</td><td>{_e(r.action)}</td></tr>" for r in ours.removed]
    counts = json.dumps({"tvm_fusion": fused_kernels, "stock": stock_kernels})
    return _PAGE.format(
        title=_e(title), fused=fused_kernels, stock=stock_kernels, legend=legend,
        operators=len(ours.nodes), ours=render_svg(ours, "tvm_fusion"),
        theirs=render_svg(stock, "stock", hidden=True), rows="\n".join(rows),
        cuts=len(rows), counts=counts, css=_CSS, js=_JS, removed="\n".join(removed),
        n_removed=len(removed), profiled="\n".join(profiled), n_profiled=len(profiled))


@dataclass
class FusionPicture:
    """The page; shows inline in Jupyter (``_repr_html_``) and ``save``s to a file."""

    html: str

    def _repr_html_(self) -> str:
        return self.html

    def save(self, path) -> None:
        """Atomically (temp file + ``os.replace``); readable by others, as a page to share
        should be (the temp file is created 0600)."""
        atomic_write_text(path, self.html)


def picture(module_plan, stock_mod, title: str = "fusion plan",
            fused_kernels: int | None = None, layout_blocks=()) -> FusionPicture:
    """The page of one planned module against stock FuseOps' fused module; ``layout_blocks``
    are SmartMem's records of the build (the Collector's), whose removed layout operators
    the page lists."""
    ours = plan_graph(module_plan)
    ours.removed = [r for block in layout_blocks for r in getattr(block, "removed", [])]
    return FusionPicture(render_html(ours, kernel_graph(stock_mod), title, fused_kernels,
                                     count_kernels(stock_mod)))


def visualize(mod_or_model, target="llvm", title: str | None = None, **options) -> FusionPicture:
    """Plan an ONNX model (a path or a ``ModelProto``) or an imported Relax module with
    tvm_fusion and with stock FuseOps, and draw both. ``options`` are tvm_fusion's options."""
    graph_layout.find_dot()  # before the planning: without Graphviz, say so at once
    if isinstance(mod_or_model, str):
        title = title or mod_or_model
        mod_or_model = load_onnx(mod_or_model)
    mod = (import_onnx(mod_or_model, node_names=True)
           if isinstance(mod_or_model, onnx.ModelProto) else mod_or_model)
    collector = Collector()
    with tvm.transform.PassContext(instruments=[collector]):
        fused = fuse(mod, target, **options)
    if not collector.plans:
        raise ValueError("visualize: the planner recorded no plan (strategy='tvm' has none)")
    stock = fuse(mod, target, strategy="tvm")
    return picture(collector.plans[0], stock, title or "fusion plan", count_kernels(fused),
                   collector.layout_blocks)


def _head(c: Cluster) -> str:
    """A cluster's header line: its kernel number, the anchor's mapping type, what it saves."""
    head = f"#{c.kernel} {c.kind}" if c.kind != "kernel" else f"#{c.kernel}"
    return head + (f" · {c.note}" if c.note else "")


def _cell(node: Node) -> str:
    origin = f'<br><span class="onnx">{_e(node.onnx_text)}</span>' if node.onnx else ""
    return f'{_e(node.label)} <span class="var">{_e(node.var)}</span>{origin}'


def _short(label: str) -> str:
    return label if len(label) <= LABEL_CHARS else label[: LABEL_CHARS - 1] + "…"


def _bytes(n: int) -> str:
    if n >= 100_000:
        return f"{n / 1e6:.2f} MB"
    return f"{n / 1e3:.1f} kB" if n >= 1000 else f"{n} B"


def _e(text) -> str:
    return html.escape(str(text), quote=True)


# The side tables' rows are grid rows with content-visibility:auto, so the browser lays out only
# the rows on screen: a GPT-2 page has hundreds, and as table rows they took half its opening.
_CSS = """
body{font:13px system-ui,sans-serif;margin:0;color:#222}
header{padding:8px 12px;border-bottom:1px solid #ccc;background:#fafafa}
header h1{font-size:16px;margin:0 0 4px}
.key{display:inline-block;padding:1px 6px;border:1.5px solid;border-radius:4px;margin-right:4px}
main{display:flex;height:calc(100vh - 118px)}
#canvas{flex:1;overflow:auto;border-right:1px solid #ccc}
aside{width:480px;overflow:auto;padding:0 8px}
svg text{font:11px ui-monospace,monospace}
svg text.head{font-weight:bold}
svg text.onnx{font-size:10px;fill:#3a6ea5}
span.onnx{color:#3a6ea5}
g.cluster[data-ops]:not([data-ops="1"]),g.fold{cursor:pointer}
g.fold{display:none}
g.fold.shown{display:inline}
g.fold.hit rect{stroke:#e6b800;stroke-width:5}
path.in,path.link{fill:none;stroke:#999;stroke-width:1}
path.link{stroke:#5a6b7d;stroke-width:1.2}
path.cut{fill:none;stroke:#c0392b;stroke-width:1.4;stroke-dasharray:5 3;cursor:pointer}
path.cut:hover,path.cut.sel{stroke-width:3.5}
path.profiled{fill:none;stroke:#2e7d32;stroke-width:2.5}
g.op.hit rect{fill:#fff59d;stroke:#333}
g.op.cur rect{fill:#ffd54f;stroke:#000;stroke-width:2}
table{border-collapse:collapse;width:100%;font-size:12px}
aside table,aside tbody{display:block}
aside tr{display:grid;grid-template-columns:1fr 1fr 1.1fr;content-visibility:auto;
  contain-intrinsic-size:auto 44px}
td,th{border-bottom:1px solid #ddd;padding:3px;text-align:left;vertical-align:top}
td:nth-child(-n+2){font-family:ui-monospace,monospace;word-break:break-all}
.var{color:#888}
tr.sel{background:#fff59d}
button{margin-right:4px}
#hits{color:#555;margin-right:8px}
"""

# The page's behaviour: the view toggle; a cut edge <-> its table row; a click on a kernel's
# cluster collapses it to one node (its fold) and a click on that node expands it; the search
# marks operators (and the collapsed kernels holding them), Enter steps through them; zoom.
_JS = """
(function(){
  var root=document.currentScript.closest('.plan'),zoom=1;
  function $(q){return root.querySelector(q);}
  function $$(q,el){return (el||root).querySelectorAll(q);}
  var views=$$('svg.view'),search=$('#search'),hits=[],at=-1;
  function cur(){return $('svg.view:not([style*="none"])');}
  function show(name){views.forEach(function(v){
    v.style.display=v.getAttribute('data-view')===name?'':'none';});
    $('#which').textContent=name==='stock'?'stock FuseOps':'tvm_fusion';find();}
  $('#toggle').onclick=function(){
    show(cur().getAttribute('data-view')==='stock'?'tvm_fusion':'stock');};
  function select(k){$$('.sel').forEach(function(e){e.classList.remove('sel');});
    $$('[data-edge="'+k+'"]').forEach(function(e){
      e.classList.add('sel');if(e.tagName==='TR'){e.scrollIntoView({block:'nearest'});}});}
  $$('path.cut').forEach(function(p){
    p.onclick=function(){select(p.getAttribute('data-edge'));};});
  function reveal(el){el.scrollIntoView({block:'center',inline:'center'});}
  $$('tr[data-edge]').forEach(function(r){r.onclick=function(){
    var k=r.getAttribute('data-edge');show('tvm_fusion');select(k);
    var p=$('path[data-edge="'+k+'"]');if(p){reveal(p);}};});
  // a click on a kernel collapses it to its fold (one node over it); a click on that expands
  function collapse(v,k,on){var f=v.querySelector('g.fold[data-kernel="'+k+'"]');
    if(f){f.classList.toggle('shown',on);}mark();}
  $$('g.cluster').forEach(function(g){g.onclick=function(){
    collapse(g.ownerSVGElement,g.getAttribute('data-kernel'),true);};});
  $$('g.fold').forEach(function(f){f.onclick=function(){
    collapse(f.ownerSVGElement,f.getAttribute('data-kernel'),false);};});
  function all(on){$$('g.fold',cur()).forEach(function(f){f.classList.toggle('shown',on);});
    mark();}
  $('#collapse').onclick=function(){all(true);};
  $('#expand').onclick=function(){all(false);};
  // search: operators whose PrimFunc name, Relax variable or ONNX node contains the text;
  // a collapsed kernel holding one is marked; Enter steps through them, expanding as it goes
  function mark(){var held={};hits.forEach(function(g){held[g.getAttribute('data-kernel')]=1;});
    $$('g.fold',cur()).forEach(function(f){
      f.classList.toggle('hit',!!held[f.getAttribute('data-kernel')]);});}
  function find(){var q=search.value.trim().toLowerCase(),v=cur();hits=[];at=-1;
    $$('g.op.hit,g.op.cur').forEach(function(g){g.classList.remove('hit','cur');});
    if(q){$$('g.op',v).forEach(function(g){
      if(g.getAttribute('data-name').indexOf(q)>=0){g.classList.add('hit');hits.push(g);}});}
    $('#hits').textContent=q?hits.length+' found'+(hits.length?' (Enter: next)':''):'';
    mark();}
  function next(){if(!hits.length){return;}
    if(at>=0){hits[at].classList.remove('cur');}at=(at+1)%hits.length;var g=hits[at];
    collapse(g.ownerSVGElement,g.getAttribute('data-kernel'),false);
    g.classList.add('cur');reveal(g);}
  search.oninput=find;
  search.onkeydown=function(e){if(e.key==='Enter'){next();}};
  $$('tr.removed').forEach(function(r){r.onclick=function(){
    show('tvm_fusion');search.value=r.getAttribute('data-find');find();next();};});
  function scale(z){zoom=Math.max(0.05,Math.min(2,z));views.forEach(function(v){
    var b=v.viewBox.baseVal;v.setAttribute('width',b.width*zoom);
    v.setAttribute('height',b.height*zoom);});
    $('#zoom').textContent=Math.round(zoom*100)+'%';}
  $('#zoomout').onclick=function(){scale(zoom/1.25);};
  $('#zoomin').onclick=function(){scale(zoom*1.25);};
  // open on the first kernel: dot centres each rank, so a wide graph starts off to the side
  var first=$('svg.view[data-view="tvm_fusion"] g.cluster');
  if(first){first.scrollIntoView({block:'start',inline:'center'});}
})();
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{css}</style></head><body><div class="plan">
<header><h1>{title}: {operators} operators as planned, tvm_fusion {fused} kernels,
stock FuseOps {stock} kernels, {n_removed} layout operators removed</h1>
<button id="toggle">toggle tvm_fusion / stock FuseOps</button> showing <b id="which">tvm_fusion</b>
&nbsp; <input id="search" placeholder="find operator or ONNX node" size="28">
<span id="hits"></span>
<button id="collapse">collapse all</button><button id="expand">expand all</button>
<button id="zoomout">−</button><span id="zoom">100%</span> <button id="zoomin">+</button><br>
anchor: {legend}
<span style="color:#c0392b">- - -</span> edge kept apart (hover or click for why);
click a kernel to collapse it to one node, and that node to expand it; laid out by Graphviz dot
<script type="application/json" id="kernel-counts">{counts}</script></header>
<main><div id="canvas">
{ours}
{theirs}
</div><aside><h3>{cuts} edges between kernels, and why</h3>
<table><tr><th>producer</th><th>consumer</th><th>why not fused</th></tr>
{rows}
</table>
<h3>{n_profiled} pairs a profile decided (fused vs apart)</h3>
<table id="profiled"><tr><th>producer</th><th>consumer</th><th>verdict: measured times</th></tr>
{profiled}
</table>
<h3>{n_removed} layout operators SmartMem removed</h3>
<table id="removed"><tr><th>removed</th><th>its indexing now done by</th><th>Table 5</th></tr>
{removed}
</table></aside></main>
<script>{js}</script>
</div></body></html>
"""

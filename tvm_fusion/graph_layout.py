"""Layered layout of a clustered graph by Graphviz's ``dot``, run when a page is written.

Why dot: a fusion plan of a real model is hundreds of operators in about a hundred clusters, and
a layered layout that keeps clusters apart, orders nodes to cross few edges and routes edges
around clusters is what ``dot`` has done well for decades; drawing it by hand was ours to
maintain. The caller gives boxes of fixed size (it draws their text itself), clusters (each
with a header line) and edges; this runs ``dot -Tjson0`` once and hands back, in SVG
coordinates (y down, 1 unit = 1 px = 1 pt), each node's top-left corner, each cluster's box and
each edge's path (dot's B-spline as SVG cubic segments, ending at the arrow's tip).

Graphviz is a system package, not a Python one: without ``dot`` on the PATH this raises
:class:`GraphvizMissing`, one line naming the package to install.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field

__all__ = ["GraphvizMissing", "Layout", "find_dot", "layout"]

INSTALL = ("install Graphviz: apt-get install graphviz (Debian/Ubuntu), brew install graphviz "
           "(macOS) or conda install graphviz")
HEAD_FONT = 11  # cluster headers are one line of monospace at this size (px = pt here)
HEAD, PAD = 20, 6  # a one-node cluster's header line above its node, and its border
TIMEOUT_S = 600


class GraphvizMissing(OSError):
    """Graphviz's ``dot`` is not on the PATH; the message says how to install it."""


@dataclass
class Layout:
    width: float
    height: float
    nodes: dict[int, tuple[float, float]] = field(default_factory=dict)  # top-left corner
    clusters: dict[int, tuple[float, float, float, float]] = field(default_factory=dict)
    edges: dict[int, str] = field(default_factory=dict)  # SVG path data


def find_dot() -> str:
    """The path of ``dot``, or :class:`GraphvizMissing` (checked before any long work)."""
    path = shutil.which("dot")
    if path is None:
        raise GraphvizMissing(f"the plan's page is laid out by Graphviz's dot, which is not on "
                              f"the PATH: {INSTALL}")
    return path


def layout(sizes: dict[int, tuple[float, float]], clusters: dict[int, tuple[list[int], str]],
           edges: dict[int, tuple[int, int]], margin: float = 10.0) -> Layout:
    """Lay out nodes ``{id: (width, height)}`` in ``clusters`` ``{id: (members, header)}``
    with ``edges`` ``{key: (src, dst)}``, top to bottom.

    A cluster of one node is given to dot as one node with room for the header and a border
    (and its box is cut back out of it): dot's cost grows with its clusters, and half the
    kernels of a plan, every kernel of stock FuseOps, are one operator."""
    dot = find_dot()
    single = {members[0]: k for k, (members, _) in clusters.items() if len(members) == 1}
    boxed = {n: ((w + 2 * PAD, h + HEAD + PAD) if n in single else (w, h))
             for n, (w, h) in sizes.items()}
    text = to_dot(boxed, {k: c for k, c in clusters.items() if len(c[0]) > 1}, edges)
    try:
        proc = subprocess.run([dot, "-Tjson0"], input=text, capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"Graphviz's dot took over {TIMEOUT_S} s to lay out "
                           f"{len(sizes)} nodes") from None
    if proc.returncode != 0:
        raise RuntimeError(f"Graphviz's dot failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip().splitlines()[-1:]}")
    out = from_json(json.loads(proc.stdout), margin)
    for n, k in single.items():  # the node was the cluster's box; the node sits inside it
        x, y = out.nodes[n]
        w, h = boxed[n]
        out.clusters[k] = (x, y, w, h)
        out.nodes[n] = (x + PAD, y + HEAD)
    return out


def to_dot(sizes, clusters, edges) -> str:
    """The DOT text: fixed-size unlabelled boxes (sizes in inches: dot's unit), one
    ``cluster_K`` subgraph per cluster whose label reserves the header's line."""
    lines = ["digraph plan {", "rankdir=TB; nodesep=0.25; ranksep=0.35; newrank=true;",
             f'graph [fontname="Courier" fontsize={HEAD_FONT} labeljust=l labelloc=t '
             'margin=10];',
             'node [shape=box fixedsize=true label=""];', "edge [arrowsize=0.6];"]
    for k, (members, header) in clusters.items():
        lines.append(f"subgraph cluster_{k} {{ label={_quote(header)};")
        lines += [f"n{n} [width={sizes[n][0] / 72:.4f} height={sizes[n][1] / 72:.4f}];"
                  for n in members]
        lines.append("}")
    clustered = {n for members, _ in clusters.values() for n in members}
    lines += [f"n{n} [width={w / 72:.4f} height={h / 72:.4f}];"
              for n, (w, h) in sizes.items() if n not in clustered]
    lines += [f'n{a} -> n{b} [id="{key}"];' for key, (a, b) in edges.items()]
    lines.append("}")
    return "\n".join(lines)


def from_json(graph: dict, margin: float = 10.0) -> Layout:
    """dot's ``-Tjson0`` (points, y up) as a :class:`Layout` (y down, shifted by ``margin``)."""
    _, _, right, top = (float(v) for v in graph["bb"].split(","))

    def point(text: str) -> tuple[float, float]:
        x, y = text.split(",")[-2:]
        return float(x) + margin, top - float(y) + margin

    out = Layout(right + 2 * margin, top + 2 * margin)
    for obj in graph.get("objects", []):
        name = obj.get("name", "")
        if name.startswith("cluster_") and "bb" in obj:
            x0, y0, x1, y1 = (float(v) for v in obj["bb"].split(","))
            out.clusters[int(name[8:])] = (x0 + margin, top - y1 + margin, x1 - x0, y1 - y0)
        elif name.startswith("n") and "pos" in obj:
            cx, cy = point(obj["pos"])
            w, h = float(obj["width"]) * 72, float(obj["height"]) * 72
            out.nodes[int(name[1:])] = (cx - w / 2, cy - h / 2)
    for edge in graph.get("edges", []):
        if "pos" in edge and "id" in edge:
            out.edges[int(edge["id"])] = _spline_path(edge["pos"], point)
    return out


def _spline_path(pos: str, point) -> str:
    """dot's edge ``pos`` ("e,x,y" arrow tip, then 3n+1 B-spline points) as SVG path data."""
    tip, start, pts = None, None, []
    for item in pos.split():
        if item.startswith("e,"):
            tip = point(item)
        elif item.startswith("s,"):
            start = point(item)
        else:
            pts.append(point(item))
    if not pts:
        return ""
    d = [f"M{_xy(start)}L{_xy(pts[0])}" if start else f"M{_xy(pts[0])}"]
    for i in range(1, len(pts) - 2, 3):
        d.append(f"C{_xy(pts[i])} {_xy(pts[i + 1])} {_xy(pts[i + 2])}")
    if tip:
        d.append(f"L{_xy(tip)}")
    return "".join(d)


def _xy(p: tuple[float, float]) -> str:
    return f"{p[0]:.1f},{p[1]:.1f}"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'

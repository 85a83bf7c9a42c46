"""Draw docs/img/architecture.png: tvm_fusion's layers and where its passes sit in a TVM build.

    python scripts/draw_architecture.py [--out docs/img/architecture.png]

Plain matplotlib (no graphviz). The text version of the same diagram is in
docs/architecture.md; keep the two in step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

TVM = "#e0e0e0"  # TVM's own passes, unchanged
OURS = "#ffcc80"  # tvm_fusion
TARGET = "#bbdefb"  # target-specific tvm_fusion passes
LAYER = "#c8e6c9"  # a layer of the package
EDGE = "#424242"

# The layers, top to bottom: imports only go down (docs/architecture.md, "Layers").
LAYERS = [
    ("apps", "cli · report · bench · visualize · zoo · fuzz/\n"
             "export_models · tuning.tune_cli · tuning.db_cli"),
    ("driver", "compile (compile_model)\ntuning.tune · tuning.measure · layout.measure"),
    ("transform", "transform.py: Sequential,\nthe registered pipeline \"tvm_fusion\""),
    ("pipeline", "pipeline.py: phase lists per backend\n(CPU · GPU/CUDA · Adreno texture)"),
    ("passes", "relay_passes/ (rewrite/, apollo/)\nlayout/ · tir_schedules/"),
    ("helpers", "options · instrument · tir_utils · symbolic · target\n"
                "devices · threads · feeds · numerics · models/ …"),
]

# (label, module, colour); top to bottom
MAIN = [
    ("ONNX model  →  from_onnx(model, keep_params_in_input=False)", "TVM frontend", TVM),
    ("RewriteByMathProperties", "relay_passes/rewrite/  ·  DNNFusion §4.2", OURS),
    ("PackConvs  (CPU)", "layout/conv_pack.py  ·  packed NCHW[x]c convs", OURS),
    ("library dispatch · DecomposeOpsForInference · LegalizeOps ·\n"
     "AnnotateTIROpPattern · FoldConstant · CanonicalizeBindings · DCE",
     "legalisation: TVM's passes", TVM),
    ("EliminateLayoutTransforms", "layout/  ·  SmartMem (ASPLOS'24)", OURS),
    ("AnnotateMappingType", "relay_passes/mapping_type.py  ·  DNNFusion Table 2", OURS),
    ("PlanFusion  (strategy = \"dnnfusion\" | \"tvm\")",
     "relay_passes/ecg.py, fusion_table.py, fusion_plan.py, grouping.py, plan_fusion.py\n"
     "conv→conv chains: relay_passes/optifx.py (OptiFX)  ·  yellow cells: the oracle handed in\n"
     "strategy=\"apollo\": ApolloFuse (relay_passes/apollo/) replaces PlanFusion → FuseTIR "
     "→ schedules", OURS),
    ("FuseTIR", "TVM's own, never reimplemented", TVM),
]
BRANCHES = [
    ("CPU (llvm)", [("ScheduleFusedBlocks", "tir_schedules/\n(OptiFX: tir_schedules/optifx.py)",
                     TARGET)]),
    ("GPU / CUDA", [("DLight rules", "per fused PrimFunc\n(OptiFX: tir_schedules/optifx.py)",
                     TARGET)]),
    ("Adreno texture", [("AnnotateTextureScopes\nScheduleTextureKernels", "layout/texture*.py",
                         TARGET)]),
]
TAIL = [
    ("dataflow lowering · finalisation",
     "TVM's backend passes  ·  textures: whole-texel stores (layout/texture_lower.py)", TVM),
    ("VM executable  /  exported library", "tvm.compile  ·  tvm-fusion compile -o model.so", TVM),
]


def _box(ax, x, y, w, h, label, module, colour):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h,
                                boxstyle="round,pad=0.02,rounding_size=0.12",
                                facecolor=colour, edgecolor=EDGE, linewidth=1))
    ax.text(x, y + 0.14, label, ha="center", va="center", fontsize=9.5, weight="bold")
    ax.text(x, y - 0.24, module, ha="center", va="center", fontsize=7.5, color="#37474f",
            style="italic")


def _arrow(ax, x0, y0, x1, y1):
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                arrowprops=dict(arrowstyle="-|>", color=EDGE, lw=1.1, shrinkA=0, shrinkB=0))


def _layers(ax, x: float, top: float, width: float = 4.6, height: float = 1.25,
            step: float = 1.75) -> None:
    """The layers as a stack of boxes, each importing only from those below it."""
    ax.text(x, top + 0.75, "Layers (imports only go down)", ha="center", fontsize=10.5,
            weight="bold", color="#1b5e20")
    for i, (name, modules) in enumerate(LAYERS):
        y = top - i * step
        _box(ax, x, y, width, height, name, modules, LAYER)
        if i:
            _arrow(ax, x, y + step - height / 2 - 0.02, x, y + height / 2 + 0.02)


def draw(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(17.5, 13.5))
    width, height, step = 7.6, 0.95, 1.3
    cx = 11.4
    _layers(ax, 2.4, -0.3)
    y = 0.0
    ys = []
    for label, module, colour in MAIN:
        extra = 0.2 * module.count("\n")
        y -= extra / 2
        _box(ax, cx, y, width, height + extra, label, module, colour)
        ys.append(y)
        y -= step + extra / 2
    for a, b in zip(ys, ys[1:]):
        _arrow(ax, cx, a - height / 2 - 0.02, cx, b + height / 2 + 0.15)
    # bracket: the graph phases, what tvm_fusion.transform.Sequential runs
    top, bottom = ys[1] + height / 2 + 0.1, ys[-1] - height / 2 - 0.1
    ax.plot([cx + width / 2 + 0.25] * 2, [top, bottom], color="#e65100", lw=2.5)
    ax.text(cx + width / 2 + 0.4, (top + bottom) / 2,
            "graph phases:\ntvm_fusion.transform.Sequential\n(target, **options)\n"
            "replaces stock TVM's\nLegalizeOps … FuseOps → FuseTIR\n\n"
            "pipeline.py orders every phase;\nrelax_pipeline=\"tvm_fusion\" adds\n"
            "the target's backend phase\nand TVM's lowering", fontsize=8.5, va="center",
            color="#bf360c")
    # backend phases, one per target family
    by = ys[-1] - step - 0.35
    bw = 3.6
    xs = [cx - 4.0, cx, cx + 4.0]
    for bx, (name, boxes) in zip(xs, BRANCHES):
        _arrow(ax, cx, ys[-1] - height / 2 - 0.02, bx, by + height / 2 + 0.35)
        ax.text(bx, by + height / 2 + 0.18, name, ha="center", va="bottom", fontsize=9,
                weight="bold", color="#0d47a1")
        for label, module, colour in boxes:
            _box(ax, bx, by, bw, height + 0.1, label, module, colour)
    ty = by - step - 0.35
    for bx in xs:
        _arrow(ax, bx, by - height / 2 - 0.07, cx, ty + height / 2 + 0.02)
    for label, module, colour in TAIL:
        _box(ax, cx, ty, width, height, label, module, colour)
        if label is not TAIL[-1][0]:
            _arrow(ax, cx, ty - height / 2 - 0.02, cx, ty - step + height / 2 + 0.02)
        ty -= step
    # legend
    for i, (colour, text) in enumerate([(LAYER, "a layer of tvm_fusion"),
                                        (TVM, "TVM 0.27, unchanged"),
                                        (OURS, "tvm_fusion graph phase"),
                                        (TARGET, "tvm_fusion backend phase")]):
        ax.add_patch(FancyBboxPatch((0.0 + 3.6 * i, 1.05), 0.45, 0.3, boxstyle="round,pad=0.02",
                                    facecolor=colour, edgecolor=EDGE))
        ax.text(0.6 + 3.6 * i, 1.2, text, va="center", fontsize=9)
    ax.set_xlim(-0.6, 20.0)
    ax.set_ylim(ty + step - height, 1.6)
    ax.axis("off")
    ax.set_title("tvm_fusion: its layers, and where its phases sit in a TVM build "
                 "(Relax, TVM 0.27)", fontsize=13, pad=6)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "architecture.png")
    args = parser.parse_args(argv)
    draw(args.out)
    print(args.out)


if __name__ == "__main__":
    main()

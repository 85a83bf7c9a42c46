"""Draw docs/img/architecture.png: where tvm_fusion's passes sit in a TVM build.

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
EDGE = "#424242"

# (label, module, colour); top to bottom
MAIN = [
    ("ONNX model  →  from_onnx(model, keep_params_in_input=False)", "TVM frontend", TVM),
    ("RewriteByMathProperties", "relay_passes/rewrite/math_properties.py  ·  DNNFusion §4.2", OURS),
    ("library dispatch · DecomposeOpsForInference · LegalizeOps ·\n"
     "AnnotateTIROpPattern · FoldConstant · CanonicalizeBindings · DCE",
     "transform.legalize_passes  (TVM's passes)", TVM),
    ("EliminateLayoutTransforms", "layout/smartmem.py  ·  SmartMem (ASPLOS'24)", OURS),
    ("AnnotateMappingType", "relay_passes/mapping_type.py  ·  DNNFusion Table 2", OURS),
    ("PlanFusion  (strategy = \"dnnfusion\" | \"tvm\")",
     "relay_passes/ecg.py, fusion_plan.py, grouping.py  ·  Table 3, Listing 1\n"
     "yellow cells: tuning/oracle.py (profiling DB, latency model, analytic)\n"
     "strategy=\"apollo\": ApolloFuse replaces PlanFusion → FuseTIR → schedules (apollo.md)",
     OURS),
    ("FuseTIR", "TVM's own, never reimplemented", TVM),
]
BRANCHES = [
    ("CPU (llvm): in Sequential", [("ScheduleFusedBlocks",
                                    "tir_schedules/  ·  one loop nest per block", TARGET)]),
    ("GPU: relax_pipeline=\"tvm_fusion\"", [("ApplyGPUSchedules",
                                            "pipeline.py  ·  stock DLight rules", TARGET)]),
    ("Adreno textures: compile_opencl", [("AnnotateTextureScopes\nScheduleTextureKernels",
                                          "layout/texture.py, texture_schedule.py", TARGET)]),
]
TAIL = [
    ("dataflow lowering · finalisation  →  tvm.compile(..., tir_pipeline)",
     "TVM's backend passes; Adreno textures: tir_pipeline=\"tvm_fusion_adreno\"", TVM),
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


def draw(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(12, 13.5))
    width, height, step = 7.6, 0.95, 1.3
    cx = 6.0
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
    # bracket: what tvm_fusion.transform.Sequential covers
    top, bottom = ys[1] + height / 2 + 0.1, ys[-1] - height / 2 - 0.1
    ax.plot([cx + width / 2 + 0.25] * 2, [top, bottom], color="#e65100", lw=2.5)
    ax.text(cx + width / 2 + 0.4, (top + bottom) / 2,
            "tvm_fusion.transform.Sequential(target, **options)\n"
            "replaces stock TVM's\nLegalizeOps … FuseOps → FuseTIR\n"
            "(+ ScheduleFusedBlocks on llvm)\n\n"
            "relax_pipeline=\"tvm_fusion\"\n(pipeline.py) adds the target's\n"
            "schedules and TVM's lowering", fontsize=8.5, va="center", color="#bf360c")
    # target branches
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
    for i, (colour, text) in enumerate([(TVM, "TVM 0.27, unchanged"),
                                        (OURS, "tvm_fusion graph passes"),
                                        (TARGET, "tvm_fusion, per target")]):
        ax.add_patch(FancyBboxPatch((0.0 + 3.3 * i, 1.05), 0.45, 0.3, boxstyle="round,pad=0.02",
                                    facecolor=colour, edgecolor=EDGE))
        ax.text(0.6 + 3.3 * i, 1.2, text, va="center", fontsize=9)
    ax.set_xlim(-0.6, 14.6)
    ax.set_ylim(ty + step - height, 1.6)
    ax.axis("off")
    ax.set_title("Where tvm_fusion sits in a TVM build (Relax, TVM 0.27)", fontsize=13, pad=6)
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

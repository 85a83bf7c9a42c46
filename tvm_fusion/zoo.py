"""The model-zoo table (DNNFusion Table 5 analogue): every exported model, stock vs tvm_fusion.

Models are the ``*.onnx`` files of a folder (``./models``, or
``$TVM_FUSION_MODELS``), as ``python -m tvm_fusion.export_models`` writes them; the table does not
need PyTorch. Output: Markdown, JSON and a PNG bar chart of kernels per model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .atomic import atomic_write_text
from .compile import load_onnx
from .export_models import models_dir
from .report import ModelReport, make_report


def zoo_models(path: str | os.PathLike | None = None) -> list[Path]:
    folder = models_dir(path)
    found = sorted(folder.glob("*.onnx"))
    if not found:
        raise ValueError(f"no *.onnx models in {folder}: export the zoo with `python -m "
                         f"tvm_fusion.export_models` (pip install 'tvm_fusion[models]')")
    return found


def zoo_reports(paths: list[Path], target="llvm", check: bool = True,
                **options) -> list[ModelReport]:
    """One report per model, with a progress bar."""
    reports = []
    bar = tqdm(paths, desc="zoo", unit="model")
    for path in bar:
        bar.set_postfix_str(path.stem)
        reports.append(make_report(load_onnx(path), path.stem, target, check=check, **options))
    return reports


_COLUMNS = [
    ("model", lambda r: r.name),
    ("operators", lambda r: r.operators),
    ("CIL", lambda r: r.compute_intensive),
    ("MIL", lambda r: r.memory_intensive),
    ("stock TVM kernels", lambda r: r.stock_kernels),
    ("tvm_fusion kernels", lambda r: r.fused_kernels),
    ("anchor bound", lambda r: r.anchor_bound),
    ("IRS before (MB)", lambda r: f"{r.irs_bytes_before / 1e6:.1f}"),
    ("IRS after (MB)", lambda r: f"{r.irs_bytes_after / 1e6:.1f}"),
    ("fusion rate", lambda r: f"{r.fusion_rate:.2f}"),
    ("planning (s)", lambda r: f"{r.planning_seconds:.3f}"),
    ("max abs err vs ONNX", lambda r: "—" if r.max_error_vs_onnx is None
     else f"{r.max_error_vs_onnx:.1e}"),
]


def to_markdown(reports: list[ModelReport]) -> str:
    head = "| " + " | ".join(name for name, _ in _COLUMNS) + " |"
    rule = "|" + "---|" * len(_COLUMNS)
    rows = ["| " + " | ".join(str(get(r)) for _, get in _COLUMNS) + " |" for r in reports]
    return "\n".join([head, rule, *rows])


def plot_kernels(reports: list[ModelReport], path: Path) -> Path:
    """Grouped bars: stock TVM vs tvm_fusion kernels per model, anchor bound as a tick."""
    import matplotlib  # the optional "bench" extra: only drawing needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = np.arange(len(reports))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(reports) + 2), 4))
    ax.bar(x - 0.2, [r.stock_kernels for r in reports], 0.4, label="stock TVM (FuseOps)")
    ax.bar(x + 0.2, [r.fused_kernels for r in reports], 0.4, label="tvm_fusion (DNNFusion)")
    ax.scatter(x + 0.2, [r.anchor_bound for r in reports], marker="_", s=300, color="black",
               label="anchor bound", zorder=3)
    ax.set_xticks(x, [r.name for r in reports], rotation=45, ha="right")
    ax.set_ylabel("kernels per inference")
    ax.set_title("Kernels after fusion (fewer is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(reports: list[ModelReport], out_dir: str | os.PathLike) -> dict[str, Path]:
    """``zoo.md``, ``zoo.json`` and ``zoo_kernels.png`` in ``out_dir``, each written atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "zoo.md", "json": out / "zoo.json", "chart": out / "zoo_kernels.png"}
    atomic_write_text(paths["markdown"], to_markdown(reports) + "\n")
    atomic_write_text(paths["json"], json.dumps([r.to_json() for r in reports], indent=2) + "\n")
    tmp_chart = paths["chart"].with_suffix(".tmp.png")
    plot_kernels(reports, tmp_chart)
    os.replace(tmp_chart, paths["chart"])
    return paths

"""Measure rewriting on ONNX models: FLOPs and kernel counts with and without it.

:func:`measure` gives one Markdown table row per model (the table in ``docs/rewrite.md``; the
command is ``scripts/measure_rewrite.py``). Kernel counts are ``count_kernels(fuse(mod, "llvm",
strategy))`` for the DNNFusion planner and for stock TVM ``FuseOps``, on the imported module
and on the rewritten one. ``check=True`` also compiles the rewritten module with
``compile_model`` (``options`` are pipeline options, e.g. ``schedule=False``) and compares it
with ONNX Runtime (rtol 1e-3).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import tvm

from ...compile import compile_model, count_kernels, fuse, graph_input_names, import_onnx, load_onnx
from ...compile import run as run_executable
from ...feeds import random_inputs
from ...instrument import Collector
from ...numerics import compare, onnx_reference
from .math_properties import RULES, RewriteByMathProperties

HEADER = ("| model | FLOPs before | FLOPs after | saved | rewrites (rules) | rewrite s "
          "| kernels dnnfusion | kernels stock | max abs err vs ORT |\n"
          "|---|---|---|---|---|---|---|---|---|")


def measure(path: Path, check: bool = False, options: dict | None = None) -> str:
    """One table row for the model at ``path``."""
    model = load_onnx(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = import_onnx(model)
        collector = Collector()
        start = time.perf_counter()
        with tvm.transform.PassContext(instruments=[collector]):
            rewritten = RewriteByMathProperties()(mod)
        seconds = time.perf_counter() - start
        (stats,) = collector.rewrite_stats
        kernels = {}
        for strategy in ("dnnfusion", "tvm"):  # rewrite=False: "before" must not rewrite
            kernels[strategy] = tuple(
                count_kernels(fuse(m, "llvm", strategy=strategy, rewrite=False))
                for m in (mod, rewritten))
        error = "—"
        if check:
            feeds = random_inputs(model, seed=0)
            outputs = run_executable(compile_model(rewritten, "llvm", **(options or {})),
                                     [feeds[n] for n in graph_input_names(model)])
            error = f"{compare(outputs, onnx_reference(model, feeds), rtol=1e-3, atol=1e-4):.1e}"
    saved = stats.flops_before - stats.flops_after
    rules = ", ".join(f"{k} {v}" for k, v in sorted(stats.fired.items())) or "—"
    return (f"| {path.stem} | {stats.flops_before / 1e9:.4f} G | {stats.flops_after / 1e9:.4f} G "
            f"| {100 * saved / max(stats.flops_before, 1):.2f} % ({saved / 1e6:.2f} M) "
            f"| {stats.rewrites} ({rules}) | {seconds:.2f} "
            f"| {kernels['dnnfusion'][0]} → {kernels['dnnfusion'][1]} "
            f"| {kernels['tvm'][0]} → {kernels['tvm'][1]} | {error} |")


def rules_markdown() -> str:
    """The rule registry as a Markdown table (``docs/rewrite.md`` embeds its output)."""
    lines = ["| rule | property | Table 4 | pattern → result | FLOPs (m×n) | preconditions "
             "| exact / rtol |", "|---|---|---|---|---|---|---|"]
    for rule in RULES.values():
        rows = ", ".join(str(r) for r in rule.table4) or "—"
        pre = "; ".join(rule.preconditions) or "—"
        tol = "exact" if rule.exact else f"{rule.rtol:g}"
        kind = "" if rule.engine == "standalone" else f" ({rule.engine})"
        lines.append(f"| `{rule.name}`{kind} | {rule.prop} | {rows} | {rule.lhs} → {rule.rhs} "
                     f"| {rule.flops} | {pre} | {tol} |")
    return "\n".join(lines)

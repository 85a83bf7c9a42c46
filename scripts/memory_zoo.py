#!/usr/bin/env python
"""Planned activation memory of every zoo model, stock FuseOps vs tvm_fusion (issue 20, item 3).

    python scripts/memory_zoo.py [models/*.onnx ...] [--target JSON]

One line per model: megabytes (10⁶ bytes) of :func:`tvm_fusion.memory.planned_memory`'s total
(TVM's ``StaticPlanBlockMemory`` storage + run-time allocations + the largest kernel workspace)
for stock FuseOps' grouping and for tvm_fusion, with the planned storage and the largest
workspace apart. Nothing is compiled or timed: each module is lowered just far enough for the
planner to run, so the whole zoo takes minutes, not the hour a bench run does. A model with
symbolic dimensions is counted at the sizes the cost model assumes (``tvm_fusion.symbolic``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tvm_fusion.compile import fuse, import_model, load_model  # noqa: E402
from tvm_fusion.memory import planned_memory  # noqa: E402
from tvm_fusion.target import host_target, to_target  # noqa: E402

MB = 1e6


def measure(path: Path, target) -> dict:
    """MemoryPlans of one model: stock FuseOps' module planned by TVM (as its default pipeline
    builds it) and re-packed (as tvm_fusion's lowering builds it), and tvm_fusion's module
    planned by TVM alone and as its build plans it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = import_model(load_model(path))
        stock_mod, ours_mod = fuse(mod, target, strategy="tvm"), fuse(mod, target)
        return {"stock": planned_memory(stock_mod, target, repack=False),
                "stock_repacked": planned_memory(stock_mod, target),
                "ours_tvm_plan": planned_memory(ours_mod, target, repack=False),
                "ours": planned_memory(ours_mod, target)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = sorted(Path(os.environ.get("TVM_FUSION_MODELS", "models")).glob("*.onnx"))
    parser.add_argument("models", nargs="*", type=Path, default=default)
    parser.add_argument("--target", default=None, help="target JSON (default: this host's)")
    args = parser.parse_args(argv)
    target = to_target(args.target) if args.target else host_target()
    print(f"{'model':<18} {'stock':>8} {'ours':>8} {'ratio':>6} | {'stock*':>8} {'ours-':>8}"
          f" | ours planned+workspace (largest workspace kernel)   [MB; stock*: stock re-packed,"
          f" ours-: ours with TVM's plan alone]")
    above = []
    for path in args.models:
        start = time.perf_counter()
        try:
            m = measure(path, target)
        except Exception as err:  # noqa: BLE001 - one line per model, the zoo goes on
            print(f"{path.stem:<18} failed: {str(err).splitlines()[0][:120]}", flush=True)
            continue
        stock, ours = m["stock"], m["ours"]
        if ours.total > stock.total:
            above.append(path.stem)
        print(f"{path.stem:<18} {stock.total / MB:8.3f} {ours.total / MB:8.3f} "
              f"{ours.total / max(stock.total, 1):6.3f} | {m['stock_repacked'].total / MB:8.3f} "
              f"{m['ours_tvm_plan'].total / MB:8.3f} | {ours.planned / MB:.3f}+"
              f"{ours.workspace / MB:.3f} ({ours.workspace_kernel}) "
              f"[{time.perf_counter() - start:.0f} s]", flush=True)
    print(f"above stock: {', '.join(above) or 'none'}")
    return 1 if above else 0


if __name__ == "__main__":
    sys.exit(main())

"""SmartMem's numbers for docs/smartmem.md, as Markdown tables: kernels and pure data-movement
kernels (stock TVM vs tvm_fusion without and with SmartMem's elimination), or CPU latency with
the elimination on and off under the same schedules, in one run.

    python scripts/measure_smartmem.py counts swin_block models/swin_t.onnx ...
    python scripts/measure_smartmem.py time swin_block models/swin_t.onnx models/vit_b16.onnx

``swin_block`` names the Swin-T window-attention block of :mod:`tvm_fusion.models.swin`. The
measurement itself is :mod:`tvm_fusion.layout.measure`.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from tvm_fusion.layout.measure import count_row, time_row
from tvm_fusion.threads import use_physical_cores

_GROUPING = {"dnnfusion": "DNNFusion planner", "tvm": "stock FuseOps"}


def main(argv: list[str] | None = None) -> None:
    use_physical_cores()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("counts", "time"))
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--strategy", default="dnnfusion,tvm",
                        help="time: groupings to measure the elimination under (comma list)")
    args = parser.parse_args(argv)
    warnings.simplefilter("default")
    if args.what == "counts":
        print("| model | stock TVM kernels | stock data-movement | tvm_fusion (no layout) | "
              "data-movement | tvm_fusion + SmartMem | data-movement | Fixed ops eliminated "
              "| layout copies |")
        print("|---|---|---|---|---|---|---|---|---|")
        for path in args.models:
            r = count_row(path)
            print(f"| {r['model']} | {r['stock']} | {r['stock_moves']} | {r['dnnfusion']} | "
                  f"{r['dnnfusion_moves']} | {r['smartmem']} | {r['smartmem_moves']} | "
                  f"{r['eliminated']} | {r['copies']} |", flush=True)
    else:
        print("| model | grouping | without elimination (ms) | with elimination (ms) | "
              "speedup | max abs diff |")
        print("|---|---|---|---|---|---|")
        for path in args.models:
            for strategy in args.strategy.split(","):
                r = time_row(path, args.rounds, strategy)
                print(f"| {r['model']} | {_GROUPING[strategy]} | {r['without_ms']:.1f} | "
                      f"{r['with_ms']:.1f} | "
                      f"{r['speedup']:.2f}× | {r['max_abs_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()

"""Compile time and kernel count of ONNX models under two source trees of tvm_fusion, in turns.

    python scripts/compile_time.py --trees OLD_TREE NEW_TREE models/*.onnx

Each build runs in a process of its own with ``PYTHONPATH=TREE`` (so any checkout can be
compared with any other), on one core (``TVM_NUM_THREADS=1``, ``taskset -c CORE``), in the
order old, new, new, old per model; the best of each tree's two builds is kept. The target is
the host CPU with one core. Prints a Markdown table; ``--json`` writes every build.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_ONE_BUILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
import tvm
from tvm_fusion.compile import compile_model, count_kernels, fuse, import_onnx, load_onnx
target = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                            "num-cores": 1})
mod = import_onnx(load_onnx(sys.argv[1]))
start = time.perf_counter()
compile_model(mod, target)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "kernels": count_kernels(fuse(mod, target))}))
"""


def build(tree: str, model: str, core: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "TVM_NUM_THREADS": "1"}
    cmd = ["taskset", "-c", str(core), sys.executable, "-c", _ONE_BUILD, model]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        raise SystemExit(f"compile_time: {model} under {tree}: {lines[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs=2, required=True, metavar=("OLD", "NEW"))
    parser.add_argument("--core", type=int, default=0, help="CPU core to pin builds to")
    parser.add_argument("--json", help="write every build here")
    parser.add_argument("models", nargs="+")
    args = parser.parse_args()
    old, new = args.trees
    records, rows = [], []
    total = {old: 0.0, new: 0.0}
    for model in args.models:
        runs = {old: [], new: []}
        for tree in (old, new, new, old):
            result = build(tree, model, args.core)
            runs[tree].append(result)
            records.append({"model": model, "tree": tree, **result})
        best = {t: min(r["seconds"] for r in runs[t]) for t in runs}
        total[old] += best[old]
        total[new] += best[new]
        rows.append(f"| {Path(model).stem} | {runs[old][0]['kernels']} → {runs[new][0]['kernels']} "
                    f"| {best[old]:.2f} | {best[new]:.2f} | {best[new] / best[old]:.2f} |")
        print(rows[-1], file=sys.stderr, flush=True)
    print("| model | kernels old → new | compile old (s) | compile new (s) | new / old |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"| all {len(rows)} | | {total[old]:.1f} | {total[new]:.1f} | "
          f"{total[new] / total[old]:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

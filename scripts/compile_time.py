"""Compile time and kernel count of ONNX models under two source trees of tvm_fusion, in turns.

    python scripts/compile_time.py --trees OLD_TREE NEW_TREE models/*.onnx
    python scripts/compile_time.py --trees OLD_TREE NEW_TREE Tanh:5 Tanh,Exp,Mul:161

A model that is not a file is a chain ``OPS:N``: N operators cycling through OPS on a 4x64
input (Add/Mul/Sub take the input as their second operand), as tests/test_compile_time.py
builds them.

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
import tempfile
from pathlib import Path

import onnx
from onnx import TensorProto, helper

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


def chain_model(spec: str, folder: str) -> str:
    """An ONNX file of the chain ``OPS:N`` (see the module docstring)."""
    ops, _, count = spec.rpartition(":")
    names = ops.split(",")
    nodes, prev = [], "x"
    for i in range(int(count)):
        op = names[i % len(names)]
        out = "y" if i == int(count) - 1 else f"t{i}"
        nodes.append(helper.make_node(op, [prev, "x"] if op in ("Add", "Mul", "Sub") else [prev],
                                      [out]))
        prev = out
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])])
    path = os.path.join(folder, f"{ops.replace(',', '-')}x{count}.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def build(tree: str, model: str, core: int, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "TVM_NUM_THREADS": "1"}
    cmd = ["taskset", "-c", str(core), sys.executable, "-c", _ONE_BUILD, model]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"seconds": float("inf"), "kernels": "?"}
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        raise SystemExit(f"compile_time: {model} under {tree}: {lines[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs=2, required=True, metavar=("OLD", "NEW"))
    parser.add_argument("--core", type=int, default=0, help="CPU core to pin builds to")
    parser.add_argument("--json", help="write every build here")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds per build; a slower build is reported as such")
    parser.add_argument("models", nargs="+")
    args = parser.parse_args()
    old, new = args.trees
    records, rows = [], []
    total = {old: 0.0, new: 0.0}
    folder = tempfile.mkdtemp(prefix="compile_time.")
    models = [m if os.path.isfile(m) else chain_model(m, folder) for m in args.models]
    for model in models:
        runs = {old: [], new: []}
        for tree in (old, new, new, old):
            result = build(tree, model, args.core, args.timeout)
            runs[tree].append(result)
            records.append({"model": model, "tree": tree, **result})
        best = {t: min(r["seconds"] for r in runs[t]) for t in runs}
        total[old] += best[old]
        total[new] += best[new]
        shown = {t: f"{best[t]:.2f}" if best[t] != float("inf") else f"> {args.timeout:.0f}"
                 for t in best}
        rows.append(f"| {Path(model).stem} | {runs[old][0]['kernels']} → {runs[new][0]['kernels']} "
                    f"| {shown[old]} | {shown[new]} | {best[new] / best[old]:.2f} |")
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

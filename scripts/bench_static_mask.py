"""Static-length causal masks: the figures of docs/attention.md's static-length table.

The Llama-style attention (32 query heads, 4 key/value heads, head size 64, transformers'
``full(min).triu(1)`` mask) built at each static length four ways, in one process, calls
alternated (``bench_attention.alternate``): tvm_fusion as it is (the folded mask read back as
``j > i``), tvm_fusion with the constant arguments hidden from the attention template (what it
did before: the mask read as data), the symbolic-length module at the same length, and stock
FuseOps with the same schedules. Run pinned, one thread::

    TVM_NUM_THREADS=1 taskset -c 1 python scripts/bench_static_mask.py --seqs 1024,2048
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_attention import STOCK, alternate, run_once, vm_call, with_upper_bound  # noqa: E402

import tvm_fusion.tir_schedules.fused_block as fused_block  # noqa: E402
from tvm_fusion.compile import compile_model, graph_input_names, import_onnx  # noqa: E402
from tvm_fusion.feeds import random_inputs  # noqa: E402
from tvm_fusion.models.attention import llama_attention  # noqa: E402
from tvm_fusion.numerics import max_abs_error  # noqa: E402
from tvm_fusion.target import host_target_dict, to_target  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="1024,2048")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]
    target = to_target(host_target_dict() | {"num-cores": 1})
    shape = {"heads": 32, "kv_heads": 4, "head_dim": 64}
    sym_model = llama_attention(seq="seq", **shape)
    symbolic = compile_model(with_upper_bound(import_onnx(sym_model), {"seq": max(seqs)}),
                             target)
    collect = fused_block.constant_arguments
    for seq in seqs:
        model = llama_attention(seq=seq, **shape)
        mod = import_onnx(model)
        builds = {"static": compile_model(mod, target)}
        fused_block.constant_arguments = lambda _mod: {}  # the mask read as data
        try:
            builds["static_as_data"] = compile_model(mod, target)
        finally:
            fused_block.constant_arguments = collect
        builds["symbolic"] = symbolic
        builds["stock"] = compile_model(mod, target, **STOCK)
        feeds = random_inputs(model, seed=0)
        inputs = [feeds[n] for n in graph_input_names(model)]
        ref = run_once(builds["stock"], inputs)
        errors = {name: max_abs_error(run_once(ex, inputs), ref) for name, ex in builds.items()}
        times = alternate({name: vm_call(ex, inputs) for name, ex in builds.items()},
                          args.seconds)
        row = {"seq": seq, "ms": {name: times[name] * 1e3 for name in builds},
               "calls": times["static_calls"], "max_abs_err_vs_stock": errors,
               "as_data_over_static": times["static_as_data"] / times["static"],
               "stock_over_static": times["stock"] / times["static"],
               "symbolic_over_static": times["symbolic"] / times["static"]}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

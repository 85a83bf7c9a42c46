"""The host CPU target against a bare ``llvm``, and a symbolic build against a static one.

    python scripts/bench_host_target.py [--repeat 10]

Models (built in code, nothing downloaded): a BERT-base-sized encoder layer
(``tvm_fusion.models.transformer_encoder_layer``: seq 128, hidden 768, 12 heads, FFN 3072) and
the symbolic encoder layer and conv net of :mod:`tvm_fusion.models.symbolic` (run at batch 1,
seq 128 and batch 8). Every build uses the tvm_fusion pipeline; all are built first, then timed
in turns (:func:`tvm_fusion.bench.medians_in_turns`), so the two targets see the same machine
state.
For the symbolic encoder a static build at the same size is timed too: what the symbolic
schedules cost against shapes known at compile time.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tvm_fusion.threads import use_physical_cores  # noqa: E402

use_physical_cores()

import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from tvm_fusion.bench import medians_in_turns  # noqa: E402
from tvm_fusion.compile import compile_model, graph_input_names, import_onnx  # noqa: E402
from tvm_fusion.feeds import random_inputs  # noqa: E402
from tvm_fusion.models import transformer_encoder_layer  # noqa: E402
from tvm_fusion.models.symbolic import conv_net, encoder_layer  # noqa: E402
from tvm_fusion.numerics import max_abs_error, onnx_reference  # noqa: E402
from tvm_fusion.target import host_cpu, host_target  # noqa: E402


def _vm_call(executable, inputs):
    device = tvm.cpu()
    vm = relax.VirtualMachine(executable, device)
    args = [tvm.runtime.tensor(x, device) for x in inputs]
    return lambda: vm["main"](*args)


def _case(model, sizes: dict, static_too: bool = False) -> dict:
    feeds = random_inputs(model, seed=0, shape_overrides=sizes)
    inputs = [feeds[k] for k in graph_input_names(model)]
    reference = onnx_reference(model, feeds)
    mod = import_onnx(model)
    builds = {"llvm": "llvm", "host": host_target()}
    calls = {}
    for label, tgt in builds.items():
        calls[label] = _vm_call(compile_model(mod, tgt), inputs)
    if static_too:  # the same model with its inputs' shapes fixed at compile time
        shapes = {k: feeds[k].shape for k in graph_input_names(model)}
        static = import_onnx(model, shape_dict=shapes)
        calls["host, static shapes"] = _vm_call(compile_model(static, host_target()), inputs)
    for label, call in calls.items():
        out = call()
        got = [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]
        assert max_abs_error(got, reference) < 1e-3, label
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()

    cases = {
        "bert_base_layer (static, seq 128)": (
            transformer_encoder_layer(seq=128, hidden=768, heads=12, ffn=3072), {}, False),
        "encoder_layer (symbolic, batch 1 seq 128)": (
            encoder_layer(), {"batch": 1, "seq": 128}, True),
        "conv_net (symbolic, batch 8)": (conv_net(), {"batch": 8}, False),
    }
    print(f"host CPU: {host_cpu()}; target {host_target()}; runtime threads "
          f"{use_physical_cores()}")
    print("| model | build | median ms | vs bare llvm |")
    print("|---|---|---|---|")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (model, sizes, static) in cases.items():
            calls = _case(model, sizes, static)
            medians = medians_in_turns(calls, warmup=2, repeat=args.repeat, turn_s=0.2)
            for label, ms in medians.items():
                print(f"| {name} | {label} | {ms:.3f} | {medians['llvm'] / ms:.2f}x |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

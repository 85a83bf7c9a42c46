"""OptiFX conv→conv microbenchmarks (one run): each fused chain vs the same convs scheduled
separately by tvm_fusion; then end-to-end latency with conv_chains on/off. Every build of a row
is made first and the builds are then timed in turns (``medians_in_turns``). Prints Markdown.

    python scripts/bench_conv_chains.py [--e2e mobilenet_v2,efficientnet_b0,unet] [--repeat 15]
"""

from __future__ import annotations

import argparse
import os

import tvm
from tvm import relax

from tvm_fusion.bench import medians_in_turns
from tvm_fusion.compile import (
    compile_model,
    count_kernels,
    fuse,
    graph_input_names,
    import_onnx,
    load_onnx,
)
from tvm_fusion.relay_passes.conv_chains_testing import chain_model
from tvm_fusion.testing import random_inputs
from tvm_fusion.threads import use_physical_cores

TARGET = {"kind": "llvm", "mcpu": "znver5", "num-cores": 2}
CHAINS = {  # MobileNetV2 dw→pw shapes and 3×3→1×1 as in the zoo's ResNet/U-Net
    "dw3x3→pw 96@56 (MobileNetV2)": (96, 56, [("conv", -1, 3, 1, 1, -1, "relu6"),
                                            ("conv", 24, 1, 1, 0, 1, None)]),
    "dw3x3→pw 144@28 (MobileNetV2)": (144, 28, [("conv", -1, 3, 1, 1, -1, "relu6"),
                                              ("conv", 32, 1, 1, 0, 1, None)]),
    "dw3x3→pw 384@14 (MobileNetV2)": (384, 14, [("conv", -1, 3, 1, 1, -1, "relu6"),
                                              ("conv", 64, 1, 1, 0, 1, None)]),
    "3x3→1x1 64@56": (64, 56, [("conv", 64, 3, 1, 1, 1, "relu"),
                                ("conv", 64, 1, 1, 0, 1, None)]),
}


def _build(model, **options):
    """A no-argument call of the compiled model on its random inputs, and its kernel count."""
    tgt = tvm.target.Target(TARGET)
    mod = import_onnx(model)
    dev = tvm.cpu()
    vm = relax.VirtualMachine(compile_model(mod, tgt, **options), dev)
    feeds = random_inputs(model)
    args = [tvm.runtime.tensor(feeds[n], dev) for n in graph_input_names(model)]
    return (lambda: vm["main"](*args)), count_kernels(fuse(mod, tgt, **options))


def main():
    use_physical_cores()
    ap = argparse.ArgumentParser()
    ap.add_argument("--e2e", default="mobilenet_v2,efficientnet_b0,unet")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    print("| chain | separate (ms) | fused (ms) | speedup |\n|---|---|---|---|")
    for name, (c, s, ops) in CHAINS.items():
        model = chain_model(c, s, ops)
        sep, _ = _build(model, conv_chains="off", conv_layout="NCHW")
        fus, _ = _build(model, table3={("M2M", "M2M"): "green"}, conv_chains="off",
                        conv_layout="NCHW")
        ms = medians_in_turns({"sep": sep, "fus": fus}, 5, args.repeat, number=20)
        print(f"| {name} | {ms['sep']:.3f} | {ms['fus']:.3f} | {ms['sep'] / ms['fus']:.2f}x |",
              flush=True)
    if not args.e2e:
        return
    # chains need NCHW convs, so "off" is the NCHW build too; the default build (packed convs
    # where conv_layout="auto" packs) is the last column
    print("\n| model | kernels off | kernels on | off (ms) | on (ms) | speedup | default (ms) |")
    print("|---|---|---|---|---|---|---|")
    for name in args.e2e.split(","):
        model = load_onnx(os.path.join("models", f"{name}.onnx"))
        (off, koff), (on, kon), (default, _) = (
            _build(model, conv_chains="off", conv_layout="NCHW"),
            _build(model, conv_chains="cost_model"), _build(model))
        ms = medians_in_turns({"off": off, "on": on, "default": default}, 2, args.repeat)
        print(f"| {name} | {koff} | {kon} | {ms['off']:.2f} | {ms['on']:.2f} | "
              f"{ms['off'] / ms['on']:.2f}x | {ms['default']:.2f} |", flush=True)


if __name__ == "__main__":
    main()

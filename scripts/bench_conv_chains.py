"""OptiFX conv→conv microbenchmarks (one run): each fused chain vs the same convs scheduled
separately by tvm_fusion; then end-to-end latency with conv_chains on/off. Every build of a row
is made first and the builds are then timed in turns (``medians_in_turns``). Prints Markdown.

    python scripts/bench_conv_chains.py [--e2e mobilenet_v2,efficientnet_b0,unet] [--repeat 15]
        [--db out/conv_chains.db]
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
from tvm_fusion.feeds import random_inputs
from tvm_fusion.models.conv_chains import chain_model
from tvm_fusion.numerics import max_abs_error, onnx_reference
from tvm_fusion.target import host_target
from tvm_fusion.threads import use_physical_cores

# (channels, input size, ops, how often the pair occurs in the model)
DW = ("conv", -1, 3, 1, 1, -1, "relu6")
DW_S2 = ("conv", -1, 3, 2, 1, -1, "relu6")


def _pw(cout, act=None):
    return ("conv", cout, 1, 1, 0, 1, act)


CHAINS = {  # every depthwise -> pointwise pair of MobileNetV2, in model order
    "MobileNetV2 dw 32@112 -> pw 16": (32, 112, [DW, _pw(16)], 1),
    "MobileNetV2 dw/s2 96@112 -> pw 24": (96, 112, [DW_S2, _pw(24)], 1),
    "MobileNetV2 dw 144@56 -> pw 24": (144, 56, [DW, _pw(24)], 1),
    "MobileNetV2 dw/s2 144@56 -> pw 32": (144, 56, [DW_S2, _pw(32)], 1),
    "MobileNetV2 dw 192@28 -> pw 32": (192, 28, [DW, _pw(32)], 2),
    "MobileNetV2 dw/s2 192@28 -> pw 64": (192, 28, [DW_S2, _pw(64)], 1),
    "MobileNetV2 dw 384@14 -> pw 64": (384, 14, [DW, _pw(64)], 3),
    "MobileNetV2 dw 384@14 -> pw 96": (384, 14, [DW, _pw(96)], 1),
    "MobileNetV2 dw 576@14 -> pw 96": (576, 14, [DW, _pw(96)], 2),
    "MobileNetV2 dw/s2 576@14 -> pw 160": (576, 14, [DW_S2, _pw(160)], 1),
    "MobileNetV2 dw 960@7 -> pw 160": (960, 7, [DW, _pw(160)], 2),
    "MobileNetV2 dw 960@7 -> pw 320": (960, 7, [DW, _pw(320)], 1),
    # ResNet-50's bottleneck 3x3 -> 1x1 expansion (stride-1 blocks of each stage)
    "ResNet-50 3x3 64@56 -> 1x1 256": (64, 56, [("conv", 64, 3, 1, 1, 1, "relu"), _pw(256)], 2),
    "ResNet-50 3x3 128@28 -> 1x1 512": (128, 28, [("conv", 128, 3, 1, 1, 1, "relu"),
                                                  _pw(512)], 3),
    "ResNet-50 3x3 256@14 -> 1x1 1024": (256, 14, [("conv", 256, 3, 1, 1, 1, "relu"),
                                                   _pw(1024)], 5),
    "ResNet-50 3x3 512@7 -> 1x1 2048": (512, 7, [("conv", 512, 3, 1, 1, 1, "relu"),
                                                 _pw(2048)], 2),
}


def _build(model, **options):
    """A no-argument call of the compiled model on its random inputs (returning its outputs),
    and its kernel count."""
    tgt = host_target()
    mod = import_onnx(model)
    dev = tvm.cpu()
    vm = relax.VirtualMachine(compile_model(mod, tgt, **options), dev)
    feeds = random_inputs(model)
    args = [tvm.runtime.tensor(feeds[n], dev) for n in graph_input_names(model)]
    return (lambda: vm["main"](*args)), count_kernels(fuse(mod, tgt, **options))


def _error_vs_onnxruntime(model, call) -> float:
    out = call()
    outs = [out] if hasattr(out, "numpy") else list(out)
    ref = onnx_reference(model, random_inputs(model))
    return max_abs_error(outs, ref)


def main():
    use_physical_cores()
    ap = argparse.ArgumentParser()
    ap.add_argument("--e2e", default="mobilenet_v2,efficientnet_b0,unet")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--db", default="out/conv_chains.db",
                    help="profiling database of the measured chains (created if missing)")
    args = ap.parse_args()
    print("| chain | x in model | separate (ms) | fused (ms) | speedup |\n|---|---|---|---|---|")
    totals: dict[str, list[float]] = {}
    for name, (c, s, ops, count) in CHAINS.items():
        model = chain_model(c, s, ops)
        sep, _ = _build(model, conv_chains="off", conv_layout="NCHW")
        fus, _ = _build(model, table3={("M2M", "M2M"): "green"}, conv_chains="off",
                        conv_layout="NCHW")
        ms = medians_in_turns({"sep": sep, "fus": fus}, 5, args.repeat, number=20)
        print(f"| {name} | {count} | {ms['sep']:.3f} | {ms['fus']:.3f} | "
              f"{ms['sep'] / ms['fus']:.2f}x |", flush=True)
        total = totals.setdefault(name.split()[0], [0.0, 0.0])
        total[0] += count * ms["sep"]
        total[1] += count * ms["fus"]
    for model_name, (sep, fus) in totals.items():
        print(f"| all {model_name} pairs (time-weighted) | | {sep:.3f} | {fus:.3f} | "
              f"{sep / fus:.2f}x |")
    if not args.e2e:
        return
    # chains need NCHW convs, so "off" is the NCHW build too; the default build (packed convs
    # where conv_layout="auto" packs) is the last column
    # "measured": every candidate chain timed fused vs as planned (profiling database)
    print("\n| model | kernels off | cost model | measured | off (ms) | cost model (ms) | "
          "measured (ms) | speedup | default (ms) | max err vs ORT |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.e2e.split(","):
        model = load_onnx(os.path.join("models", f"{name}.onnx"))
        builds = {"off": _build(model, conv_chains="off", conv_layout="NCHW"),
                  "model": _build(model, conv_chains="cost_model"),
                  "measured": _build(model, conv_chains="cost_model", profile="measure",
                                     profile_db=args.db),
                  "default": _build(model)}
        ms = medians_in_turns({k: b[0] for k, b in builds.items()}, 2, args.repeat)
        err = _error_vs_onnxruntime(model, builds["measured"][0])
        print(f"| {name} | {builds['off'][1]} | {builds['model'][1]} | "
              f"{builds['measured'][1]} | {ms['off']:.2f} | {ms['model']:.2f} | "
              f"{ms['measured']:.2f} | {ms['off'] / ms['measured']:.2f}x | "
              f"{ms['default']:.2f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()

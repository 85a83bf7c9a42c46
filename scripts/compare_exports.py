"""Exports of one model (ONNX files, torch.export ``.pt2``), each built by tvm_fusion and run
on the same input in turns: time per call, their agreement, kernels and attention blocks.

    TVM_NUM_THREADS=1 taskset -c 1 python scripts/compare_exports.py \\
        out/full/symbolic/vit_b16.torch_export.pt2 out/full/symbolic/vit_b16.dynamo.onnx \\
        --shape 3,3,224,224 --repeat 6 --clock cpu

The exports must take one float32 input of the given shape (a model's symbolic sizes bound
by it). Run full-size models under ``ulimit -v`` (docs/frontend.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import tvm  # noqa: E402

from tvm_fusion.bench import CLOCKS, check_clock, medians_in_turns  # noqa: E402
from tvm_fusion.compile import compile_model, count_kernels, fuse, import_model, load_model  # noqa: E402,E501
from tvm_fusion.instrument import Collector  # noqa: E402
from tvm_fusion.target import host_target  # noqa: E402


def _first(result) -> np.ndarray:
    return (result if hasattr(result, "numpy") else result[0]).numpy()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--shape", required=True, help="the input's shape, e.g. 3,3,224,224")
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args(argv)
    try:
        check_clock(args.clock)
    except ValueError as err:
        parser.exit(2, f"compare_exports.py: {err}\n")
    target = host_target()
    shape = tuple(int(d) for d in args.shape.split(","))
    x = tvm.runtime.tensor(np.random.default_rng(0).standard_normal(shape).astype("float32"))
    vms, outs = {}, {}
    for path in args.files:
        mod = import_model(load_model(path))
        collector = Collector()
        with tvm.transform.PassContext(instruments=[collector]):
            kernels = count_kernels(fuse(mod, target))
        attention = [d for p in collector.plans[:1] for plan in p.plans.values()
                     for d in getattr(plan, "attention", [])]
        print(f"{path.name}: {kernels} kernels, attention {sum(d.chosen for d in attention)} "
              f"of {len(attention)}", flush=True)
        vms[path.name] = vm = tvm.relax.VirtualMachine(compile_model(mod, target), tvm.cpu())
        outs[path.name] = _first(vm["main"](x))
    names = list(vms)
    for name in names[1:]:
        print(f"max |{name} - {names[0]}| = {np.abs(outs[name] - outs[names[0]]).max():.2e}")
    ms = medians_in_turns({n: (lambda vm=vm: vm["main"](x)) for n, vm in vms.items()},
                          warmup=1, repeat=args.repeat, clock=CLOCKS[args.clock])
    for name in names:
        print(f"{name}: {ms[name]:.1f} ms ({ms[name] / ms[names[0]]:.3f}x {names[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

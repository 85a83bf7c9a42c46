"""Where a build's time goes: per kernel, GEMM/conv kernels vs the rest, for several builds.

    python scripts/kernel_breakdown.py models/bert_base.onnx [--target JSON] [--runs 5]

Each call of the Relax VM is timed through its instrument hook (wall time around every packed
call, the fastest of ``--runs`` whole runs kept; the builds run in turns). With more than one
thread every kernel then also pays the thread pool's wake-up after the Python hook (a depthwise
conv + pointwise pair read 0.187 ms as two kernels, 0.099 as one, and 0.10 ms both when timed
without the hook), so per-kernel shares are only trustworthy with ``TVM_NUM_THREADS=1``. A
kernel whose name holds ``matmul``,
``conv`` or ``dense`` counts as GEMM/conv (it carries the FLOPs), everything else as other.
The last line bounds what grouping alone can win over stock FuseOps with the same schedules:
if fusion removed *all* non-GEMM time and left the GEMMs as they are, the speed-up would be
``wall / GEMM time`` (Amdahl).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tvm_fusion.threads import use_physical_cores  # noqa: E402

GEMM_WORDS = ("matmul", "conv", "dense")
BUILDS = {"tvm-fuseops-sched": {"strategy": "tvm", "schedule": True}, "tvm_fusion": {}}


def breakdown(vms: dict, args, runs: int, clock=time.perf_counter, kernel_min: bool = False
              ) -> dict[str, tuple[float, dict, dict]]:
    """Per build: (wall s, seconds per class, seconds per kernel name) of its fastest run
    (``kernel_min``: each kernel's own fastest run instead, what a loaded machine disturbs
    least; their sum then undercuts the wall time).
    The builds run in turns, one whole run each, order reversed every round (ABBA), so the
    machine's drift during the measurement lands on every build alike. ``clock``:
    ``time.thread_time`` times the calling thread's CPU time (one thread: a busy neighbour
    on a shared machine does not inflate it)."""
    per_kernel: collections.Counter = collections.Counter()
    started: dict = {}

    def instrument(_func, name, before, _ret, *_args):
        if before:
            started[name] = clock()
        else:
            per_kernel[name] += clock() - started.pop(name)
        return 0

    best: dict = {}
    fastest: dict = {build: {} for build in vms}
    for vm in vms.values():
        vm["main"](*args)  # warm-up
        vm.set_instrument(instrument)
    names = list(vms)
    for round_ in range(runs):
        for build in names if round_ % 2 == 0 else reversed(names):
            per_kernel.clear()
            start = clock()
            vms[build]["main"](*args)
            wall = clock() - start
            for name, seconds in per_kernel.items():
                fastest[build][name] = min(seconds, fastest[build].get(name, seconds))
            if build not in best or wall < best[build][0]:
                best[build] = (wall, dict(per_kernel))
    result = {}
    for build, (wall, kernels) in best.items():
        kernels = fastest[build] if kernel_min else kernels
        classes: collections.Counter = collections.Counter()
        for name, seconds in kernels.items():
            kind = "vm" if name.startswith("vm.") else (
                "gemm/conv" if any(w in name for w in GEMM_WORDS) else "other")
            classes[kind] += seconds
        result[build] = (wall, dict(classes), kernels)
    return result


def main(argv=None) -> int:
    use_physical_cores()
    import tvm
    from tvm import relax

    from tvm_fusion.compile import compile_model, graph_input_names, import_onnx, load_onnx
    from tvm_fusion.feeds import random_inputs
    from tvm_fusion.target import host_target, to_target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--target", default="native",
                        help="kind, tag or JSON dict; default: this machine's CPU")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--top", type=int, default=6, help="slowest kernels listed per build")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this thread's CPU time (time.thread_time), what a loaded "
                             "machine does not inflate; one thread only (TVM_NUM_THREADS=1)")
    parser.add_argument("--kernel-min", action="store_true",
                        help="each kernel's time from its own fastest run (robust under load)")
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=N",
                        help="the size of a symbolic dimension (repeatable): past=2048")
    args = parser.parse_args(argv)
    target = host_target() if args.target == "native" else to_target(args.target)
    model = load_onnx(args.model)
    try:
        sizes = {k: int(v) for k, v in (d.split("=", 1) for d in args.dim)}
    except ValueError:
        parser.error(f"--dim takes NAME=N, got {args.dim}")
    feeds = random_inputs(model, shape_overrides=sizes or None)
    dev = tvm.cpu()
    inputs = [tvm.runtime.tensor(feeds[n], dev) for n in graph_input_names(model)]
    vms = {build: relax.VirtualMachine(compile_model(import_onnx(model), target, **options), dev)
           for build, options in BUILDS.items()}
    walls = {}
    for build, (wall, classes, kernels) in breakdown(
            vms, inputs, args.runs,
            time.thread_time if args.clock == "cpu" else time.perf_counter,
            args.kernel_min).items():
        walls[build] = (wall, classes)
        shares = ", ".join(f"{k} {v * 1e3:.2f} ms ({v / wall:.0%})" for k, v in
                           sorted(classes.items()))
        print(f"{Path(args.model).stem} {build}: {wall * 1e3:.2f} ms; {shares}")
        for name, seconds in sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"    {seconds * 1e3:8.2f} ms  {name}")
    wall, classes = walls["tvm-fuseops-sched"]
    gemm = classes.get("gemm/conv", 0.0)
    print(f"bound on fusion's gain over tvm-fuseops-sched with the same GEMMs: "
          f"{wall / gemm:.2f}x (wall {wall * 1e3:.2f} ms / GEMM+conv {gemm * 1e3:.2f} ms); "
          f"measured {wall / walls['tvm_fusion'][0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tuned against tuned (issue 20, item 5): tvm_fusion tuned with ``tvm-fusion tune --local`` and
stock TVM tuned with its own ``relax.pipeline.static_shape_tuning_pipeline`` on the stock
FuseOps module, the same trial budget each, timed in one run with the untuned builds and ONNX
Runtime.

    python scripts/tuned_comparison.py models/mobilenet_v2.onnx models/bert_base.onnx \\
        --trials 256 --out out/tuned

Tuning writes ``<out>/<model>/{tvm_fusion,stock}`` (reused when the script runs again: a rerun
with the same budget only times). Timing: one thread per runtime unless ``--threads``, the
builds in turns (one call each, order reversed every round), medians. The CPU is named in the
output. Stock's tuning gets ``max_trials_per_task = trials // tasks`` so that every task is
tuned (its default gives the whole budget to the first tasks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--trials", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=5.0, help="timing per model")
    parser.add_argument("--out", default="out/tuned")
    args = parser.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))

    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    from tvm_fusion.compile import compile_model, graph_input_names, import_onnx, load_onnx
    from tvm_fusion.feeds import random_inputs
    from tvm_fusion.numerics import max_abs_error, onnx_reference
    from tvm_fusion.target import host_cpu, host_target_dict
    from tvm_fusion.tuning.tune import TuneConfig, compile_tuned, tune

    target = tvm.target.Target({**host_target_dict(), "num-cores": args.threads})
    rows = []
    for path in args.models:
        name = Path(path).stem
        work = Path(args.out) / name
        model = load_onnx(path)
        mod = import_onnx(model)
        feeds = random_inputs(model)
        order = graph_input_names(model)
        dev = tvm.cpu()
        inputs = [tvm.runtime.tensor(feeds[k], dev) for k in order]

        t0 = time.perf_counter()
        tune(mod, TuneConfig(tracker=None, key=None, target=target, trials=args.trials,
                             work_dir=str(work / "tvm_fusion"), local=True, progress=True))
        ours_tune_s = time.perf_counter() - t0
        ours_tuned, _ = compile_tuned(mod, str(work / "tvm_fusion"), target)

        t0 = time.perf_counter()
        with target:  # the tasks static_shape_tuning_pipeline will see (its first steps)
            zero = relax.get_pipeline("zero")(relax.transform.DecomposeOpsForInference()(mod))
            tasks = ms.relax_integration.extract_tasks(zero, target)
        per_task = max(1, args.trials // max(len(tasks), 1))
        with target, _same_builder_as_ours(target):
            tuned_stock_mod = relax.pipeline.static_shape_tuning_pipeline(
                total_trials=args.trials, target=target, work_dir=str(work / "stock"),
                max_trials_per_task=per_task)(mod)
        stock_tune_s = time.perf_counter() - t0
        stock_tuned = tvm.compile(tuned_stock_mod, target)

        builds = {
            "stock FuseOps, untuned": compile_model(mod, target, strategy="tvm"),
            "stock FuseOps, tuned": stock_tuned,
            "tvm_fusion, untuned": compile_model(mod, target),
            "tvm_fusion, tuned": ours_tuned,
        }
        vms = {k: relax.VirtualMachine(ex, dev) for k, ex in builds.items()}
        session = _ort_session(model, args.threads)
        reference = onnx_reference(model, feeds)
        errors = {k: max_abs_error(_outputs(vm["main"](*inputs)), reference)
                  for k, vm in vms.items()}
        calls = {k: (lambda vm=vm, x=inputs: vm["main"](*x)) for k, vm in vms.items()}
        calls["onnxruntime"] = lambda s=session, f=feeds: s.run(None, f)
        times = _alternate(calls, args.seconds)
        rows.append({"model": name, "trials": args.trials, "tasks_stock": len(tasks),
                     "tune_s": {"tvm_fusion": round(ours_tune_s), "stock": round(stock_tune_s)},
                     "ms": {k: round(v * 1e3, 3) for k, v in times.items()},
                     "max_abs_err_vs_onnx": {k: float(v) for k, v in errors.items()}})
        print(json.dumps(rows[-1]), flush=True)
    cpu = f"{host_cpu()} ({_cpu_model()}), {args.threads} thread(s)"
    print(_markdown(rows, cpu))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tuned.json").write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
    return 0


@contextlib.contextmanager
def _same_builder_as_ours(target):
    """Stock's tuning builds its candidates with the builder ``tvm-fusion tune`` uses.

    ``static_shape_tuning_pipeline`` asks meta_schedule for its default ``"local"`` builder,
    whose single-use workers import ``tvm.s_tir.tensor_intrin`` (20-30 s) before every build
    and give up after 30 s: on a busy 2-core machine every candidate of stock's failed to
    build. The same build function for both keeps the comparison about the schedules."""
    from tvm.s_tir import meta_schedule as ms

    from tvm_fusion.tuning.tune import TuneConfig, make_builder

    ours = make_builder(TuneConfig(tracker=None, key=None, target=target), target)
    create = ms.builder.Builder.create
    ms.builder.Builder.create = staticmethod(lambda kind="local", *a, **k: ours)
    try:
        yield
    finally:
        ms.builder.Builder.create = create


def _ort_session(model, threads: int):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def _outputs(value):
    from tvm_fusion.compile import flatten_outputs

    return flatten_outputs(value)


def _alternate(calls: dict, seconds: float) -> dict:
    """Median seconds per call, the calls in turns (order reversed every round)."""
    import numpy as np

    samples = {k: [] for k in calls}
    for call in calls.values():
        call()  # warm-up
    names = list(calls)
    end = time.perf_counter() + seconds * len(calls)
    rounds = 0
    while time.perf_counter() < end or rounds < 5:
        for k in names if rounds % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            calls[k]()
            samples[k].append(time.perf_counter() - t0)
        rounds += 1
    return {k: float(np.median(v)) for k, v in samples.items()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _markdown(rows, cpu: str) -> str:
    if not rows:
        return ""
    cols = list(rows[0]["ms"])
    lines = [f"CPU: {cpu}", "", "| model | trials | " + " | ".join(cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['trials']} | "
                     + " | ".join(f"{r['ms'][c]:.2f}" for c in cols) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

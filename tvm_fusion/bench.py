"""Side-by-side latency in one run: stock TVM, tvm_fusion, ONNX Runtime, PyTorch eager.

Every variant runs the same random inputs; all are built first, then timed in turns (ABBA
rounds, :func:`medians_in_turns`): medians over ``repeat`` rounds after ``warmup`` untimed
runs; the error column is the max abs difference from the reference (ONNX Runtime with graph
optimisations off; PyTorch for a torch.export program), so a fast wrong answer shows. TVM variants:

* ``tvm-default``: ``tvm.compile(mod, target)`` as a user gets it (on CPU: no fusion);
* ``tvm-fuseops``: stock ``relax.get_default_pipeline`` (FuseOps + FuseTIR, DLight on GPUs);
* ``tvm-fuseops-sched``: stock FuseOps grouping through the tvm_fusion pipeline with our CPU
  schedules (``strategy="tvm", schedule=True``), so fusion's own gain is isolated;
* ``tvm_fusion``: the ``"tvm_fusion"`` pipeline.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tvm
from tqdm import tqdm
from tvm import relax

from . import export_models
from .atomic import atomic_write_text
from .build_cache import load_or_build
from .compile import (
    compile_model,
    default_sizes,
    flatten_outputs,
    graph_input_names,
    import_model,
    load_model,
    model_signature,
    reference_outputs,
)
from .feeds import random_inputs, run_shapes, shapes_for
from .frontend import TorchProgram
from .numerics import max_abs_error
from .symbolic import symbolic_hints
from .target import to_target
from .threads import use_physical_cores

# variant -> compile_model keyword arguments
TVM_VARIANTS = {
    "tvm-default": {"strategy": "none"},
    "tvm-fuseops": {"strategy": "tvm"},
    # stock FuseOps grouping + our CPU schedules: isolates what DNNFusion's grouping adds
    "tvm-fuseops-sched": {"strategy": "tvm", "schedule": True},
    "tvm_fusion": {"strategy": "dnnfusion"},
}
ALL_VARIANTS = (*TVM_VARIANTS, "onnxruntime", "pytorch")


@dataclass
class Measurement:
    model: str
    variant: str
    median_ms: float | None
    max_error: float | None  # vs ONNX Runtime
    note: str = ""


def median_ms(fn: Callable[[], object], warmup: int = 2, repeat: int = 10) -> float:
    """Median wall time of ``fn()`` in milliseconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# A turn of one variant lasts at least this long when variants are different runtimes: each
# runtime's worker threads spin after a call, and on two cores the first call after a switch
# was slowed by the other runtime's threads (TVM's MobileNetV2 39.7 ms after an ONNX Runtime
# call, 5 ms otherwise; ONNX Runtime 9.9 ms after TVM, 3.2 ms alone). Long turns, each
# starting with an untimed call, amortise the switch.
TURN_S = 0.2
# A turn starts with an untimed call only when calls are this cheap.
CHEAP_S = 0.5

# What ``bench --clock`` times a call with. ``cpu``, the calling thread's CPU time, is only the
# call's whole time when every runtime runs on that one thread (TVM_NUM_THREADS=1: TVM's
# single-thread launches and ONNX Runtime's one intra-op thread run in the caller).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def check_clock(clock: str) -> None:
    """Refuse a clock that would time only part of a call (one line for the CLI)."""
    if clock not in CLOCKS:
        raise ValueError(f"unknown clock {clock!r}; expected one of {sorted(CLOCKS)}")
    if clock == "cpu" and use_physical_cores() != 1:
        raise ValueError("--clock cpu times the calling thread only: run with "
                         "TVM_NUM_THREADS=1 (one thread per runtime)")


def write_results(out_dir: str | os.PathLike, stem: str, result: dict, table: str) -> None:
    """A benchmark script's results: ``<stem>.json`` and its Markdown table ``<stem>.md`` in
    ``out_dir``, each written atomically (a run killed mid-write leaves the last whole file)."""
    out = Path(out_dir)
    atomic_write_text(out / f"{stem}.json", json.dumps(result, indent=2))
    atomic_write_text(out / f"{stem}.md", table)


def medians_in_turns(calls: dict[str, Callable[[], object]], warmup: int = 2,
                     repeat: int = 10, number: int = 1, turn_s: float = 0.0,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median time (ms per call, by ``clock``: wall time unless given) of each of ``calls``,
    sampled in turns.

    Round ``r`` times every call ``number`` times, in forward order on even rounds and backward
    on odd ones (ABBA), so that a machine whose speed drifts during the run (a 2-vCPU VM here
    went from 0.19 to 0.10 ms on the same kernel within one run) biases no variant: timing one
    variant after another turned a 1.0x pair of kernels into "1.97x". With ``turn_s`` a turn
    repeats a call until it lasts that long (at least ``number`` times) after one untimed call
    (see :data:`TURN_S`). ``clock=time.thread_time`` (:data:`CLOCKS`) leaves out the time a busy
    neighbour keeps the calling thread off the core."""
    names = list(calls)
    counts = {}
    for name in names:
        seconds = 0.0
        for _ in range(warmup):
            start = time.perf_counter()
            calls[name]()
            seconds = time.perf_counter() - start
        counts[name] = max(number, math.ceil(turn_s / seconds) if turn_s and seconds else 1)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeat):
        for name in names if r % 2 == 0 else reversed(names):
            if turn_s and (not samples[name] or samples[name][-1] < CHEAP_S):
                calls[name]()
            start = clock()
            for _ in range(counts[name]):
                calls[name]()
            samples[name].append((clock() - start) / counts[name])
    return {name: statistics.median(times) * 1e3 for name, times in samples.items()}


def _tvm_build(path, model, target: str, compile_kwargs: dict, cache_dir=None):
    """The variant's executable, from ``cache_dir`` when an identical build is there
    (:mod:`tvm_fusion.build_cache`)."""
    tgt = to_target(target)
    return load_or_build(cache_dir, path, compile_kwargs, tgt,
                         lambda: compile_model(import_model(model), tgt, **compile_kwargs))


def _tvm_runner(executable, target: str, inputs: list[np.ndarray]):
    tgt = to_target(target)
    device = tvm.device("cpu" if tgt.kind.name in ("llvm", "c") else tgt.kind.name, 0)
    vm = relax.VirtualMachine(executable, device)
    args = [tvm.runtime.tensor(x, device) for x in inputs]

    def call():
        out = vm["main"](*args)
        device.sync()
        return out

    return call, lambda: flatten_outputs(call())


def onnxruntime_missing() -> str | None:
    """Why ``import onnxruntime`` fails here (not installed, or broken), else None."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as err:
        return str(err).strip().splitlines()[0] if str(err).strip() else "ImportError"
    return None


def check_variants(variants) -> None:
    """Variants asked for by name: an unknown name, or onnxruntime when it cannot be imported,
    is one ``ValueError`` before any model is loaded or built."""
    unknown = sorted(set(variants) - set(ALL_VARIANTS))
    if unknown:
        raise ValueError(f"unknown bench variant {unknown[0]!r}; expected {ALL_VARIANTS}")
    if "onnxruntime" in variants and (why := onnxruntime_missing()) is not None:
        raise ValueError(f"bench variant 'onnxruntime' needs onnxruntime, which cannot be "
                         f"imported ({why}): pip install onnxruntime, or leave it out of "
                         f"--variants")


def _ort_runner(model, feeds: dict):
    if isinstance(model, TorchProgram):
        raise LookupError("a torch.export program is no ONNX file")
    if (why := onnxruntime_missing()) is not None:  # the default variants: a skipped row
        raise LookupError(f"onnxruntime cannot be imported ({why})")
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = use_physical_cores()
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return (lambda: session.run(None, feeds)), (lambda: session.run(None, feeds))


def _program_runner(model: TorchProgram, feeds: dict):
    """PyTorch running the torch.export program itself."""
    import torch

    torch.set_num_threads(use_physical_cores())
    module = model.program.module()
    args = [torch.from_numpy(feeds[vi.name]) for vi in model.signature.graph.input]

    def call():
        with torch.no_grad():
            return module(*args)

    return call, lambda: model.reference(feeds)


def _torch_runner(name: str, feeds: dict):
    """PyTorch eager from the exporter's own definition, when torch is installed."""
    if importlib.util.find_spec("torch") is None:
        raise LookupError("PyTorch is not installed (pip install 'tvm_fusion[models]')")
    if name not in export_models.MODELS:
        raise LookupError(f"{name} is not in the exporter's registry (tvm_fusion.export_models)")
    import torch

    spec = export_models.MODELS[name]
    torch.manual_seed(export_models.SEED)
    net = export_models.calibrate(spec.build().eval(), spec)
    torch.set_num_threads(use_physical_cores())
    args = [torch.from_numpy(feeds[i.name]) for i in spec.inputs]

    def call():
        with torch.no_grad():
            return net(*args)

    def outputs():
        out = call()
        return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]

    return call, outputs


def bench_model(path: str | os.PathLike, target: str = "llvm", variants=ALL_VARIANTS,
                repeat: int = 10, warmup: int = 2, seed: int = 0, progress=None,
                input_shapes: dict | None = None, clock: str = "wall", cache_dir=None,
                build_only: bool = False):
    """Time every variant of one ONNX model; returns a list of :class:`Measurement`.

    With ``cache_dir`` the TVM variants' builds are kept there and reused by a later run
    (:mod:`tvm_fusion.build_cache`); ``build_only`` builds them and times nothing (rows
    without a time), so a quiet timing run can follow.

    Every runtime gets the same threads, one per physical core (TVM's own default is half the
    hardware threads on x86: :mod:`tvm_fusion.threads`). A model with symbolic dimensions is
    compiled symbolic and run at ``input_shapes`` (:func:`tvm_fusion.feeds.run_shapes`)."""
    use_physical_cores()
    check_clock(clock)
    unknown = sorted(set(variants) - set(ALL_VARIANTS))
    if unknown:
        raise ValueError(f"unknown bench variant {unknown[0]!r}; expected {ALL_VARIANTS}")
    name = Path(path).stem
    model = load_model(path)
    if build_only:
        for variant in variants:
            if variant in TVM_VARIANTS:
                _tvm_build(path, model, target, TVM_VARIANTS[variant], cache_dir)
            if progress is not None:
                progress.update(1)
        return [Measurement(name, v, None, None,
                            "built" if v in TVM_VARIANTS else "not built: no TVM variant")
                for v in variants]
    signature = model_signature(model)
    with symbolic_hints(default_sizes(model)):
        shapes = run_shapes(signature, shapes_for(signature, input_shapes))
    feeds = random_inputs(signature, seed=seed, shape_overrides=shapes)
    inputs = [feeds[k] for k in graph_input_names(signature)]
    reference = reference_outputs(model, feeds)
    calls, errors, skipped = {}, {}, {}
    for variant in variants:
        if progress is not None:
            progress.set_postfix_str(f"{name}/{variant}")
        try:
            if variant in TVM_VARIANTS:
                executable = _tvm_build(path, model, target, TVM_VARIANTS[variant], cache_dir)
                call, outputs = _tvm_runner(executable, target, inputs)
            elif variant == "onnxruntime":
                call, outputs = _ort_runner(model, feeds)
            elif isinstance(model, TorchProgram):
                call, outputs = _program_runner(model, feeds)
            else:
                call, outputs = _torch_runner(name, feeds)
        except LookupError as err:
            skipped[variant] = f"skipped: {err}"
        else:
            calls[variant] = call
            errors[variant] = max_abs_error(outputs(), reference)
        if progress is not None:
            progress.update(1)
    # every variant is built before any is timed, then all are timed in turns
    medians = medians_in_turns(calls, warmup, repeat, turn_s=TURN_S, clock=CLOCKS[clock])
    return [Measurement(name, v, None, None, skipped[v]) if v in skipped
            else Measurement(name, v, round(medians[v], 4), errors[v]) for v in variants]


def run_bench(paths: list[Path], target="llvm", variants=ALL_VARIANTS, repeat=10, warmup=2,
              out_dir: str | os.PathLike = "out/bench", input_shapes: dict | None = None,
              clock: str = "wall", cache_dir=None, build_only: bool = False
              ) -> list[Measurement]:
    """Bench several models with one progress bar; writes JSON, Markdown and a PNG chart."""
    rows: list[Measurement] = []
    with tqdm(total=len(paths) * len(variants), desc="build" if build_only else "bench",
              unit="run") as bar:
        for path in paths:
            rows += bench_model(path, target, variants, repeat, warmup, progress=bar,
                                input_shapes=input_shapes, clock=clock, cache_dir=cache_dir,
                                build_only=build_only)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "bench.json", json.dumps(
        {"target": str(target), "input_shapes": input_shapes or {}, "repeat": repeat,
         "warmup": warmup, "clock": clock, "machine": machine(),
         "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    atomic_write_text(out / "bench.md", to_markdown(rows) + "\n")
    if any(r.median_ms for r in rows):  # a --build-only run has nothing to draw
        plot(rows, out / "bench.png")
    return rows


def machine() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} hardware threads, "
            f"{use_physical_cores()} runtime threads, Python {platform.python_version()}")


def to_markdown(rows: list[Measurement]) -> str:
    models = list(dict.fromkeys(r.model for r in rows))
    variants = list(dict.fromkeys(r.variant for r in rows))
    cell = {(r.model, r.variant): r for r in rows}
    head = "| model | " + " | ".join(f"{v} (ms)" for v in variants) + " | max abs err vs ORT |"
    lines = [head, "|" + "---|" * (len(variants) + 2)]
    for m in models:
        vals, errs = [], []
        for v in variants:
            r = cell.get((m, v))
            vals.append("—" if r is None or r.median_ms is None else f"{r.median_ms:.2f}")
            if r is not None and r.max_error is not None and v != "onnxruntime":
                errs.append(f"{v} {r.max_error:.1e}")
        lines.append(f"| {m} | " + " | ".join(vals) + " | " + "; ".join(errs) + " |")
    return "\n".join(lines)


def plot(rows: list[Measurement], path: Path) -> None:
    import matplotlib  # the optional "bench" extra: only drawing needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    variants = list(dict.fromkeys(r.variant for r in rows))
    width = 0.8 / max(len(variants), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(models) + 2), 4))
    for i, v in enumerate(variants):
        ys = [next((r.median_ms or 0 for r in rows if r.model == m and r.variant == v), 0)
              for m in models]
        ax.bar([j + (i - (len(variants) - 1) / 2) * width for j in range(len(models))], ys,
               width, label=v)
    ax.set_yscale("log")
    ax.set_xticks(range(len(models)), models, rotation=30, ha="right")
    ax.set_ylabel("median latency (ms, log scale)")
    ax.set_title("Latency per inference (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)

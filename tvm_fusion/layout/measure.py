"""Numbers for ``docs/smartmem.md``: kernels and pure data-movement kernels (stock TVM vs
tvm_fusion without and with SmartMem's elimination), and CPU latency with the elimination on
and off under the same schedules, in one run (the command is ``scripts/measure_smartmem.py``).

"Same schedules": both builds run ``ScheduleFusedBlocks``; a scheduled function that then fails
to build (a bug of the CPU schedules, reported by name) is left unscheduled, in both builds
alike.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import tvm

from .. import pipeline
from ..compile import count_kernels, fuse, graph_input_names, import_onnx, load_onnx, run
from ..feeds import random_inputs
from ..instrument import Collector
from ..models.swin import swin_window_attention
from ..numerics import max_abs_error
from ..tir_schedules.fused_block import ScheduleFusedBlocks
from .metrics import count_data_movement_kernels
from .pipeline import graph_passes

LLVM = tvm.target.Target("llvm")


def _load(path: Path):
    """An ONNX file, or ``swin_block`` for the Swin-T window-attention block of
    :mod:`tvm_fusion.models.swin`."""
    if str(path) == "swin_block":
        return swin_window_attention()
    return load_onnx(path)


def count_row(path: Path) -> dict:
    """Kernels and data-movement kernels of one model, three ways."""
    mod = import_onnx(_load(path))
    stock = fuse(mod, LLVM, strategy="tvm")
    row = {"model": path.stem, "stock": count_kernels(stock),
           "stock_moves": count_data_movement_kernels(stock)}
    for layout in (False, True):
        # with the elimination: an explicit policy takes graph_passes' own path (no rewriting)
        options = {"layout_policy": "reduction"} if layout else {}
        collector = Collector()
        with LLVM, tvm.transform.PassContext(instruments=[collector]):
            fused = graph_passes(LLVM, layout=layout, schedule=False, **options)(mod)
        key = "smartmem" if layout else "dnnfusion"
        row[key] = count_kernels(fused)
        row[key + "_moves"] = count_data_movement_kernels(fused)
        if layout:
            row["eliminated"] = sum(r.eliminated for r in collector.layout_blocks)
            row["copies"] = sum(r.layout_copies for r in collector.layout_blocks)
    return row


@tvm.transform.module_pass(opt_level=0, name="measure.ScheduleOrLeave")
def schedule_or_leave(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """``ScheduleFusedBlocks``, then a probe build per function; one that fails keeps its
    unscheduled form (named in a warning)."""
    original = dict(mod.functions.items())  # the pass may rewrite a uniquely owned module
    scheduled = ScheduleFusedBlocks(LLVM)(mod)
    for gvar, func in list(scheduled.functions.items()):
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        try:
            probe = func.with_attr("global_symbol", gvar.name_hint)
            tvm.tirx.build(tvm.IRModule({gvar: probe}), LLVM)
        except Exception as err:  # noqa: BLE001 (reported, and the same in both builds)
            warnings.warn(f"CPU schedule of {gvar.name_hint} does not build "
                          f"({str(err).strip().splitlines()[-1][:80]}); left unscheduled",
                          stacklevel=1)
            scheduled[gvar] = original[gvar]
    return scheduled


def build(mod: tvm.IRModule, layout: bool, strategy: str = "dnnfusion"):
    """A CPU build with the elimination on or off; ``strategy="tvm"`` groups with stock
    FuseOps, so the elimination is the only tvm_fusion graph pass in play."""

    @tvm.transform.module_pass(opt_level=0, name="measure.pipeline")
    def _pipeline(m, _ctx):
        with LLVM:
            # an explicit policy takes graph_passes' own path, which honours layout=True
            # under either strategy (Sequential keeps strategy="tvm" pure stock)
            graph = graph_passes(LLVM, layout=layout, schedule=False, strategy=strategy,
                                 layout_policy="reduction")
            return pipeline.build(LLVM, graph, schedule=[schedule_or_leave])(m)

    return tvm.compile(mod, LLVM, relax_pipeline=_pipeline)


def time_row(path: Path, rounds: int = 5, strategy: str = "dnnfusion") -> dict:
    """Median latency of the two builds, measured alternately in one process."""
    model = _load(path)
    mod = import_onnx(model)
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[n] for n in graph_input_names(model)]
    exes, seconds = {}, {}
    for layout in (False, True):
        start = time.perf_counter()
        exes[layout] = build(mod, layout, strategy)
        seconds[layout] = time.perf_counter() - start
    outs = {layout: run(ex, inputs) for layout, ex in exes.items()}
    diff = max_abs_error(outs[True], outs[False])
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    samples: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for layout in (False, True):
            vm = tvm.relax.VirtualMachine(exes[layout], dev)
            timer = vm.time_evaluator("main", dev, number=2, repeat=3)
            samples[layout].append(float(np.median(timer(*args).results)) * 1e3)
    base, ours = float(np.median(samples[False])), float(np.median(samples[True]))
    return {"model": path.stem, "strategy": strategy, "without_ms": base, "with_ms": ours,
            "speedup": base / ours, "max_abs_diff": diff,
            "compile_s": (seconds[False], seconds[True])}

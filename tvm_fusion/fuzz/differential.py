"""Run one fuzz case three ways and say whose bug a disagreement is.

The ONNX Runtime reference (:func:`tvm_fusion.numerics.onnx_reference`, graph optimisations off)
and stock TVM (``compile_model(..., strategy="tvm")``: FuseOps + FuseTIR) are the two judges:

* ``ok``: tvm_fusion builds, runs and matches ONNX Runtime;
* ``wrong``: tvm_fusion's numbers disagree with ONNX Runtime while stock TVM's agree;
* ``crash``: tvm_fusion raises where stock TVM builds and runs (and agrees);
* ``timeout``: tvm_fusion took longer than the case limit (set by :mod:`.worker`);
* ``skipped``: ONNX Runtime fails, or stock TVM fails or disagrees: not evidence against us.

:func:`check_case_memory` (``scripts/fuzz.py --memory``) adds issue 20's memory check to an
``ok`` case: ``memory`` when the default tvm_fusion build's planned activation memory
(:func:`tvm_fusion.memory.planned_memory`) exceeds stock FuseOps' (TVM's own plan); the bytes of
both are kept on the outcome either way. Symbolic cases are not measured.

Tolerances depend on the output dtype and scale with the output's magnitude (a float32 sum of
large terms carries absolute error relative to the terms); integers and bools must match
exactly; matching NaN and same-signed infinities are equal (:func:`tvm_fusion.numerics.compare`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable

import numpy as np
import onnx

from ..compile import compile_model, fuse, graph_input_names, import_onnx, run
from ..memory import planned_memory
from ..numerics import abs_error, compare, onnx_reference
from ..tir_schedules.records import ScheduleFailedWarning
from .feeds import make_feeds

CLASSES = ("ok", "wrong", "crash", "timeout", "skipped", "memory")
FAILURES = ("wrong", "crash", "timeout", "memory")

#: (rtol, atol relative to max(1, max |finite reference|)) per numpy dtype kind/size.
TOLERANCES = {"float16": (1e-2, 1e-2), "float32": (1e-4, 1e-4), "float64": (1e-7, 1e-7)}


@dataclasses.dataclass
class Case:
    """One fuzz case: the model and everything else its result depends on."""

    seed: int
    model: onnx.ModelProto
    options: dict = dataclasses.field(default_factory=dict)
    special: bool = False
    target: str = "llvm"
    symbolic: bool = False
    shapes: dict | None = None  # concrete input shapes (needed when ``symbolic``)

    def feeds(self) -> dict[str, np.ndarray]:
        return make_feeds(self.model, self.seed, self.special, self.shapes)

    def replace(self, **changes) -> Case:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class Outcome:
    """A case's class, where it failed (``stage``), the first error line and max errors."""

    cls: str
    stage: str = ""
    error: str = ""
    max_err: float | None = None  # tvm_fusion vs ONNX Runtime, when both ran
    stock_err: float | None = None  # stock TVM vs ONNX Runtime
    seconds: float = 0.0
    stock_bytes: int | None = None  # planned activation memory, with check_case_memory
    ours_bytes: int | None = None
    # schedules of our build that failed and fell back (ScheduleFailedWarning): right values,
    # slower kernels (a packed GEMM on register tiles ran MobileNetV3 fp16 at 0.17x ORT)
    fallbacks: list = dataclasses.field(default_factory=list)

    def signature(self) -> str:
        """What the minimiser keeps fixed: the class and, for a crash, the error's shape (its
        first line without numbers and quoted names)."""
        if self.cls != "crash":
            return self.cls
        text = re.sub(r"'[^']*'|\"[^\"]*\"|0x[0-9a-f]+|\d+", "_", self.error)
        return f"crash:{text[:80]}"


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    for line in text.splitlines():  # TVM's errors start with a traceback header: skip it
        line = line.strip()
        if line and not line.startswith(("Traceback", "File ", "File\"", "  ")) and \
                not re.match(r"^\d+:", line):
            return f"{type(err).__name__}: {line}"[:300]
    return type(err).__name__


def _tolerance(ref: np.ndarray) -> tuple[float, float]:
    if ref.dtype.kind != "f":
        return 0.0, 0.0
    rtol, atol = TOLERANCES.get(str(ref.dtype), TOLERANCES["float32"])
    finite = np.abs(ref[np.isfinite(ref)].astype(np.float64))
    scale = max(1.0, float(finite.max())) if finite.size else 1.0
    return rtol, atol * scale


def mismatch(got: list[np.ndarray], ref: list[np.ndarray]) -> tuple[str | None, float]:
    """(first line of the disagreement or None, max abs error over outputs; inf for a NaN or
    shape mismatch)."""
    if len(got) != len(ref):
        return f"{len(got)} outputs, reference has {len(ref)}", float("inf")
    worst, message = 0.0, None
    for i, (g, r) in enumerate(zip(got, ref)):
        g, r = np.asarray(g), np.asarray(r)
        rtol, atol = _tolerance(r)
        try:
            worst = max(worst, compare([g], [r], rtol=rtol, atol=atol))
        except AssertionError as err:
            text = str(err).replace("output 0", f"output {i}", 1)
            message = message or text.splitlines()[0]
            worst = max(worst, _max_err(g, r))
    return message, worst


def _max_err(g: np.ndarray, r: np.ndarray) -> float:
    if g.shape != r.shape:
        return float("inf")
    err = abs_error(g, r)
    return float(err.max()) if err.size else 0.0


def _build_and_run(case: Case, inputs: list[np.ndarray], **compile_args) -> list[np.ndarray]:
    # A symbolic case (the hook of generate.make_symbolic) is imported as is: the importer
    # sees the named dim and the feeds carry the concrete sizes.
    executable = compile_model(import_onnx(case.model), case.target, **compile_args)
    return run(executable, inputs)


@contextlib.contextmanager
def private_database():
    """``$TVM_FUSION_DB`` at a file of a new temporary folder, removed afterwards: a case's
    plans depend on no profiling database. A fixed path that does not exist was not enough:
    Apollo writes the blocklist entries it learns through to the database, creating the file,
    so later cases (of any fuzz process on the machine) planned with them, and processes
    reading it while another wrote failed with "disk I/O error" (seeds 2518, 2528, 2541)."""
    old = os.environ.get("TVM_FUSION_DB")
    with tempfile.TemporaryDirectory(prefix="tvm_fusion-fuzz-") as tmp:
        os.environ["TVM_FUSION_DB"] = os.path.join(tmp, "profiling.db")
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("TVM_FUSION_DB", None)
            else:
                os.environ["TVM_FUSION_DB"] = old


def check_case(case: Case, on_stage: Callable[[str], None] | None = None) -> Outcome:
    """Classify ``case`` (see the module docstring); never raises for a model's failure.

    ``on_stage`` is told each stage before it starts (``reference``, ``stock``, ``ours``), so a
    supervisor that kills a hung child knows whose compile hung. The builds see a profiling
    database of their own (:func:`private_database`).
    """
    with private_database():
        return _check_case(case, on_stage)


def _check_case(case: Case, on_stage: Callable[[str], None] | None) -> Outcome:
    start = time.perf_counter()
    stage = on_stage or (lambda _s: None)

    def done(outcome: Outcome) -> Outcome:
        outcome.seconds = round(time.perf_counter() - start, 3)
        return outcome

    feeds = case.feeds()
    inputs = [feeds[n] for n in graph_input_names(case.model)]
    stage("reference")
    try:
        with np.errstate(all="ignore"):
            ref = onnx_reference(case.model, feeds)
    except Exception as err:  # noqa: BLE001 - any reference failure means: not our bug
        return done(Outcome("skipped", "reference", first_line(err)))
    stage("stock")
    try:
        stock = _build_and_run(case, inputs, strategy="tvm")
    except Exception as err:  # noqa: BLE001
        return done(Outcome("skipped", "stock", first_line(err)))
    message, stock_err = mismatch(stock, ref)
    if message:
        return done(Outcome("skipped", "stock", f"stock TVM disagrees: {message}",
                            stock_err=stock_err))
    stage("ours")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ScheduleFailedWarning)
            ours = _build_and_run(case, inputs, **case.options)
    except Exception as err:  # noqa: BLE001
        return done(Outcome("crash", "ours", first_line(err), stock_err=stock_err))
    fallbacks = [first_line(w.message) for w in caught
                 if issubclass(w.category, ScheduleFailedWarning)]
    message, err = mismatch(ours, ref)
    if message:
        return done(Outcome("wrong", "ours", message, max_err=err, stock_err=stock_err,
                            fallbacks=fallbacks))
    return done(Outcome("ok", "ours", max_err=err, stock_err=stock_err, fallbacks=fallbacks))


def check_case_memory(case: Case, on_stage: Callable[[str], None] | None = None) -> Outcome:
    """:func:`check_case`, then for an ``ok`` static case the planned activation memory of the
    default tvm_fusion build against stock FuseOps' (``memory`` when above)."""
    outcome = check_case(case, on_stage)
    if outcome.cls != "ok" or case.symbolic:
        return outcome
    (on_stage or (lambda _s: None))("memory")
    start = time.perf_counter() - outcome.seconds
    mod = import_onnx(case.model)
    with private_database():
        stock = planned_memory(fuse(mod, case.target, strategy="tvm"), case.target,
                               repack=False)
        ours = planned_memory(fuse(mod, case.target), case.target)
    outcome.stock_bytes, outcome.ours_bytes = stock.total, ours.total
    if ours.total > stock.total:
        outcome.cls, outcome.stage = "memory", "memory"
        outcome.error = (f"planned activation memory {ours.total:,} B above stock FuseOps' "
                         f"{stock.total:,} B (largest workspace: {ours.workspace:,} B in "
                         f"{ours.workspace_kernel or '-'})")
    outcome.seconds = round(time.perf_counter() - start, 3)
    return outcome

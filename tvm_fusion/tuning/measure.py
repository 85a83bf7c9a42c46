"""Time a candidate's fused and split variants on a device and store both in the database.

Each variant of a :class:`~.candidate.Candidate` is built the way the real build would build
it (``FuseTIR``, then the schedule strategy, then TVM's own dataflow lowering and
finalisation for the target), compiled with ``tvm.compile`` and timed by a :class:`Runner`:

* :class:`LocalRunner` runs on this machine's device for the target;
* :class:`RPCRunner` runs on a remote device through a ``tvm.rpc`` session (a tracker-issued
  phone, say); it exports the library, uploads it and times it there. Issue 7 plugs its
  tracker sessions in here.

Both time ``invoke_stateful`` of the Relax VM with ``time_evaluator`` after one warm-up run,
so the same code path is timed as in deployment, and keep every repeat as a sample. The
variants of one candidate are sampled in turns (ABBA), not one after the other, so that load
from other processes biases neither.

**Schedule strategies** (DNNFusion notes §8.2 item 9): a yellow verdict holds for the scheduler
that produced it, so the strategy id is part of the database key and both variants of a
candidate are always built with the same one: ``"fused_block"`` (``-exact``: without fast
math) is the CPU build's ``ScheduleFusedBlocks`` (one loop nest per block); ``"unscheduled"``
is FuseTIR output as it stands (one loop nest per operator, TVM's default TIR lowering), what
the build does with ``schedule=False``; ``"dlight"`` is stock DLight per fused function, as
tvm_fusion's GPU pipeline does.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import tvm
from tvm import relax

from .. import pipeline
from ..tir_schedules.fused_block import ScheduleFusedBlocks
from ..tir_schedules.gpu import apply_gpu_schedules
from .candidate import Candidate
from .database import Entry, Measurement, ProfilingDatabase


class MeasureError(RuntimeError):
    """A variant could not be built or run; the message names the candidate and variant."""


# ---------------------------------------------------------------------- schedule strategies

@dataclass(frozen=True)
class ScheduleStrategy:
    """How a variant's PrimFuncs are scheduled before lowering; ``id`` goes into the key."""

    id: str
    apply: Callable[[tvm.IRModule, tvm.target.Target], tvm.IRModule]


def _unscheduled(mod: tvm.IRModule, _target) -> tvm.IRModule:
    return mod


def _fused_block(fast_math: bool):
    def apply(mod: tvm.IRModule, target) -> tvm.IRModule:
        # The CPU build's own pass (one loop nest per block).
        with target:
            return ScheduleFusedBlocks(target, fast_math=fast_math)(mod)

    return apply


def _dlight(mod: tvm.IRModule, target) -> tvm.IRModule:
    # The GPU build's own pass, so a verdict is measured on the code the build emits.
    with target:
        return apply_gpu_schedules(mod)


SCHEDULE_STRATEGIES = {
    "unscheduled": ScheduleStrategy("unscheduled", _unscheduled),
    "fused_block": ScheduleStrategy("fused_block", _fused_block(fast_math=True)),
    "fused_block-exact": ScheduleStrategy("fused_block-exact", _fused_block(fast_math=False)),
    "dlight": ScheduleStrategy("dlight", _dlight),
}


def default_strategy(target: tvm.target.Target) -> ScheduleStrategy:
    """What tvm_fusion's pipeline does for ``target`` by default: DLight on GPUs,
    ``ScheduleFusedBlocks`` (with fast math) on ``llvm``, nothing elsewhere."""
    if "gpu" in target.keys:
        return SCHEDULE_STRATEGIES["dlight"]
    if target.kind.name == "llvm":
        return SCHEDULE_STRATEGIES["fused_block"]
    return SCHEDULE_STRATEGIES["unscheduled"]


def resolve_strategy(strategy, target: tvm.target.Target) -> ScheduleStrategy:
    if strategy is None:
        return default_strategy(target)
    if isinstance(strategy, ScheduleStrategy):
        return strategy
    if strategy not in SCHEDULE_STRATEGIES:
        raise ValueError(f"unknown schedule strategy {strategy!r}; expected one of "
                         f"{', '.join(SCHEDULE_STRATEGIES)} or a ScheduleStrategy")
    return SCHEDULE_STRATEGIES[strategy]


# ---------------------------------------------------------------------------------- runners

@dataclass
class TimingConfig:
    """``time_evaluator`` settings: ``repeat`` samples, each the mean of ``number`` runs (at
    least ``min_repeat_ms`` long, so a microsecond kernel is not timed by the clock's tick)."""

    number: int = 1
    repeat: int = 5
    min_repeat_ms: int = 10


class Runner(Protocol):
    """Times compiled executables; ``device_key`` and ``method`` go into the database."""

    method: str  # "local" | "rpc"
    device_key: str
    config: TimingConfig

    def prepare(self, executable, inputs: list[np.ndarray]) -> Callable[[], float]:
        """Load ``executable``, feed ``inputs``, run it once; return a callable that times
        one sample (seconds per run). The measurer interleaves the samples of the variants
        it compares, so load that drifts during a measurement hits both alike."""
        ...


def local_device_key(target: tvm.target.Target) -> str:
    """Which device local latencies are valid for: the device type, the CPU model (or GPU
    name) and the core count. Hostnames are left out: containers change them every run."""
    dev = tvm.device(target.get_target_device_type(), 0)
    kind = str(dev).split(":", 1)[0]  # "cpu:0" -> "cpu"
    if kind == "cpu":
        return f"local/cpu/{_cpu_model()}/x{os.cpu_count()}"
    try:
        name = dev.device_name if dev.exist else "absent"
    except Exception:  # noqa: BLE001 (a runtime built without this device type)
        name = "unknown"
    return f"local/{kind}/{name}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


class LocalRunner:
    """Runs on this machine's device for ``target``."""

    method = "local"

    def __init__(self, target: tvm.target.Target, config: TimingConfig | None = None,
                 device_key: str | None = None):
        self.device = tvm.device(target.get_target_device_type(), 0)
        self.config = config or TimingConfig()
        self.device_key = device_key or local_device_key(target)

    def prepare(self, executable, inputs: list[np.ndarray]) -> Callable[[], float]:
        return _vm_timer(relax.VirtualMachine(executable, self.device), self.device, inputs,
                         self.config)


class RPCRunner:
    """Runs on the device of an RPC session (``tvm.rpc.connect_tracker(...).request(key)``).

    Parameters
    ----------
    session
        A ``tvm.rpc.RPCSession`` (``rpc.LocalSession()`` works for tests).
    device_key
        The database's name for that device (the tracker key plus the model, say).
    device_type
        ``"cpu"``, ``"opencl"``, ``"cuda"``, ...: the remote device to run on.
    export
        ``export(executable, path)``: writes a library the remote can load; defaults to
        ``executable.export_library(path)``. Android needs the NDK's ``fcompile`` here.
    """

    method = "rpc"

    def __init__(self, session, device_key: str, device_type: str = "cpu",
                 config: TimingConfig | None = None,
                 export: Callable[[object, str], None] | None = None,
                 library_suffix: str = ".so"):
        self.session = session
        self.device_key = device_key
        self.device = session.device(device_type, 0)
        self.config = config or TimingConfig()
        self.export = export or (lambda ex, path: ex.export_library(path))
        self.library_suffix = library_suffix

    def prepare(self, executable, inputs: list[np.ndarray]) -> Callable[[], float]:
        # A fresh name per library: overwriting a shared object the remote process has loaded
        # crashes it (dlopen hands back the old mapping of a file that changed underneath).
        name = f"tvm_fusion_{uuid.uuid4().hex}{self.library_suffix}"
        with tempfile.TemporaryDirectory(prefix="tvm_fusion_rpc_") as tmp:
            path = os.path.join(tmp, name)
            self.export(executable, path)
            self.session.upload(path)
        remote = self.session.load_module(name)
        vm = relax.VirtualMachine(remote, self.device)
        return _vm_timer(vm, self.device, inputs, self.config)


def _vm_timer(vm, device, inputs: list[np.ndarray], config: TimingConfig):
    vm.set_input("main", *[tvm.runtime.tensor(x, device) for x in inputs])
    vm.invoke_stateful("main")  # warm-up: first-touch allocation and caches
    device.sync()
    timer = vm.time_evaluator("invoke_stateful", device, number=config.number, repeat=1,
                              min_repeat_ms=config.min_repeat_ms)

    def sample() -> float:
        return float(timer("main").results[0])

    return sample


# ------------------------------------------------------------------------------- building

def build_variant(candidate: Candidate, variant: str, target: tvm.target.Target,
                  strategy: ScheduleStrategy):
    """Compile one variant with ``strategy`` and the target's own lowering."""
    mod = strategy.apply(candidate.variant_module(variant), target)
    return tvm.compile(mod, target, relax_pipeline=pipeline.lowering(target))


# ------------------------------------------------------------------------------- measurer

class Measurer:
    """Database-backed timing of candidates: a cache hit is never measured again.

    Parameters
    ----------
    database
        Where results go (and are looked up first).
    target
        The build target; its JSON text is the ``target`` of every key.
    runner
        Where variants run; defaults to :class:`LocalRunner` for ``target``.
    strategy
        A strategy id or :class:`ScheduleStrategy`; defaults to :func:`default_strategy`.
    """

    def __init__(self, database: ProfilingDatabase, target: tvm.target.Target,
                 runner: Runner | None = None, strategy=None, seed: int = 0):
        self.database = database
        self.target = target
        self.target_key = target_key(target)
        self.runner = runner or LocalRunner(target)
        self.strategy = resolve_strategy(strategy, target)
        self.seed = seed
        self.seconds = 0.0  # spent building and timing variants
        self.log: list[tuple[str, str, str]] = []  # (kernel hash, variant, run id) written

    @property
    def measured(self) -> int:
        """Variants timed (not looked up) by this measurer."""
        return len(self.log)

    @property
    def device_key(self) -> str:
        return self.runner.device_key

    def lookup(self, candidate: Candidate) -> dict[str, Entry | None]:
        """Both variants' entries (``None`` for a miss), measuring nothing."""
        return {v: self.database.lookup(self.target_key, self.device_key, self.strategy.id,
                                        candidate.hash, v)
                for v in candidate.variants}

    def ensure(self, candidate: Candidate) -> tuple[dict[str, Entry], list[str]]:
        """Entries of both variants, measuring (and storing) the ones missing.

        Returns the entries and the variants that were measured now.
        """
        found = self.lookup(candidate)
        missing = [v for v, entry in found.items() if entry is None]
        if missing:
            found.update(self.measure(candidate, missing))
        return found, missing

    def measure(self, candidate: Candidate, variants: list[str]) -> dict[str, Entry]:
        """Build, run and store ``variants``, whether or not the database has them.

        Samples are interleaved (ABBA order: fused, split, split, fused, ...), so a change of
        machine load during the measurement lands on every variant alike.
        """
        start = time.perf_counter()
        current = variants[0]
        try:
            timers = {}
            inputs = candidate.random_inputs(self.seed)
            for current in variants:
                executable = build_variant(candidate, current, self.target, self.strategy)
                timers[current] = self.runner.prepare(executable, inputs)
            samples: dict[str, list[float]] = {v: [] for v in variants}
            for round_ in range(self.runner.config.repeat):
                for current in variants if round_ % 2 == 0 else variants[::-1]:
                    samples[current].append(timers[current]())
        except Exception as err:  # noqa: BLE001 (TVM raises many types; name the candidate)
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise MeasureError(
                f"measuring {current} of {candidate.describe()} failed: {first}") from err
        finally:
            self.seconds += time.perf_counter() - start
        entries = {}
        for variant in variants:
            measurement = Measurement(
                target=self.target_key, device_key=self.device_key,
                strategy=self.strategy.id, kernel_hash=candidate.hash, variant=variant,
                samples=samples[variant], method=self.runner.method, shapes=candidate.shapes,
                description=candidate.describe(),
                features=candidate.features(variant, self.target), tvm_version=tvm.__version__)
            entries[variant] = self.database.record(measurement)
            self.log.append((candidate.hash, variant, measurement.run_id))
        return entries


def target_key(target: tvm.target.Target) -> str:
    """The target as the database spells it: TVM's canonical JSON text of the target."""
    return str(target)

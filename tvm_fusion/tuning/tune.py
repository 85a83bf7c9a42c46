"""meta_schedule tuning of tvm_fusion's fused kernels over an RPC tracker; resumable.

``tune(model, TuneConfig(...))`` (and ``tvm-fusion tune``):

1. runs ``tvm_fusion.transform.Sequential(target, schedule=False)``: the *fused* PrimFuncs of
   the DNNFusion plan after ``FuseTIR``, unscheduled (not stock ``FuseOps`` kernels);
2. extracts one meta_schedule task per distinct fused PrimFunc
   (``ms.relax_integration.extract_tasks``; repeated kernels are one task with a weight);
3. tunes them with ``ms.tune_tasks``: XGBoost cost model, evolutionary search, candidates built
   here (the NDK's clang for Android, :func:`.rpc.builder_export`) and timed by
   ``ms.runner.RPCRunner`` through the tracker with one worker per registered server, so the
   servers (phones) under the key share the trials in the tracker's queue order. A candidate
   whose server dies or whose kernel crashes comes back as an error: meta_schedule stores it
   with run time 1e10 s (never chosen), :class:`_Progress` appends it to ``failures.jsonl``
   and tuning goes on with the servers left;
4. compares, per kernel, the best tuned record with our hand schedule (``ScheduleFusedBlocks``
   on CPU, DLight on GPU), both built by the same builder and timed on the same runner in the
   same round, and keeps the faster (``choices`` in ``tvm_fusion_tuning.json``): a tuned build
   is never slower than the untuned tvm_fusion build because of tuning, up to timing noise;
5. writes one profiling-database row per kernel and schedule (strategy ``meta_schedule`` and
   ``fused_block``/``dlight``, variant ``fused``, method ``rpc``, device key
   ``rpc/<key>``), next to the yellow-cell oracle's entries.

**Work directory** (``--work-dir``): meta_schedule's ``JSONDatabase``
(``database_workload.json``, ``database_tuning_record.json``: one line appended per measured
candidate as each round of ``num_trials_per_iter`` candidates finishes),
``tvm_fusion_tuning.json`` (target, key, trials, choices; written atomically),
``failures.jsonl`` and meta_schedule's logs. **Resuming**: ``tune_tasks`` restarts its trial
count from zero whatever the database holds, so :func:`tune` counts the records of this
model's kernels already present and asks only for the rest (``--trials`` is the total); the
search is seeded from the measured records. A torn last line (a process killed while
appending) is dropped before the database is opened. What an interrupted session loses is
the round in flight (at most ``num_trials_per_iter`` candidates not yet measured to the end).

``compile_tuned`` (``tvm-fusion compile --tuned DIR``) builds with the chosen schedule per
kernel, falling back to the hand schedule for kernels without a record; it never tunes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tqdm import tqdm
from tvm import relax
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .. import pipeline
from ..atomic import atomic_write_text
from ..compile import flatten_outputs
from ..target import to_target
from ..transform import Sequential
from . import rpc
from .database import Measurement, ProfilingDatabase
from .measure import RPCRunner, TimingConfig, default_strategy, target_key

META_FILE = "tvm_fusion_tuning.json"
FAILURES_FILE = "failures.jsonl"
RECORDS_FILE = "database_tuning_record.json"
WORKLOADS_FILE = "database_workload.json"
COST_MODEL_FILE = "cost_model.tar"
FAILED_RUN_S = 1e9  # meta_schedule stores 1e10 s for a failed run; anything above is failed
FORMAT = "tvm_fusion.tuning"
META_SCHEDULE_LOGGER = "tvm.s_tir.meta_schedule"


@dataclass
class TuneConfig:
    """Everything ``tvm-fusion tune`` takes (see the module docstring)."""

    tracker: str | None  # None with ``local``: a tracker and a server on this machine
    key: str | None
    target: str | dict | tvm.target.Target = "llvm"
    trials: int = 64
    work_dir: str = "tuning"
    target_host: str | dict | None = None
    trials_per_iter: int = 8
    session_timeout_s: int | None = None  # None: 60 s here, 300 s on another machine
    number: int = 3
    repeat: int = 1
    min_repeat_ms: int = 5
    compare_rounds: int = 3
    profile_db: str | None = None  # None: the oracle's default database; "" : none
    options: dict = field(default_factory=dict)  # tvm_fusion Sequential options
    population: int = 256
    seed: int = 0
    progress: bool = True
    builder_workers: int | None = None
    local: bool = False  # tune on this machine: start (and stop) a tracker and a server


class TuneError(RuntimeError):
    """Tuning ran but measured nothing usable (every trial and the hand schedule failed), or
    meta_schedule stopped; the message is one line with the root cause."""


LOCAL_KEY = "local"
SESSION_TIMEOUT_S = 60  # per remote measurement on this machine
SLOW_SESSION_TIMEOUT_S = 300  # on a phone or an emulated device: uploads, linking there, 100x


def session_timeout(cfg: TuneConfig, target: tvm.target.Target) -> int:
    """Seconds per remote measurement: ``cfg.session_timeout_s``, or by default 60 s on this
    machine and 300 s on another one (a phone over USB, an emulated AArch64 device that runs
    35-100x slower and links each ``.tar`` candidate with an emulated compiler driver)."""
    if cfg.session_timeout_s is not None:
        if cfg.session_timeout_s < 1:
            raise ValueError(f"--timeout {cfg.session_timeout_s}: must be >= 1 second")
        return int(cfg.session_timeout_s)
    return SLOW_SESSION_TIMEOUT_S if rpc.is_cross(target) else SESSION_TIMEOUT_S


@dataclass
class KernelResult:
    """One fused kernel after tuning (times in seconds, medians on the runner)."""

    name: str
    workload: str  # structural hash of the task module
    weight: int
    records: int  # tuning records in the database (failed ones included)
    failed: int
    tuned_s: float | None
    hand_s: float | None
    choice: str  # "tuned" | "hand"
    error: str | None = None  # root cause when neither schedule could be timed


@dataclass
class TuneResult:
    work_dir: str
    target: str
    key: str
    servers: int
    trials_before: int  # records of this model's kernels found in the work dir at start
    trials_run: int  # candidates measured by this session
    failed_run: int  # of which failed (dead server, crash, timeout)
    kernels: list[KernelResult]
    seconds: float
    suffix: str = ".so"  # what ``compile --tuned`` exports for this target: .so or .tar

    @property
    def trials_total(self) -> int:
        return self.trials_before + self.trials_run


# ---------------------------------------------------------------------------------- target

def resolve_target(target, target_host=None) -> tvm.target.Target:
    """A target for tuning: a ``Target``, kind, tag or JSON dict (text); ``num-cores`` is
    added to an ``llvm`` target that has none (meta_schedule needs it): this machine's core
    count for a host target, and an error naming ``--target`` for a cross target (the phone's
    core count cannot be guessed here)."""
    try:
        tgt = to_target(target)
    except ValueError as err:
        raise ValueError(f"--target: {err}") from None
    if target_host is not None:
        try:
            host = to_target(target_host)
        except ValueError as err:
            raise ValueError(f"--target-host: {err}") from None
        tgt = tvm.target.Target(tgt, host)
    if tgt.kind.name == "llvm" and "num-cores" not in tgt.attrs:
        if rpc.is_cross(tgt):
            raise ValueError(f"--target {target!r}: add \"num-cores\" (the device's core "
                             "count), e.g. {\"kind\": \"llvm\", \"mtriple\": "
                             "\"aarch64-linux-android\", \"num-cores\": 8}")
        config = {**_target_dict(tgt), "num-cores": os.cpu_count() or 1}
        tgt = tvm.target.Target(config, tgt.host) if tgt.host is not None else \
            tvm.target.Target(config)
    return tgt


def _target_dict(tgt: tvm.target.Target) -> dict:
    config = json.loads(str(tgt)) if str(tgt).startswith("{") else {"kind": tgt.kind.name}
    config.pop("host", None)
    return {k: v for k, v in config.items() if not (k == "tag" and not v)}


def _device_type(tgt: tvm.target.Target) -> str:
    return tgt.kind.name if tgt.kind.name != "llvm" else "cpu"


# ----------------------------------------------------------------------------- the module

def fused_module(mod: tvm.IRModule, target: tvm.target.Target, **options) -> tvm.IRModule:
    """tvm_fusion's graph passes with no schedule: fused PrimFuncs as meta_schedule takes
    them (``schedule=False``), the rest of the Relax module unchanged."""
    options = {**options, "schedule": False}
    with target:
        return Sequential(target, **options)(mod)


def _workload_mod(func: tvm.tirx.PrimFunc) -> tvm.IRModule:
    """The module meta_schedule's task extraction makes of a PrimFunc (``main``)."""
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main")})


def _hash(mod: tvm.IRModule) -> str:
    return f"{tvm_ffi.structural_hash(mod) & (2**64 - 1):016x}"


def _hand_schedule(fused: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """The untuned tvm_fusion schedule of every fused kernel (what the default build does)."""
    strategy = default_strategy(target)
    return strategy.apply(fused, target)


def _strategy_id(target: tvm.target.Target) -> str:
    return default_strategy(target).id


def _primfuncs(mod: tvm.IRModule) -> dict:
    return {gv: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


# ------------------------------------------------------------------------- the work dir

def _repair_lines(path: str) -> int:
    """Drop a torn last line (a process killed while appending) from a JSON-lines file;
    returns how many lines were dropped. The file is rewritten atomically."""
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8", errors="replace") as handle:
        text = handle.read()
    lines = text.split("\n")
    keep, dropped = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        keep.append(line)
    if dropped or (text and not text.endswith("\n")):
        atomic_write_text(path, "".join(line + "\n" for line in keep))
    return dropped


def open_database(work_dir: str):
    """meta_schedule's JSONDatabase in ``work_dir`` (created if missing, repaired if torn)."""
    os.makedirs(work_dir, exist_ok=True)
    for name in (WORKLOADS_FILE, RECORDS_FILE):
        _repair_lines(os.path.join(work_dir, name))
    return ms.database.JSONDatabase(work_dir=work_dir, module_equality="structural")


def _records_by_workload(db) -> dict[str, list]:
    out: dict[str, list] = {}
    for rec in db.get_all_tuning_records():
        out.setdefault(_hash(rec.workload.mod), []).append(rec)
    return out


def _run_s(rec) -> float:
    secs = [float(x) for x in rec.run_secs] if rec.run_secs is not None else []
    return statistics.fmean(secs) if secs else float("inf")


def read_meta(work_dir: str) -> dict:
    path = os.path.join(work_dir, META_FILE)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        meta = json.load(handle)
    if meta.get("format") != FORMAT:
        raise ValueError(f"--tuned {work_dir}: {META_FILE} is not a tvm_fusion tuning file")
    return meta


def _write_meta(work_dir: str, meta: dict) -> None:
    atomic_write_text(os.path.join(work_dir, META_FILE),
                      json.dumps({"format": FORMAT, **meta}, indent=1, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- progress

def _make_progress_callback(total: int, initial: int, work_dir: str, enabled: bool):
    @derived_object
    class _Progress(ms.measure_callback.PyMeasureCallback):
        """Advances the progress bar per measured candidate; appends failures (dead server,
        kernel crash, timeout, build error) to ``failures.jsonl`` as they come."""

        def __init__(self):
            self.bar = tqdm(total=total, initial=initial, desc="tune", unit="trial",
                            disable=not enabled, dynamic_ncols=True)
            self.measured = 0
            self.failed = 0
            self.causes: dict[str, int] = {}
            self.best: dict[str, float] = {}

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
                  runner_results):
            name = str(task_scheduler.tasks_[task_id].ctx.task_name)
            lines = []
            for b, r in zip(builder_results, runner_results):
                self.measured += 1
                error = b.error_msg or r.error_msg
                if error:
                    self.failed += 1
                    cause = rpc.root_cause(error)
                    self.causes[cause] = self.causes.get(cause, 0) + 1
                    lines.append(json.dumps({"task": name, "at": time.time(),
                                             "stage": "build" if b.error_msg else "run",
                                             "cause": cause,
                                             "error": rpc.whole_error(error)}))
                elif r.run_secs:
                    t = statistics.fmean(float(x) for x in r.run_secs)
                    self.best[name] = min(self.best.get(name, float("inf")), t)
            if lines:
                with open(os.path.join(work_dir, FAILURES_FILE), "a", encoding="utf-8") as fh:
                    fh.write("".join(line + "\n" for line in lines))
                    fh.flush()
                    os.fsync(fh.fileno())
            best = ", ".join(f"{k}: {v * 1e6:.0f}us" for k, v in self.best.items())
            self.bar.set_postfix_str(f"failed {self.failed}; best {best}"[:120])
            self.bar.update(len(runner_results))

        def close(self):
            self.bar.close()

    return _Progress()


# ------------------------------------------------------------------------------- tuning

def _make_runner(cfg: TuneConfig, host: str, port: int, servers: int,
                 compare: bool = False):
    """The tuning runner (one worker per server), or with ``compare`` the runner of the
    tuned-vs-hand comparison: more samples, at least 20 ms each."""
    repeat, min_ms = (max(cfg.repeat, 3), max(cfg.min_repeat_ms, 20)) if compare else \
        (cfg.repeat, cfg.min_repeat_ms)
    return ms.runner.RPCRunner(
        ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=cfg.key,
                            session_priority=1, session_timeout_sec=cfg.session_timeout_s),
        ms.runner.EvaluatorConfig(number=cfg.number, repeat=repeat, min_repeat_ms=min_ms,
                                  enable_cpu_cache_flush=False),
        f_create_session=rpc.create_session,
        max_workers=servers)


def make_builder(cfg: TuneConfig, target: tvm.target.Target):
    """meta_schedule's ``LocalBuilder`` with :func:`.rpc.build_candidate` (no intrinsic-registry
    import per single-use worker) and 120 s per build."""
    export = rpc.builder_export(target)
    workers = cfg.builder_workers or max(1, min(os.cpu_count() or 1, 4))
    return ms.builder.LocalBuilder(max_workers=workers, f_build=rpc.build_candidate,
                                  f_export=export, timeout_sec=120.0)


def _tune_contexts(tasks, work_dir: str, cfg: TuneConfig):
    strategy = ms.search_strategy.EvolutionarySearch(
        population_size=cfg.population, init_measured_ratio=0.2,
        init_min_unmeasured=min(50, cfg.population), genetic_num_iters=2)
    with _unnamed_handlers_aside(META_SCHEDULE_LOGGER):
        return ms.relax_integration.extracted_tasks_to_tune_contexts(
            tasks, work_dir, strategy=strategy, num_threads=max(1, os.cpu_count() or 1),
            seed=cfg.seed)


def _spaces_that_generate(contexts, weights, work_dir: str):
    """The tasks whose design space meta_schedule's rules generate; the others keep their hand
    schedule (``choice`` ``hand``), recorded in ``failures.jsonl`` at stage ``space``.

    The task scheduler generates every space before its first trial and catches nothing there:
    one rule failing on one kernel (``reverse_compute_at`` on BERT's fused attention, whose
    producers sit under another loop) stopped the whole tuning."""
    kept_contexts, kept_weights = [], []
    for ctx, weight in zip(contexts, weights):
        try:
            ctx.generate_design_space()
        except Exception as err:  # noqa: BLE001 (ScheduleError, TVMError: a rule's failure)
            cause = rpc.root_cause(err)
            _append_failure(work_dir, {"task": ctx.task_name, "stage": "space",
                                       "cause": cause, "error": str(err)})
            continue
        kept_contexts.append(ctx)
        kept_weights.append(weight)
    return kept_contexts, kept_weights


@contextlib.contextmanager
def _unnamed_handlers_aside(name: str):
    """meta_schedule's logging set-up lists the logger's handlers by name and fails on an
    unnamed one (``'NoneType' object has no attribute 'format'``); pytest >= 9.2 attaches its
    unnamed capture handlers to such a non-propagating logger, and a user's code may too. They
    step aside while meta_schedule configures its loggers, and come back after."""
    logger = logging.getLogger(name)
    unnamed = [h for h in logger.handlers if h.get_name() is None]
    for handler in unnamed:
        logger.removeHandler(handler)
    try:
        yield
    finally:
        for handler in unnamed:
            logger.addHandler(handler)


def tune(mod: tvm.IRModule, cfg: TuneConfig) -> TuneResult:
    """Tune the fused kernels of a Relax module (from ``import_onnx``) through the tracker,
    or with ``cfg.local`` on this machine (a tracker and a server started here and stopped
    at the end).

    Raises ``ValueError`` naming the option for an unreachable tracker (``--tracker``), no
    server under the key (``--key``), a bad target (``--target``) or trials (``--trials``);
    :class:`TuneError` (one line, the root cause) when meta_schedule stops or when every
    trial of this run and every hand-schedule measurement failed.
    """
    start = time.perf_counter()
    if cfg.trials < 0:
        raise ValueError(f"--trials {cfg.trials}: must be >= 0")
    if cfg.trials_per_iter < 1:
        raise ValueError(f"--trials-per-iter {cfg.trials_per_iter}: must be >= 1")
    target = resolve_target(cfg.target, cfg.target_host)
    cfg = dataclasses.replace(cfg, session_timeout_s=session_timeout(cfg, target))
    rpc.builder_export(target)  # Android without the NDK: fail before any work
    if cfg.local:
        if cfg.tracker:
            raise ValueError("--local: tunes on this machine with its own tracker; drop "
                             "--tracker (or drop --local to use that tracker)")
        if rpc.is_cross(target) or target.kind.name != "llvm":
            raise ValueError(f"--local: measures on this machine's CPU, but --target is "
                             f"{_target_dict(target)}; use a tracker with the device's "
                             "server (--tracker, --key)")
        with rpc.local_farm(cfg.key or LOCAL_KEY) as tracker:
            return tune(mod, dataclasses.replace(cfg, local=False, tracker=tracker,
                                                 key=cfg.key or LOCAL_KEY))
    if not cfg.tracker:
        raise ValueError("--tracker: required (HOST:PORT of the RPC tracker), or --local to "
                         "tune on this machine")
    if not cfg.key:
        raise ValueError("--key: required with --tracker (the key the servers registered "
                         "under, e.g. android)")
    host, port = rpc.parse_tracker(cfg.tracker)
    servers = rpc.check_farm(host, port, cfg.key)
    rpc.ensure_importable()  # the workers unpickle rpc.create_session / export_ndk by reference

    work_dir = os.path.abspath(cfg.work_dir)
    meta = read_meta(work_dir) if os.path.isdir(work_dir) else {}
    if meta and meta.get("target") != str(target):
        raise ValueError(f"--work-dir {cfg.work_dir}: it holds tuning for target "
                         f"{meta.get('target')}, not {target}; use another directory")
    db = open_database(work_dir)
    previous = os.environ.get(rpc.FAILURES_ENV)
    os.environ[rpc.FAILURES_ENV] = os.path.join(work_dir, FAILURES_FILE)  # runner workers
    try:
        return _tune(mod, cfg, target, host, port, servers, work_dir, meta, db, start)
    finally:
        if previous is None:
            os.environ.pop(rpc.FAILURES_ENV, None)
        else:
            os.environ[rpc.FAILURES_ENV] = previous


def _tune(mod, cfg: TuneConfig, target, host, port, servers, work_dir, meta, db,
          start) -> TuneResult:
    fused = fused_module(mod, target, **cfg.options)
    tasks = ms.relax_integration.extract_tasks(fused, target)
    tasks = [t for t in tasks if not t.mod.attrs.get("tirx.is_scheduled", False)]
    if not tasks:
        raise ValueError("the model has no fused kernel to tune")
    workloads = {t.task_name: _hash(t.mod) for t in tasks}
    before = _records_by_workload(db)
    done = sum(len(before.get(w, [])) for w in workloads.values())
    remaining = max(0, cfg.trials - done)

    progress = None
    ran = failed = 0
    if remaining:
        logging.getLogger(META_SCHEDULE_LOGGER).setLevel(logging.WARNING)
        contexts, weights = _spaces_that_generate(*_tune_contexts(tasks, work_dir, cfg),
                                                  work_dir)
        cost_model = ms.cost_model.XGBModel(
            extractor=ms.feature_extractor.PerStoreFeature(), adaptive_training=True,
            num_warmup_samples=min(8, cfg.trials_per_iter))
        cm_path = os.path.join(work_dir, COST_MODEL_FILE)
        if os.path.exists(cm_path):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # xgboost guesses the file format
                    cost_model.load(cm_path)
            except Exception:  # noqa: BLE001 (a stale model is only a warm start)
                pass
        progress = _make_progress_callback(cfg.trials, min(done, cfg.trials), work_dir,
                                           cfg.progress)
        runner = _make_runner(cfg, host, port, servers)
        try:
            if contexts:  # else every kernel keeps its hand schedule
                ms.tune_tasks(
                    tasks=contexts, task_weights=weights, work_dir=work_dir,
                    max_trials_global=remaining, num_trials_per_iter=cfg.trials_per_iter,
                    builder=make_builder(cfg, target), runner=runner, database=db,
                    cost_model=cost_model,
                    measure_callbacks=[*ms.measure_callback.MeasureCallback.create("default"),
                                       progress])
        except Exception as err:  # noqa: BLE001 (TVMError, RuntimeError, a ValueError whose
            # text is a worker's whole traceback: its first line would say nothing)
            raise TuneError(f"meta_schedule stopped: {rpc.root_cause(err)} (work dir "
                            f"{work_dir}: rerun to resume)") from err
        finally:
            progress.close()
            ran, failed = progress.measured, progress.failed
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # xgboost's note on its file format
                cost_model.save(cm_path)
        except Exception:  # noqa: BLE001 (the cost model is only a warm start)
            pass
    compare = _make_runner(cfg, host, port, 1, compare=True)
    try:
        kernels = _choose(fused, target, tasks, db, cfg, compare, work_dir)
    except Exception as err:  # noqa: BLE001 (the builder's sanity check, a dead runner)
        raise TuneError(f"timing the chosen schedules failed: {rpc.root_cause(err)}") from err
    result = TuneResult(work_dir=work_dir, target=str(target), key=cfg.key, servers=servers,
                        trials_before=done, trials_run=ran, failed_run=failed,
                        kernels=kernels, seconds=time.perf_counter() - start,
                        suffix=rpc.library_suffix(target))
    _write_meta(work_dir, {
        "target": str(target), "key": cfg.key, "tracker": cfg.tracker,
        "trials": result.trials_total, "options": _jsonable(cfg.options),
        "choices": {k.workload: {"name": k.name, "choice": k.choice, "tuned_s": k.tuned_s,
                                 "hand_s": k.hand_s, "records": k.records,
                                 "failed": k.failed} for k in kernels},
        "updated_at": time.time(), "tvm_version": tvm.__version__})
    _record_profiles(cfg, target, kernels, tasks)
    timed = any(k.tuned_s is not None or k.hand_s is not None for k in kernels)
    if not timed and (ran == 0 or failed == ran):
        causes = dict(progress.causes) if progress is not None else {}
        for k in kernels:
            if k.error:
                causes[k.error] = causes.get(k.error, 0) + 1
        cause = max(causes, key=causes.get) if causes else "no measurement came back"
        raise TuneError(f"every measurement failed ({failed} of {ran} trials this run, and "
                        f"the hand schedules): {cause} (all errors in "
                        f"{os.path.join(work_dir, FAILURES_FILE)}; docs/android.md section 8)")
    return result


def _jsonable(options: dict) -> dict:
    return {k: v for k, v in options.items() if isinstance(v, (str, int, float, bool))}


def measure_modules(mods: list[tvm.IRModule], target: tvm.target.Target, builder, runner,
                    rounds: int = 1) -> list[list[float] | str]:
    """Build each ``main`` module with ``builder`` and time it ``rounds`` times on ``runner``
    (interleaved); per module, the samples (seconds) or the root cause of its error (one
    line, :func:`.rpc.root_cause`)."""
    built = builder.build([ms.builder.BuilderInput(m, target) for m in mods])
    out: list[list[float] | str] = []
    inputs, slots = [], []
    for i, (m, b) in enumerate(zip(mods, built)):
        if b.error_msg:
            out.append(rpc.root_cause(b.error_msg))
            continue
        out.append([])
        args = ms.arg_info.ArgInfo.from_prim_func(m["main"])
        inputs.append(ms.runner.RunnerInput(b.artifact_path, _device_type(target), args))
        slots.append(i)
    try:
        for round_ in range(rounds):
            # One candidate at a time, in turns (ABBA...): two kernels timed at once on one
            # device (or two servers on one machine) would slow each other down.
            order = list(zip(slots, inputs))
            for i, inp in order if round_ % 2 == 0 else order[::-1]:
                res = runner.run([inp])[0].result()
                if isinstance(out[i], str):
                    continue
                if res.error_msg:
                    if not out[i]:
                        out[i] = rpc.root_cause(res.error_msg)
                    continue
                out[i].extend(float(x) for x in res.run_secs)
    finally:
        for b in built:
            if b.artifact_path:
                shutil.rmtree(os.path.dirname(b.artifact_path), ignore_errors=True)
    return out


def _choose(fused, target, tasks, db, cfg, runner, work_dir) -> list[KernelResult]:
    """Per kernel: the best tuned record vs our hand schedule, same builder and runner."""
    hand = _primfuncs(_hand_schedule(fused, target))
    by_name = {gv.name_hint: f for gv, f in hand.items()}
    records = _records_by_workload(db)
    mods, owners = [], []
    results = []
    for task in tasks:
        wl = _hash(task.mod)
        recs = records.get(wl, [])
        n_failed = sum(1 for r in recs if _run_s(r) >= FAILED_RUN_S)
        kr = KernelResult(name=task.task_name, workload=wl, weight=int(task.weight),
                          records=len(recs), failed=n_failed, tuned_s=None, hand_s=None,
                          choice="hand")
        results.append(kr)
        sch = db.query_schedule(task.mod, target, "main") if recs else None
        if sch is not None:
            mods.append(sch.mod)
            owners.append((kr, "tuned"))
        hand_func = by_name.get(task.task_name)
        if hand_func is not None:
            mods.append(_workload_mod(hand_func))
            owners.append((kr, "hand"))
    if mods:
        timed = measure_modules(mods, target, make_builder(cfg, target), runner,
                                rounds=max(1, cfg.compare_rounds))
        for (kr, which), samples in zip(owners, timed):
            if isinstance(samples, list) and samples:
                setattr(kr, f"{which}_s", statistics.median(samples))
                kr.__dict__.setdefault("_samples", {})[which] = samples
            elif isinstance(samples, str):
                kr.error = samples
                _append_failure(work_dir, {"task": kr.name, "stage": f"compare-{which}",
                                           "cause": samples, "error": samples})
    for kr in results:
        if kr.tuned_s is not None and (kr.hand_s is None or kr.tuned_s < kr.hand_s):
            kr.choice = "tuned"
    return results


def _append_failure(work_dir: str, entry: dict) -> None:
    with open(os.path.join(work_dir, FAILURES_FILE), "a", encoding="utf-8") as handle:
        handle.write(json.dumps({**entry, "at": time.time()}) + "\n")


def _record_profiles(cfg: TuneConfig, target, kernels: list[KernelResult], tasks) -> None:
    """One profiling-database row per kernel and schedule (method ``rpc``)."""
    if cfg.profile_db == "":
        return
    shapes = {t.task_name: _shapes(t.mod["main"]) for t in tasks}
    hand_id = _strategy_id(target)
    with ProfilingDatabase(cfg.profile_db) as pdb:
        for k in kernels:
            samples = k.__dict__.get("_samples", {})
            for which, strategy in (("tuned", "meta_schedule"), ("hand", hand_id)):
                if not samples.get(which):
                    continue
                pdb.record(Measurement(
                    target=target_key(target), device_key=f"rpc/{cfg.key}", strategy=strategy,
                    kernel_hash=f"tir:{k.workload}", variant="fused", samples=samples[which],
                    method="rpc", shapes=shapes.get(k.name, ""),
                    description=f"fused kernel {k.name} ({which}; chosen: {k.choice})",
                    tvm_version=tvm.__version__))


def _shapes(func) -> str:
    parts = []
    for p in func.params:
        buf = func.buffer_map[p] if hasattr(func, "buffer_map") and p in func.buffer_map else p
        shape = getattr(buf, "shape", None)
        if shape is not None:
            parts.append("x".join(str(int(s)) for s in shape) + f":{buf.dtype}")
    return ", ".join(parts)


# ------------------------------------------------------------------------ tuned build

def apply_tuned(fused: tvm.IRModule, work_dir: str, target: tvm.target.Target) -> tuple[
        tvm.IRModule, dict]:
    """The fused module with each kernel's chosen schedule: the tuned record where tuning
    chose it, else our hand schedule (also for kernels with no record). Returns the module and
    ``{kernel name: "tuned" | "hand"}``."""
    meta = read_meta(work_dir)
    choices = meta.get("choices", {})
    db = open_database(work_dir)
    applied = {}
    out = fused
    for gv, func in _primfuncs(fused).items():
        wm = _workload_mod(func)
        wl = _hash(wm)
        chosen = choices.get(wl, {}).get("choice")
        if chosen is None and db.has_workload(wm):
            chosen = "tuned"  # a record without a comparison (tuning was interrupted)
        sch = db.query_schedule(wm, target, "main") if chosen == "tuned" else None
        if sch is None:
            applied[gv.name_hint] = "hand"
            continue
        new = sch.mod["main"].with_attr("tirx.is_scheduled", True)
        symbol = func.attrs.get("global_symbol") if func.attrs else None
        new = new.with_attr("global_symbol", symbol) if symbol is not None else \
            new.without_attr("global_symbol")
        out[gv] = new
        applied[gv.name_hint] = "tuned"
    return _hand_schedule(out, target), applied


def tuned_target(target, work_dir: str) -> tvm.target.Target:
    """The target recorded in ``work_dir`` when ``target`` is ``None`` or plain ``"llvm"``;
    otherwise ``target``, which must be of the same kind."""
    meta = read_meta(work_dir)
    if not meta:
        raise ValueError(f"--tuned {work_dir}: not a tuning directory (no {META_FILE}); run "
                         "tvm-fusion tune first")
    recorded = tvm.target.Target(json.loads(meta["target"]))
    if target is None or (isinstance(target, str) and target == "llvm"):
        return recorded
    tgt = resolve_target(target)
    if tgt.kind.name != recorded.kind.name:
        raise ValueError(f"--target {tgt.kind.name}: --tuned {work_dir} was tuned for "
                         f"{recorded.kind.name}")
    return tgt


def compile_tuned(mod: tvm.IRModule, work_dir: str, target=None, **options):
    """Compile a Relax module (from ``import_onnx``) with the schedules in ``work_dir``;
    returns ``(executable, {kernel: "tuned" | "hand"})``. Never tunes."""
    if not os.path.isdir(work_dir):
        raise FileNotFoundError(f"--tuned {work_dir}: no such directory")
    tgt = tuned_target(target, work_dir)
    meta = read_meta(work_dir)
    merged = {**meta.get("options", {}), **options}
    fused = fused_module(mod, tgt, **{k: v for k, v in merged.items() if k != "schedule"})
    scheduled, applied = apply_tuned(fused, work_dir, tgt)
    with tgt:
        return tvm.compile(scheduled, tgt, relax_pipeline=pipeline.lowering(tgt)), applied


# ------------------------------------------------------------------------- model latency

def remote_latency(executable, inputs: list[np.ndarray], tracker: str, key: str,
                   target: tvm.target.Target, repeat: int = 10,
                   min_repeat_ms: int = 20, timeout_s: float | None = None) -> list[float]:
    """Samples (seconds per run) of a whole compiled model on a device of the farm
    (``timeout_s``: the session's, by default 60 s here and 300 s on another machine)."""
    host, port = rpc.parse_tracker(tracker)
    if timeout_s is None:
        timeout_s = SLOW_SESSION_TIMEOUT_S if rpc.is_cross(target) else SESSION_TIMEOUT_S
    session = rpc.request_session(host, port, key, timeout_s=timeout_s)
    suffix = rpc.library_suffix(target)
    runner = RPCRunner(session, f"rpc/{key}", _device_type(target),
                       TimingConfig(number=1, repeat=repeat, min_repeat_ms=min_repeat_ms),
                       export=lambda ex, path: rpc.export_library(ex, path, target),
                       library_suffix=suffix)
    sample = runner.prepare(executable, inputs)
    return [sample() for _ in range(repeat)]


def remote_run(executable, inputs: list[np.ndarray], tracker: str, key: str,
               target: tvm.target.Target, timeout_s: float | None = None,
               suffix: str | None = None) -> list[np.ndarray]:
    """Run a compiled model once on a device of the farm; its outputs as numpy arrays.

    The library is exported for ``target`` (:func:`.rpc.export_library`; ``suffix`` ``.so`` or
    ``.tar``, default :func:`.rpc.library_suffix`), uploaded under a fresh name and run with
    the inputs copied to the device: what checks the numerics of a cross-compiled build on a
    phone or the emulated AArch64 device."""
    host, port = rpc.parse_tracker(tracker)
    if timeout_s is None:
        timeout_s = SLOW_SESSION_TIMEOUT_S if rpc.is_cross(target) else SESSION_TIMEOUT_S
    session = rpc.request_session(host, port, key, timeout_s=timeout_s)
    name = f"tvm_fusion_{uuid.uuid4().hex}{suffix or rpc.library_suffix(target)}"
    with tempfile.TemporaryDirectory(prefix="tvm_fusion_rpc_") as tmp:
        path = os.path.join(tmp, name)
        rpc.export_library(executable, path, target)
        session.upload(path)
    dev = session.device(_device_type(target), 0)
    vm = relax.VirtualMachine(session.load_module(name), dev)
    result = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(x), dev) for x in inputs])
    return _remote_outputs(session, result)


def _remote_outputs(session, value) -> list[np.ndarray]:
    """A VM result on the device as numpy arrays: a tuple of outputs stays there as an opaque
    ``RPCObjectRef`` (not iterable here), so its items are fetched through the device's own
    ``ffi.ArraySize`` / ``ffi.ArrayGetItem``."""
    if hasattr(value, "numpy"):
        return [value.numpy()]
    if type(value).__name__ != "RPCObjectRef":
        return flatten_outputs(value)
    size = session.get_function("ffi.ArraySize")
    get_item = session.get_function("ffi.ArrayGetItem")
    return [out for i in range(int(size(value)))
            for out in _remote_outputs(session, get_item(value, i))]


__all__ = ["TuneConfig", "TuneResult", "KernelResult", "TuneError", "tune", "compile_tuned",
           "apply_tuned", "fused_module", "resolve_target", "open_database", "remote_latency",
           "remote_run", "measure_modules", "tuned_target"]

"""The yellow-cell oracle chain: database → measurement → model → analytic default.

:class:`ProfilingOracle` implements the planner's ``ProfitabilityOracle``. For a yellow
(fuse_depend) pair it asks, in order, and the first that can answer decides:

1. **db**: the profiling database has both variants of the candidate (fused, and the block and
   the new operator as two kernels) for this target, device and schedule strategy;
2. **measure** (``mode="measure"`` only): build and time the missing variants now, store them,
   decide on the measurement;
3. **model**: a :class:`~.cost_model.LatencyModel` trained on the database predicts both; the
   decision says it is a prediction and how wrong the model was on held-out kernels;
4. **analytic**: the fallback oracle (the planner's ``AnalyticOracle`` by default); its detail
   says why nothing above answered.

The verdict is DNNFusion's: keep the pair apart when the fused kernel is slower than the two
apart (``fused > split × (1 + margin)``, comparing the ``statistic`` of the samples, the
fastest run by default). ``mode="off"`` skips the database and measurement.
The ``Decision.source`` is ``"db"``, ``"measure"``, ``"model"`` or the fallback's own.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections import Counter

import tvm

from ..relay_passes.ecg import ECG
from ..relay_passes.fusion_plan import AnalyticOracle, Decision, PlanOptions
from ..relay_passes.plan_fusion import ModulePlan, plan_module
from .candidate import (
    FUSED,
    Candidate,
    CandidateError,
    PrimFuncHashes,
    from_blocks,
    from_ecg,
    index_block,
)
from .cost_model import LatencyModel
from .database import Entry, ProfilingDatabase, default_path
from .measure import LocalRunner, MeasureError, Measurer, Runner

MODES = ("db", "measure", "off")
STATISTICS = ("min", "median", "mean")


class ProfilingOracle:
    """Decides yellow cells from measurements (see the module docstring).

    Parameters
    ----------
    database
        A :class:`ProfilingDatabase`, or a path to one: ``"measure"`` creates a missing file,
        ``"db"`` does not (every yellow cell then falls through, saying so). Required for
        ``"measure"``.
    mode
        ``"db"``: look up, never measure; ``"measure"``: look up, measure misses;
        ``"off"``: neither (model, then fallback).
    model
        A trained :class:`~.cost_model.LatencyModel`, asked when the database cannot answer.
    fallback
        The last resort; defaults to ``AnalyticOracle()``.
    target
        Build target; defaults to ``Target.current()`` at the first decision, then ``llvm``.
    runner
        Where measurements run (default: a local runner for the target); its ``device_key``
        is also the device looked up in ``"db"`` mode.
    device_key
        The device whose entries to use when no runner is given: a build host planning for a
        phone looks up the phone's key (default: this machine's, :func:`.measure.local_device_key`).
    strategy
        Schedule strategy id (``"unscheduled"``, ``"dlight"``); default per target.
    margin
        Fuse unless ``fused > split × (1 + margin)``; 0 is the paper's rule.
    statistic
        Which latency of the samples is compared: ``"min"`` (default: on a shared machine,
        interference only ever adds time, so the fastest run is the steadiest estimate of the
        kernel itself), ``"median"`` or ``"mean"``.
    """

    def __init__(self, database: ProfilingDatabase | str | None = None, mode: str = "db",
                 model=None, fallback=None, target: tvm.target.Target | str | None = None,
                 runner: Runner | None = None, device_key: str | None = None,
                 strategy=None, margin: float = 0.0, statistic: str = "min", seed: int = 0):
        if mode not in MODES:
            raise ValueError(f"unknown profile mode {mode!r}; expected one of {MODES}")
        if statistic not in STATISTICS:
            raise ValueError(f"unknown statistic {statistic!r}; expected one of {STATISTICS}")
        self.statistic = statistic
        if mode == "measure" and database is None:
            raise ValueError("profile mode 'measure' needs a profiling database")
        self._no_database = "no profiling database"
        if isinstance(database, str) or hasattr(database, "__fspath__"):
            path = os.fspath(database)
            if mode == "db" and not os.path.exists(path):  # looking up never creates a file
                self._no_database = f"no profiling database at {path}"
                database = None
            elif mode != "off":
                database = ProfilingDatabase(path)
            else:
                database = None
        self.database = database
        self.mode = mode
        self.model = model
        self.fallback = fallback or AnalyticOracle()
        self.margin = float(margin)
        self._target = tvm.target.Target(target) if isinstance(target, (str, dict)) else target
        self._runner = runner
        self._device_key = device_key
        self._strategy = strategy
        self._seed = seed
        self._measurer: Measurer | None = None
        self._module: tvm.IRModule | None = None
        self._hashes: PrimFuncHashes | None = None
        self._indices: dict[int, tuple] = {}
        self.counts: Counter = Counter()  # decisions per source

    # ------------------------------------------------------------------------------ setup

    def bind(self, mod: tvm.IRModule) -> ProfilingOracle:
        """The legalized module being planned (the ECG names PrimFuncs, the module holds
        them). Not needed once ``ECG`` carries its module."""
        self._module = mod
        self._hashes = PrimFuncHashes(mod)
        self._indices.clear()
        return self

    @property
    def target(self) -> tvm.target.Target:
        """The target given, else the current one at the first decision, else ``llvm``."""
        if self._target is None:
            self._target = tvm.target.Target.current() or tvm.target.Target("llvm")
        return self._target

    @property
    def measurer(self) -> Measurer:
        """Looks up and measures for this oracle's target, runner and strategy."""
        if self._measurer is None:
            runner = self._runner or LocalRunner(self.target, device_key=self._device_key)
            self._measurer = Measurer(self.database, self.target, runner, self._strategy,
                                      self._seed)
        return self._measurer

    @property
    def measure_seconds(self) -> float:
        return self._measurer.seconds if self._measurer else 0.0

    def candidate(self, ecg: ECG, block: list[int], node: int,
                  producer_first: bool) -> Candidate:
        """The candidate the planner asks about, with its database key."""
        mod, index = self._block_of(ecg)
        return from_ecg(mod, ecg, list(block), node, producer_first, index, self._hashes)

    def _block_of(self, ecg: ECG):
        """The module being planned and the (cached) index of the ECG's dataflow block."""
        mod = getattr(ecg, "module", None) or self._module
        if mod is None:
            raise ValueError("ProfilingOracle needs the module being planned: call "
                             "oracle.bind(mod) first (or use tuning.oracle.plan_module_profiled)")
        if self._module is not mod:
            self.bind(mod)
        cached = self._indices.get(id(ecg))
        if cached is None or cached[0] is not ecg:
            cached = (ecg, index_block(ecg.block))
            self._indices[id(ecg)] = cached
        return mod, cached[1]

    def merge_times(self, ecg: ECG, groups: list[list[int]]) -> tuple[float, float, str] | None:
        """``(fused s, split s, detail)`` of merging the planned blocks ``groups`` into one
        kernel (an OptiFX conv chain): from the database, measured on a miss in ``"measure"``
        mode; None when neither answers (the caller's cost model decides)."""
        if self.mode == "off" or self.database is None:
            return None
        try:
            mod, index = self._block_of(ecg)
            cand = from_blocks(mod, ecg, groups, index, self._hashes)
            found = self.measurer.lookup(cand)
            source = "db"
            if not all(found.values()):
                if self.mode != "measure":
                    return None
                found, _ = self.measurer.ensure(cand)
                source = "measure"
        except (CandidateError, MeasureError) as err:
            self.counts["chain unmeasured"] += 1
            warnings.warn(f"conv chain {_groups_text(ecg, groups)}: {err}", stacklevel=2)
            return None
        self.counts[f"chain {source}"] += 1
        fused, split = found[FUSED], found[cand.split_variant]
        f_s, s_s = getattr(fused, self.statistic), getattr(split, self.statistic)
        return f_s, s_s, (f"{source}: fused {f_s * 1e6:.1f} us vs {len(groups)} kernels "
                          f"{s_s * 1e6:.1f} us ({self.statistic}; key {cand.hash[:12]})")

    # --------------------------------------------------------------------------- decision

    def decide(self, ecg: ECG, block: list[int], node: int, producer_first: bool) -> Decision:
        decision = self._decide(ecg, block, node, producer_first)
        self.counts[decision.source] += 1
        return decision

    def _decide(self, ecg, block, node, producer_first) -> Decision:
        why = []
        cand = None
        if self.mode != "off" or self.model is not None:
            try:
                cand = self.candidate(ecg, block, node, producer_first)
            except CandidateError as err:
                why.append(f"cannot extract the candidate: {err}")
        if cand is not None and self.mode != "off" and self.database is None:
            why.append(self._no_database)
        elif cand is not None and self.mode != "off":
            found = self.measurer.lookup(cand)
            if all(found.values()):
                return self._verdict(cand, found, "db")
            if self.mode == "measure":
                try:
                    found, _ = self.measurer.ensure(cand)
                    return self._verdict(cand, found, "measure")
                except MeasureError as err:
                    why.append(str(err))
            else:
                why.append("no database entry")
        if cand is not None and self.model is not None:
            return self._predict(cand)
        if self.model is None and self.mode != "off":
            why.append("no model")
        elif self.mode == "off":
            why.append("profiling off")
        fallback = self.fallback.decide(ecg, block, node, producer_first)
        return dataclasses.replace(fallback,
                                   detail=f"{fallback.detail} ({'; '.join(why)})")

    def _verdict(self, cand: Candidate, found: dict[str, Entry], source: str) -> Decision:
        fused, split = found[FUSED], found[cand.split_variant]
        f_s, s_s = getattr(fused, self.statistic), getattr(split, self.statistic)
        fuse = f_s <= s_s * (1.0 + self.margin)
        detail = (f"fused {f_s * 1e6:.1f} us vs split {s_s * 1e6:.1f} us "
                  f"({self.statistic} of {fused.count}/{split.count} runs on "
                  f"{fused.device_key}, {fused.strategy}; key {cand.hash[:12]})")
        return Decision(fuse, source, detail)

    def _predict(self, cand: Candidate) -> Decision:
        fused, split = self.model.predict_pair(cand.features(FUSED, self.target),
                                               cand.features(cand.split_variant, self.target))
        fuse = fused <= split * (1.0 + self.margin)
        detail = (f"predicted, not measured: fused {fused * 1e6:.1f} us vs split "
                  f"{split * 1e6:.1f} us ({self.model.summary()})")
        return Decision(fuse, "model", detail)


def _groups_text(ecg: ECG, groups: list[list[int]]) -> str:
    return " | ".join(" ".join(ecg.nodes[m].op_name for m in g) for g in groups)


def plan_module_profiled(mod: tvm.IRModule, oracle: ProfilingOracle,
                         options: PlanOptions | None = None,
                         broadcast_policy: str = "expanding_only") -> ModulePlan:
    """``plan_module`` with ``oracle`` deciding the yellow cells (bound to ``mod`` first)."""
    options = dataclasses.replace(options or PlanOptions(), oracle=oracle.bind(mod))
    return plan_module(mod, options, broadcast_policy)


def make_oracle(profile: str = "off", database=None, model=None, fallback=None, **kwargs):
    """The yellow-cell oracle for ``Sequential``-style options.

    ``profile="off"`` without a model returns ``fallback`` itself (the planner's
    ``AnalyticOracle`` by default), so turning profiling off costs nothing. ``database`` is a
    :class:`ProfilingDatabase` or a path (``None``: :func:`~.database.default_path`);
    ``model`` a :class:`~.cost_model.LatencyModel` or the path of a saved one. Other keywords
    go to :class:`ProfilingOracle` (``target``, ``runner``, ``strategy``, ``margin``,
    ``statistic``).
    """
    if profile not in MODES:
        raise ValueError(f"option profile={profile!r} is not one of {MODES}")
    if isinstance(model, str) or hasattr(model, "__fspath__"):
        model = LatencyModel.load(model)
    fallback = fallback or AnalyticOracle()
    if profile == "off" and model is None:
        return fallback
    if profile != "off" and database is None:
        database = default_path()
    return ProfilingOracle(database, profile, model=model, fallback=fallback, **kwargs)

"""An XGBoost latency model trained on the profiling database, for candidates it lacks.

When the database has no entry for a yellow candidate and measuring is off, DNNFusion would
have to guess; this model guesses from the entries it has. Each database entry is one variant
(``fused`` or ``split``) of one candidate, stored with the features
:meth:`~.candidate.Candidate.features` computed when it was measured: operator counts per
mapping type and per operator kind, FLOPs, input/output/intermediate/crossing bytes, IRS
sizes, kernels, target kind.

Two boosters, because the verdict hangs on a ratio that is often a few percent while latencies
span five orders of magnitude:

* **latency**: log latency of any variant, from its features;
* **ratio**: ``log(split / fused)`` of a candidate, from its split variant's features (which
  hold everything the fused ones do, plus the bytes that cross between the two kernels).

A candidate's prediction is ``fused = latency(fused)`` and ``split = fused × exp(ratio)``, so
the verdict is the ratio model's sign, learnt on the quantity that decides.

**Validation.** K-fold cross-validation by candidate (both variants of a held-out candidate are
held out together, so no model is scored on a kernel it saw). :attr:`LatencyModel.validation`
keeps the pooled held-out median and mean absolute percentage error of the latency booster,
the log-RMSE, and the share of held-out candidates whose verdict (fused faster or not) the
model gets right, beside the share that "always fuse" gets right, and the same on decisive
candidates only (measured gap over 10 %: most yellow pairs are within the noise of a shared
machine, where no model can be right more than by chance). The returned model is then fitted
on every entry with the same settings.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from ..atomic import atomic_write_text
from .database import ProfilingDatabase

# xgboost is imported where a model is trained or loaded: it is heavy, and only the latency
# model needs it (every build imports this module through the oracle)

MODEL_FORMAT = "tvm_fusion.latency_model"
_PARAMS = {"objective": "reg:squarederror", "max_depth": 4, "eta": 0.1, "subsample": 0.9,
           "colsample_bytree": 0.9, "min_child_weight": 1.0, "nthread": 2, "seed": 0}
_ROUNDS = 200
_MIN_PAIRS = 5  # fewer candidates with both variants: no ratio booster
DECISIVE = math.log(1.10)  # a verdict measured with a >10 % gap is not a coin toss of noise


class LatencyModel:
    """Predicts latencies (seconds) of a candidate's variants from their feature dicts."""

    def __init__(self, latency, ratio, feature_names: list[str], validation: dict,
                 trained_on: dict):
        self.latency = latency  # xgboost.Booster: log seconds of one variant
        self.ratio = ratio  # xgboost.Booster | None: log(split / fused) of one candidate
        self.feature_names = feature_names
        self.validation = validation
        self.trained_on = trained_on

    # ----------------------------------------------------------------------------- train

    @classmethod
    def train(cls, database: ProfilingDatabase, target: str | None = None,
              device_key: str | None = None, strategy: str | None = None,
              folds: int = 5, seed: int = 0, rounds: int = _ROUNDS,
              statistic: str = "min") -> LatencyModel:
        """Fit on the entries matching the filters; cross-validate first.

        Validation is ``folds``-fold by candidate: every candidate is held out once, scored by
        a model fitted on the other folds, and the held-out errors of all folds are pooled
        (with a few hundred entries one 20 % split swings with the seed). ``statistic`` is the
        latency learnt (``min``, ``median`` or ``mean`` of each entry's samples); use the one
        the oracle compares. Raises ``ValueError`` when fewer than 10 entries of 5 candidates
        match.
        """
        entries = [e for e in database.entries(target=target, device_key=device_key,
                                               strategy=strategy, order="id") if e.features]
        kernels = sorted({e.kernel_hash for e in entries})
        if len(entries) < 10 or len(kernels) < 5:
            raise ValueError(f"{database.path}: {len(entries)} entries of {len(kernels)} "
                             "candidates match; the latency model needs at least 10 of 5")
        folds = max(2, min(int(folds), len(kernels)))
        names = sorted({k for e in entries for k in e.features})
        order = np.random.default_rng(seed).permutation(kernels)
        fold_of = {k: i % folds for i, k in enumerate(order)}
        params = dict(_PARAMS, seed=seed)

        scored = []  # (entry, predicted latency, predicted pair verdict or None)
        for fold in range(folds):
            train = [e for e in entries if fold_of[e.kernel_hash] != fold]
            test = [e for e in entries if fold_of[e.kernel_hash] == fold]
            trial = cls._fit(train, names, params, rounds, statistic)
            scored.append(_score(trial, test, statistic))
        validation = _pool(scored, folds, len(entries))

        final = cls._fit(entries, names, params, rounds, statistic)
        final.validation = validation
        final.trained_on = {"database": database.path, "target": target,
                            "device_key": device_key, "strategy": strategy,
                            "entries": len(entries), "candidates": len(kernels),
                            "pairs": len(_pairs(entries)), "statistic": statistic}
        return final

    @classmethod
    def _fit(cls, entries, names, params, rounds, statistic) -> LatencyModel:
        import xgboost as xgb

        x = _matrix([e.features for e in entries], names)
        y = np.log(np.array([getattr(e, statistic) for e in entries]))
        latency = xgb.train(params, xgb.DMatrix(x, label=y, feature_names=_safe(names)), rounds)
        pairs = _pairs(entries)
        ratio = None
        if len(pairs) >= _MIN_PAIRS:
            xr = _matrix([split.features for _, split in pairs], names)
            yr = np.log(np.array([getattr(s, statistic) / getattr(f, statistic)
                                  for f, s in pairs]))
            ratio = xgb.train(params, xgb.DMatrix(xr, label=yr, feature_names=_safe(names)),
                              rounds)
        return cls(latency, ratio, names, {}, {})

    # --------------------------------------------------------------------------- predict

    def predict(self, features: dict) -> float:
        """Latency of one variant in seconds (a prediction: callers must label it as one)."""
        return float(np.exp(self._raw(self.latency, [features])[0]))

    def predict_pair(self, fused: dict, split: dict) -> tuple[float, float]:
        """``(fused, split)`` latencies of one candidate, in seconds (predictions)."""
        fused_s = self.predict(fused)
        if self.ratio is None:
            return fused_s, self.predict(split)
        return fused_s, fused_s * float(np.exp(self._raw(self.ratio, [split])[0]))

    def _raw(self, booster, rows: list[dict]) -> np.ndarray:
        import xgboost as xgb

        x = _matrix(rows, self.feature_names)
        return booster.predict(xgb.DMatrix(x, feature_names=_safe(self.feature_names)))

    def summary(self) -> str:
        """One line: what the model is and how wrong it was on held-out candidates."""
        v = self.validation
        text = (f"XGBoost on {self.trained_on.get('entries')} entries; held-out latency error "
                f"median {v['median_ape'] * 100:.0f}%")
        if v.get("n_pairs"):
            text += (f", verdict right on {v['verdict_accuracy'] * 100:.0f}% of "
                     f"{v['n_pairs']} held-out candidates")
        return text

    # ------------------------------------------------------------------------ save, load

    def save(self, path: str | os.PathLike) -> None:
        """One JSON file (the boosters' own JSON inside), written atomically."""
        doc = {"format": MODEL_FORMAT, "feature_names": self.feature_names,
               "validation": self.validation, "trained_on": self.trained_on,
               "latency": _booster_json(self.latency),
               "ratio": None if self.ratio is None else _booster_json(self.ratio)}
        atomic_write_text(path, json.dumps(doc))

    @classmethod
    def load(cls, path: str | os.PathLike) -> LatencyModel:
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as handle:
                doc = json.load(handle)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: cannot read a latency model ({err})") from None
        if not isinstance(doc, dict) or doc.get("format") != MODEL_FORMAT:
            raise ValueError(f"{path}: not a tvm_fusion latency model")
        ratio = None if doc.get("ratio") is None else _booster(doc["ratio"])
        return cls(_booster(doc["latency"]), ratio, doc["feature_names"], doc["validation"],
                   doc["trained_on"])


def _booster_json(booster) -> dict:
    return json.loads(bytes(booster.save_raw("json")).decode())


def _booster(doc: dict):
    import xgboost as xgb

    booster = xgb.Booster()
    booster.load_model(bytearray(json.dumps(doc).encode()))
    return booster


def _pairs(entries) -> list:
    """``(fused, split)`` entries of every candidate that has both."""
    by_kernel: dict[str, dict] = {}
    for e in entries:
        by_kernel.setdefault(e.kernel_hash, {})["fused" if e.variant == "fused" else "split"] = e
    return [(v["fused"], v["split"]) for v in by_kernel.values() if len(v) == 2]


def _safe(names: list[str]) -> list[str]:
    """XGBoost forbids ``[``, ``]`` and ``<`` in feature names."""
    return [n.replace("[", "(").replace("]", ")").replace("<", "lt") for n in names]


def _matrix(rows: list[dict], names: list[str]) -> np.ndarray:
    index = {n: i for i, n in enumerate(names)}
    x = np.zeros((len(rows), len(names)), dtype=np.float32)
    for r, feats in enumerate(rows):
        for key, value in feats.items():
            col = index.get(key)
            if col is not None:  # a feature the model never saw cannot inform it
                x[r, col] = float(value)
    return x


def _score(model: LatencyModel, entries, statistic: str) -> dict:
    """Held-out errors of one fold."""
    measured = np.array([getattr(e, statistic) for e in entries])
    predicted = np.array([model.predict(e.features) for e in entries])
    verdicts = []  # (truth: fused no slower, predicted: fused no slower, |log(split/fused)|)
    for fused, split in _pairs(entries):
        f_pred, s_pred = model.predict_pair(fused.features, split.features)
        f_true, s_true = getattr(fused, statistic), getattr(split, statistic)
        verdicts.append((f_true <= s_true, f_pred <= s_pred, abs(math.log(s_true / f_true))))
    return {"measured": measured, "predicted": predicted, "verdicts": verdicts}


def _pool(scored: list[dict], folds: int, n_entries: int) -> dict:
    measured = np.concatenate([s["measured"] for s in scored])
    predicted = np.concatenate([s["predicted"] for s in scored])
    verdicts = [v for s in scored for v in s["verdicts"]]
    decisive = [v for v in verdicts if v[2] > DECISIVE]
    ape = np.abs(predicted - measured) / measured

    def accuracy(pairs, rule) -> float:
        return sum(rule(v) for v in pairs) / len(pairs) if pairs else float("nan")

    return {
        "folds": folds,
        "n_entries": n_entries,
        "median_ape": float(np.median(ape)),
        "mean_ape": float(np.mean(ape)),
        "log_rmse": float(math.sqrt(np.mean(np.log(predicted / measured) ** 2))),
        "n_pairs": len(verdicts),
        "verdict_accuracy": accuracy(verdicts, lambda v: v[0] == v[1]),
        "always_fuse_accuracy": accuracy(verdicts, lambda v: v[0]),
        "n_decisive_pairs": len(decisive),
        "decisive_verdict_accuracy": accuracy(decisive, lambda v: v[0] == v[1]),
    }

"""An XGBoost latency model trained on the profiling database, for candidates it lacks.

When the database has no entry for a yellow candidate and measuring is off, DNNFusion would
have to guess; this model guesses from the entries it has. Each database entry is one variant
(``fused`` or ``split``) of one candidate, stored with the features :meth:`Candidate.features`
computed when it was measured: operator counts per mapping type and per operator kind, FLOPs,
input/output/intermediate/crossing bytes, IRS sizes, kernels, target kind. The model regresses
log latency (latencies span five orders of magnitude, and the verdict compares ratios).

**Validation.** Entries are split by candidate (both variants of a held-out candidate are held
out together, so the model never saw the kernel it is scored on); the held-out median and mean
absolute percentage errors and the fraction of held-out candidates whose verdict (fused faster
or not) the model gets right are kept in :attr:`LatencyModel.validation`. The model that is
returned is then refitted on every entry with the same settings.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from .atomic import atomic_write_text
from .database import ProfilingDatabase

MODEL_FORMAT = "tvm_fusion.latency_model"
_PARAMS = {"objective": "reg:squarederror", "max_depth": 4, "eta": 0.1, "subsample": 0.9,
           "colsample_bytree": 0.9, "min_child_weight": 1.0, "nthread": 2, "seed": 0}
_ROUNDS = 200


class LatencyModel:
    """Predicts a variant's latency (seconds) from its feature dict."""

    def __init__(self, booster, feature_names: list[str], validation: dict, trained_on: dict):
        self.booster = booster
        self.feature_names = feature_names
        self.validation = validation
        self.trained_on = trained_on

    # ----------------------------------------------------------------------------- train

    @classmethod
    def train(cls, database: ProfilingDatabase, target: str | None = None,
              device_key: str | None = None, strategy: str | None = None,
              holdout: float = 0.2, seed: int = 0, rounds: int = _ROUNDS) -> LatencyModel:
        """Fit on the entries matching the filters; report held-out error first.

        Raises ``ValueError`` when there are too few entries (fewer than 10, or fewer than 5
        candidates) to hold any out.
        """
        import xgboost as xgb

        entries = [e for e in database.entries(target=target, device_key=device_key,
                                               strategy=strategy, order="id") if e.features]
        kernels = sorted({e.kernel_hash for e in entries})
        if len(entries) < 10 or len(kernels) < 5:
            raise ValueError(f"{database.path}: {len(entries)} entries of {len(kernels)} "
                             "candidates match; the latency model needs at least 10 of 5")
        names = sorted({k for e in entries for k in e.features})
        x = _matrix([e.features for e in entries], names)
        y = np.log(np.array([e.median for e in entries]))

        rng = np.random.default_rng(seed)
        held = set(rng.permutation(kernels)[:max(1, round(holdout * len(kernels)))])
        test = np.array([e.kernel_hash in held for e in entries])
        params = dict(_PARAMS, seed=seed)
        booster = xgb.train(params, xgb.DMatrix(x[~test], label=y[~test],
                                                feature_names=_safe(names)), rounds)
        pred = booster.predict(xgb.DMatrix(x[test], feature_names=_safe(names)))
        validation = _validation([e for e, t in zip(entries, test) if t], np.exp(pred),
                                 n_train=int((~test).sum()))

        final = xgb.train(params, xgb.DMatrix(x, label=y, feature_names=_safe(names)), rounds)
        trained_on = {"database": database.path, "target": target, "device_key": device_key,
                      "strategy": strategy, "entries": len(entries), "candidates": len(kernels)}
        return cls(final, names, validation, trained_on)

    # --------------------------------------------------------------------------- predict

    def predict(self, features: dict) -> float:
        """Latency in seconds (a prediction: callers must label it as one)."""
        return float(self.predict_many([features])[0])

    def predict_many(self, features: list[dict]) -> np.ndarray:
        import xgboost as xgb

        x = _matrix(features, self.feature_names)
        return np.exp(self.booster.predict(xgb.DMatrix(x, feature_names=_safe(
            self.feature_names))))

    def summary(self) -> str:
        """One line: what the model is and how wrong it was on held-out candidates."""
        v = self.validation
        return (f"XGBoost on {self.trained_on.get('entries')} entries; held-out median error "
                f"{v['median_ape'] * 100:.0f}%, verdicts right {v['verdict_accuracy'] * 100:.0f}%"
                f" of {v['n_pairs']}")

    # ------------------------------------------------------------------------ save, load

    def save(self, path: str | os.PathLike) -> None:
        """One JSON file (the booster's own JSON inside), written atomically."""
        doc = {"format": MODEL_FORMAT, "feature_names": self.feature_names,
               "validation": self.validation, "trained_on": self.trained_on,
               "booster": json.loads(bytes(self.booster.save_raw("json")).decode())}
        atomic_write_text(path, json.dumps(doc))

    @classmethod
    def load(cls, path: str | os.PathLike) -> LatencyModel:
        import xgboost as xgb

        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as handle:
                doc = json.load(handle)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: cannot read a latency model ({err})") from None
        if not isinstance(doc, dict) or doc.get("format") != MODEL_FORMAT:
            raise ValueError(f"{path}: not a tvm_fusion latency model")
        booster = xgb.Booster()
        booster.load_model(bytearray(json.dumps(doc["booster"]).encode()))
        return cls(booster, doc["feature_names"], doc["validation"], doc["trained_on"])


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


def _validation(entries, predicted: np.ndarray, n_train: int) -> dict:
    measured = np.array([e.median for e in entries])
    ape = np.abs(predicted - measured) / measured
    by_kernel: dict[str, dict[str, tuple[float, float]]] = {}
    for e, p in zip(entries, predicted):
        by_kernel.setdefault(e.kernel_hash, {})[
            "fused" if e.variant == "fused" else "split"] = (e.median, float(p))
    pairs = [v for v in by_kernel.values() if len(v) == 2]
    right = sum((v["fused"][0] <= v["split"][0]) == (v["fused"][1] <= v["split"][1])
                for v in pairs)
    fused_wins = sum(v["fused"][0] <= v["split"][0] for v in pairs)
    return {
        "n_train": n_train,
        "n_test": len(entries),
        "median_ape": float(np.median(ape)),
        "mean_ape": float(np.mean(ape)),
        "log_rmse": float(math.sqrt(np.mean(np.log(predicted / measured) ** 2))),
        "n_pairs": len(pairs),
        "verdict_accuracy": right / len(pairs) if pairs else float("nan"),
        "always_fuse_accuracy": fused_wins / len(pairs) if pairs else float("nan"),
    }

"""The fuzz loop: draw each seed's case, classify it in the worker, minimise and keep failures."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable

from .differential import FAILURES, Outcome
from .generate import draw_case
from .minimise import minimise, same_failure
from .store import Store, options_to_json, record
from .triage import fixed_by, triage
from .worker import Worker


def fuzz(seeds: Iterable[int], store: Store, worker: Worker, *, target: str = "llvm",
         special_share: float = 0.3, option_share: float = 0.15, symbolic_share: float = 0.0,
         max_nodes: int = 12, fp16_share: float = 0.1, qdq_share: float = 0.3,
         gemm_block_share: float = 0.1, do_minimise: bool = True, minimise_budget_s: float = 120.0,
         minimise_timeouts: bool = False, minimise_per_crash: int = 3, do_triage: bool = True,
         on_case: Callable[[dict], None] | None = None) -> Counter:
    """Run every seed not already in ``store``; return the count per class.

    A failure is minimised (unless ``do_minimise`` is off; a ``timeout`` only with
    ``minimise_timeouts``, since each rejected candidate may cost the whole time limit) and
    written to ``store`` with its sidecar; every case gets a JSON line. Crashes with the same
    error shape are minimised ``minimise_per_crash`` times only (one bug often fails many
    seeds; later ones keep their generated model). With ``do_triage``, each minimised failure
    is also run under single option toggles (:mod:`.triage`); the JSON line's ``fixed_by``
    lists those that make it pass, a first hint at the root cause.
    """
    counts: Counter = Counter()
    minimised: Counter = Counter()
    done = store.done_seeds()
    for seed in seeds:
        if seed in done:
            continue
        try:
            case = draw_case(seed, target, special_share, option_share, symbolic_share,
                             max_nodes, fp16_share, qdq_share,
                             gemm_block_share=gemm_block_share)
        except Exception as err:  # noqa: BLE001 - a generator bug must not stop the run
            rec = {"seed": seed, "class": "skipped", "stage": "generate",
                   "error": f"{type(err).__name__}: {err}"[:300]}
            store.add(rec)
            counts["skipped"] += 1
            if on_case:
                on_case(rec)
            continue
        outcome = worker.check(case)
        extra: dict = {}
        if outcome.cls in FAILURES:
            small, final = case, outcome
            again = outcome.cls == "crash" and \
                minimised[outcome.signature()] >= minimise_per_crash
            if do_minimise and not again and (outcome.cls != "timeout" or minimise_timeouts):
                minimised[outcome.signature()] += 1
                small, checks = minimise(case, same_failure(worker.check, outcome),
                                         budget_s=minimise_budget_s)
                if small is not case:
                    final = worker.check(small)
                    if final.signature() != outcome.signature():  # flaky: keep the original
                        small, final = case, outcome
                extra["minimise_checks"] = checks
                if do_triage and outcome.cls != "memory":  # memory: the default build only
                    # which one option change makes the minimised case pass
                    extra["fixed_by"] = fixed_by(triage(small, worker.check))
            path = store.save_failure(small, final, original=case,
                                      original_nodes=len(case.model.graph.node))
            extra.update(model=str(path.relative_to(store.out)),
                         min_nodes=len(small.model.graph.node),
                         min_ops=[n.op_type for n in small.model.graph.node],
                         min_options=options_to_json(small.options), min_error=final.error,
                         min_max_err=final.max_err)
        rec = record(case, outcome, **extra)
        store.add(rec)
        counts[outcome.cls] += 1
        if on_case:
            on_case(rec)
    return counts


def summarise(records: list[dict]) -> dict:
    """Counts per class, the failures grouped by their minimised error shape, and the cases
    whose schedules fell back (right values, slower kernels) by the warning."""
    counts = Counter(r["class"] for r in records)
    groups: dict[str, list[int]] = {}
    for r in records:
        if r["class"] in FAILURES:
            key = Outcome(r["class"], error=r.get("min_error") or r.get("error", "")).signature()
            if r["class"] == "wrong":
                key = "wrong: " + " ".join(_ops(r))
            if r.get("fixed_by") is not None:
                key += f" | fixed by: {', '.join(r['fixed_by']) or 'none'}"
            groups.setdefault(key, []).append(r["seed"])
    fallbacks: dict[str, list[int]] = {}  # schedules that fell back, by their first line
    for r in records:
        for line in r.get("fallbacks", []):
            fallbacks.setdefault(re.sub(r"\d+", "N", line)[:160], []).append(r["seed"])
    return {"counts": dict(counts), "groups": groups, "fallbacks": fallbacks}


def _ops(rec: dict) -> list[str]:
    return rec.get("min_ops") or rec.get("ops") or []

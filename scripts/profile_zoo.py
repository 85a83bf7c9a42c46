#!/usr/bin/env python
"""Fill the profiling database by measuring the zoo, re-plan from it, compare, train the model.

For each model: import and legalize (not timed), plan with ``ProfilingOracle(mode="measure")``
(every yellow candidate missing from the database is built and timed, fused and split), then
plan again with ``mode="db"`` (lookups only) and check that both plans are identical. The
planning times are the point: DNNFusion's database exists so that a compile does not pay for
measurement (YOLO-V4: about 3 h without, 1 h with). Finally an XGBoost latency model is trained
on the database and its held-out error printed.

    python scripts/profile_zoo.py --models tinybert,mobilenet_v2,gpt2 --db /tmp/zoo.db

Timing "planning with measurement" needs a database that does not yet hold the zoo's
candidates; the script refuses a non-empty one unless ``--reuse`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import tvm  # noqa: E402

from tvm_fusion.compile import import_onnx, load_onnx  # noqa: E402
from tvm_fusion.relay_passes.plan_fusion import plan_module  # noqa: E402
from tvm_fusion.threads import use_physical_cores  # noqa: E402
from tvm_fusion.transform import legalize_passes  # noqa: E402
from tvm_fusion.tuning.cost_model import LatencyModel  # noqa: E402
from tvm_fusion.tuning.database import ProfilingDatabase  # noqa: E402
from tvm_fusion.tuning.measure import LocalRunner, TimingConfig  # noqa: E402
from tvm_fusion.tuning.oracle import ProfilingOracle, plan_module_profiled  # noqa: E402

DEFAULT_MODELS = "tinybert,mobilenet_v2,gpt2"


def _groups(module_plan) -> dict:
    return {f"{k[0]}#{k[1]}": [b.members for b in p.blocks]
            for k, p in module_plan.plans.items()}


def _yellow(module_plan) -> list[bool]:
    return [y.decision.fuse for p in module_plan.plans.values() for y in p.yellow]


def profile_model(name: str, path: Path, db: ProfilingDatabase, target, timing) -> dict:
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = import_onnx(load_onnx(path))
        with target:
            mod = tvm.transform.Sequential(legalize_passes(target))(mod)
    load_s = time.perf_counter() - start

    analytic = plan_module(mod)
    measuring = ProfilingOracle(db, "measure", target=target,
                                runner=LocalRunner(target, timing))
    start = time.perf_counter()
    measured_plan = plan_module_profiled(mod, measuring)
    measure_s = time.perf_counter() - start

    lookup = ProfilingOracle(db, "db", target=target)
    start = time.perf_counter()
    db_plan = plan_module_profiled(mod, lookup)
    db_s = time.perf_counter() - start

    identical = _groups(db_plan) == _groups(measured_plan)
    return {
        "model": name, "operators": measured_plan.num_operators, "load_s": round(load_s, 2),
        "yellow_decisions": len(_yellow(measured_plan)),
        "measured_variants": measuring.measurer.measured,
        "sources_measure_run": dict(measuring.counts), "sources_db_run": dict(lookup.counts),
        "plan_measure_s": round(measure_s, 3), "plan_db_s": round(db_s, 4),
        "plan_analytic_s": round(analytic.seconds, 4),
        "speedup": round(measure_s / max(db_s, 1e-9), 1), "identical": identical,
        "kernels_measured": measured_plan.num_kernels, "kernels_db": db_plan.num_kernels,
        "kernels_analytic": analytic.num_kernels,
        "yellow_kept_apart": sum(not f for f in _yellow(measured_plan)),
    }


def main(argv=None) -> int:
    use_physical_cores()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help=f"comma-separated zoo names, or 'all' (default {DEFAULT_MODELS})")
    parser.add_argument("--zoo", default=str(REPO_ROOT / "models"), help="folder of .onnx files")
    parser.add_argument("--db", default=None, help="database file (default: a fresh temp file)")
    parser.add_argument("--reuse", action="store_true",
                        help="accept a database that already has entries")
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--min-repeat-ms", type=int, default=10)
    parser.add_argument("--folds", type=int, default=5, help="cross-validation folds")
    parser.add_argument("--model-out", help="save the trained latency model here (JSON)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    names = (sorted(p.stem for p in Path(args.zoo).glob("*.onnx")) if args.models == "all"
             else [m.strip() for m in args.models.split(",") if m.strip()])
    if args.db is None:
        import tempfile

        args.db = os.path.join(tempfile.mkdtemp(prefix="tvm_fusion_zoo_"), "profile.db")
    db = ProfilingDatabase(args.db)
    if len(db) and not args.reuse:
        print(f"{args.db} already has {len(db)} entries: planning 'with measurement' would "
              "hit them; pass a new --db, or --reuse", file=sys.stderr)
        return 2
    target = tvm.target.Target(args.target)
    timing = TimingConfig(number=1, repeat=args.repeat, min_repeat_ms=args.min_repeat_ms)
    print(f"database {args.db}; target {target.kind.name}; "
          f"device {LocalRunner(target).device_key}")

    rows = []
    header = (f"{'model':14s} {'ops':>5s} {'yellow':>6s} {'timed':>5s} {'measure s':>10s} "
              f"{'db s':>8s} {'speedup':>8s} {'same':>5s} {'kernels m/db/analytic':>22s}")
    print(header)
    for name in names:
        row = profile_model(name, Path(args.zoo) / f"{name}.onnx", db, target, timing)
        rows.append(row)
        print(f"{name:14s} {row['operators']:5d} {row['yellow_decisions']:6d} "
              f"{row['measured_variants']:5d} {row['plan_measure_s']:10.2f} "
              f"{row['plan_db_s']:8.3f} {row['speedup']:7.0f}x {str(row['identical']):>5s} "
              f"{row['kernels_measured']:>8d}/{row['kernels_db']}/{row['kernels_analytic']}",
              flush=True)
    total_m = sum(r["plan_measure_s"] for r in rows)
    total_db = sum(r["plan_db_s"] for r in rows)
    print(f"{'total':14s} {'':5s} {'':6s} {'':5s} {total_m:10.2f} {total_db:8.3f} "
          f"{total_m / max(total_db, 1e-9):7.0f}x {str(all(r['identical'] for r in rows)):>5s}")

    result = {"database": args.db, "target": str(target), "rows": rows,
              "total_measure_s": round(total_m, 3), "total_db_s": round(total_db, 4),
              "entries": len(db)}
    try:
        model = LatencyModel.train(db, folds=args.folds)
    except ValueError as err:
        print(f"latency model: not trained ({err})")
    else:
        v = model.validation
        print(f"latency model (XGBoost, {len(db)} entries, {v['folds']}-fold by candidate): "
              f"held-out latency error median {v['median_ape'] * 100:.1f}%, mean "
              f"{v['mean_ape'] * 100:.1f}%, log-RMSE {v['log_rmse']:.3f}; verdict right on "
              f"{v['verdict_accuracy'] * 100:.0f}% of {v['n_pairs']} candidates (always-fuse "
              f"{v['always_fuse_accuracy'] * 100:.0f}%), on "
              f"{v['decisive_verdict_accuracy'] * 100:.0f}% of the {v['n_decisive_pairs']} "
              f"with a measured gap over 10%")
        result["model_validation"] = v
        if args.model_out:
            model.save(args.model_out)
            print(f"saved the latency model to {args.model_out}")
    if args.json:
        from tvm_fusion.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

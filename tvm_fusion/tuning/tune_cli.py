"""``tvm-fusion tune model.onnx --tracker HOST:PORT --key KEY --target T --trials N --work-dir D``.

``add_tune_parser(subparsers)`` adds the ``tune`` command; :func:`compile_tuned_cmd` is what
``tvm-fusion compile --tuned D`` runs. Bad input (an unreachable tracker, no server under the
key, a bad target, Android without ``$TVM_NDK_CC``) is a ``ValueError`` with a one-line message
naming the option, which ``tvm-fusion``'s ``main`` prints with exit code 2. A tuning that ran
but measured nothing (every trial and the hand schedules failed) or that meta_schedule stopped
is one line with the root cause and exit code 1 (the whole errors are in ``failures.jsonl``).
``--local`` tunes on this machine: a tracker and a server are started and stopped here.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..compile import import_onnx, load_onnx
from ..options import parse_cli_options
from . import rpc, tune

# the tuner is called as tune.X, looked up at each call: tests replace tune.TuneConfig


def add_tune_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``tune`` to ``subparsers`` (from ``add_subparsers``)."""
    parser = subparsers.add_parser(
        "tune", help="meta_schedule tuning of the fused kernels over an RPC tracker",
        description=__doc__.splitlines()[0])
    parser.add_argument("model", help="ONNX file")
    parser.add_argument("--tracker", default=None, metavar="HOST:PORT",
                        help="the RPC tracker (python -m tvm.exec.rpc_tracker); required "
                             "without --local")
    parser.add_argument("--key", default=None,
                        help="device key the servers registered under, e.g. android")
    parser.add_argument("--local", action="store_true",
                        help="tune on this machine: start a tracker and a server here, stop "
                             "them at the end (no --tracker; a target for this CPU)")
    parser.add_argument("--target", default="llvm",
                        help="TVM target: kind, tag or JSON dict, e.g. '{\"kind\": \"llvm\", "
                             "\"mtriple\": \"aarch64-linux-android\", \"num-cores\": 8}' or "
                             "qcom/adreno-opencl")
    parser.add_argument("--target-host", default=None,
                        help="host target of a GPU target, e.g. '{\"kind\": \"llvm\", "
                             "\"mtriple\": \"aarch64-linux-android\"}'")
    parser.add_argument("--trials", type=int, default=64,
                        help="total measured candidates for the model (a rerun with the same "
                             "--work-dir resumes: only the missing ones are run)")
    parser.add_argument("--work-dir", required=True,
                        help="tuning database and logs; reuse it to resume")
    parser.add_argument("--trials-per-iter", type=int, default=8,
                        help="candidates per search round (the most an interruption loses)")
    parser.add_argument("--timeout", type=int, default=None,
                        help="seconds per remote measurement (session, upload, run); default "
                             "60 on this machine, 300 on another (a phone, an emulated device)")
    parser.add_argument("--number", type=int, default=3, help="runs per timing sample")
    parser.add_argument("--repeat", type=int, default=1, help="timing samples per candidate")
    parser.add_argument("--profile-db", default=None,
                        help="profiling database for per-kernel rows (default: the oracle's, "
                             "$TVM_FUSION_DB); 'none' to skip")
    parser.add_argument("--option", "-O", action="append", metavar="KEY=VALUE",
                        help="a tvm_fusion option (see docs/options.md), repeatable")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_cmd_tune)
    return parser


def _cmd_tune(args) -> int:
    options = parse_cli_options(args.option)  # a bad -O fails before the model loads
    mod = import_onnx(load_onnx(args.model))
    profile_db = "" if (args.profile_db or "").lower() == "none" else args.profile_db
    cfg = tune.TuneConfig(tracker=args.tracker, key=args.key, target=args.target,
                     target_host=args.target_host, trials=args.trials, work_dir=args.work_dir,
                     trials_per_iter=args.trials_per_iter, session_timeout_s=args.timeout,
                     number=args.number, repeat=args.repeat, profile_db=profile_db,
                     options=options, progress=not args.no_progress,
                     seed=args.seed, local=args.local)
    try:
        result = tune.tune(mod, cfg)
    except tune.TuneError as err:
        print(f"tvm-fusion: error: tune: {err}", file=sys.stderr)
        return 1
    print(f"tuned {len(result.kernels)} fused kernels on {result.servers} server(s) under "
          f"key {result.key!r}: {result.trials_run} trials this run ({result.failed_run} "
          f"failed), {result.trials_total} in {result.work_dir}; {result.seconds:.0f} s")
    for k in result.kernels:
        tuned = "-" if k.tuned_s is None else f"{k.tuned_s * 1e6:.1f} us"
        hand = "-" if k.hand_s is None else f"{k.hand_s * 1e6:.1f} us"
        print(f"  {k.name}: tuned {tuned}, hand schedule {hand} -> {k.choice} "
              f"({k.records} records, {k.failed} failed)")
    print(f"build with it: tvm-fusion compile {args.model} --tuned {args.work_dir} "
          f"-o model{result.suffix}")
    return 0


def compile_tuned_cmd(model_path: str, tuned_dir: str, output: str, target, options: dict,
                      quiet: bool = False) -> dict:
    """``tvm-fusion compile MODEL --tuned DIR -o OUT``: build with the tuned schedules (no
    tuning) and export for the target's platform (the NDK's clang for Android ``.so``; a
    ``.tar`` of objects needs no linker). Returns ``{kernel: "tuned" | "hand"}``."""
    tgt = tune.tuned_target(target, tuned_dir)
    mod = import_onnx(load_onnx(model_path))
    executable, applied = tune.compile_tuned(mod, tuned_dir, tgt, **options)
    rpc.export_library(executable, output, tgt)
    if not quiet:
        n = sum(1 for v in applied.values() if v == "tuned")
        print(f"{n} of {len(applied)} fused kernels use tuned schedules from {tuned_dir}: "
              + json.dumps(applied))
    return applied

"""Differential fuzzing of tvm_fusion against stock TVM and ONNX Runtime (docs/fuzzing.md).

    PYTHONPATH=$PWD python scripts/fuzz.py --seeds 0:300 --out fuzz-out

Writes ``OUT/cases.jsonl`` (one JSON line per case: seed, options, class, first error line),
``OUT/failures/seed<N>-<class>.onnx`` (minimised) with a ``.json`` sidecar and the original
``.orig.onnx``, and ``OUT/summary.json`` (counts per class, failures grouped). Exit code 0 if
no case is wrong, crashed or timed out, 1 if some are, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _seeds(text: str) -> range:
    try:
        a, b = text.split(":")
        lo, hi = int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds {text!r}: expected A:B with integers A < B") from None
    if lo >= hi or lo < 0:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: expected 0 <= A < B")
    return range(lo, hi)


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share in [0, 1]")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2 (house style)
        print(f"fuzz.py: error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> int:
    p = _Parser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=_seeds, required=True, help="seed range A:B (B exclusive)")
    p.add_argument("--out", required=True, help="output folder (created; resumable)")
    p.add_argument("--target", default="native",
                   help="TVM target (kind, tag or JSON dict); default (or 'native'): this "
                        "machine's CPU, so its vector units and FMA contraction are fuzzed "
                        "(a bare 'llvm' is SSE2)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per compile (60)")
    p.add_argument("--special-share", type=_share, default=0.3,
                   help="share of cases with NaN/inf/denormal/large inputs (0.3)")
    p.add_argument("--option-share", type=_share, default=0.15,
                   help="chance of each option taking a non-default value (0.15)")
    p.add_argument("--symbolic-share", type=_share, default=0.0,
                   help="share of cases whose first input's dim 0 is symbolic (0)")
    p.add_argument("--fp16-share", type=_share, default=0.1,
                   help="share of cases whose whole graph is cast to float16 (0.1)")
    p.add_argument("--qdq-share", type=_share, default=0.3,
                   help="share of cases with QDQ int8 Conv/MatMul/Gemm (0.3)")
    p.add_argument("--gemm-block-share", type=_share, default=0.1,
                   help="share of cases ending in two or three GEMMs with Table 3's M2M->M2M "
                        "green, so one block holds them (0.1)")
    p.add_argument("--max-nodes", type=int, default=12, help="nodes per graph at most (12)")
    p.add_argument("--memory", action="store_true",
                   help="also fail a case whose planned activation memory (default tvm_fusion "
                        "build) exceeds stock FuseOps' (class 'memory'; issue 20)")
    p.add_argument("--no-minimise", action="store_true", help="keep failures as generated")
    p.add_argument("--minimise-budget", type=float, default=120.0,
                   help="seconds of minimisation per failure (120)")
    p.add_argument("--minimise-per-crash", type=int, default=3,
                   help="minimise at most this many crashes with one error shape (3)")
    p.add_argument("--no-triage", action="store_true",
                   help="do not rerun minimised failures under single option toggles")
    p.add_argument("--minimise-timeouts", action="store_true",
                   help="also minimise timeouts (each rejected candidate may cost --timeout)")
    args = p.parse_args(argv)
    if args.max_nodes < 1:
        p.error("--max-nodes must be >= 1")

    from tqdm import tqdm

    from tvm_fusion.compile import to_target
    from tvm_fusion.fuzz.run import fuzz, summarise
    from tvm_fusion.fuzz.store import Store
    from tvm_fusion.fuzz.worker import Worker
    from tvm_fusion.target import host_target_dict

    if args.target == "native":
        args.target = json.dumps(host_target_dict())
    try:
        to_target(args.target)
    except ValueError as err:
        p.error(f"--target {args.target!r}: {err}")
    store = Store(args.out)
    bar = tqdm(total=len(args.seeds), unit="graph", initial=len(
        store.done_seeds() & set(args.seeds)))
    tally = {c: 0 for c in ("ok", "wrong", "crash", "timeout", "skipped", "memory")}

    def on_case(rec):
        tally[rec["class"]] += 1
        bar.set_postfix(tally, refresh=False)
        bar.update(1)

    checker = "tvm_fusion.fuzz.differential:check_case" + ("_memory" if args.memory else "")
    with Worker(args.timeout, os.path.join(args.out, "worker.log"), checker) as worker:
        fuzz(args.seeds, store, worker, target=args.target, special_share=args.special_share,
             option_share=args.option_share, symbolic_share=args.symbolic_share,
             fp16_share=args.fp16_share, qdq_share=args.qdq_share,
             gemm_block_share=args.gemm_block_share, max_nodes=args.max_nodes,
             do_minimise=not args.no_minimise,
             minimise_budget_s=args.minimise_budget,
             minimise_timeouts=args.minimise_timeouts,
             minimise_per_crash=args.minimise_per_crash, do_triage=not args.no_triage,
             on_case=on_case)
    bar.close()
    records = [r for r in store.records() if r["seed"] in set(args.seeds)]
    summary = summarise(records)
    summary["seeds"] = f"{args.seeds.start}:{args.seeds.stop}"
    from tvm_fusion.atomic import atomic_write_text

    atomic_write_text(os.path.join(args.out, "summary.json"), json.dumps(summary, indent=1))
    print(json.dumps(summary["counts"]))
    bad = sum(summary["counts"].get(c, 0) for c in ("wrong", "crash", "timeout"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Differential fuzzing of torch.export programs: tvm_fusion against stock TVM and PyTorch
(tvm_fusion/fuzz/torch_programs.py; docs/fuzzing.md).

    PYTHONPATH=$PWD python scripts/fuzz_torch_export.py --seeds 0:40 --out fuzz-torch

Writes DIR/cases.jsonl (one line per case, rewritten whole after each case) and exits 1 when a
case is wrong or crashed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tvm_fusion.atomic import atomic_write_text  # noqa: E402
from tvm_fusion.fuzz.torch_programs import check_program, draw_program  # noqa: E402
from tvm_fusion.native_log import filtered_stderr  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", required=True, help="seed range A:B (B exclusive)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--target", default="native",
                        help="TVM target (kind, tag or JSON dict); default (or 'native'): this "
                             "machine's CPU, as scripts/fuzz.py (a bare 'llvm' is SSE2)")
    args = parser.parse_args(argv)
    if args.target == "native":
        from tvm_fusion.target import host_target_dict
        args.target = json.dumps(host_target_dict())
    try:
        start, stop = (int(v) for v in args.seeds.split(":"))
    except ValueError:
        parser.exit(2, f"fuzz_torch_export.py: --seeds takes A:B, got {args.seeds!r}\n")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "cases.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    done = {json.loads(line)["seed"] for line in lines}
    counts: dict[str, int] = {}
    for seed in range(start, stop):
        if seed in done:
            continue
        with filtered_stderr():
            result = check_program(draw_program(seed), args.target)
        counts[result.status] = counts.get(result.status, 0) + 1
        print(f"seed {seed}: {result.status} {' '.join(result.blocks)} "
              f"{result.error.splitlines()[0] if result.error else ''}"
              + "".join(f"\n  fallback: {f}" for f in result.fallbacks), flush=True)
        if result.fallbacks:
            counts["fallback"] = counts.get("fallback", 0) + 1
        lines.append(json.dumps(asdict(result)))
        atomic_write_text(log, "\n".join(lines) + "\n")
    print(json.dumps(counts))
    return 1 if counts.get("wrong") or counts.get("crash") else 0


if __name__ == "__main__":
    sys.exit(main())

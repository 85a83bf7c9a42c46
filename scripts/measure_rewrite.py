"""Rewriting on ONNX models: FLOPs and kernel counts with and without it, one Markdown table
row per model (the tables of docs/rewrite.md), or the rule registry as a table.

    python scripts/measure_rewrite.py models/*.onnx [--check] [--option schedule=false]
    python scripts/measure_rewrite.py --rules

``--check`` also compiles the rewritten module and compares it with ONNX Runtime (rtol 1e-3);
``--option key=value`` passes a pipeline option to that build. The measurement itself is
:mod:`tvm_fusion.relay_passes.rewrite.measure`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tvm_fusion.relay_passes.rewrite.measure import HEADER, measure, rules_markdown


def _option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    lowered = value.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    return key, int(value) if value.lstrip("-").isdigit() else value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", type=Path)
    parser.add_argument("--rules", action="store_true", help="print the rule table and exit")
    parser.add_argument("--check", action="store_true", help="compare with ONNX Runtime")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a compile_model option for --check (true/false/int/str)")
    args = parser.parse_args(argv)
    if args.rules:
        print(rules_markdown())
        return
    options = dict(_option(text) for text in args.option)
    print(HEADER, flush=True)
    for path in args.models:
        print(measure(path, args.check, options), flush=True)


if __name__ == "__main__":
    main()

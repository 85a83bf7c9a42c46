"""``tvm-fusion db stats | list | export | import | prune``: inspect the profiling database.

``add_db_parser(subparsers)`` adds the ``db`` command to an ``argparse`` sub-parser set; each
sub-command's ``func(args)`` returns an exit code. Errors are ``ValueError``s (a corrupt or
foreign file included) with one-line messages, which ``tvm-fusion``'s ``main`` prints as
``tvm-fusion: error: ...`` with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import time

from .database import ENV_PATH, ProfilingDatabase, default_path


def add_db_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``db`` and its sub-commands to ``subparsers`` (from ``add_subparsers``)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=None, metavar="PATH",
                        help=f"database file (default: ${ENV_PATH}, else {default_path()})")
    filters = argparse.ArgumentParser(add_help=False)
    filters.add_argument("--target", help="only entries for this target (its JSON text)")
    filters.add_argument("--device", help="only entries for this device key")
    filters.add_argument("--strategy", help="only entries for this schedule strategy")

    db = subparsers.add_parser("db", help="inspect the profiling database",
                               description=__doc__.splitlines()[0])
    sub = db.add_subparsers(dest="db_command", metavar="{stats,list,export,import,prune}")
    db.set_defaults(func=lambda _args: _usage(db))

    stats = sub.add_parser("stats", parents=[common], help="entries per target/device/strategy")
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.add_argument("--check", action="store_true", help="also run SQLite's quick_check")
    stats.set_defaults(func=_cmd_stats)

    lst = sub.add_parser("list", parents=[common, filters], help="list entries")
    lst.add_argument("--limit", type=int, default=50, help="at most this many (0: all)")
    lst.add_argument("--sort", choices=("updated", "slowest", "fastest"), default="updated")
    lst.add_argument("--json", action="store_true", help="print JSON")
    lst.set_defaults(func=_cmd_list)

    exp = sub.add_parser("export", parents=[common, filters], help="write entries to JSON")
    exp.add_argument("output", help="JSON file (written atomically)")
    exp.set_defaults(func=_cmd_export)

    imp = sub.add_parser("import", parents=[common], help="merge JSON exports in")
    imp.add_argument("inputs", nargs="+", help="JSON files written by 'db export'")
    imp.set_defaults(func=_cmd_import)

    prune = sub.add_parser("prune", parents=[common, filters], help="delete entries")
    prune.add_argument("--older-than", type=float, metavar="DAYS",
                       help="entries last updated more than DAYS ago")
    prune.add_argument("--tvm-version", help="entries measured with this TVM version")
    prune.add_argument("--all", action="store_true",
                       help="allow pruning with no other criterion (every entry)")
    prune.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    prune.add_argument("--vacuum", action="store_true", help="shrink the file afterwards")
    prune.set_defaults(func=_cmd_prune)
    return db


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _open(args, create: bool = False) -> ProfilingDatabase:
    return ProfilingDatabase(args.db, create=create)


def _when(stamp) -> str:
    return "-" if stamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def _cmd_stats(args) -> int:
    with _open(args) as db:
        stats = db.stats()
        if args.check:
            stats["check"] = db.check()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(f"profiling database {stats['path']} (schema v{stats['schema_version']}, "
          f"{stats['bytes'] / 1024:.0f} KiB)")
    print(f"  {stats['entries']} entries of {stats['kernels']} candidates, "
          f"{stats['samples']} samples; oldest {_when(stats['oldest'])}, "
          f"newest {_when(stats['newest'])}")
    for g in stats["groups"]:
        print(f"  {g['entries']:6d} entries  {g['kernels']:6d} candidates  "
              f"strategy {g['strategy']}  device {g['device_key']}  target {g['target']}")
    if "check" in stats:
        print(f"  integrity: {stats['check']}")
    return 0


def _cmd_list(args) -> int:
    order = {"updated": "updated_at DESC", "slowest": "median DESC",
             "fastest": "median ASC"}[args.sort]
    with _open(args) as db:
        entries = list(db.entries(target=args.target, device_key=args.device,
                                  strategy=args.strategy, order=order,
                                  limit=args.limit or None))
    if args.json:
        for e in entries:
            e.runs = {k: {**r, "samples": len(r["samples"])} for k, r in e.runs.items()}
        print(json.dumps([e.to_json() for e in entries], indent=2))
        return 0
    print(f"{'key':12s} {'variant':9s} {'median us':>11s} {'std us':>9s} {'n':>4s}  "
          f"{'method':6s} candidate")
    for e in entries:
        print(f"{e.kernel_hash[:12]:12s} {e.variant:9s} {e.median * 1e6:11.2f} "
              f"{e.std * 1e6:9.2f} {e.count:4d}  {e.method:6s} {e.description}  [{e.shapes}]")
    return 0


def _cmd_export(args) -> int:
    with _open(args) as db:
        count = db.export_json(args.output, target=args.target, device_key=args.device,
                               strategy=args.strategy)
    print(f"wrote {count} entries to {args.output}")
    return 0


def _cmd_import(args) -> int:
    with _open(args, create=True) as db:
        for path in args.inputs:
            counts = db.import_json(path)
            print(f"{path}: {counts['added']} added, {counts['merged']} merged, "
                  f"{counts['unchanged']} unchanged")
    return 0


def _cmd_prune(args) -> int:
    older = None if args.older_than is None else args.older_than * 86400.0
    with _open(args) as db:
        count = db.prune(older_than_s=older, target=args.target, device_key=args.device,
                         strategy=args.strategy, tvm_version=args.tvm_version,
                         everything=args.all, dry_run=args.dry_run)
        if args.vacuum and not args.dry_run:
            db.vacuum()
    print(f"{'would delete' if args.dry_run else 'deleted'} {count} entries")
    return 0

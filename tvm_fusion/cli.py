"""``tvm-fusion``: demo | compile | report | bench | tune | db.

Bad input (a malformed ONNX file, an unsupported operator, an unknown option or a bad value of
one, a bad target, an unwritable output) is one line on stderr and exit code 2, never a
traceback from inside TVM. A failed numerical check or an internal error (a bug, of ours or of
TVM's) is one line too, with exit code 1; ``TVM_FUSION_TRACEBACK=1`` shows its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from . import __version__
from . import report as reporting  # reporting.make_report is looked up per call (tests)
from .bench import ALL_VARIANTS, CLOCKS, check_clock, check_variants, run_bench
from .bench import to_markdown as bench_markdown
from .compile import compile_model, import_model, load_model, model_signature
from .devices import require_codegen, require_device
from .feeds import shape_names, shapes_for
from .graph_layout import find_dot
from .models import BUILTIN_MODELS, get_builtin
from .options import Options, parse_cli_options
from .target import NATIVE, host_target, to_target
from .threads import use_physical_cores
from .tuning import db_cli, tune_cli  # tune_cli.compile_tuned_cmd: looked up per call (tests)
from .tuning.rpc import export_library
from .visualize import picture
from .zoo import to_markdown as zoo_markdown
from .zoo import write_outputs, zoo_models, zoo_reports

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1
# The project's errors for bad input are ValueErrors (ModelError, OptionError, the profiling
# database's and the tuner's errors); OSError covers unreadable inputs and unwritable outputs.
BAD_INPUT = (ValueError, OSError, NotImplementedError)
# commands whose --target defaults to (and whose "native" means) the host CPU
_HOST_DEFAULT = ("demo", "compile", "report", "bench")
_TARGET_HELP = ("TVM target: kind, tag or JSON dict; default (or 'native'): this machine's CPU, "
                "{\"kind\": \"llvm\", \"mcpu\": <host CPU>, \"num-cores\": <cores>}")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    use_physical_cores()  # before any kernel runs: TVM's default is half the cores on x86
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        tuned_for_its_target = getattr(args, "tuned", None) and args.target is None
        if (args.command in _HOST_DEFAULT and getattr(args, "target", None) in (None, NATIVE)
                and not tuned_for_its_target):  # compile --tuned: the tuning's own target
            args.target = host_target()  # the CPU this runs on, not SSE2 (tvm_fusion.target)
        _check_device(args)
        return args.func(args)
    except BAD_INPUT as err:
        print(f"tvm-fusion: error: {_one_line(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except AssertionError as err:  # a numerical check failed: a bug, say so plainly
        print(f"tvm-fusion: numerical check failed: {_one_line(err)}", file=sys.stderr)
        return EXIT_INTERNAL
    except Exception as err:  # noqa: BLE001 (the last resort: a bug, still one line)
        if os.environ.get("TVM_FUSION_TRACEBACK"):
            raise
        print(f"tvm-fusion: error: {_one_line(err)} (internal error {type(err).__name__}; "
              f"TVM_FUSION_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


def _check_device(args) -> None:
    """A command that runs the model (demo, report's check, bench) on a GPU target fails up
    front, in one line, where this machine has no such device; report suggests --no-check."""
    if args.command == "report" and not getattr(args, "no_check", False):
        require_device(args.target, "the report runs the model to check it: pass --no-check to "
                                    "plan and compile without running")
    elif args.command in ("demo", "bench"):
        require_device(args.target, f"{args.command} runs the model: give a CPU --target here")


def _one_line(err: BaseException) -> str:
    """The first line of an error's message; of a message that carries a traceback (some of
    TVM's do), the last line, which is the error itself."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    return lines[-1] if lines[0].startswith("Traceback (most recent call last)") else lines[0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tvm-fusion", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tvm_fusion {__version__}")
    sub = parser.add_subparsers(dest="command")

    def common(p):
        p.add_argument("--target", default=None, help=_TARGET_HELP)
        p.add_argument("--strategy", default=None,
                       help="dnnfusion (default) | apollo | tvm (stock FuseOps)")
        p.add_argument("--option", "-O", action="append", metavar="KEY=VALUE",
                       help="a tvm_fusion option, repeatable; values by type: true/false, "
                            "integers, numbers, names; table3=O2M:M2M=green,...; "
                            "preset=conservative|default|aggressive (docs/options.md)")
        p.add_argument("--profile", choices=("off", "db", "measure"),
                       help="yellow cells: profiling database lookups, measuring misses, or off")
        p.add_argument("--profile-db", help="profiling database (default $TVM_FUSION_DB)")
        p.add_argument("--latency-model", help="a trained XGBoost latency model (JSON)")
        p.add_argument("--no-rewrite", action="store_true",
                       help="skip mathematical-property rewriting")
        p.add_argument("--no-layout", action="store_true",
                       help="skip SmartMem layout-transform elimination")

    demo = sub.add_parser("demo", help="run the whole flow on the built-in models")
    demo.add_argument("--model", default="all", help="encoder | figure3 | all")
    demo.add_argument("--why", action="store_true", help="print every rejected pair")
    common(demo)
    demo.set_defaults(func=_cmd_demo)

    comp = sub.add_parser("compile", help="compile an ONNX model (or a torch.export .pt2 "
                                          "program) to a shared library")
    comp.add_argument("model")
    comp.add_argument("-o", "--output", required=True,
                      help="shared library to write (missing parent folders are created)")
    comp.add_argument("--tuned", metavar="DIR",
                      help="use the schedules 'tvm-fusion tune' left in DIR (no tuning)")
    common(comp)
    comp.set_defaults(func=_cmd_compile)

    rep = sub.add_parser("report", help="the fusion report of ONNX models")
    rep.add_argument("models", nargs="*", help="ONNX files or torch.export programs (.pt2); "
                                               "or --zoo")
    rep.add_argument("--zoo", action="store_true",
                     help="every model of the zoo folder: Markdown, JSON and a chart in --out")
    rep.add_argument("--models-dir", help="zoo folder (default $TVM_FUSION_MODELS or ./models)")
    rep.add_argument("--out", default="out/zoo", help="where --zoo writes its files")
    rep.add_argument("--json", action="store_true", help="print JSON instead of text")
    rep.add_argument("--why", action="store_true", help="print every rejected pair and why")
    rep.add_argument("--no-check", action="store_true", help="skip the numerical check")
    rep.add_argument("--html", metavar="FILE",
                     help="also draw the plan (one model): an offline HTML page "
                          "(docs/visualize.md)")
    _input_shape_arg(rep)
    common(rep)
    rep.set_defaults(func=_cmd_report)
    bench = sub.add_parser("bench", help="latency side by side: stock TVM, tvm_fusion, "
                                         "ONNX Runtime, PyTorch")
    bench.add_argument("models", nargs="*", help="ONNX files or torch.export programs (.pt2) "
                                                 "(default: the zoo folder)")
    bench.add_argument("--models-dir", help="zoo folder (default $TVM_FUSION_MODELS or ./models)")
    bench.add_argument("--target", default=None, help=_TARGET_HELP)
    bench.add_argument("--variants", default=None,
                       help=f"comma-separated subset of {','.join(ALL_VARIANTS)} (default: all; "
                            "those whose runtime is missing are skipped with a note)")
    bench.add_argument("--repeat", type=int, default=10)
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                       help="time calls by wall clock, or (cpu) by the calling thread's CPU "
                       "time, which a busy neighbour does not inflate; cpu needs "
                       "TVM_NUM_THREADS=1")
    bench.add_argument("--out", default="out/bench", help="where JSON, Markdown and PNG go")
    bench.add_argument("--cache", default=None, metavar="DIR",
                       help="keep the TVM builds in DIR and reuse identical ones (same model, "
                            "options, target, TVM and tvm_fusion code)")
    bench.add_argument("--build-only", action="store_true",
                       help="build the TVM variants into --cache and time nothing (for a "
                            "timing run on a quiet machine later)")
    _input_shape_arg(bench)
    bench.set_defaults(func=_cmd_bench)

    db_cli.add_db_parser(sub)
    tune_cli.add_tune_parser(sub)
    return parser


def _input_shape_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-shape", action="append", metavar="NAME=D0,D1,...",
                   help="run a model with symbolic dimensions at this shape: a graph input's "
                        "full shape (x=1,128,64) or one dim_param's size (seq=128); repeatable. "
                        "The model is compiled symbolic; unnamed dims run at 1 (batch) or 128")


def _parse_input_shapes(pairs: list[str] | None) -> dict | None:
    """``--input-shape`` values: ``NAME=1,128`` -> ``{NAME: (1, 128)}``, ``seq=7`` -> 7."""
    if not pairs:
        return None
    shapes: dict = {}
    for pair in pairs:
        name, _, dims = pair.partition("=")
        try:
            sizes = tuple(int(d) for d in dims.replace("x", ",").split(","))
        except ValueError:
            sizes = ()
        if not name.strip() or not sizes or min(sizes) < 1:
            raise ValueError(f"--input-shape {pair!r} must be NAME=D0,D1,... (positive ints)")
        shapes[name.strip()] = sizes[0] if len(sizes) == 1 else sizes
    return shapes


def _check_shape_names(shapes: dict | None, models: list) -> None:
    """Every ``--input-shape`` name must belong to one of the models (each model gets the
    entries that name its own inputs and dimensions)."""
    known = set().union(*(shape_names(model_signature(m)) for m in models)) if models else set()
    unknown = sorted(set(shapes or {}) - known)
    if unknown:
        raise ValueError(f"--input-shape {unknown[0]!r}: no model has an input or symbolic "
                         f"dimension of that name (they have: {', '.join(sorted(known))})")


def _cmd_bench(args) -> int:
    _check_target(args.target)
    check_clock(args.clock)
    if args.build_only and args.cache is None:
        raise ValueError("--build-only keeps its builds in --cache DIR: give one")
    variants = list(ALL_VARIANTS) if args.variants is None else [
        v.strip() for v in args.variants.split(",") if v.strip()]
    if args.variants is not None:  # asked for by name: a missing runtime is an error
        check_variants(variants)
    paths = [Path(p) for p in args.models] or zoo_models(args.models_dir)
    shapes = _parse_input_shapes(args.input_shape)
    if shapes:
        _check_shape_names(shapes, [load_model(p) for p in paths])
    rows = run_bench(paths, args.target, variants, args.repeat, args.warmup, args.out,
                     input_shapes=shapes, clock=args.clock, cache_dir=args.cache,
                     build_only=args.build_only)
    if args.build_only:
        print(f"built {len(paths)} model(s) into {args.cache}")
        return 0
    print(bench_markdown(rows))
    print(f"wrote {args.out}/bench.json, bench.md, bench.png")
    return 0


def _options(args) -> dict:
    """The tvm_fusion options of a command: ``-O`` pairs and the flags, checked here so that a
    bad value fails before a model is loaded or built."""
    options = parse_cli_options(args.option)
    if getattr(args, "strategy", None) is not None:
        options["strategy"] = args.strategy
    for flag, key in (("profile", "profile"), ("profile_db", "profile_db"),
                      ("latency_model", "latency_model")):
        if getattr(args, flag, None) is not None:
            options[key] = getattr(args, flag)
    if getattr(args, "no_rewrite", False):
        options["rewrite"] = False
    if getattr(args, "no_layout", False):
        options["layout"] = False
    # compile's --strategy none (tvm.compile's CPU default, no fusion) is no option of ours
    Options.from_kwargs(**{k: v for k, v in options.items()
                           if not (k == "strategy" and v == "none" and args.command == "compile")})
    return options


def _check_target(target: str) -> None:
    """``--target`` checked up front, so a typo fails before minutes of compiling."""
    try:
        to_target(target)
        require_codegen(target)  # a missing code generator or a CPU of another architecture
    except ValueError as err:
        raise ValueError(f"--target: {err}") from None


def _writable_path(flag: str, path: str, example: str) -> str:
    """An output file named by ``flag``, checked before any work: missing parent folders are
    created (as ``--out`` folders are); a folder or an unwritable place is one line."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{flag} {path}: is a folder; give a file name such as {example}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot create {out.parent} ({err.strerror})") from None
    if not os.access(out.parent, os.W_OK):
        raise ValueError(f"{flag} {path}: {out.parent} is not writable")
    return str(out)


def _cmd_demo(args) -> int:
    options = _options(args)
    _check_target(args.target)
    names = list(BUILTIN_MODELS) if args.model == "all" else [args.model]
    for name in names:
        model = get_builtin(name)
        print(f"== built-in model '{name}': import -> plan -> compile -> run -> check", flush=True)
        report = reporting.make_report(model, name, args.target, check=True, **options)
        print(reporting.format_report(report, why=args.why))
        print(f"  result: {report.fused_kernels} kernels instead of {report.stock_kernels}, "
              f"outputs match the stock build and the ONNX reference", flush=True)
    return 0


def _cmd_compile(args) -> int:
    options = _options(args)
    output = _writable_path("-o", args.output, "model.so")
    if getattr(args, "tuned", None):
        tune_cli.compile_tuned_cmd(args.model, args.tuned, output, args.target, options)
        print(f"wrote {args.output}")
        return 0
    _check_target(args.target)
    mod = import_model(load_model(args.model))
    executable = compile_model(mod, args.target, **options)
    # for another machine's CPU (an aarch64 mtriple): its cross compiler links the .so, or a
    # .tar of objects; the host's g++ cannot link them
    export_library(executable, output, to_target(args.target))
    print(f"wrote {args.output}")
    return 0


def _cmd_report(args) -> int:
    options = _options(args)
    _check_target(args.target)
    if args.zoo:
        return _cmd_zoo(args)
    if not args.models:
        raise ValueError("report needs ONNX files (or .pt2 programs), or --zoo")
    if args.html and len(args.models) != 1:
        raise ValueError(f"--html draws one model; {len(args.models)} given")
    html_path = _writable_path("--html", args.html, "plan.html") if args.html else None
    if html_path:
        find_dot()  # Graphviz lays the page out: without it, one line before any work
    reports, failures = [], []
    shapes = _parse_input_shapes(args.input_shape)
    many = len(args.models) > 1  # one bad file among several is reported, the rest go on
    models = []
    for path in args.models:
        try:
            models.append((path, load_model(path)))
        except BAD_INPUT as err:
            failures.append(_skip_model(path, err, many))
    _check_shape_names(shapes, [model for _, model in models])
    for path, model in tqdm(models, desc="report", unit="model", disable=len(models) < 2):
        name = os.path.splitext(os.path.basename(path))[0]
        artifacts: dict = {}
        try:
            reports.append(reporting.make_report(
                model, name, args.target, check=not args.no_check,
                input_shapes=shapes_for(model_signature(model), shapes), artifacts=artifacts,
                **options))
        except (*BAD_INPUT, AssertionError) as err:
            failures.append(_skip_model(path, err, many))
            continue
        if html_path:
            _write_picture(html_path, artifacts, reports[-1])
    if args.json:
        print(json.dumps([r.to_json() for r in reports], indent=2))
    elif reports:
        print("\n\n".join(reporting.format_report(r, why=args.why) for r in reports))
    return max(failures, default=0)


def _skip_model(path: str, err: BaseException, many: bool) -> int:
    """In a run over several models, one line for a model that cannot be reported (and the
    exit code it earns); a single model's error propagates to ``main`` as before."""
    if not many:
        raise err
    text = _one_line(err)
    if path not in text:
        text = f"{path}: {text}"
    if isinstance(err, AssertionError):
        print(f"tvm-fusion: numerical check failed: {text}", file=sys.stderr)
        return EXIT_INTERNAL
    print(f"tvm-fusion: error: {text}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _write_picture(path: str, artifacts: dict, report) -> None:
    if artifacts.get("plan") is None:
        raise ValueError("--html: stock FuseOps (--strategy tvm) has no plan to draw; "
                         "drop --strategy tvm")
    start = time.perf_counter()
    picture(artifacts["plan"], artifacts["stock_mod"], report.name,
            report.fused_kernels, artifacts.get("layout_blocks", ())).save(path)
    print(f"wrote {path} (drawn in {time.perf_counter() - start:.2f} s)", file=sys.stderr)


def _cmd_zoo(args) -> int:
    if args.input_shape:
        raise ValueError("--input-shape applies to named models, not to --zoo")
    paths = [Path(p) for p in args.models] or zoo_models(args.models_dir)
    reports = zoo_reports(paths, args.target, check=not args.no_check, **_options(args))
    written = write_outputs(reports, args.out)
    print(zoo_markdown(reports))
    print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

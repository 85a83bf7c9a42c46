"""Issue 24's "must show": real dynamic-shape exports import, compile and run.

    python scripts/dynamic_exports.py [--small] [--models bert_base,gpt2_lm,...]
                                      [--exporters dynamo,torchscript,torch_export]
                                      [--out out/dynamic] [--no-timing] [--no-ablation]
                                      [--clock wall|cpu]

For each model (BERT-base, GPT-2 with its LM head, the 2-layer Llama-style decoder, ViT-B/16
with a symbolic batch; ``--small``: their tiny configurations) and each exporter
(``torch.onnx.export(dynamo=True)``, the TorchScript exporter, ``torch.export``):

1. the export (cached under ``--out``; ``tvm_fusion.export_models.export_symbolic``);
2. the import through ``tvm_fusion.frontend`` and the repairs it applied;
3. one build with tvm_fusion and one with stock ``tvm.compile``, each run at two sizes of the
   symbolic dimension (sequence 7 and 200, batch 1 and 3) against PyTorch (and ONNX Runtime
   for ONNX files);
4. kernels: stock FuseOps against tvm_fusion (what ``tvm-fusion report`` prints);
5. at the larger size, tvm_fusion's time on the symbolic module against the same model with
   its sizes fixed before compiling (``relax.transform.BindSymbolicVars``), timed in turns
   in one process (run it pinned, ``TVM_NUM_THREADS=1 taskset -c 1``, on a quiet machine);
6. which repairs the model needed: each left out in turn, what breaks (the import fails, a
   tensor loses its shape, the stock build fails).

Writes ``--out/results.json`` (one entry per model and exporter, appended as each finishes)
and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from tvm_fusion import export_models as zoo  # noqa: E402
from tvm_fusion.bench import CLOCKS, check_clock, medians_in_turns  # noqa: E402
from tvm_fusion.compile import (  # noqa: E402
    compile_model,
    count_kernels,
    fuse,
    import_model,
    load_model,
)
from tvm_fusion.frontend import ALL_FX_REPAIRS, ALL_REPAIRS, ImportReport, TorchProgram  # noqa: E402
from tvm_fusion.instrument import Collector  # noqa: E402
from tvm_fusion.native_log import EVERYTHING, filtered_stderr  # noqa: E402
from tvm_fusion.target import host_target  # noqa: E402

MODELS = ("bert_base", "gpt2_lm", "llama_decoder", "vit_b16")


def _vm(executable):
    return relax.VirtualMachine(executable, tvm.cpu())


def _outputs(value) -> list[np.ndarray]:
    if hasattr(value, "numpy"):
        return [value.numpy()]
    return [o for item in value for o in _outputs(item)]


def _max_err(got, ref) -> float:
    return max(float(np.max(np.abs(g.astype(np.float64) - r.astype(np.float64))))
               for g, r in zip(got, ref, strict=True))


def _shapes_lost(mod) -> list[str]:
    """Tensors without a shape, or with a symbolic size the inputs do not define."""
    main = mod["main"]
    defined = {v.name for p in main.params for v in relax.analysis.tir_vars_in_type(p.ty)}
    lost = []
    for block in main.body.blocks:
        for binding in block.bindings:
            var = binding.var
            if isinstance(binding, relax.MatchCast) or not isinstance(var.ty, relax.TensorType):
                continue
            if var.ty.shape is None:
                lost.append(var.name)
            elif any(v.name not in defined for v in relax.analysis.tir_vars_in_type(var.ty)):
                lost.append(var.name)
    return lost


def _ablation(model, repairs) -> dict:
    """Each repair left out: what breaks ('' when nothing does)."""
    needed = {}
    for repair in sorted(repairs):
        rest = repairs - {repair}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if isinstance(model, TorchProgram):
                    mod = model.import_module(repairs=rest)
                else:
                    from tvm_fusion.frontend import from_onnx
                    mod = from_onnx(model, repairs=rest)
        except Exception as err:  # noqa: BLE001
            needed[repair] = f"import fails ({str(err)[:120]})"
            continue
        lost = _shapes_lost(mod)
        if lost:
            needed[repair] = f"{len(lost)} tensors lose their shape"
            continue
        try:
            with filtered_stderr(noise=EVERYTHING):
                tvm.compile(mod, host_target())
            needed[repair] = ""
        except Exception as err:  # noqa: BLE001
            needed[repair] = f"stock build fails ({str(err).strip().splitlines()[-1][:100]})"
    return needed


def _sizes(spec) -> list[dict]:
    return [{dim: zoo.CHECK_SIZES[dim][i] for _, _, dim in spec.symbolic} for i in range(2)]


def run_case(spec, exporter: str, out: Path, args) -> dict:
    entry: dict = {"model": spec.name, "exporter": exporter, "small": args.small}
    path = zoo.symbolic_path(out, spec, exporter)
    if not path.exists():
        res = zoo.export_symbolic(spec, exporter, out)
        if not res.ok:
            entry["error"] = f"export: {res.error}"
            return entry
    entry["file"] = str(path)
    model = load_model(path)
    report = ImportReport()
    start = time.perf_counter()
    mod = import_model(model, report=report)
    entry["import_s"] = round(time.perf_counter() - start, 2)
    entry["repairs_applied"] = dict(report.repairs)
    entry["shapes_lost"] = len(_shapes_lost(mod))
    target = host_target()

    # PyTorch reference from the spec itself (same seed, same calibration as the export)
    import torch

    torch.manual_seed(zoo.SEED)
    net = zoo.calibrate(spec.build().eval(), spec)
    builds = {}
    for label, build in (("tvm_fusion", lambda: compile_model(mod, target)),
                         ("stock", lambda: compile_model(mod, target, strategy="none"))):
        start = time.perf_counter()
        with filtered_stderr():
            builds[label] = _vm(build())
        entry[f"{label}_build_s"] = round(time.perf_counter() - start, 1)
    entry["checks"] = []
    for i, sizes in enumerate(_sizes(spec)):
        feeds = zoo.random_inputs(spec, zoo.SEED + i, sizes)
        args_np = [feeds[i.name] for i in spec.inputs]  # by position: a program names its own
        expected = zoo._torch_outputs(net, tuple(torch.from_numpy(a) for a in args_np))
        check = {"sizes": sizes}
        for label, vm in builds.items():
            got = _outputs(vm["main"](*[tvm.runtime.tensor(a) for a in args_np]))
            check[f"{label}_vs_pytorch"] = _max_err(got, expected)
        if not isinstance(model, TorchProgram):
            from tvm_fusion.numerics import onnx_reference
            reference = onnx_reference(model, feeds)
            check["tvm_fusion_vs_ort"] = _max_err(_outputs(builds["tvm_fusion"]["main"](
                *[tvm.runtime.tensor(a) for a in args_np])), reference)
        check["scale"] = float(max(np.abs(e).max() for e in expected))
        entry["checks"].append(check)

    with filtered_stderr():
        entry["kernels_stock_fuseops"] = count_kernels(fuse(mod, target, strategy="tvm"))
        collector = Collector()
        with tvm.transform.PassContext(instruments=[collector]):
            entry["kernels_tvm_fusion"] = count_kernels(fuse(mod, target))
        decisions = [d for p in collector.plans[:1] for plan in p.plans.values()
                     for d in getattr(plan, "attention", [])]
        entry["attention_fused"] = sum(d.chosen for d in decisions)
        entry["attention_candidates"] = len(decisions)

    if not args.no_timing:
        sizes = _sizes(spec)[-1]
        binding = {}
        params = mod["main"].params
        order = [i.name for i in spec.inputs]  # by position: a program names its own inputs
        for input_name, axis, dim in spec.symbolic:
            var = params[order.index(input_name)].ty.shape[axis]
            if isinstance(var, tvm.tirx.Var):
                binding[var] = sizes[dim]
        static = relax.transform.BindSymbolicVars(binding)(mod)
        with filtered_stderr():
            static_vm = _vm(compile_model(static, target))
        feeds = zoo.random_inputs(spec, zoo.SEED, sizes)
        inputs = [tvm.runtime.tensor(feeds[i.name]) for i in spec.inputs]
        calls = {"symbolic": lambda: builds["tvm_fusion"]["main"](*inputs),
                 "static": lambda: static_vm["main"](*inputs)}
        medians = medians_in_turns(calls, warmup=2, repeat=args.repeat, turn_s=0.5,
                                   clock=CLOCKS[args.clock])
        entry["time_ms"] = {k: round(v, 3) for k, v in medians.items()}
        entry["symbolic_over_static"] = round(medians["symbolic"] / medians["static"], 3)

    if not args.no_ablation:
        entry["needed"] = _ablation(model, ALL_FX_REPAIRS if isinstance(model, TorchProgram)
                                    else ALL_REPAIRS)
    return entry


def to_markdown(entries: list[dict]) -> str:
    lines = ["| model | exporter | repairs applied | needed (left out: what breaks) | "
             "kernels stock -> tvm_fusion | max err vs PyTorch (tvm_fusion / stock) | "
             "attention blocks | symbolic / static |", "|" + "---|" * 8]
    for e in entries:
        if "error" in e:
            lines.append(f"| {e['model']} | {e['exporter']} | {e['error']} |||||")
            continue
        applied = ", ".join(f"{k} {v}" for k, v in sorted(e["repairs_applied"].items())) or "—"
        needed = "; ".join(f"{k}: {v}" for k, v in sorted(e.get("needed", {}).items()) if v)
        errs = " ; ".join(f"{c['tvm_fusion_vs_pytorch']:.1e} / {c['stock_vs_pytorch']:.1e}"
                          for c in e["checks"])
        ratio = e.get("symbolic_over_static", "—")
        attention = f"{e.get('attention_fused', '?')} of {e.get('attention_candidates', '?')}"
        lines.append(f"| {e['model']} | {e['exporter']} | {applied} | {needed or 'none'} | "
                     f"{e['kernels_stock_fuseops']} -> {e['kernels_tvm_fusion']} | {errs} | "
                     f"{attention} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the tiny configurations")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--exporters", default=",".join(zoo.SYMBOLIC_EXPORTERS))
    parser.add_argument("--out", default="out/dynamic")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="cpu: each call's thread CPU time (TVM_NUM_THREADS=1; a busy "
                             "neighbour does not inflate it)")
    parser.add_argument("--no-ablation", action="store_true")
    args = parser.parse_args(argv)
    try:
        check_clock(args.clock)
    except ValueError as err:
        parser.error(str(err))
    out = Path(args.out) / ("small" if args.small else "full")
    registry = zoo.SMALL if args.small else zoo.MODELS
    results = out / "results.json"
    entries = json.loads(results.read_text()) if results.exists() else []
    done = {(e["model"], e["exporter"]) for e in entries if "error" not in e}
    for name in args.models.split(","):
        for exporter in args.exporters.split(","):
            if (name, exporter) in done:
                continue
            print(f"== {name} / {exporter}", flush=True)
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    entry = run_case(registry[name], exporter, out, args)
            except Exception as err:  # noqa: BLE001 (one case failing is a result too)
                entry = {"model": name, "exporter": exporter,
                         "error": f"{type(err).__name__}: {str(err).strip()[:300]}"}
            print(json.dumps(entry), flush=True)
            entries = [e for e in entries if (e["model"], e["exporter"]) != (name, exporter)]
            entries.append(entry)
            out.mkdir(parents=True, exist_ok=True)
            results.write_text(json.dumps(entries, indent=1) + "\n")
    print(to_markdown(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main())

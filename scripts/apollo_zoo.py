"""Apollo vs DNNFusion vs stock TVM on the model zoo: kernel counts, numerics, CPU latency.

    python scripts/apollo_zoo.py --out out/apollo                 # kernel table, every model
    python scripts/apollo_zoo.py --check bert_base,tinybert       # + numerics vs ONNX Runtime
    python scripts/apollo_zoo.py --latency tinybert,mobilenet_v2  # + CPU latency, one run

Writes ``apollo.md`` (paste under "## Apollo" in docs/benchmarks.md) and ``apollo.json``.
Kernel counts are after FuseTIR (``count_kernels``); the anchor bound is DNNFusion's
(Many-to-Many plus Opaque operators of the model as imported). Feedback events, if any, are
listed per model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import tvm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tvm_fusion.bench import median_ms  # noqa: E402
from tvm_fusion.compile import (  # noqa: E402
    compile_model,
    count_kernels,
    fuse,
    graph_input_names,
    import_onnx,
    load_onnx,
    run,
)
from tvm_fusion.feeds import random_inputs  # noqa: E402
from tvm_fusion.instrument import Collector  # noqa: E402
from tvm_fusion.numerics import onnx_reference  # noqa: E402
from tvm_fusion.relay_passes.plan_fusion import plan_module  # noqa: E402
from tvm_fusion.threads import use_physical_cores  # noqa: E402
from tvm_fusion.transform import legalize_passes  # noqa: E402

TARGET = tvm.target.Target("llvm")
APOLLO = {"apollo_blocklist": "memory"}


def kernels(path: Path) -> dict:
    model = load_onnx(path)
    mod = import_onnx(model)
    with TARGET:
        bound = plan_module(tvm.transform.Sequential(legalize_passes(TARGET))(mod)).anchor_bound
    row = {"model": path.stem, "anchor_bound": bound}
    row["tvm"] = count_kernels(fuse(mod, TARGET, strategy="tvm"))
    row["dnnfusion"] = count_kernels(fuse(mod, TARGET, strategy="dnnfusion", schedule=False))
    collector = Collector()
    start = time.perf_counter()
    with tvm.transform.PassContext(instruments=[collector]):
        out = fuse(mod, TARGET, strategy="apollo", **APOLLO)  # scheduled: feedback
    row["apollo_build_s"] = round(time.perf_counter() - start, 1)
    row["apollo"] = count_kernels(out)
    plan = collector.plans[-1]
    row["apollo_layer3_packs"] = sum(d["fused"] for p in plan.plans.values() for d in p.parallel)
    row["feedback"] = [e.describe() for e in plan.feedback]
    for layers in (1, 2):
        row[f"apollo_L{layers}"] = count_kernels(fuse(
            mod, TARGET, strategy="apollo", schedule=False, apollo_layers=layers, **APOLLO))
    return row


def check(path: Path) -> float:
    model = load_onnx(path)
    mod = import_onnx(model)
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[n] for n in graph_input_names(model)]
    ours = run(compile_model(mod, TARGET, strategy="apollo", **APOLLO), inputs)
    ref = onnx_reference(model, feeds)
    return max(float(abs(a - b).max()) for a, b in zip(ours, ref))


def latency(path: Path, repeat: int, warmup: int) -> dict:
    model = load_onnx(path)
    mod = import_onnx(model)
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[n] for n in graph_input_names(model)]
    row = {"model": path.stem}
    for name, kwargs in (("tvm", {"strategy": "tvm"}), ("dnnfusion", {"strategy": "dnnfusion"}),
                         ("apollo", {"strategy": "apollo", **APOLLO})):
        vm = tvm.relax.VirtualMachine(compile_model(mod, TARGET, **kwargs), tvm.cpu())
        args = [tvm.runtime.tensor(x, tvm.cpu()) for x in inputs]
        row[name] = round(median_ms(lambda: vm["main"](*args), warmup, repeat), 2)  # noqa: B023
    return row


def markdown(rows: list[dict], checks: dict, lat: list[dict]) -> str:
    lines = ["| model | stock TVM | dnnfusion | apollo L1 | apollo L1+L2 | apollo L1+L2+L3 | "
             "anchor bound | L3 packs | apollo build (s) | max abs err vs ORT |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = checks.get(r["model"])
        lines.append(f"| {r['model']} | {r['tvm']} | {r['dnnfusion']} | {r['apollo_L1']} | "
                     f"{r['apollo_L2']} | {r['apollo']} | {r['anchor_bound']} | "
                     f"{r['apollo_layer3_packs']} | {r['apollo_build_s']} | "
                     f"{'—' if err is None else f'{err:.1e}'} |")
    events = [(r["model"], e) for r in rows for e in r["feedback"]]
    lines.append("")
    lines.append("Feedback events: " + ("none" if not events else ""))
    for model, e in events:
        lines.append(f"- {model}: {e}")
    if lat:
        lines += ["", "| model | stock TVM (ms) | dnnfusion (ms) | apollo (ms) |",
                  "|---|---|---|---|"]
        for r in lat:
            lines.append(f"| {r['model']} | {r['tvm']} | {r['dnnfusion']} | {r['apollo']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    use_physical_cores()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=str(ROOT / "models"))
    ap.add_argument("--only", default="", help="comma-separated model names (default: all)")
    ap.add_argument("--check", default="", help="models to check against ONNX Runtime")
    ap.add_argument("--latency", default="", help="models to time on the CPU")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default="out/apollo")
    args = ap.parse_args()
    paths = sorted(Path(args.models).glob("*.onnx"))
    if args.only:
        keep = set(args.only.split(","))
        paths = [p for p in paths if p.stem in keep]
    rows = []
    for p in paths:
        rows.append(kernels(p))
        print(json.dumps(rows[-1]), flush=True)
    checks = {}
    for name in filter(None, args.check.split(",")):
        checks[name] = check(Path(args.models) / f"{name}.onnx")
        print(name, "max abs err vs ORT", checks[name], flush=True)
    lat = []
    for name in filter(None, args.latency.split(",")):
        lat.append(latency(Path(args.models) / f"{name}.onnx", args.repeat, args.warmup))
        print(json.dumps(lat[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "apollo.md").write_text(markdown(rows, checks, lat))
    (out / "apollo.json").write_text(json.dumps({"kernels": rows, "errors": checks,
                                                 "latency_ms": lat}, indent=2) + "\n")
    print(markdown(rows, checks, lat))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The fusion report: what stock TVM and tvm_fusion make of one model, and why.

Per model: operators, kernels after stock FuseOps, kernels after tvm_fusion, the anchor bound
(Many-to-Many plus Opaque operators: the fewest kernels when each holds one of them),
intermediate-result bytes before and after, every fusion block with its mapping types, the
typed reason every rejected pair was rejected for, and the numerical check against the stock
build and the ONNX reference.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import onnx
import tvm

from .compile import (
    ModelError,
    compile_model,
    count_kernels,
    default_sizes,
    fuse,
    graph_input_names,
    import_model,
    model_nodes,
    model_signature,
    reference_outputs,
    run,
)
from .devices import require_device
from .feeds import random_inputs, run_shapes
from .instrument import Collector
from .layout.int8_conv import NOTES_ATTR as INT8_NOTES
from .memory import planned_memory
from .numerics import check_outputs, max_abs_error
from .relay_passes.plan_fusion import ModulePlan
from .relay_passes.rejection import describe
from .symbolic import symbolic_hints
from .target import to_target
from .transform import Sequential


@dataclass
class BlockRow:
    kernel: int
    mapping_type: str
    operators: list[str]
    kind: str = ""  # "attention" for a planned attention block


@dataclass
class ModelReport:
    name: str
    onnx_nodes: int
    operators: int  # operators after legalisation (ECG nodes)
    compute_intensive: int  # CIL: operators that reuse input elements (conv, matmul)
    memory_intensive: int  # MIL: every other operator
    stock_kernels: int
    fused_kernels: int
    anchor_bound: int
    irs_bytes_before: int
    irs_bytes_after: int
    planning_seconds: float
    flops_before_rewrite: int | None = None  # high-level FLOPs, DNNFusion §4.2
    flops_after_rewrite: int | None = None
    rules_fired: dict = field(default_factory=dict)
    rewrite_symbolic_skipped: int = 0  # operators rewriting left alone: a symbolic shape
    blocks: list[BlockRow] = field(default_factory=list)
    rejections: list[dict] = field(default_factory=list)  # first, second, reason, detail
    yellow: list[dict] = field(default_factory=list)
    opaque: list[str] = field(default_factory=list)
    feedback: list[str] = field(default_factory=list)  # strategy="apollo": scheduler feedback
    guard: list[str] = field(default_factory=list)  # kernels the fusion guard split, and why
    conv_chains: list[dict] = field(default_factory=list)  # OptiFX candidates (conv_chains=…)
    attention: list[dict] = field(default_factory=list)  # attention candidates (attention=…)
    max_error_vs_stock: float | None = None
    max_error_vs_onnx: float | None = None
    # outputs that differ from ONNX Runtime the way stock TVM's do (ties in TopK/ArgMax indices,
    # fp16 accumulation order): tvm_fusion agrees with stock TVM there, so the check passes
    check_notes: list[str] = field(default_factory=list)
    run_shapes: dict = field(default_factory=dict)  # symbolic dims/inputs: the sizes checked
    # what the model came as: "ONNX" (nodes: ONNX nodes; reference: ONNX Runtime) or
    # "torch.export" (nodes: FX operators; reference: PyTorch)
    source: str = "ONNX"
    # activation memory of a run (tvm_fusion.memory: planned storage + run-time allocations +
    # the largest kernel workspace), stock FuseOps' grouping and tvm_fusion's, same schedules
    activation_bytes_stock: int | None = None
    activation_bytes_fused: int | None = None
    # QDQ convs (layout/int8_conv.py): each one's integer kernel, or why it keeps float32 sums
    int8_convs: list[str] = field(default_factory=list)

    @property
    def fusion_rate(self) -> float:
        return self.operators / max(self.fused_kernels, 1)

    def to_json(self) -> dict:
        data = asdict(self)
        data["fusion_rate"] = round(self.fusion_rate, 3)
        return data


def make_report(model: onnx.ModelProto, name: str = "model", target="llvm", check: bool = True,
                seed: int = 0, input_shapes: dict | None = None, artifacts: dict | None = None,
                **options) -> ModelReport:
    """Plan, compile and (optionally) check one ONNX model (or a torch.export program,
    :func:`tvm_fusion.compile.load_model`, checked against PyTorch).

    A model with symbolic dimensions is planned and compiled once, symbolic; the check runs it
    at ``input_shapes`` (graph input -> shape, or ``dim_param`` -> size; the rest at the sizes
    the cost model assumes, :func:`tvm_fusion.feeds.run_shapes`).

    ``artifacts``, a dict, receives what the report was made from (``plan``: the ModulePlan
    or None, ``stock_mod``: stock FuseOps' module), so a picture can show the same plan."""
    if check:  # before minutes of building: the check runs the model on the target's device
        require_device(target, "the check runs the model: pass check=False (--no-check) to "
                               "plan and compile without running")
    mod = import_model(model, node_names=True)  # the picture names operators by ONNX node
    stock_mod = fuse(mod, target, strategy="tvm")
    collector = Collector()
    with tvm.transform.PassContext(instruments=[collector]):
        fused_mod = fuse(mod, target, **options)
    record, rewrites = collector.plans, collector.rewrite_stats
    # "Before fusion" is the model as imported: no rewriting, no layout elimination (which
    # pre-fuses), so operators, CIL/MIL, the anchor bound and IRS-before are the model's own.
    original = _plan_only(mod, target, options.get("symbolic_hint"))
    module_plan = record[0] if record else original
    if artifacts is not None:
        artifacts.update(plan=record[0] if record else None, stock_mod=stock_mod,
                         layout_blocks=list(collector.layout_blocks))
    nodes = [n for p in original.plans.values() for n in p.ecg.nodes]

    report = ModelReport(
        name=name,
        onnx_nodes=model_nodes(model),
        source="ONNX" if model_signature(model) is model else "torch.export",
        operators=original.num_operators,
        compute_intensive=sum(n.compute_intensive for n in nodes),
        memory_intensive=sum(not n.compute_intensive for n in nodes),
        stock_kernels=count_kernels(stock_mod),
        fused_kernels=count_kernels(fused_mod),
        anchor_bound=original.anchor_bound,
        irs_bytes_before=sum(p.ecg.irs_bytes_unfused() for p in original.plans.values()),
        irs_bytes_after=sum(p.ecg.irs_bytes_fused(p.groups()) for p in module_plan.plans.values()),
        planning_seconds=round(module_plan.seconds, 4),
    )
    with symbolic_hints(options.get("symbolic_hint")):
        report.activation_bytes_stock = planned_memory(stock_mod, target, repack=False).total
        report.activation_bytes_fused = planned_memory(fused_mod, target).total
    if rewrites:
        report.flops_before_rewrite = int(rewrites[0].flops_before)
        report.flops_after_rewrite = int(rewrites[0].flops_after)
        report.rules_fired = dict(rewrites[0].fired)
        report.rewrite_symbolic_skipped = int(getattr(rewrites[0], "symbolic_skipped", 0))
    report.int8_convs = [str(n) for n in (fused_mod.attrs or {}).get(INT8_NOTES, [])]
    report.feedback = [e.describe() for e in getattr(module_plan, "feedback", [])]
    report.guard = [d.describe() for d in getattr(module_plan, "guard", [])]
    kernel = 0
    for plan in module_plan.plans.values():
        kernel_of = {}
        for block in plan.blocks:
            nodes = [plan.ecg.nodes[i] for i in block.members]
            report.blocks.append(BlockRow(kernel, block.mapping_type.short,
                                          [f"{n.op_name}[{n.mapping_type.short}]" for n in nodes],
                                          block.kind))
            kernel_of.update({i: kernel for i in block.members})
            kernel += 1
        report.attention += [_attention_row(plan.ecg, d, kernel_of)
                             for d in getattr(plan, "attention", [])]
        report.rejections += [{"first": r.first, "second": r.second, "reason": r.reason.value,
                               "detail": r.detail} for r in plan.rejections]
        report.yellow += [{"first": y.first, "second": y.second, "fuse": y.decision.fuse,
                           "decided_by": y.decision.source, "detail": y.decision.detail}
                          for y in plan.yellow]
        report.opaque += [f"{n.op_name}: {n.reason}" for n in plan.ecg.nodes if not n.fusible]
        report.conv_chains += [_chain_row(plan.ecg, d) for d in getattr(plan, "conv_chains", [])]

    signature = model_signature(model)
    with symbolic_hints(default_sizes(model)), symbolic_hints(options.get("symbolic_hint")):
        shapes = run_shapes(signature, input_shapes)  # validated even when nothing runs
    if check:
        report.run_shapes = {k: list(v) if isinstance(v, tuple) else v
                             for k, v in shapes.items()}
        feeds = random_inputs(signature, seed=seed, shape_overrides=shapes)
        order = graph_input_names(signature)
        inputs = [feeds[k] for k in order]
        ours = run(compile_model(mod, target, **options), inputs)
        try:  # stock TVM 0.27 fails on some models tvm_fusion builds (fp16 batch norm)
            stock = run(compile_model(mod, target, strategy="tvm"), inputs)
        except Exception as err:  # noqa: BLE001 (TVM raises several types)
            stock = None
            report.check_notes.append(
                f"stock TVM does not build the model ({_first_line(err)}): checked against "
                f"{'PyTorch' if signature is not model else 'ONNX Runtime'} only")
        try:
            reference = reference_outputs(model, feeds)
        except Exception as err:  # noqa: BLE001 (ONNX Runtime raises its own untyped errors)
            which = "PyTorch" if signature is not model else "ONNX Runtime"
            raise ModelError(f"{name}: the reference ({which}) cannot run the model "
                             f"({_first_line(err)}); --no-check skips the check") from None
        if stock is not None:
            report.max_error_vs_stock = max_abs_error(ours, stock)
        report.max_error_vs_onnx = max_abs_error(ours, reference)
        report.check_notes += check_outputs(ours, stock, reference)
    return report


def _nodes_word(report: ModelReport) -> str:
    return "FX operators" if report.source == "torch.export" else "ONNX nodes"


def _reference_word(report: ModelReport) -> str:
    return "pytorch" if report.source == "torch.export" else "onnx"


def _plan_only(mod, target, symbolic_hint=None) -> ModulePlan:
    tgt = to_target(target)
    collector = Collector()
    with tgt, tvm.transform.PassContext(instruments=[collector]):
        # the model's own operators: QDQ convs as convs, not the integer kernels
        Sequential(tgt, rewrite=False, layout=False, integer_qdq_convs=False,
                   symbolic_hint=symbolic_hint)(mod)
    return collector.plans[0]


def format_report(report: ModelReport, why: bool = False) -> str:
    """Human-readable text of a report; ``why`` adds every rejected pair and yellow decision."""
    lines = [
        f"model {report.name}: {report.onnx_nodes} {_nodes_word(report)}, "
        f"{report.operators} operators "
        f"({report.compute_intensive} compute-, {report.memory_intensive} memory-intensive)",
        f"  kernels: stock TVM {report.stock_kernels}, tvm_fusion {report.fused_kernels} "
        f"(anchor bound {report.anchor_bound}; fusion rate {report.fusion_rate:.2f})",
        f"  intermediate results: {_mb(report.irs_bytes_before)} before, "
        f"{_mb(report.irs_bytes_after)} after fusion",
        f"  planning: {report.planning_seconds:.3f} s",
    ]
    if report.activation_bytes_fused is not None:
        lines.insert(3, f"  activation memory (planned storage + largest kernel workspace): "
                        f"stock TVM {_mb(report.activation_bytes_stock)}, tvm_fusion "
                        f"{_mb(report.activation_bytes_fused)}")
    if report.flops_before_rewrite is not None:
        fired = ", ".join(f"{k} {v}" for k, v in sorted(report.rules_fired.items())) or "none"
        lines.append(f"  rewriting: {report.flops_before_rewrite / 1e9:.4f} -> "
                     f"{report.flops_after_rewrite / 1e9:.4f} GFLOPs; rules fired: {fired}"
                     + (f"; {report.rewrite_symbolic_skipped} operators with symbolic shapes "
                        f"not rewritten" if report.rewrite_symbolic_skipped else ""))
    if report.run_shapes:
        sizes = ", ".join(f"{k}={v}" if isinstance(v, int) else f"{k}=[{','.join(map(str, v))}]"
                          for k, v in report.run_shapes.items())
        lines.append(f"  input shapes: compiled once for every size; run and checked at {sizes}")
    if report.max_error_vs_onnx is not None:
        vs_stock = ("n/a" if report.max_error_vs_stock is None
                    else f"{report.max_error_vs_stock:.3g}")
        lines.append(f"  numerics: max |tvm_fusion - stock| = {vs_stock}, "
                     f"max |tvm_fusion - {_reference_word(report)}| = "
                     f"{report.max_error_vs_onnx:.3g}")
        lines += [f"    {note}" for note in report.check_notes]
    lines.append("  fusion blocks:")
    for block in report.blocks:
        lines.append(f"    #{block.kernel:<3d} {block.mapping_type:7s} "
                     + (f"[{block.kind}] " if block.kind else "")
                     + " -> ".join(block.operators))
    if report.attention:
        fused = [a for a in report.attention if a["chosen"]]
        saved = sum(a["score_bytes"] for a in fused)
        lines.append(f"  attention (online softmax): {len(fused)} of {len(report.attention)} "
                     f"candidates fused, {_mb(saved)} of scores never written")
        for a in report.attention if why else fused:
            where = f"kernel #{a['kernel']}" if a["kernel"] is not None else "not fused"
            lines.append(f"    {' -> '.join(a['operators'])}: {where}, {a['operators_in_block']} "
                         f"operators, scores {'x'.join(map(str, a['score_shape']))} "
                         f"({_mb(a['score_bytes'])})"
                         + ("" if a["chosen"] else
                            f"; not fused: {describe(a['rejected'], a['reason'])}"))
    if report.int8_convs:
        integer = [n for n in report.int8_convs if ": integer sums" in n]
        lines.append(f"  QDQ convs: {len(integer)} of {len(report.int8_convs)} with integer "
                     "sums" + (", the rest float32:" if len(integer) < len(report.int8_convs)
                               else ""))
        lines += [f"    {n}" for n in report.int8_convs if why or n not in integer]
    if report.opaque:
        lines.append("  opaque (never fused): " + "; ".join(report.opaque))
    if report.feedback:
        lines.append("  scheduler feedback (Apollo):")
        lines += [f"    {event}" for event in report.feedback]
    if report.guard:
        lines.append("  fusion guard (kernels estimated slower fused than apart):")
        lines += [f"    {decision}" for decision in report.guard]
    chosen = [c for c in report.conv_chains if c["chosen"]]
    if report.conv_chains:
        lines.append(f"  conv chains (OptiFX): {len(chosen)} of {len(report.conv_chains)} "
                     f"candidates fused")
        for c in report.conv_chains if why else chosen:
            lines.append(f"    {' -> '.join(c['operators'])} [{c['shape']}]: tile "
                         f"{c['tile'][0]}x{c['tile'][1]}, halo {c['halo'][0]}x{c['halo'][1]}, "
                         f"redundant {c['redundant_flops'] / 1e6:.2f} MFLOP, "
                         f"{_mb(c['bytes_saved'])} saved, "
                         f"{'measured' if c.get('measured') else 'modelled'} "
                         f"{c['modelled_speedup']:.2f}x"
                         + ("" if c["chosen"] else
                            f"; not fused: {describe(c['rejected'], c['reason'])}"))
    if why:
        groups = group_rejections(report.rejections)
        lines.append(f"  rejected pairs: {len(report.rejections)}, in {len(groups)} patterns "
                     "(count, producer -> consumer kind: [reason] detail; JSON lists every pair)")
        for (first, second, reason), count in groups.items():
            lines.append(f"    {count:3d}x {first} -> {second}: {reason}")
        lines.append("  yellow (fuse_depend) decisions:")
        for y in report.yellow:
            verdict = "fused" if y["fuse"] else "kept apart"
            lines.append(f"    {y['first']} -> {y['second']}: {verdict} ({y['decided_by']}: "
                         f"{y['detail']})")
    return "\n".join(lines)


def group_rejections(rejections: list[dict]) -> dict[tuple[str, str, str], int]:
    """Rejected pairs by pattern (producer kind, consumer kind, ``[reason] detail``) with their
    counts, in order of first appearance: a transformer's layers repeat the same rejection per
    layer, which as one line each buried the few distinct reasons (BERT-base: 159 lines)."""
    counts: dict[tuple[str, str, str], int] = {}
    for r in rejections:
        key = (operator_kind(r["first"]), operator_kind(r["second"]),
               describe(r["reason"], r["detail"]))
        counts[key] = counts.get(key, 0) + 1
    return counts


def operator_kind(described: str) -> str:
    """``lv23=fused_matmul4_add5[M2M]`` → ``fused_matmul_add[M2M]``: the operator without its
    Relax variable and the numbers TVM appends to repeated PrimFunc names (``conv2d`` kept)."""
    name = described.split("=", 1)[1] if "=" in described else described
    return re.sub(r"(?<=[a-z])\d+(?=_|\[|$)", "", name)


def _attention_row(ecg, decision, kernel_of: dict) -> dict:
    """One attention candidate for the report: its anchors, its kernel, the score bytes the
    fused kernel never writes (every score-sized intermediate of the unfused operators)."""
    cand = decision.candidate
    return {"operators": [ecg.nodes[i].op_name for i in (cand.qk, cand.softmax, cand.pv)],
            "chosen": decision.chosen,
            "kernel": kernel_of.get(cand.pv) if decision.chosen else None,
            "operators_in_block": len(cand.members), "score_shape": list(cand.score_shape),
            "score_bytes": int(cand.score_bytes) if decision.chosen else 0,
            "score_bytes_unfused": int(cand.score_bytes),
            "rejected": decision.rejected.value if decision.rejected else None,
            "reason": decision.reason}


def _chain_row(ecg, decision) -> dict:
    """One OptiFX candidate for the report: its halo, redundant FLOPs (T_red), bytes saved."""
    sc = decision.score
    return {"operators": [ecg.nodes[i].op_name for i in decision.candidate.rops],
            "shape": decision.candidate.shape, "chosen": decision.chosen,
            "rejected": decision.rejected.value if decision.rejected else None,
            "reason": decision.reason, "tile": list(sc.tile), "halo": list(sc.halo),
            "redundant_flops": sc.redundant_flops, "bytes_saved": sc.bytes_saved,
            "modelled_speedup": round(sc.ratio, 3),
            # timed fused vs as planned (profiling database); else the roofline's estimate
            "measured": sc.rule.startswith("measured")}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.3f} MB"


__all__ = ["ModelReport", "make_report", "format_report", "check_outputs", "group_rejections"]

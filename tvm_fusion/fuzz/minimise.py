"""Delta-debug a failing fuzz case down to what the failure needs.

Greedy reduction to a fixpoint: each step proposes a smaller case and keeps it when the
predicate (normally "the same failure class, and for a crash the same error shape") still
holds. Steps, largest first:

1. keep one graph output, or drop one;
2. *cut* at a value: it becomes a graph input (random values), and every node only it needed
   goes; trying the latest values first removes the most nodes per accepted step;
3. *bypass* a node: its consumers read one of its inputs of the same shape and type instead;
4. drop each non-default option (back to its default) and turn edge-value inputs off;
5. shrink input dims (to 1, or halved) where shape inference still types the whole graph.

The predicate sees every candidate, so a step that turns a real bug into a different one (or
into a stock-TVM failure, class ``skipped``) is simply rejected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import onnx

from .differential import Case, Outcome


def _prune(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop nodes no output needs, then unused inputs and initializers."""
    g = model.graph
    need = {o.name for o in g.output}
    kept = []
    for node in reversed(list(g.node)):
        if any(o in need for o in node.output):
            kept.append(node)
            need.update(i for i in node.input if i)
    kept.reverse()
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(kept)
    inputs = [vi for vi in g.input if vi.name in need]
    del out.graph.input[:]
    out.graph.input.extend(inputs)
    inits = [t for t in g.initializer if t.name in need]
    del out.graph.initializer[:]
    out.graph.initializer.extend(inits)
    del out.graph.value_info[:]
    return out


#: Function ops whose output ONNX shape inference leaves untyped: output i has input i's type.
_SAME_AS_INPUT = {"GroupNormalization"}


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Static types of every value ONNX shape inference (helped past function ops it does not
    expand) can give."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for _ in range(len(model.graph.node) + 1):
        try:
            inferred = onnx.shape_inference.infer_shapes(probe)
        except Exception:  # noqa: BLE001
            return {}
        found = {vi.name: vi for vi in inferred.graph.value_info}
        found.update({vi.name: vi for vi in inferred.graph.input})
        added = False
        for node in probe.graph.node:
            if node.op_type in _SAME_AS_INPUT and node.output[0] not in found and \
                    node.input[0] in found:
                vi = onnx.ValueInfoProto()
                vi.CopyFrom(found[node.input[0]])
                vi.name = node.output[0]
                probe.graph.value_info.append(vi)
                added = True
        if not added:
            break
    found.update({vi.name: vi for vi in inferred.graph.output})
    return {n: vi for n, vi in found.items() if _static(vi)}


def _static(vi: onnx.ValueInfoProto) -> bool:
    return vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape") and all(
        d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim)


def _with_outputs(model: onnx.ModelProto, outputs: list[onnx.ValueInfoProto]):
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.output[:]
    out.graph.output.extend(outputs)
    return _prune(out)


def _output_steps(model):
    outs = list(model.graph.output)
    if len(outs) < 2:
        return
    for o in outs:
        yield _with_outputs(model, [o])
    for i in range(len(outs)):
        yield _with_outputs(model, outs[:i] + outs[i + 1:])


def _cut_steps(model):
    types = _value_types(model)
    produced = [o for n in model.graph.node for o in n.output if o]
    outputs = {o.name for o in model.graph.output}
    for name in reversed(produced):
        if name not in types or name in outputs:
            continue
        vi = onnx.ValueInfoProto()
        vi.CopyFrom(types[name])
        vi.doc_string = ""
        out = onnx.ModelProto()
        out.CopyFrom(model)
        nodes = [n for n in out.graph.node if name not in n.output]
        del out.graph.node[:]
        out.graph.node.extend(nodes)
        out.graph.input.append(vi)
        yield _prune(out)


def _rename_input(model, old: str, new: str):
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
    for o in out.graph.output:
        if o.name == old:
            o.name = new
    return out


def _bypass_steps(model):
    types = _value_types(model)
    inits = {t.name: t for t in model.graph.initializer}
    inputs = {vi.name: vi for vi in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    for node in reversed(list(model.graph.node)):
        if len(node.output) != 1 or node.output[0] not in types:
            continue
        out_t = types[node.output[0]].type.tensor_type
        for src in node.input:
            if not src or src in inits:
                continue
            vi = types.get(src) or inputs.get(src)
            if vi is None or not _static(vi):
                continue
            t = vi.type.tensor_type
            if t.elem_type != out_t.elem_type or [d.dim_value for d in t.shape.dim] != [
                    d.dim_value for d in out_t.shape.dim]:
                continue
            if src in outputs:  # two graph outputs would share one name
                continue
            cand = _rename_input(model, node.output[0], src)
            cand.graph.node.remove(next(n for n in cand.graph.node if n.output == node.output))
            yield _prune(cand)
            break


def _shrink_steps(model):
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims = vi.type.tensor_type.shape.dim
        for j, d in enumerate(dims):
            if d.dim_value <= 1:
                continue
            for new in sorted({1, d.dim_value // 2}):
                cand = onnx.ModelProto()
                cand.CopyFrom(model)
                target = next(v for v in cand.graph.input if v.name == vi.name)
                target.type.tensor_type.shape.dim[j].dim_value = new
                retyped = _retype_outputs(cand)
                if retyped is not None:
                    yield retyped


def _retype_outputs(model):
    """The model with its output shapes re-inferred after an input shape changed; ``None``
    if the graph no longer types (an initializer's shape no longer fits)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for o in probe.graph.output:
        o.type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=True)
    except Exception:  # noqa: BLE001
        return None
    outs = list(inferred.graph.output)
    if not all(_static(o) for o in outs):
        return None
    del probe.graph.output[:]
    probe.graph.output.extend(outs)
    try:
        onnx.checker.check_model(probe)
    except Exception:  # noqa: BLE001
        return None
    return probe


def _model_steps(model, shrink: bool = True):
    yield from _output_steps(model)
    yield from _cut_steps(model)
    yield from _bypass_steps(model)
    if shrink:
        yield from _shrink_steps(model)


def _case_steps(case: Case):
    # A symbolic case keeps its concrete ``shapes`` (and so its input dims); any other case
    # takes its feeds' shapes from the model, which the shrink step changes.
    for m in _model_steps(case.model, shrink=not case.symbolic):
        yield case.replace(model=m) if case.symbolic else case.replace(model=m, shapes=None)
    for key in list(case.options):
        yield case.replace(options={k: v for k, v in case.options.items() if k != key})
    if case.special:
        yield case.replace(special=False)


def size(case: Case) -> tuple[int, int, int, int]:
    """What minimisation decreases: nodes, options, edge values on, total input elements."""
    elems = sum(math.prod(d.dim_value for d in vi.type.tensor_type.shape.dim)
                for vi in case.model.graph.input)
    return (len(case.model.graph.node), len(case.options), int(case.special), elems)


def minimise(case: Case, predicate: Callable[[Case], bool], budget_s: float = 180.0,
             max_checks: int = 300) -> tuple[Case, int]:
    """The smallest case found for which ``predicate`` holds, and the number of checks run.

    ``predicate(case)`` must hold for the input case (it is not re-checked). A candidate is
    only tried when it is smaller (:func:`size`), so the loop ends.
    """
    deadline = time.monotonic() + budget_s
    checks = 0
    progress = True
    while progress:
        progress = False
        for cand in _case_steps(case):
            if checks >= max_checks or time.monotonic() > deadline:
                return case, checks
            if size(cand) >= size(case):
                continue
            try:
                onnx.checker.check_model(cand.model)
            except Exception:  # noqa: BLE001 - an invalid candidate is just not smaller
                continue
            checks += 1
            if predicate(cand):
                case, progress = cand, True
                break
    return case, checks


def same_failure(check: Callable[[Case], Outcome], outcome: Outcome) -> Callable[[Case], bool]:
    """A predicate: ``check`` classifies a candidate with ``outcome``'s signature."""
    signature = outcome.signature()
    return lambda cand: check(cand).signature() == signature

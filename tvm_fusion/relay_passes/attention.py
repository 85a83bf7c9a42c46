"""Attention planned as one block: ``Q·Kᵀ`` → score arithmetic → softmax → ``·V``.

DNNFusion's Table 3 makes Many-to-Many → Many-to-Many red, so attention stays three kernels or
more (``Q·Kᵀ``, softmax, ``·V``) with every score matrix written to memory and read back: at a
sequence of 2,048, 32 heads of float32 scores are 512 MB per layer. FlashAttention's online
softmax computes the same result tile by tile without that matrix, so this one M2M → M2M → M2M
chain is fused, overriding the red cells for exactly these operators, as OptiFX overrides them
for conv chains.

The pattern is found from mapping types and the TIR of the legalised operators, never from
names (``tir_schedules/attention_match.py`` reads the TIR):

* a Many-to-Many operator that is a contraction whose row operand is reduced along its last
  axis (``P·V``); its row operand comes from
* a softmax over the last axis (a max and a sum reduction, ``exp(x - max) / sum``), through at
  most float-to-float casts (fp16 models soften in fp32); its input comes from
* a chain of One-to-One and Reorganize/Shuffle operators of the score's size (scale, additive
  or boolean masks, ``Where``, biases, the reshapes of Swin's shifted-window mask) from
* a contraction of the score's size whose row operand is Q and column operand K (``Q·Kᵀ``).

The block also takes what only it reads: the data movement in front of Q, K and V (head split
reshapes and transposes, the ``Split`` of a fused QKV projection, the GQA ``Expand``/``Reshape``
of key/value heads, gathers with constant indices), their element-wise prologues (a scale on Q,
RoPE on Q and K), what computes the masks (``Trilu``, broadcasts, comparisons), and the head
merge after ``·V``.
Everything it takes becomes an index change or a prologue in the template's loads.

A candidate is refused (a typed :class:`~.rejection.RejectReason`) when the scores or
probabilities are read outside (``output_attentions``: they must be materialised anyway), when
an operator of it is opaque, or when fusing would form a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx

from ..tir_schedules.attention_match import (
    NotAttention,
    contraction_roles,
    is_pure_cast,
    is_row_softmax,
    match_attention,
)
from .ecg import ECG
from .fusion_plan import path_reenters
from .grouping import group_bindings
from .mapping_type import MappingType
from .rejection import RejectReason

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_DATA_MOVEMENT = (MappingType.REORGANIZE, MappingType.SHUFFLE, MappingType.ONE_TO_MANY,
                  MappingType.ONE_TO_ONE)

__all__ = ["AttentionCandidate", "AttentionDecision", "find_attention"]


@dataclass(frozen=True)
class AttentionCandidate:
    """One attention: its three anchors and every operator of its block."""

    qk: int
    softmax: int
    pv: int
    members: frozenset[int]
    score_nodes: tuple[int, ...]  # score-sized results the block no longer writes
    score_bytes: int  # their bytes, unfused (symbolic sizes at their representative value)
    score_shape: tuple  # the softmax's shape (batch..., heads, queries, keys)


@dataclass
class AttentionDecision:
    candidate: AttentionCandidate
    chosen: bool
    reason: str
    names: list[str] = field(default_factory=list)  # QK, softmax, PV as the report names them
    rejected: RejectReason | None = None


# ------------------------------------------------------------------------------ recognition


def _func(ecg: ECG, mod: tvm.IRModule, index: int):
    call = ecg.block.bindings[ecg.nodes[index].binding_index].value
    if not isinstance(call, relax.Call) or not call.op.same_as(_CALL_TIR):
        return None
    try:
        func = mod[call.args[0]]
    except Exception:  # noqa: BLE001 (a call of something that is not in the module)
        return None
    return func if isinstance(func, tirx.PrimFunc) else None


def _input_node(ecg: ECG, index: int, position: int) -> int | None:
    """The operator producing the call's input ``position`` (None for a parameter/constant)."""
    call = ecg.block.bindings[ecg.nodes[index].binding_index].value
    args = call.args[1]
    args = list(args.fields) if isinstance(args, relax.Tuple) else [args]
    if position >= len(args) or not isinstance(args[position], relax.Var):
        return None
    return ecg.var_to_node.get(args[position])


def _numel(shape) -> int:
    total = 1
    for d in shape or ():
        total *= d
    return total


class _Facts:
    """Per-operator TIR facts, computed once per PrimFunc name."""

    def __init__(self, ecg: ECG, mod: tvm.IRModule):
        self.ecg, self.mod = ecg, mod
        self._cache: dict = {}

    def _get(self, kind: str, index: int, fn):
        node = self.ecg.nodes[index]
        key = (kind, node.op_name)
        if key not in self._cache:
            func = _func(self.ecg, self.mod, index)
            self._cache[key] = fn(func) if func is not None else None
        return self._cache[key]

    def contraction(self, index: int):
        node = self.ecg.nodes[index]
        if not node.fusible or node.mapping_type is not MappingType.MANY_TO_MANY:
            return None
        return self._get("contraction", index, contraction_roles)

    def softmax(self, index: int) -> bool:
        node = self.ecg.nodes[index]
        if not node.fusible or node.mapping_type is not MappingType.MANY_TO_MANY:
            return False
        return bool(self._get("softmax", index, is_row_softmax))

    def cast(self, index: int) -> bool:
        return bool(self.ecg.nodes[index].fusible and self._get("cast", index, is_pure_cast))


def find_attention(ecg: ECG, mod: tvm.IRModule, where: tuple[str, int] = ("main", 0),
                   cache: dict | None = None) -> list[AttentionDecision]:
    """Every attention of one ECG (the dataflow block ``where`` = (function, block index) of
    ``mod``), each chosen or refused with its reason. A candidate is fused on a trial module
    and handed to the template's matcher: only what the template takes is planned. ``cache``
    keeps those verdicts across blocks (a transformer's layers are one candidate)."""
    facts = _Facts(ecg, mod)
    cache = {} if cache is None else cache
    decisions = []
    taken: set[int] = set()
    for pv in range(len(ecg.nodes)):
        found = _candidate(ecg, facts, pv)
        if found is None:
            continue
        cand, problem = found
        names = [ecg.nodes[n].describe() for n in (cand.qk, cand.softmax, cand.pv)]
        if problem is None and cand.members & taken:
            problem = (RejectReason.ALREADY_FUSED, "shares operators with another attention")
        if problem is None and path_reenters(ecg, set(cand.members), {}, []):
            problem = (RejectReason.CYCLE, "would form a cycle through an operator outside")
        if problem is None:
            key = _shape_key(ecg, cand.members)
            if key not in cache:
                cache[key] = _template_refuses(mod, where, ecg, cand.members)
            if cache[key] is not None:
                problem = (RejectReason.ATTENTION_TEMPLATE,
                           f"the attention template does not take it: {cache[key]}")
        if problem is not None:
            decisions.append(AttentionDecision(cand, False, problem[1], names, problem[0]))
            continue
        taken |= cand.members
        decisions.append(AttentionDecision(
            cand, True, f"fused: online softmax, {_mb(cand.score_bytes)} of scores never "
                        f"written", names))
    return decisions


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.3f} MB"


def _shape_key(ecg: ECG, members) -> tuple:
    """Operators and their wiring inside the block: equal for every layer of a model."""
    order = sorted(members)
    rank = {m: n for n, m in enumerate(order)}
    return tuple((ecg.nodes[m].op_name, tuple(rank.get(p, -1) for p in ecg.nodes[m].preds))
                 for m in order)


def _template_refuses(mod: tvm.IRModule, where: tuple[str, int], ecg: ECG,
                      members) -> str | None:
    """Fuse ``members`` on a module of their function alone (TVM's FuseTIR, as the build will)
    and match the result: None when the attention template takes it, else why not."""
    func_name, block_index = where
    positions = [pos for pos, b in enumerate(ecg.block.bindings)
                 if ecg.var_to_node.get(b.var) in members]
    small = tvm.IRModule({gv: f for gv, f in mod.functions.items()
                          if isinstance(f, tirx.PrimFunc) or gv.name_hint == func_name})
    before = {gv.name_hint for gv in small.functions}

    def groups(name, index, _block):
        return [positions] if (name, index) == (func_name, block_index) else []

    try:
        fused = relax.transform.FuseTIR()(group_bindings(small, groups))
    except Exception as err:  # noqa: BLE001 (TVM raises several types)
        return f"FuseTIR failed ({type(err).__name__})"
    new = [f for gv, f in fused.functions.items()
           if isinstance(f, tirx.PrimFunc) and gv.name_hint not in before]
    if len(new) != 1:
        return "the block did not fuse into one function"
    try:
        match_attention(new[0])
    except NotAttention as err:
        return str(err)
    return None


def _candidate(ecg: ECG, facts: _Facts, pv: int):
    """(candidate, None) or (candidate, (reason, detail)) when ``pv`` ends an attention; None
    when it does not."""
    nodes = ecg.nodes
    roles = facts.contraction(pv)
    if roles is None:
        return None
    casts, p = [], _input_node(ecg, pv, roles.row_input)
    while p is not None and not facts.softmax(p) and len(casts) < _MAX_PROB_STEPS and (
            facts.cast(p) or _batch_view(ecg, p)):
        casts.append(p)
        p = _input_node(ecg, p, 0)
    if p is None or not facts.softmax(p):
        return None
    sm = p
    score_numel = _numel(nodes[sm].out_shapes[0])
    starts = [n for n in nodes[sm].preds
              if nodes[n].out_shapes and _numel(nodes[n].out_shapes[0]) == score_numel]
    if len(starts) != 1:
        return None
    start = starts[0]
    chain, qk = _score_chain(ecg, facts, start, score_numel)
    if qk is None:
        return None
    qk_roles = facts.contraction(qk)
    core = set(chain) | {qk, sm, pv, *casts}
    members = set(core)
    role = {n: "score" for n in chain}
    role.update({qk: "score", sm: "score", pv: "core", **{c: "score" for c in casts}})
    members |= _epilogue(ecg, facts, pv)
    for n in members - core:
        role[n] = "out"
    # operands: the block takes their data movement (and the query's arithmetic)
    for node, position, side in ((qk, qk_roles.row_input, "q"), (qk, qk_roles.col_input, "k"),
                                 (pv, roles.col_input, "v")):
        src = _input_node(ecg, node, position)
        if src is not None and src not in members:
            role.setdefault(src, side)
    _grow_producers(ecg, members, role)
    score_nodes = tuple(sorted(n for n in members if nodes[n].out_shapes
                               and _numel(nodes[n].out_shapes[0]) == score_numel
                               and n != pv))
    cand = AttentionCandidate(
        qk, sm, pv, frozenset(members), score_nodes,
        sum(nodes[n].irs_bytes for n in score_nodes), tuple(nodes[sm].out_shapes[0] or ()))
    escape = _escapes(ecg, core - {pv}, members)
    if escape is not None:
        return cand, (RejectReason.SCORES_ESCAPE,
                      f"{nodes[escape].describe()} is read outside the attention (the scores or "
                      f"probabilities must be written anyway)")
    opaque = [n for n in members if not nodes[n].fusible]
    if opaque:
        return cand, (RejectReason.OPAQUE, f"{nodes[opaque[0]].describe()} is opaque")
    return cand, None


_MAX_PROB_STEPS = 4  # casts and views between the softmax and P·V (bmm: broadcast, reshape)


def _batch_view(ecg: ECG, index: int) -> bool:
    """A data-movement operator that leaves the probabilities' elements and rows alone: a
    broadcast to the same shape or a reshape that keeps the key axis (torch.export's ``bmm``
    puts ``broadcast_to`` and ``(1, heads, s, s) → (heads, s, s)`` between the softmax and
    ``P·V``). The fused TIR is matched exactly: this only lets the walk reach the softmax."""
    node = ecg.nodes[index]
    src = _input_node(ecg, index, 0)
    if (src is None or not node.fusible or node.flops != 0 or len(node.preds) != 1
            or node.mapping_type not in (MappingType.ONE_TO_ONE, MappingType.REORGANIZE)):
        return False
    out, inp = node.out_shapes[0] if node.out_shapes else None, ecg.nodes[src].out_shapes
    inp = inp[0] if inp else None
    return (out is not None and inp is not None and len(out) >= 2 and len(inp) >= 2
            and _numel(out) == _numel(inp) and tuple(out[-1:]) == tuple(inp[-1:]))


def _score_chain(ecg: ECG, facts: _Facts, start: int, score_numel: int):
    """The element-wise/reshape operators of the score's size between ``Q·Kᵀ`` and the
    softmax (``start`` is the softmax's input), and ``Q·Kᵀ``; (…, None) when there is none."""
    nodes = ecg.nodes
    up: set[int] = set()  # score-sized element-wise ancestors of start (start included)
    contractions: set[int] = set()
    todo = [start]
    while todo:
        n = todo.pop()
        if n in up or n in contractions:
            continue
        node = nodes[n]
        if not node.out_shapes or _numel(node.out_shapes[0]) != score_numel:
            continue
        c = facts.contraction(n)
        if c is not None:
            contractions.add(n)
            continue
        if node.mapping_type not in (MappingType.ONE_TO_ONE, MappingType.REORGANIZE,
                                     MappingType.SHUFFLE) or not node.fusible:
            continue
        up.add(n)
        todo.extend(node.preds)
    if len(contractions) != 1:
        return [], None
    qk = next(iter(contractions))
    # the chain: ancestors of start that descend from Q·Kᵀ
    down, todo = set(), [qk]
    while todo:
        n = todo.pop()
        for s in nodes[n].succs:
            if s in up and s not in down:
                down.add(s)
                todo.append(s)
    if start != qk and start not in down:
        return [], None
    return sorted(down), qk


def _epilogue(ecg: ECG, facts: _Facts, pv: int) -> set[int]:
    """Data movement and casts after ``·V`` that only it feeds (the head merge)."""
    nodes, taken, cur = ecg.nodes, set(), pv
    while len(nodes[cur].succs) == 1 and not nodes[cur].is_graph_output:
        nxt = nodes[cur].succs[0]
        node = nodes[nxt]
        moves = node.flops == 0 and node.mapping_type in (MappingType.REORGANIZE,
                                                          MappingType.SHUFFLE)
        if not node.fusible or len(node.preds) != 1 or not (moves or facts.cast(nxt)):
            break
        taken.add(nxt)
        cur = nxt
    return taken


def _grow_producers(ecg: ECG, members: set[int], role: dict) -> None:
    """Add the producers only the block reads, to a fixed point: data movement and
    element-wise arithmetic (never a Many-to-Many operator). The CPU kernel evaluates K- and
    V-side prologues once per head when it packs them (RoPE on K costs a few operations per
    key), Q-side ones once per query block, score-side ones per score."""
    nodes = ecg.nodes
    changed = True
    while changed:
        changed = False
        for m in sorted(members):
            for p in nodes[m].preds:
                if p in members:
                    continue
                node = nodes[p]
                if (not node.fusible or node.is_graph_output
                        or node.mapping_type not in _DATA_MOVEMENT
                        or not all(s in members for s in node.succs)):
                    continue
                # an operand's own side, else the sides of what reads it
                sides = {role[p]} if p in role else {role.get(s, "k") for s in node.succs}
                members.add(p)
                role[p] = "q" if sides == {"q"} else ("score" if "score" in sides else
                                                      sorted(sides)[0])
                changed = True


def _escapes(ecg: ECG, inner: set[int], members: set[int]) -> int | None:
    """An inner operator (scores, probabilities) whose result leaves the block."""
    for n in sorted(inner):
        node = ecg.nodes[n]
        if node.is_graph_output or any(s not in members for s in node.succs):
            return n
    return None

"""Reorder a fused PrimFunc's top-level loop nests so independent element-wise stages come first.

``FuseTIR`` emits stages in the order of the Relax bindings. An attention block may compute the
mask (an output of its own) *after* the scores matmul although the scores' epilogue adds it;
then that epilogue cannot be moved under the matmul's tile loop (it would read the mask before
it is written). Running every stage as early as its inputs allow, spatial stages before
reductions when both are ready, lets the epilogue join the anchor. Only the order of the
root's statements changes, never a statement, and every read-after-write, write-after-read and
write-after-write between stages is kept.
"""

from __future__ import annotations

from tvm import tirx
from tvm.s_tir import SBlock, SBlockRealize

from ..tir_utils import find_all, with_root_body

_ITER_REDUCE = 2


def _accesses(stmt) -> tuple[set[str], set[str], bool]:
    reads, writes, reduction = set(), set(), False
    for block in find_all(stmt, SBlock):
        reads.update(r.source.name for r in block.reads)
        writes.update(w.source.name for w in block.writes)
        reduction |= any(int(iv.iter_type) == _ITER_REDUCE for iv in block.iter_vars)
    return reads, writes, reduction


def hoist_independent_stages(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with its root statements topologically re-sorted (spatial stages first)."""
    realize = func.body
    if not isinstance(realize, SBlockRealize):
        return func
    root = realize.block
    if not isinstance(root.body, tirx.SeqStmt) or len(root.body.seq) < 3:
        return func
    stages = list(root.body.seq)
    info = [_accesses(s) for s in stages]
    deps = {i: set() for i in range(len(stages))}
    for j in range(len(stages)):
        rj, wj, _ = info[j]
        for i in range(j):
            ri, wi, _ = info[i]
            if (wi & rj) or (ri & wj) or (wi & wj):
                deps[j].add(i)
    order, placed = [], set()
    while len(order) < len(stages):
        ready = [i for i in range(len(stages)) if i not in placed and deps[i] <= placed]
        pick = min(ready, key=lambda i: (info[i][2], i))
        order.append(pick)
        placed.add(pick)
    if order == list(range(len(stages))):
        return func
    return with_root_body(func, tirx.SeqStmt([stages[i] for i in order]))

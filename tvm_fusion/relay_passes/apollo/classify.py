"""Apollo's operator types (§3.3, Definitions 1-4), read from each operator's access functions.

See :mod:`.apollo` for how they are used; never classified by operator name.
"""

from __future__ import annotations

from tvm import tirx

from ...tir_utils import buffer_loads, find_all, iter_sblocks
from ..ecg import ECGNode
from ..mapping_type import MappingType, analyze_primfunc

EW, BC, RED, TRANSPOSE, RESHAPE = "elementwise", "broadcast", "reduction", "transpose", "reshape"
MATMUL, CONV, OTHER, INELIGIBLE = "matmul", "conv", "other", "ineligible"
COMPUTE_BOUND = (MATMUL, CONV)


# ------------------------------------------------------------------------- classification

def apollo_type(node: ECGNode, func: tirx.PrimFunc | None) -> str:
    """The Apollo operator type of one ECG node (Definitions 1-4 plus the named opaque kinds)."""
    if not node.fusible or node.mapping_type is MappingType.OPAQUE:
        return INELIGIBLE
    mt = node.mapping_type
    if mt is MappingType.MANY_TO_MANY:
        if func is None or not _has_reduction(func):
            return OTHER  # a stencil or scan without a reduction iterator: "general"
        window = _reads_window(func)
        if _is_fma(func):  # matmul/conv: FMA + reduction (§2.4), whatever its intensity
            return CONV if window else MATMUL
        return OTHER if window else RED  # pooling: a window is a "general" relation
    if mt is MappingType.SHUFFLE:
        return TRANSPOSE
    if mt is MappingType.REORGANIZE:
        return RESHAPE
    if mt is MappingType.ONE_TO_MANY and not _broadcast_only(node, func):
        return OTHER  # gather, resize: a general relation
    return BC if _has_injective_read(node, func) else EW


def _has_reduction(func: tirx.PrimFunc) -> bool:
    return any(any(int(iv.iter_type) == 2 for iv in blk.iter_vars) for blk in iter_sblocks(func))


def _is_fma(func: tirx.PrimFunc) -> bool:
    """A reduction block accumulating a product of loads from two *different* sets of buffers
    (``A[i, k] * B[k, j]``, data × weight); ``(x - m) * (x - m)`` (a variance) is not one."""
    for blk in iter_sblocks(func):
        if not any(int(iv.iter_type) == 2 for iv in blk.iter_vars):
            continue
        for mul in find_all(blk.body, tirx.Mul):
            left = {str(ld.source.name) for ld in buffer_loads(mul.a)}
            right = {str(ld.source.name) for ld in buffer_loads(mul.b)}
            if left and right and left != right:
                return True
    return False


def _reads_window(func: tirx.PrimFunc) -> bool:
    """A conv reads ``x[.., h*s + kh, ..]`` with a window wider than the stride (``kh``'s extent
    > ``s``), so neighbouring outputs share inputs. A matmul whose operand layout was folded
    into its index (``a[.., h*32 + k]``, extent of ``k`` = 32) tiles without overlap: not a
    conv. A 1x1 conv is a matmul here, which is what it computes."""
    for blk in iter_sblocks(func):
        reduce = {iv.var.name: _extent(iv) for iv in blk.iter_vars if int(iv.iter_type) == 2}
        spatial = {iv.var.name for iv in blk.iter_vars if int(iv.iter_type) != 2}
        if not reduce:
            continue
        for load in buffer_loads(blk.body):
            for index in load.indices:
                if not isinstance(index, tirx.Add):
                    continue
                terms = [_term(index.a), _term(index.b)]
                if None in terms:
                    continue
                (va, ca), (vb, cb) = terms
                for (sv, sc), (rv, _) in (((va, ca), (vb, cb)), ((vb, cb), (va, ca))):
                    if sv in spatial and rv in reduce and (reduce[rv] or 0) > sc:
                        return True
    return False


def _extent(iv) -> int | None:
    ext = iv.dom.extent
    return int(ext) if isinstance(ext, tirx.IntImm) else None


def _term(expr) -> tuple[str, int] | None:
    """``v`` or ``v * c`` (either order) as ``(name, c)``."""
    if isinstance(expr, tirx.Var):
        return expr.name, 1
    if isinstance(expr, tirx.Mul):
        a, b = expr.a, expr.b
        if isinstance(a, tirx.Var) and isinstance(b, tirx.IntImm):
            return a.name, int(b)
        if isinstance(b, tirx.Var) and isinstance(a, tirx.IntImm):
            return b.name, int(a)
    return None


def _uses_iter(expr, names: set[str]) -> bool:
    return any(v.name in names for v in find_all(expr, tirx.Var))


def _reads(func: tirx.PrimFunc | None):
    if func is None:
        return []
    return [r for b in analyze_primfunc(func).blocks for r in b.reads]


def _broadcast_only(node: ECGNode, func) -> bool:
    reads = [r for r in _reads(func) if r.kind is MappingType.ONE_TO_MANY]
    return bool(reads) and all(r.broadcast for r in reads)


def _has_injective_read(node: ECGNode, func) -> bool:
    """Def. 2: an input relation is injective when it lacks an output iterator; scalar inputs
    "can be discarded"."""
    for r in _reads(func):
        if r.kind is MappingType.ONE_TO_MANY and r.broadcast and (r.numel or 0) > 1:
            return True
    return False

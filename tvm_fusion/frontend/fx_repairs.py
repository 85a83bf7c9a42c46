"""Converters for FX (ATen) operators that TVM 0.27's ExportedProgram importer lacks or gets
wrong; each names the TVM behaviour it works around. A converter is ``fn(importer, node)`` and
returns the node's Relax value, or None where it does not apply (TVM's converter runs then)."""

from __future__ import annotations

from collections.abc import Callable

from tvm import relax

__all__ = ["ALL_FX_REPAIRS", "CONVERTERS", "REPAIRS"]

CONVERTERS: dict[str, Callable] = {}

# views, and expands, that keep their input's shape are the identity: skipped to reach a bmm's
# operands (TVM returns a view's input itself; an expand is a broadcast_to copy)
_IDENTITIES = ("view.default", "reshape.default", "_unsafe_view.default", "expand.default")


def _converter(*targets: str, repair: str):
    def register(fn):
        fn.repair = repair
        for target in targets:
            CONVERTERS[target] = fn
        return fn
    return register


@_converter("bmm.default", repair="unexpanded_weight")
def bmm_of_an_expanded_matrix(importer, node):
    """``bmm(a, expand(w, (B, K, N)))`` of a matrix ``w`` as ``matmul(a, w)``.

    torch's decomposition of ``linear``/``matmul`` on a 3-D input it cannot flatten (ViT's
    attention in-projection, on the sequence-first ``(197, batch, 768)`` of
    ``nn.MultiheadAttention``) expands the weight to ``(197, 768, 2304)`` for a ``bmm``. TVM
    imports that as ``broadcast_to`` of the weight, which is constant after its parameters are
    bound, and ``FoldConstant`` (stock's and tvm_fusion's) materialises it: 1.4 GB for each of
    ViT-B/16's 12 layers (the build died out of memory), and a batched GEMM whose weight is
    read from 197 copies. Relax's ``matmul`` broadcasts a 2-D operand itself; the unused
    ``broadcast_to`` left behind is removed after the import (``from_exported_program``), and
    so is the input's own expand to its unchanged shape (a copy)."""
    lhs, rhs = _through_identities(node.args[0]), _through_identities(node.args[1])
    if getattr(rhs, "target", None) is None or _name(rhs) != "expand.default":
        return None
    matrix = rhs.args[0]
    shape = _shape(matrix)
    expanded = _shape(rhs)
    if shape is None or expanded is None or len(expanded) != 3:
        return None
    if not (len(shape) == 2 or (len(shape) == 3 and shape[0] == "1")):
        return None
    if shape[-2:] != expanded[-2:]:
        return None
    dtype = str(node.meta["val"].dtype).replace("torch.", "")
    return importer.block_builder.emit(
        relax.op.matmul(importer.env[lhs], importer.env[matrix], out_dtype=dtype))


def _through_identities(arg):
    """``arg``, or the input of the views and expands of unchanged shape ending at it."""
    while getattr(arg, "target", None) is not None and _name(arg) in _IDENTITIES and (
            _shape(arg) is not None and _shape(arg) == _shape(arg.args[0])):
        arg = arg.args[0]
    return arg


def _name(node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _shape(node) -> tuple[str, ...] | None:
    """torch's shape of an FX node's value, each size as text (``"197"``, ``"s77"``): compared
    as text, symbolic sizes do not ask torch's shape environment for a guard."""
    val = getattr(node, "meta", {}).get("val")
    return None if getattr(val, "shape", None) is None else tuple(str(d) for d in val.shape)


REPAIRS = frozenset(fn.repair for fn in CONVERTERS.values())
# every repair of the ExportedProgram import; "pin_shapes" is torch's shapes pinned (fx_import)
ALL_FX_REPAIRS = frozenset({"pin_shapes", *REPAIRS})

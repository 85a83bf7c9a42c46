"""Constant masks read back as index expressions, so that the attention template skips their tiles.

With a static sequence length ``FoldConstant`` folds a causal mask (transformers'
``full(min).triu(1)``) into a constant tensor: the fused attention then reads it as data, and
:func:`~.attention.mask_regions` finds no index condition to skip tiles by. This module looks at
the constants a fused PrimFunc is called with (:func:`constant_arguments`, from the Relax
calls) and, where the score function reads one that is exactly a causal pattern —
``M[i, j] = a`` for ``j > i + o`` and ``b`` elsewhere, bit for bit, broadcast over the batch
axes — replaces the load by ``Select(j > i + o, a, b)`` (:func:`inline_causal_masks`). The
result is the same value at every point, so the numerics are unchanged; the kernel's signature
is kept (the constant is still passed, and no longer read). Anything else (random values, a
band the pattern does not describe, a constant shared by calls with different values) stays
data.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.expr import GenericConst, TensorLoad

from ..tir_utils import buffer_loads
from .attention_match import AttentionPattern

__all__ = ["agreed_value", "causal_offset", "constant_arguments", "inline_causal_masks"]


def constant_arguments(mod: tvm.IRModule) -> dict:
    """``{PrimFunc name: {argument position: [constant, ...]}}``: the arguments that are
    a constant at every ``call_tir`` of that PrimFunc in the module's Relax functions (one per
    call; read lazily by :func:`agreed_value`, so that weights are never copied here)."""
    seen: dict = {}

    def visit(call):
        if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
                and call.op.name == "relax.call_tir" and isinstance(call.args[0], tvm.ir.GlobalVar)
                and isinstance(call.args[1], relax.Tuple)):
            return
        name = call.args[0].name_hint
        args = list(call.args[1].fields)
        if name not in seen:
            seen[name] = {n: [a] for n, a in enumerate(args) if isinstance(a, GenericConst)}
            return
        kept = seen[name]
        for n in list(kept):
            if n < len(args) and isinstance(args[n], GenericConst):
                kept[n].append(args[n])
            else:
                del kept[n]

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return {name: consts for name, consts in seen.items() if consts}


def agreed_value(constants: list) -> np.ndarray | None:
    """The value every call passes (bit for bit), or None when two calls differ."""
    first = constants[0].value.numpy()
    for other in constants[1:]:
        if other.same_as(constants[0]):
            continue
        value = other.value.numpy()
        if value.dtype != first.dtype or value.shape != first.shape or (
                value.tobytes() != first.tobytes()):
            return None
    return first


def causal_offset(mask: np.ndarray) -> tuple[int, object, object] | None:
    """``(o, a, b)`` when the 2-D ``mask`` is exactly ``where(j > i + o, a, b)`` with ``a != b``
    (compared bit for bit: ``-0.0``, NaN and infinities are values like any other), else None."""
    if mask.ndim != 2 or 0 in mask.shape:
        return None
    rows, cols = mask.shape
    bits = _bits(mask)
    a, b = bits[0, cols - 1], bits[rows - 1, 0]
    if a == b:
        return None
    # row i keeps min(max(i + o + 1, 0), cols) leading b's: read o off a row that has both
    leading = np.where((bits != b).any(axis=1), np.argmax(bits != b, axis=1), cols)
    partial = np.nonzero((leading > 0) & (leading < cols))[0]
    row = int(partial[0]) if partial.size else 0
    o = int(leading[row]) - 1 - row
    i = np.arange(rows)[:, None]
    j = np.arange(cols)[None, :]
    expected = np.where(j > i + o, a, b)
    if not np.array_equal(expected, bits):
        return None
    return o, mask[0, cols - 1], mask[rows - 1, 0]


def _bits(mask: np.ndarray) -> np.ndarray:
    """An integer view with the same bits (bool as uint8)."""
    if mask.dtype == np.bool_:
        return mask.view(np.uint8)
    return mask.view(np.dtype(f"u{mask.dtype.itemsize}"))


def inline_causal_masks(pattern: AttentionPattern, constants: dict) -> tuple[object, list]:
    """The score function with every load of a causal constant replaced by its index
    expression, and one note per mask replaced. ``constants`` maps positions of
    ``pattern.func``'s parameters to their constant values."""
    params = list(pattern.func.params)
    score, notes = pattern.score, []
    for pos, consts in sorted(constants.items()):
        if pos >= len(params):
            continue
        buf = params[pos]
        loads = [ld for ld in buffer_loads(score) if ld.source.same_as(buf)]
        if not loads:
            continue
        value = agreed_value(consts)
        plane = _plane(loads, value, pattern) if value is not None else None
        found = causal_offset(plane) if plane is not None else None
        if found is None:
            continue
        o, a, b = found
        cond = tirx.GT(pattern.j, pattern.i + tirx.const(o, str(pattern.i.ty)))
        dtype = str(loads[0].ty)
        if dtype == "bool":
            expr = cond if bool(a) else tirx.Not(cond)
        else:
            expr = tirx.Select(cond, tirx.const(a.item(), dtype), tirx.const(b.item(), dtype))

        def replace(ld, buf=buf, expr=expr):
            return expr if ld.source.same_as(buf) else ld

        score = tvm_ffi.structural_map(score, [(TensorLoad, replace)])
        notes.append(f"constant mask {buf.name} read as causal: {a.item()} where "
                     f"j > i + {o}, else {b.item()}")
    return score, notes


def _plane(loads: list, value: np.ndarray, pattern: AttentionPattern) -> np.ndarray | None:
    """The mask as a (rows × keys) array when every load indexes it by ``i``, ``j``, a batch
    axis the constant does not vary along, or a constant index; else None."""
    first = loads[0]
    for ld in loads[1:]:
        if len(ld.indices) != len(first.indices) or not all(
                bool(tvm_ffi.structural_equal(x, y)) for x, y in zip(ld.indices, first.indices)):
            return None
    rows, keys = pattern.sq, pattern.sk
    if not isinstance(rows, tirx.IntImm) or not isinstance(keys, tirx.IntImm):
        return None
    if value.ndim != len(first.indices):
        return None
    take, axes = [], {}
    for axis, ix in enumerate(first.indices):
        if isinstance(ix, tirx.IntImm):
            take.append(int(ix.value))
        elif isinstance(ix, tvm.ir.Var) and any(ix.same_as(v) for v in pattern.batch):
            # broadcast over this batch axis: the same plane at every index
            if not (_bits(value) == _bits(value.take([0], axis=axis))).all():
                return None
            take.append(0)
        elif isinstance(ix, tvm.ir.Var) and ix.same_as(pattern.i):
            axes["i"] = axis
            take.append(slice(None))
        elif isinstance(ix, tvm.ir.Var) and ix.same_as(pattern.j):
            axes["j"] = axis
            take.append(slice(None))
        else:
            return None
    if set(axes) != {"i", "j"}:
        return None
    plane = value[tuple(take)]
    if axes["i"] > axes["j"]:
        plane = plane.T
    if plane.shape != (int(rows.value), int(keys.value)):
        return None
    return plane

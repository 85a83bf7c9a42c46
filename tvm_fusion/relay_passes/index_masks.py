"""A mask computed from indices alone, read by several operators, is recomputed for each.

A decoder exported with a symbolic sequence length computes its causal mask once, outside the
layers, from ``Range``, comparisons, ``And``, ``Where`` on the sequence length
(``torch.onnx.export(dynamo=True)`` of transformers' Llama and GPT-2), and every layer's
attention adds that one tensor. An operator read by several consumers is never taken into one
consumer's block, so each fused attention reads the mask as data and cannot skip its masked
tiles: the symbolic build paid 1.21× the static one on the dynamo Llama (whose
``FoldConstant`` folds the mask, which the attention template reads back as ``j > i``).

This pass gives each reader its own copy of such a computation, so that the attention planner
takes it into the block (``attention.py``: producers only the block reads) and the template
sees the mask as an index expression (``j <= i``), as in a model that computes the mask inside
each layer. Only *index computations* are copied: ``call_tir`` of spatial PrimFuncs (no
reduction) whose only floating-point operations are casts and selections (``Where`` between
constants), reading constants, shapes and other index computations, never a parameter of the
function. A copy costs one element-wise pass over the mask where it is not absorbed; float
arithmetic (RoPE's ``cos``/``sin`` tables, also computed from positions) is not copied, since
recomputing it inside every attention costs more than reading it.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ..tir_utils import find_all, is_reduction_block, iter_sblocks

__all__ = ["RecomputeIndexMasks", "is_index_computation"]

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_FLOAT_OPS = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.FloorDiv, tirx.FloorMod, tirx.Mod,
              tirx.Min, tirx.Max)


def _is_float(dtype) -> bool:
    return str(dtype).startswith(("float", "bfloat"))


def is_index_computation(func: tirx.PrimFunc) -> bool:
    """A PrimFunc without reductions whose floating-point values are only loaded, cast and
    selected (no float arithmetic, no math calls): a function of indices and constants."""
    if any(is_reduction_block(b) for b in iter_sblocks(func)):
        return False
    for node in find_all(func.body, _FLOAT_OPS + (tvm.ir.Call,)):
        if not _is_float(node.ty):
            continue
        op = getattr(node, "op", None)
        if not (isinstance(op, tvm.ir.Op) and op.name.rsplit(".", 1)[-1] == "if_then_else"):
            return False
    return True


def RecomputeIndexMasks() -> tvm.transform.Pass:  # noqa: N802 (a pass constructor)
    """Every index computation read by several operators that are not index computations
    themselves is copied for each of those readers (the original is dropped when nothing else
    reads it)."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.RecomputeIndexMasks")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out, changed = mod.clone(), False  # a pass leaves the module it was given as it was
        for gvar, func in mod.functions.items():
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                new = _recompute(mod, func)
                if new is not None:
                    out[gvar], changed = new, True
        if not changed:
            return out
        return relax.transform.DeadCodeElimination()(relax.transform.Normalize()(out))

    return _pass


def _substitute(expr, mapping: dict):
    """``expr`` with the variables of ``mapping`` replaced (calls, tuples and leaves)."""
    if isinstance(expr, relax.Var):
        return mapping.get(expr, expr)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([_substitute(f, mapping) for f in expr.fields])
    if isinstance(expr, relax.Call):
        return relax.Call(expr.op, [_substitute(a, mapping) for a in expr.args], expr.attrs,
                          expr.ty_args)
    return expr


def _index_vars(mod: tvm.IRModule, func: relax.Function, block) -> set:
    """The variables of ``block`` bound to index computations."""
    found: set = set()
    data = set(func.params)  # values that may depend on data (symbolic sizes are not)
    for b in func.body.blocks:
        data.update(x.var for x in b.bindings)
    for binding in block.bindings:
        value = binding.value
        if not (isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call)):
            continue
        if any(v in data and v not in found for v in relax.analysis.free_vars(value)):
            continue  # reads a parameter, or a value computed from data
        if value.op.same_as(_CALL_TIR):
            if len(value.args) != 2 or not isinstance(value.args[0], tvm.ir.GlobalVar):
                continue  # sizes passed as arguments: opaque to the planner anyway
            callee = mod[value.args[0]]
            if not (isinstance(callee, tirx.PrimFunc) and is_index_computation(callee)):
                continue
        # other calls in a dataflow block are pure operators on shapes (shape_of,
        # shape_to_tensor), reading only index computations, constants and shapes
        found.add(binding.var)
    return found


def _recompute(mod: tvm.IRModule, func: relax.Function) -> relax.Function | None:
    blocks, changed = [], False
    for block in func.body.blocks:
        if not isinstance(block, relax.DataflowBlock):
            blocks.append(block)
            continue
        index = _index_vars(mod, func, block)
        producer = {b.var: b for b in block.bindings if b.var in index}
        readers: dict = {}  # index var -> the other bindings that read it, in order
        for binding in block.bindings:
            if binding.var in index:
                continue
            for v in relax.analysis.free_vars(binding.value):
                if v in index and isinstance(v, relax.DataflowVar):
                    readers.setdefault(v, []).append(binding.var)
        # every reader its own copy (the first too: the original may also feed other index
        # computations, RoPE's positions, which would keep it out of the reader's block)
        shared = {v: rs for v, rs in readers.items() if len(rs) > 1}
        if not shared:
            blocks.append(block)
            continue
        bindings = []
        for binding in block.bindings:
            mapping = {}
            for v in relax.analysis.free_vars(binding.value):
                if binding.var in shared.get(v, ()):
                    mapping[v] = _emit_copy(v, producer, bindings)
            if mapping:
                changed = True
                bindings.append(relax.VarBinding(binding.var,
                                                 _substitute(binding.value, mapping)))
            else:
                bindings.append(binding)
        blocks.append(relax.DataflowBlock(bindings))
    if not changed:
        return None
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty,
                          func.is_pure, func.attrs)


def _emit_copy(var, producer: dict, bindings: list):
    """Append a fresh copy of ``var``'s index computation (and of every index computation it
    reads) to ``bindings``; returns the copy of ``var``."""
    copies: dict = {}

    def copy(v):
        if v in copies or v not in producer:
            return copies.get(v, v)
        value = producer[v].value
        for w in relax.analysis.free_vars(value):
            copy(w)
        new = relax.DataflowVar(f"{v.name}_copy", v.ty)
        bindings.append(relax.VarBinding(new, _substitute(value, copies)))
        copies[v] = new
        return new

    return copy(var)

"""Storage tokens re-packed after TVM's ``StaticPlanBlockMemory``, largest tensors first.

TVM's planner gives each tensor a storage token as the bindings come: the free token closest in
size, else the largest smaller one, *enlarged*. That greedy choice depends on the order of the
kernels. Fusion removes kernels, and with them the moments at which a token was free: in a
ConvNeXt block fused into four kernels (depthwise conv, LayerNorm, the 4x-wide GEMM, the GEMM
with the residual add) the only token free when the wide hidden tensor comes is the one the
depthwise conv's output just left, and the conv took the *small* free token (best fit), so the
hidden tensor enlarges it; block after block every token ends up 4x-wide (ConvNeXt-T: 14.9 MB
where FuseOps' order, with its extra transposes, leaves 11.1 MB and the live tensors never
need more than 7.2 MB).

This pass keeps TVM's tensors and lifetimes and chooses the tokens again, the way offline
planners for static graphs do (TFLite's greedy-by-size): tensors sorted by size, largest first,
each into the first token none of whose tensors is alive at the same time, else a new token of
its size. The new plan replaces TVM's only where it takes fewer bytes, so a function never gets
more storage than TVM's planner gave it.

What it touches, and why that is safe:

* only tensors TVM planned (``R.memory.alloc_tensor`` on an ``R.memory.alloc_storage`` of a
  constant byte size, at offset 0), in functions of straight-line bindings (no ``If``); a token
  holding a tensor of symbolic shape, or a storage used other than by ``alloc_tensor``, keeps
  TVM's assignment;
* lifetimes are conservative: every binding that mentions a tensor (or a value built from one:
  a view, a tuple, an item of it) extends its life to that binding, and a tensor used by the
  function's result lives to the end; a kernel's input and output never share a token;
* tokens are pooled as TVM pools them: per device index, storage scope and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx

from ..module_update import with_functions

__all__ = ["RepackStorage", "repack_function"]

_ALLOC_STORAGE = "relax.memory.alloc_storage"
_ALLOC_TENSOR = "relax.memory.alloc_tensor"


@dataclass(eq=False)
class _Storage:
    var: relax.Var
    call: relax.Call
    size: int
    key: tuple
    tensors: list = field(default_factory=list)  # indices of the planned tensors on it
    fixed: bool = False  # keeps TVM's assignment


@dataclass(eq=False)
class _Tensor:
    var: relax.Var
    index: int  # of its alloc_tensor binding
    size: int
    storage: _Storage
    last_use: int = -1


def _op_name(expr) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def _const(expr) -> int | None:
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


def _shape_bytes(shape: relax.Expr, dtype: str) -> int | None:
    if not isinstance(shape, relax.ShapeExpr):
        return None
    t = tvm.runtime.DataType(dtype)
    size = (t.bits * t.lanes + 7) // 8
    for dim in shape.values:
        value = _const(dim)
        if value is None:
            return None
        size *= value
    return size


def _free_vars(expr) -> list[relax.Var]:
    found = []
    relax.analysis.post_order_visit(
        expr, lambda n: found.append(n) if isinstance(n, relax.Var) else None)
    return found


def _has_control_flow(expr) -> bool:
    hit = []
    relax.analysis.post_order_visit(
        expr, lambda n: hit.append(n) if isinstance(n, relax.If | relax.Function) else None)
    return bool(hit)


def _storage_of(binding: relax.VarBinding) -> _Storage | None:
    call = binding.value
    size_shape, vdev, scope, dtype = call.args
    if (not isinstance(size_shape, relax.ShapeExpr) or len(size_shape.values) != 1
            or _const(size_shape.values[0]) is None):
        return None
    key = (str(vdev), str(scope), str(dtype))
    return _Storage(binding.var, call, _const(size_shape.values[0]), key)


def _greedy_by_size(tensors: list[_Tensor]) -> list[list[_Tensor]]:
    """Tokens (lists of tensors), largest tensors placed first, each into the first token
    where it overlaps no tensor's lifetime."""
    tokens: list[list[_Tensor]] = []
    for t in sorted(tensors, key=lambda t: (-t.size, t.index)):
        for token in tokens:
            if all(t.last_use < o.index or o.last_use < t.index for o in token):
                token.append(t)
                break
        else:
            tokens.append([t])
    return tokens


def repack_function(func: relax.Function) -> relax.Function:
    """``func`` (after ``StaticPlanBlockMemory``) with its planned tensors' storage tokens
    chosen again largest-first, where that takes fewer bytes; otherwise ``func`` itself."""
    body = func.body
    if not isinstance(body, relax.SeqExpr) or _has_control_flow(body):
        return func
    bindings = [b for block in body.blocks for b in block.bindings]
    if not all(isinstance(b, relax.VarBinding) for b in bindings):
        return func
    storages: dict[relax.Var, _Storage] = {}
    tensors: dict[relax.Var, _Tensor] = {}
    roots: dict[relax.Var, set] = {}  # a var -> the planned tensors its value may hold

    def use(var, index):
        for t in roots.get(var, ()):
            t.last_use = max(t.last_use, index)

    for index, binding in enumerate(bindings):
        value, name = binding.value, _op_name(binding.value)
        if name == _ALLOC_STORAGE:
            storage = _storage_of(binding)
            if storage is not None:
                storages[binding.var] = storage
            continue
        if name == _ALLOC_TENSOR:
            storage_var, offset, shape, dtype = value.args[:4]
            storage = storages.get(storage_var)
            if storage is None:
                continue
            size = _shape_bytes(shape, str(dtype.value))
            if size is None or _const(offset) != 0:
                storage.fixed = True
                continue
            tensor = _Tensor(binding.var, index, size, storage, last_use=index)
            storage.tensors.append(tensor)
            tensors[binding.var] = tensor
            roots[binding.var] = {tensor}
            continue
        held: set = set()
        for var in _free_vars(value):
            if var in storages:  # a storage used other than by alloc_tensor
                storages[var].fixed = True
            use(var, index)
            held |= roots.get(var, set())
        if held:
            roots[binding.var] = held
    for var in _free_vars(body.body):
        if var in storages:
            storages[var].fixed = True
        use(var, len(bindings))

    new_storage: dict[relax.Var, relax.Var] = {}  # alloc_tensor var -> its new storage var
    new_calls: dict[relax.Var, relax.Call] = {}  # new storage var -> its alloc_storage
    dropped: set = set()
    pools: dict[tuple, list[_Storage]] = {}
    for storage in storages.values():
        if not storage.fixed and storage.tensors:
            pools.setdefault(storage.key, []).append(storage)
    for pool in pools.values():
        planned = [t for s in pool for t in s.tensors]
        tokens = _greedy_by_size(planned)
        if sum(max(t.size for t in token) for token in tokens) >= sum(s.size for s in pool):
            continue
        template = pool[0].call
        for token in tokens:
            size = max(t.size for t in token)
            var = relax.Var(f"storage_r{len(new_calls)}", pool[0].var.ty)
            new_calls[var] = relax.op.memory.alloc_storage(
                relax.ShapeExpr([tirx.IntImm("int64", size)]), *template.args[1:])
            for t in token:
                new_storage[t.var] = var
        dropped |= {s.var for s in pool}
    if not new_storage:
        return func

    emitted: set = set()
    out = []
    for binding in bindings:
        if binding.var in dropped:
            continue
        if binding.var in new_storage:
            storage_var = new_storage[binding.var]
            if storage_var not in emitted:
                emitted.add(storage_var)
                out.append(relax.VarBinding(storage_var, new_calls[storage_var]))
            call = binding.value
            call = relax.Call(call.op, [storage_var, *call.args[1:]], call.attrs,
                              call.ty_args, call.span)
            out.append(relax.VarBinding(binding.var, call))
            continue
        out.append(binding)
    new_body = relax.SeqExpr([relax.BindingBlock(out)], body.body)
    return relax.Function(func.params, new_body, func.ret_ty, func.is_pure, func.attrs,
                          func.span)


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.RepackStorage")
class RepackStorage:
    """:func:`repack_function` on every Relax function of a module (after
    ``StaticPlanBlockMemory``)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions.items():
            if isinstance(func, relax.Function):
                repacked = repack_function(func)
                if repacked is not func:
                    updates[gvar] = repacked
        return with_functions(mod, updates)

"""A yellow-cell candidate as a standalone sub-graph: its database key, features and modules.

A candidate is a fusion block plus the operator the planner wants to add. To time it, the
candidate's bindings are copied out of the dataflow block into a small Relax ``main`` whose
parameters are the candidate's external inputs and whose results are the values someone outside
the candidate reads; constants stay constants. The same sub-graph is then partitioned two ways:

* ``fused``: every operator in one ``Primitive`` function (one kernel after ``FuseTIR``);
* ``split:<j>``: the block in one kernel and the new operator (local binding ``j``) in another,
  which is what the planner keeps if it says no (DNNFusion §5.3: ``latency(block) +
  latency(new)``; not "every operator apart", which would credit the block's earlier fusions to
  this step).

**The key** is a canonical string, hashed with SHA-256: per binding, the ``tvm_ffi``
structural hash of the called PrimFunc *with its attributes stripped* (so an annotation pass
changes nothing; the TIR itself carries operator kind, attributes and shapes), how each argument
is wired (external input ``i<k>``, local binding ``k<j>``, constant with shape and dtype), the
external inputs' shapes and dtypes, and which bindings are returned. Names never enter the key:
Relax and PrimFunc names differ between models for the same operator. Structural hashes are
stable across processes for one TVM version; the database records the TVM version of each
entry.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.expr import GenericConst

from .. import symbolic
from ..relay_passes.ecg import ECG
from ..relay_passes.grouping import group_bindings

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
FUSED = "fused"


class CandidateError(ValueError):
    """The candidate cannot be built standalone (dynamic shapes, non-tensor inputs, ...)."""


@dataclass
class _BlockIndex:
    """Per dataflow block: who defines and who uses each var (built once per ECG)."""

    bindings: list
    defined_at: dict  # Var -> binding position
    users: dict  # Var -> [binding positions that read it]
    aliases: dict  # binding position -> [positions of TupleGetItem bindings of its var]


def index_block(block: relax.DataflowBlock) -> _BlockIndex:
    """Definitions and uses of every var of ``block``; planning asks many candidates of one
    block, so this is computed once and shared (``free_vars`` is an FFI call)."""
    bindings = list(block.bindings)
    defined_at, users, aliases = {}, {}, {}
    for pos, binding in enumerate(bindings):
        defined_at[binding.var] = pos
        value = binding.value
        for var in relax.analysis.free_vars(value):
            users.setdefault(var, []).append(pos)
        if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
            owner = defined_at.get(value.tuple_value)
            if owner is not None:
                aliases.setdefault(owner, []).append(pos)
    return _BlockIndex(bindings, defined_at, users, aliases)


class PrimFuncHashes:
    """Structural hash of each PrimFunc of a module, attributes stripped, cached by name."""

    def __init__(self, mod: tvm.IRModule):
        self.mod = mod
        self._cache: dict[str, int] = {}

    def __call__(self, gvar: tvm.ir.GlobalVar) -> int:
        name = gvar.name_hint
        if name not in self._cache:
            func = self.mod[gvar]
            bare = tirx.PrimFunc(func.params, func.body, func.ret_type)
            self._cache[name] = int(tvm_ffi.structural_hash(bare))
        return self._cache[name]


@dataclass
class Candidate:
    """``block + [node]`` of one ECG, ready to be keyed, described and built."""

    mod: tvm.IRModule
    ecg: ECG
    block: list[int]  # ECG node indices already in the fusion block
    node: int  # the ECG node the planner wants to add
    producer_first: bool
    positions: list[int]  # binding positions copied (operators and their tuple aliases)
    inputs: list[relax.Var]  # external inputs, in first-use order
    outputs: list[int]  # binding positions whose values leave the candidate
    canonical: str  # the text the key hashes
    hash: str  # SHA-256 of ``canonical`` (hex, 32 chars)
    new_local: int  # local index of the new node's binding (the ``split`` partition)
    shapes: str  # external input shapes, human-readable
    index: _BlockIndex
    _local: dict[int, int] = field(default_factory=dict)  # binding position -> local index
    # a merge of planned blocks (:func:`from_blocks`): the split variant keeps them apart
    split_groups: list[list[int]] | None = None  # local binding indices per kernel

    @property
    def split_variant(self) -> str:
        return "split:blocks" if self.split_groups else f"split:{self.new_local}"

    @property
    def variants(self) -> tuple[str, str]:
        return (FUSED, self.split_variant)

    def describe(self) -> str:
        """Operator names in binding order, the new one marked (for ``db list``)."""
        names = []
        new_pos = self.ecg.nodes[self.node].binding_index
        for pos in self.positions:
            node = self.ecg.var_to_node.get(self.index.bindings[pos].var)
            if node is None or self.ecg.nodes[node].binding_index != pos:
                continue
            text = f"{self.ecg.nodes[node].op_name}[{self.ecg.nodes[node].mapping_type.short}]"
            names.append(f"+{text}" if pos == new_pos else text)
        return " ".join(names)

    # ------------------------------------------------------------------------------ modules

    def standalone(self) -> tvm.IRModule:
        """The sub-graph as a module: ``main`` over the external inputs, no grouping yet."""
        index = self.index
        callees = {}
        for pos in self.positions:
            value = index.bindings[pos].value
            if isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR):
                gvar = value.args[0]
                callees[gvar.name_hint] = (gvar, self.mod[gvar])
        base = tvm.IRModule({gvar: func for gvar, func in callees.values()})
        builder = relax.BlockBuilder(base)
        params = [relax.Var(v.name, v.ty) for v in self.inputs]
        subst = _Substitute(dict(zip(self.inputs, params)))
        with builder.function("main", params):
            with builder.dataflow():
                for pos in self.positions:
                    binding = index.bindings[pos]
                    new_var = builder.emit(subst.visit_expr(binding.value), binding.var.name)
                    subst.var_map[binding.var] = new_var
                results = [subst.var_map[index.bindings[p].var] for p in self.outputs]
                out = builder.emit_output(results[0] if len(results) == 1
                                          else relax.Tuple(results))
            builder.emit_func_output(out)
        return builder.get()

    def variant_module(self, variant: str) -> tvm.IRModule:
        """The standalone module partitioned as ``variant``, after ``FuseTIR``."""
        mod = self.standalone()
        all_local = list(range(len(self.positions)))
        if variant == FUSED:
            groups = [all_local]
        elif variant == self.split_variant and self.split_groups:
            groups = self.split_groups
        elif variant == self.split_variant:
            groups = [[i for i in all_local if i not in self._new_group()]]
        else:
            raise ValueError(f"unknown variant {variant!r} of candidate {self.hash}")
        grouped = group_bindings(mod, lambda _name, _index, _block: groups)
        return relax.transform.FuseTIR()(grouped)

    def _new_group(self) -> set[int]:
        """The new node's binding and its tuple aliases: they form the second kernel."""
        new_pos = self.ecg.nodes[self.node].binding_index
        positions = {new_pos, *self.index.aliases.get(new_pos, [])}
        return {self._local[p] for p in positions if p in self._local}

    def random_inputs(self, seed: int = 0) -> list[np.ndarray]:
        """Inputs of the right shapes and dtypes. Integers are zeros: an index input (gather,
        take) must stay in bounds, and zero is in bounds for every non-empty axis."""
        rng = np.random.default_rng(seed)
        arrays = []
        for var in self.inputs:
            shape, dtype = _static_tensor(var)
            try:
                np.dtype(dtype)
            except TypeError:
                raise CandidateError(f"input {var.name}: numpy has no dtype {dtype}") from None
            if dtype.startswith("float"):
                arrays.append(rng.standard_normal(shape).astype(dtype))
            else:
                arrays.append(np.zeros(shape, dtype=dtype))
        return arrays

    # ----------------------------------------------------------------------------- features

    def features(self, variant: str, target: tvm.target.Target | None = None) -> dict:
        """Numbers describing ``variant`` for the latency model (stored with every entry)."""
        nodes = [self.ecg.nodes[i] for i in [*self.block, self.node]]
        members = {n.index for n in nodes}
        feats: dict[str, float] = {
            "n_ops": len(nodes),
            "n_kernels": 1 if variant == FUSED else len(self.split_groups or [[], []]),
            "producer_first": float(self.producer_first),
            "new_type": int(self.ecg.nodes[self.node].mapping_type),
        }
        flops = sum(n.flops for n in nodes)
        out_bytes = sum(n.irs_bytes for n in nodes
                        if n.is_graph_output or any(s not in members for s in n.succs))
        inner_bytes = sum(n.irs_bytes for n in nodes) - out_bytes
        crossing = self._crossing_bytes() if variant != FUSED else 0
        in_bytes = sum(_nbytes(v) for v in self.inputs)
        feats["log_flops"] = math.log1p(flops)
        feats["log_in_bytes"] = math.log1p(in_bytes)
        feats["log_out_bytes"] = math.log1p(out_bytes)
        feats["log_inner_bytes"] = math.log1p(inner_bytes)
        feats["log_crossing_bytes"] = math.log1p(crossing)
        feats["log_max_irs"] = math.log1p(max(n.irs_bytes for n in nodes))
        feats["flops_per_byte"] = flops / max(in_bytes + out_bytes, 1)
        for n in nodes:
            key = f"type:{n.mapping_type.short}"
            feats[key] = feats.get(key, 0) + 1
            kind = f"kind:{op_kind(n.op_name)}"
            feats[kind] = feats.get(kind, 0) + 1
        if target is not None:
            feats[f"target:{target.kind.name}"] = 1
            feats["target_gpu"] = float("gpu" in target.keys)
        return feats

    def _crossing_bytes(self) -> int:
        """Bytes the split variant writes from one kernel and reads in the other."""
        if self.split_groups:
            kernel = {j: k for k, group in enumerate(self.split_groups) for j in group}
            members = {*self.block, self.node}

            def kernel_of(i: int):
                return kernel.get(self._local.get(self.ecg.nodes[i].binding_index))

            return sum(self.ecg.nodes[i].irs_bytes for i in members if any(
                s in members and kernel_of(s) != kernel_of(i) for s in self.ecg.nodes[i].succs))
        new = self.ecg.nodes[self.node]
        if self.producer_first:
            return sum(self.ecg.nodes[p].irs_bytes for p in new.preds if p in self.block)
        return new.irs_bytes


def op_kind(op_name: str) -> str:
    """``add2`` → ``add``: the operator kind of a legalized PrimFunc name."""
    return re.sub(r"\d+$", "", op_name) or op_name


def from_ecg(mod: tvm.IRModule, ecg: ECG, block: list[int], node: int, producer_first: bool,
             index: _BlockIndex | None = None, hashes: PrimFuncHashes | None = None) -> Candidate:
    """Extract ``block + [node]`` of ``ecg`` (a dataflow block of ``mod``) as a candidate."""
    return _extract(mod, ecg, sorted(block), node, producer_first, index, hashes)


def from_blocks(mod: tvm.IRModule, ecg: ECG, groups: list[list[int]],
                index: _BlockIndex | None = None,
                hashes: PrimFuncHashes | None = None) -> Candidate:
    """Merging several planned blocks (``groups`` of ECG nodes) into one kernel, as a
    candidate: ``fused`` is one kernel, ``split:blocks`` the blocks as planned. An OptiFX conv
    chain is one (``conv_chains`` with a profiling database). The key records the partition,
    so it never meets a yellow cell's."""
    members = sorted({m for group in groups for m in group})
    cand = _extract(mod, ecg, members[:-1], members[-1], True, index, hashes)
    kernel_of = {ecg.nodes[m].binding_index: k for k, group in enumerate(groups) for m in group}
    for pos in cand.positions:  # tuple aliases go with the operator they read
        if pos not in kernel_of:
            owner = next(p for p, aliases in cand.index.aliases.items() if pos in aliases)
            kernel_of[pos] = kernel_of[owner]
    cand.split_groups = [[cand._local[p] for p in cand.positions if kernel_of[p] == k]
                         for k in range(len(groups))]
    cand.canonical += ";split:" + "|".join(",".join(map(str, g)) for g in cand.split_groups)
    cand.hash = hashlib.sha256(cand.canonical.encode()).hexdigest()[:32]
    return cand


def _extract(mod, ecg, block, node, producer_first, index, hashes) -> Candidate:
    index = index or index_block(ecg.block)
    hashes = hashes or PrimFuncHashes(mod)
    members = sorted({*block, node})
    op_positions = [ecg.nodes[i].binding_index for i in members]
    positions = sorted({*op_positions, *(a for p in op_positions
                                         for a in index.aliases.get(p, []))})
    local = {pos: j for j, pos in enumerate(positions)}
    inside = set(positions)

    inputs: list[relax.Var] = []
    tokens: list[str] = []
    for pos in positions:
        binding = index.bindings[pos]
        value = binding.value
        if isinstance(value, relax.TupleGetItem):
            src = index.defined_at[value.tuple_value]
            tokens.append(f"k{local[pos]}=k{local[src]}.{value.index}")
            continue
        if not (isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR)):
            raise CandidateError(f"binding {binding.var.name} is not a call_tir")
        refs = [_ref(arg, local, index, inside, inputs) for arg in _tir_args(value)]
        extra = "" if len(value.args) < 3 else f"|{value.args[2]}"
        tokens.append(f"k{local[pos]}=tir:{hashes(value.args[0]):016x}({','.join(refs)}{extra})"
                      f"->{_type_text(binding.var.ty)}")

    outputs = []
    for pos in positions:
        var = index.bindings[pos].var
        leaves = not isinstance(var, relax.DataflowVar)
        used_outside = any(u not in inside for u in index.users.get(var, []))
        if leaves or used_outside:
            outputs.append(pos)
    if not outputs:  # nothing reads it (cannot happen after DCE): keep the last value
        outputs.append(positions[-1])
    input_types = [_type_text(v.ty) for v in inputs]
    for var in inputs:
        _static_tensor(var)
    canonical = ";".join(["in:" + ",".join(input_types), *tokens,
                          "out:" + ",".join(f"k{local[p]}" for p in outputs)])
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:32]
    cand = Candidate(
        mod=mod, ecg=ecg, block=list(block), node=node, producer_first=producer_first,
        positions=positions, inputs=inputs, outputs=outputs, canonical=canonical, hash=digest,
        new_local=local[ecg.nodes[node].binding_index], shapes=" ".join(input_types),
        index=index, _local=local,
    )
    return cand


def _tir_args(call: relax.Call) -> list:
    args = call.args[1]
    return list(args.fields) if isinstance(args, relax.Tuple) else [args]


def _ref(arg, local, index, inside, inputs) -> str:
    if isinstance(arg, GenericConst):
        return f"c{_type_text(arg.ty)}"
    if isinstance(arg, relax.Var):
        pos = index.defined_at.get(arg)
        if pos is not None and pos in inside:
            return f"k{local[pos]}"
        if arg not in inputs:
            inputs.append(arg)
        return f"i{inputs.index(arg)}"
    raise CandidateError(f"unsupported call_tir argument {type(arg).__name__}")


def _type_text(ty) -> str:
    if isinstance(ty, relax.TupleType):
        return "(" + ",".join(_type_text(f) for f in ty.fields) + ")"
    if isinstance(ty, relax.TensorType):
        # a symbolic extent with the size it is measured at (the key of a timing)
        dims = "?" if ty.shape is None else ",".join(
            str(int(d)) if isinstance(d, (int, tirx.IntImm)) else f"{d}={symbolic.extent(d)}"
            for d in ty.shape.values)
        return f"{ty.dtype}[{dims}]"
    return type(ty).__name__


def _static_tensor(var) -> tuple[tuple[int, ...], str]:
    ty = var.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise CandidateError(f"input {var.name} is not a tensor of known shape")
    # symbolic extents at their representative size: the module stays symbolic (the code
    # measured is the code that runs), its inputs are concrete
    return symbolic.concrete_shape(ty.shape.values), str(ty.dtype)


def _nbytes(var) -> int:
    try:
        shape, dtype = _static_tensor(var)
    except CandidateError:
        return 0
    return int(np.prod(shape, dtype=np.int64)) * dtype_bytes(dtype)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element (``bool`` is one byte; ``bfloat16`` is two, which numpy lacks)."""
    bits = "".join(ch for ch in dtype if ch.isdigit())
    return max(int(bits) // 8, 1) if bits else 1


@relax.expr_functor.mutator
class _Substitute(relax.PyExprMutator):
    """Rename the candidate's free vars to the standalone function's parameters."""

    def __init__(self, var_map: dict):
        super().__init__()
        self.var_map = var_map

    def visit_var_(self, var):
        return self.var_map.get(var, var)

    def visit_dataflow_var_(self, var):
        return self.var_map.get(var, var)

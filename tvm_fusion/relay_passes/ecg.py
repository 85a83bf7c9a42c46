"""The Extended Computational Graph (DNNFusion §3.2) of one Relax dataflow block.

One node per operator binding of a legalized dataflow block (a ``call_tir``, or a Relax call left
for the VM or a library, which is Opaque). Each node carries what the planner and the report
need: mapping type (classified at this call site, where we know which arguments are weights),
output shapes and dtypes, intermediate-result (IRS) bytes, FLOPs, predecessors and successors,
and whether its result leaves the block. ``TupleGetItem`` bindings are not operators: they alias
one field of a multi-output node and travel with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx
from tvm.ir.expr import GenericConst
from tvm.s_tir.analysis import estimate_tir_flops

from ..symbolic import concrete_shape, specialize, takes_sizes
from ..tir_utils import shape_numel
from .mapping_type import (
    Classification,
    FuncAccess,
    MappingType,
    analyze_primfunc,
    classify,
    relax_mapping_type,
)

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
CIL_FLOPS_PER_ELEMENT = 8


@dataclass
class ECGNode:
    """One operator of the block."""

    index: int  # position among the block's operators (a topological order)
    binding_index: int  # position among the block's bindings
    var: relax.Var
    op_name: str  # the PrimFunc name, or the Relax op name for opaque calls
    mapping_type: MappingType
    reason: str  # why it has that mapping type
    fusible: bool
    out_shapes: list[tuple[int, ...] | None]  # symbolic extents at a representative size
    out_dtypes: list[str]
    irs_bytes: int  # bytes of the result(s) this operator writes
    flops: int
    weight_inputs: tuple[int, ...]  # positions of the arguments that are weights (constants)
    in_elements: int = 0  # elements of all tensor arguments (for arithmetic intensity)
    preds: list[int] = field(default_factory=list)
    succs: list[int] = field(default_factory=list)
    is_graph_output: bool = False  # its result (or a field of it) leaves the dataflow block
    width_change: int = 0  # +1: its data in a wider type (dequantize), -1: narrower (quantize)

    @property
    def widens(self) -> bool:
        return self.width_change > 0

    @property
    def narrows(self) -> bool:
        return self.width_change < 0

    @property
    def name(self) -> str:
        return self.var.name

    @property
    def compute_intensive(self) -> bool:
        """DNNFusion's CIL: input elements are reused (conv, matmul). We call an operator
        compute-intensive when it does at least ``CIL_FLOPS_PER_ELEMENT`` FLOPs per input element;
        the paper leaves Softmax and pooling ambiguous, and this puts both with the MILs."""
        return self.flops >= CIL_FLOPS_PER_ELEMENT * max(self.in_elements, 1)

    def describe(self) -> str:
        return f"{self.name}={self.op_name}[{self.mapping_type.short}]"


@dataclass
class ECG:
    """The graph; ``nodes`` are in binding (topological) order."""

    nodes: list[ECGNode]
    block: relax.DataflowBlock
    var_to_node: dict[relax.Var, int]  # result vars (and tuple-field aliases) -> node index

    def __len__(self) -> int:
        return len(self.nodes)

    def anchor_bound(self) -> int:
        """Many-to-Many plus Opaque operators: the fewest kernels if each block holds one."""
        return sum(n.mapping_type >= MappingType.MANY_TO_MANY for n in self.nodes)

    def irs_bytes_unfused(self) -> int:
        """Every operator result that is not a graph output is an intermediate result."""
        return sum(n.irs_bytes for n in self.nodes if not n.is_graph_output)

    def irs_bytes_fused(self, blocks: list[list[int]]) -> int:
        """Intermediates that survive a plan: block outputs that are not graph outputs."""
        block_of = {i: b for b, members in enumerate(blocks) for i in members}
        total = 0
        for node in self.nodes:
            if node.is_graph_output:
                continue
            if not self.ir_removable(node.index, block_of):
                total += node.irs_bytes
        return total

    def ir_removable(self, index: int, block_of: dict[int, int]) -> bool:
        """DNNFusion's IR_removable: every consumer is in the producer's block."""
        node = self.nodes[index]
        if node.is_graph_output or index not in block_of:
            return False
        return all(block_of.get(s) == block_of[index] for s in node.succs)


class FuncCache:
    """Analysis and FLOPs per PrimFunc, shared by every call site of a module."""

    def __init__(self, mod: tvm.IRModule):
        self.mod = mod
        self.access: dict[str, FuncAccess] = {}
        self.flops: dict[str, int] = {}

    def get(self, gvar: tvm.ir.GlobalVar, num_outputs: int) -> tuple[FuncAccess, int]:
        name = gvar.name_hint
        if name not in self.access:
            func = self.mod[gvar]
            if not isinstance(func, tirx.PrimFunc):
                self.access[name] = FuncAccess((), 0, f"{name} is not a PrimFunc", fusible=False)
                self.flops[name] = 0
            else:
                self.access[name] = analyze_primfunc(func, num_outputs)
                try:  # symbolic extents counted at their representative size
                    self.flops[name] = int(estimate_tir_flops(
                        tvm.IRModule({"main": specialize(func)})))
                except Exception:  # FLOPs are advisory; opaque code has none we can count
                    self.flops[name] = 0
        return self.access[name], self.flops[name]


def build_ecg(
    mod: tvm.IRModule,
    block: relax.DataflowBlock,
    weight_params: frozenset[str] = frozenset(),
    broadcast_policy: str = "expanding_only",
    cache: FuncCache | None = None,
) -> ECG:
    """Build the ECG of a legalized dataflow block.

    ``weight_params`` names function parameters that hold weights (``num_input`` convention);
    constants in the IR are weights too.
    """
    cache = cache or FuncCache(mod)
    nodes: list[ECGNode] = []
    # Keyed by the Var objects: Relax names are not unique (``lv25`` may be bound twice).
    var_to_node: dict[relax.Var, int] = {}
    outputs_of_block: set[relax.Var] = set()
    bindings = list(block.bindings)

    # Vars bound by non-operator bindings (tuples, aliases) carry the dependencies of what they
    # were built from, so that no edge between operators is hidden behind them.
    carried: dict[relax.Var, set[int]] = {}

    def sources(expr) -> set[int]:
        found: set[int] = set()
        for used in relax.analysis.free_vars(expr):
            if used in var_to_node:
                found.add(var_to_node[used])
            found |= carried.get(used, set())
        return found

    # Symbolic sizes read at run time (``match_cast`` after ``tensor_to_shape``: NMS, a
    # dynamic slice): an operator whose result type uses one depends on the binding that
    # defines it, and cannot share a kernel with the operators that compute it.
    runtime_dims: dict[str, set[int]] = {}

    def dim_sources(ty) -> set[int]:
        found: set[int] = set()
        for tvar in relax.analysis.tir_vars_in_type(ty):
            found |= runtime_dims.get(tvar.name, set())
        return found

    # sizes known before a binding (the function's inputs define them): a match_cast that only
    # restates one (a shape pinned to the exporter's) reads nothing at run time
    known_dims: set[str] = set()
    producer_calls: dict = {}  # var -> the call that computes it
    for pos, binding in enumerate(bindings):
        var, value = binding.var, binding.value
        for used in relax.analysis.free_vars(value):
            known_dims.update(v.name for v in relax.analysis.tir_vars_in_type(used.ty))
        if not isinstance(var, relax.DataflowVar):
            outputs_of_block.add(var)
        if isinstance(binding, relax.MatchCast):
            # a size named by a variable of its own (BindCompoundExtents: ``past + 1``) is
            # known when the value's shape computes it from known sizes
            known_dims.update(_renamed_dims(binding, known_dims))
            for tvar in relax.analysis.definable_tir_vars_in_type(binding.ty):
                if tvar.name not in known_dims:
                    runtime_dims.setdefault(tvar.name, set()).update(sources(value))
            src = var_to_node.get(value)
            if src is not None and nodes[src].fusible:
                # its readers read it through the match_cast binding, which no kernel can
                # contain: grouped with one of them, the producer would need the cast's result
                # before computing it (a cycle between groups). Where CanonicalizeBindings
                # folded such a cast away, _renamed_inputs finds the rename in the kernels
                nodes[src].fusible = False
                nodes[src].reason = "its readers read its result through a match_cast"
        known_dims.update(v.name for v in relax.analysis.tir_vars_in_type(var.ty))
        if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
            owner = var_to_node.get(value.tuple_value)
            if owner is not None:
                var_to_node[var] = owner
                continue
        node = None
        if isinstance(value, relax.Call):
            node = _make_node(len(nodes), pos, var, value, weight_params, broadcast_policy, cache)
        if node is None:
            carried[var] = sources(value)
            continue
        for arg in _renamed_inputs(cache.mod, value, producer_calls):
            # the kernel names an extent (``past + 1``) by a variable of its own
            # (BindCompoundExtents): FuseTIR cannot put it in one kernel with the producer,
            # whose buffer has the compound extent (two shapes for one Relax value)
            src = var_to_node.get(arg)
            if src is not None and nodes[src].fusible:
                nodes[src].fusible = False
                nodes[src].reason = ("a reader names its compound extent by a variable of its "
                                     "own (FuseTIR needs one buffer shape per value)")
        producer_calls[var] = value
        shape_deps = dim_sources(var.ty)
        if shape_deps:
            node.fusible = False
            node.reason = "its result's shape is read at run time (match_cast)"
        for src in sorted(sources(value) | shape_deps):
            node.preds.append(src)
            nodes[src].succs.append(node.index)
        nodes.append(node)
        var_to_node[var] = node.index

    # Results that escape: non-dataflow vars, and any node var used by a non-operator binding
    # (a Tuple, an alias) or by the block's non-dataflow outputs.
    for pos, binding in enumerate(bindings):
        value = binding.value
        var = binding.var
        is_op = isinstance(value, relax.Call) and var in var_to_node and (
            nodes[var_to_node[var]].binding_index == pos
        )
        is_alias = isinstance(value, relax.TupleGetItem) and var in var_to_node
        if var in outputs_of_block and var in var_to_node:
            nodes[var_to_node[var]].is_graph_output = True
        if is_op or is_alias:
            continue
        for used in relax.analysis.free_vars(value):
            if used in var_to_node:
                nodes[var_to_node[used]].is_graph_output = True
    return ECG(nodes, block, var_to_node)


def _renamed_dims(binding: relax.MatchCast, known: set[str]) -> set[str]:
    """Variables the cast binds to a dimension of its value that is an expression of sizes
    already known (a rename of ``past + 1``, not a size read at run time)."""
    ours, theirs = getattr(binding.ty, "shape", None), getattr(binding.value.ty, "shape", None)
    ours, theirs = getattr(ours, "values", ours), getattr(theirs, "values", theirs)
    if ours is None or theirs is None or len(ours) != len(theirs):
        return set()
    return {a.name for a, b in zip(ours, theirs) if isinstance(a, tirx.Var)
            and all(v.name in known for v in tirx.analysis.undefined_vars(b))}


def _renamed_inputs(mod: tvm.IRModule, call: relax.Call, producers: dict) -> list:
    """The tensor arguments of a ``call_tir`` whose producing kernel's result buffer has a
    compound extent (``past + 1``) where this kernel's buffer has a plain variable."""
    func = _prim_func(mod, call)
    if func is None:
        return []
    found = []
    for arg, param in zip(_call_inputs(call), func.params):
        source = _prim_func(mod, producers.get(arg))
        if source is None:
            continue
        mine, theirs = getattr(param.ty, "shape", None), getattr(source.params[-1].ty, "shape",
                                                                 None)
        if mine is None or theirs is None or len(mine) != len(theirs):
            continue
        if any(not isinstance(a, (tvm.ir.Var, tirx.IntImm)) and isinstance(b, tvm.ir.Var)
               for a, b in zip(theirs, mine)):
            found.append(arg)
    return found


def _prim_func(mod: tvm.IRModule, call) -> tirx.PrimFunc | None:
    if not isinstance(call, relax.Call) or not call.op.same_as(_CALL_TIR) or not isinstance(
            call.args[0], tvm.ir.GlobalVar):
        return None
    func = mod[call.args[0]]
    return func if isinstance(func, tirx.PrimFunc) else None


def _make_node(index, pos, var, call, weight_params, policy, cache) -> ECGNode | None:
    out_shapes, out_dtypes = _result_types(var.ty)
    numel_bytes = sum(
        (shape_numel(s) or 0) * _dtype_bytes(dt) for s, dt in zip(out_shapes, out_dtypes)
    )
    args = _call_inputs(call)
    weights = {
        i for i, a in enumerate(args)
        if isinstance(a, GenericConst) or (isinstance(a, relax.Var) and a.name in weight_params)
    }
    if call.op.same_as(_CALL_TIR):
        gvar = call.args[0]
        access, flops = cache.get(gvar, max(len(out_shapes), 1))
        found: Classification = classify(access, frozenset(weights), policy)
        op_name, fusible = gvar.name_hint, access.fusible
    else:
        if not _is_tensor_op(call):
            return None
        found = relax_mapping_type(call)
        op_name = call.op.name if isinstance(call.op, tvm.ir.Op) else str(call.op)
        flops, fusible = 0, False
    fusible = fusible and found.mapping_type is not MappingType.OPAQUE
    reason = found.reason
    if fusible and takes_sizes(call):
        # FuseTIR drops the fused call's result shape when a member takes symbolic sizes as
        # arguments (``call_tir(f, (x, seq))``, a PrimValue): stock FuseOps never fuses one
        fusible = False
        reason = "takes symbolic sizes as arguments (FuseTIR loses the result's shape)"
    arg_types = [_result_types(a.ty) for a in args]
    return ECGNode(
        index=index, binding_index=pos, var=var, op_name=op_name,
        mapping_type=found.mapping_type, reason=reason, fusible=fusible,
        out_shapes=out_shapes, out_dtypes=out_dtypes, irs_bytes=numel_bytes, flops=flops,
        weight_inputs=tuple(sorted(weights)),
        in_elements=sum(shape_numel(s) or 0 for shapes, _ in arg_types for s in shapes
                        if s is not None),
        width_change=_width_change(out_shapes, out_dtypes,
                                   [t for i, t in enumerate(arg_types) if i not in weights]),
    )


def _width_change(out_shapes, out_dtypes, data_types) -> int:
    """+1 when the one result has as many elements as its data inputs of that size, all in
    fewer bytes (a dequantize int8 → float32, a cast up float16 → float32); -1 when they are
    all wider (a quantize); else 0. Fused, a widening operator is best its consumers'
    prologue and a narrowing one its producer's epilogue: the kernels exchange the narrower
    tensor. ``data_types`` holds each data (non-weight) argument's (shapes, dtypes)."""
    if len(out_shapes) != 1 or out_shapes[0] is None:
        return 0
    width, elements = _dtype_bytes(out_dtypes[0]), shape_numel(out_shapes[0]) or 0
    signs = set()
    for shapes, dtypes in data_types:
        if len(shapes) != 1 or shapes[0] is None:
            continue
        size = shape_numel(shapes[0]) or 0
        if size > elements:
            return 0
        if size == elements:
            signs.add((width > _dtype_bytes(dtypes[0])) - (width < _dtype_bytes(dtypes[0])))
    return signs.pop() if len(signs) == 1 and elements > 0 else 0


def _is_tensor_op(call: relax.Call) -> bool:
    """Calls that compute tensors (kernels), as opposed to shape or VM bookkeeping."""
    ty = call.ty
    return isinstance(ty, (relax.TensorType, relax.TupleType)) if ty is not None else False


def _call_inputs(call: relax.Call) -> list:
    if call.op.same_as(_CALL_TIR):
        args = call.args[1]
        return list(args.fields) if isinstance(args, relax.Tuple) else [args]
    flat = []
    for arg in call.args:
        flat.extend(arg.fields if isinstance(arg, relax.Tuple) else [arg])
    return flat


def _result_types(ty) -> tuple[list, list[str]]:
    if isinstance(ty, relax.TupleType):
        shapes, dtypes = [], []
        for field_ty in ty.fields:
            s, d = _result_types(field_ty)
            shapes += s
            dtypes += d
        return shapes, dtypes
    if isinstance(ty, relax.TensorType):
        # symbolic extents (seq, batch) at their representative size: bytes and FLOPs are
        # numbers for the planner; the IR itself stays symbolic
        values = getattr(ty.shape, "values", None) if ty.shape is not None else None
        return [concrete_shape(values)], [str(ty.dtype)]
    return [], []


def _dtype_bytes(dtype: str) -> int:
    if dtype == "bool":
        return 1
    bits = "".join(ch for ch in dtype if ch.isdigit())
    return max(int(bits) // 8, 1) if bits else 4

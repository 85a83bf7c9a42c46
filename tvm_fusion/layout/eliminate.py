"""``EliminateLayoutTransforms``: Fixed operators disappear into their neighbours as index
arithmetic (SmartMem §3.2.1), on legalized Relax, before fusion planning.

Per dataflow block:

1. every ``call_tir`` is classified (:mod:`.classes`); a Fixed operator with one source and one
   block is read as a load map (:mod:`.index_maps`), a Gather's constant index substituted;
2. chains of such operators are composed from their source to each consumer ("eliminate both";
   a Fixed operator with several consumers is pushed into each of them, never materialised) and
   simplified with the analyzer: one *site* per (source, chain, consumer read);
3. each site gets Table 5's action: *eliminate 1st* (the consumer reads the source through the
   composed map) or *eliminate 2nd* (the producer writes the consumer's view). Where both are
   possible the reduction-dimension rule decides (:mod:`.layout_choice`); where neither is (a
   graph input reshaped into a graph output) one copy kernel remains, recorded as such;
4. the site becomes one copy PrimFunc (generated from the simplified map) grouped with the
   neighbour that absorbs it; ``FuseTIR`` merges the group and the copy block is inlined
   (``compute_inline`` into a consumer's loads, ``reverse_compute_inline`` into a spatial
   producer's store; after a reduction it stays the epilogue, which the schedules store from
   the accumulator).

The planner then sees neighbours that already contain the index arithmetic; no Fixed operator
is left as an operator of its own. Every decision is recorded with its reason
(:class:`BlockRecord`, collected by :class:`tvm_fusion.instrument.Collector`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax, s_tir, te, tirx
from tvm.ir.expr import GenericConst

from ..instrument import emit
from ..onnx_names import node_names
from ..relay_passes.grouping import group_bindings, is_primitive
from ..relay_passes.mapping_type import analyze_primfunc, classify, num_primfunc_outputs
from ..symbolic import takes_sizes
from ..tir_utils import is_reduction_block, iter_sblocks
from .classes import Action, LayoutClass, layout_class, pair_decision
from .index_maps import LoadMap, Unsupported, extract_load_map, is_pure_copy
from .layout_choice import SitePreference, choose_views, site_preference
from .metrics import kernel_names

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
COPY_BLOCK = "smartmem_copy"
ELIMINATED_ATTR = "tvm_fusion.smartmem"
COPY_ATTR = "tvm_fusion.copy"


@dataclass
class OpInfo:
    """One ``call_tir`` binding of the block."""

    var: relax.Var
    call: relax.Call
    gvar: tvm.ir.GlobalVar
    args: list
    cls: LayoutClass
    reason: str
    absorbs: bool  # can take index arithmetic of a neighbour (not Opaque, fusible, one output)
    load_map: LoadMap | None  # set when the op is an eliminable Fixed op


@dataclass
class Site:
    """A consumer reading ``source`` through a chain of eliminated Fixed operators."""

    source: relax.Expr
    chain_vars: list[relax.Var]  # the eliminated operators' results, source side first
    load_map: LoadMap  # consumer-input index -> source index, simplified
    consumer: relax.Var | None  # None: the chain's result leaves the block or is not an op arg
    position: int | None  # argument position at the consumer
    result_var: relax.Var  # the last Fixed operator's result (what the consumer used)
    action: Action | None = None
    reason: str = ""
    preference: SitePreference | None = None
    view_key: str = ""
    leave: bool = False  # the chain stays as it is (its consumer is a multi-source Fixed op)

    def describe(self, names: dict) -> str:
        src = names.get(self.source, "const")
        dst = names.get(self.consumer, "block output") if self.consumer is not None else (
            "block output")
        chain = " > ".join(names.get(v, v.name) for v in self.chain_vars)
        return (f"{src} -[{chain}]-> {dst}: {self.action.value}"
                f" ({self.reason}); map {self.load_map.describe()}")


@dataclass(frozen=True)
class RemovedLayoutOp:
    """A Fixed (layout) operator the elimination removed, and where its index map went."""

    op: str  # its PrimFunc (transpose, reshape...)
    onnx: tuple[str, ...]  # the ONNX nodes it came from (tvm_fusion.onnx_names), if known
    into: str  # the operator whose loads (or the producer whose stores) now do its indexing
    into_onnx: tuple[str, ...]
    action: str  # Table 5's cell


@dataclass
class BlockRecord:
    """What the pass did to one dataflow block."""

    function: str
    classes: dict[str, str] = field(default_factory=dict)  # op var name -> class
    sites: list[str] = field(default_factory=list)
    eliminated: int = 0  # Fixed operators removed
    materialised: int = 0  # copies left as kernels of their own
    layout_copies: int = 0  # extra layouts written for consumers beyond the first (k)
    removed: list[RemovedLayoutOp] = field(default_factory=list)  # the eliminated ones


def _removed_ops(ops: dict, sites: list, removed: set) -> list[RemovedLayoutOp]:
    """One entry per eliminated Fixed operator, with the first site that folded it away."""
    out: list[RemovedLayoutOp] = []
    for var in [v for v in ops if v in removed]:  # binding order
        site = next((s for s in sites if var in s.chain_vars and not s.leave), None)
        if site is None:
            continue
        into = site.consumer if site.consumer is not None else site.source
        into_op = ops.get(into)
        out.append(RemovedLayoutOp(
            ops[var].gvar.name_hint, tuple(node_names(var)),
            into_op.gvar.name_hint if into_op is not None else "its producer",
            tuple(node_names(into)) if isinstance(into, relax.Var) else (),
            site.action.value if site.action is not None else ""))
    return out


@dataclass
class EliminationOptions:
    """Knobs; defaults are the paper's where it has one."""

    policy: str = "reduction"  # "reduction" (the paper) | "vector" (CPU tiles; measured slower)
    max_layout_copies: int = 1  # extra layouts a producer may write (paper: "redundant copies")
    fuse_epilogues: bool = True  # Table 5's "try fuse" for ILD&Var -> ILI&Var (DNNFusion green)


# ------------------------------------------------------------------------------- the pass


def eliminate_layout_transforms(mod: tvm.IRModule, options: EliminationOptions,
                                policy: str) -> tvm.IRModule:
    """Run the elimination on every non-primitive Relax function of a legalized module; each
    block's :class:`BlockRecord` goes to the active :class:`tvm_fusion.instrument.Collector`."""
    rewriter = _Rewriter(mod, options, policy)
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and not is_primitive(func):
            rewriter.function = gvar.name_hint
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    rewritten = rewriter.builder_.get()
    for block_record in rewriter.records:
        emit("layout_blocks", block_record)
    if not rewriter.groups:
        return relax.transform.DeadCodeElimination()(rewritten)
    groups = rewriter.groups

    def group_fn(_name, _index, block):
        found = []
        for members in groups:
            positions = [p for p, b in enumerate(block.bindings)
                         if any(b.var.same_as(m) for m in members)]
            if any(takes_sizes(block.bindings[p].value) for p in positions):
                continue  # a symbolic size argument: FuseTIR would lose it (symbolic.py)
            if len(positions) > 1:
                found.append(positions)
        return found

    grouped = group_bindings(rewritten, group_fn)
    fused = relax.transform.FuseTIR()(grouped)
    fused = relax.transform.DeadCodeElimination()(fused)
    used = set(kernel_names(fused))
    for gvar, func in list(fused.functions.items()):
        if not isinstance(func, tirx.PrimFunc):
            continue
        if gvar.name_hint not in used and func.attrs is not None and COPY_ATTR in func.attrs:
            del fused[gvar]  # a copy outlined into a group: FuseTIR leaves the original behind
        elif _has_copy(func) and (func.attrs is None or COPY_ATTR not in func.attrs):
            fused[gvar] = inline_copies(func)
    return relax.transform.AnnotateTIROpPattern()(fused)


def _has_copy(func: tirx.PrimFunc) -> bool:
    return any(b.name_hint.startswith(COPY_BLOCK) for b in iter_sblocks(func))


def inline_copies(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Inline every copy block of a fused function: into its consumers' loads (eliminate 1st)
    or into its spatial producer's store (eliminate 2nd); a copy after a reduction stays as the
    epilogue. Records what happened on the function."""
    sch = s_tir.Schedule(func.with_attr("global_symbol", "main"))
    notes = []
    for block in list(iter_sblocks(sch.mod["main"])):
        name = block.name_hint
        if not name.startswith(COPY_BLOCK):
            continue
        rv = sch.get_sblock(name)
        if sch.get_consumers(rv):
            try:
                sch.compute_inline(rv)
                notes.append(f"{name}: eliminate 1st, composed into the consumer's loads")
                continue
            except Exception as err:  # noqa: BLE001 (TVM raises ScheduleError subclasses)
                notes.append(f"{name}: kept ({_first_line(err)})")
                continue
        producers = sch.get_producers(rv)
        reduction = any(is_reduction_block(sch.get(p)) for p in producers)
        if any(len(sch.get_consumers(p)) > 1 for p in producers):
            # TVM 0.27's reverse_compute_inline does not check this: it retargets the store and
            # leaves the other readers of the producer's buffer dangling (ill-formed TIR).
            notes.append(f"{name}: eliminate 2nd, a second layout written by the producer "
                         "(its natural layout is read elsewhere)")
            continue
        try:
            sch.reverse_compute_inline(rv)
            notes.append(f"{name}: eliminate 2nd, composed into the producer's store")
        except Exception:  # noqa: BLE001 (TVM raises ScheduleError subclasses)
            if reduction:
                notes.append(f"{name}: eliminate 2nd, epilogue of a reduction (the schedule "
                             "stores it from the accumulator)")
            else:
                notes.append(f"{name}: eliminate 2nd, a second layout written by the producer "
                             "(its natural layout is read elsewhere)")
    result = sch.mod["main"]
    symbol = func.attrs.get("global_symbol") if func.attrs else None
    result = result.with_attr("global_symbol", symbol) if symbol else result.without_attr(
        "global_symbol")
    return result.with_attr(ELIMINATED_ATTR, notes)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def copy_primfunc(load_map: LoadMap) -> tirx.PrimFunc:
    """A one-block copy ``out[v] = src[g(v)]`` from a (simplified) load map."""
    src = te.placeholder([tirx.IntImm("int64", n) for n in load_map.in_shape], load_map.dtype,
                         name="src")

    def body(*iters):
        return src[tuple(load_map.apply(iters))]

    out = te.compute([tirx.IntImm("int64", n) for n in load_map.out_shape], body,
                     name=COPY_BLOCK)
    func = te.create_prim_func([src, out]).without_attr("global_symbol")
    return func.with_attr(COPY_ATTR, load_map.describe())


# ---------------------------------------------------------------------------- the rewriter


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, options: EliminationOptions, policy: str):
        super().__init__(mod)
        self.src_mod = mod
        self.options = options
        self.policy = policy
        self.function = ""
        self.groups: list[list[relax.Var]] = []
        self.records: list[BlockRecord] = []
        self._copy_funcs: dict[str, tvm.ir.GlobalVar] = {}

    # ------------------------------------------------------------------------- analysis

    def _op_info(self, var, call) -> OpInfo | None:
        if not (isinstance(call, relax.Call) and call.op.same_as(_CALL_TIR)):
            return None
        gvar = call.args[0]
        func = self.src_mod[gvar]
        args = list(call.args[1].fields) if isinstance(call.args[1], relax.Tuple) else [
            call.args[1]]
        if not isinstance(func, tirx.PrimFunc):
            return OpInfo(var, call, gvar, args, LayoutClass.OPAQUE, "not a PrimFunc", False,
                          None)
        single = isinstance(var.ty, relax.TensorType)
        access = analyze_primfunc(func, num_primfunc_outputs(func))
        consts = {i for i, a in enumerate(args) if isinstance(a, GenericConst)}
        mapping = classify(access, frozenset(consts))
        pure = is_pure_copy(func)
        cls, reason = layout_class(mapping, pure)
        load_map = None
        if cls.fixed and single:
            scalars = {i: int(a.value.numpy()) for i, a in enumerate(args)
                       if isinstance(a, GenericConst) and len(a.ty.shape) == 0
                       and "int" in str(a.ty.dtype)}
            try:
                load_map = extract_load_map(func, scalars)
            except Unsupported as err:
                reason += f"; kept as an operator: {err}"
            else:
                others = [i for i in range(len(args)) if i != load_map.src and i not in scalars]
                if others:
                    load_map, reason = None, reason + "; kept: reads a second tensor"
        absorbs = access.fusible and cls is not LayoutClass.OPAQUE and single
        return OpInfo(var, call, gvar, args, cls, reason, absorbs, load_map)

    def _plan(self, block: relax.DataflowBlock):
        bindings = list(block.bindings)
        ops: dict[relax.Var, OpInfo] = {}
        for b in bindings:
            info = self._op_info(b.var, b.value)
            if info is not None:
                ops[b.var] = info
        uses: dict[relax.Var, list[tuple[relax.Var, int | None]]] = {}
        for b in bindings:
            info = ops.get(b.var)
            if info is not None:
                for pos, arg in enumerate(info.args):
                    if isinstance(arg, relax.Var):
                        uses.setdefault(arg, []).append((b.var, pos))
            else:
                for used in relax.analysis.free_vars(b.value):
                    uses.setdefault(used, []).append((b.var, None))
        fixed = {v for v, o in ops.items() if o.load_map is not None}
        sites: list[Site] = []

        def walk(var, load_map, chain):
            other_use = _leaves(var)  # the chain's result leaves the block
            for user, pos in uses.get(var, []):
                if user in fixed and pos == ops[user].load_map.src:
                    walk(user, load_map.then(ops[user].load_map), chain + [user])
                elif user in ops and pos is not None:
                    sites.append(Site(source, chain, load_map, user, pos, var))
                else:
                    other_use = True
            if other_use:  # one copy serves every use outside an operator argument
                sites.append(Site(source, chain, load_map, None, None, var))

        for b in bindings:  # binding order: deterministic sites, copies and names
            var = b.var
            if var not in fixed:
                continue
            head = ops[var]
            source = head.args[head.load_map.src]
            if isinstance(source, relax.Var) and source in fixed:
                continue  # not a chain head
            walk(var, head.load_map, [var])
        return ops, uses, fixed, sites

    def _decide(self, ops, uses, fixed, sites, record: BlockRecord) -> None:
        """Table 5 per site, then the layout choice per source (:mod:`.layout_choice`)."""
        by_source: dict = {}
        for site in sites:
            by_source.setdefault(_key(site.source), []).append(site)
        for group in by_source.values():
            source = group[0].source
            producer = ops.get(source) if isinstance(source, relax.Var) else None
            direct = [u for u, _ in uses.get(source, []) if u not in fixed] if isinstance(
                source, relax.Var) else []
            leaves = isinstance(source, relax.Var) and not isinstance(source, relax.DataflowVar)
            for site in group:
                self._decide_site(site, ops, producer)
            seconds = [s for s in group if s.action is Action.ELIMINATE_SECOND]
            natural_needed = bool(direct) or leaves or any(
                s.action is not Action.ELIMINATE_SECOND for s in group)
            kept = choose_views(seconds, natural_needed, self.options.max_layout_copies)
            for site in seconds:
                if site.view_key not in kept:
                    site.action = Action.ELIMINATE_FIRST
                    site.reason = (f"{site.reason}; but more layouts are wanted than the natural "
                                   f"one plus {self.options.max_layout_copies} copies: reads "
                                   "through the map")
            views = {s.view_key for s in group if s.action is Action.ELIMINATE_SECOND}
            record.layout_copies += max(len(views) - (0 if natural_needed else 1), 0)

    def _decide_site(self, site: Site, ops, producer: OpInfo | None) -> None:
        first_fixed = ops[site.chain_vars[0]].cls
        last_fixed = ops[site.chain_vars[-1]].cls
        consumer = ops.get(site.consumer) if site.consumer is not None else None
        # Table 5: (Fixed, consumer) eliminates the 1st (or both); (producer, Fixed) the 2nd.
        can_first = consumer is not None and consumer.absorbs and pair_decision(
            last_fixed, consumer.cls).action in (Action.ELIMINATE_FIRST, Action.ELIMINATE_BOTH)
        can_second = (producer is not None and producer.absorbs and producer.load_map is None
                      and site.load_map.is_bijection()
                      and pair_decision(producer.cls, first_fixed).action in (
                          Action.ELIMINATE_SECOND, Action.ELIMINATE_BOTH))
        site.view_key = f"{site.load_map.describe()}|{site.load_map.out_shape}"
        if consumer is not None and consumer.cls.fixed and consumer.load_map is None:
            # Concat/pad read several sources (or one through a condition): no single load map
            # composes with them, and absorbing slices into them would turn one kernel into a
            # stencil-like read. The chain is left to the fusion planner.
            site.action, site.leave = Action.KEEP_BOTH, True
            site.reason = (f"consumer is a multi-source {consumer.cls.value} operator: the chain "
                           "is left as it is, for the fusion planner")
            return
        if can_first and can_second:
            pref = site_preference(self.src_mod[consumer.gvar], site.position, site.load_map,
                                   self.policy)
            site.preference = pref
            site.action = Action.ELIMINATE_SECOND if pref.wants_view else Action.ELIMINATE_FIRST
            site.reason = pref.reason
        elif can_first:
            site.action = Action.ELIMINATE_FIRST
            site.reason = (f"{consumer.cls.value} consumer reads through the map; the producer "
                           f"({producer.cls.value if producer else 'an input or constant'}) "
                           "cannot write it")
        elif can_second:
            site.action = Action.ELIMINATE_SECOND
            site.reason = (f"{producer.cls.value} producer writes it; "
                           f"{'the block output' if consumer is None else consumer.cls.value} "
                           "cannot absorb it")
        else:
            site.action = Action.KEEP_BOTH
            site.reason = "no neighbour can absorb it: one composed copy kernel remains"

    # -------------------------------------------------------------------------- rewriting

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        record = BlockRecord(self.function)
        ops, uses, fixed, sites = self._plan(block)
        for v, o in ops.items():
            record.classes[v.name] = o.cls.value
        self.records.append(record)
        self._decide(ops, uses, fixed, sites, record)
        names = {v: v.name for v in ops}
        record.sites = [s.describe(names) for s in sites]
        kept_fixed = {v for s in sites if s.leave for v in s.chain_vars}
        record.eliminated = len(fixed - kept_fixed)
        record.removed = _removed_ops(ops, sites, fixed - kept_fixed)
        record.materialised = len({s.view_key for s in sites
                                   if s.action is Action.KEEP_BOTH and not s.leave})

        at_consumer: dict = {}
        at_producer: dict = {}
        at_result: dict = {}
        for s in sites:
            if s.leave or (s.consumer is None and s.result_var in kept_fixed):
                continue  # the consumer keeps reading the original chain
            if s.action is Action.ELIMINATE_SECOND:
                at_producer.setdefault(s.source, []).append(s)
            if s.consumer is not None:
                at_consumer.setdefault(s.consumer, []).append(s)
            else:
                at_result.setdefault(s.result_var, []).append(s)

        site_var: dict[int, relax.Var] = {}
        classes: dict = {}  # emitted var -> class of its operator (copies are not in it)
        block_groups: list[list[relax.Var]] = []
        self.builder_._begin_dataflow_block()
        for b in block.bindings:
            var = b.var
            if var in kept_fixed:
                self.visit_binding(b)
                continue
            if var in fixed:  # replaced; a use outside any operator gets its copy here
                for s in at_result.get(var, []):
                    if s.action is not Action.ELIMINATE_SECOND:
                        site_var[id(s)] = self._emit_copy(s, leaves=_leaves(var))
                    self.set_var_remap(var, site_var[id(s)])
                continue
            members = []
            if var in at_consumer:
                info = ops[var]
                new_args = [self.visit_expr(a) for a in info.args]
                for s in at_consumer[var]:
                    if s.action is Action.ELIMINATE_SECOND:
                        new_args[s.position] = site_var[id(s)]
                        continue
                    new_args[s.position] = self._emit_copy(s)
                    if s.action is Action.ELIMINATE_FIRST:
                        members.append(new_args[s.position])
                call = info.call
                new_call = relax.Call(call.op, [call.args[0], relax.Tuple(new_args),
                                                *call.args[2:]], call.attrs, call.ty_args)
                new_var = self._emit(new_call, var)
            else:
                self.visit_binding(b)
                new_var = self.visit_expr(var)
            if var in ops and ops[var].absorbs:  # an opaque scan is no epilogue's anchor
                classes[new_var] = ops[var].cls
            members.append(new_var)
            for view in _views(at_producer.get(var, [])):
                leaves = any(s.consumer is None and _leaves(s.result_var) for s in view)
                copy = self._emit_copy(view[0], source=new_var, leaves=leaves)
                members.append(copy)
                for s in view:
                    site_var[id(s)] = copy
            if len(members) > 1:
                block_groups.append(members)
        new_block = self.builder_._end_block()
        if self.options.fuse_epilogues:
            block_groups = epilogue_groups(new_block, classes, block_groups)
        self.groups.extend(block_groups)
        return new_block

    def _emit(self, value, old_var: relax.Var) -> relax.Var:
        if isinstance(old_var, relax.DataflowVar):
            new = self.builder_.emit(value, old_var.name)
        else:
            new = self.builder_.emit_output(value, old_var.name)
        self.set_var_remap(old_var, new)
        return new

    def _emit_copy(self, site: Site, source=None, leaves: bool = False) -> relax.Var:
        lm = site.load_map
        key = f"{lm.describe()}|{lm.in_shape}|{lm.out_shape}|{lm.dtype}"
        gvar = self._copy_funcs.get(key)
        if gvar is None:
            gvar = self.builder_.add_func(copy_primfunc(site.load_map), COPY_BLOCK)
            self._copy_funcs[key] = gvar
        src = source if source is not None else self.visit_expr(site.source)
        call = relax.call_tir(gvar, relax.Tuple([src]), site.result_var.ty)
        if leaves:
            return self.builder_.emit_output(call, site.result_var.name)
        return self.builder_.emit(call, site.result_var.name)


def _leaves(var: relax.Var) -> bool:
    return not isinstance(var, relax.DataflowVar)


def epilogue_groups(block: relax.DataflowBlock, classes: dict,
                    groups: list[list[relax.Var]]) -> list[list[relax.Var]]:
    """Table 5's *try fuse* for an ILD&Variable operator and the ILI&Variable operator that is
    its only consumer (a bias, an activation; DNNFusion's Table 3 makes Many-to-Many followed by
    One-to-One green): the consumer joins the anchor's group, and so on down a chain.

    Done here rather than left to the planner because eliminating Fixed operators changes the
    graph the planner grows blocks on: an elementwise operator between two anchors would join
    whichever it meets first, and as the *next* anchor's prologue it is recomputed per read and
    blocks that anchor's tiling (measured on Swin-T's QKV bias). Other inputs of the consumer
    must be defined before the anchor's group, so no group can reach itself.
    """
    bindings = list(block.bindings)
    position = {b.var: i for i, b in enumerate(bindings)}
    parent: dict = {}

    def find(v):
        while v in parent:
            v = parent[v]
        return v

    def union(a, b):
        ra, rb = find(a), find(b)
        if not ra.same_as(rb):
            parent[rb] = ra

    for members in groups:
        for m in members[1:]:
            union(members[0], m)
    uses: dict = {}
    for b in bindings:
        for used in relax.analysis.free_vars(b.value):
            uses[used] = uses.get(used, 0) + 1
    anchored = set()
    for b in bindings:
        var, cls = b.var, classes.get(b.var)
        if cls is LayoutClass.ILD_VARIABLE:
            anchored.add(find(var))
        if cls is not LayoutClass.ILI_VARIABLE or not isinstance(b.value, relax.Call):
            continue
        args = [a for a in _call_args(b.value) if isinstance(a, relax.Var)]
        cands = [a for a in args if a in position and find(a) in anchored and uses.get(a) == 1
                 and isinstance(a, relax.DataflowVar)]
        if len(cands) != 1 or _widens(cands[0], var):
            continue
        anchor = cands[0]
        root = find(anchor)
        first = min(position[v] for v in position if find(v).same_as(root))
        if all(a.same_as(anchor) or a not in position or position[a] < first for a in args):
            union(anchor, var)
            anchored.add(find(var))
    components: dict = {}
    for v in position:
        components.setdefault(find(v), []).append(v)
    return [m for m in components.values() if len(m) > 1]


def _widens(source: relax.Var, result: relax.Var) -> bool:
    """``result`` holds ``source``'s elements in a wider type (a dequantize, a cast up): the
    chain stops before it, so the anchor's kernel writes the narrow tensor and the widening
    operator becomes its consumers' prologue (the planner's rule, fusion_plan.py)."""
    src, out = source.ty, result.ty
    if not isinstance(src, relax.TensorType) or not isinstance(out, relax.TensorType):
        return False
    if src.shape is None or out.shape is None or not tvm_ffi.structural_equal(src.shape, out.shape):
        return False
    return tvm.DataType(str(out.dtype)).bits > tvm.DataType(str(src.dtype)).bits


def _call_args(call: relax.Call) -> list:
    if isinstance(call.op, tvm.ir.Op) and call.op.same_as(_CALL_TIR):
        args = call.args[1]
        return list(args.fields) if isinstance(args, relax.Tuple) else [args]
    return list(call.args)


def _views(sites: list[Site]) -> list[list[Site]]:
    found: dict[str, list[Site]] = {}
    for s in sites:
        found.setdefault(s.view_key, []).append(s)
    return list(found.values())


def _key(expr):
    return expr if isinstance(expr, relax.Var) else id(expr)

"""Texture (image2d) memory for Adreno OpenCL: which tensors live in textures, in what layout,
and a lowering that writes them correctly.

* :func:`AnnotateTextureScopes` (a pass on fused Relax, after ``FuseTIR``) gives a tensor the
  ``global.texture`` scope when it gains from it: it is passed between two kernels, has a static
  shape, is float32/float16, and some consumer reads it inside a reduction (conv, matmul,
  pooling, softmax, norms: the ILD consumers whose reads the texture cache serves). Its layout
  comes from those consumers' reduction dimensions (:mod:`.texture_map`); the producer writes
  it through the layout's index map and every consumer reads it through the same map, both as
  ``global.texture`` *parameters* of their PrimFuncs (per call site, so a shared PrimFunc is
  specialised), and the Relax type carries a ``VDevice`` with that scope. Graph inputs and
  outputs, tensors the image limits cannot hold and tensors only elementwise ops read stay
  buffers; every decision is recorded with its reason.
* :func:`ScheduleTextureKernels` schedules every kernel one texel per thread with the RGBA lane
  vectorised (:mod:`.texture_schedule`).
* :func:`register_tir_pipelines` / ``tir_pipeline="tvm_fusion_adreno"`` lower them without
  0.27's scalarised-store bug (:mod:`.texture_lower`).

Targets: ``qcom/adreno-opencl-texture`` (textures) and ``qcom/adreno-opencl`` (no ``texture``
key: everything stays a buffer, same schedules and lowering).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax, s_tir, tirx

from ..instrument import emit
from ..relay_passes.grouping import is_primitive
from ..tir_utils import iter_sblocks
from .index_maps import input_accesses, refined_dims
from .texture_lower import OUR_PIPELINE, STOCK_PIPELINE, register_tir_pipelines
from .texture_map import Limits, TextureLayout, texture_layout
from .texture_schedule import schedule_texture_kernel

__all__ = [
    "AnnotateTextureScopes", "ScheduleTextureKernels", "TextureDecision", "texture_layout",
    "TextureLayout", "Limits", "register_tir_pipelines", "OUR_PIPELINE", "STOCK_PIPELINE",
    "TEXTURE_SCOPE", "reduction_dims", "wants_texture",
]

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
TEXTURE_SCOPE = "global.texture"
_DTYPES = ("float32", "float16")


@dataclass
class TextureDecision:
    """One tensor: its texture layout, or why it stays a buffer."""

    tensor: str
    shape: tuple
    layout: TextureLayout | None
    reason: str
    consumers: list[str] = field(default_factory=list)


def wants_texture(target: tvm.target.Target | None) -> bool:
    """Targets with the ``texture`` key (``qcom/adreno-opencl-texture``)."""
    return target is not None and "texture" in target.keys


def reduction_dims(func: tirx.PrimFunc, position: int) -> tuple[list[int], int]:
    """The logical dimensions of input ``position`` that ``func``'s reductions walk, largest
    reduction first (innermost first on ties), and the reading block's loop volume. Empty when
    no reduction reads it (an elementwise consumer)."""
    dims: list[int] = []
    work = 0
    for access in input_accesses(func, position):
        if not access.reduce:
            continue
        volume = 1
        for extent in access.extents.values():
            volume *= extent
        work = max(work, volume)
        ranges = access.ranges()
        used = [v for v in access.reduce if access.extents[v] > 1]
        order = sorted(range(len(used)), key=lambda i: (-access.extents[used[i]], -i))
        for i in order:
            pieces = refined_dims(access.indices, ranges, used[i])
            fastest = sorted(pieces, key=lambda piece: piece[1])
            for dim, _lower, _extent in fastest[:1]:
                if dim not in dims:
                    dims.append(dim)
    return dims, work


# ------------------------------------------------------------------------------- the passes


def AnnotateTextureScopes(  # noqa: N802 (a pass constructor, named as TVM names passes)
    target: tvm.target.Target | None = None
) -> tvm.transform.Pass:
    """Put the tensors that gain from it into ``global.texture`` (see the module docstring).

    Parameters
    ----------
    target
        Needs the ``texture`` key (else the pass does nothing); gives the image limits.
        Defaults to ``Target.current()``.

    A :class:`TextureDecision` per candidate tensor goes to the active
    :class:`tvm_fusion.instrument.Collector`.
    """

    @tvm.transform.module_pass(opt_level=0, name="AnnotateTextureScopes")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        tgt = target or tvm.target.Target.current()
        if not wants_texture(tgt):
            return mod
        return _TextureAnnotator(mod, tgt).run()

    return _pass


def ScheduleTextureKernels() -> tvm.transform.Pass:  # noqa: N802
    """Schedule every PrimFunc that has not been scheduled for a GPU yet, one texel (or one
    element) per thread, RGBA lanes vectorised."""

    @tvm.transform.module_pass(opt_level=0, name="ScheduleTextureKernels")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, tirx.PrimFunc) and not _has_threads(func):
                mod[gvar] = schedule_texture_kernel(func)
        return mod

    return _pass


def _has_threads(func: tirx.PrimFunc) -> bool:
    return func.attrs is not None and "tvm_fusion.texture_schedule" in func.attrs


class _TextureAnnotator:
    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target):
        self.mod = mod
        self.target = target
        self.limits = Limits.from_target(target)
        self.vdevice = relax.VDevice(target, 0, TEXTURE_SCOPE)

    def run(self) -> tvm.IRModule:
        layouts: dict = {}
        for func in self.mod.functions.values():
            if isinstance(func, relax.Function) and not is_primitive(func):
                for block in _dataflow_blocks(func):
                    layouts.update(self._choose(block))
        if not layouts:
            return self.mod
        rewriter = _Retype(self.mod, layouts, self.vdevice)
        for gvar, func in list(self.mod.functions.items()):
            if isinstance(func, relax.Function) and not is_primitive(func):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        out = rewriter.builder_.get()
        infos = dict(out.global_infos) if out.global_infos else {}
        vdevices = list(infos.get("vdevice", []))
        if not any(str(v) == str(self.vdevice) for v in vdevices):
            vdevices.append(self.vdevice)
        out.update_global_info("vdevice", vdevices)
        return relax.transform.DeadCodeElimination()(out)

    def _choose(self, block: relax.DataflowBlock) -> dict:
        calls: dict = {}
        uses: dict = {}
        for b in block.bindings:
            value = b.value
            if isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR):
                calls[b.var] = value
                for pos, arg in enumerate(_args(value)):
                    if isinstance(arg, relax.Var):
                        uses.setdefault(arg, []).append((b.var, pos))
            else:
                for used in relax.analysis.free_vars(value):
                    uses.setdefault(used, []).append((b.var, None))
        chosen = {}
        for var, call in calls.items():
            decision = self._decide(var, call, calls, uses.get(var, []))
            if decision is not None:
                emit("texture_decisions", decision)
            if decision is not None and decision.layout is not None:
                chosen[var] = decision.layout
        return chosen

    def _decide(self, var, call, calls, uses) -> TextureDecision | None:
        ty = var.ty
        if not isinstance(ty, relax.TensorType):
            return None
        shape = _static_shape(ty)
        if shape is None:
            return TextureDecision(var.name, (), None, "dynamic shape")

        def stay(reason):
            return TextureDecision(var.name, shape, None, reason)

        if not isinstance(var, relax.DataflowVar):
            return stay("graph output: stays a buffer the host can read")
        if str(ty.dtype) not in _DTYPES:
            return stay(f"dtype {ty.dtype}: textures hold float32/float16 texels")
        if not uses:
            return stay("no consumer")
        if any(pos is None or user not in calls for user, pos in uses):
            return stay("read by something other than a kernel argument")
        requirements = []
        for user, pos in uses:
            func = self.mod[calls[user].args[0]]
            dims, work = reduction_dims(func, pos)
            requirements.append((work, dims))
        if not any(dims for _, dims in requirements):
            return stay("only elementwise consumers: no reduction reads it, a buffer serves")
        ordered: list[int] = []
        for _, dims in sorted(requirements, key=lambda r: -r[0]):
            ordered += [d for d in dims if d not in ordered]
        layout = texture_layout(shape, ordered, self.limits)
        consumers = [calls[user].args[0].name_hint for user, _ in uses]
        if layout is None:
            return TextureDecision(var.name, shape, None,
                                   f"no dimension divisible by 4 or image over the limits "
                                   f"({self.limits.spatial}², {self.limits.depth} slices)",
                                   consumers)
        return TextureDecision(var.name, shape, layout,
                               f"reduced along dims {ordered} by its consumers", consumers)


def _args(call: relax.Call) -> list:
    args = call.args[1]
    return list(args.fields) if isinstance(args, relax.Tuple) else [args]


def _static_shape(ty: relax.TensorType) -> tuple | None:
    if ty.shape is None or not hasattr(ty.shape, "values"):
        return None
    dims = []
    for d in ty.shape.values:
        if not isinstance(d, int | tirx.IntImm):
            return None
        dims.append(int(d))
    return tuple(dims)


def _dataflow_blocks(func: relax.Function) -> list:
    body = func.body
    return [b for b in body.blocks if isinstance(b, relax.DataflowBlock)] if isinstance(
        body, relax.SeqExpr) else []


def specialise(func: tirx.PrimFunc, layouts: dict[int, TextureLayout]) -> tirx.PrimFunc:
    """``func`` with parameter ``i`` in ``layouts`` re-laid out (``transform_layout``) and
    scoped ``global.texture``."""
    sch = s_tir.Schedule(func.with_attr("global_symbol", "main"))
    params = list(func.params)
    for index, layout in layouts.items():
        name = params[index].name
        block = _block_touching(sch, name)
        sch.transform_layout(block, name, layout.index_map())
    result = sch.mod["main"]
    new_params = list(result.params)
    mapping = {new_params[i]: tirx.decl_buffer(new_params[i].shape, str(new_params[i].dtype),
                                               new_params[i].name, scope=TEXTURE_SCOPE)
               for i in layouts}
    result = result.specialize(mapping)
    symbol = func.attrs.get("global_symbol") if func.attrs else None
    result = result.with_attr("global_symbol", symbol) if symbol else result.without_attr(
        "global_symbol")
    return result.with_attr("tvm_fusion.texture_params",
                            {params[i].name: layout.describe() for i, layout in layouts.items()})


def _block_touching(sch, name: str):
    for block in iter_sblocks(sch.mod["main"]):
        names = {r.source.name for r in block.reads} | {w.source.name for w in block.writes}
        if name in names:
            return sch.get_sblock(block.name_hint)
    raise ValueError(f"no block reads or writes {name!r}")


@relax.expr_functor.mutator
class _Retype(relax.PyExprMutator):
    """Re-emit each block with textured tensors in their physical shape and scope, and each
    kernel specialised to the layouts of its arguments and result."""

    def __init__(self, mod: tvm.IRModule, layouts: dict, vdevice):
        super().__init__(mod)
        self.src = mod
        self.layouts = layouts
        self.vdevice = vdevice
        self.cache: dict[str, tvm.ir.GlobalVar] = {}

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        self.builder_._begin_dataflow_block()
        for b in block.bindings:
            value = b.value
            if not (isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR)):
                self.visit_binding(b)
                continue
            args = _args(value)
            per_param = {i: self.layouts[a] for i, a in enumerate(args)
                         if isinstance(a, relax.Var) and a in self.layouts}
            out_ty = value.ty
            if b.var in self.layouts:
                per_param[len(args)] = self.layouts[b.var]
                layout = self.layouts[b.var]
                out_ty = relax.TensorType(layout.physical_shape, b.var.ty.dtype, self.vdevice)
            if not per_param:
                self.visit_binding(b)
                continue
            gvar = self._specialised(value.args[0], per_param)
            new_args = relax.Tuple([self.visit_expr(a) for a in args])
            # a block's output stays an output (a DataflowVar would leak out of the block)
            bind = (self.builder_.emit if isinstance(b.var, relax.DataflowVar)
                    else self.builder_.emit_output)
            # a kernel with several results returns a tuple: call_tir takes their types
            out = list(out_ty.fields) if isinstance(out_ty, relax.TupleType) else out_ty
            new_var = bind(relax.call_tir(gvar, new_args, out), b.var.name)
            self.set_var_remap(b.var, new_var)
        return self.builder_._end_block()

    def _specialised(self, gvar, per_param) -> tvm.ir.GlobalVar:
        key = gvar.name_hint + "|" + "|".join(f"{i}:{lay.describe()}"
                                              for i, lay in sorted(per_param.items()))
        if key not in self.cache:
            func = specialise(self.src[gvar], per_param)
            self.cache[key] = self.builder_.add_func(func, gvar.name_hint + "_tex")
        return self.cache[key]

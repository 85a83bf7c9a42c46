"""TIR lowering for Adreno texture kernels that is right, as TVM 0.27 needs it (own passes only).

Two bugs in 0.27's Adreno TIR pipeline (``s_tir/backend/adreno/pipeline.py``), both found on
PoCL (``docs/smartmem.md``):

* **registration**: ``default_tir_pipeline()`` returns one pass where ``tvm.tirx.build`` unpacks
  a (pipeline, host finalisation, device finalisation) triple, so selecting it raises
  ``cannot unpack non-iterable ModulePass``. :func:`register_tir_pipelines` registers the
  stock passes as a proper triple, ``"adreno_fixed"`` (what stock TVM *would* build);
* **scalarised texture stores**: ``TextureFlatten`` runs first, when a store into the RGBA
  lane loop is still scalar, and keeps the lane index only for loads; ``VectorizeLoop`` then
  cannot vectorise the store call and splits it into 4 scalar stores, each writing a whole
  texel with one value broadcast. Every texel ends up holding its last lane 4 times.
  ``"tvm_fusion_adreno"`` lowers blocks and vectorises *before* ``TextureFlatten``, so a texel
  is stored as one 4-lane value, and then verifies it: a texture store whose value is not 4
  lanes wide is rejected, never emitted.

:func:`LowerTextures` is that pipeline's texture part (up to ``InjectTextureAlloc``) as one
module pass: the registered ``"tvm_fusion"`` Relax pipeline runs it at the end of a texture
build, so ``tvm.compile``'s default TIR pipeline (``s_tir``, whose passes are the rest of ours,
in the same order) emits correct image2d code without ``tir_pipeline=...``. Running the whole
``"tvm_fusion_adreno"`` after it changes nothing: on lowered code its texture part is a no-op.

Textures must be kernel parameters: a texture allocated inside a PrimFunc fails in 0.27's
``InjectTextureAlloc`` (``Expect no tvm_stack_make_shape outside of CallNodes``) and has no
meaning across kernels; :func:`check_texture_params` rejects it with the buffer's name.
"""

from __future__ import annotations

import tvm
import tvm.s_tir.backend.adreno  # noqa: F401 (registers TextureFlatten and friends)
from tvm import s_tir, tirx
from tvm.s_tir import SBlock
from tvm.s_tir import pipeline as s_pipeline
from tvm.s_tir.backend.adreno import pipeline as adreno
from tvm.tirx import compilation_pipeline

from ..tir_utils import find_all

STOCK_PIPELINE = "adreno_fixed"
OUR_PIPELINE = "tvm_fusion_adreno"
LANES = 4


class TextureLoweringError(ValueError):
    """A kernel whose texture code would be wrong; the message names the kernel and the store."""


def is_texture_scope(scope: str) -> bool:
    return scope.startswith("global.texture")


def check_texture_params(mod: tvm.IRModule) -> None:
    """Raise when a PrimFunc allocates a texture instead of receiving it as a parameter."""
    for gvar, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        for block in find_all(func.body, SBlock):
            for buf in block.alloc_buffers:
                if is_texture_scope(buf.scope()):
                    raise TextureLoweringError(
                        f"{gvar.name_hint}: texture {buf.name!r} is allocated inside the kernel; "
                        "textures must be parameters (the producer writes them, the consumer "
                        "reads them)")


def check_texture_stores(mod: tvm.IRModule) -> None:
    """Raise on a texture store whose value is not one whole 4-lane texel (the 0.27 bug)."""
    for gvar, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        for call in find_all(func.body, tvm.ir.expr.Call):
            op = call.op
            if not (isinstance(op, tvm.ir.Op) and op.name.endswith("texture2d_store")):
                continue
            value = call.args[-1]
            lanes = _lanes(str(value.ty))
            if lanes != LANES:
                raise TextureLoweringError(
                    f"{gvar.name_hint}: texture store of a {lanes}-lane value ({value.ty}); "
                    "a texel must be written as one 4-lane vector (vectorise the RGBA lane loop)")


def _lanes(dtype: str) -> int:
    return int(dtype.rsplit("x", 1)[1]) if "x" in dtype else 1


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.CheckTextureParams")
def _check_params_pass(mod, _ctx):
    check_texture_params(mod)
    return mod


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.CheckTextureStores")
def _check_stores_pass(mod, _ctx):
    check_texture_stores(mod)
    return mod


def _block_lowering() -> list:
    """From schedulable blocks to plain loops, as 0.27's Adreno pipeline does it (minus
    ``TextureFlatten``, which must wait until the lanes are vectors)."""
    s, t = s_tir.transform, tirx.transform
    return [
        s.CanonicalizeLoop(), s.LowerCrossThreadReduction(), s.LowerInitBlock(),
        s.PlanAndUpdateBufferAllocationLocation(), s.ConvertBlocksToOpaque(),
        s.LiftThreadBinding(), s.ManifestSharedMemoryLocalStage(), s.CompactBufferAllocation(),
        s.LowerAutoCopy(), s.UnifyThreadBinding(), s.LowerMatchBuffer(), s.StmtSimplify(),
        s.InjectPermutedLayout(), s.AnnotateIrregularLoop(), s.InjectSoftwarePipeline(),
        s.TransformMmaBufferLayout(), s.LowerOpaqueBlock(), t.VectorizeLoop(True),
    ]


def _texture_lowering() -> list:
    """Blocks lowered and lanes vectorised, then textures flattened (stores checked) and their
    allocations injected: everything texture-specific."""
    textures = s_tir.backend.adreno.transform
    return ([_check_params_pass] + _block_lowering()
            + [textures.TextureFlatten(), _check_stores_pass, textures.InjectTextureAlloc()])


def _rest(config) -> list:
    """Everything 0.27's Adreno pipeline runs after ``InjectTextureAlloc``, in its order (the
    same passes as the default ``s_tir`` pipeline's from ``FlattenBuffer`` on)."""
    s, t = s_tir.transform, tirx.transform
    passes = [
        t.FlattenBuffer(), t.BF16ComputeLegalize(), t.NarrowDataType(32), s.LoopPartition(),
        t.VectorizeLoop(not bool(config.get("tirx.disable_vectorize", False))),
        s.InjectVirtualThread(), s.InjectDoubleBuffer(),
    ]
    if not bool(config.get("tirx.disable_storage_rewrite", False)):
        passes.append(t.StorageRewrite())
    passes += [s.HoistIfThenElse(), t.UnrollLoop(), s.RenormalizeSplitPattern(),
               t.StmtSimplify(), t.RemoveNoOp(), s.RewriteUnsafeSelect()]
    if not bool(config.get("tirx.disable_cse_tir", False)):
        passes.append(t.CommonSubexprElim())
    passes += [t.FP8ComputeLegalize(), s.VerifyVTCMLimit(), s.LowerVtcmAlloc(), t.VerifyMemory(),
               t.AnnotateEntryFunc(), s.ThreadSync("shared"), s.ThreadSync("shared.dyn"),
               s.ThreadSync("warp"), s.InferFragment(), s.LowerThreadAllreduce(),
               s.MergeSharedMemoryAllocations(), t.SplitHostDevice(), t.MakePackedAPI(),
               t.FP8StorageLegalize(), t.BF16StorageLegalize()]
    return passes


def LowerTextures() -> tvm.transform.Pass:  # noqa: N802 (a pass constructor)
    """The texture part of ``"tvm_fusion_adreno"``: what a texture kernel needs before the
    default ``s_tir`` TIR pipeline can finish it (see the module docstring)."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.LowerTextures")
    def _lower(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return tvm.transform.Sequential(_texture_lowering())(mod)

    return _lower


def our_tir_pipeline() -> tvm.transform.Pass:
    """0.27's Adreno TIR pipeline with the lanes vectorised before ``TextureFlatten`` and both
    checks in place."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.AdrenoTIRPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        config = tvm.transform.PassContext.current().config
        return tvm.transform.Sequential(_texture_lowering() + _rest(config))(mod)

    return _pipeline


def register_tir_pipelines() -> None:
    """Register ``"adreno_fixed"`` (stock passes, proper triple) and ``"tvm_fusion_adreno"``
    (ours) for ``tvm.tirx.build(..., pipeline=name)`` / ``tvm.compile(..., tir_pipeline=name)``.
    Idempotent."""
    finalize = (s_pipeline.finalize_host_passes, s_pipeline.finalize_device_passes)
    compilation_pipeline.register_tir_pipeline(
        STOCK_PIPELINE, lambda: (adreno.default_tir_pipeline(), *finalize))
    compilation_pipeline.register_tir_pipeline(
        OUR_PIPELINE, lambda: (our_tir_pipeline(), *finalize))

"""Keep TVM 0.27's LLVM code generator from dropping ``noalias`` for a whole module.

``CodeGenLLVM`` reads ``tirx.noalias`` into a member (``is_restricted_``) when it *declares* a
function, and declares every function of a module before it emits any; emitting does not read
the attribute again. So the module's last declared function decides for all of them: when
that is a function without the attribute, every kernel of the module is emitted with its
buffers in one alias set (one ``tvm-alias`` TBAA tag, no ``noalias`` parameters), and LLVM can
no longer keep a register tile in registers across loads (``src/target/llvm/codegen_llvm.cc``,
``DeclareFunctionInternal``).

In a Relax VM build that function is the shape function ``VMShapeLower`` adds for symbolic
shapes (``shape_func``: no ``tirx.noalias``). Measured: the fused attention of a Llama layer
at a symbolic length ran 3.4× slower in the VM build than the same kernel built alone.

:class:`MarkSingleBufferNoAlias` gives the attribute to every PrimFunc with at most one buffer
or pointer parameter, which cannot alias anything (the shape function reads and writes one
shape heap), so that it no longer switches the module's kernels off.
"""

from __future__ import annotations

import tvm
from tvm import tirx

from ..module_update import with_functions

NOALIAS = "tirx.noalias"


def _pointer_params(func: tirx.PrimFunc) -> int:
    count = 0
    for param in func.params:
        ty = getattr(param, "ty", None)
        if isinstance(ty, (tirx.BufferType, tvm.ir.PointerType)) or (
                getattr(ty, "dtype", None) is not None and str(ty.dtype) == "handle"):
            count += 1
    return count


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.MarkSingleBufferNoAlias")
class MarkSingleBufferNoAlias:
    """``tirx.noalias`` on PrimFuncs with at most one buffer parameter (see the module)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            if func.attrs is not None and NOALIAS in func.attrs:
                continue
            if _pointer_params(func) <= 1:
                updates[gvar] = func.with_attr(NOALIAS, True)
        return with_functions(mod, updates)


__all__ = ["MarkSingleBufferNoAlias"]

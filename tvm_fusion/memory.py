"""Planned activation memory of a fused module: what a run of it keeps allocated.

TVM's ``StaticPlanBlockMemory`` gives the tensors of a Relax function storage blocks that are
reused once their tensors are dead; their total is the *planned* activation memory of the
graph (a tvm_fusion build re-packs TVM's tokens, largest tensors first, where that takes fewer
bytes). Weights are constants and not counted. Two more terms complete the picture:

* ``unplanned``: tensors the planner leaves to run-time allocation (``R.builtin.alloc_tensor``
  of a size only known at run time; counted at the symbolic hint);
* ``workspace``: buffers a kernel allocates inside itself (an intermediate a fused loop nest
  kept, a padded copy). Kernels run one after the other, so the largest one counts.

``planned_memory(fused, target)`` lowers a module after fusion (``compile.fuse``) just far
enough for the planner to have run; the kernels themselves are not compiled.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax, tirx
from tvm.s_tir import SBlock

from .pipeline import memory_planning
from .symbolic import extent
from .target import to_target
from .tir_utils import compact_buffers, find_all

__all__ = ["MemoryPlan", "compact_buffers", "kernel_workspace", "planned_memory"]

_ALLOC_STORAGE = "relax.memory.alloc_storage"
_ALLOC_TENSOR = "relax.builtin.alloc_tensor"


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of one module's activations: planned storage, run-time allocations, and the
    largest kernel workspace (with the kernel's name)."""

    planned: int
    unplanned: int
    workspace: int
    workspace_kernel: str

    @property
    def total(self) -> int:
        return self.planned + self.unplanned + self.workspace


def planned_memory(fused: tvm.IRModule, target, repack: bool = True) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``fused`` (a module after ``FuseTIR``) for ``target``, as a
    tvm_fusion build plans it (TVM's planner, then its tokens re-packed:
    ``relay_passes/repack_storage.py``); ``repack=False``: as TVM's own pipeline does, for
    stock FuseOps' module."""
    target = to_target(target)
    with target:
        lowered = memory_planning(target, repack)(fused)
    planned = unplanned = 0
    for func in lowered.functions.values():
        if isinstance(func, relax.Function):
            p, u = _relax_allocations(func)
            planned, unplanned = planned + p, unplanned + u
    workspace, kernel = 0, ""
    for gvar, func in lowered.functions.items():
        if isinstance(func, tirx.PrimFunc):
            size = kernel_workspace(func)
            if size > workspace:
                workspace, kernel = size, gvar.name_hint
    return MemoryPlan(planned, unplanned, workspace, kernel)


def _relax_allocations(func: relax.Function) -> tuple[int, int]:
    planned = unplanned = 0

    def visit(node):
        nonlocal planned, unplanned
        if not isinstance(node, relax.Call) or not isinstance(node.op, tvm.ir.Op):
            return
        if node.op.name == _ALLOC_STORAGE:
            planned += _shape_bytes(node.args[0], 1)
        elif node.op.name == _ALLOC_TENSOR:
            dtype = tvm.runtime.DataType(node.args[1].value)
            unplanned += _shape_bytes(node.args[0], (dtype.bits * dtype.lanes + 7) // 8)

    relax.analysis.post_order_visit(func.body, visit)
    return planned, unplanned


def _shape_bytes(shape: relax.Expr, element_bytes: int) -> int:
    size = element_bytes
    for dim in shape.values:
        size *= _value(dim)
    return size


def _value(dim) -> int:
    return int(dim.value) if isinstance(dim, tirx.IntImm) else extent(dim)


def kernel_workspace(func: tirx.PrimFunc) -> int:
    """Bytes of the global-scope buffers a kernel allocates for itself (``local`` tiles, which
    become registers, are not memory), after TVM's lowering has shrunk each buffer to the
    region one iteration of the loop it is computed under needs (a padded slab, a row)."""
    func = compact_buffers(func)
    total = 0
    for block in find_all(func.body, SBlock):  # the root block included: it holds most
        for buf in block.alloc_buffers:
            if buf.scope() in ("global", ""):
                size = (buf.dtype.bits * buf.dtype.lanes + 7) // 8
                for dim in buf.shape:
                    size *= _value(dim)
                total += size
    return total

"""Kernel metrics for layout work: how many kernels a module launches and how many of them
only move data (Table 1's explicit layout transformations, counted after fusion).

A kernel is *pure data movement* when every block of its PrimFunc stores a load, a constant or
a choice between them (Reshape, Transpose, Slice, Gather, Concat, Pad and their fusions): it
computes nothing, so SmartMem would have eliminated it.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from .index_maps import is_pure_copy

_KERNEL_OPS = ("relax.call_tir", "relax.call_dps_packed")


def kernel_names(mod: tvm.IRModule) -> list[str]:
    """The callee of every kernel launch in the module's Relax functions, in program order."""
    names: list[str] = []

    def visit(node):
        if isinstance(node, relax.Call) and isinstance(node.op, tvm.ir.Op) and (
                node.op.name in _KERNEL_OPS):
            callee = node.args[0]
            names.append(callee.name_hint if isinstance(callee, tvm.ir.GlobalVar) else
                         str(callee))

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return names


def is_data_movement(func) -> bool:
    """A PrimFunc that only moves data (see the module docstring)."""
    return isinstance(func, tirx.PrimFunc) and is_pure_copy(func)


def count_data_movement_kernels(mod: tvm.IRModule) -> int:
    """Kernel launches whose PrimFunc is pure data movement."""
    by_name = {g.name_hint: f for g, f in mod.functions.items()}
    return sum(is_data_movement(by_name.get(n)) for n in kernel_names(mod))

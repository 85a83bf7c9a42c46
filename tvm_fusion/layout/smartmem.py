"""SmartMem (ASPLOS'24) for TVM Relax: layout-transformation elimination and layout choice.

The pieces, one module each:

* :mod:`.classes`: the four operator classes (ILD/ILI × Variable/Fixed) from TIR, Tables 5/6;
* :mod:`.index_maps`: index comprehension: load maps read from TIR, composed, simplified by
  ``tvm.sym.Analyzer``, split into identity/split/merge pieces by ``detect_iter_map``;
* :mod:`.layout_choice`: the reduction-dimension rule and the k-layouts-then-copies rule;
* :mod:`.eliminate`: the Relax rewrite that makes Fixed operators disappear into neighbours;
* :mod:`.metrics`: kernels and pure data-movement kernels of a module.

:func:`EliminateLayoutTransforms` is the pass. It runs on *legalized* Relax (it reads TIR),
after ``legalize_passes`` and before ``AnnotateMappingType``/``PlanFusion``::

    passes = legalize_passes(tgt) + [EliminateLayoutTransforms(tgt), AnnotateMappingType(...),
                                     PlanFusion(...), FuseTIR(), ...]
"""

from __future__ import annotations

import tvm

from .classes import (
    TABLES_5_6,
    Action,
    LayoutClass,
    PairDecision,
    Search,
    layout_class,
    pair_decision,
    tables_markdown,
)
from .eliminate import (
    ELIMINATED_ATTR,
    BlockRecord,
    EliminationOptions,
    eliminate_layout_transforms,
)
from .index_maps import LoadMap, extract_load_map, simplify
from .layout_choice import SitePreference, choose_views, site_preference
from .metrics import count_data_movement_kernels, is_data_movement, kernel_names

__all__ = [
    "EliminateLayoutTransforms", "LayoutClass", "Action", "Search", "PairDecision",
    "TABLES_5_6", "pair_decision", "layout_class", "tables_markdown", "BlockRecord",
    "EliminationOptions", "LoadMap", "extract_load_map", "simplify", "SitePreference",
    "site_preference", "choose_views", "count_data_movement_kernels", "is_data_movement",
    "kernel_names", "ELIMINATED_ATTR", "POLICIES",
]

POLICIES = ("reduction", "vector")


def EliminateLayoutTransforms(  # noqa: N802 (a pass constructor, named as TVM names passes)
    target: tvm.target.Target | None = None,
    policy: str = "reduction",
    max_layout_copies: int = 1,
    fuse_epilogues: bool = True,
) -> tvm.transform.Pass:
    """SmartMem's elimination of Fixed (data-movement) operators, on legalized Relax.

    Parameters
    ----------
    target
        Accepted for symmetry with the other passes (the elimination is target-independent).
    policy
        Which dimension a consumer wants contiguous: ``"reduction"`` (the paper: its reduction
        dimension) or ``"vector"`` (the output's innermost axis, what a CPU kernel vectorised
        along it walks). ``"vector"`` makes the producer write Kᵀ for Q·Kᵀ; on our CPU schedules
        that is slower, because a 49- or 197-wide key axis cannot be vector-tiled anyway and the
        row reduction then reads K strided (``docs/smartmem.md``).
    max_layout_copies
        Extra layouts a producer may write when its consumers want more than one (the paper's
        redundant copies; a buffer serves k = 1 contiguous dimension per layout).
    fuse_epilogues
        Table 5's *try fuse* for an ILD&Variable operator and its single ILI&Variable consumer
        (bias, activation), done before planning so the planner cannot make it the next
        anchor's prologue instead (:func:`.eliminate.epilogue_groups`).

    Returns
    -------
    tvm.transform.Pass
        A module pass; composes with ``tvm.transform.Sequential``. One :class:`BlockRecord`
        per dataflow block (classes, every site with its action and reason) goes to the active
        :class:`tvm_fusion.instrument.Collector`.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown layout policy {policy!r}; expected one of {POLICIES}")
    if int(max_layout_copies) < 0:
        raise ValueError(f"max_layout_copies must be >= 0, got {max_layout_copies}")
    options = EliminationOptions(policy, int(max_layout_copies), bool(fuse_epilogues))

    @tvm.transform.module_pass(opt_level=0, name="EliminateLayoutTransforms")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return eliminate_layout_transforms(mod, options, policy)

    return _pass

"""The reduction-dimension layout choice (SmartMem §3.2.2): the producer writes the layout its
consumer reads best.

A consumer reads best when the dimension its innermost loop walks is contiguous: the
reduction dimension for the paper's GPU kernels (a dot product), the output's innermost axis
for CPU kernels vectorised along it (policy ``"vector"``, ours; see
:func:`.index_maps.walked_var`). The walked iterator is traced back through the eliminated
operators into the producer's index space with ``detect_iter_map``, where it may be only a
*piece* of a dimension (the refined dimensions of the paper's Fig. 4).

Candidate layouts for a tensor are its natural (row-major) layout and each consumer's view
(the layout in which that consumer indexes it, which the producer can write by absorbing the
Fixed chain: Table 5's *eliminate 2nd*). Several consumers share one layout when it makes
all of their walked dimensions contiguous; a buffer has k = 1 contiguous dimension, so a
consumer needing another one gets an extra copy (the paper's redundant copies), up to a limit.
Textures have k = 2 (:mod:`.texture`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx

from .index_maps import LoadMap, contiguous_along, input_accesses, refined_dims, walked_var


@dataclass(frozen=True)
class SitePreference:
    """What one consumer read wants from the tensor it reads through a composed map."""

    walked: str | None  # the consumer iterator its innermost loop walks (None: no preference)
    natural: bool  # contiguous when the producer writes its natural layout
    view: bool  # contiguous when the producer writes the consumer's view
    refined: tuple  # (dim, lower, extent) pieces of the producer's dims the iterator lands in
    work: int  # the consumer's loop volume, to serve the heaviest first
    reason: str

    @property
    def wants_view(self) -> bool:
        """Eliminate 2nd: only the consumer's own view makes the walk contiguous."""
        return self.view and not self.natural


def site_preference(consumer: tirx.PrimFunc, position: int, load_map: LoadMap,
                    policy: str) -> SitePreference:
    """The preference of ``consumer`` reading input ``position`` through ``load_map``."""
    accesses = input_accesses(consumer, position)
    if not accesses:
        return SitePreference(None, True, True, (), 0, "the consumer never reads it")
    # The access inside a reduction decides (the paper's ILD part), else the first one.
    access = next((a for a in accesses if a.reduce), accesses[0])
    work = 1
    for extent in access.extents.values():
        work *= extent
    var = walked_var(access, policy)
    if var is None:
        return SitePreference(None, True, False, (), work,
                              f"{access.block} walks no dimension of it ({policy} rule): "
                              "the consumer reads through the map")
    ranges = access.ranges()
    in_source = load_map.apply(access.indices)
    natural = contiguous_along(in_source, load_map.in_shape, ranges, var)
    view = contiguous_along(access.indices, load_map.out_shape, ranges, var)
    refined = tuple(refined_dims(in_source, ranges, var))
    where = ", ".join(f"dim {d}" + (f"/{lo}" if lo > 1 else "") + f"[{n}]"
                      for d, lo, n in refined) or "nowhere"
    if natural:
        reason = (f"{access.block} walks {var.name} ({policy} rule), contiguous in the "
                  f"producer's layout ({where}): the consumer reads through the map")
    elif view:
        reason = (f"{access.block} walks {var.name} ({policy} rule), strided in the producer's "
                  f"layout ({where}), contiguous in its own view: the producer writes the view")
    else:
        reason = (f"{access.block} walks {var.name} ({policy} rule), contiguous in neither "
                  f"layout ({where}): the consumer reads through the map")
    return SitePreference(var.name, natural, view, refined, work, reason)


def choose_views(seconds: list, natural_needed: bool, max_copies: int) -> set[str]:
    """Which consumer views the producer writes.

    ``seconds`` are the sites that asked for their view (``site.view_key``; a site with no
    ``preference`` was forced there because its consumer cannot absorb anything, and is always
    served). When the natural layout is still needed, every wanted view is an extra copy, at
    most ``max_copies`` of them, heaviest consumer first; otherwise the heaviest view replaces
    the natural layout for free.
    """
    forced = {s.view_key for s in seconds if s.preference is None}
    wanted: dict[str, int] = {}
    for s in seconds:
        if s.preference is not None and s.view_key not in forced:
            wanted[s.view_key] = wanted.get(s.view_key, 0) + s.preference.work
    ranked = sorted(wanted, key=lambda k: -wanted[k])
    free = 0 if natural_needed or forced else 1
    return forced | set(ranked[: free + max(max_copies, 0)])

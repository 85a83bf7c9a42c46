"""Layer III's cost model: Apollo's Eq. (3), made resource-aware (notes §4.2)."""

from __future__ import annotations

from ..rejection import RejectReason

# ------------------------------------------------------------------------------ Eq. (3)

CPU_BYTES_PER_S = 10e9  # one socket's sustained DRAM bandwidth, order of magnitude
CPU_FLOPS_PER_S = 50e9  # a few AVX2 cores
LAUNCH_S = 5e-6  # one VM kernel call (packed function call + parallel region start)


def parallel_gain(costs: list[dict], budget_bytes: int, max_branches: int = 7) -> dict:
    """Eq. (3) made resource-aware, for packing independent kernels into one.

    ``gain = Σ cost_i − T_par`` with ``cost_i = time_i + launch`` and
    ``T_par = max(max_i time_i, Σ_i time_i · occupancy_i) + launch``: a kernel that keeps every
    core busy (occupancy 1) gains nothing from a partner but the launch it saves; small kernels
    overlap. Refused outright (the resource check) when there are more than ``max_branches``
    kernels or their combined working set exceeds ``budget_bytes`` (the packed kernel's inputs and
    outputs must stay cache-resident for the overlap to pay). ``rejected`` says why a group is
    not packed (None when it is), ``reason`` in words.
    """
    k = len(costs)
    nbytes = sum(c["bytes"] for c in costs)
    if k > max_branches:
        return {"fuse": False, "gain": 0.0, "bytes": nbytes, "rejected": RejectReason.BLOCK_LIMIT,
                "reason": f"{k} branches > {max_branches}"}
    if nbytes > budget_bytes:
        return {"fuse": False, "gain": 0.0, "bytes": nbytes, "rejected": RejectReason.WORKING_SET,
                "reason": f"working set {nbytes} B > budget {budget_bytes} B"}
    seq = sum(c["time"] + LAUNCH_S for c in costs)
    par = max(max(c["time"] for c in costs),
              sum(c["time"] * c["occupancy"] for c in costs)) + LAUNCH_S
    gain = seq - par
    return {"fuse": gain > 0, "gain": gain, "bytes": nbytes,
            "rejected": None if gain > 0 else RejectReason.PROFITABILITY,
            "reason": "Eq. (3) gain > 0" if gain > 0 else "Eq. (3) gain not positive"}

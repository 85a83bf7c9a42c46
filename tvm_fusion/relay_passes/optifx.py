"""OptiFX/AFUSION at graph level: which chains of region-based operators share one kernel.

A *region-based operator* (ROP) is a conv, depthwise conv or pooling call: a 4-D NCHW window
reduction, recognised from its TIR (never its name). With its element-wise epilogue it is the
paper's CBR node. Candidates (Algorithm 1's sub-graphs, T_graph = 3) are connected sets of 2–3
ROPs in the three shapes of §3.1:

* SISO ``C1 → C2 (→ C3)``: every operator between them element-wise with one consumer;
* SIMO ``C1 → {C2, C3}``: the intermediate read only by the two consumers (a join after them,
  a concat, is element-wise and joins the kernel as their epilogue);
* MISO ``C1, C2 → add``: two ROPs whose epilogues meet in one element-wise join.

Each candidate is scored by the roofline (Eq. 1–3; weights ``C·K·R·S/G``, the per-group term
that reproduces Table 4) before and after fusion. After fusion the intermediate's traffic is
gone and the halo recomputation (``T_red``) is added. Two pruning rules (notes §2.4):

* ``"cost_model"`` (default): per-kernel roofline time ``Σ max(F/P, B/M)`` must improve by
  ``θ_opt = 1.05``; an intermediate that fits the last-level cache costs no DRAM traffic in
  either case, so fusing it only pays by saving cache traffic;
* ``"paper_1.05"``: the literal rule, aggregate intensity ``P~(I_G') > 1.05·P~(I_G)`` (it prunes
  every sub-graph whose unfused intensity is already above the ridge, e.g. Table 4's G1, G2);
* ``"off"``: no conv→conv fusion.

Algorithm 2 (backtracking, best-first by cost, ``θ_ex = 1.1``) then picks a set of
non-overlapping candidates, with the notes' fixes: improved graphs are expanded too, states are
memoised, inapplicable candidates skipped. Costs come from a ``latency(candidate)`` callable when
given (the profiling database / measurement), else from the roofline. The chosen chains become
pre-formed blocks: the DNNFusion plan's blocks holding their operators are merged (overriding
Table 3's red M2M→M2M cell for exactly these blocks), unless that would form a cycle.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import tvm
from tvm import relax

from ..tir_schedules.optifx import choose_band, choose_tile
from ..tir_utils import iter_sblocks
from .ecg import ECG
from .fusion_plan import FusionBlock, path_reenters
from .mapping_type import MappingType
from .rejection import Rejection, RejectReason

MODES = ("cost_model", "paper_1.05", "off")
THETA_OPT = 1.05
THETA_EX = 1.1
T_GRAPH = 3


@dataclass(frozen=True)
class Platform:
    """Roofline constants. ``cache_bytes``: an intermediate this small stays on chip unfused."""

    name: str
    p_max: float  # FLOP/s
    m_max: float  # bytes/s (DRAM)
    cache_bytes: int = 0
    cache_bw: float = 0.0  # bytes/s of the cache holding small intermediates

    @property
    def i_max(self) -> float:
        return self.p_max / self.m_max


PLATFORMS = {
    # the paper's GPUs (§5.1)
    "a6000_ada": Platform("a6000_ada", 91.1e12, 960e9),
    "rtx4090": Platform("rtx4090", 82.6e12, 1008e9),
    "orin": Platform("orin", 5.32e12, 204.8e9),
    # the development CPU: 2 Zen cores, AVX-512 (measured ~150 GFLOP/s on convs), DDR ~20 GB/s,
    # 2 MiB L2 per core (~100 GB/s per core)
    "cpu": Platform("cpu", 150e9, 20e9, 2 << 20, 200e9),
}


@dataclass(frozen=True)
class RegionOp:
    """Shape facts of one ROP call (NCHW)."""

    node: int
    kind: str  # conv | depthwise | pool
    n: int
    c: int
    h: int
    w: int
    k: int
    ho: int
    wo: int
    r: int
    s: int
    stride: int
    groups: int
    dtype_bytes: int = 4

    @property
    def flops(self) -> int:
        per = 2 * (self.c // self.groups) * self.r * self.s if self.kind != "pool" else \
            self.r * self.s
        return self.n * self.k * self.ho * self.wo * per

    @property
    def weight_bytes(self) -> int:
        if self.kind == "pool":
            return 0
        return self.dtype_bytes * self.c * self.k * self.r * self.s // self.groups

    @property
    def in_bytes(self) -> int:
        return self.dtype_bytes * self.n * self.c * self.h * self.w

    @property
    def out_bytes(self) -> int:
        return self.dtype_bytes * self.n * self.k * self.ho * self.wo

    @property
    def intensity(self) -> float:
        """Eq. 3 with the per-group weight term."""
        return self.flops / (self.in_bytes + self.weight_bytes + self.out_bytes)


@dataclass(frozen=True)
class ChainCandidate:
    """A sub-graph of 2–3 ROPs and the element-wise operators between/after them."""

    shape: str  # SISO | SIMO | MISO
    rops: tuple[int, ...]  # ECG node indices of the ROPs, topological order
    members: frozenset[int]  # every ECG node of the sub-graph
    intermediates: tuple[int, ...]  # nodes whose results stay on chip (ROP → ROP edges)


@dataclass
class Score:
    t_unfused: float
    t_fused: float
    i_unfused: float
    i_fused: float
    redundant_flops: int
    halo: tuple[int, int]
    tile: tuple[int, int]
    bytes_saved: int
    keep: bool
    rule: str

    @property
    def ratio(self) -> float:
        return self.t_unfused / self.t_fused if self.t_fused else 0.0


@dataclass
class ChainDecision:
    candidate: ChainCandidate
    score: Score
    chosen: bool
    reason: str  # the detail: the cost model's or the measurement's verdict
    names: list[str] = field(default_factory=list)
    rejected: RejectReason | None = None  # why it was not fused (None: chosen)


# ------------------------------------------------------------------------- ROP recognition


def region_op(ecg: ECG, index: int, mod: tvm.IRModule | None = None) -> RegionOp | None:
    """The ROP facts of an ECG node, read from its PrimFunc and argument shapes."""
    node = ecg.nodes[index]
    if node.mapping_type is not MappingType.MANY_TO_MANY or not node.fusible:
        return None
    call = ecg.block.bindings[node.binding_index].value
    if not isinstance(call, relax.Call) or len(call.args) < 2:
        return None
    args = call.args[1]
    args = list(args.fields) if isinstance(args, relax.Tuple) else [args]
    shapes = [_shape(a) for a in args]
    if not shapes or shapes[0] is None or len(shapes[0]) != 4:
        return None
    out = node.out_shapes[0] if node.out_shapes else None
    if out is None or len(out) != 4:
        return None
    n, c, h, w = shapes[0]
    _, k, ho, wo = out
    weight = next((s for i, s in enumerate(shapes[1:], 1)
                   if s is not None and len(s) == 4 and s[0] == k and i in node.weight_inputs),
                  None)
    window = _window(mod, call.args[0]) if mod is not None else None
    if weight is not None:
        groups = max(c // max(weight[1], 1), 1)
        r, s = weight[2], weight[3]
        kind = "depthwise" if groups == c and groups > 1 else "conv"
    else:
        if k != c or window is None:
            return None
        r, s = window
        groups, kind = c, "pool"
    stride = _stride(h, ho, r) if ho > 1 else 1
    return RegionOp(index, kind, n, c, h, w, k, ho, wo, r, s, stride, groups)


def _shape(expr):
    ty = expr.ty if hasattr(expr, "ty") else None
    if isinstance(ty, relax.TensorType) and ty.shape is not None and hasattr(ty.shape, "values"):
        try:
            return tuple(int(d) for d in ty.shape.values)
        except TypeError:
            return None
    return None


def _stride(h: int, ho: int, r: int) -> int:
    """The stride from sizes: padding is at most r-1 in total, so ``(ho-1)·s ≤ h+r-1-r``."""
    for s in (1, 2, 3, 4):
        for pad in range(0, r):
            if (h + pad - r) // s + 1 == ho:
                return s
    return 1


def _window(mod, gvar) -> tuple[int, int] | None:
    """Window size of a pooling PrimFunc: the extents of its two reduction iterators."""
    try:
        func = mod[gvar]
    except Exception:  # noqa: BLE001
        return None
    for block in iter_sblocks(func):
        red = [iv for iv in block.iter_vars if int(iv.iter_type) == 2]
        if len(red) == 2:
            try:
                return int(red[0].dom.extent), int(red[1].dom.extent)
            except TypeError:
                return None
    return None


# ------------------------------------------------------------------------------ candidates


def _elementwise_path(ecg: ECG, start: int, rops: dict) -> tuple[list[int], int | None]:
    """Follow single-consumer element-wise operators from ``start``'s result. Returns the
    operators passed and the first operator that is not such (None at a fork/output)."""
    path = []
    cur = start
    while True:
        node = ecg.nodes[cur]
        if node.is_graph_output or len(node.succs) != 1:
            return path, None if len(node.succs) != 1 else node.succs[0]
        nxt = node.succs[0]
        nn = ecg.nodes[nxt]
        if (nxt in rops or nn.mapping_type is not MappingType.ONE_TO_ONE or not nn.fusible
                or len(nn.preds) > 1):  # a join of two branches ends the CBR
            return path, nxt
        path.append(nxt)
        cur = nxt


def _epilogue(ecg: ECG, rop: int, rops: dict) -> tuple[list[int], int]:
    """The element-wise chain after a ROP and the node whose result leaves it (the CBR end)."""
    path, _ = _elementwise_path(ecg, rop, rops)
    return path, (path[-1] if path else rop)


def find_candidates(ecg: ECG, rops: dict[int, RegionOp]) -> list[ChainCandidate]:
    """All SISO/SIMO/MISO sub-graphs of 2..T_GRAPH ROPs (overlapping enumeration)."""
    found: list[ChainCandidate] = []
    nexts: dict[int, tuple[list[int], int | None]] = {}
    for r in rops:
        path, nxt = _elementwise_path(ecg, r, rops)
        nexts[r] = (path, nxt)
    # SISO chains
    for r1 in rops:
        path1, nxt = nexts[r1]
        if nxt is None or nxt not in rops:
            continue
        mem = {r1, *path1, nxt}
        found.append(ChainCandidate("SISO", (r1, nxt), frozenset(mem),
                                    (path1[-1] if path1 else r1,)))
        path2, nxt2 = nexts[nxt]
        if nxt2 is not None and nxt2 in rops and T_GRAPH >= 3:
            mem3 = mem | {*path2, nxt2}
            found.append(ChainCandidate("SISO", (r1, nxt, nxt2), frozenset(mem3),
                                   (path1[-1] if path1 else r1, path2[-1] if path2 else nxt)))
    # SIMO: the end of a CBR feeds exactly two ROPs and nothing else
    for r1 in rops:
        path, end = _epilogue(ecg, r1, rops)
        node = ecg.nodes[end]
        if node.is_graph_output or len(node.succs) != 2:
            continue
        if not all(s in rops for s in node.succs):
            continue
        mem = {r1, *path, *node.succs}
        a, b = sorted(node.succs)
        # a join of the two branches (concat) joins as their epilogue
        ea, enda = _epilogue(ecg, a, rops)
        eb, endb = _epilogue(ecg, b, rops)
        mem |= set(ea) | set(eb)
        join = _common_join(ecg, enda, endb)
        if join is not None:
            mem.add(join)
        found.append(ChainCandidate("SIMO", (r1, a, b), frozenset(mem), (end,)))
    # MISO: two CBRs whose ends meet in one element-wise join
    ends = {}
    for r in rops:
        path, end = _epilogue(ecg, r, rops)
        ends[r] = (path, end)
    for r1 in rops:
        for r2 in rops:
            if r2 <= r1:
                continue
            p1, e1 = ends[r1]
            p2, e2 = ends[r2]
            join = _common_join(ecg, e1, e2)
            if join is None:
                continue
            found.append(ChainCandidate("MISO", (r1, r2), frozenset({r1, r2, *p1, *p2, join}), ()))
    return found


def _common_join(ecg: ECG, a: int, b: int) -> int | None:
    na, nb = ecg.nodes[a], ecg.nodes[b]
    if na.is_graph_output or nb.is_graph_output or na.succs != nb.succs or len(na.succs) != 1:
        return None
    join = ecg.nodes[na.succs[0]]
    if join.mapping_type is not MappingType.ONE_TO_ONE or not join.fusible:
        return None
    return join.index


# ---------------------------------------------------------------------------- cost model


def t_red(h: int, w: int, th_tiles: int, tw_tiles: int, phi_r: int, phi_s: int) -> int:
    """The paper's redundant evaluations of the intermediate, per channel (Sec. 3.2)."""
    return ((th_tiles - 1) * phi_r * w + (tw_tiles - 1) * phi_s * h
            + (tw_tiles - 1) * (th_tiles - 1) * phi_r * phi_s)


def roofline_time(flops: float, nbytes: float, p: Platform) -> float:
    return max(flops / p.p_max, nbytes / p.m_max)


def attainable(intensity: float, p: Platform) -> float:
    """Eq. 2."""
    return min(p.m_max * intensity, p.p_max)


def score(cand: ChainCandidate, rops: dict[int, RegionOp], p: Platform, mode: str,
          cores: int = 2, lanes: int = 16) -> Score:
    ops = [rops[i] for i in cand.rops]
    flops = sum(o.flops for o in ops)
    # unfused: every ROP kernel reads its input and weights and writes its output
    t_unf, bytes_unf = 0.0, 0
    for o in ops:
        nbytes = o.in_bytes + o.weight_bytes + o.out_bytes
        t_unf += _kernel_time(o.flops, nbytes, o, cand, rops, p)
        bytes_unf += nbytes
    # fused: the intermediates never leave the chip; the halo is recomputed
    inter = _intermediate_bytes(cand, rops)
    bytes_f = bytes_unf - 2 * inter if cand.shape != "SIMO" else bytes_unf - 3 * inter
    halo, tile, red = (0, 0), (0, 0), 0
    if cand.shape in ("SISO", "SIMO"):
        last = ops[-1]
        chain = [(o.r, o.stride) for o in ops] if cand.shape == "SISO" else \
            [(ops[0].r, ops[0].stride), (max(o.r for o in ops[1:]), ops[1].stride)]
        chans = [ops[0].c] + [o.k for o in ops]
        if cand.shape == "SISO" and len(ops) == 2 and (last.r, last.s, last.stride) == (1, 1, 1):
            # a 1×1 tail needs no halo: whole-row bands (tir_schedules/optifx.py)
            tile = (choose_band(last.ho, last.wo, last.c, cores, lanes), last.wo)
        else:
            tile = choose_tile(last.ho, last.wo, chans[:len(chain) + 1], chain, cores, lanes)
        tiles_h = -(-last.ho // tile[0])
        tiles_w = -(-last.wo // tile[1])
        # every op but the last recomputes the halo that all later ops' windows add up to
        # (SISO; SIMO's branches read the shared producer: the widest window counts)
        later = ops[1:] if cand.shape == "SISO" else [max(ops[1:], key=lambda o: o.r)]
        producers = ops[:-1] if cand.shape == "SISO" else ops[:1]
        for i, producer in enumerate(producers):
            phi_r = sum(max(0, o.r - o.stride) for o in later[i:])
            phi_s = sum(max(0, o.s - o.stride) for o in later[i:])
            halo = halo if i else (phi_r, phi_s)
            per_ch = t_red(producer.ho, producer.wo, tiles_h, tiles_w, phi_r, phi_s)
            red += producer.n * producer.k * per_ch * (
                2 * (producer.c // producer.groups) * producer.r * producer.s
                if producer.kind != "pool" else producer.r * producer.s)
    t_f = roofline_time(flops + red, bytes_f, p)
    i_unf = flops / max(bytes_unf, 1)
    i_f = (flops + red) / max(bytes_f, 1)
    if mode == "paper_1.05":
        keep = attainable(i_f, p) > THETA_OPT * attainable(i_unf, p)
        rule = f"P~(I'={i_f:.2f}) vs {THETA_OPT}xP~(I={i_unf:.2f})"
    else:
        keep = t_unf > THETA_OPT * t_f
        rule = f"roofline time {t_unf * 1e6:.1f} us -> {t_f * 1e6:.1f} us"
    return Score(t_unf, t_f, i_unf, i_f, int(red), halo, tile, int(2 * inter), keep, rule)


def _kernel_time(flops, nbytes, op: RegionOp, cand, rops, p: Platform) -> float:
    """Per-kernel roofline; an intermediate small enough for the cache moves at cache speed."""
    if p.cache_bytes and cand.intermediates:
        small = sum(_node_bytes(cand, rops, i) for i in cand.intermediates)
        if small <= p.cache_bytes and p.cache_bw:
            dram = nbytes - small  # its write (producer) or read (consumer) hits the cache
            return max(flops / p.p_max, dram / p.m_max + small / p.cache_bw)
    return roofline_time(flops, nbytes, p)


def _node_bytes(cand, rops, i) -> int:
    for r in cand.rops:
        if r == i:
            return rops[r].out_bytes
    # an epilogue end: same size as the ROP whose CBR it ends
    first = rops[cand.rops[0]]
    return first.out_bytes


def _intermediate_bytes(cand: ChainCandidate, rops) -> int:
    if cand.shape == "MISO":
        return 0
    ops = [rops[i] for i in cand.rops]
    if cand.shape == "SIMO":
        return ops[0].out_bytes
    return sum(o.out_bytes for o in ops[:-1])


# ------------------------------------------------------------------------------ search


def backtracking_search(candidates: list[ChainCandidate], cost: Callable[[frozenset], float],
                        theta_ex: float = THETA_EX, max_states: int = 20000) -> frozenset:
    """Algorithm 2 with the notes' fixes: best-first over sets of applied candidates (indices),
    improved states are pushed too, states are memoised, overlapping candidates skipped."""
    start: frozenset = frozenset()
    best, best_cost = start, cost(start)
    heap = [(best_cost, 0, start)]
    seen = {start}
    counter = 1
    while heap and len(seen) < max_states:
        _, _, state = heapq.heappop(heap)
        used = set().union(*(candidates[i].members for i in state)) if state else set()
        for i, cand in enumerate(candidates):
            if i in state or cand.members & used:
                continue  # ApplyFusion not applicable
            nxt = state | {i}
            if nxt in seen:
                continue
            seen.add(nxt)
            c = cost(nxt)
            if c < best_cost:
                best, best_cost = nxt, c
            if c < theta_ex * best_cost:
                heapq.heappush(heap, (c, counter, nxt))
                counter += 1
    return best


def choose_chains(ecg: ECG, mode: str = "cost_model", platform: Platform | str = "cpu",
                  mod: tvm.IRModule | None = None,
                  latency: Callable[[ChainCandidate], tuple[float, float, str] | None]
                  | None = None,
                  prune: bool = True) -> list[ChainDecision]:
    """Candidates of one ECG, scored, pruned (Algorithm 1) and searched (Algorithm 2).

    ``latency(candidate)``, when given, returns measured ``(fused s, unfused s, detail)`` (the
    profiling database) or None; a measured candidate is kept exactly when fusing it was
    faster, whatever the roofline and the CPU template rules say, and its measured saving is
    its gain in the search. Unmeasured candidates keep the cost model's verdict."""
    if mode not in MODES:
        raise ValueError(f"unknown conv_chains mode {mode!r}; expected one of {MODES}")
    if mode == "off":
        return []
    plat = PLATFORMS[platform] if isinstance(platform, str) else platform
    rops = {}
    for node in ecg.nodes:
        op = region_op(ecg, node.index, mod)
        if op is not None:
            rops[node.index] = op
    cands = find_candidates(ecg, rops)
    scored = []
    for c in cands:
        sc = _cpu_template_check(c, rops, plat, score(c, rops, plat, mode))
        measured = latency(c) if latency is not None else None
        if measured is not None:
            fused, unfused, detail = measured
            sc = replace(sc, t_fused=fused, t_unfused=unfused, keep=fused < unfused,
                         rule="measured, " + detail)
        scored.append((c, sc))
    kept = [(c, s) for c, s in scored if s.keep or not prune]
    if not kept:
        return [_pruned(c, s) for c, s in scored]
    gains = [s.t_fused - s.t_unfused for _, s in kept]  # negative: time saved

    def cost(state: frozenset) -> float:
        return sum(gains[i] for i in state)

    chosen = _greedy_or_search([c for c, _ in kept], gains, cost)
    out = []
    for i, (c, s) in enumerate(kept):
        ok = i in chosen
        out.append(ChainDecision(c, s, ok, ("fused: " if ok else "overlaps a better chain: ")
                                 + s.rule, [ecg.nodes[r].describe() for r in c.rops],
                                 None if ok else RejectReason.OVERLAP))
    out += [_pruned(c, s) for c, s in scored if not s.keep and prune]
    return out


def _pruned(cand: ChainCandidate, sc: Score) -> ChainDecision:
    return ChainDecision(cand, sc, False, "pruned: " + sc.rule,
                         rejected=RejectReason.PROFITABILITY)


def is_pointwise_tail(cand: ChainCandidate, rops: dict[int, RegionOp]) -> bool:
    """A SISO pair ending in a 1×1 stride-1 conv: no halo, the CPU row-band template."""
    last = rops[cand.rops[-1]]
    return cand.shape == "SISO" and len(cand.rops) == 2 and last.kind != "pool" and (
        last.r, last.s, last.stride) == (1, 1, 1)


# A band of the 1x1 conv's positions must fill at least one AVX-512 register
CPU_BAND_POSITIONS = 16


def _cpu_template_check(cand: ChainCandidate, rops: dict[int, RegionOp], plat: Platform,
                        sc: Score) -> Score:
    """On a CPU only pointwise tails are kept: their row-band template runs at 0.97–1.34× of
    the separate kernels, while the overlapped-tile template with a halo was measured far
    slower on this CPU (MobileNetV2's 3×3/s2 → dw → pw chain 9.4 ms against 0.6 ms, a 1×1 →
    dw/s2 pair 7.2 ms; docs/optifx.md), whatever the roofline says. And only on maps that
    split into two bands (one per core) of at least a register of positions: on 7×7 maps the
    bands are single 7-wide rows and the pair ran at 0.7–0.8×, with nothing to save (the
    intermediate fits in L2 unfused)."""
    if plat.name != "cpu" or not sc.keep:
        return sc
    if not is_pointwise_tail(cand, rops):
        return replace(sc, keep=False, rule="CPU: only chains ending in a 1x1 conv are fused "
                       "(the halo template is slower than separate kernels here); " + sc.rule)
    last = rops[cand.rops[-1]]
    if not any(last.ho % rows == 0 and last.ho // rows >= 2
               and rows * last.wo >= CPU_BAND_POSITIONS for rows in range(1, last.ho)):
        return replace(sc, keep=False, rule=f"CPU: a {last.ho}x{last.wo} map has no two bands "
                       f"of {CPU_BAND_POSITIONS} positions; " + sc.rule)
    return sc


def _greedy_or_search(cands: list[ChainCandidate], gains: list[float], cost) -> frozenset:
    """Backtracking search when the candidate set is small enough; on a whole network the
    candidates only interact through overlaps, so the search runs per connected group."""
    groups: list[list[int]] = []
    owner: dict[int, int] = {}
    for i, c in enumerate(cands):
        hit = {owner[m] for m in c.members if m in owner}
        if not hit:
            groups.append([i])
            g = len(groups) - 1
        else:
            g = min(hit)
            for other in sorted(hit - {g}, reverse=True):
                groups[g] += groups[other]
                groups[other] = []
            groups[g].append(i)
        for gi, members in enumerate(groups):
            for j in members:
                for m in cands[j].members:
                    owner[m] = gi
    chosen: set[int] = set()
    for members in groups:
        if not members:
            continue
        local = [cands[i] for i in members]
        base = 1.0 + sum(abs(gains[i]) for i in members)  # costs must be positive (θ_ex)
        best = backtracking_search(
            local, lambda st, m=members, b=base: b + sum(gains[m[i]] for i in st))
        chosen |= {members[i] for i in best}
    return frozenset(chosen)


# ------------------------------------------------------------------------- plan merging


def blocks_holding(plan, cand: ChainCandidate) -> list[int]:
    """Indices of the plan's blocks that hold a member of ``cand``: what merging it merges."""
    return sorted({b for b, blk in enumerate(plan.blocks) for m in blk.members
                   if m in cand.members})


def merge_chains_into_plan(plan, decisions: list[ChainDecision]):
    """Merge the DNNFusion blocks holding each chosen chain (the red M2M→M2M cell overridden
    for exactly these blocks). A merge that would form a cycle is refused and recorded."""
    ecg = plan.ecg
    for dec in decisions:
        if not dec.chosen:
            continue
        block_of = {m: b for b, blk in enumerate(plan.blocks) for m in blk.members}
        ids = blocks_holding(plan, dec.candidate)
        merged = sorted(set().union(*(plan.blocks[b].members for b in ids)))
        if path_reenters(ecg, set(merged), block_of, plan.blocks):
            dec.chosen = False
            dec.rejected = RejectReason.CYCLE
            dec.reason = "would form a cycle through an operator outside the chain"
            plan.rejections.append(Rejection(ecg.nodes[dec.candidate.rops[0]].describe(),
                                             ecg.nodes[dec.candidate.rops[-1]].describe(),
                                             RejectReason.CYCLE, "conv chain: " + dec.reason))
            continue
        new = FusionBlock(merged, MappingType.MANY_TO_MANY, plan.blocks[ids[0]].seed)
        plan.blocks = [b for i, b in enumerate(plan.blocks) if i not in ids] + [new]
        plan.blocks.sort(key=lambda b: b.members[0])
    plan.conv_chains = decisions
    return plan


__all__ = ["MODES", "PLATFORMS", "Platform", "RegionOp", "ChainCandidate", "Score", "ChainDecision",
           "region_op", "find_candidates", "score", "t_red", "backtracking_search",
           "choose_chains", "blocks_holding", "merge_chains_into_plan", "attainable",
           "roofline_time"]

"""DNNFusion's rewrite rules (§4.2, Table 4): each declared once, with what it needs to be sound.

A :class:`Rule` carries its property (associative, distributive, commutative), the pattern and
result as the paper writes them, the FLOPs before and after for the paper's m×n case, its
preconditions, whether it is exact in IEEE arithmetic or needs ``allow_fp_reassociation``, the
tolerance its numerical test uses, and a generator of rewrite candidates at a root node.

Rules on chains of ``⊙`` and ``+`` are not written per bracketing and operand order: the product
and sum engines (:mod:`.chains`) match modulo associativity and commutativity, and each
engine step is a rule of its own so statistics and switches stay per rule. That is how the
paper's 149 variants (45/38/66) reduce to the rules below without losing any.

A generator only proposes; the driver (:mod:`.rewrite`) prices each candidate with
:func:`.cost.node_cost`, applies only strict improvements, and re-checks shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from .chains import (
    ONE,
    Product,
    combine_powers,
    emit_product,
    emit_sum,
    flatten_product,
    flatten_product_deep,
    flatten_sum,
    fold_sum_constants,
    multiply_all,
    product_view,
    scalar_const_value,
)
from .ir import (
    ELEMENTWISE_BINARY,
    ELEMENTWISE_UNARY,
    Builder,
    Leaf,
    Node,
    Refuse,
    Value,
    aligned,
    broadcast,
    is_const,
    is_float,
    is_int,
    key,
    nonneg,
)

PROPERTIES = ("associative", "distributive", "commutative")


@dataclass(frozen=True)
class Rule:
    """One rewrite rule.

    Attributes
    ----------
    name
        Unique name; ``RewriteByMathProperties(rules=[...])`` and the statistics use it.
    prop
        ``"associative"``, ``"distributive"`` or ``"commutative"`` (the paper's categories).
    lhs, rhs
        The pattern and its replacement, in Table 4's notation.
    flops
        FLOPs before → after for m×n operands, per occurrence as the paper counts them.
    preconditions
        What must be proven from shapes, dtypes and constness before the rule fires.
    table4
        The Table 4 rows (1–10, top to bottom) this rule implements.
    exact
        True when the result is bit-identical in IEEE arithmetic; False means rounding (or
        overflow behaviour) may change, so the rule needs ``allow_fp_reassociation``.
    rtol
        The relative tolerance its numerical test allows.
    roots
        Operators a match can be rooted at.
    engine
        ``"standalone"`` (its own generator), ``"product"``/``"sum"`` (a step of a chain engine),
        or ``"matching"`` (realised by matching modulo operand order; never applied alone).
    """

    name: str
    prop: str
    lhs: str
    rhs: str
    flops: str
    preconditions: tuple[str, ...] = ()
    table4: tuple[int, ...] = ()
    exact: bool = False
    rtol: float = 1e-5
    roots: tuple[str, ...] = ()
    engine: str = "standalone"
    generate: Callable | None = None


@dataclass
class RuleMatch:
    """Replace each root node by its value; ``fired`` names the rules involved."""

    roots: dict
    fired: tuple[str, ...]


class Ctx:
    """What generators see: the enabled rules and a builder."""

    def __init__(self, enabled: frozenset[str]):
        self.enabled = enabled
        self.b = Builder()

    def on(self, name: str) -> bool:
        return name in self.enabled

    def allows(self, steps: Iterable[str]) -> bool:
        return all(s in self.enabled for s in steps)


RULES: dict[str, Rule] = {}


def _register(rule: Rule) -> None:
    if rule.name in RULES:
        raise ValueError(f"rule {rule.name!r} declared twice")
    if rule.prop not in PROPERTIES:
        raise ValueError(f"rule {rule.name!r}: unknown property {rule.prop!r}")
    RULES[rule.name] = rule


def _declare(**fields) -> Callable:
    """Declare a standalone rule; the decorated function generates its candidates."""

    def wrap(fn):
        _register(Rule(generate=fn, **fields))
        return fn

    return wrap


def _declare_step(**fields) -> None:
    """Declare a step of a chain engine (its generator is the engine's)."""
    _register(Rule(**fields))


# ---------------------------------------------------------------------------------------------
# Product engine: ⊙ chains (Table 4 rows 1–4)
# ---------------------------------------------------------------------------------------------
_PRODUCT_ROOTS = ("multiply", "divide", "negative")
_SUM_ROOTS = ("add", "subtract")

_declare_step(
    name="mul_fold_constants", prop="associative", engine="product", roots=_PRODUCT_ROOTS,
    lhs="(A ⊙ c1) ⊙ c2,  A / c,  (−A) ⊙ (−B)", rhs="A ⊙ (c1·c2),  A ⊙ (1/c),  A ⊙ B",
    flops="2mn → mn", preconditions=("c1, c2 constants (folded at compile time)",))
_declare_step(
    name="mul_combine_powers", prop="associative", engine="product", roots=_PRODUCT_ROOTS,
    table4=(1, 2, 4),
    lhs="x^a ⊙ x^b: √B ⊙ √B, X ⊙ X, Recip(A) ⊙ Recip(A), 1/√x",
    rhs="x^(a+b): B, Square(X), Square(Recip(A)), Rsqrt(x)",
    flops="(A⊙√B)⊙(√B⊙C): 5mn → 2mn",
    preconditions=("integer exponents, or the base is provably >= 0 (abs/exp/square/relu/…"
                   " or a non-negative constant)",
                   "exponents of one sign, unless the base is a positive finite constant"))
_declare_step(
    name="mul_distribute_power", prop="associative", engine="product", roots=_PRODUCT_ROOTS,
    table4=(1,), lhs="Recip(A ⊙ B), Square(A ⊙ B), √(A ⊙ B)",
    rhs="Recip(A) ⊙ Recip(B), …", flops="enabler (0)",
    preconditions=("integer exponent, or every factor provably >= 0",))
_declare_step(
    name="mul_group_exponents", prop="associative", engine="product", roots=_PRODUCT_ROOTS,
    table4=(1,), lhs="Square(A) ⊙ Square(B), Recip(A) ⊙ Recip(B), √A ⊙ √B",
    rhs="Square(A ⊙ B), Recip(A ⊙ B), √(A ⊙ B)", flops="3mn → 2mn",
    preconditions=("fractional exponents only over provably non-negative bases",))
_declare_step(
    name="mul_merge_abs", prop="associative", engine="product", roots=_PRODUCT_ROOTS,
    table4=(3,), lhs="Abs(A) ⊙ B ⊙ Abs(C)", rhs="Abs(A ⊙ C) ⊙ B", flops="4mn → 3mn")
_declare_step(
    name="mul_merge_exp", prop="associative", engine="product", roots=_PRODUCT_ROOTS,
    lhs="Exp(A) ⊙ Exp(B)", rhs="Exp(A + B)", flops="3mn → 2mn",
    preconditions=("changes overflow: exp(A)·exp(B) may be inf·0",))


def _product_candidates(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    if not is_float(root.dtype):
        return
    prod = combine_powers(flatten_product_deep(root))
    new = emit_product(ctx.b, prod, root.shape)
    if prod.steps and ctx.allows(prod.steps):
        yield RuleMatch({root: new}, tuple(sorted(prod.steps)))


# ---------------------------------------------------------------------------------------------
# Sum engine: + chains (Table 4 rows 5–7)
# ---------------------------------------------------------------------------------------------
_declare_step(
    name="add_fold_constants", prop="associative", engine="sum", roots=_SUM_ROOTS,
    lhs="(A + c1) + c2,  (A − c1) + c2", rhs="A + (c1 + c2)", flops="2mn → mn",
    preconditions=("c1, c2 constants",))
_declare_step(
    name="add_factor_common", prop="distributive", engine="sum", roots=_SUM_ROOTS,
    table4=(5, 6, 7),
    lhs="A⊙C + A⊙B,  A + A⊙B,  Square(A+B) − (A+B)⊙C",
    rhs="A⊙(B+C),  A⊙(B+1),  (A+B)⊙(A+B−C)",
    flops="3mn → 2mn; 2mn → 2mn (A loaded once; mn when B is a weight); 5mn → 3mn")
_declare_step(
    name="add_merge_log", prop="distributive", engine="sum", roots=_SUM_ROOTS,
    lhs="Log(A) + Log(B) − Log(C)", rhs="Log(A ⊙ B / C)", flops="5mn → 4mn",
    preconditions=("A, B, C provably >= 0 (log of a negative is NaN; the product need not be)",
                   "changes overflow of the product"))
_declare_step(
    name="commute_operands", prop="commutative", engine="matching", table4=(8,),
    roots=_PRODUCT_ROOTS + _SUM_ROOTS, lhs="A ⊙ B", rhs="B ⊙ A", exact=True, rtol=0.0,
    flops="mn → mn (enabler only: realised by matching chains as multisets)")


def _sum_candidates(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    if not is_float(root.dtype):
        return
    s = flatten_sum(root)
    b = ctx.b
    if ctx.on("add_fold_constants") and s.consts and (len(s.consts) > 1 or s.consts[0][0] < 0):
        const = fold_sum_constants(b, s.consts, root.dtype, root.shape)
        yield RuleMatch({root: emit_sum(b, s.terms, const)}, ("add_fold_constants",))
    if ctx.on("add_factor_common"):
        yield from _factor_common(ctx, root, s)
    if ctx.on("add_merge_log"):
        yield from _merge_logs(ctx, root, s)


def _factor_common(ctx: Ctx, root: Node, s) -> Iterable[RuleMatch]:
    views = [(sign, term, product_view(term)) for sign, term in s.terms]
    seen: dict = {}
    for _, _, view in views:
        for base, e in view.factors:
            if e >= 1 and e.denominator == 1:
                seen.setdefault(key(base), [base, 0])[1] += 1
    for k, (base, count) in seen.items():
        if count < 2:
            continue
        try:
            yield _factor_out(ctx, root, s, views, k, base)
        except Refuse:
            continue


def _factor_out(ctx: Ctx, root: Node, s, views, k, base: Value) -> RuleMatch:
    b = ctx.b
    inner_terms: list = []
    inner_consts: list = []
    rest: list = []
    steps = {"add_factor_common"}
    for sign, term, view in views:
        idx = next((i for i, (f, e) in enumerate(view.factors)
                    if key(f) == k and e >= 1 and e.denominator == 1), None)
        if idx is None:
            rest.append((sign, term))
            continue
        reduced = view.copy()
        f, e = reduced.factors[idx]
        if e == ONE:
            del reduced.factors[idx]
        else:
            reduced.factors[idx] = (f, e - 1)
        if reduced.empty():
            inner_consts.append((sign, b.const(1, root.dtype)))
            continue
        part = emit_product(b, reduced, root.shape)
        steps |= reduced.steps
        if is_const(part):
            inner_consts.append((sign, part))
        else:
            inner_terms.append((sign, part))
    const = fold_sum_constants(b, inner_consts, root.dtype, root.shape)
    if not inner_terms and const is None:
        raise Refuse("the factored sum is zero")
    inner = emit_sum(b, inner_terms, const) if inner_terms else const
    outer = b.op("multiply", base, inner)
    if len(s.consts) > 1:
        steps.add("add_fold_constants")
    outer_const = fold_sum_constants(b, s.consts, root.dtype, root.shape)
    if not ctx.allows(steps):
        raise Refuse("a needed step is disabled")
    return RuleMatch({root: emit_sum(b, [(1, outer)] + rest, outer_const)}, tuple(sorted(steps)))


def _merge_logs(ctx: Ctx, root: Node, s) -> Iterable[RuleMatch]:
    b = ctx.b
    logs = [(sign, t) for sign, t in s.terms
            if isinstance(t, Node) and t.op == "log" and t.single_use() and nonneg(t.args[0])]
    if len(logs) < 2:
        return
    num = [t.args[0] for sign, t in logs if sign > 0]
    den = [t.args[0] for sign, t in logs if sign < 0]
    sign = 1
    if not num:
        num, den, sign = den, [], -1
    arg = multiply_all(b, num)
    if den:
        arg = b.op("divide", arg, multiply_all(b, den))
    rest = [(sg, t) for sg, t in s.terms if not any(t is lt for _, lt in logs)]
    const = fold_sum_constants(b, s.consts, root.dtype, root.shape)
    new = emit_sum(b, [(sign, b.op("log", arg))] + rest, const)
    yield RuleMatch({root: new}, ("add_merge_log",))


# ---------------------------------------------------------------------------------------------
# Reductions (Table 4 rows 9–10 and their family)
# ---------------------------------------------------------------------------------------------
_REDUCE_ROOTS = ("sum", "mean", "max", "min")
_SWAP = {"max": "min", "min": "max", "sum": "sum", "mean": "mean"}


def _uniform(v: Value, axes, rank: int) -> bool:
    """``v`` is constant along every reduced axis (size 1 there once broadcast-aligned)."""
    shape = aligned(v.shape, rank)
    return len(shape) == rank and all(shape[a] == 1 for a in axes)


def _reduced_layout(b: Builder, u: Value, rank: int, axes, keepdims: bool) -> Value:
    """A value uniform along ``axes`` reshaped to broadcast against the reduction's result."""
    shape = aligned(u.shape, rank)
    target = shape if keepdims else tuple(d for i, d in enumerate(shape) if i not in axes)
    return u if tuple(u.shape) == target else b.op("reshape", u, shape=target)


def _full_extent(v: Value, x: Value, axes) -> bool:
    return v.ndim == x.ndim and all(v.shape[a] == x.shape[a] for a in axes)


@_declare(
    name="reduce_pull_uniform_factor", prop="distributive", roots=_REDUCE_ROOTS,
    lhs="ReduceSum(c ⊙ A), ReduceMax(c ⊙ A)  (c constant along the reduced axes)",
    rhs="c ⊙ ReduceSum(A), c ⊙ ReduceMax(A) (ReduceMin when c <= 0)", flops="2mn → mn + m",
    preconditions=("c broadcasts with size 1 on every reduced axis",
                   "max/min: c a constant of one sign, or provably >= 0"))
def _reduce_pull_factor(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    x = root.args[0]
    if not (isinstance(x, Node) and x.single_use() and x.op in _PRODUCT_ROOTS
            and is_float(x.dtype)):
        return
    axes, rank = root.attrs["axis"], x.ndim
    prod = combine_powers(flatten_product(x))
    uni, rest = Product(x.dtype), Product(x.dtype)
    for c, e in prod.consts:
        (uni if _uniform(c, axes, rank) else rest).consts.append((c, e))
    for f, e in prod.factors:
        (uni if _uniform(f, axes, rank) else rest).factors.append((f, e))
    for inner in prod.abs_inner:
        (uni if _uniform(inner, axes, rank) else rest).abs_inner.append(inner)
    for inner in prod.exp_inner:
        (uni if _uniform(inner, axes, rank) else rest).exp_inner.append(inner)
    if uni.empty() or rest.empty():
        return
    op = root.op
    if op in ("max", "min"):
        op = _extremum_after_scaling(uni, op)
    b = ctx.b
    p = emit_product(b, rest, x.shape)
    if not _full_extent(p, x, axes):
        return
    red = b.op(op, p, axis=axes, keepdims=root.attrs["keepdims"])
    u = _reduced_layout(b, emit_product(b, uni, x.shape), rank, axes, root.attrs["keepdims"])
    steps = {"reduce_pull_uniform_factor"} | rest.steps | uni.steps
    if ctx.allows(steps):
        yield RuleMatch({root: b.op("multiply", red, u)}, tuple(sorted(steps)))


def _extremum_after_scaling(uni: Product, op: str) -> str:
    """max(c·A) is c·max(A) for c >= 0 and c·min(A) for c <= 0; refuse a mixed sign."""
    if any(not nonneg(f) for f, _ in uni.factors):
        raise Refuse("max/min: a non-constant scale of unknown sign")
    sign = 1
    for c, e in uni.consts:
        v = c.value()
        if np.all(v >= 0):
            continue
        if np.all(v <= 0) and e.denominator == 1:
            sign *= -1 if e.numerator % 2 else 1
            continue
        raise Refuse("max/min: a constant of mixed sign")
    return op if sign > 0 else _SWAP[op]


@_declare(
    name="reduce_pull_uniform_term", prop="distributive", roots=_REDUCE_ROOTS,
    lhs="ReduceSum(A + c), ReduceMean(A + c), ReduceMax(A + c)",
    rhs="ReduceSum(A) + k·c, ReduceMean(A) + c, ReduceMax(A) + c", flops="2mn → mn + m",
    preconditions=("c broadcasts with size 1 on every reduced axis",
                   "max/min: the remaining terms are added, not subtracted"))
def _reduce_pull_term(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    x = root.args[0]
    if not (isinstance(x, Node) and x.single_use() and x.op in _SUM_ROOTS and is_float(x.dtype)):
        return
    axes, rank, keep = root.attrs["axis"], x.ndim, root.attrs["keepdims"]
    s = flatten_sum(x)
    uni_t = [(sg, t) for sg, t in s.terms if _uniform(t, axes, rank)]
    rest_t = [(sg, t) for sg, t in s.terms if not _uniform(t, axes, rank)]
    uni_c = [(sg, c) for sg, c in s.consts if _uniform(c, axes, rank)]
    rest_c = [(sg, c) for sg, c in s.consts if not _uniform(c, axes, rank)]
    if not (uni_t or uni_c) or not (rest_t or rest_c):
        return
    if root.op in ("max", "min") and any(sg < 0 for sg, _ in rest_t + rest_c):
        return
    b = ctx.b
    p = emit_sum(b, rest_t, fold_sum_constants(b, rest_c, x.dtype, x.shape))
    if not _full_extent(p, x, axes):
        return
    red = b.op(root.op, p, axis=axes, keepdims=keep)
    u_const = fold_sum_constants(b, uni_c, x.dtype, x.shape)
    if not uni_t and u_const is None:
        return
    u = emit_sum(b, uni_t, u_const) if uni_t else u_const
    u = _reduced_layout(b, u, rank, axes, keep)
    if root.op == "sum":
        count = int(np.prod([x.shape[a] for a in axes]))
        u = b.op("multiply", u, b.const(count, x.dtype))
    yield RuleMatch({root: b.op("add", red, u)}, ("reduce_pull_uniform_term",))


@_declare(
    name="reduce_negate", prop="commutative", roots=_REDUCE_ROOTS, exact=True, rtol=0.0,
    lhs="ReduceSum(−A), ReduceMax(−A)", rhs="−ReduceSum(A), −ReduceMin(A)",
    flops="2mn → mn + m")
def _reduce_negate(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    x = root.args[0]
    if isinstance(x, Node) and x.single_use() and x.op == "negative" and is_float(x.dtype):
        b = ctx.b
        red = b.op(_SWAP[root.op], x.args[0], **root.attrs)
        yield RuleMatch({root: b.op("negative", red)}, ("reduce_negate",))


@_declare(
    name="reduce_prod_exp", prop="commutative", roots=("prod",), table4=(10,),
    lhs="ReduceProd(Exp(A))", rhs="Exp(ReduceSum(A))", flops="2mn → mn + m",
    preconditions=("floating point; over/underflow behaviour changes (exact in reals)",))
def _reduce_prod_exp(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    x = root.args[0]
    if isinstance(x, Node) and x.single_use() and x.op == "exp" and is_float(x.dtype):
        b = ctx.b
        yield RuleMatch({root: b.op("exp", b.op("sum", x.args[0], **root.attrs))},
                        ("reduce_prod_exp",))


@_declare(
    name="reduce_monotone_unary", prop="commutative", roots=("max", "min"),
    lhs="ReduceMax(Exp(A)), ReduceMax(Log(A)), ReduceMax(√A)",
    rhs="Exp(ReduceMax(A)), Log(ReduceMax(A)), √ReduceMax(A)", flops="2mn → mn + m",
    preconditions=("f increasing; Log/√ need A provably >= 0 (NaN orders differently)",))
def _reduce_monotone(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    x = root.args[0]
    if not (isinstance(x, Node) and x.single_use() and is_float(x.dtype)):
        return
    if x.op == "exp" or (x.op in ("log", "sqrt") and nonneg(x.args[0])):
        b = ctx.b
        yield RuleMatch({root: b.op(x.op, b.op(root.op, x.args[0], **root.attrs))},
                        ("reduce_monotone_unary",))


@_declare(
    name="reduce_sum_left_shift", prop="commutative", roots=("sum",), table4=(9,), exact=True,
    rtol=0.0, lhs="ReduceSum(BitShift(A, k, LEFT))", rhs="BitShift(ReduceSum(A), k, LEFT)",
    flops="2mn → mn + m",
    preconditions=("integer dtype", "left shift only: Σ⌊a/2^k⌋ ≠ ⌊Σa/2^k⌋ for right shifts",
                   "k a constant in [0, bits) and uniform along the reduced axes"))
def _reduce_sum_shift(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    x = root.args[0]
    if not (isinstance(x, Node) and x.single_use() and x.op == "left_shift"
            and is_int(x.dtype)):
        return
    a, k = x.args
    axes, rank = root.attrs["axis"], x.ndim
    bits = np.iinfo(np.dtype(x.dtype)).bits
    if not (is_const(k) and _uniform(k, axes, rank) and _full_extent(a, x, axes)):
        return
    kv = k.value()
    if not (np.all(kv >= 0) and np.all(kv < bits)):
        return
    b = ctx.b
    red = b.op("sum", a, **root.attrs)
    shift = _reduced_layout(b, k, rank, axes, root.attrs["keepdims"])
    yield RuleMatch({root: b.op("left_shift", red, shift)}, ("reduce_sum_left_shift",))


@_declare(
    name="reduce_merge_nested", prop="associative", roots=("sum", "mean", "max", "min", "prod"),
    lhs="ReduceSum(ReduceSum(A, ax1), ax2)", rhs="ReduceSum(A, ax1 ∪ ax2)",
    flops="mn + m → mn", preconditions=("both reductions of the same kind",))
def _reduce_merge(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    x = root.args[0]
    if not (isinstance(x, Node) and x.single_use() and x.op == root.op):
        return
    y = x.args[0]
    inner, outer = x.attrs["axis"], root.attrs["axis"]
    if x.attrs["keepdims"]:
        outer_y = set(outer)
    else:
        remaining = [i for i in range(y.ndim) if i not in inner]
        outer_y = {remaining[j] for j in outer}
    axes = tuple(sorted(set(inner) | outer_y))
    b = ctx.b
    red = b.op(root.op, y, axis=axes, keepdims=True)
    if red.shape != root.shape:
        red = b.op("reshape", red, shape=root.shape)
    yield RuleMatch({root: red}, ("reduce_merge_nested",))


# ---------------------------------------------------------------------------------------------
# Scales and matmul (Figure 2(b); attention's 1/sqrt(d); GELU's 0.5)
# ---------------------------------------------------------------------------------------------
@_declare(
    name="scale_into_weights", prop="associative", roots=("multiply", "divide"),
    lhs="(X·W + b) ⊙ c, through reshape/permute_dims/split to the weights",
    rhs="X·(W ⊙ c) + b ⊙ c, folded", flops="mn·(2k+1) → mn·2k",
    preconditions=("c constant: a scalar, or varying only along the columns/rows a matmul "
                   "can absorb", "c finite and non-zero (and 1/c finite for a divide)",
                   "every node on the path is used only by the path",
                   "the path ends in constants on every branch"))
def _scale_into_weights(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    if not is_float(root.dtype):
        return
    pairs = [(root.args[0], root.args[1], False)]
    if root.op == "multiply":
        pairs.append((root.args[1], root.args[0], False))
    else:
        pairs = [(root.args[0], root.args[1], True)]
    for v, c, invert in pairs:
        if not is_const(c) or is_const(v) or broadcast(v.shape, c.shape) != v.shape:
            continue
        scale = c.value()
        # x / 0 keeps ±inf through later ops, while 0 · (1/0) in the folded weights is NaN:
        # only finite, non-zero scales move into the weights.
        if not np.all(np.isfinite(scale)) or np.any(scale == 0):
            continue
        if invert:
            with np.errstate(all="ignore"):
                scale = (1 / scale).astype(root.dtype)
            if not np.all(np.isfinite(scale)):
                continue
        extra: dict = {}
        try:
            new = _absorb(ctx.b, v, np.asarray(scale, dtype=root.dtype), extra)
        except Refuse:
            continue
        yield RuleMatch({root: new, **extra}, ("scale_into_weights",))


def _absorb(b: Builder, v: Value, s: np.ndarray, extra: dict) -> Value:
    """A value equal to ``v ⊙ s`` whose only change is in constants (see the rule)."""
    if is_const(v):
        shape = broadcast(v.shape, s.shape)
        return b.fold(("scale", s.shape, s.tobytes()), [v], shape, v.dtype,
                      lambda: (v.value() * s).astype(v.dtype))
    if not (isinstance(v, Node) and v.single_use()):
        raise Refuse("the scale would change a value used elsewhere")
    if broadcast(v.shape, s.shape) != v.shape:
        raise Refuse("the scale would enlarge the value")
    op, args = v.op, v.args
    if op == "multiply":
        order = (1, 0) if is_const(args[1]) else (0, 1)
        for i in order:
            try:
                new = _absorb(b, args[i], _fit(s, args[i]), extra)
            except Refuse:
                continue
            return b.op("multiply", *([new, args[1]] if i == 0 else [args[0], new]))
        raise Refuse("no operand of the multiply absorbs the scale")
    if op == "divide":
        return b.op("divide", _absorb(b, args[0], _fit(s, args[0]), extra), args[1])
    if op in ("add", "subtract"):
        return b.op(op, *[_absorb(b, a, _fit(s, a), extra) for a in args])
    if op == "negative":
        return b.op("negative", _absorb(b, args[0], s, extra))
    if op == "matmul":
        return _absorb_matmul(b, v, s, extra)
    if op == "permute_dims":
        full = s.reshape(aligned(s.shape, v.ndim))
        inverse = np.argsort(v.attrs["axes"])
        return b.op("permute_dims", _absorb(b, args[0], np.transpose(full, inverse), extra),
                    axes=v.attrs["axes"])
    if op == "reshape":
        return b.op("reshape", _absorb(b, args[0], _through_reshape(s, args[0], v), extra),
                    shape=v.attrs["shape"])
    if op == "get_item":
        return _absorb_split_piece(b, v, s, extra)
    raise Refuse(f"the scale cannot pass {op}")


def _fit(s: np.ndarray, operand: Value) -> np.ndarray:
    """``s`` for one operand of a broadcasting op: constants may grow, others may not."""
    if is_const(operand):
        return s
    full = s.reshape(aligned(s.shape, max(s.ndim, operand.ndim)))
    extra = full.ndim - operand.ndim
    if extra and any(d != 1 for d in full.shape[:extra]):
        raise Refuse("the scale has axes the operand lacks")
    trimmed = full.reshape(full.shape[extra:])
    if any(t != 1 and o == 1 for t, o in zip(trimmed.shape, operand.shape)):
        raise Refuse("the operand is broadcast along an axis the scale varies on")
    return trimmed


def _through_reshape(s: np.ndarray, x: Value, v: Node) -> np.ndarray:
    if s.size == 1:
        return s.reshape(())
    full = s.reshape(aligned(s.shape, v.ndim))
    if all(d == 1 for d in full.shape[:-1]) and x.shape[-1] == v.shape[-1]:
        return full.reshape(full.shape[-1:])
    raise Refuse("a non-scalar scale cannot pass this reshape")


def _absorb_matmul(b: Builder, v: Node, s: np.ndarray, extra: dict) -> Value:
    a, w = v.args
    full = s.reshape(aligned(s.shape, v.ndim))
    if s.size == 1:
        for i in ((1, 0) if is_const(w) else (0, 1)):
            try:
                new = _absorb(b, v.args[i], s.reshape(()), extra)
            except Refuse:
                continue
            return b.op("matmul", *([new, w] if i == 0 else [a, new]))
        raise Refuse("neither matmul operand absorbs the scale")
    if all(d == 1 for d in full.shape[:-1]):
        return b.op("matmul", a, _absorb(b, w, full.reshape(full.shape[-1:]), extra))
    if all(d == 1 for i, d in enumerate(full.shape) if i != v.ndim - 2):
        return b.op("matmul", _absorb(b, a, full.reshape(full.shape[-2], 1), extra), w)
    raise Refuse("the scale varies along batch axes of a matmul")


def _absorb_split_piece(b: Builder, v: Node, s: np.ndarray, extra: dict) -> Value:
    split = v.args[0]
    y = split.args[0]
    if split.ext_uses or any(u.op != "get_item" for u in split.users):
        raise Refuse("the split has a non-get_item use")
    if not (isinstance(y, Node) and y.single_use()):
        raise Refuse("the split's input is used elsewhere")
    axis, index = split.attrs["axis"], v.attrs["index"]
    bounds = (0, *split.attrs["indices"], y.shape[axis])
    piece = s.reshape(aligned(s.shape, y.ndim))
    shape = list(piece.shape)
    shape[axis] = y.shape[axis]
    full = np.ones(shape, dtype=s.dtype)
    index_slice = [slice(None)] * y.ndim
    index_slice[axis] = slice(bounds[index], bounds[index + 1])
    full[tuple(index_slice)] = piece
    new_split = b.op("split", _absorb(b, y, full, extra), axis=axis,
                     indices=split.attrs["indices"])
    for user in split.users:
        if user is not v:
            extra[user] = b.op("get_item", new_split, index=user.attrs["index"])
    return b.op("get_item", new_split, index=index)


@_declare(
    name="scale_across_matmul", prop="associative", roots=("matmul", "multiply", "divide"),
    lhs="(c ⊙ A)·B,  (A·B) ⊙ c", rhs="A·(c ⊙ B) with c folded into a weight B, or c on the "
    "smallest of A, B, A·B", flops="mk + 2mnk → 2mnk (B a weight)",
    preconditions=("c a scalar constant", "the scaled operand chain is used only here"))
def _scale_across_matmul(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    if not is_float(root.dtype):
        return
    b = ctx.b
    if root.op == "matmul":
        for side in (0, 1):
            try:
                found = _extract_scalar(ctx, root.args[side])
            except Refuse:
                continue
            if found is None:
                continue
            c, rest = found
            other = root.args[1 - side]
            for target in ("other", "out"):
                if target == "out" and is_const(other):
                    continue
                if target == "other":
                    scaled = b.op("multiply", other, b.const(c, root.dtype))
                    ops = [rest, scaled] if side == 0 else [scaled, rest]
                    new = b.op("matmul", *ops)
                else:
                    ops = [rest, other] if side == 0 else [other, rest]
                    new = b.op("multiply", b.op("matmul", *ops), b.const(c, root.dtype))
                yield RuleMatch({root: new}, ("scale_across_matmul",))
        return
    m, c = root.args
    if root.op == "multiply" and is_const(m):
        m, c = c, m
    cv = scalar_const_value(c)
    if cv is None or not (isinstance(m, Node) and m.op == "matmul" and m.single_use()):
        return
    if root.op == "divide":
        cv = float(np.asarray(1, dtype=root.dtype) / np.asarray(cv, dtype=root.dtype))
    for side in (0, 1):
        operand = m.args[side]
        if is_const(operand):
            continue  # scale_into_weights folds it
        scaled = b.op("multiply", operand, b.const(cv, root.dtype))
        ops = [scaled, m.args[1]] if side == 0 else [m.args[0], scaled]
        yield RuleMatch({root: b.op("matmul", *ops)}, ("scale_across_matmul",))


def _extract_scalar(ctx: Ctx, operand: Value):
    """(c, x) with ``operand == c ⊙ x``: a scalar constant factor of a product, found through
    reshape/permute_dims; None when there is none."""
    layout = []
    v = operand
    while isinstance(v, Node) and v.single_use() and v.op in ("reshape", "permute_dims"):
        layout.append(v)
        v = v.args[0]
    if not (isinstance(v, Node) and v.single_use() and v.op in _PRODUCT_ROOTS
            and is_float(v.dtype)):
        return None
    prod = combine_powers(flatten_product(v))
    scalars = [(c, e) for c, e in prod.consts if c.size == 1]
    if not scalars:
        return None
    rest = prod.copy()
    rest.consts = [(c, e) for c, e in prod.consts if c.size != 1]
    if not (rest.factors or rest.abs_inner or rest.exp_inner):
        return None
    value = 1.0
    for c, e in scalars:
        value *= float(np.power(np.float64(c.value().reshape(())), float(e)))
    x = emit_product(ctx.b, rest, v.shape)
    if x.shape != v.shape or not ctx.allows(rest.steps):
        raise Refuse("the rest of the product changes shape")
    for node in reversed(layout):
        x = ctx.b.op(node.op, x, **node.attrs)
    return np.asarray(value, dtype=operand.dtype), x


@_declare(
    name="matmul_distribute", prop="distributive", roots=_SUM_ROOTS,
    lhs="A·B + A·C,  A·C + B·C", rhs="A·(B + C),  (A + B)·C", flops="4mnk + mn → 2mnk + nk",
    preconditions=("the shared operand is the same value", "the other operands have one shape"))
def _matmul_distribute(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    m1, m2 = root.args
    if not all(isinstance(m, Node) and m.op == "matmul" and m.single_use() for m in (m1, m2)):
        return
    if m1 is m2:
        return
    b = ctx.b
    if key(m1.args[0]) == key(m2.args[0]) and m1.args[1].shape == m2.args[1].shape:
        inner = b.op(root.op, m1.args[1], m2.args[1])
        yield RuleMatch({root: b.op("matmul", m1.args[0], inner)}, ("matmul_distribute",))
    if key(m1.args[1]) == key(m2.args[1]) and m1.args[0].shape == m2.args[0].shape:
        inner = b.op(root.op, m1.args[0], m2.args[0])
        yield RuleMatch({root: b.op("matmul", inner, m1.args[1])}, ("matmul_distribute",))


@_declare(
    name="matmul_concat_shared_input", prop="distributive", roots=("matmul",), exact=True,
    rtol=0.0, lhs="A·W1 (+ b1), A·W2 (+ b2), A·W3 (+ b3)  (weights)",
    rhs="split(A·concat(W1, W2, W3) (+ concat(b1, b2, b3)))",
    flops="same FLOPs; A loaded once instead of three times (one matmul kernel)",
    preconditions=("W_i constant 2-D weights with the same rows and dtype",
                   "the same value A on the left of every matmul",
                   "no two products meet again through elementwise operators"))
def _matmul_concat(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    a, w = root.args
    if not _concat_weight(w):
        return
    siblings = [u for u in a.users
                if u.op == "matmul" and u.alive and u.attached and u.args[0] is a
                and _concat_weight(u.args[1]) and u.args[1].shape[0] == w.shape[0]
                and u.dtype == root.dtype]
    siblings = sorted(set(siblings), key=lambda n: n.order)
    if len(siblings) < 2 or siblings[0] is not root or _meet_elementwise(siblings):
        return
    b = ctx.b
    weights = [s.args[1] for s in siblings]
    merged = b.op("matmul", a, b.concat_const(weights, axis=1))
    outs = siblings
    biased = [_bias_add(s) for s in siblings]
    if all(pair is not None for pair in biased):  # concatenate the biases too: one add
        biases = [bias for _, bias in biased]
        cat = b.fold(("concat_bias",), biases, (sum(w.shape[1] for w in weights),), root.dtype,
                     lambda: np.concatenate([c.value().reshape(-1) for c in biases]))
        merged = b.op("add", merged, cat)
        outs = [add for add, _ in biased]
    indices, acc = [], 0
    for wt in weights[:-1]:
        acc += wt.shape[1]
        indices.append(acc)
    split = b.op("split", merged, axis=merged.ndim - 1, indices=tuple(indices))
    roots = {out: b.op("get_item", split, index=i) for i, out in enumerate(outs)}
    yield RuleMatch(roots, ("matmul_concat_shared_input",))


def _meet_elementwise(products: list[Node]) -> bool:
    """Whether two of ``products`` reach one operator through elementwise operators only
    (SwiGLU's ``silu(A·W1)·(A·W2)``). Apart, the last matmul takes that operator as its epilogue
    and the other product is the only intermediate; merged, the split halves of the wide result
    lie in different GEMM tiles, so the whole ``A·concat(W1, W2)`` is kept (stored, read back,
    and alive at once: Llama's gate/up, 1.41 MB where the two apart keep 0.70 MB)."""
    reached: dict[int, int] = {}
    for n, product in enumerate(products):
        seen, todo = set(), [product]
        while todo:
            node = todo.pop()
            for user in node.users:
                if (user.op in ELEMENTWISE_BINARY or user.op in ELEMENTWISE_UNARY) \
                        and id(user) not in seen:
                    seen.add(id(user))
                    if reached.setdefault(id(user), n) != n:
                        return True
                    todo.append(user)
    return False


def _concat_weight(w: Value) -> bool:
    return isinstance(w, Leaf) and w.is_const and w.ndim == 2


def _bias_add(m: Node):
    """(add, bias) when ``m``'s only use adds a constant varying along the last axis only."""
    if m.ext_uses or len(m.users) != 1 or m.users[0].op != "add":
        return None
    add = m.users[0]
    bias = add.args[1] if add.args[0] is m else add.args[0]
    if (add.args[0] is add.args[1] or not is_const(bias) or add.shape != m.shape
            or bias.shape[-1:] != m.shape[-1:] or any(d != 1 for d in bias.shape[:-1])):
        return None
    return add, bias


def _is_last_two_swap(axes, ndim: int) -> bool:
    return ndim >= 2 and tuple(axes) == tuple(range(ndim - 2)) + (ndim - 1, ndim - 2)


@_declare(
    name="transpose_of_matmul", prop="commutative", roots=("permute_dims",), exact=True,
    rtol=0.0, lhs="(A·B)ᵀ with A or B a transpose or a weight", rhs="Bᵀ·Aᵀ",
    flops="same FLOPs; one or two transposes fewer",
    preconditions=("the permutation swaps the last two axes only",))
def _transpose_of_matmul(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    m = root.args[0]
    if not (_is_last_two_swap(root.attrs["axes"], root.ndim) and isinstance(m, Node)
            and m.op == "matmul" and m.single_use()):
        return
    b = ctx.b
    saved = 0
    swapped = []
    for x in (m.args[1], m.args[0]):
        if isinstance(x, Node) and x.op == "permute_dims" and _is_last_two_swap(
                x.attrs["axes"], x.ndim):
            swapped.append(x.args[0])
            saved += 1
            continue
        axes = tuple(range(x.ndim - 2)) + (x.ndim - 1, x.ndim - 2)
        if is_const(x):
            saved += 1
        swapped.append(b.op("permute_dims", x, axes=axes))
    if saved:
        yield RuleMatch({root: b.op("matmul", *swapped)}, ("transpose_of_matmul",))


# ---------------------------------------------------------------------------------------------
# Layout and shifts
# ---------------------------------------------------------------------------------------------
@_declare(
    name="permute_compose", prop="associative", roots=("permute_dims",), exact=True, rtol=0.0,
    lhs="Transpose(Transpose(A, p1), p2)", rhs="Transpose(A, p1∘p2), or A",
    flops="0 → 0; one transpose fewer")
def _permute_compose(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    x = root.args[0]
    if not (isinstance(x, Node) and x.op == "permute_dims"):
        return
    p1, p2 = x.attrs["axes"], root.attrs["axes"]
    composed = tuple(p1[i] for i in p2)
    if composed == tuple(range(len(composed))):
        yield RuleMatch({root: x.args[0]}, ("permute_compose",))
    else:
        yield RuleMatch({root: ctx.b.op("permute_dims", x.args[0], axes=composed)},
                        ("permute_compose",))


@_declare(
    name="reshape_compose", prop="associative", roots=("reshape",), exact=True, rtol=0.0,
    lhs="Reshape(Reshape(A, s1), s2), Reshape(A, shape(A))", rhs="Reshape(A, s2), A",
    flops="0 → 0; one reshape fewer")
def _reshape_compose(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    x = root.args[0]
    if x.shape == root.shape:
        yield RuleMatch({root: x}, ("reshape_compose",))
        return
    if isinstance(x, Node) and x.op == "reshape":
        inner = x.args[0]
        new = inner if inner.shape == root.shape else ctx.b.op(
            "reshape", inner, shape=root.attrs["shape"])
        yield RuleMatch({root: new}, ("reshape_compose",))


_ROW_UNARY = ("negative", "abs", "sqrt", "rsqrt", "square", "exp", "log")
_ROW_BINARY = ("add", "subtract", "multiply", "divide", "power")


@_declare(
    name="reshape_through_rowwise", prop="commutative", roots=("reshape",), exact=True,
    rtol=0.0, lhs="Reshape(Reshape(X, (B·M, K))·W + b, (B, M, N))", rhs="X·W + b",
    flops="0 → 0; two reshapes fewer",
    preconditions=("the inner reshape only merges leading axes (the last axis is kept)",
                   "the outer reshape restores exactly those leading axes",
                   "every op between acts row by row: 2-D weight matmul, element-wise ops "
                   "whose other operand varies only along the last axis"))
def _reshape_through_rowwise(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    path = []
    v = root.args[0]
    while isinstance(v, Node) and v.single_use():
        data = _row_data_operand(v)
        if data is None:
            break
        path.append((v, data))
        v = v.args[data]
    if not (path and isinstance(v, Node) and v.op == "reshape" and v.single_use()):
        return
    x = v.args[0]
    if x.ndim < 1 or v.ndim < 1 or x.shape[-1] != v.shape[-1]:
        return
    if root.shape[:-1] != x.shape[:-1] or root.shape[-1] != path[0][0].shape[-1]:
        return
    b = ctx.b
    new = x
    for node, data in reversed(path):
        args = list(node.args)
        args[data] = new
        new = b.op(node.op, *args, **node.attrs)
    yield RuleMatch({root: new}, ("reshape_through_rowwise",))


def _row_data_operand(v: Node) -> int | None:
    """Which operand carries the rows when ``v`` maps each row (last axis) independently."""
    if v.op in _ROW_UNARY:
        return 0
    if v.op in _ROW_BINARY:
        rowless = [a.ndim <= 1 or all(d == 1 for d in a.shape[:-1]) for a in v.args]
        if rowless[0] != rowless[1]:
            return 1 if rowless[0] else 0
        return None
    if v.op == "matmul" and v.args[0].ndim == 2 and v.args[1].ndim == 2:
        return 0
    return None


@_declare(
    name="shift_compose", prop="associative", roots=("left_shift", "right_shift"), exact=True,
    rtol=0.0, lhs="BitShift(BitShift(A, a), b)  (same direction)", rhs="BitShift(A, a + b)",
    flops="2mn → mn", preconditions=("integer dtype", "a, b scalar constants, a + b < bits"))
def _shift_compose(ctx: Ctx, root: Node) -> Iterable[RuleMatch]:
    x, amount = root.args
    if not (isinstance(x, Node) and x.op == root.op and is_int(root.dtype)):
        return
    a, b_ = scalar_const_value(x.args[1]), scalar_const_value(amount)
    if a is None or b_ is None or x.args[1].shape != () or amount.shape != ():
        return
    bits = np.iinfo(np.dtype(root.dtype)).bits
    if not (0 <= a and 0 <= b_ and a + b_ < bits):
        return
    total = ctx.b.const(int(a + b_), root.dtype)
    yield RuleMatch({root: ctx.b.op(root.op, x.args[0], total)}, ("shift_compose",))


# ---------------------------------------------------------------------------------------------
# Engine generators hang off the first rule of each engine
# ---------------------------------------------------------------------------------------------
ENGINES = {"product": (_PRODUCT_ROOTS, _product_candidates),
           "sum": (_SUM_ROOTS, _sum_candidates)}


def generators_by_op(enabled: frozenset[str]) -> dict[str, list[Callable]]:
    """Root op → the candidate generators to run there, for the enabled rules."""
    table: dict[str, list[Callable]] = {}
    for engine, (roots, gen) in ENGINES.items():
        if any(r.engine == engine and r.name in enabled for r in RULES.values()):
            for op in roots:
                table.setdefault(op, []).append(gen)
    for rule in RULES.values():
        if rule.engine == "standalone" and rule.name in enabled:
            for op in rule.roots:
                table.setdefault(op, []).append(rule.generate)
    return table


def rules_by_property() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {p: [] for p in PROPERTIES}
    for rule in RULES.values():
        out[rule.prop].append(rule.name)
    return out

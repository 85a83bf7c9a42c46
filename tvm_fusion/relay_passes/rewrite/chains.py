"""Products and sums as multisets: matching modulo associativity and commutativity.

Associative-commutative matching is NP-complete in general (DNNFusion §4.2); over chains of one
operator it is easy: flatten the chain into a multiset and match on the multiset. A product
``(A ⊙ √B) ⊙ (√B ⊙ C)`` becomes the factors ``A¹, B^½, B^½, C¹``; ``Recip(A) ⊙ Recip(A ⊙ B)``
becomes ``A⁻¹, A⁻¹, B⁻¹``. Every operand order and bracketing of a chain flattens to the same
multiset, so one rule on multisets covers all of Table 4's associative/commutative variants.

A chain only extends through nodes that die with the rewrite (used once, or used only inside
the chain), so flattening never duplicates work that stays live.

Exponents are exact fractions. Each step that moves an exponent checks the real-number law it
relies on, and the IEEE corner cases (NaN from negative bases, ``0 · ∞``) that could make the
rewritten graph differ from the original:

* ``(x·y)^e = x^e·y^e`` and ``(x^k)^e = x^(k·e)``: integer exponents, or provably non-negative
  bases (``sqrt(x)² = x`` fails for ``x < 0``);
* ``x^a·x^b = x^(a+b)``: as above, and ``a, b`` of one sign unless ``x`` is provably positive
  and finite (``x·x⁻¹`` is NaN at 0, not 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from .ir import (
    Builder,
    Leaf,
    Node,
    Refuse,
    Value,
    broadcast,
    exponent_of_const,
    is_const,
    is_float,
    key,
    nonneg,
    positive,
)

ONE = Fraction(1)
_POWER_LIKE = {"sqrt": Fraction(1, 2), "rsqrt": Fraction(-1, 2), "square": Fraction(2)}


@dataclass
class Product:
    """``Π consts^e · Π base^e · abs(Π abs_inner) · exp(Σ exp_inner)``."""

    dtype: str
    consts: list[tuple[Leaf, Fraction]] = field(default_factory=list)
    factors: list[tuple[Value, Fraction]] = field(default_factory=list)
    abs_inner: list[Value] = field(default_factory=list)
    exp_inner: list[Value] = field(default_factory=list)
    steps: set[str] = field(default_factory=set)

    def copy(self) -> Product:
        return Product(self.dtype, list(self.consts), list(self.factors), list(self.abs_inner),
                       list(self.exp_inner), set(self.steps))

    def empty(self) -> bool:
        return not (self.consts or self.factors or self.abs_inner or self.exp_inner)


def _dies_with(v: Value, allowed: set) -> bool:
    return isinstance(v, Node) and (v.single_use() or v in allowed)


def _power_of_power_ok(base: Value, k: Fraction, e: Fraction) -> bool:
    if e.denominator == 1 and (k.denominator == 1 or (k * e).denominator != 1):
        return True
    return nonneg(base)


def flatten_product(root: Node, allowed: set | None = None) -> Product:
    """The factors of the product chain rooted at ``root`` (see the module docstring)."""
    allowed = allowed or set()
    prod = Product(root.dtype)

    def visit(v: Value, e: Fraction, top: bool = False) -> None:
        if is_const(v):
            if not _is_scalar_one(v):
                prod.consts.append((v, e))
            return
        if not (top or _dies_with(v, allowed)) or v.dtype != root.dtype:
            prod.factors.append((v, e))
            return
        op, args = v.op, v.args
        if op in ("multiply", "divide"):
            if e != ONE and e.denominator != 1 and not all(nonneg(a) for a in args):
                prod.factors.append((v, e))
                return
            if e != ONE:
                prod.steps.add("mul_distribute_power")
            visit(args[0], e)
            visit(args[1], e if op == "multiply" else -e)
            return
        if op == "negative" and e.denominator == 1:
            prod.consts.append((_minus_one(v.dtype), e))
            visit(args[0], e)
            return
        k = _POWER_LIKE.get(op)
        if op == "power":
            k = exponent_of_const(args[1])
        if k is not None and _power_of_power_ok(args[0], k, e):
            if e != ONE:
                prod.steps.add("mul_combine_powers")
            visit(args[0], k * e)
            return
        if op == "abs" and e == ONE:
            prod.abs_inner.append(args[0])
            return
        if op == "abs" and e.denominator == 1 and e.numerator % 2 == 0:
            visit(args[0], e)
            return
        if op == "exp" and e == ONE:
            prod.exp_inner.append(args[0])
            return
        prod.factors.append((v, e))

    visit(root, ONE, top=True)
    return prod


def flatten_product_deep(root: Node) -> Product:
    """``flatten_product``, also entering shared nodes whose every use is inside the chain."""
    allowed: set = set()
    for _ in range(3):
        prod = flatten_product(root, allowed)
        inside = _chain_nodes(root, allowed)
        more = {v for v, _ in prod.factors
                if isinstance(v, Node) and v not in allowed and v.ext_uses == 0
                and v.users and all(u in inside for u in v.users)}
        if not more:
            return prod
        allowed |= more
    return flatten_product(root, allowed)


def _chain_nodes(root: Node, allowed: set) -> set:
    """Nodes of the product chain at ``root`` (the root and every node flattening enters)."""
    seen = {root}
    stack = [root]
    while stack:
        v = stack.pop()
        for a in v.args:
            if (isinstance(a, Node) and a not in seen and _dies_with(a, allowed)
                    and a.op in ("multiply", "divide", "negative", "sqrt", "rsqrt", "square",
                                 "power", "abs", "exp")):
                seen.add(a)
                stack.append(a)
    return seen


def _is_scalar_one(v: Leaf) -> bool:
    return v.shape == () and float(v.value()) == 1.0


def _minus_one(dtype: str) -> Leaf:
    return Leaf((), dtype, is_const=True, value=np.asarray(-1, dtype=dtype))


# ---------------------------------------------------------------------------------------------
# Normalising a product: the associative/commutative steps
# ---------------------------------------------------------------------------------------------
def combine_powers(prod: Product) -> Product:
    """``x^a · x^b → x^(a+b)`` for equal bases, where the module docstring says it is sound."""
    groups: dict = {}
    order: list = []
    for base, e in prod.factors:
        k = key(base)
        if k not in groups:
            groups[k] = (base, [])
            order.append(k)
        groups[k][1].append(e)
    out = prod.copy()
    out.factors = []
    for k in order:
        base, exps = groups[k]
        if len(exps) == 1:
            out.factors.append((base, exps[0]))
            continue
        merged = _merge_exponents(base, exps)
        if len(merged) < len(exps):
            out.steps.add("mul_combine_powers")
        out.factors.extend((base, e) for e in merged if e != 0)
    return out


def _merge_exponents(base: Value, exps: list[Fraction]) -> list[Fraction]:
    summable = all(e.denominator == 1 for e in exps) or nonneg(base)
    if not summable:
        return exps
    if positive(base):
        return [sum(exps, Fraction(0))]
    pos = [e for e in exps if e > 0]
    neg = [e for e in exps if e < 0]
    return ([sum(pos, Fraction(0))] if pos else []) + ([sum(neg, Fraction(0))] if neg else [])


def fold_constants(b: Builder, prod: Product, shape) -> Leaf | None:
    """The product of the constant factors, as one (lazily folded) constant, or None."""
    consts = prod.consts
    if not consts:
        return None
    if len(consts) == 1 and consts[0][1] == ONE:
        return consts[0][0]
    prod.steps.add("mul_fold_constants")
    for c, e in consts:
        if e.denominator != 1 and not nonneg(c):
            raise Refuse("fractional power of a possibly negative constant")
    out_shape = broadcast(*[c.shape for c, _ in consts])
    dtype = prod.dtype

    def thunk():
        acc = np.ones(out_shape, dtype=dtype)
        with np.errstate(all="ignore"):
            for c, e in consts:
                acc = acc * (c.value() if e == ONE else np.power(c.value(), float(e)))
        return acc.astype(dtype)

    folded = b.fold(("product", tuple(str(e) for _, e in consts)), [c for c, _ in consts],
                    out_shape, dtype, thunk)
    if folded.size <= 64 and len(shape) >= len(out_shape) and broadcast(shape, out_shape) == shape:
        if np.all(folded.value() == 1):
            return None
    return folded


# ---------------------------------------------------------------------------------------------
# Emitting products and sums
# ---------------------------------------------------------------------------------------------
def multiply_all(b: Builder, values: list[Value]) -> Value:
    """Multiply in the order that keeps intermediates smallest (broadcast-aware greedy)."""
    return _combine_all(b, "multiply", values)


def add_all(b: Builder, values: list[Value]) -> Value:
    return _combine_all(b, "add", values)


def _combine_all(b: Builder, op: str, values: list[Value]) -> Value:
    items = list(values)
    if not items:
        raise Refuse(f"empty {op}")
    while len(items) > 1:
        best = None
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                size = int(np.prod(broadcast(items[i].shape, items[j].shape)))
                both_const = is_const(items[i]) and is_const(items[j])
                rank = (not both_const, size, i, j)
                if best is None or rank < best[0]:
                    best = (rank, i, j)
        _, i, j = best
        merged = b.op(op, items[i], items[j])
        items = [v for k, v in enumerate(items) if k not in (i, j)] + [merged]
    return items[0]


def _power(b: Builder, base: Value, e: Fraction) -> Value:
    if e == ONE:
        return base
    if e == 2:
        return b.op("square", base)
    if e == Fraction(1, 2):
        return b.op("sqrt", base)
    return b.op("power", base, b.const(float(e), base.dtype))


def _grouped(prod: Product, sign: int) -> list[tuple[Fraction, list[Value]]]:
    """Factors of one sign grouped by |exponent|: ``a²·b² = (a·b)²``, one power, not two."""
    groups: dict[Fraction, list[Value]] = {}
    singles: list[tuple[Fraction, list[Value]]] = []
    for base, e in prod.factors:
        if (e > 0) != (sign > 0):
            continue
        mag = abs(e)
        if mag.denominator != 1 and not nonneg(base):
            singles.append((mag, [base]))
        else:
            groups.setdefault(mag, []).append(base)
    out = sorted(groups.items(), key=lambda kv: kv[0]) + singles
    if any(len(bases) > 1 and mag != ONE for mag, bases in out):
        prod.steps.add("mul_group_exponents")
    return out


def emit_product(b: Builder, prod: Product, shape) -> Value:
    """The normal form of ``prod``: numerator / denominator, one power per exponent group."""
    numer = [_power(b, multiply_all(b, bases), e) for e, bases in _grouped(prod, +1)]
    denom_groups = _grouped(prod, -1)
    if len(prod.abs_inner) > 1:
        prod.steps.add("mul_merge_abs")
    if prod.abs_inner:
        numer.append(b.op("abs", multiply_all(b, prod.abs_inner)))
    if len(prod.exp_inner) > 1:
        prod.steps.add("mul_merge_exp")
    if prod.exp_inner:
        numer.append(b.op("exp", add_all(b, prod.exp_inner)))
    const = fold_constants(b, prod, shape)
    if (not numer and const is None and len(denom_groups) == 1
            and denom_groups[0][0] == Fraction(1, 2)):
        return b.op("rsqrt", multiply_all(b, denom_groups[0][1]))
    if const is not None:
        if const.size == 1 and numer and np.all(const.value() == -1):
            numer[-1] = b.op("negative", numer[-1])
        else:
            numer.append(const)
    denom = [_power(b, multiply_all(b, bases), e) for e, bases in denom_groups]
    if not denom:
        if not numer:
            raise Refuse("the product is the constant 1")
        return multiply_all(b, numer)
    top = multiply_all(b, numer) if numer else b.const(1, prod.dtype)
    return b.op("divide", top, multiply_all(b, denom))


@dataclass
class Sum:
    """``Σ sign·term`` with the constant terms kept apart."""

    dtype: str
    terms: list[tuple[int, Value]] = field(default_factory=list)
    consts: list[tuple[int, Leaf]] = field(default_factory=list)


def flatten_sum(root: Node) -> Sum:
    out = Sum(root.dtype)

    def visit(v: Value, sign: int, top: bool = False) -> None:
        if is_const(v):
            out.consts.append((sign, v))
            return
        if isinstance(v, Node) and (top or v.single_use()) and v.dtype == root.dtype:
            if v.op == "add":
                visit(v.args[0], sign)
                visit(v.args[1], sign)
                return
            if v.op == "subtract":
                visit(v.args[0], sign)
                visit(v.args[1], -sign)
                return
            if v.op == "negative":
                visit(v.args[0], -sign)
                return
        out.terms.append((sign, v))

    visit(root, 1, top=True)
    return out


def fold_sum_constants(b: Builder, consts: list[tuple[int, Leaf]], dtype: str, shape):
    """Σ sign·c as one constant; None when there is none or it is zero and drops out."""
    if not consts:
        return None
    if len(consts) == 1 and consts[0][0] == 1:
        return consts[0][1]
    out_shape = broadcast(*[c.shape for _, c in consts])

    def thunk():
        acc = np.zeros(out_shape, dtype=dtype)
        for s, c in consts:
            acc = acc + c.value() if s > 0 else acc - c.value()
        return acc.astype(dtype)

    folded = b.fold(("sum", tuple(s for s, _ in consts)), [c for _, c in consts], out_shape,
                    dtype, thunk)
    if folded.size <= 64 and len(shape) >= len(out_shape) and broadcast(shape, out_shape) == shape:
        if np.all(folded.value() == 0):
            return None
    return folded


def emit_sum(b: Builder, terms: list[tuple[int, Value]], const: Leaf | None) -> Value:
    """Positive terms added (smallest first), then the negative ones subtracted."""
    pos = [v for s, v in terms if s > 0] + ([const] if const is not None else [])
    neg = [v for s, v in terms if s < 0]
    if not pos and not neg:
        raise Refuse("empty sum")
    if not pos:
        return b.op("negative", add_all(b, neg))
    acc = add_all(b, pos)
    for v in sorted(neg, key=lambda v: v.size):
        acc = b.op("subtract", acc, v)
    return acc


def product_view(term: Value) -> Product:
    """A sum term as a product (a lone value is the product of itself)."""
    if (isinstance(term, Node) and term.single_use() and is_float(term.dtype)
            and term.op in ("multiply", "divide", "negative", "square", "power")):
        return combine_powers(flatten_product(term))
    return Product(term.dtype, factors=[(term, ONE)])


def scalar_const_value(v: Value) -> float | None:
    if is_const(v) and v.size == 1:
        return float(np.asarray(v.value()).reshape(()))
    return None

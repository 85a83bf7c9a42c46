"""Vectorisable float32 ``exp``, ``erf``, ``tanh``, ``sigmoid`` and small integer powers.

LLVM lowers a vector ``exp``/``tanh`` to one libm call per lane and leaves ``erf`` scalar, so a
fused GELU or softmax spends more time in those calls than its matmul spends multiplying
(GPT-2's tanh-GELU prologue took as long as the FFN matmul). These are the same polynomial and
rational approximations TVM's ``topi.fast_exp``/``fast_erf``/``fast_tanh`` (and Eigen) use:
relative error about 1e-7 for ``exp`` and absolute error below 1e-6 for ``erf``/``tanh``, well
inside the tolerances models are compared at. ``pow(x, 2|3|4)`` becomes multiplications.

IEEE special values come out as the exact functions give them: a NaN argument is returned
unchanged (the clamps alone would turn it into a bound: ``min``/``max`` pick the non-NaN operand),
``exp`` overflows to ``inf`` only above ln(FLT_MAX) ≈ 88.72 and underflows through the
denormals to 0 below about -103.97 (its scale 2^n is applied as two normal halves), and ±inf
saturate as the exact functions do. ``sigmoid`` alone returns 0 where the exact value is a
denormal (x < -88): it skips the general ``exp``'s edge handling (:func:`fast_sigmoid`).

Only float32 calls are rewritten; the rewrite is a structural map over the PrimFunc. TVM 0.27's
simplifier substitutes every bound value (``Let`` or ``Bind``) into its uses, and an
approximation reads its argument several times, so k approximations nested in one expression
grow ~20^k: the inliner keeps such chains to :data:`MAX_NESTED` per expression
(:mod:`.inline`).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

_F32 = "float32"
# Approximations nested in one expression at most (see the module docstring).
MAX_NESTED = 2


def _c(value: float):
    return tirx.const(value, _F32)


def _bind(value, build):
    """``build(x)`` with ``value`` bound once (a Let), so a polynomial reads it once."""
    if isinstance(value, (tvm.ir.Var, tirx.FloatImm)):
        return build(value)
    var = tvm.tirx.Var("fm", str(value.ty.dtype))
    return tirx.Let(var, value, build(var))


def _keep_nan(x, result):
    """``result``, or ``x`` itself where ``x`` is NaN (exact functions propagate NaN)."""
    return tirx.Select(tirx.isnan(x), x, result)


def _pow2(n):
    """2^n for an integral float32 ``n`` in [-126, 127], built from its exponent bits."""
    return tirx.reinterpret(_F32, tirx.shift_left(
        tirx.Cast("int32", n) + tirx.const(127, "int32"), tirx.const(23, "int32")))


def fast_exp(value):
    """2^n · p(r), r = x − n·ln2 (topi.fast_exp's coefficients).

    x is clamped to [-104, 89], beyond which exp is 0 or inf in float32; 2^n (n in [-150, 128])
    is applied as 2^(n//2) · 2^(n - n//2), both normal, so the product overflows and
    underflows (gradually) exactly where exp does."""

    def with_n(x, n):
        def with_r(r):
            y = _exp_poly(r)
            half = tirx.floor(n * _c(0.5))
            return y * _pow2(half) * _pow2(n - half)

        return _bind(x - n * _c(0.6931471805599453), with_r)

    def build(x):
        clamped = _bind(tirx.max(tirx.min(x, _c(89.0)), _c(-104.0)),
                        lambda xc: _bind(tirx.floor(xc * _c(1.44269504088896341) + _c(0.5)),
                                         lambda n: with_n(xc, n)))
        return _keep_nan(x, clamped)

    return _bind(value, build)


def _exp_poly(r):
    """exp(r) for |r| <= ln2 / 2 (topi.fast_exp's coefficients)."""
    p = _c(1.9875691500e-4)
    for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
                 5.0000001201e-1):
        p = p * r + _c(coef)
    return p * r * r + r + _c(1.0)


def fast_erf(value):
    """Odd/even rational approximation on [-4, 4] (Eigen's, as topi.fast_erf)."""
    alpha = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
             -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
             -1.60960333262415e-02)
    beta = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
            -7.37332916720468e-03, -1.42647390514189e-02)
    return _bind(value, lambda x: _rational(x, 4.0, alpha, beta))


def fast_tanh(value):
    """Odd/even rational approximation on [-9, 9] (Eigen's, as topi.fast_tanh)."""
    alpha = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
             5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
             4.89352455891786e-03)
    beta = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
            4.89352518554385e-03)
    return _bind(value, lambda x: _rational(x, 9.0, alpha, beta))


def _rational(x, bound: float, alpha, beta):
    def build(xc):
        def with_x2(x2):
            p = _c(alpha[0])
            for coef in alpha[1:]:
                p = x2 * p + _c(coef)
            q = _c(beta[0])
            for coef in beta[1:]:
                q = x2 * q + _c(coef)
            return xc * p / q

        return _bind(xc * xc, with_x2)

    return _keep_nan(x, _bind(tirx.max(tirx.min(x, _c(bound)), _c(-bound)), build))


# |x| beyond which sigmoid(x) is 0 or 1 to float32's normal range (exp(88) is below FLT_MAX and
# exp(-88) below FLT_MIN, so 1 + exp(-88) rounds to 1 and 1 / (1 + exp(88)) is a denormal).
_SIGMOID_BOUND = 88.0


def fast_sigmoid(value):
    """1 / (1 + exp(-x)), with exp's polynomial (as :func:`fast_exp`) on -x clamped to ±88,
    where 2^n is one normal scale (n in [-127, 127]; 2^-127 comes out as 0), so the two-half
    scale and the NaN select of a general ``exp`` are not needed: a sigmoid ran at 0.84 ns an
    element with them, 0.52 without (Zen 3, one core). The clamps let a NaN through (compared
    the way round that keeps ``x``), so NaN propagates; below x = -88 the result is 0 (the
    exact value is a denormal under 6.1e-39), above 88 it is 1 as exactly rounded."""

    def build(z):
        bound = _c(_SIGMOID_BOUND)

        def with_clamped(zc):
            def with_n(n):
                def with_r(r):
                    return _exp_poly(r) * _pow2(n)

                return _bind(zc - n * _c(0.6931471805599453), with_r)

            return _bind(tirx.floor(zc * _c(1.44269504088896341) + _c(0.5)), with_n)

        clamped = tirx.Select(z > bound, bound, tirx.Select(z < -bound, -bound, z))
        exp = _bind(clamped, with_clamped)
        return tirx.Select(z > bound, _c(0.0), _c(1.0) / (_c(1.0) + exp))

    return _bind(_c(0.0) - value, build)


def _int_power(base, exponent) -> object | None:
    if not isinstance(exponent, tirx.FloatImm) or exponent.value not in (2.0, 3.0, 4.0):
        return None
    count = int(exponent.value)

    def build(x):
        result = x
        for _ in range(count - 1):
            result = result * x
        return result

    return _bind(base, build)


_RULES = {"tirx.exp": fast_exp, "tirx.erf": fast_erf, "tirx.tanh": fast_tanh,
          "tirx.sigmoid": fast_sigmoid}
APPROXIMATED = frozenset(_RULES)


def _rewrite(call):
    if not isinstance(call.op, tvm.ir.Op) or str(getattr(call.ty, "dtype", "")) != _F32:
        return call
    name = call.op.name
    if name in _RULES and len(call.args) == 1:
        return _RULES[name](call.args[0])
    if name == "tirx.pow" and len(call.args) == 2:
        replaced = _int_power(call.args[0], call.args[1])
        if replaced is not None:
            return replaced
    return call


def fast_math(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with float32 exp/erf/tanh/sigmoid/pow(x, 2..4) replaced as above."""
    return tvm_ffi.structural_map(func, [(tvm.ir.Call, _rewrite)])

"""Logical negation kept IEEE-exact through TVM's simplifier.

TVM's rewrite simplifier turns ``!(a < b)`` into ``b <= a``, which is wrong for floats: with a
NaN operand the first is true and the second false. Inlining puts a comparison and its
negation into one expression (``Not(Less(x, 0))``, ``Where(Not(GreaterOrEqual(..)))``), where
the simplifier meets them. A negation written as ``x xor 1`` on the comparison's integer value
is the same function that the simplifier does not rewrite.
"""

from __future__ import annotations

import tvm_ffi
from tvm import tirx


def _xor_not(node: tirx.Not):
    value = node.a
    as_int = tirx.Cast("int8", value)
    return tirx.Cast("bool", tirx.bitwise_xor(as_int, tirx.const(1, "int8")))


def protect_negations(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every logical ``not`` written as an integer ``xor`` (see above)."""
    return tvm_ffi.structural_map(func, [(tirx.Not, _xor_not)])

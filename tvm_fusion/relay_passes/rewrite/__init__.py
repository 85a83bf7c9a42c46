"""DNNFusion §4.2: rewriting by mathematical properties (associative, distributive,
commutative laws), FLOP-driven. The pass is :class:`RewriteByMathProperties`; ``rules`` holds
Table 4's rules as data, ``chains``/``ir`` the block graph they match on, ``cost`` and ``emit``
the FLOP count and the Relax they write back."""

from .math_properties import RewriteByMathProperties

__all__ = ["RewriteByMathProperties"]

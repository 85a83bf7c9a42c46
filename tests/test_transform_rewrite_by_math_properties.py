"""``RewriteByMathProperties`` (DNNFusion §4.2), before and expected, on high-level Relax."""

# ruff: noqa: E501

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion.relay_passes.rewrite.math_properties import RewriteByMathProperties


@I.ir_module
class CommonFactor:
    @R.function
    def main(a: R.Tensor((4, 8), "float32"), b: R.Tensor((4, 8), "float32"), c: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        with R.dataflow():
            lv0 = R.multiply(a, b)
            lv1 = R.multiply(a, c)
            gv = R.add(lv0, lv1)
            R.output(gv)
        return gv


def test_common_factor_is_pulled_out_of_a_sum():
    """Distributivity: ``a*b + a*c`` becomes ``a*(b + c)``, one multiply fewer."""

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((4, 8), "float32"), b: R.Tensor((4, 8), "float32"), c: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                rw = R.add(b, c)
                gv = R.multiply(a, rw)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(RewriteByMathProperties()(CommonFactor), Expected)


def test_without_fp_reassociation_the_sum_is_left_alone():
    """Factoring changes rounding: only IEEE-exact rules run without reassociation."""
    after = RewriteByMathProperties(allow_fp_reassociation=False)(CommonFactor)
    tvm.ir.assert_structural_equal(after, CommonFactor)


def test_transposes_that_cancel_are_removed():
    """Associativity of permutations: two transposes that compose to the identity vanish."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3, 4), "float32")) -> R.Tensor((2, 3, 4), "float32"):
            with R.dataflow():
                lv0 = R.permute_dims(x, [1, 0, 2])
                gv = R.permute_dims(lv0, [1, 0, 2])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 3, 4), "float32")) -> R.Tensor((2, 3, 4), "float32"):
            return x

    tvm.ir.assert_structural_equal(RewriteByMathProperties()(Before), Expected)

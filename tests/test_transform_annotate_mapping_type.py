"""``AnnotateMappingType``: every PrimFunc gets its DNNFusion mapping type and the reason, read
from its TIR (legalized Relax in, the same module with two attributes per PrimFunc out)."""

# ruff: noqa: E501

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion.relay_passes.mapping_type import AnnotateMappingType


def _before() -> tvm.IRModule:
    """A fresh module per test: the pass writes its attributes into the module it is given."""

    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def add(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), b: T.Buffer((T.int64(8),), "float32"), T_add: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for ax0, ax1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("T_add"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(x[v_ax0, v_ax1], b[v_ax1])
                    T.writes(T_add[v_ax0, v_ax1])
                    T_add[v_ax0, v_ax1] = x[v_ax0, v_ax1] + b[v_ax1]

        @T.prim_func(private=True, s_tir=True)
        def transpose(lv0: T.Buffer((T.int64(4), T.int64(8)), "float32"), T_transpose: T.Buffer((T.int64(8), T.int64(4)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for ax0, ax1 in T.grid(T.int64(8), T.int64(4)):
                with T.sblock("T_transpose"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(lv0[v_ax1, v_ax0])
                    T.writes(T_transpose[v_ax0, v_ax1])
                    T_transpose[v_ax0, v_ax1] = lv0[v_ax1, v_ax0]

        @T.prim_func(private=True, s_tir=True)
        def sum(lv1: T.Buffer((T.int64(8), T.int64(4)), "float32"), lv1_red: T.Buffer((T.int64(8), T.int64(1)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for ax0, ax1, k1 in T.grid(T.int64(8), T.int64(1), T.int64(4)):
                with T.sblock("lv1_red"):
                    v_ax0, v_ax1, v_k1 = T.axis.remap("SSR", [ax0, ax1, k1])
                    T.reads(lv1[v_ax0, v_k1])
                    T.writes(lv1_red[v_ax0, v_ax1])
                    with T.init():
                        lv1_red[v_ax0, v_ax1] = T.float32(0.0)
                    lv1_red[v_ax0, v_ax1] = lv1_red[v_ax0, v_ax1] + lv1[v_ax0, v_k1]

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), b: R.Tensor((8,), "float32")) -> R.Tensor((8, 1), "float32"):
            cls = Before
            with R.dataflow():
                lv0 = R.call_tir(cls.add, (x, b), out_ty=R.Tensor((4, 8), "float32"))
                lv1 = R.call_tir(cls.transpose, (lv0,), out_ty=R.Tensor((8, 4), "float32"))
                gv = R.call_tir(cls.sum, (lv1,), out_ty=R.Tensor((8, 1), "float32"))
                R.output(gv)
            return gv
    # fmt: on

    return Before


def test_bias_add_transpose_and_sum_get_their_mapping_types():
    """A bias add whose other input spans the output is One-to-One (``expanding_only``), a
    transpose Shuffle, a reduction Many-to-Many; the Relax function is left as it was."""

    # fmt: off
    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def add(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), b: T.Buffer((T.int64(8),), "float32"), T_add: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True, "tvm_fusion.mapping_reason": "T_add: x same indices (offset/stride allowed)", "tvm_fusion.mapping_type": "ONE_TO_ONE"})
            for ax0, ax1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("T_add"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(x[v_ax0, v_ax1], b[v_ax1])
                    T.writes(T_add[v_ax0, v_ax1])
                    T_add[v_ax0, v_ax1] = x[v_ax0, v_ax1] + b[v_ax1]

        @T.prim_func(private=True, s_tir=True)
        def transpose(lv0: T.Buffer((T.int64(4), T.int64(8)), "float32"), T_transpose: T.Buffer((T.int64(8), T.int64(4)), "float32")):
            T.func_attr({"tirx.noalias": True, "tvm_fusion.mapping_reason": "T_transpose: lv0 permuted indices", "tvm_fusion.mapping_type": "SHUFFLE"})
            for ax0, ax1 in T.grid(T.int64(8), T.int64(4)):
                with T.sblock("T_transpose"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(lv0[v_ax1, v_ax0])
                    T.writes(T_transpose[v_ax0, v_ax1])
                    T_transpose[v_ax0, v_ax1] = lv0[v_ax1, v_ax0]

        @T.prim_func(private=True, s_tir=True)
        def sum(lv1: T.Buffer((T.int64(8), T.int64(4)), "float32"), lv1_red: T.Buffer((T.int64(8), T.int64(1)), "float32")):
            T.func_attr({"tirx.noalias": True, "tvm_fusion.mapping_reason": "lv1_red: reduction", "tvm_fusion.mapping_type": "MANY_TO_MANY"})
            for ax0, ax1, k1 in T.grid(T.int64(8), T.int64(1), T.int64(4)):
                with T.sblock("lv1_red"):
                    v_ax0, v_ax1, v_k1 = T.axis.remap("SSR", [ax0, ax1, k1])
                    T.reads(lv1[v_ax0, v_k1])
                    T.writes(lv1_red[v_ax0, v_ax1])
                    with T.init():
                        lv1_red[v_ax0, v_ax1] = T.float32(0.0)
                    lv1_red[v_ax0, v_ax1] = lv1_red[v_ax0, v_ax1] + lv1[v_ax0, v_k1]

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), b: R.Tensor((8,), "float32")) -> R.Tensor((8, 1), "float32"):
            cls = Expected
            with R.dataflow():
                lv0 = R.call_tir(cls.add, (x, b), out_ty=R.Tensor((4, 8), "float32"))
                lv1 = R.call_tir(cls.transpose, (lv0,), out_ty=R.Tensor((8, 4), "float32"))
                gv = R.call_tir(cls.sum, (lv1,), out_ty=R.Tensor((8, 1), "float32"))
                R.output(gv)
            return gv
    # fmt: on

    before = _before()
    tvm.ir.assert_structural_equal(AnnotateMappingType()(before), Expected)
    tvm.ir.assert_structural_equal(before, _before())  # the input is left as it was


def test_strict_policy_calls_the_bias_add_one_to_many():
    """The paper's literal reading: any broadcast input makes an elementwise op One-to-Many.
    Only the bias add changes, so only it is compared."""

    # fmt: off
    @T.prim_func(private=True, s_tir=True)
    def expected_add(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), b: T.Buffer((T.int64(8),), "float32"), T_add: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        T.func_attr({"tirx.noalias": True, "tvm_fusion.mapping_reason": "T_add: b broadcast along v_ax0", "tvm_fusion.mapping_type": "ONE_TO_MANY"})
        for ax0, ax1 in T.grid(T.int64(4), T.int64(8)):
            with T.sblock("T_add"):
                v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                T.reads(x[v_ax0, v_ax1], b[v_ax1])
                T.writes(T_add[v_ax0, v_ax1])
                T_add[v_ax0, v_ax1] = x[v_ax0, v_ax1] + b[v_ax1]
    # fmt: on

    after = AnnotateMappingType("strict")(_before())
    tvm.ir.assert_structural_equal(after["add"], expected_add)

"""``EliminateLayoutTransforms`` (SmartMem): a data-movement operator disappears into the loads
of its consumer, on legalized Relax."""

# ruff: noqa: E501

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion.layout.smartmem import EliminateLayoutTransforms


# fmt: off
@I.ir_module
class Before:
    @T.prim_func(private=True, s_tir=True)
    def transpose(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), T_transpose: T.Buffer((T.int64(8), T.int64(4)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for ax0, ax1 in T.grid(T.int64(8), T.int64(4)):
            with T.sblock("T_transpose"):
                v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                T.reads(x[v_ax1, v_ax0])
                T.writes(T_transpose[v_ax0, v_ax1])
                T_transpose[v_ax0, v_ax1] = x[v_ax1, v_ax0]

    @T.prim_func(private=True, s_tir=True)
    def tir_exp(lv0: T.Buffer((T.int64(8), T.int64(4)), "float32"), compute: T.Buffer((T.int64(8), T.int64(4)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i0, i1 in T.grid(T.int64(8), T.int64(4)):
            with T.sblock("compute"):
                v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                T.reads(lv0[v_i0, v_i1])
                T.writes(compute[v_i0, v_i1])
                compute[v_i0, v_i1] = T.exp(lv0[v_i0, v_i1])

    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((8, 4), "float32"):
        cls = Before
        with R.dataflow():
            lv0 = R.call_tir(cls.transpose, (x,), out_ty=R.Tensor((8, 4), "float32"))
            gv = R.call_tir(cls.tir_exp, (lv0,), out_ty=R.Tensor((8, 4), "float32"))
            R.output(gv)
        return gv
# fmt: on


def test_transpose_is_composed_into_the_consumers_loads():
    """The transpose (Fixed) is eliminated: ``exp`` reads ``x`` through the transposed index
    map, one kernel and no copy; the function records the site's action."""

    # fmt: off
    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def fused_smartmem_copy_tir_exp(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute_intermediate: T.Buffer((T.int64(8), T.int64(4)), "float32")):
            T.func_attr({"op_pattern": 2, "tirx.noalias": True, "tvm_fusion.smartmem": ["smartmem_copy: eliminate 1st, composed into the consumer's loads"]})
            for i0, i1 in T.grid(T.int64(8), T.int64(4)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(x[v_i1, v_i0])
                    T.writes(compute_intermediate[v_i0, v_i1])
                    compute_intermediate[v_i0, v_i1] = T.exp(x[v_i1, v_i0])

        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((8, 4), "float32"):
            cls = Expected
            with R.dataflow():
                gv = R.call_tir(cls.fused_smartmem_copy_tir_exp, (x,), out_ty=R.Tensor((8, 4), "float32"))
                R.output(gv)
            return gv
    # fmt: on

    tvm.ir.assert_structural_equal(EliminateLayoutTransforms()(Before), Expected)

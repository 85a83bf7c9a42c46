"""``PlanFusion``: DNNFusion's plan outlined as ``Primitive`` Relax functions (FuseOps' output
form, ready for ``FuseTIR``), on legalized Relax."""

# ruff: noqa: E501

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion.relay_passes.plan_fusion import PlanFusion, plan_module
from tvm_fusion.relay_passes.rejection import RejectReason


def _before() -> tvm.IRModule:
    """``relu(matmul(exp(matmul(x, w)), w))``, legalized: three PrimFuncs, four calls."""

    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def matmul(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), w: T.Buffer((T.int64(8), T.int64(8)), "float32"), matmul: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i0, i1, k in T.grid(T.int64(4), T.int64(8), T.int64(8)):
                with T.sblock("matmul"):
                    v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
                    T.reads(x[v_i0, v_k], w[v_k, v_i1])
                    T.writes(matmul[v_i0, v_i1])
                    with T.init():
                        matmul[v_i0, v_i1] = T.float32(0.0)
                    matmul[v_i0, v_i1] = matmul[v_i0, v_i1] + x[v_i0, v_k] * w[v_k, v_i1]

        @T.prim_func(private=True, s_tir=True)
        def tir_exp(lv0: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(lv0[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1])
                    compute[v_i0, v_i1] = T.exp(lv0[v_i0, v_i1])

        @T.prim_func(private=True, s_tir=True)
        def relu(lv2: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(lv2[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1])
                    compute[v_i0, v_i1] = T.max(lv2[v_i0, v_i1], T.float32(0.0))

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            cls = Before
            with R.dataflow():
                lv0 = R.call_tir(cls.matmul, (x, w), out_ty=R.Tensor((4, 8), "float32"))
                lv1 = R.call_tir(cls.tir_exp, (lv0,), out_ty=R.Tensor((4, 8), "float32"))
                lv2 = R.call_tir(cls.matmul, (lv1, w), out_ty=R.Tensor((4, 8), "float32"))
                gv = R.call_tir(cls.relu, (lv2,), out_ty=R.Tensor((4, 8), "float32"))
                R.output(gv)
            return gv
    # fmt: on

    return Before


def test_elementwise_ops_join_the_second_matmul_and_the_first_stays_alone():
    """Seeded at ``exp`` (One-to-One), the block takes the second matmul and its relu; the
    first matmul cannot join a block that already holds a Many-to-Many operator (Table 3's
    red cell), so it stays a kernel of its own. The group is outlined as FuseOps would."""

    # fmt: off
    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def matmul(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), w: T.Buffer((T.int64(8), T.int64(8)), "float32"), matmul: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i0, i1, k in T.grid(T.int64(4), T.int64(8), T.int64(8)):
                with T.sblock("matmul"):
                    v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
                    T.reads(x[v_i0, v_k], w[v_k, v_i1])
                    T.writes(matmul[v_i0, v_i1])
                    with T.init():
                        matmul[v_i0, v_i1] = T.float32(0.0)
                    matmul[v_i0, v_i1] = matmul[v_i0, v_i1] + x[v_i0, v_k] * w[v_k, v_i1]

        @T.prim_func(private=True, s_tir=True)
        def tir_exp(lv0: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(lv0[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1])
                    compute[v_i0, v_i1] = T.exp(lv0[v_i0, v_i1])

        @T.prim_func(private=True, s_tir=True)
        def relu(lv2: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(lv2[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1])
                    compute[v_i0, v_i1] = T.max(lv2[v_i0, v_i1], T.float32(0.0))

        @R.function(private=True)
        def fused_tir_exp_matmul_relu(lv0: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            R.func_attr({"Primitive": True})
            cls = Expected
            with R.dataflow():
                lv1 = R.call_tir(cls.tir_exp, (lv0,), out_ty=R.Tensor((4, 8), "float32"))
                lv2 = R.call_tir(cls.matmul, (lv1, w), out_ty=R.Tensor((4, 8), "float32"))
                gv = R.call_tir(cls.relu, (lv2,), out_ty=R.Tensor((4, 8), "float32"))
                gv1: R.Tensor((4, 8), "float32") = gv
                R.output(gv1)
            return gv1

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            cls = Expected
            with R.dataflow():
                lv0 = R.call_tir(cls.matmul, (x, w), out_ty=R.Tensor((4, 8), "float32"))
                gv: R.Tensor((4, 8), "float32") = cls.fused_tir_exp_matmul_relu(lv0, w)
                R.output(gv)
            return gv
    # fmt: on

    before = _before()
    tvm.ir.assert_structural_equal(PlanFusion()(before), Expected)
    tvm.ir.assert_structural_equal(before, _before())  # the input is left as it was


def test_the_cut_is_recorded_with_its_typed_reason():
    """The planner's record of that cut, read from the planner itself."""
    (plan,) = plan_module(_before()).plans.values()
    assert [(r.first, r.second, r.reason) for r in plan.rejections] == [
        ("lv0=matmul[M2M]", "lv1=tir_exp[O2O]", RejectReason.RED_CELL)]
    assert plan.rejections[0].describe() == "[red_cell] Table 3 red: block M2M then M2M"


def test_tvm_strategy_is_stock_fuse_ops():
    """``strategy="tvm"`` is the baseline every comparison runs against: FuseOps on TVM's op
    patterns, untouched (here it fuses the first matmul with ``exp``, the second with relu)."""
    patterns = relax.transform.AnnotateTIROpPattern()
    after = PlanFusion("tvm")(patterns(_before()))
    tvm.ir.assert_structural_equal(after, relax.transform.FuseOps()(patterns(_before())))
    assert sorted(g.name_hint for g in after.functions if g.name_hint.startswith("fused")) == [
        "fused_matmul_relu", "fused_matmul_tir_exp"]

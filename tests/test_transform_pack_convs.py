"""``PackConvs``: dense convs become TOPI's ``conv2d_NCHWc`` between layout changes on CPU."""

# ruff: noqa: E501

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion.layout.conv_pack import PackConvs

CPU = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((1, 8, 4, 4), "float32"), w: R.Tensor((8, 8, 1, 1), "float32")) -> R.Tensor((1, 8, 4, 4), "float32"):
        with R.dataflow():
            lv0 = R.nn.conv2d(x, w)
            gv = R.nn.relu(lv0)
            R.output(gv)
        return gv


def test_dense_conv_is_packed_and_the_relu_follows_its_layout():
    """``NCHW4c``: the activation and the weight get packed, the conv and its relu run on
    the packed tensor, and one layout change back to NCHW is left at the graph output."""

    # fmt: off
    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def te_layout_transform(x: T.Buffer((T.int64(1), T.int64(8), T.int64(4), T.int64(4)), "float32"), te_layout_transform: T.Buffer((T.int64(1), T.int64(2), T.int64(4), T.int64(4), T.int64(4)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for self, i0, i1, i2 in T.grid(T.int64(1), T.int64(8), T.int64(4), T.int64(4)):
                with T.sblock("te_layout_transform"):
                    v_self, v_i0, v_i1, v_i2 = T.axis.remap("SSSS", [self, i0, i1, i2])
                    T.reads(x[v_self, v_i0, v_i1, v_i2])
                    T.writes(te_layout_transform[v_self, v_i0 // T.int64(4), v_i1, v_i2, v_i0 % T.int64(4)])
                    te_layout_transform[v_self, v_i0 // T.int64(4), v_i1, v_i2, v_i0 % T.int64(4)] = x[v_self, v_i0, v_i1, v_i2]

        @T.prim_func(private=True, s_tir=True)
        def te_layout_transform1(w: T.Buffer((T.int64(8), T.int64(8), T.int64(1), T.int64(1)), "float32"), te_layout_transform: T.Buffer((T.int64(2), T.int64(2), T.int64(1), T.int64(1), T.int64(4), T.int64(4)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for self, i0, i1, i2 in T.grid(T.int64(8), T.int64(8), T.int64(1), T.int64(1)):
                with T.sblock("te_layout_transform"):
                    v_self, v_i0, v_i1, v_i2 = T.axis.remap("SSSS", [self, i0, i1, i2])
                    T.reads(w[v_self, v_i0, v_i1, v_i2])
                    T.writes(te_layout_transform[v_self // T.int64(4), v_i0 // T.int64(4), v_i1, v_i2, v_i0 % T.int64(4), v_self % T.int64(4)])
                    te_layout_transform[v_self // T.int64(4), v_i0 // T.int64(4), v_i1, v_i2, v_i0 % T.int64(4), v_self % T.int64(4)] = w[v_self, v_i0, v_i1, v_i2]

        @T.prim_func(private=True, s_tir=True)
        def conv2d_NCHWc(lv: T.Buffer((T.int64(1), T.int64(2), T.int64(4), T.int64(4), T.int64(4)), "float32"), lv1: T.Buffer((T.int64(2), T.int64(2), T.int64(1), T.int64(1), T.int64(4), T.int64(4)), "float32"), conv2d_NCHWc: T.Buffer((T.int64(1), T.int64(2), T.int64(4), T.int64(4), T.int64(4)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for n, oc_chunk, oh, ow, oc_block, ic, kh, kw in T.grid(T.int64(1), T.int64(2), T.int64(4), T.int64(4), T.int64(4), T.int64(8), T.int64(1), T.int64(1)):
                with T.sblock("conv2d_NCHWc"):
                    v_n, v_oc_chunk, v_oh, v_ow, v_oc_block, v_ic, v_kh, v_kw = T.axis.remap("SSSSSRRR", [n, oc_chunk, oh, ow, oc_block, ic, kh, kw])
                    T.reads(lv[v_n, v_ic // T.int64(4), v_oh + v_kh, v_ow + v_kw, v_ic % T.int64(4)], lv1[v_oc_chunk, v_ic // T.int64(4), v_kh, v_kw, v_ic % T.int64(4), v_oc_block])
                    T.writes(conv2d_NCHWc[v_n, v_oc_chunk, v_oh, v_ow, v_oc_block])
                    with T.init():
                        conv2d_NCHWc[v_n, v_oc_chunk, v_oh, v_ow, v_oc_block] = T.float32(0.0)
                    conv2d_NCHWc[v_n, v_oc_chunk, v_oh, v_ow, v_oc_block] = conv2d_NCHWc[v_n, v_oc_chunk, v_oh, v_ow, v_oc_block] + lv[v_n, v_ic // T.int64(4), v_oh + v_kh, v_ow + v_kw, v_ic % T.int64(4)] * lv1[v_oc_chunk, v_ic // T.int64(4), v_kh, v_kw, v_ic % T.int64(4), v_oc_block]

        @T.prim_func(private=True, s_tir=True)
        def relu(lv0: T.Buffer((T.int64(1), T.int64(2), T.int64(4), T.int64(4), T.int64(4)), "float32"), compute: T.Buffer((T.int64(1), T.int64(2), T.int64(4), T.int64(4), T.int64(4)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i0, i1, i2, i3, i4 in T.grid(T.int64(1), T.int64(2), T.int64(4), T.int64(4), T.int64(4)):
                with T.sblock("compute"):
                    v_i0, v_i1, v_i2, v_i3, v_i4 = T.axis.remap("SSSSS", [i0, i1, i2, i3, i4])
                    T.reads(lv0[v_i0, v_i1, v_i2, v_i3, v_i4])
                    T.writes(compute[v_i0, v_i1, v_i2, v_i3, v_i4])
                    compute[v_i0, v_i1, v_i2, v_i3, v_i4] = T.max(lv0[v_i0, v_i1, v_i2, v_i3, v_i4], T.float32(0.0))

        @T.prim_func(private=True, s_tir=True)
        def te_layout_transform2(lv2: T.Buffer((T.int64(1), T.int64(2), T.int64(4), T.int64(4), T.int64(4)), "float32"), te_layout_transform: T.Buffer((T.int64(1), T.int64(8), T.int64(4), T.int64(4)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for self, i0, i1, i2, i3 in T.grid(T.int64(1), T.int64(2), T.int64(4), T.int64(4), T.int64(4)):
                with T.sblock("te_layout_transform"):
                    v_self, v_i0, v_i1, v_i2, v_i3 = T.axis.remap("SSSSS", [self, i0, i1, i2, i3])
                    T.reads(lv2[v_self, v_i0, v_i1, v_i2, v_i3])
                    T.writes(te_layout_transform[v_self, v_i0 * T.int64(4) + v_i3, v_i1, v_i2])
                    te_layout_transform[v_self, v_i0 * T.int64(4) + v_i3, v_i1, v_i2] = lv2[v_self, v_i0, v_i1, v_i2, v_i3]

        @R.function
        def main(x: R.Tensor((1, 8, 4, 4), "float32"), w: R.Tensor((8, 8, 1, 1), "float32")) -> R.Tensor((1, 8, 4, 4), "float32"):
            cls = Expected
            with R.dataflow():
                lv = R.call_tir(cls.te_layout_transform, (x,), out_ty=R.Tensor((1, 2, 4, 4, 4), "float32"))
                lv1 = R.call_tir(cls.te_layout_transform1, (w,), out_ty=R.Tensor((2, 2, 1, 1, 4, 4), "float32"))
                lv0 = R.call_tir(cls.conv2d_NCHWc, (lv, lv1), out_ty=R.Tensor((1, 2, 4, 4, 4), "float32"))
                lv2 = R.call_tir(cls.relu, (lv0,), out_ty=R.Tensor((1, 2, 4, 4, 4), "float32"))
                gv = R.call_tir(cls.te_layout_transform2, (lv2,), out_ty=R.Tensor((1, 8, 4, 4), "float32"))
                R.output(gv)
            return gv
    # fmt: on

    tvm.ir.assert_structural_equal(PackConvs(CPU, "NCHWc", block=4)(Before), Expected)


def test_nchw_policy_and_non_cpu_targets_leave_the_module_alone():
    tvm.ir.assert_structural_equal(PackConvs(CPU, "NCHW")(Before), Before)
    tvm.ir.assert_structural_equal(PackConvs(tvm.target.Target("opencl"), "NCHWc")(Before),
                                   Before)


def test_auto_policy_keeps_a_model_with_a_grouped_conv_in_nchw():
    """Packing dense convs next to a depthwise one would put a layout change between them."""

    @I.ir_module
    class Depthwise:
        @R.function
        def main(x: R.Tensor((1, 8, 4, 4), "float32"), w: R.Tensor((8, 8, 1, 1), "float32"), d: R.Tensor((8, 1, 3, 3), "float32")) -> R.Tensor((1, 8, 4, 4), "float32"):
            with R.dataflow():
                lv0 = R.nn.conv2d(x, w)
                gv = R.nn.conv2d(lv0, d, padding=[1, 1, 1, 1], groups=8)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(PackConvs(CPU, "auto")(Depthwise), Depthwise)

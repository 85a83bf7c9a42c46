"""The Adreno texture passes: ``AnnotateTextureScopes`` puts a tensor that a reduction reads into
``global.texture`` with an RGBA layout; ``ScheduleTextureKernels`` writes one texel per thread."""

# ruff: noqa: E501

import tvm
import tvm.backend.adreno  # noqa: F401 (registers the qcom/* target tags)
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion.layout.texture import AnnotateTextureScopes, ScheduleTextureKernels

TEXTURE = tvm.target.Target("qcom/adreno-opencl-texture")
BUFFERS = tvm.target.Target("qcom/adreno-opencl")


def _before() -> tvm.IRModule:
    """``sum(exp(x), axis=1)``, legalized: the intermediate is read by a row reduction."""

    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def tir_exp(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(x[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1])
                    compute[v_i0, v_i1] = T.exp(x[v_i0, v_i1])

        @T.prim_func(private=True, s_tir=True)
        def sum(lv0: T.Buffer((T.int64(4), T.int64(8)), "float32"), lv0_red: T.Buffer((T.int64(4), T.int64(1)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for ax0, ax1, k1 in T.grid(T.int64(4), T.int64(1), T.int64(8)):
                with T.sblock("lv0_red"):
                    v_ax0, v_ax1, v_k1 = T.axis.remap("SSR", [ax0, ax1, k1])
                    T.reads(lv0[v_ax0, v_k1])
                    T.writes(lv0_red[v_ax0, v_ax1])
                    with T.init():
                        lv0_red[v_ax0, v_ax1] = T.float32(0.0)
                    lv0_red[v_ax0, v_ax1] = lv0_red[v_ax0, v_ax1] + lv0[v_ax0, v_k1]

        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 1), "float32"):
            cls = Before
            with R.dataflow():
                lv0 = R.call_tir(cls.tir_exp, (x,), out_ty=R.Tensor((4, 8), "float32"))
                gv = R.call_tir(cls.sum, (lv0,), out_ty=R.Tensor((4, 1), "float32"))
                R.output(gv)
            return gv
    # fmt: on

    return Before


def test_intermediate_read_by_a_reduction_moves_to_a_texture():
    """The 4×8 intermediate becomes a 2×4 image of RGBA texels, the reduced dimension in the
    lanes and along x: ``exp`` writes it and ``sum`` reads it through that map, both
    specialised (``_tex``), and its Relax type carries the texture ``VDevice``. The graph
    input and output stay buffers."""

    # fmt: off
    @I.ir_module
    class Expected:
        I.module_global_infos({"vdevice": [I.vdevice("qcom/adreno-opencl-texture", 0, "global.texture")]})

        @T.prim_func(private=True, s_tir=True)
        def tir_exp_tex(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute: T.Buffer((T.int64(4), T.int64(2), T.int64(4)), "float32", scope="global.texture")):
            T.func_attr({"tirx.noalias": True, "tvm_fusion.texture_params": {"compute": "4x8 → image 2×4: lanes=d1%4, x=d1/4, y=d0"}})
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(x[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1 // T.int64(4), v_i1 % T.int64(4)])
                    compute[v_i0, v_i1 // T.int64(4), v_i1 % T.int64(4)] = T.exp(x[v_i0, v_i1])

        @T.prim_func(private=True, s_tir=True)
        def sum_tex(lv0: T.Buffer((T.int64(4), T.int64(2), T.int64(4)), "float32", scope="global.texture"), lv0_red: T.Buffer((T.int64(4), T.int64(1)), "float32")):
            T.func_attr({"tirx.noalias": True, "tvm_fusion.texture_params": {"lv0": "4x8 → image 2×4: lanes=d1%4, x=d1/4, y=d0"}})
            for ax0, ax1, k1 in T.grid(T.int64(4), T.int64(1), T.int64(8)):
                with T.sblock("lv0_red"):
                    v_ax0, v_ax1, v_k1 = T.axis.remap("SSR", [ax0, ax1, k1])
                    T.reads(lv0[v_ax0, v_k1 // T.int64(4), v_k1 % T.int64(4)])
                    T.writes(lv0_red[v_ax0, v_ax1])
                    with T.init():
                        lv0_red[v_ax0, v_ax1] = T.float32(0.0)
                    lv0_red[v_ax0, v_ax1] = lv0_red[v_ax0, v_ax1] + lv0[v_ax0, v_k1 // T.int64(4), v_k1 % T.int64(4)]

        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 1), "float32"):
            cls = Expected
            with R.dataflow():
                lv0 = R.call_tir(cls.tir_exp_tex, (x,), out_ty=R.Tensor((4, 2, 4), "float32", vdevice="opencl:0:global.texture"))
                gv = R.call_tir(cls.sum_tex, (lv0,), out_ty=R.Tensor((4, 1), "float32"))
                R.output(gv)
            return gv
    # fmt: on

    before = _before()
    with TEXTURE:
        after = AnnotateTextureScopes(TEXTURE)(before)
    tvm.ir.assert_structural_equal(after, Expected)
    tvm.ir.assert_structural_equal(before, _before())  # the input is left as it was


def test_buffer_target_keeps_every_tensor_a_buffer():
    """``qcom/adreno-opencl`` has no ``texture`` key: nothing to annotate."""
    with BUFFERS:
        after = AnnotateTextureScopes(BUFFERS)(_before())
    tvm.ir.assert_structural_equal(after, _before())


def test_texture_writer_stores_whole_texels():
    """The producer of a texture: one thread per texel, its four lanes computed into a local
    texel and stored as one vectorised RGBA write. Only the PrimFunc is compared."""

    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def tir_exp_tex(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute: T.Buffer((T.int64(4), T.int64(2), T.int64(4)), "float32", scope="global.texture")):
            T.func_attr({"tirx.noalias": True})
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(x[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1 // T.int64(4), v_i1 % T.int64(4)])
                    compute[v_i0, v_i1 // T.int64(4), v_i1 % T.int64(4)] = T.exp(x[v_i0, v_i1])

    @T.prim_func(private=True, s_tir=True)
    def expected(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute: T.Buffer((T.int64(4), T.int64(2), T.int64(4)), "float32", scope="global.texture")):
        T.func_attr({"tirx.noalias": True, "tvm_fusion.texture_schedule": True})
        compute_local = T.sblock_alloc_buffer((T.int64(4), T.int64(2), T.int64(4)), scope="local")
        for i0_i1_0_fused_0 in T.thread_binding(T.int64(1), thread="blockIdx.x"):
            for i0_i1_0_fused_1 in T.thread_binding(T.int64(8), thread="threadIdx.x"):
                for i1_1 in range(T.int64(4)):
                    with T.sblock("compute"):
                        v_i0 = T.axis.spatial(T.int64(4), (i0_i1_0_fused_0 * T.int64(8) + i0_i1_0_fused_1) // T.int64(2))
                        v_i1 = T.axis.spatial(T.int64(8), (i0_i1_0_fused_0 * T.int64(8) + i0_i1_0_fused_1) % T.int64(2) * T.int64(4) + i1_1)
                        T.reads(x[v_i0, v_i1])
                        T.writes(compute_local[v_i0, v_i1 // T.int64(4), v_i1 % T.int64(4)])
                        compute_local[v_i0, v_i1 // T.int64(4), v_i1 % T.int64(4)] = T.exp(x[v_i0, v_i1])
                for ax0 in T.vectorized(T.int64(4)):
                    with T.sblock("compute_local"):
                        v0 = T.axis.spatial(T.int64(4), i0_i1_0_fused_1 // T.int64(2))
                        v1 = T.axis.spatial(T.int64(2), i0_i1_0_fused_1 % T.int64(2))
                        v2 = T.axis.spatial(T.int64(4), ax0)
                        T.reads(compute_local[v0, v1, v2])
                        T.writes(compute[v0, v1, v2])
                        compute[v0, v1, v2] = compute_local[v0, v1, v2]
    # fmt: on

    with TEXTURE:
        after = ScheduleTextureKernels()(Before)
    tvm.ir.assert_structural_equal(after["tir_exp_tex"], expected)

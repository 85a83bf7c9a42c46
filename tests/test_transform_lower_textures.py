"""``LowerTextures``: the texture part of the Adreno TIR lowering that the registered pipeline
runs before TVM's default TIR pipeline. A texture-scope buffer's reads become ``texture2d_load``
of a texel's lane; thread bindings become launches. (The store side, ``texture2d_store`` of a
whole texel, returns a pointer type TVMScript cannot write; tests/test_texture.py checks it in
the generated OpenCL: ``write_imagef``.)"""

# ruff: noqa: E501, F841

import tvm
import tvm.backend.adreno  # noqa: F401 (registers the qcom/* target tags)
from tvm.script import ir as I
from tvm.script import tirx as T

from tvm_fusion.layout.texture_lower import LowerTextures

TEXTURE = tvm.target.Target("qcom/adreno-opencl-texture")
LAYOUT = "4x8 → image 2×4: lanes=d1%4, x=d1/4, y=d0"


def _before() -> tvm.IRModule:
    """The reduction of ``sum(exp(x), axis=1)`` after ``AnnotateTextureScopes`` and
    ``ScheduleTextureKernels``: it reads the 4×8 intermediate as a 2×4 image of texels."""

    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def sum_tex(lv0: T.Buffer((T.int64(4), T.int64(2), T.int64(4)), "float32", scope="global.texture"), lv0_red: T.Buffer((T.int64(4), T.int64(1)), "float32")):
            T.func_attr({"tirx.noalias": True, "tvm_fusion.texture_params": {"lv0": LAYOUT}, "tvm_fusion.texture_schedule": True})
            for ax0_ax1_fused_0 in T.thread_binding(T.int64(1), thread="blockIdx.x"):
                for ax0_ax1_fused_1 in T.thread_binding(T.int64(4), thread="threadIdx.x"):
                    for k1 in range(T.int64(8)):
                        with T.sblock("lv0_red"):
                            v_ax0 = T.axis.spatial(T.int64(4), ax0_ax1_fused_0 * T.int64(4) + ax0_ax1_fused_1)
                            v_ax1 = T.axis.spatial(T.int64(1), T.int64(0))
                            v_k1 = T.axis.reduce(T.int64(8), k1)
                            T.reads(lv0[v_ax0, v_k1 // T.int64(4), v_k1 % T.int64(4)])
                            T.writes(lv0_red[v_ax0, v_ax1])
                            with T.init():
                                lv0_red[v_ax0, v_ax1] = T.float32(0.0)
                            lv0_red[v_ax0, v_ax1] = lv0_red[v_ax0, v_ax1] + lv0[v_ax0, v_k1 // T.int64(4), v_k1 % T.int64(4)]

    # fmt: on

    return Before


def test_texture_reads_become_texel_loads():
    # fmt: off
    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def sum_tex(lv0: T.Buffer((T.int64(4), T.int64(2), T.int64(4)), "float32", scope="global.texture"), lv0_red: T.Buffer((T.int64(4), T.int64(1)), "float32")):
            T.func_attr({"tirx.noalias": True, "tvm_fusion.texture_params": {"lv0": LAYOUT}, "tvm_fusion.texture_schedule": True})
            blockIdx_x = T.launch_thread("blockIdx.x", T.int64(1))
            threadIdx_x = T.launch_thread("threadIdx.x", T.int64(4))
            for k1 in range(T.int64(8)):
                if k1 == T.int64(0):
                    lv0_red[threadIdx_x, T.int64(0)] = T.float32(0.0)
                lv0_red[threadIdx_x, T.int64(0)] = lv0_red[threadIdx_x, T.int64(0)] + T.call_intrin("float32", "tirx.texture2d_load", lv0.data, k1 // T.int64(4), threadIdx_x, 0, 128, k1 % T.int64(4))

    # fmt: on

    before = _before()
    with TEXTURE:
        after = LowerTextures()(before)
    tvm.ir.assert_structural_equal(after, Expected)

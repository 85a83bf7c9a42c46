"""``ApplyGPUSchedules``: every fused PrimFunc gets a GPU schedule (DLight's rules, OptiFX's
template for a fused conv chain), checked by lowering it for the target."""

# ruff: noqa: E501

import warnings

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion.pipeline import apply_gpu_schedules
from tvm_fusion.tir_utils import find_all

GPU = tvm.target.Target("opencl")  # source-only codegen: no GPU or driver needed to lower


def test_fused_elementwise_function_gets_one_thread_per_element():
    """DLight's fallback rule: the loops are fused and split over blocks of 256 threads, the
    intermediate inlined; the function is marked scheduled."""

    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def fused_add_relu(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), y: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute_intermediate: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            T_add_intermediate = T.sblock_alloc_buffer((T.int64(4), T.int64(8)))
            for ax0, ax1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("T_add"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(x[v_ax0, v_ax1], y[v_ax0, v_ax1])
                    T.writes(T_add_intermediate[v_ax0, v_ax1])
                    T_add_intermediate[v_ax0, v_ax1] = x[v_ax0, v_ax1] + y[v_ax0, v_ax1]
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(T_add_intermediate[v_i0, v_i1])
                    T.writes(compute_intermediate[v_i0, v_i1])
                    compute_intermediate[v_i0, v_i1] = T.max(T_add_intermediate[v_i0, v_i1], T.float32(0.0))

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), y: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            cls = Before
            with R.dataflow():
                gv = R.call_tir(cls.fused_add_relu, (x, y), out_ty=R.Tensor((4, 8), "float32"))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def fused_add_relu(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), y: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute_intermediate: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            for ax0_ax1_fused_0 in T.thread_binding(T.int64(1), thread="blockIdx.x"):
                for ax0_ax1_fused_1 in T.thread_binding(T.int64(256), thread="threadIdx.x"):
                    with T.sblock("compute"):
                        v0 = T.axis.spatial(T.int64(4), (ax0_ax1_fused_0 * T.int64(256) + ax0_ax1_fused_1) // T.int64(8))
                        v1 = T.axis.spatial(T.int64(8), (ax0_ax1_fused_0 * T.int64(256) + ax0_ax1_fused_1) % T.int64(8))
                        T.where(ax0_ax1_fused_0 * T.int64(256) + ax0_ax1_fused_1 < T.int64(32))
                        T.reads(x[v0, v1], y[v0, v1])
                        T.writes(compute_intermediate[v0, v1])
                        compute_intermediate[v0, v1] = T.max(x[v0, v1] + y[v0, v1], T.float32(0.0))

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), y: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            cls = Expected
            with R.dataflow():
                gv = R.call_tir(cls.fused_add_relu, (x, y), out_ty=R.Tensor((4, 8), "float32"))
                R.output(gv)
            return gv
    # fmt: on

    unscheduled = Before.script()
    with GPU:
        after = apply_gpu_schedules(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert Before.script() == unscheduled  # the input is left as it was


def test_schedule_over_static_shared_memory_falls_to_fewer_rules():
    """ViT's patch embedding as one DNNFusion block (conv 16×16/16, bias, reshape, transpose,
    concatenate with the class token, position add): the Matmul rules fail on it and DLight's
    GeneralReduction keeps the whole conv output (768×14×14 floats, 602,112 bytes) in shared
    memory, which ptxas rejects on a GPU (found by the H100 run, docs/benchmarks.md). A schedule
    over the target's static shared memory is refused and the next rule set (Fallback: no
    shared memory) takes the function."""

    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        @T.prim_func(private=True, s_tir=True)
        def fused_conv2d_add_reshape_transpose_concatenate_add(input: T.Buffer((T.int64(1), T.int64(3), T.int64(224), T.int64(224)), "float32"), param_0: T.Buffer((T.int64(768), T.int64(3), T.int64(16), T.int64(16)), "float32"), param_1: T.Buffer((T.int64(1), T.int64(768), T.int64(1), T.int64(1)), "float32"), param_2: T.Buffer((T.int64(1), T.int64(1), T.int64(768)), "float32"), param_3: T.Buffer((T.int64(1), T.int64(197), T.int64(768)), "float32"), T_add_intermediate: T.Buffer((T.int64(1), T.int64(197), T.int64(768)), "float32")):
            T.func_attr({"tirx.noalias": True})
            # with T.sblock("root"):
            pad_temp = T.sblock_alloc_buffer((T.int64(1), T.int64(3), T.int64(224), T.int64(224)))
            conv2d_nchw_intermediate = T.sblock_alloc_buffer((T.int64(1), T.int64(768), T.int64(14), T.int64(14)))
            T_add_intermediate_intermediate = T.sblock_alloc_buffer((T.int64(1), T.int64(768), T.int64(14), T.int64(14)))
            T_reshape_intermediate = T.sblock_alloc_buffer((T.int64(1), T.int64(768), T.int64(196)))
            T_transpose_intermediate = T.sblock_alloc_buffer((T.int64(1), T.int64(196), T.int64(768)))
            T_concat_intermediate = T.sblock_alloc_buffer((T.int64(1), T.int64(197), T.int64(768)))
            for i0, i1, i2, i3 in T.grid(T.int64(1), T.int64(3), T.int64(224), T.int64(224)):
                with T.sblock("pad_temp"):
                    v_i0, v_i1, v_i2, v_i3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
                    T.reads(input[v_i0, v_i1, v_i2, v_i3])
                    T.writes(pad_temp[v_i0, v_i1, v_i2, v_i3])
                    pad_temp[v_i0, v_i1, v_i2, v_i3] = input[v_i0, v_i1, v_i2, v_i3]
            for nn, ff, yy, xx, rc, ry, rx in T.grid(T.int64(1), T.int64(768), T.int64(14), T.int64(14), T.int64(3), T.int64(16), T.int64(16)):
                with T.sblock("conv2d_nchw"):
                    v_nn, v_ff, v_yy, v_xx, v_rc, v_ry, v_rx = T.axis.remap("SSSSRRR", [nn, ff, yy, xx, rc, ry, rx])
                    T.reads(pad_temp[v_nn, v_rc, v_yy * T.int64(16) + v_ry, v_xx * T.int64(16) + v_rx], param_0[v_ff, v_rc, v_ry, v_rx])
                    T.writes(conv2d_nchw_intermediate[v_nn, v_ff, v_yy, v_xx])
                    with T.init():
                        conv2d_nchw_intermediate[v_nn, v_ff, v_yy, v_xx] = T.float32(0.0)
                    conv2d_nchw_intermediate[v_nn, v_ff, v_yy, v_xx] = conv2d_nchw_intermediate[v_nn, v_ff, v_yy, v_xx] + pad_temp[v_nn, v_rc, v_yy * T.int64(16) + v_ry, v_xx * T.int64(16) + v_rx] * param_0[v_ff, v_rc, v_ry, v_rx]
            for ax0, ax1, ax2, ax3 in T.grid(T.int64(1), T.int64(768), T.int64(14), T.int64(14)):
                with T.sblock("T_add"):
                    v_ax0, v_ax1, v_ax2, v_ax3 = T.axis.remap("SSSS", [ax0, ax1, ax2, ax3])
                    T.reads(conv2d_nchw_intermediate[v_ax0, v_ax1, v_ax2, v_ax3], param_1[v_ax0, v_ax1, T.int64(0), T.int64(0)])
                    T.writes(T_add_intermediate_intermediate[v_ax0, v_ax1, v_ax2, v_ax3])
                    T_add_intermediate_intermediate[v_ax0, v_ax1, v_ax2, v_ax3] = conv2d_nchw_intermediate[v_ax0, v_ax1, v_ax2, v_ax3] + param_1[v_ax0, v_ax1, T.int64(0), T.int64(0)]
            for ax0, ax1, ax2 in T.grid(T.int64(1), T.int64(768), T.int64(196)):
                with T.sblock("T_reshape"):
                    v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
                    T.reads(T_add_intermediate_intermediate[T.int64(0), (v_ax2 // T.int64(196) + v_ax1) % T.int64(768), v_ax2 % T.int64(196) // T.int64(14), v_ax2 % T.int64(14)])
                    T.writes(T_reshape_intermediate[v_ax0, v_ax1, v_ax2])
                    T_reshape_intermediate[v_ax0, v_ax1, v_ax2] = T_add_intermediate_intermediate[T.int64(0), (v_ax2 // T.int64(196) + v_ax1) % T.int64(768), v_ax2 % T.int64(196) // T.int64(14), v_ax2 % T.int64(14)]
            for ax0, ax1, ax2 in T.grid(T.int64(1), T.int64(196), T.int64(768)):
                with T.sblock("T_transpose"):
                    v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
                    T.reads(T_reshape_intermediate[v_ax0, v_ax2, v_ax1])
                    T.writes(T_transpose_intermediate[v_ax0, v_ax1, v_ax2])
                    T_transpose_intermediate[v_ax0, v_ax1, v_ax2] = T_reshape_intermediate[v_ax0, v_ax2, v_ax1]
            for ax0, ax1, ax2 in T.grid(T.int64(1), T.int64(197), T.int64(768)):
                with T.sblock("T_concat"):
                    v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
                    T.reads(T_transpose_intermediate[v_ax0, v_ax1 - T.int64(1), v_ax2], param_2[v_ax0, v_ax1, v_ax2])
                    T.writes(T_concat_intermediate[v_ax0, v_ax1, v_ax2])
                    T_concat_intermediate[v_ax0, v_ax1, v_ax2] = T.if_then_else(T.int64(1) <= v_ax1, T_transpose_intermediate[v_ax0, v_ax1 - T.int64(1), v_ax2], param_2[v_ax0, v_ax1, v_ax2])
            for ax0, ax1, ax2 in T.grid(T.int64(1), T.int64(197), T.int64(768)):
                with T.sblock("T_add1"):
                    v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
                    T.reads(T_concat_intermediate[v_ax0, v_ax1, v_ax2], param_3[v_ax0, v_ax1, v_ax2])
                    T.writes(T_add_intermediate[v_ax0, v_ax1, v_ax2])
                    T_add_intermediate[v_ax0, v_ax1, v_ax2] = T_concat_intermediate[v_ax0, v_ax1, v_ax2] + param_3[v_ax0, v_ax1, v_ax2]
    # fmt: on

    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    with cuda, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after = apply_gpu_schedules(Before)
    func = after["fused_conv2d_add_reshape_transpose_concatenate_add"]
    assert func.attrs["tirx.is_scheduled"]
    allocated = [b.name for block in find_all(func.body, tvm.s_tir.SBlock)
                 for b in block.alloc_buffers if "shared" in b.scope()]
    assert not allocated, allocated
    assert any("shared memory" in str(w.message) or "fewer rules" in str(w.message)
               for w in caught)

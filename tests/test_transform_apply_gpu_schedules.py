"""``ApplyGPUSchedules``: every fused PrimFunc gets a GPU schedule (DLight's rules, OptiFX's
template for a fused conv chain), checked by lowering it for the target."""

# ruff: noqa: E501

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion.pipeline import apply_gpu_schedules

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

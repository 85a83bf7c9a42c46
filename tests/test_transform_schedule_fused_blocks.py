"""``ScheduleFusedBlocks``: a fused PrimFunc becomes one loop nest per anchor on a CPU target;
other targets are left to DLight."""

# ruff: noqa: E501

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion.tir_schedules.fused_block import ScheduleFusedBlocks

CPU = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})


def _before(m: int = 4, n: int = 8) -> tvm.IRModule:
    """``relu(x + y)`` on ``m × n`` as FuseTIR leaves it: two loop nests and an intermediate
    buffer."""

    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def fused_add_relu(x: T.Buffer((T.int64(m), T.int64(n)), "float32"), y: T.Buffer((T.int64(m), T.int64(n)), "float32"), compute_intermediate: T.Buffer((T.int64(m), T.int64(n)), "float32")):
            T.func_attr({"tirx.noalias": True})
            T_add_intermediate = T.sblock_alloc_buffer((T.int64(m), T.int64(n)))
            for ax0, ax1 in T.grid(T.int64(m), T.int64(n)):
                with T.sblock("T_add"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(x[v_ax0, v_ax1], y[v_ax0, v_ax1])
                    T.writes(T_add_intermediate[v_ax0, v_ax1])
                    T_add_intermediate[v_ax0, v_ax1] = x[v_ax0, v_ax1] + y[v_ax0, v_ax1]
            for i0, i1 in T.grid(T.int64(m), T.int64(n)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(T_add_intermediate[v_i0, v_i1])
                    T.writes(compute_intermediate[v_i0, v_i1])
                    compute_intermediate[v_i0, v_i1] = T.max(T_add_intermediate[v_i0, v_i1], T.float32(0.0))

        @R.function
        def main(x: R.Tensor((m, n), "float32"), y: R.Tensor((m, n), "float32")) -> R.Tensor((m, n), "float32"):
            cls = Before
            with R.dataflow():
                gv = R.call_tir(cls.fused_add_relu, (x, y), out_ty=R.Tensor((m, n), "float32"))
                R.output(gv)
            return gv
    # fmt: on

    return Before


def test_elementwise_chain_becomes_one_loop_nest():
    """The add is inlined into the relu (no buffer kept); 32 elements are too few to
    parallelise and the 8-wide row is left to LLVM's vectoriser. The function records what
    was done and that it is scheduled."""

    # fmt: off
    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def fused_add_relu(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), y: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute_intermediate: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True, "tvm_fusion.kept_buffers": {}, "tvm_fusion.schedule": ["compute: elementwise/injective, inner 8 left to LLVM, serial", "inlined T_add: read once per element by 'compute'"], "tvm_fusion.scheduled": True})
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(x[v_i0, v_i1], y[v_i0, v_i1])
                    T.writes(compute_intermediate[v_i0, v_i1])
                    compute_intermediate[v_i0, v_i1] = T.max(x[v_i0, v_i1] + y[v_i0, v_i1], T.float32(0.0))

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), y: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            cls = Expected
            with R.dataflow():
                gv = R.call_tir(cls.fused_add_relu, (x, y), out_ty=R.Tensor((4, 8), "float32"))
                R.output(gv)
            return gv
    # fmt: on

    before = _before()
    with CPU:
        after = ScheduleFusedBlocks(CPU)(before)
    tvm.ir.assert_structural_equal(after, Expected)
    tvm.ir.assert_structural_equal(before, _before())  # the input is left as it was


def test_gpu_targets_are_left_alone():
    tvm.ir.assert_structural_equal(ScheduleFusedBlocks(tvm.target.Target("opencl"))(_before()),
                                   _before())


def test_rows_run_in_parallel_and_the_row_is_vectorised():
    """Enough work for both cores: rows in parallel, each row in 64-lane vectors (four
    AVX-512 registers per step). Only the PrimFunc changes, so only it is compared."""

    # fmt: off
    @T.prim_func(private=True, s_tir=True)
    def expected(x: T.Buffer((T.int64(64), T.int64(256)), "float32"), y: T.Buffer((T.int64(64), T.int64(256)), "float32"), compute_intermediate: T.Buffer((T.int64(64), T.int64(256)), "float32")):
        T.func_attr({"tirx.noalias": True, "tvm_fusion.kept_buffers": {}, "tvm_fusion.schedule": ["compute: elementwise/injective, vector 64, parallel 64", "inlined T_add: read once per element by 'compute'"], "tvm_fusion.scheduled": True})
        for i0 in T.parallel(T.int64(64)):
            for i1_0 in range(T.int64(4)):
                for i1_1 in T.vectorized(T.int64(64)):
                    with T.sblock("compute"):
                        v_i0 = T.axis.spatial(T.int64(64), i0)
                        v_i1 = T.axis.spatial(T.int64(256), i1_0 * T.int64(64) + i1_1)
                        T.reads(x[v_i0, v_i1], y[v_i0, v_i1])
                        T.writes(compute_intermediate[v_i0, v_i1])
                        compute_intermediate[v_i0, v_i1] = T.max(x[v_i0, v_i1] + y[v_i0, v_i1], T.float32(0.0))
    # fmt: on

    with CPU:
        after = ScheduleFusedBlocks(CPU)(_before(64, 256))
    tvm.ir.assert_structural_equal(after["fused_add_relu"], expected)


# fmt: off
@T.prim_func(s_tir=True)
def _padded_rows(x: T.Buffer((1, 64, 1), "float32"), out: T.Buffer((1, 64, 1), "float32")):
    pad = T.sblock_alloc_buffer((1, 64, 3))
    for i0, i1, i2 in T.grid(1, 64, 3):
        with T.sblock("pad"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            pad[v0, v1, v2] = T.if_then_else(v2 == 1, x[v0, v1, 0], T.float32(0))
    for i0, i1, i2 in T.grid(1, 64, 1):
        with T.sblock("row"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            out[v0, v1, v2] = pad[v0, (v1 + 1) % 64, 0] + pad[v0, v1, 1] + pad[v0, v1, 2]
# fmt: on


def test_parallel_loops_start_below_an_attached_stage():
    """A stage attached at the unit batch loop above the rows (a padding computed once) breaks
    the nest there: the parallel loop is the row loop below it, not a fuse across the stage,
    which TVM rejects (fuzz seed 2478: the block fell back to plain loops)."""
    from tvm import s_tir

    from tvm_fusion.tir_schedules.cpu_target import cpu_params
    from tvm_fusion.tir_schedules.loops import parallelize

    sch = s_tir.Schedule(_padded_rows)
    row = sch.get_sblock("row")
    sch.compute_at(sch.get_sblock("pad"), sch.get_loops(row)[0])
    loops = sch.get_loops(row)
    assert parallelize(sch, loops[:2], 1 << 20, cpu_params(CPU)) == "parallel 64"
    assert sch.get(loops[1]).kind == tvm.tirx.ForKind.PARALLEL

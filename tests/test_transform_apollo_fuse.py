"""``ApolloFuse``: Apollo's partition, ``FuseTIR`` and the CPU schedules with scheduler feedback,
in one pass on legalized Relax."""

# ruff: noqa: E501

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion.relay_passes.apollo.feedback import ApolloFuse, MemoryBlocklist, plan_module_apollo
from tvm_fusion.relay_passes.apollo.partition import ApolloOptions
from tvm_fusion.relay_passes.rejection import RejectReason

CPU = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})
OPTIONS = ApolloOptions(cores=2)  # Layer III's occupancy estimate, not this machine's


def _add_relu() -> tvm.IRModule:
    """``relu(x + y)``, legalized."""

    # fmt: off
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def add(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), y: T.Buffer((T.int64(4), T.int64(8)), "float32"), T_add: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for ax0, ax1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("T_add"):
                    v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(x[v_ax0, v_ax1], y[v_ax0, v_ax1])
                    T.writes(T_add[v_ax0, v_ax1])
                    T_add[v_ax0, v_ax1] = x[v_ax0, v_ax1] + y[v_ax0, v_ax1]

        @T.prim_func(private=True, s_tir=True)
        def relu(lv0: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(lv0[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1])
                    compute[v_i0, v_i1] = T.max(lv0[v_i0, v_i1], T.float32(0.0))

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), y: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            cls = Before
            with R.dataflow():
                lv0 = R.call_tir(cls.add, (x, y), out_ty=R.Tensor((4, 8), "float32"))
                gv = R.call_tir(cls.relu, (lv0,), out_ty=R.Tensor((4, 8), "float32"))
                R.output(gv)
            return gv
    # fmt: on

    return Before


def test_elementwise_pair_is_fused_and_scheduled_as_one_loop_nest():
    """Layer I's rule ① (element-wise → element-wise) merges the pair; FuseTIR makes it one
    PrimFunc, which the CPU schedule turns into one loop nest."""

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

    before = _add_relu()
    with CPU:
        after = ApolloFuse(OPTIONS)(before)
    tvm.ir.assert_structural_equal(after, Expected)
    tvm.ir.assert_structural_equal(before, _add_relu())  # the input is left as it was


def test_a_failing_schedule_splits_the_partition_back():
    """Feedback: the fused function's schedule fails (injected), the merge that built it is
    undone and the module is re-planned: the two operators come back as they were, and the
    blocklisted merge is a rejection typed as a schedule failure."""
    blocklist = MemoryBlocklist()
    with CPU:
        after = ApolloFuse(OPTIONS, schedule=False, rounds=2, blocklist=blocklist,
                           fail_hook=lambda name, _func: name == "fused_add_relu")(_add_relu())
    tvm.ir.assert_structural_equal(after, _add_relu())
    (plan,) = plan_module_apollo(_add_relu(), OPTIONS, blocklist=blocklist).plans.values()
    assert [(r.first, r.second, r.reason) for r in plan.rejections] == [
        ("lv0=add[O2O]", "gv=relu[O2O]", RejectReason.SCHEDULE_FAILURE)]


def test_independent_kernels_are_packed_into_one():
    """Layer III (parallelism stitching): two kernels with no edge between them, too small to
    keep the cores busy alone, share one launch (Eq. (3) gain: the launch saved). DNNFusion
    never fuses operators without a producer-consumer edge."""

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
        def relu(y: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(y[v_i0, v_i1])
                    T.writes(compute[v_i0, v_i1])
                    compute[v_i0, v_i1] = T.max(y[v_i0, v_i1], T.float32(0.0))

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), y: R.Tensor((4, 8), "float32")) -> R.Tuple(R.Tensor((4, 8), "float32"), R.Tensor((4, 8), "float32")):
            cls = Before
            with R.dataflow():
                a = R.call_tir(cls.tir_exp, (x,), out_ty=R.Tensor((4, 8), "float32"))
                b = R.call_tir(cls.relu, (y,), out_ty=R.Tensor((4, 8), "float32"))
                gv = (a, b)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def fused_tir_exp_relu(x: T.Buffer((T.int64(4), T.int64(8)), "float32"), y: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute_intermediate: T.Buffer((T.int64(4), T.int64(8)), "float32"), compute_intermediate_1: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(x[v_i0, v_i1])
                    T.writes(compute_intermediate[v_i0, v_i1])
                    compute_intermediate[v_i0, v_i1] = T.exp(x[v_i0, v_i1])
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute1"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(y[v_i0, v_i1])
                    T.writes(compute_intermediate_1[v_i0, v_i1])
                    compute_intermediate_1[v_i0, v_i1] = T.max(y[v_i0, v_i1], T.float32(0.0))

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), y: R.Tensor((4, 8), "float32")) -> R.Tuple(R.Tensor((4, 8), "float32"), R.Tensor((4, 8), "float32")):
            cls = Expected
            with R.dataflow():
                fused = R.call_tir(cls.fused_tir_exp_relu, (x, y), out_ty=[R.Tensor((4, 8), "float32"), R.Tensor((4, 8), "float32")])
                a: R.Tensor((4, 8), "float32") = fused[0]
                b: R.Tensor((4, 8), "float32") = fused[1]
                gv = (a, b)
                R.output(gv)
            return gv
    # fmt: on

    with CPU:
        after = ApolloFuse(OPTIONS, schedule=False)(Before)
    tvm.ir.assert_structural_equal(after, Expected)

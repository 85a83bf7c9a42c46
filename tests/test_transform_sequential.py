"""``transform.Sequential``, the whole graph-level pipeline, end to end on a small high-level
Relax module: rewriting, legalisation, SmartMem, DNNFusion's plan, ``FuseTIR`` and the CPU
schedule each leave their mark on the one kernel that comes out."""

# ruff: noqa: E501

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_fusion.transform import Sequential

CPU = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})


def test_five_operators_become_one_loop_nest():
    """``relu(xᵀ·w + xᵀ·v)``: rewriting factors it to ``relu(xᵀ·(w + v))``, SmartMem composes
    the transpose into the loads of ``x``, the planner puts everything in one block, and the
    schedule inlines it into a single loop nest with no intermediate buffer."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((8, 4), "float32"), w: R.Tensor((4, 8), "float32"), v: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                t = R.permute_dims(x, [1, 0])
                lv0 = R.multiply(t, w)
                lv1 = R.multiply(t, v)
                lv2 = R.add(lv0, lv1)
                gv = R.nn.relu(lv2)
                R.output(gv)
            return gv

    # fmt: off
    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def fused_add_fused_smartmem_copy_multiply_relu(w: T.Buffer((T.int64(4), T.int64(8)), "float32"), v: T.Buffer((T.int64(4), T.int64(8)), "float32"), x: T.Buffer((T.int64(8), T.int64(4)), "float32"), compute_intermediate: T.Buffer((T.int64(4), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True, "tvm_fusion.kept_buffers": {}, "tvm_fusion.schedule": ["compute: elementwise/injective, inner 8 left to LLVM, serial", "inlined T_add: read once per element by 'T_multiply'", "inlined T_multiply: read once per element by 'compute'"], "tvm_fusion.scheduled": True})
            for i0, i1 in T.grid(T.int64(4), T.int64(8)):
                with T.sblock("compute"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(x[v_i1, v_i0], w[v_i0, v_i1], v[v_i0, v_i1])
                    T.writes(compute_intermediate[v_i0, v_i1])
                    compute_intermediate[v_i0, v_i1] = T.max(x[v_i1, v_i0] * (w[v_i0, v_i1] + v[v_i0, v_i1]), T.float32(0.0))

        @R.function
        def main(x: R.Tensor((8, 4), "float32"), w: R.Tensor((4, 8), "float32"), v: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            cls = Expected
            with R.dataflow():
                gv = R.call_tir(cls.fused_add_fused_smartmem_copy_multiply_relu, (w, v, x), out_ty=R.Tensor((4, 8), "float32"))
                R.output(gv)
            return gv
    # fmt: on

    with CPU:
        after = Sequential(CPU)(Before)
    tvm.ir.assert_structural_equal(after, Expected)

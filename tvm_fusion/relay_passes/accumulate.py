"""Convs, matmuls and reductions over 16-bit floats sum in float32 where the CPU has no
arithmetic for them.

TVM 0.27 legalises an fp16 (bf16) ``conv2d`` or ``matmul`` whose ``out_dtype`` is unset with an
accumulator of the input type. On a CPU without fp16 arithmetic (x86 without AVX512-FP16,
aarch64 without FP16; bf16 everywhere) LLVM then converts every multiply-add to float32 and
rounds the running sum back to 16 bits: six times ONNX Runtime's time on an fp16 MobileNetV3
(which computes such nodes in float32, fp16 being only their storage), and a sum of many
terms that loses digits at each step. Here such a call gets ``out_dtype="float32"`` and a cast
back to its dtype after it::

    y = conv2d(x, w)                   # x, w float16
    →  y = astype(conv2d(x, w, out_dtype="float32"), "float16")

so its kernel loads fp16, multiplies and sums in float32 registers and stores fp16 (the cast
is an elementwise epilogue that fuses into it): activations stay 16-bit, and the packed GEMM
(``layout/gemm_pack.py``) takes the call with its weight widened to float32 at compile time.
A reduction without an ``out_dtype`` (``mean``: a global average pool; ``softmax``'s sum; an
average pool) is legalised by TVM's own legalisation with its TE function applied to the input
cast up and its result cast back (:func:`widened_legalizations`): one kernel, as before, that
sums in float32. A Relax-level ``astype`` around it instead would be a kernel of its own under
stock FuseOps (a float32 copy of the input, twice its bytes). (TVM's ``layer_norm`` already
sums an fp16 input in float32.)
Where the target computes in the type (``CpuParams.accumulates``: AVX512-FP16, NEON with
``+fullfp16``) nothing changes. The choice follows the target, not the machine compiling.
"""

from __future__ import annotations

import inspect

import tvm
from tvm import relax, te

from ..tir_schedules.cpu_target import cpu_params

__all__ = ["REDUCTIONS", "WIDENED_OPS", "AccumulateInFloat32", "widened_legalizations"]

# the ops whose legalisation takes an ``out_dtype`` for its sum, and their constructors
WIDENED_OPS = {
    "relax.matmul": relax.op.matmul,
    "relax.nn.conv1d": relax.op.nn.conv1d,
    "relax.nn.conv2d": relax.op.nn.conv2d,
    "relax.nn.conv3d": relax.op.nn.conv3d,
    "relax.nn.conv1d_transpose": relax.op.nn.conv1d_transpose,
    "relax.nn.conv2d_transpose": relax.op.nn.conv2d_transpose,
}
# reductions whose legalisation sums in the input's type (their one data input)
REDUCTIONS = ("relax.sum", "relax.mean", "relax.variance", "relax.std", "relax.nn.softmax",
              "relax.nn.log_softmax", "relax.nn.avg_pool1d", "relax.nn.avg_pool2d",
              "relax.nn.avg_pool3d", "relax.nn.adaptive_avg_pool1d",
              "relax.nn.adaptive_avg_pool2d", "relax.nn.adaptive_avg_pool3d")
_UNSET = ("", "void", "None")


def AccumulateInFloat32(target: tvm.target.Target) -> tvm.transform.Pass:  # noqa: N802 (a pass)
    """On ``llvm`` targets, fp16/bf16 convs and matmuls whose sum the target cannot compute in
    their type sum in float32 and cast back (module docstring); other targets: unchanged."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.AccumulateInFloat32")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if target.kind.name != "llvm":
            return mod
        params = cpu_params(target)
        rewriter = _Widen(mod, params.accumulates)
        changed = False
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                new = rewriter.visit_expr(func)
                if not new.same_as(func):
                    rewriter.builder_.update_func(gvar, new)
                    changed = True
        return rewriter.builder_.get() if changed else mod

    return _pass


@relax.expr_functor.mutator
class _Widen(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, accumulates):
        super().__init__(mod)
        self.accumulates = accumulates

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (TVM's visitor name)
        call = self.visit_expr_post_order(call)
        make = WIDENED_OPS.get(getattr(call.op, "name", ""))
        if make is None or len(call.args) != 2:
            return call
        dtypes = {str(getattr(arg.ty, "dtype", "")) for arg in call.args}
        if len(dtypes) != 1:
            return call
        dtype = dtypes.pop()
        out_dtype = str(call.attrs.out_dtype)
        wide = self.accumulates(dtype) if dtype else dtype
        if wide == dtype or out_dtype not in (*_UNSET, dtype):
            return call
        fields = list(inspect.signature(make).parameters)[2:]  # after the two operands
        attrs = {name: getattr(call.attrs, name) for name in fields if name != "out_dtype"}
        widened = self.builder_.emit(make(*call.args, **attrs, out_dtype=wide))
        return relax.op.astype(widened, dtype)


def widened_legalizations(target: tvm.target.Target) -> dict:
    """``LegalizeOps``' custom legalisations of :data:`REDUCTIONS` for ``target``: where it
    cannot sum a 16-bit float in its type, TVM's legalisation of the op with its TE function
    applied to the input cast to float32 and its result cast back; other calls are TVM's
    legalisation unchanged. Empty for targets other than ``llvm``."""
    if target.kind.name != "llvm":
        return {}
    accumulates = cpu_params(target).accumulates

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        stock = call.op.get_attr("FLegalize")
        dtype = str(getattr(call.args[0].ty, "dtype", "")) if call.args else ""
        wide = accumulates(dtype) if dtype else dtype
        if wide == dtype:
            return stock(bb, call)
        name = call.op.name.rsplit(".", 1)[-1]  # the kernel's name, as TVM's: "mean"
        return stock(_Widening(bb, call.args[0], wide, dtype, name), call)

    return dict.fromkeys(REDUCTIONS, legalize)


class _Widening:
    """A block builder for one op's legalisation whose ``call_te`` on ``data`` computes the TE
    function on ``data`` cast to ``wide`` and casts the result back to ``narrow``; everything
    else (a zero-size reduction's ``full``) is the builder's."""

    def __init__(self, bb: relax.BlockBuilder, data: relax.Expr, wide: str, narrow: str,
                 name: str):
        self.bb, self.data, self.wide, self.narrow, self.name = bb, data, wide, narrow, name

    def call_te(self, func, *args, **kwargs):
        if not args or not isinstance(args[0], relax.Expr) or not args[0].same_as(self.data):
            return self.bb.call_te(func, *args, **kwargs)

        def widened(x, *rest, **more):
            # stages named apart from the op's own ("compute"): the schedule rules tell a
            # function's stages by name, and inline the cast up into the reduction
            up = te.compute(x.shape, lambda *i: x(*i).astype(self.wide), name="T_cast_up")
            out = func(up, *rest, **more)
            return te.compute(out.shape, lambda *i: out(*i).astype(self.narrow),
                              name="T_cast_down")

        kwargs.setdefault("primfunc_name_hint", self.name)
        return self.bb.call_te(widened, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.bb, name)

"""Packed ``NCHW[x]c`` convolutions on CPU: DNNFusion's inter-block layout for conv blocks.

DNNFusion gives each block its dominant operator's best layout (`../shared/specs/dnnfusion.md`
§6). On a CPU a dense convolution's best layout packs ``x`` channels — one SIMD register — as
the innermost axis: the output-channel block is the vector axis, each input element one
broadcast reused by every lane, each weight vector reused across a register tile of output
positions, and every load contiguous. In plain NCHW the same conv vectorises along a row and
must re-load the input per output channel.

``PackConvs`` runs TVM's own ``ConvertLayout`` (``conv2d`` to ``NCHW{x}c`` / ``OIHW{x}i{x}o``;
its layout inference keeps NCHW for a conv whose channels do not divide or that is grouped,
and carries the packed layout through element-wise ops), then legalises the packed convs to
TOPI's ``conv2d_NCHWc`` (0.27's ``LegalizeOps`` leaves them unlegalised). Weights are packed
at compile time (``FoldConstant``); the activations' ``layout_transform``s left at the edges
of packed regions are what SmartMem's elimination then folds into their neighbours.

Policy (option ``conv_layout``): ``"auto"`` packs when the model has no grouped (e.g.
depthwise) convolution — mixing packed dense convs with NCHW depthwise convs puts a layout
change on every edge between them (MobileNetV2 measured 6.25 → 6.54 ms packed), whereas a
model of dense convs runs packed throughout (ResNet-50 59 → 46 ms); ``"NCHWc"`` always packs;
``"NCHW"`` never does.
"""

from __future__ import annotations

import warnings

import tvm
from tvm import relax, topi

from ..tir_schedules.cpu_target import cpu_params

POLICIES = ("auto", "NCHWc", "NCHW")


class PackConvsWarning(UserWarning):
    """Packing failed inside TVM's ConvertLayout; the module stays NCHW."""


def conv_calls(func: relax.Function) -> list[relax.Call]:
    """Every ``relax.nn.conv2d`` call of a function."""
    calls = []

    def visit(node):
        if isinstance(node, relax.Call) and getattr(node.op, "name", "") == "relax.nn.conv2d":
            calls.append(node)

    relax.analysis.post_order_visit(func.body, visit)
    return calls


def should_pack(mod: tvm.IRModule, policy: str) -> tuple[bool, str]:
    """Whether to pack this module's convs, and why (for the record)."""
    if policy not in POLICIES:
        raise ValueError(f"conv_layout must be one of {POLICIES}, got {policy!r}")
    convs = [c for f in mod.functions.values() if isinstance(f, relax.Function)
             for c in conv_calls(f)]
    if policy == "NCHW" or not convs:
        return False, "no conv" if not convs else "conv_layout='NCHW'"
    grouped = sum(int(c.attrs.groups) != 1 for c in convs)
    if policy == "auto" and grouped:
        return False, f"{grouped} grouped conv(s): NCHW throughout avoids a layout change " \
                      f"between every grouped and dense conv"
    return True, f"{len(convs) - grouped} dense conv(s) packed"


def _legalize_packed(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    attrs = call.attrs
    if str(attrs.data_layout) == "NCHW":
        return call  # the stock legaliser takes it
    if int(attrs.groups) != 1:
        return _grouped_as_nchw(bb, call)
    return bb.call_te(topi.nn.conv2d_NCHWc, call.args[0], call.args[1],
                      [int(s) for s in attrs.strides], [int(p) for p in attrs.padding],
                      [int(d) for d in attrs.dilation], str(attrs.data_layout),
                      str(attrs.out_layout), str(call.ty.dtype),
                      primfunc_name_hint="conv2d_NCHWc")


def _grouped_as_nchw(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """A grouped conv ConvertLayout packed (it packs every conv whose channels per group the
    block divides) computed in NCHW between two layout changes: 0.27's legaliser leaves a
    packed grouped conv alone and VM codegen then fails ("cannot emit this Relax operator
    directly"; found by the fuzzer's wide convs under ``conv_layout="NCHWc"``). The weight's
    change is its own binding, which FoldConstant folds."""
    attrs = call.attrs
    data = bb.emit_te(topi.layout_transform, call.args[0], str(attrs.data_layout), "NCHW")
    weight = bb.emit_te(topi.layout_transform, call.args[1], str(attrs.kernel_layout), "OIHW")
    out = bb.emit_te(topi.nn.group_conv2d_nchw, data, weight,
                     [int(s) for s in attrs.strides], [int(p) for p in attrs.padding],
                     [int(d) for d in attrs.dilation], int(attrs.groups), str(call.ty.dtype))
    return bb.call_te(topi.layout_transform, out, "NCHW", str(attrs.out_layout))


def PackConvs(target: tvm.target.Target, policy: str = "auto",  # noqa: N802 (a TVM pass)
              block: int | None = None) -> tvm.transform.Pass:
    """Pack dense convs to ``NCHW{block}c`` (``block``: the target's fp32 SIMD lanes) on
    ``llvm`` targets; other targets are left alone."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.PackConvs")
    def _pack(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if target.kind.name != "llvm":
            return mod
        pack, _ = should_pack(mod, policy)
        if not pack:
            return mod
        lanes = block or cpu_params(target).lanes
        try:
            with target:  # TOPI's conv2d_NCHWc asks for the current target
                return tvm.transform.Sequential([
                    relax.transform.DecomposeOpsForInference(),
                    relax.transform.ConvertLayout(
                        {"relax.nn.conv2d": [f"NCHW{lanes}c", f"OIHW{lanes}i{lanes}o"]}),
                    relax.transform.LegalizeOps({"relax.nn.conv2d": _legalize_packed}),
                    relax.transform.FoldConstant(),
                ])(mod)
        except Exception as err:  # noqa: BLE001 (TVM raises several types)
            # 0.27's ConvertLayout fails on some broadcasts against packed tensors (found by
            # the random-DAG test: "Cannot broadcast from 5 to 4", a dim of 0): keep NCHW
            first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
            warnings.warn(f"tvm_fusion: packing convs to NCHW{lanes}c failed "
                          f"({type(err).__name__}: {first}); keeping NCHW", PackConvsWarning,
                          stacklevel=2)
            return mod

    return _pack


__all__ = ["PackConvs", "PackConvsWarning", "POLICIES", "should_pack"]

"""Symbolic shapes end to end (issue 19, item 1) and the host CPU target (item 4).

Every model has ONNX ``dim_param`` dimensions (batch, sequence, box count). Each is compiled
ONCE, symbolic, with tvm_fusion and with stock TVM, then run at two sizes and compared with
ONNX Runtime and with the stock build; the fused module has no more kernels than stock FuseOps.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import tvm
from conftest import TARGET
from tvm import relax, tirx

from tvm_fusion import symbolic
from tvm_fusion import target as host
from tvm_fusion.cli import main as cli_main
from tvm_fusion.compile import compile_model, count_kernels, fuse, graph_input_names, import_onnx
from tvm_fusion.compile import run as run_vm
from tvm_fusion.feeds import random_inputs, run_shapes
from tvm_fusion.instrument import Collector
from tvm_fusion.models.symbolic import conv_net, decoder_block, encoder_layer, mlp, nms_model
from tvm_fusion.numerics import compare, onnx_reference
from tvm_fusion.threads import physical_cores
from tvm_fusion.tir_schedules.fused_block import FALLBACK_ATTR, SCHEDULE_ATTR


def check_symbolic(model: onnx.ModelProto, sizes: list[dict], rtol=1e-4, atol=1e-5,
                   at_most_stock: bool = True, **options) -> tvm.IRModule:
    """Compile ``model`` once with tvm_fusion and once with stock TVM; at every entry of
    ``sizes`` both must match ONNX Runtime. Returns the fused module, which has no more
    kernels than stock FuseOps' unless ``at_most_stock`` is False."""
    mod = import_onnx(model)
    ours = compile_model(mod, TARGET, **options)
    stock = compile_model(mod, TARGET, strategy="tvm")
    for size in sizes:
        feeds = random_inputs(model, seed=1, shape_overrides=size)
        inputs = [feeds[name] for name in graph_input_names(model)]
        got = run_vm(ours, inputs)
        compare(got, onnx_reference(model, feeds), rtol=rtol, atol=atol)
        compare(got, run_vm(stock, inputs), rtol=rtol, atol=atol)
    fused = fuse(mod, TARGET, **options)
    if at_most_stock:
        assert count_kernels(fused) <= count_kernels(fuse(mod, TARGET, strategy="tvm"))
    return fused


def _prim_funcs(mod: tvm.IRModule) -> dict:
    return {g.name_hint: f for g, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}


# ---------------------------------------------------------------------------------- models


@pytest.mark.parametrize("packed", [True, False])
def test_matmul_add_relu_batch_and_sequence(packed):
    fused = check_symbolic(mlp(), [{"batch": 1, "seq": 7}, {"batch": 3, "seq": 33}],
                           pack_weights=packed)
    assert count_kernels(fused) == 1
    (func,) = _prim_funcs(fused).values()
    notes = list(func.attrs[SCHEDULE_ATTR])
    if packed:  # the packed GEMM: one nest for every length, its M tail by runtime bounds
        assert any("packed GEMM" in n and "epilogue" in n for n in notes), notes
    else:  # the register tile over the symbolic rows, padded to whole tiles (remainder
        # guarded only in the write-back), not left as is
        assert any("tile matmul" in n and "padded to a multiple" in n for n in notes), notes
    assert FALLBACK_ATTR not in func.attrs


@pytest.mark.slow
def test_encoder_layer():
    fused = check_symbolic(encoder_layer(), [{"batch": 1, "seq": 7}, {"batch": 2, "seq": 33}])
    stock = count_kernels(fuse(import_onnx(encoder_layer()), TARGET, strategy="tvm"))
    assert count_kernels(fused) < stock
    for name, func in _prim_funcs(fused).items():
        notes = " ".join(func.attrs[SCHEDULE_ATTR])
        assert "not analysable" not in notes, (name, notes)
        assert FALLBACK_ATTR not in func.attrs, (name, func.attrs[FALLBACK_ATTR])


def test_decoder_block_with_causal_mask():
    fused = check_symbolic(decoder_block(), [{"batch": 1, "seq": 5}, {"batch": 2, "seq": 33}])
    assert count_kernels(fused) < count_kernels(
        fuse(import_onnx(decoder_block()), TARGET, strategy="tvm"))


def test_conv_net_dynamic_batch():
    check_symbolic(conv_net(), [{"batch": 1}, {"batch": 3}])


@pytest.mark.slow
def test_conv_net_packed_dynamic_batch():
    """Conv packing (NCHW[x]c) keeps a symbolic batch."""
    fused = check_symbolic(conv_net(), [{"batch": 2}], conv_layout="NCHWc")
    assert any("NCHWc" in name for name in _prim_funcs(fused))


def test_non_max_suppression():
    """NMS's output shape is read at run time (match_cast): the slice that uses it keeps its
    own kernel, after the shape computation it depends on."""
    fused = check_symbolic(nms_model(), [{"num_boxes": 20}, {"num_boxes": 50}])
    collector = Collector()
    with tvm.transform.PassContext(instruments=[collector]):
        fuse(import_onnx(nms_model()), TARGET)
    nodes = [n for p in collector.plans[0].plans.values() for n in p.ecg.nodes]
    slices = [n for n in nodes if "dynamic_strided_slice" in n.op_name]
    assert slices and not slices[0].fusible and "run time" in slices[0].reason
    assert count_kernels(fused) < count_kernels(
        fuse(import_onnx(nms_model()), TARGET, strategy="tvm"))


def _symbolize(model: onnx.ModelProto, axis: int, name: str) -> onnx.ModelProto:
    """``model`` with dimension ``axis`` of every graph input and output made ``name``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name for t in out.graph.initializer}
    for vi in [*out.graph.input, *out.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        if vi.name not in inits and len(dims) > axis:
            dims[axis].Clear()
            dims[axis].dim_param = name
    del out.graph.value_info[:]
    return out


@pytest.mark.parametrize("op, axis, sizes, options", [
    # shape_to_tensor takes the batch as a PrimType argument: kept out of fusion groups
    ("Gather", 0, (10, 12), {}),
    # reshape/transpose with seq // 4 extents take seq as tir_vars
    ("DepthToSpace", 1, (8, 12), {}),
    # symbolic input channels, packed to NCHW4c: SmartMem's epilogue group must skip the conv
    # (a lone conv forced to NCHWc adds its two layout transforms: no kernel-count claim)
    ("Conv", 1, (8,), {"conv_layout": "NCHWc", "at_most_stock": False}),
])
def test_single_ops_taking_symbolic_sizes(op, axis, sizes, options):
    from tvm_fusion.testing.single_op import single_op_model

    model = _symbolize(single_op_model(op), axis, "n_sym")
    check_symbolic(model, [{"n_sym": n} for n in sizes], **options)


@pytest.mark.slow
def test_encoder_apollo():
    check_symbolic(encoder_layer(), [{"batch": 1, "seq": 7}, {"batch": 2, "seq": 20}],
                   strategy="apollo")


def test_relax_pipeline_compiles_once_runs_at_two_sizes():
    model = mlp()
    mod = import_onnx(model)
    ex = tvm.compile(mod, TARGET, relax_pipeline="tvm_fusion")
    for size in ({"batch": 2, "seq": 5}, {"batch": 1, "seq": 64}):
        feeds = random_inputs(model, shape_overrides=size)
        compare(run_vm(ex, [feeds["x"]]), onnx_reference(model, feeds))


# ------------------------------------------------------------------- representative sizes


def test_extent_defaults_and_hints():
    seq, batch = tirx.Var("seq", "int64"), tirx.Var("batch", "int64")
    assert symbolic.extent(seq * batch * 4) == symbolic.DEFAULT_EXTENT * symbolic.DEFAULT_BATCH * 4
    with symbolic.symbolic_hints({"seq": 7, "batch": 3}):
        assert symbolic.extent(seq * batch * 4) == 84
        assert symbolic.numel([batch, seq, 64]) == 3 * 7 * 64
    assert symbolic.extent(seq) == symbolic.DEFAULT_EXTENT
    with pytest.raises(ValueError, match="symbolic_hint"):
        symbolic.check_hints({"seq": 0})


def test_hint_scales_intermediate_bytes():
    mod = import_onnx(encoder_layer())

    def irs(**options) -> int:
        collector = Collector()
        with tvm.transform.PassContext(instruments=[collector]):
            fuse(mod, TARGET, schedule=False, **options)
        return sum(p.ecg.irs_bytes_unfused() for p in collector.plans[0].plans.values())

    small, large = irs(symbolic_hint={"seq": 16}), irs(symbolic_hint={"seq": 64})
    assert 0 < small < large
    with pytest.raises(ValueError, match="symbolic_hint"):
        fuse(mod, TARGET, symbolic_hint=[1, 2])


def test_run_shapes_resolves_dims_from_full_shapes():
    model = encoder_layer()
    shapes = run_shapes(model, {"x": (2, 16, 64)})
    feeds = random_inputs(model, shape_overrides=shapes)
    assert feeds["mask"].shape == (2, 1, 1, 16)
    assert run_shapes(model) == {"batch": symbolic.DEFAULT_BATCH, "seq": symbolic.DEFAULT_EXTENT}
    with pytest.raises(ValueError, match="not a graph input or symbolic dimension"):
        run_shapes(model, {"tokens": 3})
    with pytest.raises(ValueError, match="does not fit"):
        run_shapes(model, {"x": (2, 16, 32)})


# ------------------------------------------------------------------------------------ CLI


def test_cli_report_and_compile_with_input_shape(tmp_path, capsys):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp(), path)
    assert cli_main(["report", str(path), "--target", "llvm", "--input-shape", "x=2,5,64",
                     "--input-shape", "seq=5"]) == 0
    out = capsys.readouterr().out
    assert "run and checked at x=[2,5,64]" in out and "tvm_fusion 1" in out
    assert cli_main(["report", str(path), "--target", "llvm", "--input-shape", "x=2,5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit" in err[0]
    # one --input-shape list serves several models; a name no model has is an error
    conv = tmp_path / "conv.onnx"
    onnx.save(conv_net(), conv)
    assert cli_main(["report", str(path), str(conv), "--target", "llvm", "--no-check",
                     "--input-shape", "seq=3", "--input-shape", "batch=2"]) == 0
    capsys.readouterr()
    assert cli_main(["report", str(conv), "--target", "llvm", "--input-shape", "seq=3"]) == 2
    assert "no model has an input" in capsys.readouterr().err
    lib = tmp_path / "mlp.so"
    assert cli_main(["compile", str(path), "--target", "llvm", "-o", str(lib)]) == 0
    ex = tvm.runtime.load_module(str(lib))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    for rows in (3, 9):  # the exported library is still symbolic
        x = np.random.default_rng(0).standard_normal((1, rows, 64)).astype("float32")
        y = vm["main"](tvm.runtime.tensor(x)).numpy()
        compare([y], onnx_reference(mlp(), {"x": x}))


# ------------------------------------------------------------------------------ host CPU


def test_host_target_names_the_cpu():
    tgt = host.host_target()
    assert tgt.kind.name == "llvm"
    assert str(tgt.attrs["mcpu"]) == str(tvm.target.codegen.llvm_get_system_cpu())
    assert int(tgt.attrs["num-cores"]) == physical_cores()
    assert not host.is_bare_x86_llvm(tgt)
    assert not host.is_bare_x86_llvm(tvm.target.Target(
        {"kind": "llvm", "mtriple": "aarch64-linux-gnu"}))
    assert host.is_bare_x86_llvm(tvm.target.Target(
        {"kind": "llvm", "mtriple": "x86_64-linux-gnu"}))


def test_bare_llvm_warns_once(monkeypatch):
    from tvm_fusion.transform import Sequential

    monkeypatch.setattr(host, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Sequential({"kind": "llvm", "mtriple": "x86_64-linux-gnu"})
        Sequential({"kind": "llvm", "mtriple": "x86_64-linux-gnu"})
        Sequential(host.host_target())
    texts = [str(w.message) for w in caught if "names no CPU" in str(w.message)]
    assert len(texts) == 1 and "mcpu" in texts[0]


def test_cli_default_target_is_the_host(monkeypatch, tmp_path):
    import tvm_fusion.report as report_module

    seen = []

    def fake_report(model, name, target, **kwargs):
        seen.append(target)
        raise ValueError("stop here")

    monkeypatch.setattr(report_module, "make_report", fake_report)
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp(), path)
    for extra in ([], ["--target", "native"]):
        assert cli_main(["report", str(path), *extra]) == 2
    assert all(str(t.attrs["mcpu"]) == host.host_cpu() for t in seen) and len(seen) == 2


# ------------------------------------------------------- grouping and schedules (issue 24)


def _merge_heads_module() -> tvm.IRModule:
    """``(batch, 4, 17) -> (batch*4, 17) -> relu -> (batch, 4, 17) * 2``: the second reshape's
    result uses ``batch``, which no shape of a group that starts after the first defines."""
    batch = tirx.Var("batch", "int64")
    x = relax.Var("x", relax.TensorType([batch, 4, 17], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            flat = bb.emit(relax.op.reshape(x, relax.ShapeExpr([batch * 4, 17])))
            act = bb.emit(relax.op.nn.relu(flat))
            back = bb.emit(relax.op.reshape(act, relax.ShapeExpr([batch, 4, 17])))
            out = bb.emit_output(relax.op.multiply(back, relax.const(2.0, "float32")))
        bb.emit_func_output(out)
    return bb.get()


def test_a_group_gets_the_sizes_its_parameters_do_not_define():
    mod = _merge_heads_module()
    fused = fuse(mod, TARGET)
    main = fused["main"].script()
    assert "ndim=3" not in main  # every result has its shape (an opaque one failed to build)
    executable = compile_model(mod, TARGET)
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 4, 17)).astype("float32")
        (got,) = run_vm(executable, [x])
        np.testing.assert_allclose(got, np.maximum(x, 0) * 2, rtol=1e-6)


def test_a_stage_is_not_attached_where_it_would_be_recomputed_per_row():
    """A producer that each row of its consumer reads through ``(i * seq + j) // seq % seq``
    (what chains of symbolic reshapes leave): TVM bounds that by two whole rows' worth of
    rows, not one (nothing in the PrimFunc proves ``seq > 0``), so per row it would compute
    about twice all of it; read as ``B[i, j]`` it is attached."""
    from tvm.script import tirx as T

    from tvm_fusion.tir_schedules.cpu import _recomputes

    def schedule(row_of):
        @T.prim_func(s_tir=True)
        def func(a: T.handle, c: T.handle):
            seq = T.int64()
            A = T.match_buffer(a, (seq, seq), "float32")
            C = T.match_buffer(c, (seq, seq), "float32")
            B = T.sblock_alloc_buffer((seq, seq), "float32")
            for i, j in T.grid(seq, seq):
                with T.sblock("B"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = A[vi, vj] * T.float32(2)
            for i, j in T.grid(seq, seq):
                with T.sblock("C"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = B[row_of(vi, vj, seq), vj] + T.float32(1)

        sch = tvm.s_tir.Schedule(func)
        return sch, sch.get_sblock("B"), sch.get_loops(sch.get_sblock("C"))[0]

    assert _recomputes(*schedule(lambda i, j, n: (i * n + j) // n % n))
    assert not _recomputes(*schedule(lambda i, j, n: i))

"""Texture (image2d) layouts for Adreno OpenCL: the mapping, a lowering that writes whole
texels, and the generated kernels run on a real OpenCL runtime (PoCL) against numpy.

The PoCL tests skip when pyopencl or an OpenCL device with images is missing
(``apt-get install -y pocl-opencl-icd ocl-icd-libopencl1 clinfo && pip install pyopencl``).
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from tvm import relax, s_tir, te, tirx

from tvm_fusion.compile import graph_input_names, import_onnx
from tvm_fusion.feeds import random_inputs
from tvm_fusion.instrument import Collector
from tvm_fusion.layout import opencl_runner
from tvm_fusion.layout.pipeline import compile_opencl, opencl_module
from tvm_fusion.layout.texture import TEXTURE_SCOPE
from tvm_fusion.layout.texture_lower import (
    OUR_PIPELINE,
    STOCK_PIPELINE,
    TextureLoweringError,
    check_texture_params,
    check_texture_stores,
    register_tir_pipelines,
)
from tvm_fusion.layout.texture_map import Limits, texture_layout
from tvm_fusion.models import transformer_encoder_layer
from tvm_fusion.models.cnn import inverted_residual_net, resnet_bottleneck
from tvm_fusion.models.swin import swin_window_attention
from tvm_fusion.numerics import max_abs_error, onnx_reference

TEXTURE = "qcom/adreno-opencl-texture"
BUFFERS = "qcom/adreno-opencl"
POCL, WHY = opencl_runner.available()
needs_pocl = pytest.mark.skipif(not POCL, reason=WHY)


def _target(name: str) -> tvm.target.Target:
    import tvm.backend.adreno  # noqa: F401 (registers the qcom/* tags)

    return tvm.target.Target(name)


def _positions(layout, shape):
    index_map = layout.index_map()
    return {idx: tuple(int(v) for v in index_map.map_indices(list(idx)))
            for idx in itertools.product(*[range(s) for s in shape])}


# ------------------------------------------------------------------------------- the mapping


def test_conv_input_maps_to_nchw4c():
    """Channels (the conv's reduction) in the lanes, the kernel's width along x: NCHW4c."""
    n, c, h, w = 2, 8, 3, 4
    layout = texture_layout((n, c, h, w), reduction_dims=[1, 3])
    assert layout.physical_shape == (n * c // 4 * h, w, 4)
    for (i, j, k, m), pos in _positions(layout, (n, c, h, w)).items():
        assert pos == ((i * (c // 4) + j // 4) * h + k, m, j % 4)


def test_one_reduction_dimension_runs_its_blocks_along_x():
    layout = texture_layout((6, 16), reduction_dims=[1])  # a matmul's A: K in lanes and x
    assert layout.physical_shape == (6, 4, 4)
    positions = _positions(layout, (6, 16))
    assert len(set(positions.values())) == 6 * 16  # one element per texel lane
    assert positions[(5, 13)] == (5, 3, 1)


def test_image_limits_move_rows_into_slices_or_give_up():
    limits = Limits(spatial=2048, depth=8)
    sliced = texture_layout((4, 1000, 64), [2], limits)
    assert sliced.physical_shape == (4, 1000, 16, 4) and sliced.depth == 4
    assert texture_layout((16, 1000, 64), [2], limits) is None  # 16 slices > 8
    assert texture_layout((3, 5), [1]) is None  # nothing divisible by 4
    assert Limits.from_target(_target(TEXTURE)) == Limits(16384, 2048)


# ------------------------------------------------------------------------------ the lowering


def _scale_kernel():
    """``B[y, x, lane] = 2·A[y, 4x + lane]`` into a texture, RGBA lane loop vectorised."""
    a = te.placeholder((tirx.IntImm("int64", 16), tirx.IntImm("int64", 64)), "float32", "A")
    b = te.compute((tirx.IntImm("int64", 16), tirx.IntImm("int64", 16), tirx.IntImm("int64", 4)),
                   lambda y, x, lane: a[y, x * 4 + lane] * 2.0, name="B")
    func = te.create_prim_func([a, b])
    params = list(func.params)
    func = func.specialize({params[1]: tirx.decl_buffer(params[1].shape, "float32", "B",
                                                        scope=TEXTURE_SCOPE)})
    sch = s_tir.Schedule(func)
    y, x, lane = sch.get_loops(sch.get_sblock("B"))
    sch.bind(y, "blockIdx.x")
    sch.bind(x, "threadIdx.x")
    sch.vectorize(lane)
    return sch.mod["main"]


def _build(func, pipeline):
    register_tir_pipelines()
    return opencl_runner.compile_primfunc(func, _target(TEXTURE), pipeline, "scale")


def test_stock_adreno_lowering_scalarises_texture_stores_and_ours_does_not():
    stock = _build(_scale_kernel(), STOCK_PIPELINE)  # the registration fix makes it buildable
    ours = _build(_scale_kernel(), OUR_PIPELINE)
    assert "for (int" in stock.source and stock.source.count("write_imagef(") == 1
    assert "for (int" not in ours.source and "vload4" in ours.source
    assert ours.source.count("write_imagef(") == 1


def test_scalar_texture_store_is_rejected():
    """The verifier in our pipeline catches what the stock order produces."""
    captured = {}

    @tvm.ir.instrument.pass_instrument
    class Capture:
        def run_after_pass(self, mod, info):
            if info.name.endswith("VectorizeLoop"):
                captured["mod"] = mod

    register_tir_pipelines()
    with tvm.transform.PassContext(instruments=[Capture()]):
        tvm.tirx.build(tvm.IRModule({"scale": _scale_kernel().with_attr("global_symbol",
                                                                        "scale")}),
                       target=tvm.target.Target(_target(TEXTURE), host="llvm"),
                       pipeline=STOCK_PIPELINE)
    with pytest.raises(TextureLoweringError, match="4-lane"):
        check_texture_stores(captured["mod"])


def test_texture_allocated_inside_a_kernel_is_rejected():
    a = te.placeholder((8, 4), "float32", "A")
    b = te.compute((8, 4), lambda i, j: a[i, j] + 1, name="B")
    c = te.compute((8, 4), lambda i, j: b[i, j] * 2, name="C")
    sch = s_tir.Schedule(te.create_prim_func([a, c]))
    sch.set_scope(sch.get_sblock("B"), 0, TEXTURE_SCOPE)
    with pytest.raises(TextureLoweringError, match="allocated inside"):
        check_texture_params(tvm.IRModule({"f": sch.mod["main"]}))


# ------------------------------------------------------------------------ kernels on PoCL


def _chain_model(dtype="float32") -> tvm.IRModule:
    """Every operator kind between textures: elementwise → conv2d (NCHW) → max pool → 1×1
    conv → reshape → softmax → matmul → matmul (the last writes the output buffer)."""
    rng = np.random.default_rng(0)

    def const(*shape):
        return relax.const((rng.standard_normal(shape) * 0.3).astype(dtype))

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 16, 16), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.add(x, relax.const(np.array(1.0, dtype))))
            c = bb.emit(relax.op.nn.conv2d(a, const(16, 8, 3, 3), padding=1))
            p = bb.emit(relax.op.nn.max_pool2d(c, pool_size=2, strides=2))
            c2 = bb.emit(relax.op.nn.conv2d(p, const(16, 16, 1, 1)))
            r = bb.emit(relax.op.reshape(c2, (1, 16, 64)))
            s = bb.emit(relax.op.nn.softmax(r, axis=-1))
            m = bb.emit(relax.op.matmul(s, const(64, 32)))
            out = bb.emit_output(relax.op.matmul(m, const(32, 8)))
        bb.emit_func_output(out)
    return bb.get()


def _nhwc_model(dtype="float32") -> tvm.IRModule:
    """Conv2d in NHWC (channels last, OHWI weights) and average pooling."""
    rng = np.random.default_rng(1)
    weight = relax.const((rng.standard_normal((16, 3, 3, 8)) * 0.3).astype(dtype))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 16, 8), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.nn.relu(x))
            c = bb.emit(relax.op.nn.conv2d(a, weight, padding=1, data_layout="NHWC",
                                           kernel_layout="OHWI"))
            p = bb.emit(relax.op.nn.avg_pool2d(c, pool_size=2, strides=2, layout="NHWC"))
            out = bb.emit_output(relax.op.nn.conv2d(p, relax.const(
                (rng.standard_normal((4, 1, 1, 16)) * 0.3).astype(dtype)), data_layout="NHWC",
                kernel_layout="OHWI"))
        bb.emit_func_output(out)
    return bb.get()


def _reference(build, shape) -> tuple[np.ndarray, np.ndarray]:
    from tvm_fusion.compile import run

    x = np.random.default_rng(7).standard_normal(shape).astype("float32")
    return x, run(tvm.compile(build("float32"), "llvm"), [x])[0]


def _run(mod, target, x, pipeline=OUR_PIPELINE):
    return opencl_runner.OpenCLRunner().run_module(mod, [x], _target(target),
                                                   pipeline=pipeline)[0]


def _texture_params(mod) -> dict[str, int]:
    return {g.name_hint: sum(p.scope() == TEXTURE_SCOPE for p in f.params)
            for g, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}


def _close(got, want, rtol):
    np.testing.assert_allclose(got.astype("float32"), want, rtol=rtol,
                               atol=rtol * float(np.abs(want).max()))


def _textured(mod):
    """One kernel per operator on the texture target, and the texture decisions."""
    collector = Collector()
    with tvm.transform.PassContext(instruments=[collector]):
        out = opencl_module(mod, TEXTURE, fuse=False)
    return out, collector.texture_decisions


@needs_pocl
def test_every_operator_kind_reads_and_writes_textures_on_pocl():
    """One kernel per operator (no fusion): each reads its input from a texture and every
    intermediate is written as one; fp32 matches numpy/LLVM to 1e-5."""
    x, want = _reference(_chain_model, (1, 8, 16, 16))
    mod, record = _textured(_chain_model())
    textured = {d.tensor: d.layout for d in record if d.layout is not None}
    assert len(textured) == 6  # every intermediate; only the graph output stays a buffer
    assert "lanes=d1%4, x=d3" in next(iter(textured.values())).describe()  # NCHW4c
    counts = _texture_params(mod)
    assert all(n >= 1 for n in counts.values()) and len(counts) == 7
    _close(_run(mod, TEXTURE, x), want, 1e-5)


@needs_pocl
def test_nhwc_conv_and_average_pool_on_pocl():
    x, want = _reference(_nhwc_model, (1, 16, 16, 8))
    mod, record = _textured(_nhwc_model())
    layouts = [d.layout for d in record if d.layout is not None]
    assert layouts and "lanes=d3%4" in layouts[0].describe()  # channels last in the lanes
    _close(_run(mod, TEXTURE, x), want, 1e-5)


@needs_pocl
def test_fused_pipeline_and_buffer_target_on_pocl():
    """The whole tvm_fusion pipeline (elimination, DNNFusion planning, textures) and the
    buffer-only Adreno target give the same numbers."""
    x, want = _reference(_chain_model, (1, 8, 16, 16))
    fused = opencl_module(_chain_model(), TEXTURE)
    _close(_run(fused, TEXTURE, x), want, 1e-5)
    buffers = opencl_module(_chain_model(), BUFFERS, fuse=False)
    assert not any(_texture_params(buffers).values())
    _close(_run(buffers, BUFFERS, x), want, 1e-5)


@needs_pocl
def test_fp16_through_pocls_fp32_path():
    """fp16 kernels (CL_HALF_FLOAT images, ``half`` arithmetic mapped to float because PoCL has
    no cl_khr_fp16): layouts and texel stores are checked, fp16 rounding of weights, inputs
    and every stored texel is the only difference from fp32."""
    x, want = _reference(_chain_model, (1, 8, 16, 16))
    mod = opencl_module(_chain_model("float16"), TEXTURE, fuse=False)
    got = _run(mod, TEXTURE, x.astype("float16"))
    assert got.dtype == np.float16
    _close(got, want, 2e-2)


@needs_pocl
def test_stock_texture_lowering_is_wrong_where_ours_is_right():
    """The same scheduled kernels through TVM 0.27's own Adreno TIR pipeline (registered as a
    proper triple) store each texel's last lane four times."""
    x, want = _reference(_chain_model, (1, 8, 16, 16))
    mod = opencl_module(_chain_model(), TEXTURE, fuse=False)
    ours = _run(mod, TEXTURE, x)
    stock = _run(mod, TEXTURE, x, pipeline=STOCK_PIPELINE)
    scale = float(np.abs(want).max())
    assert np.abs(ours - want).max() <= 1e-5 * scale
    assert np.abs(stock - want).max() > 1e-2 * scale


def _conv_relu_conv():
    rng = np.random.default_rng(3)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 16, 16), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            c = bb.emit(relax.op.nn.conv2d(x, relax.const(
                (rng.standard_normal((16, 8, 3, 3)) * 0.3).astype("float32")), padding=1))
            r = bb.emit(relax.op.nn.relu(c))
            out = bb.emit_output(relax.op.nn.conv2d(r, relax.const(
                (rng.standard_normal((8, 16, 3, 3)) * 0.3).astype("float32")), padding=1))
        bb.emit_func_output(out)
    return bb.get()


@needs_pocl
def test_stock_adreno_texture_pipeline_is_wrong_where_ours_is_right():
    """TVM 0.27's own Adreno texture build of conv → relu → conv (ConvertLayout to NCHW4c,
    texture scopes, DLight Adreno schedules, its TIR lowering registered as a proper triple)
    runs on PoCL and is wrong; ours on the same model is right."""
    from tvm.relax.backend.adreno import pipeline as adreno

    from tvm_fusion.compile import run

    x = np.random.default_rng(4).standard_normal((1, 8, 16, 16)).astype("float32")
    want = run(tvm.compile(_conv_relu_conv(), "llvm"), [x])[0]
    target = tvm.target.Target(_target(TEXTURE), host="llvm")
    with target:
        stock = tvm.transform.Sequential(adreno.library_dispatch_passes(target)
                                         + adreno.legalize_passes(target))(_conv_relu_conv())
    assert any(p.scope().startswith("global.texture") for f in stock.functions.values()
               if isinstance(f, tirx.PrimFunc) for p in f.params)
    got_stock = _run(stock, TEXTURE, x, pipeline=STOCK_PIPELINE)
    ours = _run(opencl_module(_conv_relu_conv(), TEXTURE), TEXTURE, x)
    scale = float(np.abs(want).max())
    assert np.abs(got_stock - want).max() > 0.1 * scale
    _close(ours, want, 1e-5)


def _opencl_source(executable) -> str:
    def walk(module):
        yield module
        for imported in module.imports:
            yield from walk(imported)

    return "\n".join(m.inspect_source() for m in walk(executable.mod) if m.kind == "opencl")


def test_vm_build_for_the_texture_target():
    """``tvm.compile`` with our passes and TIR pipeline: textures are image2d arrays and every
    texel is written once, as a vector."""
    ex = compile_opencl(_chain_model(), TEXTURE)
    source = _opencl_source(ex)
    assert "image2d_array_t" in source and "write_imagef(" in source
    # the build ran our store check; and no texel is written from inside a lane loop
    assert not re.search(r"for \(int [^\n]*\n[^\n]*\n\s*write_imagef", source)
    assert "alloc_storage" in ex.as_text()


def test_the_registered_pipeline_builds_textures():
    """``tvm.compile(mod, texture target, relax_pipeline="tvm_fusion")`` with the default TIR
    pipeline is our Adreno build: a conv net's kernels read and write image2d textures, in the
    same OpenCL as :func:`compile_opencl`. Stock TVM's default build declares image2d
    parameters too, but 0.27's default TIR lowering then reads them as buffers (``vload4``)."""
    target = tvm.target.Target(_target(TEXTURE), host="llvm")
    ours = _opencl_source(tvm.compile(_conv_relu_conv(), target, relax_pipeline="tvm_fusion"))
    assert "image2d_array_t" in ours and "read_imagef(" in ours and "write_imagef(" in ours
    assert ours == _opencl_source(compile_opencl(_conv_relu_conv(), target))
    stock = _opencl_source(tvm.compile(_conv_relu_conv(), target))
    assert "image2d_array_t" in stock and "read_imagef(" not in stock


# --------------------------------------------- whole models on PoCL against ONNX Runtime

MODELS_DIR = Path(os.environ.get("TVM_FUSION_MODELS", Path(__file__).parent.parent / "models"))

TEXTURE_MODELS = {
    # MobileNetV2's inverted residuals (expansion, depthwise 3x3, projection, residual Add,
    # ReLU6, global pooling, classifier), small enough for the default run
    "inverted_residual_net": lambda: inverted_residual_net(size=16),
    # ResNet-50's downsampling and identity bottlenecks with BatchNormalization
    "resnet_bottleneck": lambda: resnet_bottleneck(channels=16, size=8),
    # BERT's encoder layer: Q/K/V projections, heads, masked softmax attention, LayerNorm, GELU
    "encoder_attention": lambda: transformer_encoder_layer(seq=16, hidden=32, heads=2, ffn=64),
    # Swin's window attention with the relative position bias (a Gather) and window reshapes
    "swin_window_attention": lambda: swin_window_attention(resolution=14, channels=32,
                                                           heads=2, window=7),
}


def _texture_model_error(model) -> tuple[float, float, float]:
    """The texture build (the registered pipeline's Adreno backend, every tvm_fusion pass) run
    on PoCL: (max abs error vs ONNX Runtime, max |reference|, share of the kernels' results
    kept in textures)."""
    feeds = random_inputs(model, seed=0)
    reference = onnx_reference(model, feeds)
    collector = Collector()
    with tvm.transform.PassContext(instruments=[collector]):
        built = opencl_module(import_onnx(model), TEXTURE)
    decisions = collector.texture_decisions
    textured = sum(d.layout is not None for d in decisions) / max(len(decisions), 1)
    outputs = opencl_runner.OpenCLRunner().run_module(
        built, [feeds[name] for name in graph_input_names(model)], _target(TEXTURE))
    error = max_abs_error(outputs, reference)
    return error, max(float(np.abs(r).max()) for r in reference), textured


@needs_pocl
@pytest.mark.parametrize("name", list(TEXTURE_MODELS))
def test_texture_models_match_onnx_runtime_on_pocl(name):
    """Issue 19, item 3: conv nets and attention blocks built for
    ``qcom/adreno-opencl-texture`` keep their intermediates in image2d textures and match ONNX
    Runtime on PoCL to fp32 rounding."""
    error, scale, textured = _texture_model_error(TEXTURE_MODELS[name]())
    assert textured >= 0.5, "the build kept (almost) everything in buffers"
    assert error <= 1e-5 * max(scale, 1.0), f"{name}: max abs error {error:.3g}"


@needs_pocl
@pytest.mark.slow
def test_zoo_mobilenet_v2_textures_match_onnx_runtime_on_pocl():
    """The zoo's MobileNetV2 (torchvision's, exported to ONNX) with textures on PoCL: about
    1.5 minutes here (the per-thread texel schedules are a correctness baseline)."""
    path = MODELS_DIR / "mobilenet_v2.onnx"
    if not path.exists():
        pytest.skip(f"{path} missing: run `python -m tvm_fusion.export_models --only "
                    "mobilenet_v2` (needs pip install -e '.[models]', i.e. torch)")
    error, scale, textured = _texture_model_error(onnx.load(path))
    assert textured >= 0.5
    assert error <= 1e-5 * max(scale, 1.0), f"max abs error {error:.3g}"

# ruff: noqa: E402  (notebook cells import where they are used)
# Source of tutorials/04_smartmem_texture.ipynb; build with
# `python scripts/build_tutorials.py 04_smartmem_texture`.

# %% [markdown]
# # 4. SmartMem: layout-transform elimination and texture layouts for Adreno
#
# SmartMem (ASPLOS'24) removes the operators that only move data (Reshape, Transpose,
# Gather, Slice, …) by turning them into index arithmetic inside a neighbour, lets each
# producer write the layout its consumer reads best, and maps tensors onto the 2.5-D
# **texture memory** of mobile GPUs. This notebook shows all three on a Swin-T
# window-attention block and runs the generated Adreno texture kernels on **PoCL** (a CPU
# OpenCL runtime), checked against numpy and ONNX Runtime. Details and measurements:
# [docs/smartmem.md](../docs/smartmem.md).

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import tvm
from IPython.display import Markdown, display

import tvm_fusion
from tvm_fusion.compile import compile_model, count_kernels, fuse, import_onnx, run
from tvm_fusion.feeds import random_inputs
from tvm_fusion.layout.metrics import count_data_movement_kernels, kernel_names
from tvm_fusion.models.swin import swin_window_attention
from tvm_fusion.numerics import onnx_reference
from tvm_fusion.target import host_target

LLVM = host_target()  # this machine's CPU (tutorial 1)
model = swin_window_attention()  # stage 1 of Swin-T: 56×56×96, 3 heads, 7×7 windows
mod = import_onnx(model)
print(f"{len(model.graph.node)} ONNX nodes:", ", ".join(n.op_type for n in model.graph.node))

# %% [markdown]
# ## 1. Classes from TIR and Tables 5/6
#
# Each legalised operator gets a SmartMem class from its TIR: does its speed depend on its
# input layout (**ILD** vs **ILI**), and can its output layout be chosen (**Variable**) or is
# the operator nothing but a fixed re-indexing (**Fixed**)? Tables 5 and 6 say what to do with
# every pair:

# %%
from tvm_fusion.layout.classes import tables_markdown

display(Markdown(tables_markdown()))

# %% [markdown]
# `EliminateLayoutTransforms` runs on legalised Relax, before the DNNFusion planner. Its
# record (collected by a `Collector`, a TVM pass instrument) has the class of every operator
# and, for every chain of Fixed operators, the composed load map and what was done with it:

# %%
from tvm_fusion.instrument import Collector
from tvm_fusion.layout.smartmem import EliminateLayoutTransforms

with LLVM:
    legalized = tvm.transform.Sequential(tvm_fusion.transform.legalize_passes(LLVM))(mod)
primfunc_of = {b.var.name: b.value.args[0].name_hint
               for b in legalized["main"].body.blocks[0].bindings
               if isinstance(b.value, tvm.relax.Call) and b.value.op.name == "relax.call_tir"}
collector = Collector()
with LLVM, tvm.transform.PassContext(instruments=[collector]):
    eliminated = EliminateLayoutTransforms(LLVM)(legalized)
(block,) = collector.layout_blocks
rows = ["| result | PrimFunc | SmartMem class |", "|---|---|---|"]
rows += [f"| `{var}` | `{primfunc_of.get(var, '?')}` | {cls} |"
         for var, cls in block.classes.items()]
display(Markdown("\n".join(rows)))
print(f"Fixed operators eliminated: {block.eliminated}, copy kernels left: {block.materialised}, "
      f"extra layout copies: {block.layout_copies}\n")
for site in block.sites:
    print("•", site.replace("; map", "\n    map"))

# %% [markdown]
# The first site is Swin's window partition, `Reshape → Transpose → Reshape`: composed and
# simplified by TVM's arithmetic analyzer it is two divisions and two remainders, read
# directly by the QKV matmul. The three `Gather`s of the head split read constant indices,
# so they became affine maps too (stock TVM treats `take` as opaque).
#
# ## 2. Kernels and data-movement kernels
#
# A *data-movement* kernel is one whose every block only copies. Three builds of the same
# block: stock TVM `FuseOps`, the DNNFusion planner without elimination, and the default
# pipeline (elimination, then the planner).

# %%
with LLVM:
    no_layout = tvm_fusion.transform.Sequential(LLVM, layout=False, schedule=False)(mod)
    smartmem = tvm_fusion.transform.Sequential(LLVM, schedule=False)(mod)
builds = {"stock FuseOps": fuse(mod, LLVM, strategy="tvm"), "DNNFusion, no elimination": no_layout,
          "DNNFusion + SmartMem": smartmem}
counts = {name: (count_kernels(m), count_data_movement_kernels(m)) for name, m in builds.items()}
for name, (k, moves) in counts.items():
    print(f"{name:28s} {k:3d} kernels, {moves} of them data movement")
print("\nstock FuseOps kernels:", ", ".join(kernel_names(builds["stock FuseOps"])))
print("\nDNNFusion + SmartMem kernels:", *kernel_names(smartmem), sep="\n  ")

# %%
fig, ax = plt.subplots(figsize=(7.5, 3))
names = list(counts)
width = 0.38
ys = np.arange(len(names))
compute = [counts[n][0] - counts[n][1] for n in names]
moves = [counts[n][1] for n in names]
ax.barh(ys, compute, color="#64b5f6", label="compute kernels")
ax.barh(ys, moves, left=compute, color="#ef5350", label="data-movement kernels")
for y, n in zip(ys, names):
    ax.text(counts[n][0], y, f" {counts[n][0]} ({counts[n][1]} data movement)", va="center")
ax.set_yticks(ys, names)
ax.invert_yaxis()
ax.set_xlim(0, max(c[0] for c in counts.values()) * 1.6)
ax.set_xlabel("kernels")
ax.set_title("Swin-T window-attention block")
ax.legend(loc="lower right")
fig.tight_layout()
plt.show()

# %% [markdown]
# The DNNFusion planner alone already leaves no data-movement kernel here (it fuses
# Reorganize/Shuffle operators into their neighbours); elimination changes what is *inside*
# the five kernels: composed, simplified indices instead of chains of copies, no `Gather`
# index loads, the QKV bias as an epilogue instead of a recomputed prologue. On CPU that is
# latency-neutral with the current schedules (docs/smartmem.md says why, with numbers).
# The numbers stay the same:

# %%
feeds = random_inputs(model, seed=0)
reference = onnx_reference(model, feeds)[0]
x = feeds["x"]
ours = run(compile_model(mod, LLVM), [x])[0]
stock = run(compile_model(mod, LLVM, strategy="tvm"), [x])[0]
print(f"max |tvm_fusion - ONNX Runtime| = {np.abs(ours - reference).max():.2e}")
print(f"max |stock TVM  - ONNX Runtime| = {np.abs(stock - reference).max():.2e}")
np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)

# %% [markdown]
# ## 3. Texture layouts for Adreno
#
# Adreno GPUs read tensors fastest as **image2d textures**: every texel holds 4 values
# (RGBA), addressed by `(x, y)` (and a slice `z` for image arrays). `texture_map.py` puts the
# first *reduction* dimension of a tensor's consumers, split by 4, into the RGBA lanes, a
# second one along x, and everything else along y. For the input of an NCHW 3×3 conv (it
# reduces over channels and the kernel's width) that is exactly **NCHW4c**:

# %%
from tvm_fusion.layout.texture_map import texture_layout

shape = (1, 8, 3, 4)  # N, C, H, W
layout = texture_layout(shape, reduction_dims=[1, 3])  # conv reduces over C and W
print(layout.describe())
index_map = layout.index_map()
fig, ax = plt.subplots(figsize=(7, 5))
cmap = plt.get_cmap("tab10")
for n, c, h, w in np.ndindex(*shape):
    y, xx, lane = (int(v) for v in index_map.map_indices([n, c, h, w]))
    ax.add_patch(plt.Rectangle((xx + lane / 4, y), 0.25, 1, facecolor=cmap(c % 10),
                               edgecolor="white", linewidth=0.8))
    ax.text(xx + lane / 4 + 0.125, y + 0.5, f"c{c}\nh{h}\nw{w}", ha="center", va="center",
            fontsize=6)
for xx in range(layout.width + 1):
    ax.axvline(xx, color="black", linewidth=1.5)
for y in range(layout.height + 1):
    ax.axhline(y, color="black", linewidth=1.5)
ax.set_xlim(0, layout.width)
ax.set_ylim(layout.height, 0)
ax.set_xlabel("texel x (4 lanes R, G, B, A each)")
ax.set_ylabel("texel y")
ax.set_title(f"tensor {shape} (NCHW) as a {layout.width}×{layout.height} RGBA texture: NCHW4c")
fig.tight_layout()
plt.show()

# %% [markdown]
# On the Swin block (at 14×14 resolution, so that the PoCL run below takes seconds) the
# texture target `qcom/adreno-opencl-texture` runs the same graph passes, then
# `AnnotateTextureScopes` decides per intermediate tensor: a texture when a consumer reads it
# inside a reduction and the shape fits (a dimension divisible by 4, the image limits),
# otherwise a buffer, each with its reason.

# %%
from tvm_fusion.layout.pipeline import opencl_module

TEXTURE = "qcom/adreno-opencl-texture"
small = swin_window_attention(resolution=14)
small_mod = import_onnx(small)
collector = Collector()
with tvm.transform.PassContext(instruments=[collector]):
    texture_mod = opencl_module(small_mod, TEXTURE)
rows = ["| tensor | shape | texture layout | why |", "|---|---|---|---|"]
for d in collector.texture_decisions:
    rows.append(f"| `{d.tensor}` | {'×'.join(map(str, d.shape))} | "
                f"{d.layout.describe().split(': ', 1)[1] if d.layout else 'buffer'} | {d.reason} |")
display(Markdown("\n".join(rows)))
print(f"{count_kernels(texture_mod)} kernels for the texture target")

# %% [markdown]
# The kernels are scheduled one texel per thread (`ScheduleTextureKernels`) and lowered by our
# TIR pipeline `tvm_fusion_adreno`, which vectorises each RGBA store before TVM flattens the
# texture (stock 0.27 writes each texel's last lane four times, see docs/smartmem.md). An
# excerpt of the OpenCL the build generates:

# %%
from tvm_fusion.layout.pipeline import compile_opencl

executable = compile_opencl(small_mod, TEXTURE)


def opencl_sources(module):
    if module.kind == "opencl":
        yield module.inspect_source()
    for imported in module.imports:
        yield from opencl_sources(imported)


source = "\n".join(opencl_sources(executable.mod))
lines = source.splitlines()
definitions = [i for i, line in enumerate(lines)
               if line.startswith("__kernel") and line.rstrip().endswith("{")]
start = next(i for i in definitions if "image2d" in lines[i])
print(f"{len(definitions)} OpenCL kernels, {source.count('read_imagef')} texture reads, "
      f"{source.count('write_imagef')} texture writes; the first texture kernel:\n")
print("\n".join(lines[start:start + 28]))

# %% [markdown]
# ## 4. Running the texture kernels on PoCL
#
# The pip TVM wheel has no OpenCL runtime, so `tvm_fusion.layout.opencl_runner` runs the
# generated kernels itself through `pyopencl`: buffers become `cl.Buffer`s, texture parameters
# RGBA `image2d_array`s laid out as TVM's runtime lays them out, and `main` is executed kernel
# by kernel. With PoCL (`apt-get install pocl-opencl-icd`) this runs on any CPU; it checks
# layouts, indexing and texel stores, not Adreno speed. Without an OpenCL device the cell says
# so and skips the run.

# %%
from tvm_fusion.layout import opencl_runner

ok, device = opencl_runner.available()
if not ok:
    print(f"PoCL/OpenCL unavailable ({device}): skipping the run on an OpenCL device.")
else:
    print("OpenCL device:", device)
    runner = opencl_runner.OpenCLRunner()
    small_feeds = random_inputs(small, seed=0)
    want = onnx_reference(small, small_feeds)[0]
    start = time.perf_counter()
    got = runner.run_module(texture_mod, [small_feeds["x"]], tvm.target.Target(TEXTURE))[0]
    seconds = time.perf_counter() - start
    err = np.abs(got - want).max()
    print(f"Swin block on {TEXTURE} (textures), {seconds:.1f} s: "
          f"max |OpenCL - ONNX Runtime| = {err:.2e} (outputs up to {np.abs(want).max():.2f})")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

# %% [markdown]
# The same check on a convolutional chain, where the conv input is NCHW4c as drawn above,
# against numpy-backed LLVM results, and TVM 0.27's own Adreno texture build of the same
# conv → relu → conv for comparison (its `ConvertLayout` to NCHW4c, texture scopes, DLight
# Adreno schedules and TIR lowering):

# %%
from tvm import relax


def conv_relu_conv():
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


x_conv = np.random.default_rng(4).standard_normal((1, 8, 16, 16)).astype("float32")
want = run(tvm.compile(conv_relu_conv(), "llvm"), [x_conv])[0]
errors = {}
if ok:
    from tvm.relax.backend.adreno import pipeline as adreno

    from tvm_fusion.layout.texture_lower import STOCK_PIPELINE

    target = tvm.target.Target(tvm.target.Target(TEXTURE), host="llvm")
    ours = runner.run_module(opencl_module(conv_relu_conv(), TEXTURE), [x_conv], target)[0]
    with target:
        stock_mod = tvm.transform.Sequential(adreno.library_dispatch_passes(target)
                                             + adreno.legalize_passes(target))(conv_relu_conv())
    stock_out = runner.run_module(stock_mod, [x_conv], target, pipeline=STOCK_PIPELINE)[0]
    errors = {"tvm_fusion textures": np.abs(ours - want).max(),
              "stock TVM 0.27 Adreno textures": np.abs(stock_out - want).max()}
    for name, e in errors.items():
        print(f"{name:32s} max |OpenCL - LLVM| = {e:.2e}",
              f"  (outputs up to {np.abs(want).max():.1f})")
else:
    print(f"PoCL/OpenCL unavailable ({device}): skipping the run on an OpenCL device.")

# %%
if errors:
    fig, ax = plt.subplots(figsize=(7, 2.2))
    names = list(errors)
    ax.barh(names, [max(errors[n], 1e-9) for n in names], color=["#66bb6a", "#ef5350"])
    ax.set_xscale("log")
    ax.set_xlabel("max abs error vs LLVM on PoCL (log scale)")
    ax.set_title("conv → relu → conv, fp32, texture memory")
    for i, n in enumerate(names):
        ax.text(max(errors[n], 1e-9), i, f" {errors[n]:.1e}", va="center")
    ax.set_xlim(1e-8, 1e3)
    fig.tight_layout()
    plt.show()
else:
    print("no OpenCL run, no plot")

# %% [markdown]
# Texture code is checked for correctness here, not for speed: there is no phone in CI. Tuning
# on a real Adreno over RPC is the subject of tutorial 5; conv → conv fusion with its cost
# model (OptiFX) is tutorial 3.

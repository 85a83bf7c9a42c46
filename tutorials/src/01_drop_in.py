# ruff: noqa: E402  (notebook cells import where they are used)
# Source of tutorials/01_drop_in.ipynb; build with `python scripts/build_tutorials.py 01_drop_in`.

# %% [markdown]
# # 1. Drop-in: tvm_fusion in an existing `tvm.compile` flow
#
# You already compile ONNX models with TVM:
#
# ```python
# mod = from_onnx(model, keep_params_in_input=False)
# ex = tvm.compile(mod, target)
# ```
#
# This notebook adds **one line** to that flow, `tvm_fusion.transform.Sequential(target)`,
# and shows what changes: fewer kernels, lower latency, the same numbers (checked against
# ONNX Runtime). It runs on a CPU in well under a minute and downloads nothing: the model is
# built right here with `onnx.helper`.

# %%

import numpy as np
import onnx
import onnxruntime as ort
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

import tvm_fusion
from tvm_fusion.compile import compile_model, count_kernels
from tvm_fusion.threads import use_physical_cores

# TVM's CPU runtime uses half the hardware threads on x86 (it assumes hyper-threading); on a VM
# whose vCPUs are cores that is half the machine. Set the thread count before any kernel runs.
print("TVM threads:", use_physical_cores())
print("TVM", tvm.__version__, "| tvm_fusion", tvm_fusion.__version__, "| onnx", onnx.__version__)

# %% [markdown]
# ## An ONNX model
#
# The feed-forward half of a transformer layer, written the way PyTorch exports it: LayerNorm
# and GELU come out *decomposed* into a dozen elementwise and reduction nodes
# (`ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add` and
# `Div, Erf, Add, Mul, Mul`). Those chains are where fusion matters.

# %%
SEQ, HIDDEN, FFN = 128, 256, 1024
rng = np.random.default_rng(0)


def const(name, value):
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


inits = [
    const("ln.gamma", 1 + 0.1 * rng.standard_normal(HIDDEN)),
    const("ln.beta", 0.1 * rng.standard_normal(HIDDEN)),
    const("w1", rng.standard_normal((HIDDEN, FFN)) / np.sqrt(HIDDEN)),
    const("b1", 0.1 * rng.standard_normal(FFN)),
    const("w2", rng.standard_normal((FFN, HIDDEN)) / np.sqrt(FFN)),
    const("b2", 0.1 * rng.standard_normal(HIDDEN)),
    const("two", 2.0), const("eps", 1e-5), const("sqrt2", np.sqrt(2.0)),
    const("one", 1.0), const("half", 0.5),
]
node = helper.make_node
nodes = [
    # LayerNorm, decomposed
    node("ReduceMean", ["x"], ["mean"], axes=[-1]),
    node("Sub", ["x", "mean"], ["xc"]),
    node("Pow", ["xc", "two"], ["sq"]),
    node("ReduceMean", ["sq"], ["var"], axes=[-1]),
    node("Add", ["var", "eps"], ["var_eps"]),
    node("Sqrt", ["var_eps"], ["std"]),
    node("Div", ["xc", "std"], ["xn"]),
    node("Mul", ["xn", "ln.gamma"], ["xg"]),
    node("Add", ["xg", "ln.beta"], ["h"]),
    # Linear -> GELU (decomposed) -> Linear
    node("MatMul", ["h", "w1"], ["f1"]),
    node("Add", ["f1", "b1"], ["f"]),
    node("Div", ["f", "sqrt2"], ["g1"]),
    node("Erf", ["g1"], ["g2"]),
    node("Add", ["g2", "one"], ["g3"]),
    node("Mul", ["f", "g3"], ["g4"]),
    node("Mul", ["g4", "half"], ["act"]),
    node("MatMul", ["act", "w2"], ["o1"]),
    node("Add", ["o1", "b2"], ["o2"]),
    # residual
    node("Add", ["o2", "x"], ["y"]),
]
graph = helper.make_graph(
    nodes, "ffn_block",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, HIDDEN])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, HIDDEN])],
    initializer=inits)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
onnx.checker.check_model(model, full_check=True)
print(f"{len(model.graph.node)} ONNX nodes:", ", ".join(n.op_type for n in model.graph.node))

# %% [markdown]
# ## The stock flow, and the same flow with tvm_fusion
#
# The import is TVM's own. `keep_params_in_input=False` makes the weights constants, which
# is what lets passes fold and fuse them.

# %%
# this machine's CPU: {"kind": "llvm", "mcpu": <the host CPU>, "num-cores": <physical cores>}
# (a bare "llvm" compiles for baseline x86-64: SSE2, no AVX)
target = tvm_fusion.target.host_target()
mod = from_onnx(model, keep_params_in_input=False)

# 1) stock TVM, as a user gets it
ex_stock = tvm.compile(mod, target)

# 2) the same flow, tvm_fusion inserted: one line
with target:
    fused_mod = tvm_fusion.transform.Sequential(target)(mod)
ex_fused = tvm.compile(fused_mod, target)

# 3) or in one call, through the registered Relax pipeline
ex_pipeline = tvm.compile(mod, target, relax_pipeline="tvm_fusion")

# for comparison: stock FuseOps grouping, compiled with tvm_fusion's CPU schedules
ex_fuseops_sched = compile_model(mod, target, strategy="tvm", schedule=True)
print("compiled 4 executables")

# %% [markdown]
# `Sequential` replaces the middle of TVM's Relax pipeline (`LegalizeOps … FuseOps →
# FuseTIR`) and leaves the rest, lowering and code generation, to TVM; see
# [docs/architecture.md](../docs/architecture.md). What it returns is an ordinary Relax
# module: every `call_tir` in `main` is one kernel.

# %%
print(fused_mod["main"].script(show_meta=False))

# %% [markdown]
# ## Kernel counts
#
# * **stock `tvm.compile`**: on CPU, TVM's default build legalises every operator into its own
#   kernel (no fusion);
# * **stock FuseOps**: what `relax.get_default_pipeline` does (the GPU default): a matmul
#   takes its elementwise epilogue, reductions stay apart;
# * **tvm_fusion**: DNNFusion's mapping-type planner (plus rewriting and SmartMem's
#   layout elimination).

# %%
from tvm_fusion.compile import fuse

legalized = tvm.transform.Sequential(tvm_fusion.transform.legalize_passes(target))(mod)
kernels = {
    "stock tvm.compile": count_kernels(legalized),
    "stock FuseOps": count_kernels(fuse(mod, target, strategy="tvm")),
    "tvm_fusion": count_kernels(fused_mod),
}
for name, k in kernels.items():
    print(f"{name:20s} {k:3d} kernels")

# %% [markdown]
# The same plan as a picture: each kernel a cluster coloured by its anchor's mapping type,
# the reason on every edge between two kernels (hover), and stock FuseOps' grouping behind the
# toggle. `tvm-fusion report model.onnx --html plan.html` writes the same page to a file.

# %%
tvm_fusion.visualize(model, target, title="FFN block")

# %% [markdown]
# ## Same numbers
#
# The reference is ONNX Runtime with graph optimisations off, on the same random input.

# %%
x = rng.standard_normal((1, SEQ, HIDDEN)).astype(np.float32)
opts = ort.SessionOptions()
opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
reference = ort.InferenceSession(model.SerializeToString(), opts,
                                 providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

dev = tvm.cpu()
executables = {"stock tvm.compile": ex_stock, "stock FuseOps + our schedules": ex_fuseops_sched,
               "tvm_fusion (Sequential)": ex_fused, 'tvm_fusion (relax_pipeline="tvm_fusion")':
               ex_pipeline}
vms = {name: relax.VirtualMachine(ex, dev) for name, ex in executables.items()}
x_tvm = tvm.runtime.tensor(x, dev)
for name, vm in vms.items():
    out = vm["main"](x_tvm).numpy()
    err = np.abs(out - reference).max()
    np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-4)
    print(f"{name:42s} max |TVM - ONNX Runtime| = {err:.2e}")

# %% [markdown]
# ## Latency, side by side
#
# Medians of 20 runs after 3 warm-ups, in one process, on whatever machine executed this
# notebook (the committed outputs come from a shared 2-core x86-64 box with the plain `llvm`
# target, so treat them as indicative; `tvm-fusion bench` does the same for ONNX files, see
# [docs/benchmarks.md](../docs/benchmarks.md)).

# %%
import os

from IPython.display import Markdown, display

from tvm_fusion.bench import median_ms  # median wall time of a call, after warm-up calls

opts = ort.SessionOptions()
opts.intra_op_num_threads = os.cpu_count() or 1
ort_session = ort.InferenceSession(model.SerializeToString(), opts,
                                   providers=["CPUExecutionProvider"])
latency = {name: median_ms(lambda vm=vm: vm["main"](x_tvm), warmup=3, repeat=20)
           for name, vm in vms.items() if "relax_pipeline" not in name}
latency["onnxruntime"] = median_ms(lambda: ort_session.run(None, {"x": x}), warmup=3, repeat=20)

rows = ["| build | kernels | latency (ms) | speed-up vs stock |", "|---|---|---|---|"]
kernel_of = {"stock tvm.compile": kernels["stock tvm.compile"],
             "stock FuseOps + our schedules": kernels["stock FuseOps"],
             "tvm_fusion (Sequential)": kernels["tvm_fusion"], "onnxruntime": "—"}
base = latency["stock tvm.compile"]
for name, ms in latency.items():
    rows.append(f"| {name} | {kernel_of[name]} | {ms:.2f} | {base / ms:.1f}× |")
display(Markdown("\n".join(rows)))

# %%
import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
names = list(kernels)
ax1.bar(names, [kernels[n] for n in names], color=["#9e9e9e", "#64b5f6", "#ef6c00"])
ax1.set_ylabel("kernels")
ax1.set_title("kernels launched")
for i, n in enumerate(names):
    ax1.text(i, kernels[n], str(kernels[n]), ha="center", va="bottom")
labels = list(latency)
colors = ["#9e9e9e", "#64b5f6", "#ef6c00", "#66bb6a"]
ax2.barh(labels[::-1], [latency[n] for n in labels][::-1], color=colors[::-1])
ax2.set_xscale("log")
ax2.set_xlabel("median latency (ms, log scale), lower is better")
ax2.set_title("latency on this machine")
for i, n in enumerate(labels[::-1]):
    ax2.text(latency[n], i, f" {latency[n]:.2f} ms", va="center")
ax2.set_xlim(min(latency.values()) / 2, max(latency.values()) * 6)
fig.tight_layout()
plt.show()

# %% [markdown]
# **Reading the numbers.** Most of the gap to the stock `tvm.compile` build is fusion plus
# scheduling: on CPU TVM 0.27 neither fuses nor schedules by default, so every operator is a
# naive loop nest. Against stock FuseOps compiled with the *same* CPU schedules, what is left
# is the grouping itself: on a block this small that is a kernel or so, on whole
# transformers it is far more (BERT-base 187 → 87 kernels, GPT-2 with its head 234 → 87;
# [docs/visualize.md](../docs/visualize.md)). ONNX Runtime's hand-written
# kernels remain faster than TVM's generated ones on this CPU; closing that gap is the
# schedules' job ([docs/codegen.md](../docs/codegen.md)), not the planner's.

# %% [markdown]
# ## Options
#
# `Sequential(target, **options)` takes every option of `tvm_fusion.transform.OPTIONS`
# (documented with defaults and sources in [docs/options.md](../docs/options.md));
# `strategy="tvm"` swaps the planner for stock `FuseOps`, so both can be compared in one
# flow, and an unknown option is an error that names it:

# %%
with target:
    stock_grouping = tvm_fusion.transform.Sequential(target, strategy="tvm")(mod)
print("strategy='tvm':", count_kernels(stock_grouping), "kernels")
try:
    tvm_fusion.transform.Sequential(target, brodcast_policy="strict")
except ValueError as err:
    print("ValueError:", str(err)[:100], "...")

# %% [markdown]
# **Next:** [02_inside_dnnfusion](02_inside_dnnfusion.ipynb) opens the planner up: mapping
# types, Table 3 and the fusion plan of a transformer layer with the reason for every cut.

# ruff: noqa: E402  (notebook cells import where they are used)
# Source of tutorials/02_inside_dnnfusion.ipynb; build with
# `python scripts/build_tutorials.py 02_inside_dnnfusion`.

# %% [markdown]
# # 2. Inside DNNFusion: mapping types, Table 3, the plan and rewriting
#
# DNNFusion (Niu et al., PLDI'21) does not fuse by pattern lists. It classifies every operator
# by its **mapping type**, the relation between input and output elements, and decides
# whether two neighbours may share a kernel by looking the pair up in **Table 3**. This
# notebook walks through that on one BERT encoder layer, the built-in
# `tvm_fusion.models.transformer_encoder_layer` (as PyTorch exports it: decomposed
# LayerNorm and GELU), then shows the other half of the paper, **rewriting by mathematical
# properties** (§4.2), before and after.
#
# Everything runs on a CPU in seconds; the design decisions behind each step are in
# [docs/design.md](../docs/design.md) and [docs/rewrite.md](../docs/rewrite.md).

# %%
from collections import Counter

import matplotlib.pyplot as plt
import numpy as np
import tvm
from IPython.display import Markdown, display

import tvm_fusion
from tvm_fusion.compile import count_kernels, import_onnx
from tvm_fusion.models import transformer_encoder_layer

target = tvm_fusion.target.host_target()  # this machine's CPU (tutorial 1)
model = transformer_encoder_layer(seq=64, hidden=128, heads=4, ffn=512)
mod = import_onnx(model)  # from_onnx(model, keep_params_in_input=False)
print(f"encoder layer: {len(model.graph.node)} ONNX nodes;",
      ", ".join(f"{op} ×{n}" for op, n in Counter(n.op_type for n in model.graph.node).items()))

# %% [markdown]
# ## 1. Mapping types, read from TIR
#
# The planner works on legalised Relax: every operator is a `call_tir` of a PrimFunc, and
# its mapping type is computed **from the PrimFunc's loop nest** (never from the operator's
# name): a reduction or stencil is *Many-to-Many*, the same iterators in order *One-to-One*,
# permuted *Shuffle*, mixed by a bijective index map *Reorganize*, a missing iterator or a
# data-dependent index *One-to-Many*. We run the pipeline with only the planner (no
# rewriting, no SmartMem elimination, `profile="off"` so that yellow cells use the analytic
# oracle) and keep its record, the Extended Computational Graph (ECG) and the plan: a
# `Collector` (a TVM pass instrument) receives what the passes produce while its
# `PassContext` is active.

# %%
from tvm_fusion.instrument import Collector

collector = Collector()
with target, tvm.transform.PassContext(instruments=[collector]):
    planned = tvm_fusion.transform.Sequential(
        target, rewrite=False, layout=False, profile="off")(mod)
(plan,) = collector.plans[0].plans.values()  # one dataflow block
ecg = plan.ecg
block_of = {m: k for k, b in enumerate(plan.blocks) for m in b.members}

rows = ["| # | result | PrimFunc | mapping type | CIL | why (from the TIR) |",
        "|---|---|---|---|---|---|"]
for n in ecg.nodes:
    reason = n.reason if len(n.reason) < 90 else n.reason[:87] + "..."
    rows.append(f"| {n.index} | `{n.name}` | `{n.op_name}` | **{n.mapping_type.short}** | "
                f"{'✓' if n.compute_intensive else ''} | {reason} |")
display(Markdown("\n".join(rows)))

# %%
counts = Counter(n.mapping_type.short for n in ecg.nodes)
print(f"{len(ecg.nodes)} operators:", ", ".join(f"{k} {v}" for k, v in counts.most_common()))
print(f"compute-intensive (CIL): {sum(n.compute_intensive for n in ecg.nodes)}, "
      f"memory-intensive (MIL): {sum(not n.compute_intensive for n in ecg.nodes)}")
print(f"anchor bound (Many-to-Many + Opaque operators): {ecg.anchor_bound()}")

# %% [markdown]
# Two things to notice. The LayerNorm's `subtract(x, mean)` broadcasts `mean` but is
# **One-to-One**: the default `broadcast_policy="expanding_only"` calls an elementwise operator
# One-to-Many only when no input already spans the output (the paper is ambiguous here; with
# `"strict"` the LayerNorm chain splits, see design.md). And the *anchor bound*, one kernel per
# Many-to-Many operator, is the fewest kernels any plan can reach, since Table 3 never puts
# two Many-to-Many operators in one kernel.
#
# ## 2. Table 3
#
# Rows are the first (producer) operator, columns the second (consumer). Each cell gives the
# mapping type of the fused pair and a colour: **green** `fuse_through` (always fuse),
# **yellow** `fuse_depend` (ask the profitability oracle), **red** `fuse_break`. The colours are
# lost in the paper's text; they are rebuilt from its prose (13 green, 10 yellow, 2 red; see
# design.md) and every one is an option (`table3={("O2M", "O2M"): "green"}`).

# %%
from tvm_fusion.relay_passes.fusion_table import FusionTable
from tvm_fusion.relay_passes.mapping_type import MappingType

order = [MappingType.ONE_TO_ONE, MappingType.ONE_TO_MANY, MappingType.MANY_TO_MANY,
         MappingType.REORGANIZE, MappingType.SHUFFLE]
table = FusionTable()
colour = {"green": "#a5d6a7", "yellow": "#fff59d", "red": "#ef9a9a"}
fig, ax = plt.subplots(figsize=(6.4, 4.6))
for i, first in enumerate(order):
    for j, second in enumerate(order):
        cell = table.lookup(first, second)
        ax.add_patch(plt.Rectangle((j, i), 1, 1, facecolor=colour[cell.colour.value],
                                   edgecolor="white", linewidth=2))
        text = cell.fused.short if cell.fused is not None else "×"
        ax.text(j + 0.5, i + 0.42, text, ha="center", va="center", fontsize=12, weight="bold")
        ax.text(j + 0.5, i + 0.72, cell.colour.paper_name, ha="center", va="center", fontsize=7)
ax.set_xlim(0, 5)
ax.set_ylim(5, 0)
ax.set_xticks(np.arange(5) + 0.5, [t.short for t in order])
ax.set_yticks(np.arange(5) + 0.5, [t.short for t in order])
ax.xaxis.tick_top()
ax.set_xlabel("second operator (consumer)")
ax.xaxis.set_label_position("top")
ax.set_ylabel("first operator (producer)")
ax.set_title("DNNFusion Table 3: fused type and colour", pad=32)
ax.tick_params(length=0)
for spine in ax.spines.values():
    spine.set_visible(False)
fig.tight_layout()
plt.show()
print({c.value: n for c, n in table.counts().items()})

# %% [markdown]
# ## 3. The plan, with the reason for every cut
#
# The planner (the paper's Listing 1, with the fixes listed in design.md) seeds a block at a
# One-to-One operator with the largest intermediate result, grows it through successors and
# predecessors while Table 3 allows, asks the oracle at yellow cells, and refuses any step that
# would make the block depend on itself through an outside operator. `tvm_fusion.report` is
# what `tvm-fusion report --why` prints; here through the Python API:

# %%
from tvm_fusion.report import format_report, make_report

report = make_report(model, "encoder", target, check=True, rewrite=False, layout=False,
                     profile="off")
print(format_report(report, why=True))

# %% [markdown]
# The same plan drawn (`tvm_fusion.visualize`, the page `tvm-fusion report --html` writes):
# clusters are the kernels above, and hovering an edge between two of them shows why the
# planner kept them apart.

# %%
tvm_fusion.visualize(model, target, title="encoder layer", rewrite=False, layout=False,
                     profile="off")

# %% [markdown]
# Reading it: 11 kernels, two below the anchor bound of 13. Table 3 keeps Many-to-Many
# operators apart (red: M2M → M2M), and every kernel but one holds exactly one; the exception
# is the attention block (#1), where `Q·Kᵀ`, the scale, the mask, `softmax` and `·V` become
# one kernel with an online softmax ([docs/attention.md](../docs/attention.md)), so the
# `seq × seq` scores are never written. It also takes the Q/K/V bias adds and head-split
# reshapes and transposes as its prologue and the head merge as its epilogue, which leaves the
# Q, K and V projections bare packed GEMMs; the residual add joins the output projection; the
# first FFN matmul takes its bias add and GELU, the second its bias and the residual add; each
# LayerNorm is two kernels, because `mean` and the `mean` of the squares are both reductions. The yellow decisions at the end say what decided
# each one (here the analytic oracle: bytes saved against recomputation). The "would form a
# cycle" rejections are the LayerNorm inputs: the residual `add` feeds both `mean` and
# `subtract`, and `subtract` also reads `mean`, so putting `subtract` into the `add`'s block
# would make that block wait for `mean`, which waits for the block.
#
# ## 4. The fused graph
#
# Every operator of the ECG, placed by its depth in the graph and coloured by the kernel it
# ends up in (plain matplotlib, no graphviz needed).

# %%
from matplotlib import colormaps

depth = {}
for n in ecg.nodes:  # ECG nodes are in topological order
    depth[n.index] = 1 + max((depth[p] for p in n.preds), default=-1)
levels = {}
for n in ecg.nodes:
    levels.setdefault(depth[n.index], []).append(n.index)
pos = {}
for d, members in levels.items():
    for slot, idx in enumerate(members):
        pos[idx] = (2.6 * (slot - (len(members) - 1) / 2), -0.8 * d)

palette = colormaps["Set3"].colors + colormaps["Pastel1"].colors
fig, ax = plt.subplots(figsize=(9, 0.3 * (max(levels) + 1) + 1))
for n in ecg.nodes:
    for s in n.succs:
        (x0, y0), (x1, y1) = pos[n.index], pos[s]
        same = block_of[n.index] == block_of[s]
        skip = depth[s] - depth[n.index] > 1 and abs(x1 - x0) < 0.1  # a residual: bend it
        ax.annotate("", xy=(x1, y1 + 0.15), xytext=(x0, y0 - 0.15),
                    arrowprops=dict(arrowstyle="-|>", lw=1.2 if same else 0.8,
                                    color="#333333" if same else "#999999",
                                    linestyle="-" if same else "--", shrinkA=0, shrinkB=0,
                                    connectionstyle="arc3,rad=-0.6" if skip else "arc3"))
for n in ecg.nodes:
    k = block_of[n.index]
    x, y = pos[n.index]
    ax.text(x, y, f"#{k} {n.op_name} [{n.mapping_type.short}]", ha="center", va="center",
            fontsize=7, bbox=dict(boxstyle="round,pad=0.25", facecolor=palette[k % len(palette)],
                                  edgecolor="#555555", linewidth=0.6))
xs = [p[0] for p in pos.values()]
ax.set_xlim(min(xs) - 1.8, max(xs) + 1.8)
ax.set_ylim(-0.8 * max(levels) - 0.5, 0.5)
ax.axis("off")
ax.set_title(f"encoder layer: {len(ecg.nodes)} operators → {plan.num_kernels} kernels\n"
             "(colour and #k: kernel; solid edges stay inside a kernel, dashed ones cross)",
             fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Rewriting by mathematical properties (§4.2)
#
# Before legalisation, `RewriteByMathProperties` applies the associative, distributive and
# commutative laws where they lower the cost `(FLOPs, elements loaded, operators)`. On a toy
# graph first: Table 4, row 5, `A⊙C + A⊙B = A⊙(B+C)`, three element-wise operations become two.

# %%
from tvm import relax

from tvm_fusion.relay_passes.rewrite.math_properties import RewriteByMathProperties

bb = relax.BlockBuilder()
a, b, c = (relax.Var(name, relax.TensorType((64, 64), "float32")) for name in "abc")
with bb.function("main", [a, b, c]):
    with bb.dataflow():
        ac = bb.emit(relax.op.multiply(a, c))
        ab = bb.emit(relax.op.multiply(a, b))
        out = bb.emit_output(relax.op.add(ac, ab))
    bb.emit_func_output(out)
toy = bb.get()
collector = Collector()
with tvm.transform.PassContext(instruments=[collector]):
    rewritten = RewriteByMathProperties()(toy)
(stats,) = collector.rewrite_stats
print("before:\n" + toy["main"].script())
print("after:\n" + rewritten["main"].script())
print(f"FLOPs {stats.flops_before} -> {stats.flops_after};",
      f"rules fired: {dict(stats.fired)}")

# %% [markdown]
# On the encoder layer the rules that fire are structural: the Q, K and V projections read
# the same input, so their weights (and biases) are concatenated into one matmul
# (`matmul_concat_shared_input`: two Many-to-Many operators fewer), the attention scale
# `1/√d` moves through the head split into the projection weights, where it is folded
# (`scale_into_weights`), and GELU's `·0.5` moves onto the next weight
# (`scale_across_matmul`).

# %%
collector = Collector()
with tvm.transform.PassContext(instruments=[collector]):
    rewritten = RewriteByMathProperties()(mod)
(s,) = collector.rewrite_stats
print(f"FLOPs: {s.flops_before / 1e6:.3f} M -> {s.flops_after / 1e6:.3f} M "
      f"({100 * (s.flops_before - s.flops_after) / s.flops_before:.2f} % saved)")
print("rules fired:", dict(s.fired))


def matmuls(m):
    return [line.strip() for line in m["main"].script(show_meta=False).splitlines()
            if "R.matmul" in line]


print(f"\nmatmuls before ({len(matmuls(mod))}):", *matmuls(mod)[:3], "...", sep="\n  ")
print(f"matmuls after ({len(matmuls(rewritten))}):", *matmuls(rewritten)[:2], "...", sep="\n  ")

# %%
kernels = {}
for name, options in {"planner only": dict(rewrite=False, layout=False),
                      "+ rewriting": dict(rewrite=True, layout=False),
                      "+ SmartMem elimination (default)": dict(rewrite=True, layout=True)}.items():
    with target:
        kernels[name] = count_kernels(
            tvm_fusion.transform.Sequential(target, profile="off", **options)(mod))
kernels = {"stock FuseOps": report.stock_kernels, **kernels}
fig, ax = plt.subplots(figsize=(7.5, 2.8))
ax.barh(list(kernels)[::-1], list(kernels.values())[::-1],
        color=["#ef6c00", "#ffa726", "#ffcc80", "#9e9e9e"])
for i, v in enumerate(list(kernels.values())[::-1]):
    ax.text(v, i, f" {v}", va="center")
ax.set_xlabel("kernels")
ax.set_title("encoder layer: kernels after each step")
fig.tight_layout()
plt.show()

# %% [markdown]
# Rewriting takes the layer from 11 to 9 kernels because it removes Many-to-Many operators
# (the Q, K and V projections become one matmul of the concatenated weights; the attention
# scale folds into the weights): no plan can do that on its own. The full report of the default
# pipeline (`tvm-fusion report --why` on the built-in model) checks the numbers against the
# stock build and ONNX Runtime:

# %%
full = make_report(model, "encoder", target, check=True, profile="off")
print(format_report(full).split("  fusion blocks:")[0])

# %% [markdown]
# **Next:** [04_smartmem_texture](04_smartmem_texture.ipynb): SmartMem's layout-transform
# elimination on a Swin window-attention block, and texture layouts for Adreno GPUs run on
# PoCL.

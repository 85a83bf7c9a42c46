# ruff: noqa: E402  (notebook cells import where they are used)
# Source of tutorials/05_rpc_tuning.ipynb (build: scripts/build_tutorials.py 05_rpc_tuning).

# %% [markdown]
# # 5. Tuning fused kernels on a phone over TVM's RPC
#
# You ship on a phone, so you tune on the phone. TVM's RPC *tracker* queues jobs for devices
# registered under a *key* (`android`); each phone runs an RPC *server* that registers with it;
# `tvm-fusion tune` sends tvm_fusion's fused kernels (not stock ones) to meta_schedule, which
# builds candidates on your computer, runs them on the phones and keeps a database in a work
# directory. `tvm-fusion compile --tuned DIR` then builds with it, tuning nothing.
#
# No phone is attached to the machine that executes this notebook, so this computer plays the
# phone: a tracker and two servers on 127.0.0.1 under key `android`, the host `llvm` target in
# place of `{"kind": "llvm", "mtriple": "aarch64-linux-android"}`. Every command is the one
# you would run against a real phone; [docs/android.md](../docs/android.md) has the phone side
# (NDK, `tvm_rpc` on the device, `adb reverse`, Adreno targets).

# %%
import atexit
import json
import os
import statistics
import tempfile

import matplotlib.pyplot as plt
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion.cli import main as tvm_fusion_cli
from tvm_fusion.compile import compile_model, import_onnx, run
from tvm_fusion.tuning import rpc
from tvm_fusion.tuning import tune as T

work = tempfile.mkdtemp(prefix="tvm_fusion_tutorial5_")

# %% [markdown]
# ## A small model: one fused kernel
#
# MatMul + bias + ReLU: tvm_fusion fuses it into one kernel, `fused_matmul_packed_add_relu`
# (the weight is laid out in panels at build time, hence `packed`).

# %%
rng = np.random.default_rng(0)
nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]),
         helper.make_node("Add", ["mm", "B"], ["a"]),
         helper.make_node("Relu", ["a"], ["y"])]
graph = helper.make_graph(
    nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 128])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 128])],
    initializer=[numpy_helper.from_array((rng.standard_normal((128, 128)) / 11).astype("float32"),
                                         "W"),
                 numpy_helper.from_array(rng.standard_normal(128).astype("float32"), "B")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
model_path = os.path.join(work, "small.onnx")
onnx.save(model, model_path)

# %% [markdown]
# ## The tracker and the "phones"
#
# On your computer: `python scripts/rpc_tracker.py --port 9190`. On each phone: the RPC server
# with `--tracker=<computer>:9190 --key=android`. Here both run on this machine; the launchers
# return the process, which we stop by process id at the end.

# %%
tracker_proc, port = rpc.start_tracker("127.0.0.1")
tracker = f"127.0.0.1:{port}"
servers = [rpc.start_server(tracker, "android")[0] for _ in range(2)]


def stop_farm():
    for proc in servers + [tracker_proc]:
        rpc.kill_tree(proc.pid)


atexit.register(stop_farm)  # also when a cell fails and the kernel shuts down
print("servers under key 'android':", rpc.wait_for_servers("127.0.0.1", port, "android", 2))

# %% [markdown]
# ## Tune
#
# 16 trials here (a real session uses hundreds; rerunning the same command resumes where it
# stopped). Both servers share the trials. At the end, each kernel's best tuned schedule and
# tvm_fusion's own schedule are timed in turns on the servers and the faster is kept.

# %%
tune_dir = os.path.join(work, "tune-phone")
rc = tvm_fusion_cli(["tune", model_path, "--tracker", tracker, "--key", "android",
                     "--target", "llvm", "--trials", "16", "--work-dir", tune_dir,
                     "--profile-db", os.path.join(work, "profiling.db"), "--no-progress"])
print("exit code", rc)
print(json.dumps(T.read_meta(tune_dir)["choices"], indent=1))

# %% [markdown]
# ## Compile with the tuned database, tuning nothing

# %%
lib = os.path.join(work, "model.so")
rc = tvm_fusion_cli(["compile", model_path, "--tuned", tune_dir, "-o", lib])
print("exit code", rc, "|", os.path.getsize(lib), "bytes")

# %% [markdown]
# ## What tuning bought, measured on the "phones"
#
# Three builds timed in turns over RPC: the unscheduled fused kernel meta_schedule starts
# from, tvm_fusion's untuned build (its own CPU schedules), and the tuned build. They compute
# the same numbers.

# %%
mod = import_onnx(model)
target = T.tuned_target(None, tune_dir)
tuned, applied = T.compile_tuned(mod, tune_dir)
hand = compile_model(mod, target)
unscheduled = compile_model(mod, target, schedule=False)
x = rng.standard_normal((1, 64, 128)).astype("float32")
np.testing.assert_allclose(run(tuned, [x])[0], run(hand, [x])[0], rtol=1e-4, atol=1e-4)

builds = {"unscheduled": unscheduled, "tvm_fusion (untuned)": hand, "tuned": tuned}
samples = {name: [] for name in builds}
for _ in range(3):
    for name, ex in builds.items():
        samples[name] += T.remote_latency(ex, [x], tracker, "android", target, repeat=5)
latency_us = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
print("kernels applied from the database:", applied)
print({k: round(v, 1) for k, v in latency_us.items()})
plt.figure(figsize=(5, 3))
plt.bar(list(latency_us), list(latency_us.values()), color=["tab:gray", "tab:blue", "tab:green"])
plt.ylabel("µs (median over RPC)")
plt.title("MatMul+bias+ReLU [1,64,128]×[128,128]")
plt.tight_layout()
plt.show()

# %% [markdown]
# With 16 trials, tuning beats the unscheduled kernel by a wide margin; against tvm_fusion's
# own schedule it gains little or nothing on this CPU, and the keep-the-faster rule means the
# tuned build is never slower than the untuned one (beyond timing noise).
#
# ## Stop the tracker and the servers

# %%
stop_farm()
print("stopped")

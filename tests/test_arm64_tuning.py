"""Issue 22: ``tvm-fusion tune`` -> interrupt -> resume -> ``compile --tuned`` on the emulated
AArch64 device, for a Linux target (``.tar``, linked on the device) and an Android target
(``.so`` linked here by ``$TVM_NDK_CC``, played by the cross g++); and the faults of a fleet of
two emulated servers under one key, one killed mid-tuning.

The device is ``scripts/arm64_device.py`` (fixtures in conftest.py); the tests are skipped with
the reason where qemu-aarch64-static or aarch64-linux-gnu-g++ is absent. Every process started
here is killed by process id. Emulated timings mean nothing; the tests check the flow, the
records and the outputs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import onnx
import pytest
import tvm
from test_rpc_tuning import _records, run_dead_server_scenario, small_model
from tvm import relax

from tvm_fusion.compile import graph_input_names
from tvm_fusion.feeds import random_inputs
from tvm_fusion.numerics import compare, max_abs_error, onnx_reference
from tvm_fusion.tuning import rpc

GNU = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"], "num-cores": 2}
ANDROID = {"kind": "llvm", "mtriple": "aarch64-linux-android", "mattr": ["+neon"],
           "num-cores": 2}


def _run_on_device(device, path: str, model) -> float:
    """Upload a built model file, run it on the device, compare with ONNX Runtime."""
    feeds = random_inputs(model, seed=0)
    inputs = [feeds[n] for n in graph_input_names(model)]
    session = rpc.request_session("127.0.0.1", device.port, device.key, timeout_s=300)
    session.upload(path)
    dev = session.cpu(0)
    vm = relax.VirtualMachine(session.load_module(os.path.basename(path)), dev)
    got = vm["main"](*[tvm.runtime.tensor(x, dev) for x in inputs]).numpy()
    reference = onnx_reference(model, feeds)
    compare([got], reference, rtol=1e-4, atol=1e-4)
    return max_abs_error([got], reference)


@pytest.mark.slow  # ~100 s each on 2 cores: .ci/run runs them after the default suite
@pytest.mark.timeout(900)
@pytest.mark.parametrize("which", ["linux-tar", "android-so"])
def test_tune_interrupt_resume_compile_tuned(arm64_device, tmp_path, which):
    target, suffix = (GNU, ".tar") if which == "linux-tar" else (ANDROID, ".so")
    env = rpc._env()
    if which == "android-so":
        env[rpc.NDK_ENV] = shutil.which("aarch64-linux-gnu-g++")  # the NDK's clang's stand-in
    model_path = small_model(tmp_path / "small.onnx")
    work_dir = str(tmp_path / "tune")
    cmd = [sys.executable, "-m", "tvm_fusion.cli", "tune", model_path, "--tracker",
           arm64_device.tracker, "--key", arm64_device.key, "--target", json.dumps(target),
           "--trials", "8", "--trials-per-iter", "4", "--work-dir", work_dir,
           "--profile-db", "none", "--no-progress"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:  # interrupt: the command killed (with its workers) once the first round is stored
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline and proc.poll() is None:
            if len(_records(work_dir)) >= 4:
                break
            time.sleep(0.05)
    finally:
        rpc.kill_tree(proc.pid)
    stderr = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    kept = _records(work_dir)
    assert 4 <= len(kept) < 8, (len(kept), stderr[-2000:])

    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    tune_s = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{8 - len(kept)} trials this run (0 failed), 8 in" in done.stdout, done.stdout
    assert f"--tuned {work_dir} -o model{suffix}" in done.stdout  # the hint for this target
    after = _records(work_dir)
    assert after[: len(kept)] == kept and len(after) == 8  # resumed: nothing lost, nothing redone

    out = str(tmp_path / f"model{suffix}")
    built = subprocess.run([sys.executable, "-m", "tvm_fusion.cli", "compile", model_path,
                            "--tuned", work_dir, "-o", out], env=env, capture_output=True,
                           text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "fused kernels use tuned schedules" in built.stdout
    err = _run_on_device(arm64_device, out, onnx.load(model_path))
    print(f"\n[issue 22] {which}: tune 8 trials, interrupted after {len(kept)}, resumed, "
          f"compile --tuned -> {os.path.basename(out)}: {tune_s:.0f} s of tuning; on the "
          f"emulated AArch64 device max |err| vs ORT {err:.2e}")


@pytest.mark.slow  # ~3 min: two emulated servers; .ci/run runs it after the default suite
@pytest.mark.timeout(900)
def test_server_killed_mid_tuning_then_resume(arm64, tmp_path):
    """Two emulated servers under one key; one is killed while it serves a measurement:
    tuning finishes on the other, the death is in failures.jsonl, no stored record is lost,
    and a rerun resumes. Emulated sessions last seconds, so catching one in flight is no race
    (the host-server version of this test, in test_rpc_tuning.py, stretches its sessions).
    Sessions time out after 60 s: after the kill, the surviving server's next session was
    seen to stall until its session timeout (inside TVM's tracker/server; not traced)."""
    model_path = small_model(tmp_path / "small.onnx")
    fleet = arm64.Device(key="fleet", servers=2)
    try:
        run_dead_server_scenario(fleet.tracker, fleet.key, fleet.servers[0], model_path,
                                 str(tmp_path / "tune"), target=GNU, trials=8)
    finally:
        fleet.close()

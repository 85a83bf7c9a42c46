"""Issue 7: tuning fused kernels over TVM RPC (tracker + servers), resumable, fault tolerant.

The phone is played by this machine: a tracker and two Python RPC servers on 127.0.0.1, key
``android``, host ``llvm`` target. Every process is started here on free ports and killed by
process id (children first) in the fixture's teardown, whatever the test did.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
import threading
import time

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion.cli import main
from tvm_fusion.compile import compile_model, import_onnx, run
from tvm_fusion.tuning import rpc
from tvm_fusion.tuning import tune as T
from tvm_fusion.tuning.database import ProfilingDatabase

KEY = "android"
SEQ, HIDDEN = 64, 128


def small_model(path) -> str:
    """One fused kernel: MatMul + bias + Relu, [1, 64, 128] x [128, 128]."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((HIDDEN, HIDDEN)) / 11).astype("float32"),
                                "W")
    b = numpy_helper.from_array(rng.standard_normal(HIDDEN).astype("float32"), "B")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]),
             helper.make_node("Add", ["mm", "B"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    graph = helper.make_graph(
        nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, HIDDEN])],
        initializer=[w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


class Farm:
    """A tracker and servers, all started here; ``close`` kills every one by pid."""

    def __init__(self, servers: int):
        self.procs = []
        self.tracker_proc, self.port = rpc.start_tracker("127.0.0.1")
        self.procs.append(self.tracker_proc)
        self.tracker = f"127.0.0.1:{self.port}"
        self.servers = []
        for _ in range(servers):
            proc, _port = rpc.start_server(self.tracker, KEY)
            self.procs.append(proc)
            self.servers.append(proc)
        rpc.wait_for_servers("127.0.0.1", self.port, KEY, servers, timeout_s=60)

    def close(self):
        for proc in reversed(self.procs):
            rpc.kill_tree(proc.pid)


@pytest.fixture
def farm2():
    farm = Farm(servers=2)
    try:
        yield farm
    finally:
        farm.close()


@pytest.fixture
def model_path(tmp_path):
    return small_model(tmp_path / "small.onnx")


def _records(work_dir) -> list[str]:
    path = os.path.join(work_dir, T.RECORDS_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [line for line in handle.read().split("\n") if line.strip()]


def _interleaved_latency(executables, x, farm, target, rounds=3):
    """Fastest sample per executable, the builds timed in turns on the farm: load only slows
    a sample, and the farm's two servers on two shared cores gave medians 2x apart."""
    samples = [[] for _ in executables]
    for _ in range(rounds):
        for i, ex in enumerate(executables):
            samples[i] += T.remote_latency(ex, [x], farm.tracker, KEY, target, repeat=5)
    return [min(s) for s in samples]


# ------------------------------------------------------------------------------ end to end

@pytest.mark.slow  # ~2 min; .ci/run runs it after the default run
@pytest.mark.timeout(900)
def test_tune_end_to_end_then_compile_tuned(farm2, model_path, tmp_path, capsys):
    work_dir = str(tmp_path / "tune")
    profile_db = str(tmp_path / "profiling.db")
    start = time.perf_counter()
    rc = main(["tune", model_path, "--tracker", farm2.tracker, "--key", KEY, "--target", "llvm",
               "--trials", "16", "--work-dir", work_dir, "--profile-db", profile_db,
               "--no-progress"])
    tune_s = time.perf_counter() - start
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "on 2 server(s)" in out
    assert len(_records(work_dir)) == 16
    meta = T.read_meta(work_dir)
    assert meta["key"] == KEY and meta["trials"] == 16
    (choice,) = meta["choices"].values()  # one fused kernel: matmul + bias + relu
    assert choice["name"] == "fused_matmul_packed_add_relu"  # the weight is packed at build time
    assert choice["tuned_s"] is not None and choice["hand_s"] is not None

    # Per-kernel rows in the profiling database of the yellow-cell oracle.
    with ProfilingDatabase(profile_db, create=False) as pdb:
        rows = list(pdb.entries(device_key=f"rpc/{KEY}"))
    assert {r.strategy for r in rows} == {"meta_schedule", "fused_block"}
    assert all(r.method == "rpc" and r.variant == "fused" for r in rows)

    # compile --tuned: reuses the records, measures nothing, tunes nothing.
    lib = str(tmp_path / "tuned.so")
    records_before = _records(work_dir)
    start = time.perf_counter()
    rc = main(["compile", model_path, "--tuned", work_dir, "-o", lib])
    compile_s = time.perf_counter() - start
    out = capsys.readouterr().out
    assert rc == 0, out
    assert _records(work_dir) == records_before
    expected = "1 of 1" if choice["choice"] == "tuned" else "0 of 1"
    assert expected in out, out
    assert compile_s < 60

    # Numbers: the tuned build against the untuned tvm_fusion build (hand schedules) and the
    # unscheduled fused kernels meta_schedule started from, timed on the farm in turns.
    model = onnx.load(model_path)
    mod = import_onnx(model)
    target = T.tuned_target(None, work_dir)
    tuned, applied = T.compile_tuned(mod, work_dir)
    hand = compile_model(mod, target)
    unscheduled = compile_model(mod, target, schedule=False)
    x = np.random.default_rng(1).standard_normal((1, SEQ, HIDDEN)).astype("float32")
    reference = run(hand, [x])[0]
    np.testing.assert_allclose(run(tuned, [x])[0], reference, rtol=1e-4, atol=1e-4)
    loaded = tvm.runtime.load_module(lib)
    np.testing.assert_allclose(run(loaded, [x])[0], reference, rtol=1e-4, atol=1e-4)
    t_unsched, t_hand, t_tuned = _interleaved_latency([unscheduled, hand, tuned], x, farm2,
                                                      target)
    print(f"\n[issue 7] 16 trials on 2 servers in {tune_s:.0f} s; kernel: tuned "
          f"{choice['tuned_s'] * 1e6:.1f} us vs hand {choice['hand_s'] * 1e6:.1f} us -> "
          f"{choice['choice']}; model: unscheduled {t_unsched * 1e6:.1f} us, untuned tvm_fusion "
          f"{t_hand * 1e6:.1f} us, tuned {t_tuned * 1e6:.1f} us; compile --tuned "
          f"{compile_s:.1f} s")
    assert applied == {choice["name"]: choice["choice"]}
    assert t_tuned < 0.5 * t_unsched  # tuning the fused kernel pays
    if choice["choice"] == "hand":
        # Tuning lost to the hand schedule, so the tuned build is the hand build, code for code:
        # exact, where two timings on a shared 2-core farm differed by 2x (CI, 2026-11-27).
        assert _llvm_ir(tuned) == _llvm_ir(hand)
    else:
        assert t_tuned <= 1.25 * t_hand  # never slower than the untuned build (farm noise)


def _llvm_ir(executable) -> list[str]:
    """The build's LLVM IR, less the buffer addresses that name its alias-analysis nodes."""
    return [re.sub(r"0x[0-9a-f]+", "0x", m.inspect_source("ll")) for m in executable.mod.imports]


# ----------------------------------------------------------------------------- faults

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dead_server_mid_tuning_then_resume(farm2, model_path, tmp_path):
    """A server killed while it serves a measurement: tuning finishes on the other one.

    It used to race: a session here lasted ~0.1 s and the watcher missed it in loaded CI
    runs. Each measurement now runs for at least 300 ms (``min_repeat_ms``), so a session
    stays open long enough to be caught in flight."""
    run_dead_server_scenario(farm2.tracker, KEY, farm2.servers[0], model_path,
                             str(tmp_path / "tune"), target="llvm", trials=16,
                             min_repeat_ms=300)


def run_dead_server_scenario(tracker: str, key: str, victim, model_path: str, work_dir: str,
                             target, trials: int, min_repeat_ms: int = 5,
                             timeout_s: int = 60) -> None:
    """Tune ``trials`` in rounds of 4 on two servers; kill ``victim`` (a server process) while
    one of its sessions is open, after the first round is stored; check that tuning finished
    on the other server with nothing lost and the failure recorded; then resume 4 more."""
    mod = import_onnx(onnx.load(model_path))
    cfg = T.TuneConfig(tracker=tracker, key=key, target=target, trials=trials,
                       trials_per_iter=4, work_dir=work_dir, profile_db="", progress=False,
                       compare_rounds=1, min_repeat_ms=min_repeat_ms,
                       session_timeout_s=timeout_s)
    outcome = {}

    def tune_thread():
        try:
            outcome["result"] = T.tune(mod, cfg)
        except BaseException as err:  # noqa: BLE001 (reported below)
            outcome["error"] = err

    thread = threading.Thread(target=tune_thread, daemon=True)
    thread.start()
    idle = set(rpc.children(victim.pid))  # the server's popen_worker
    deadline = time.monotonic() + 600
    before_kill = None
    while time.monotonic() < deadline and thread.is_alive():
        if len(_records(work_dir)) >= 4:
            sessions = set(rpc.children(victim.pid)) - idle
            if any(_in_session(pid) for pid in sessions):
                before_kill = _records(work_dir)
                rpc.kill_tree(victim.pid)
                break
        time.sleep(0.01)
    assert before_kill is not None, "the victim never served a session after the first round"
    thread.join(600)
    assert not thread.is_alive(), "tuning hung after a server died"
    assert "error" not in outcome, repr(outcome.get("error"))
    result = outcome["result"]
    records = _records(work_dir)
    assert records[: len(before_kill)] == before_kill  # nothing stored was lost
    assert result.trials_run == trials and len(records) == trials  # finished on the other
    with open(os.path.join(work_dir, T.FAILURES_FILE), encoding="utf-8") as handle:
        failures = [json.loads(line) for line in handle if line.strip()]
    assert failures, "the dead server left no trace in failures.jsonl"
    assert all(f.get("cause") and f.get("error") for f in failures)
    trial_failures = [f for f in failures if f["stage"] in ("build", "run")]
    assert len(trial_failures) == result.failed_run
    print(f"\n[issue 22] server killed mid-tuning: {result.failed_run} candidates failed, "
          f"{sum(f['stage'] == 'session' for f in failures)} sessions retried; "
          f"{len(before_kill)} records before the kill all kept; causes: "
          f"{sorted({f['cause'][:80] for f in failures})}")

    rc = main(["tune", model_path, "--tracker", tracker, "--key", key, "--target",
               json.dumps(target) if isinstance(target, dict) else target, "--trials",
               str(trials + 4), "--trials-per-iter", "4", "--work-dir", work_dir,
               "--profile-db", "none", "--no-progress"])
    assert rc == 0
    after = _records(work_dir)
    assert after[:trials] == records and len(after) == trials + 4
    assert T.read_meta(work_dir)["trials"] == trials + 4


def _in_session(pid: int) -> bool:
    """The process is alive and its connection to the client is still open (a session whose
    client has hung up is only exiting: killing it would cost no measurement)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") \
            else proc.connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return any(c.status == psutil.CONN_ESTABLISHED and c.raddr for c in conns)


def test_torn_record_line_is_dropped_on_open(tmp_path):
    work_dir = tmp_path / "tune"
    work_dir.mkdir()
    records = work_dir / T.RECORDS_FILE
    records.write_text('[0, [["a"]]]\n[0, [["b"], [1.0')  # a process killed mid-append
    assert T._repair_lines(str(records)) == 1
    assert records.read_text() == '[0, [["a"]]]\n'
    assert T._repair_lines(str(records)) == 0
    db = T.open_database(str(tmp_path / "new"))  # an empty work dir opens as a database
    assert len(db.get_all_tuning_records()) == 0


# ------------------------------------------------------------------------ bad input

@pytest.mark.timeout(120)
def test_unreachable_tracker_names_the_option(model_path, tmp_path, capsys):
    port = rpc.free_port()
    rc = main(["tune", model_path, "--tracker", f"127.0.0.1:{port}", "--key", KEY,
               "--work-dir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--tracker" in err
    rc = main(["tune", model_path, "--tracker", "nonsense", "--key", KEY,
               "--work-dir", str(tmp_path / "w")])
    assert rc == 2 and "--tracker" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_no_server_under_key_and_bad_target(model_path, tmp_path, capsys):
    proc, port = rpc.start_tracker("127.0.0.1")
    try:
        rc = main(["tune", model_path, "--tracker", f"127.0.0.1:{port}", "--key", "pixel",
                   "--work-dir", str(tmp_path / "w")])
        err = capsys.readouterr().err
        assert rc == 2 and "--key 'pixel'" in err and err.count("\n") == 1
        rc = main(["tune", model_path, "--tracker", f"127.0.0.1:{port}", "--key", "pixel",
                   "--target", "no-such-target", "--work-dir", str(tmp_path / "w")])
        err = capsys.readouterr().err
        assert rc == 2 and "target" in err and err.count("\n") == 1
    finally:
        rpc.kill_tree(proc.pid)


def test_compile_tuned_needs_a_tuning_dir(model_path, tmp_path, capsys):
    rc = main(["compile", model_path, "--tuned", str(tmp_path / "nothing"), "-o",
               str(tmp_path / "m.so")])
    assert rc == 2 and "--tuned" in capsys.readouterr().err


# ---------------------------------------------------------------- Android cross-compiling

ANDROID = {"kind": "llvm", "mtriple": "aarch64-linux-android", "mattr": ["+neon"],
           "num-cores": 8}


def _elf_machines(tar_path) -> dict[str, int]:
    machines = {}
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()
            if data[:4] == b"\x7fELF":
                machines[member.name] = int.from_bytes(data[18:20], "little")
    return machines


def test_aarch64_android_cross_export(model_path, tmp_path, monkeypatch):
    monkeypatch.delenv(rpc.NDK_ENV, raising=False)
    target = T.resolve_target(json.dumps(ANDROID))
    assert rpc.is_android(target) and rpc.is_cross(target)
    mod = import_onnx(onnx.load(model_path))
    executable = compile_model(mod, target)  # tvm_fusion's fused + hand-scheduled kernels
    out = rpc.export_library(executable, str(tmp_path / "model.tar"), target)
    machines = _elf_machines(out)
    assert machines and set(machines.values()) == {183}, machines  # EM_AARCH64
    # A .so for the phone needs the NDK; without it the error names TVM_NDK_CC.
    with pytest.raises(ValueError, match="TVM_NDK_CC"):
        rpc.export_library(executable, str(tmp_path / "model.so"), target)
    with pytest.raises(ValueError, match="TVM_NDK_CC"):
        rpc.builder_export(target)
    # The CLI: a tar of aarch64 objects for the phone.
    rc = main(["compile", model_path, "--target", json.dumps(ANDROID), "-o",
               str(tmp_path / "cli.tar")])
    assert rc == 0 and set(_elf_machines(tmp_path / "cli.tar").values()) == {183}


def test_android_target_needs_num_cores_and_ndk(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="num-cores"):
        T.resolve_target(json.dumps({k: v for k, v in ANDROID.items() if k != "num-cores"}))
    monkeypatch.setenv(rpc.NDK_ENV, str(tmp_path / "no-such-clang"))
    with pytest.raises(ValueError, match="not an executable"):
        rpc.builder_export(T.resolve_target(json.dumps(ANDROID)))
    gpu = T.resolve_target("qcom/adreno-opencl",
                           '{"kind": "llvm", "mtriple": "aarch64-linux-android"}')
    assert rpc.is_android(gpu) and T._device_type(gpu) == "opencl"


@pytest.mark.skipif(not os.environ.get(rpc.NDK_ENV), reason="TVM_NDK_CC (Android NDK clang) "
                    "is not set on this machine")
def test_android_ndk_shared_library(model_path, tmp_path):
    target = T.resolve_target(json.dumps(ANDROID))
    executable = compile_model(import_onnx(onnx.load(model_path)), target)
    out = rpc.export_library(executable, str(tmp_path / "model.so"), target)
    with open(out, "rb") as handle:
        head = handle.read(20)
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183
    assert rpc.builder_export(target) is rpc.export_ndk


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_tuning_process_resumes(farm2, model_path, tmp_path):
    """The tuning command itself is killed (SIGKILL, with its workers) mid-session; the rerun
    keeps every record written and runs only the missing trials."""
    import subprocess
    import sys

    work_dir = str(tmp_path / "tune")
    cmd = [sys.executable, "-m", "tvm_fusion.cli", "tune", model_path, "--tracker",
           farm2.tracker, "--key", KEY, "--trials", "16", "--trials-per-iter", "4",
           "--work-dir", work_dir, "--profile-db", "none", "--no-progress"]
    env = rpc._env()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            if len(_records(work_dir)) >= 8:
                break
            time.sleep(0.05)
    finally:
        rpc.kill_tree(proc.pid)
    kept = [r for r in _records(work_dir) if r.endswith("]")]
    assert 8 <= len(kept) < 16
    rc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert rc.returncode == 0, rc.stderr[-2000:]
    assert f"{16 - len(kept)} trials this run" in rc.stdout, rc.stdout
    after = _records(work_dir)
    assert after[: len(kept)] == kept and len(after) == 16

"""TVM's CPU thread pool: one thread per physical core, as ONNX Runtime and PyTorch get in bench."""

import os
import subprocess
import sys

import pytest

from tvm_fusion.threads import physical_cores, use_physical_cores

_NUM_THREADS = ("import tvm, tvm_fusion.threads as t; {setup}"
                "print(tvm.get_global_func('runtime.NumThreads')())")


def _runtime_threads(setup: str, env: dict) -> int:
    out = subprocess.run([sys.executable, "-c", _NUM_THREADS.format(setup=setup)], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_physical_cores_counts_each_core_once():
    assert 1 <= physical_cores() <= (os.cpu_count() or 1)


@pytest.mark.slow
def test_runtime_gets_one_thread_per_physical_core():
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    assert _runtime_threads("t.use_physical_cores(); ", env) == physical_cores()


def test_a_users_setting_wins(monkeypatch):
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    assert use_physical_cores() == 1
    assert _runtime_threads("t.use_physical_cores(); ", dict(os.environ)) == 1

"""How many threads TVM's CPU runtime runs, and setting it to the machine's physical cores.

TVM sizes its thread pool as half of ``std::thread::hardware_concurrency()`` on x86-64 (its
``threading_backend.cc``: "ignore hyper-threading") unless ``TVM_NUM_THREADS`` is set. On a
machine without SMT — most cloud VMs, where every vCPU is a core — that is half the cores: on
the 2-core development machine every TVM kernel ran on one thread while ONNX Runtime used two.
The pool is created at the first parallel launch and keeps its size, so the count must be set
before any kernel of the process runs (``runtime.config_threadpool`` cannot raise it).
"""

from __future__ import annotations

import glob
import os


def physical_cores() -> int:
    """Cores, counting SMT siblings once (Linux sysfs topology; ``os.cpu_count()`` elsewhere)."""
    siblings = set()
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list"):
        try:
            with open(path, encoding="ascii") as f:
                siblings.add(f.read().strip())
        except OSError:
            continue
    return len(siblings) or os.cpu_count() or 1


def use_physical_cores() -> int:
    """Set ``TVM_NUM_THREADS`` to the physical cores unless the user set it; returns the count.
    Call before the process runs its first TVM kernel."""
    os.environ.setdefault("TVM_NUM_THREADS", str(physical_cores()))
    return int(os.environ["TVM_NUM_THREADS"])

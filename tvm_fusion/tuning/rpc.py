"""TVM RPC for tuning on phones: tracker and servers, sessions with retries, the right exporter.

A tuning farm is one ``tvm.exec.rpc_tracker`` and any number of ``rpc_server`` processes (or
phones running the C++ ``tvm_rpc`` server / the TVM RPC app) registered under one *key*, such
as ``android``. Clients never talk to a server directly: they ask the tracker for a session
under the key, and the tracker hands out the free servers in its queue (priority first, then
arrival), so several phones under one key share the trials.

This module holds what :mod:`.tune` and the launchers in ``scripts/`` share:

* :func:`parse_tracker`, :func:`tracker_summary`, :func:`count_servers`,
  :func:`check_farm`: reach the tracker, and fail with a one-line ``ValueError`` naming the
  option (``--tracker``, ``--key``) when it is unreachable or has no server under the key;
* :func:`create_session`: a session through the tracker with a timeout and retries; it is the
  ``f_create_session`` of meta_schedule's ``RPCRunner``, so a dead server (its session cannot
  be opened, or dies mid-run) costs one candidate, which meta_schedule records as failed
  (run time 1e10 s), and tuning goes on with the servers left;
* :func:`is_android`, :func:`builder_export`, :func:`export_library`: the NDK's clang
  (``$TVM_NDK_CC``, through :mod:`tvm.support.ndk`) when the target runs on Android, the host
  compiler otherwise; Android without ``TVM_NDK_CC`` is a clear error, never a host ``.so``
  that the phone cannot load;
* :func:`start_tracker`, :func:`start_server`, :func:`kill_tree`, :func:`free_port`: local
  processes for the launchers and the tests. The Python server runs the real server in a
  ``popen_worker`` child; killing only the parent leaves an orphan that keeps the port and
  re-registers, so :func:`kill_tree` kills the children first, by process id.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import tvm

NDK_ENV = "TVM_NDK_CC"
NDK_EXPORT = "s_tir.meta_schedule.builder.export_ndk"  # registered by meta_schedule's builder


# ------------------------------------------------------------------------------- tracker

def parse_tracker(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``; anything else is a ``ValueError`` naming
    ``--tracker``."""
    host, sep, port = (text or "").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--tracker {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9190")
    return host, int(port)


def tracker_summary(host: str, port: int, timeout_s: float = 10.0) -> dict:
    """The tracker's summary (``server_info``, ``queue_info``), or a ``ValueError`` naming
    ``--tracker`` when it cannot be reached within ``timeout_s``."""
    from tvm import rpc

    # ``connect_tracker`` retries for ~60 s on a refused port; probe the socket first.
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as err:
        raise ValueError(f"--tracker {host}:{port}: cannot reach the RPC tracker ({err}); "
                         "start one with scripts/rpc_tracker.py") from None
    try:
        return rpc.connect_tracker(host, port).summary()
    except Exception as err:  # noqa: BLE001 (tvm raises RuntimeError/TVMError/OSError)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"--tracker {host}:{port}: not an RPC tracker ({first})") from None


def count_servers(host: str, port: int, key: str, timeout_s: float = 10.0) -> int:
    """Servers registered under ``key`` (free or busy)."""
    summary = tracker_summary(host, port, timeout_s)
    # server_info lists the registered servers as "server:<key>"; queue_info counts the free
    # ones. A server re-registering after a session is briefly missing from one of the two.
    listed = sum(1 for s in summary.get("server_info", [])
                 if str(s.get("key", "")).split(":", 1)[-1] == key)
    free = int(summary.get("queue_info", {}).get(key, {}).get("free", 0))
    return max(listed, free)


def check_farm(host: str, port: int, key: str, timeout_s: float = 10.0) -> int:
    """The number of servers under ``key``; a ``ValueError`` naming ``--key`` when none."""
    n = 0
    for attempt in range(3):  # a few looks: a server may be between two registrations
        n = max(n, count_servers(host, port, key, timeout_s))
        if attempt < 2:
            time.sleep(0.3)
    if n == 0:
        raise ValueError(f"--key {key!r}: no RPC server is registered under this key at the "
                         f"tracker {host}:{port} (query it: python -m tvm.exec.query_rpc_tracker "
                         f"--host {host} --port {port})")
    return n


def wait_for_servers(host: str, port: int, key: str, n: int, timeout_s: float = 60.0) -> int:
    """Block until ``n`` servers are registered under ``key``; returns the count."""
    deadline = time.monotonic() + timeout_s
    count = 0
    while time.monotonic() < deadline:
        with contextlib.suppress(ValueError):
            count = count_servers(host, port, key, timeout_s=2.0)
            if count >= n:
                return count
        time.sleep(0.3)
    raise TimeoutError(f"only {count} of {n} RPC servers registered under {key!r} at "
                       f"{host}:{port} after {timeout_s:.0f} s")


# ------------------------------------------------------------------------------ sessions

# Retries of ``create_session``; read by the runner's worker processes from the environment so
# that the function stays a plain module-level function (pickled by reference).
RETRIES_ENV = "TVM_FUSION_RPC_RETRIES"


def create_session(rpc_config):
    """``f_create_session`` for meta_schedule's ``RPCRunner``: ask the tracker for a session
    under the key, retrying with back-off (``$TVM_FUSION_RPC_RETRIES``, default 3).

    A server that died after registering is only noticed when its session fails to open; the
    tracker drops it once its connection closes, so a retry is handed another server.
    """
    retries = max(1, int(os.environ.get(RETRIES_ENV, "3")))
    last = None
    for attempt in range(retries):
        try:
            return rpc_config.connect_server()
        except Exception as err:  # noqa: BLE001 (connection errors come in many types)
            last = err
            _log_failure({"stage": "session", "key": rpc_config.tracker_key,
                          "attempt": attempt + 1, "error": _first_line(err)})
            time.sleep(min(0.5 * 2 ** attempt, 4.0))
    raise RuntimeError(f"no RPC session under key {rpc_config.tracker_key!r} after {retries} "
                       f"attempts: {last}")


FAILURES_ENV = "TVM_FUSION_RPC_FAILURES"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def _log_failure(entry: dict) -> None:
    """Append one JSON line to ``$TVM_FUSION_RPC_FAILURES`` (set by :func:`.tune.tune` for
    its runner's worker processes): a session that could not be opened is a server that died
    or vanished, recorded even when a retry on another server saved the candidate."""
    path = os.environ.get(FAILURES_ENV)
    if not path:
        return
    import json

    line = json.dumps({**entry, "at": time.time(), "pid": os.getpid()}) + "\n"
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as handle:
        handle.write(line)


def request_session(host: str, port: int, key: str, timeout_s: float = 60.0,
                    priority: int = 1, retries: int = 3):
    """A session from the tracker (for one-off remote runs: latency of a whole model)."""
    from tvm import rpc

    last = None
    for attempt in range(retries):
        try:
            return rpc.connect_tracker(host, port).request(
                key, priority=priority, session_timeout=timeout_s)
        except Exception as err:  # noqa: BLE001
            last = err
            time.sleep(min(0.5 * 2 ** attempt, 4.0))
    raise RuntimeError(f"no RPC session under key {key!r} at {host}:{port}: {last}")


# ------------------------------------------------------------------------- cross-compiling

def _mtriple(target: tvm.target.Target) -> str:
    for t in (target, target.host):
        if t is not None and t.kind.name == "llvm":
            triple = t.attrs.get("mtriple")
            if triple:
                return str(triple)
    return ""


def is_android(target: tvm.target.Target) -> bool:
    """Whether code for ``target`` (or its host) runs on Android (``mtriple`` ...-android)."""
    return "android" in _mtriple(target)


def is_cross(target: tvm.target.Target) -> bool:
    """Whether ``target``'s code is for another machine than this one (a triple is set that is
    not this machine's architecture)."""
    triple = _mtriple(target)
    if not triple:
        return False
    import platform

    machine = platform.machine().lower().replace("amd64", "x86_64").replace("arm64", "aarch64")
    return not triple.startswith(machine) or "android" in triple


def _require_ndk(what: str) -> str:
    cc = os.environ.get(NDK_ENV)
    if not cc:
        raise ValueError(
            f"--target: {what} runs on Android, which needs the NDK's clang to link a shared "
            f"library: set {NDK_ENV}, e.g. {NDK_ENV}=$NDK/toolchains/llvm/prebuilt/"
            "linux-x86_64/bin/aarch64-linux-android28-clang (docs/android.md)")
    if not (os.path.isfile(cc) and os.access(cc, os.X_OK)):
        raise ValueError(f"{NDK_ENV}={cc}: not an executable file (the NDK's clang)")
    return cc


def build_candidate(mod, target, _params=None):
    """``f_build`` for meta_schedule's ``LocalBuilder``: its default build without importing
    ``tvm.s_tir.tensor_intrin`` first. That import registers every tensor intrinsic by parsing
    TVMScript and takes 20-30 s; the builder's worker processes are single-use, so the default
    pays it on every round. Candidates arrive already scheduled (tensorized blocks included),
    so building them needs no intrinsic registry."""
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target)


def builder_export(target: tvm.target.Target):
    """``f_export`` for meta_schedule's ``LocalBuilder``: ``None`` (its default: a tar of object
    files, linked by the server's own compiler) for this machine or a Linux board with a
    compiler; the NDK export (a ``.so``) for Android, which has no compiler."""
    if is_android(target):
        _require_ndk(str(target))
        return NDK_EXPORT
    return None


def export_library(module, path: str, target: tvm.target.Target) -> str:
    """Export a compiled module (a ``tvm.compile`` result) so the device can load it.

    Android: ``path`` must end in ``.so`` and is linked by the NDK (``$TVM_NDK_CC``), or in
    ``.tar`` (object files, for inspection; no NDK needed). Otherwise the host compiler links
    ``.so`` and ``.tar`` is a tar of objects.
    """
    path = os.fspath(path)
    if path.endswith(".tar"):
        module.export_library(path)
        return path
    if is_android(target):
        _require_ndk(str(target))
        from tvm.support import ndk

        module.export_library(path, fcompile=ndk.create_shared)
        return path
    if is_cross(target):
        raise ValueError(f"--target {target}: cross-compiled for {_mtriple(target)}; export to "
                         "a .tar of objects, or link with that platform's compiler")
    module.export_library(path)
    return path


# ------------------------------------------------------------------------------ processes

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _env() -> dict:
    """The environment of child processes: this package importable (the RPC runner's workers
    unpickle :func:`create_session` by reference)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = env.get("PYTHONPATH", "").split(os.pathsep) if env.get("PYTHONPATH") else []
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


def ensure_importable() -> None:
    """Put this package's root on ``$PYTHONPATH`` of this process, so that worker processes
    started later (meta_schedule's popen pools) can import it."""
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]


def _wait_listening(host: str, port: int, proc: subprocess.Popen, timeout_s: float,
                    what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} at start")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not listen on {host}:{port} within {timeout_s:.0f} s")


def start_tracker(host: str = "127.0.0.1", port: int | None = None, log=None,
                  timeout_s: float = 30.0,
                  probe_host: str | None = None) -> tuple[subprocess.Popen, int]:
    """Start ``python -m tvm.exec.rpc_tracker`` on exactly ``port`` (a free one if ``None``);
    returns the process and the port once it listens."""
    port = port or free_port(host)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", host, "--port", str(port),
         "--port-end", str(port + 1)],
        env=_env(), stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        _wait_listening(probe_host or host, port, proc, timeout_s, "rpc_tracker")
    except BaseException:
        kill_tree(proc.pid)
        raise
    return proc, port


def start_server(tracker: str, key: str, host: str = "127.0.0.1", port: int | None = None,
                 log=None, timeout_s: float = 30.0) -> tuple[subprocess.Popen, int]:
    """Start ``python -m tvm.exec.rpc_server`` registered at ``tracker`` (``HOST:PORT``) under
    ``key``; returns the process and its port once it listens."""
    parse_tracker(tracker)
    port = port or free_port(host)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tvm.exec.rpc_server", "--host", host, "--port", str(port),
         "--port-end", str(port + 1), "--tracker", tracker, "--key", key],
        env=_env(), stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        _wait_listening(host, port, proc, timeout_s, f"rpc_server ({key})")
    except BaseException:
        kill_tree(proc.pid)
        raise
    return proc, port


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (deepest last)."""
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 (gone already, or no psutil)
        try:
            out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
        except OSError:
            return []
        kids = [int(x) for x in out.stdout.split()]
        return kids + [g for k in kids for g in children(k)]


def kill_tree(pid: int, sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> None:
    """Kill ``pid`` and all its descendants, by process id (children first, so none is
    orphaned and re-registers), then reap ``pid`` if it is our child."""
    for child in reversed(children(pid)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child: wait until it is gone
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            done = 0
        if done:
            return
        time.sleep(0.05)


def serve_until_signal(proc: subprocess.Popen) -> int:
    """Wait for ``proc`` (a tracker or server started here); on Ctrl-C or SIGTERM (raised as
    ``KeyboardInterrupt``) kill it and its children. Returns its exit code (0 when stopped)."""
    try:
        return proc.wait()
    except KeyboardInterrupt:
        kill_tree(proc.pid, signal.SIGTERM, timeout_s=3.0)
        kill_tree(proc.pid)
        return 0

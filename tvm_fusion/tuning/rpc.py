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
  that the phone cannot load; :func:`library_suffix` says which file a target's build is;
* :func:`root_cause`: the line of a remote or worker traceback that says what went wrong
  (meta_schedule's messages start with "RPCRunner: An exception occurred");
* :func:`start_tracker`, :func:`start_server`, :func:`kill_tree`, :func:`free_port`: local
  processes for the launchers and the tests. The Python server runs the real server in a
  ``popen_worker`` child; killing only the parent leaves an orphan that keeps the port and
  re-registers, so :func:`kill_tree` kills the children first, by process id.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import tvm
from tvm import rpc
from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
from tvm.support import cc as tvm_cc
from tvm.support import ndk

NDK_ENV = "TVM_NDK_CC"


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
    # ``connect_tracker`` retries for ~60 s on a refused port; probe the socket first.
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as err:
        raise ValueError(f"--tracker {host}:{port}: cannot reach the RPC tracker ({err}); "
                         "start one with `python -m tvm.exec.rpc_tracker --port "
                         f"{port}`, or tune with --local") from None
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


EMPTY_KEY_PATIENCE_S = 5.0  # how long check_farm looks for a server before saying none


def check_farm(host: str, port: int, key: str, timeout_s: float = 10.0) -> int:
    """The number of servers under ``key``; a ``ValueError`` naming ``--key`` when none."""
    # Several looks: a server may be between two registrations (TVM's server puts a new match
    # key after each session, and 4 s after a client took its key without connecting), which
    # a loaded machine stretches; with none seen, keep looking before calling the key empty.
    n, looks, deadline = 0, 0, time.monotonic() + EMPTY_KEY_PATIENCE_S
    while looks < 3 or (n == 0 and time.monotonic() < deadline):
        n = max(n, count_servers(host, port, key, timeout_s))
        looks += 1
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
    tracker drops it once its connection closes, so a retry is handed another server. Each
    attempt asks the tracker once (``max_retry=1``): TVM's own silent retries would hide the
    dead server from ``failures.jsonl``.
    """
    retries = max(1, int(os.environ.get(RETRIES_ENV, "3")))
    last = None
    for attempt in range(retries):
        try:
            return rpc_config.connect_tracker().request(
                key=rpc_config.tracker_key, priority=rpc_config.session_priority,
                session_timeout=rpc_config.session_timeout_sec, max_retry=1)
        except Exception as err:  # noqa: BLE001 (connection errors come in many types)
            last = err
            _log_failure({"stage": "session", "key": rpc_config.tracker_key,
                          "attempt": attempt + 1, "cause": root_cause(err),
                          "error": whole_error(err)})
            time.sleep(min(0.5 * 2 ** attempt, 4.0))
    raise RuntimeError(f"no RPC session under key {rpc_config.tracker_key!r} after {retries} "
                       f"attempts: {last}")


FAILURES_ENV = "TVM_FUSION_RPC_FAILURES"


MAX_ERROR_CHARS = 20000  # a whole remote traceback, with the compiler's output; not a log


def whole_error(err) -> str:
    """The whole text of an error (an exception or a message), capped at 20,000 characters
    (the end kept: the cause is last)."""
    text = (str(err) if not isinstance(err, BaseException) else
            (str(err).strip() or type(err).__name__)).strip()
    return text if len(text) <= MAX_ERROR_CHARS else "..." + text[-MAX_ERROR_CHARS:]


_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(?:\w*Error|\w*Exception|TVMError|Check failed)"
                         r"\b[^\n]*")
_NOISE = ("Traceback (most recent call last)", "RPCRunner: An exception occurred",
          "LocalBuilder: An exception occurred", "LocalRunner: An exception occurred",
          "During handling of the above exception", "The above exception was the direct")


def root_cause(err, limit: int = 400) -> str:
    """One line that says what went wrong in ``err`` (an exception or its text).

    meta_schedule reports a failed candidate as ``RPCRunner: An exception occurred`` followed
    by the remote traceback; the cause is the *last* ``SomeError: ...`` line (with the lines
    that continue it, e.g. a compiler's output), not the first line."""
    text = whole_error(err)
    lines = [ln.rstrip() for ln in text.splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if _ERROR_LINE.match(lines[i]) and not lines[i].lstrip().startswith("File "):
            parts = [lines[i].strip()]
            for ln in lines[i + 1:]:  # what continues the message (a compiler's output)
                ln = ln.strip()
                if ln.startswith(("File ", "Traceback")):
                    break
                if ln and ln not in parts:
                    parts.append(ln)
            cause = " ".join(parts)
            return cause if len(cause) <= limit else cause[:limit - 3] + "..."
    useful = [ln.strip() for ln in lines
              if ln.strip() and not ln.strip().startswith(_NOISE)
              and not ln.lstrip().startswith("File ")]
    return (useful[-1] if useful else (lines[0].strip() if lines else "error"))[:limit]


def _log_failure(entry: dict) -> None:
    """Append one JSON line to ``$TVM_FUSION_RPC_FAILURES`` (set by :func:`.tune.tune` for
    its runner's worker processes): a session that could not be opened is a server that died
    or vanished, recorded even when a retry on another server saved the candidate."""
    path = os.environ.get(FAILURES_ENV)
    if not path:
        return
    line = json.dumps({**entry, "at": time.time(), "pid": os.getpid()}) + "\n"
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as handle:
        handle.write(line)


def request_session(host: str, port: int, key: str, timeout_s: float = 60.0,
                    priority: int = 1, retries: int = 3):
    """A session from the tracker (for one-off remote runs: latency of a whole model)."""
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
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target)


def export_ndk(mod) -> str:
    """``f_export`` for Android: link the candidate into a ``.so`` with ``$TVM_NDK_CC``.

    A module-level function, so that meta_schedule's builder workers unpickle it by reference
    (this package is on their ``$PYTHONPATH``, :func:`ensure_importable`). The name
    ``s_tir.meta_schedule.builder.export_ndk`` would not do: ``tvm.support.ndk`` registers it
    only in processes that import that module, and the builder's workers do not."""
    path = os.path.join(tempfile.mkdtemp(), "tvm_tmp_mod.so")
    mod.export_library(path, fcompile=ndk.create_shared)
    return path


def builder_export(target: tvm.target.Target):
    """``f_export`` for meta_schedule's ``LocalBuilder``: ``None`` (its default: a tar of object
    files, linked by the server's own compiler) for this machine or a Linux board with a
    compiler; :func:`export_ndk` (a ``.so``) for Android, which has no compiler."""
    if is_android(target):
        _require_ndk(str(target))
        return export_ndk
    return None


def cross_cxx(target: tvm.target.Target) -> str | None:
    """The cross C++ compiler for a Linux ``target`` of another machine, when installed here
    (``<mtriple>-g++``, e.g. Debian's ``g++-aarch64-linux-gnu``)."""
    triple = _mtriple(target)
    return shutil.which(f"{triple}-g++") if triple and not is_android(target) else None


def library_suffix(target: tvm.target.Target) -> str:
    """The file a build for ``target`` is exported to: ``.so`` for this machine and for Android
    (linked by ``$TVM_NDK_CC``), ``.tar`` of objects for another Linux machine (linked there
    by the RPC server's compiler: this machine has no linker for it)."""
    return ".tar" if is_cross(target) and not is_android(target) else ".so"


def export_library(module, path: str, target: tvm.target.Target) -> str:
    """Export a compiled module (a ``tvm.compile`` result) so the device can load it.

    Android: ``path`` must end in ``.so`` and is linked by the NDK (``$TVM_NDK_CC``), or in
    ``.tar`` (object files, for inspection; no NDK needed). Another Linux machine: ``.tar``,
    or ``.so`` linked by that triple's cross compiler (``aarch64-linux-gnu-g++``) when it is
    installed here. Otherwise the host compiler links ``.so`` and ``.tar`` is a tar of objects.
    """
    path = os.fspath(path)
    if path.endswith(".tar"):
        module.export_library(path)
        return path
    if is_android(target):
        _require_ndk(str(target))
        module.export_library(path, fcompile=ndk.create_shared)
        return path
    if is_cross(target):
        cross = cross_cxx(target)
        if cross is None:
            raise ValueError(f"--target {target}: cross-compiled for {_mtriple(target)}; "
                             f"export to a .tar of objects, or install that platform's "
                             f"compiler ({_mtriple(target)}-g++) to link a .so")
        module.export_library(path, fcompile=tvm_cc.cross_compiler(cross))
        return path
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
                 log=None, timeout_s: float = 30.0, python: list[str] | None = None,
                 env: dict | None = None,
                 extra_args: list[str] | None = None) -> tuple[subprocess.Popen, int]:
    """Start ``python -m tvm.exec.rpc_server`` registered at ``tracker`` (``HOST:PORT``) under
    ``key``; returns the process and its port once it listens.

    ``python`` (a command, default this interpreter), ``env`` and ``extra_args`` start another
    Python's server, e.g. an emulated AArch64 one (``scripts/arm64_device.py``): it starts in
    tens of seconds, hence its own ``timeout_s``."""
    parse_tracker(tracker)
    port = port or free_port(host)
    proc = subprocess.Popen(
        [*(python or [sys.executable]), "-m", "tvm.exec.rpc_server", "--host", host,
         "--port", str(port), "--port-end", str(port + 1), "--tracker", tracker,
         "--key", key, *(extra_args or [])],
        env=_env() if env is None else env, stdout=log or subprocess.DEVNULL,
        stderr=subprocess.STDOUT, start_new_session=True)
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


@contextlib.contextmanager
def local_farm(key: str, servers: int = 1, timeout_s: float = 60.0):
    """A tracker and ``servers`` servers of this machine on 127.0.0.1 (free ports) for
    ``tvm-fusion tune --local``; yields the tracker's ``HOST:PORT`` and kills them all, by
    process id, on the way out (an error or Ctrl-C included)."""
    procs = []
    try:
        tracker_proc, port = start_tracker("127.0.0.1", timeout_s=timeout_s)
        procs.append(tracker_proc)
        tracker = f"127.0.0.1:{port}"
        for _ in range(servers):
            procs.append(start_server(tracker, key, timeout_s=timeout_s)[0])
        wait_for_servers("127.0.0.1", port, key, servers, timeout_s=timeout_s)
        yield tracker
    finally:
        for proc in reversed(procs):
            kill_tree(proc.pid)


def serve_until_signal(proc: subprocess.Popen) -> int:
    """Wait for ``proc`` (a tracker or server started here); on Ctrl-C or SIGTERM (raised as
    ``KeyboardInterrupt``) kill it and its children. Returns its exit code (0 when stopped)."""
    try:
        return proc.wait()
    except KeyboardInterrupt:
        kill_tree(proc.pid, signal.SIGTERM, timeout_s=3.0)
        kill_tree(proc.pid)
        return 0

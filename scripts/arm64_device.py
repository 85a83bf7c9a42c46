#!/usr/bin/env python
"""An emulated AArch64 device for TVM RPC: a real ``tvm.exec.rpc_server`` in an AArch64 Python.

    python scripts/arm64_device.py setup                  # once; cached, ~2 min and ~400 MB
    python scripts/arm64_device.py start --key android    # tracker + server on 127.0.0.1
    python scripts/arm64_device.py stop                   # both, by process id

Why: the project's users tune and run on arm64 phones, and the AArch64 code tvm_fusion emits
must run somewhere in CI, which has no phone. ``qemu-aarch64-static`` runs an AArch64 Debian
Python (from ``debootstrap --foreign``, each ``.deb`` unpacked with ``dpkg -x``: no binfmt, no
chroot, nothing AArch64 executed at setup) with the AArch64 wheels of apache-tvm and
apache-tvm-ffi, and in it TVM's own RPC server, registered at a tracker under a key exactly as a
phone's server is. Emulation is 35-100x slower than a phone and its timings do not rank
schedules: it checks correctness and the flow, never speed (docs/android.md).

Needs Debian's ``qemu-user-static``, ``g++-aarch64-linux-gnu``, ``debootstrap`` (``.ci/run``
installs them), root (or sudo) for the debootstrap step, and, at setup only, Debian's archive
and the Python package index. Everything lives under ``$TVM_FUSION_ARM64_CACHE`` (default
``~/.cache/tvm_fusion/arm64``); ``setup`` does only what is missing, so a second run is instant.

What each less obvious part is for:

* ``qemu-aarch64-static -L SYSROOT -0 LAUNCHER``: TVM's server re-executes ``sys.executable``
  for its worker; ``-0`` makes that path the launcher, so the worker goes through qemu again;
* ``--load-library .../libtvm_runtime_extra.so``: meta_schedule's ``random_fill_for_measure``
  lives there; without it every tuning trial fails on the device;
* ``CXX=aarch64-linux-gnu-g++``: a ``.tar`` upload (meta_schedule's export for a Linux target)
  is linked on the device by ``get_cc()``; the emulated process runs the host's cross g++.

Tests use :class:`Device` (fixtures ``arm64``, ``arm64_device`` in ``tests/conftest.py``) and
skip, with the reason, when :func:`unavailable` says why the device cannot be had.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_fusion.tuning import rpc  # noqa: E402

CACHE_ENV = "TVM_FUSION_ARM64_CACHE"
QEMU = "qemu-aarch64-static"
CXX = "aarch64-linux-gnu-g++"
SUITE = "bookworm"  # Python 3.11, glibc 2.36
PY = "usr/bin/python3.11"
SITE = "/opt/tvm-site"  # inside the sysroot
WHEELS = ("apache-tvm[rpc]==0.27.0.post1", "apache-tvm-ffi==0.1.14.post0")
EXTRA_LIB = f"{SITE}/tvm/lib/libtvm_runtime_extra.so"
READY = "ready"
START_TIMEOUT_S = 240.0  # an emulated Python importing tvm takes tens of seconds on 2 cores


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tvm_fusion" / "arm64")


def missing_tools(for_setup: bool = False) -> list[str]:
    """The host commands this device needs and this machine lacks (``debootstrap`` and
    ``dpkg`` only to set it up)."""
    tools = [QEMU, CXX] + (["debootstrap", "dpkg"] if for_setup else [])
    return [t for t in tools if shutil.which(t) is None]


def is_ready(cache: Path | None = None) -> bool:
    cache = cache or cache_dir()
    return (cache / READY).is_file() and (cache / "python-arm64").is_file()


def unavailable(cache: Path | None = None) -> str | None:
    """Why the device cannot be started here (a reason for ``pytest.skip``), or ``None``."""
    cache = cache or cache_dir()
    missing = missing_tools(for_setup=not is_ready(cache))
    if missing:
        return (f"the emulated AArch64 device needs {', '.join(missing)} (Debian: apt-get "
                "install qemu-user-static g++-aarch64-linux-gnu debootstrap; see .ci/run)")
    if not is_ready(cache) and os.geteuid() != 0 and shutil.which("sudo") is None:
        return "setting up the emulated AArch64 device needs root or sudo (debootstrap)"
    return None


def _say(log, text: str) -> None:
    if log is not None:
        print(f"[arm64 {time.strftime('%H:%M:%S')}] {text}", file=log, flush=True)


def _mirror() -> str:
    """The Debian archive this machine's apt uses (``$MIRROR`` overrides)."""
    if os.environ.get("MIRROR"):
        return os.environ["MIRROR"]
    sources = sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    for path in sources:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    legacy = Path("/etc/apt/sources.list")
    if legacy.is_file():
        for line in legacy.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) > 1 and parts[0] == "deb":
                return parts[1]
    return "http://deb.debian.org/debian"


def _root_cmd(cmd: list[str]) -> list[str]:
    return cmd if os.geteuid() == 0 else ["sudo", *cmd]


def device_env(cache: Path) -> dict:
    """The emulated process's whole environment (nothing of the host's Python leaks in)."""
    return {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
            "PYTHONPATH": SITE, "TVM_USE_RUNTIME_LIB": "1", "CXX": f"/usr/bin/{CXX}",
            "LC_ALL": "C.UTF-8"}


def setup(cache: Path | None = None, log=sys.stderr) -> Path:
    """Set the device up under ``cache`` (only the missing parts); returns the launcher.

    Raises ``RuntimeError`` with one line naming the failed step."""
    cache = cache or cache_dir()
    if is_ready(cache):
        return cache / "python-arm64"
    missing = missing_tools(for_setup=True)
    if missing:
        raise RuntimeError(f"arm64 setup: missing {', '.join(missing)} (apt-get install "
                           "qemu-user-static g++-aarch64-linux-gnu debootstrap)")
    cache.mkdir(parents=True, exist_ok=True)
    sysroot = cache / "sysroot"
    if not (sysroot / PY).exists():
        _say(log, f"AArch64 Debian {SUITE} userland with python3 (debootstrap --foreign)")
        tmp = cache / "sysroot.partial"
        subprocess.run(_root_cmd(["rm", "-rf", str(tmp)]), check=True)
        script = (f'set -e; debootstrap --arch=arm64 --foreign --variant=minbase '
                  f'--include=python3 {SUITE} "{tmp}" "{_mirror()}" >"{cache}/debootstrap.log" '
                  f'2>&1; for d in "{tmp}"/var/cache/apt/archives/*.deb; do dpkg -x "$d" '
                  f'"{tmp}"; done; rm -f "{tmp}"/var/cache/apt/archives/*.deb; '
                  f'mv "{tmp}" "{sysroot}"')
        done = subprocess.run(_root_cmd(["sh", "-c", script]))
        if done.returncode:
            raise RuntimeError(f"arm64 setup: debootstrap failed (exit {done.returncode}); "
                               f"see {cache}/debootstrap.log")
    site = sysroot / SITE.lstrip("/")
    if not (site / "tvm" / "__init__.py").exists():
        _say(log, "AArch64 wheels of apache-tvm and apache-tvm-ffi (the host's pip)")
        tmp = cache / "site.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--only-binary=:all:",
               "--implementation", "cp", "--python-version", "3.11", "--abi", "cp311",
               "--platform", "manylinux_2_28_aarch64", "--platform", "manylinux2014_aarch64",
               "--target", str(tmp), *WHEELS]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            raise RuntimeError(f"arm64 setup: pip could not fetch the AArch64 wheels: {last}")
        # The server runs runtime-only (TVM_USE_RUNTIME_LIB=1): the 240 MB compiler library
        # is dead weight on the device.
        (tmp / "tvm" / "lib" / "libtvm_compiler.so").unlink(missing_ok=True)
        subprocess.run(_root_cmd(["mkdir", "-p", str(site.parent)]), check=True)
        subprocess.run(_root_cmd(["rm", "-rf", str(site)]), check=True)
        subprocess.run(_root_cmd(["mv", str(tmp), str(site)]), check=True)
    launcher = cache / "python-arm64"
    launcher.write_text(f'#!/bin/sh\nexec {shutil.which(QEMU)} -L "{sysroot}" -0 "$0" '
                        f'"{sysroot / PY}" "$@"\n')
    launcher.chmod(0o755)
    _say(log, "checking: import tvm in the emulated Python")
    check = subprocess.run(
        [str(launcher), "-c", "import platform, tvm; print(platform.machine(), tvm.__version__)"],
        env=device_env(cache), capture_output=True, text=True, timeout=600)
    if check.returncode or "aarch64" not in check.stdout:
        last = (check.stderr.strip().splitlines() or [check.stdout.strip() or "?"])[-1]
        raise RuntimeError(f"arm64 setup: the emulated Python cannot import tvm: {last}")
    (cache / READY).write_text(check.stdout)
    _say(log, f"ready: {check.stdout.strip()} under {cache}")
    return launcher


def start_server(tracker: str, key: str, cache: Path | None = None, log=None,
                 timeout_s: float = START_TIMEOUT_S):
    """One emulated RPC server registered at ``tracker`` under ``key``: ``(process, port)``."""
    cache = cache or cache_dir()
    launcher = setup(cache)
    return rpc.start_server(tracker, key, python=[str(launcher)], env=device_env(cache),
                            extra_args=["--load-library", EXTRA_LIB], log=log,
                            timeout_s=timeout_s)


class Device:
    """A tracker on 127.0.0.1 and ``servers`` emulated AArch64 servers under ``key``, all
    started here; :meth:`close` kills every one by process id (children first)."""

    def __init__(self, key: str = "android", servers: int = 1, cache: Path | None = None,
                 log=None):
        self.cache = cache or cache_dir()
        self.key = key
        self.log = log
        setup(self.cache, log=sys.stderr)
        self.tracker_proc, self.port = rpc.start_tracker("127.0.0.1", log=log)
        self.tracker = f"127.0.0.1:{self.port}"
        self.servers: list = []
        try:
            for _ in range(servers):
                self.add_server(wait=False)
            rpc.wait_for_servers("127.0.0.1", self.port, key, servers,
                                 timeout_s=START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def add_server(self, wait: bool = True):
        proc, _port = start_server(self.tracker, self.key, self.cache, log=self.log)
        self.servers.append(proc)
        if wait:
            rpc.wait_for_servers("127.0.0.1", self.port, self.key, len(self.alive()),
                                 timeout_s=START_TIMEOUT_S)
        return proc

    def alive(self) -> list:
        return [p for p in self.servers if p.poll() is None]

    def pids(self) -> list[int]:
        return [self.tracker_proc.pid, *(p.pid for p in self.servers)]

    def close(self) -> None:
        for proc in reversed(self.servers):
            rpc.kill_tree(proc.pid)
        rpc.kill_tree(self.tracker_proc.pid)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------- the command

def _pid_file(cache: Path) -> Path:
    return cache / "running.pids"


def _cmd_start(args) -> int:
    cache = cache_dir()
    if _pid_file(cache).exists():
        print(f"arm64_device: already started ({_pid_file(cache)}); stop it first",
              file=sys.stderr)
        return 2
    log = open(cache / "device.log", "ab")  # noqa: SIM115 (the processes outlive us)
    dev = Device(key=args.key, servers=args.servers, cache=cache, log=log)
    _pid_file(cache).write_text("\n".join(str(p) for p in dev.pids()) + "\n")
    print(f"arm64_device: {args.servers} emulated AArch64 server(s) under key {args.key!r} at "
          f"tracker {dev.tracker} (pids in {_pid_file(cache)}; log {cache / 'device.log'})")
    print(f"TRACKER={dev.tracker}")
    return 0


def _cmd_stop(_args) -> int:
    path = _pid_file(cache_dir())
    if not path.exists():
        print("arm64_device: nothing started")
        return 0
    for pid in reversed([int(x) for x in path.read_text().split()]):
        rpc.kill_tree(pid)
    path.unlink()
    print("arm64_device: stopped")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup", help="set the device up (cached; only what is missing)")
    start = sub.add_parser("start", help="start a tracker and servers (they keep running)")
    start.add_argument("--key", default="android")
    start.add_argument("--servers", type=int, default=1)
    sub.add_parser("stop", help="stop what start started, by process id")
    sub.add_parser("status", help="say whether the device is set up, and if not, why")
    args = parser.parse_args(argv)
    try:
        if args.command == "setup":
            setup()
            return 0
        if args.command == "start":
            return _cmd_start(args)
        if args.command == "stop":
            return _cmd_stop(args)
        reason = unavailable()
        print(f"arm64_device: {'ready' if is_ready() else 'not set up'}"
              + (f"; {reason}" if reason else ""))
        return 0 if reason is None else 1
    except (RuntimeError, TimeoutError, ValueError) as err:
        print(f"arm64_device: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""Run fuzz cases in a child process with a time limit.

A compile that hangs (issue 17 item 4: chained Tanh grows exponentially) or kills its process
must cost one case, not the run. The child is started once (``spawn``: TVM's thread pool does
not survive ``fork``) and reused; it reports each stage before starting it, so when the parent
kills it at the deadline, or finds it dead, it knows whether the reference, stock TVM or
tvm_fusion was running: only the last is our ``timeout``/``crash``, the others are ``skipped``.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import time

import onnx

from .differential import Case, Outcome


def _child(conn, log_path: str | None, checker: str) -> None:
    # TVM and ONNX Runtime print warnings per case from C++: send them to the log (or away)
    # instead of over the progress bar.
    fd = os.open(log_path or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    module, _, func = checker.partition(":")
    check_case = getattr(importlib.import_module(module), func)

    while True:
        job = conn.recv()
        if job is None:
            return
        fields, model_bytes = job
        case = Case(model=onnx.load_from_string(model_bytes), **fields)
        outcome = check_case(case, on_stage=lambda s: conn.send(("stage", s)))
        conn.send(("done", outcome))


class Worker:
    """One reusable child process; :meth:`check` classifies a case within ``timeout`` s."""

    def __init__(self, timeout: float = 60.0, log_path: str | None = None,
                 checker: str = "tvm_fusion.fuzz.differential:check_case"):
        """``checker`` ("module:function", imported in the child) classifies a case; tests
        substitute one that hangs or dies."""
        self.timeout = timeout
        self.log_path = log_path
        self.checker = checker
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._conn = None

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(
            target=_child, args=(child, self.log_path, self.checker), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent

    def _kill(self) -> None:
        if self._proc is not None and self._proc.pid is not None:
            self._proc.kill()  # our own child, by its handle
            self._proc.join(5)
        self._proc = self._conn = None

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
                self._proc.join(5)
            except (OSError, BrokenPipeError):
                pass
        self._kill()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check(self, case: Case, timeout: float | None = None) -> Outcome:
        limit = self.timeout if timeout is None else timeout
        if self._proc is None or not self._proc.is_alive():
            self._start()
        fields = {f: getattr(case, f) for f in
                  ("seed", "options", "special", "target", "symbolic", "shapes")}
        start = time.perf_counter()
        self._conn.send((fields, case.model.SerializeToString()))
        stage = "start"
        deadline = start + limit + 30.0  # grace for the child's first TVM import
        ours_deadline = None
        while True:
            remaining = (ours_deadline or deadline) - time.perf_counter()
            if remaining <= 0:
                self._kill()
                cls = "timeout" if stage == "ours" else "skipped"
                return Outcome(cls, stage, f"{stage} took longer than {limit:g} s",
                               seconds=round(time.perf_counter() - start, 3))
            message = None
            if self._conn.poll(min(1.0, remaining)):
                try:
                    message = self._conn.recv()
                except (EOFError, OSError):
                    message = None
            if message is None:
                if self._proc.is_alive():
                    continue
                code = self._proc.exitcode
                self._kill()
                cls = "crash" if stage == "ours" else "skipped"
                return Outcome(cls, stage, f"process died (exit code {code}) in {stage}",
                               seconds=round(time.perf_counter() - start, 3))
            kind, value = message
            if kind == "stage":
                stage = value
                if stage == "reference":
                    deadline = time.perf_counter() + 2 * limit  # reference + stock
                if stage in ("ours", "memory"):  # memory: check_case_memory's measurement
                    ours_deadline = time.perf_counter() + limit
            else:
                return value

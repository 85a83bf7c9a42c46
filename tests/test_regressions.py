"""Every model the fuzzer kept (tests/regressions/*.onnx) through the differential check.

Each ``NAME.onnx`` has a sidecar ``NAME.json`` (written by :func:`tvm_fusion.fuzz.store.save_case`)
with the seed that gives its input values, the options, whether edge values are on, the failure
it was kept for, and ``cause``. A sidecar with ``"xfail": true`` is a bug not fixed yet: the test
is an xfail naming the cause while the case fails; once fixed it passes: drop the flag then,
so that a relapse fails. ``"timeout_s"`` bounds a case kept for a compile-time blow-up.
``"no_fallback": true`` marks a case kept because a schedule failed and fell back to plain
loops (right values, slow kernels): it must schedule without a ``ScheduleFailedWarning``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tvm_fusion.fuzz.store import load_case
from tvm_fusion.fuzz.worker import Worker

REGRESSIONS = Path(__file__).parent / "regressions"
MODELS = sorted(p for p in REGRESSIONS.glob("*.onnx") if not p.name.endswith(".orig.onnx"))


@pytest.fixture(scope="module")
def worker():
    with Worker(timeout=60.0) as w:
        yield w


@pytest.mark.parametrize("path", MODELS, ids=[p.stem for p in MODELS])
def test_regression(path, worker):
    case, side = load_case(path)
    outcome = worker.check(case, timeout=side.get("timeout_s"))  # a hang costs timeout_s
    if side.get("xfail") and outcome.cls != "ok":
        pytest.xfail(f"{side.get('cause', 'unknown cause')} ({outcome.cls}: {outcome.error})")
    assert outcome.cls == "ok", (
        f"{path.name}: {outcome.cls} ({outcome.stage}): {outcome.error}; kept for "
        f"{side.get('class')}: {side.get('cause')}")
    if side.get("no_fallback"):
        assert not outcome.fallbacks, f"{path.name}: {outcome.fallbacks}; kept for: {side['cause']}"


def test_every_regression_has_a_sidecar_with_a_cause():
    for path in MODELS:
        _, side = load_case(path)
        assert side.get("cause"), f"{path.name}: sidecar names no cause"

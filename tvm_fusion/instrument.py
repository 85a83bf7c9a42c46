"""What the passes produce, collected by a ``PassInstrument`` rather than lists passed in.

A pass that has a result worth keeping for a report (a plan, rewrite statistics, SmartMem's
record, texture decisions) hands it to :func:`emit`; every :class:`Collector` whose
``PassContext`` is active receives it::

    collector = Collector()
    with tvm.transform.PassContext(instruments=[collector]):
        mod = tvm_fusion.transform.Sequential(target)(mod)
    (plan,) = collector.plans

TVM 0.27 gives back a new handle, not the Python object, from
``PassContext.current().instruments``, so a collector registers itself when its context is
entered (``enter_pass_ctx``) and leaves when it exits. Active collectors are per thread, as
TVM's ``PassContext`` is; a collector stays active inside nested contexts (``tvm.compile``'s
own included) until its own context exits.
"""

from __future__ import annotations

import threading
from typing import Any

import tvm

__all__ = ["Collector", "emit"]

_ACTIVE = threading.local()


@tvm.ir.instrument.pass_instrument
class Collector:
    """The results of the passes run while its ``PassContext`` is active, in run order.

    Attributes
    ----------
    plans
        A ``ModulePlan`` per ``PlanFusion`` run (an ``ApolloModulePlan``, with the feedback
        events, per ``ApolloFuse`` run).
    rewrite_stats
        A ``RewriteStats`` per ``RewriteByMathProperties`` run.
    layout_blocks
        A SmartMem ``BlockRecord`` per dataflow block ``EliminateLayoutTransforms`` saw.
    texture_decisions
        A ``TextureDecision`` per candidate tensor of ``AnnotateTextureScopes``.
    """

    KINDS = ("plans", "rewrite_stats", "layout_blocks", "texture_decisions")

    def __init__(self):
        self.plans: list = []
        self.rewrite_stats: list = []
        self.layout_blocks: list = []
        self.texture_decisions: list = []

    def enter_pass_ctx(self):
        _active().append(self)

    def exit_pass_ctx(self):
        active = _active()
        del active[max(i for i, c in enumerate(active) if c is self)]


def _active() -> list:
    if not hasattr(_ACTIVE, "collectors"):
        _ACTIVE.collectors = []
    return _ACTIVE.collectors


def emit(kind: str, result: Any) -> None:
    """Give ``result`` to every active collector, under ``kind`` (one of
    :attr:`Collector.KINDS`); without one it is dropped."""
    if kind not in Collector.KINDS:
        raise ValueError(f"unknown result kind {kind!r}; expected one of {Collector.KINDS}")
    for collector in {id(c): c for c in _active()}.values():  # in two nested contexts: once
        getattr(collector, kind).append(result)

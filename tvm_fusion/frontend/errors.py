"""What cannot be imported: one line naming the node and the reason."""

from __future__ import annotations

import re

__all__ = ["FrontendError", "reason_of"]


class FrontendError(ValueError):
    """A model node that could not be imported. ``str()`` is one line: the node (ONNX node or
    FX node, with its operator) and the reason, never a C++ traceback."""

    def __init__(self, where: str, reason: str):
        self.where, self.reason = where, reason
        super().__init__(f"{where}: {reason}")


_CHECK = re.compile(r"Check failed: (?:\(.*?\) is false: )?(.*)")


def reason_of(err: BaseException) -> str:
    """The reason in an exception's message, as one line.

    TVM's C++ errors carry a traceback and ``Check failed: (cond) is false: message``; the
    message is what a user can act on. Python errors keep their first line."""
    text = str(err).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    for line in reversed(lines):
        match = _CHECK.search(line)
        if match:
            return match.group(1).strip()[:300] or line[:300]
    if lines[0].startswith("Traceback"):
        return lines[-1][:300]
    return lines[0][:300]

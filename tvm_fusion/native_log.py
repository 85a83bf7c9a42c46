"""Keep TVM's native log lines that say nothing to a user out of our output.

TVM logs from C++ straight to the process's stderr (fd 2), out of reach of Python's
``warnings`` and ``logging``. One such line is topi ``take``'s ``Warning: Fast mode segfaults
when there are out-of-bounds indices``: TVM's ONNX importer builds every Gather as
``take(mode="fast")`` (after normalising negative indices), and legalising it logs the line once
per Gather, so BERT-base's report opened with 19 copies of it. ``filtered_stderr`` captures fd 2
around a native call and replays every other line, so a warning that matters still shows.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

# (pattern, why it says nothing to the user)
NOISE = [
    # the importer's choice, not the user's; the indices are normalised by the importer
    re.compile(r"Fast mode segfaults when there are out-of-bounds indices"),
]


# every line: for native objects dropped after a failure we already report in one line
EVERYTHING = [re.compile("")]


@contextlib.contextmanager
def filtered_stderr(noise=NOISE):
    """Capture fd 2 for the block; afterwards write back the lines no ``noise`` pattern
    matches (also when the block raises)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        try:
            os.dup2(capture.fileno(), 2)
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().decode(errors="replace").splitlines(True)
                    if not any(p.search(line) for p in noise)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()

"""Differential fuzzing of tvm_fusion against stock TVM and ONNX Runtime (issue 17).

One job per module:

* :mod:`.generate` draws a random ONNX graph, its option set and its input-value mode from a
  seed (so a seed alone reproduces a case);
* :mod:`.feeds` builds the inputs of a case, with NaN/inf/denormal/large values on a share;
* :mod:`.differential` compiles and runs one case three ways and classifies it
  (ok / wrong / crash / timeout / skipped);
* :mod:`.worker` runs cases in a child process with a time limit, so a compile that hangs or
  dies is classified instead of stalling the run;
* :mod:`.minimise` delta-debugs a failing case down to the nodes, options and values that matter;
* :mod:`.store` writes cases, minimised models and their JSON sidecars atomically.

Production code must not import this package: it exists for tests and ``scripts/fuzz.py``.
"""

from .differential import CLASSES, Case, Outcome, check_case
from .generate import draw_case, draw_options, generate_model

__all__ = ["CLASSES", "Case", "Outcome", "check_case", "draw_case", "draw_options",
           "generate_model"]

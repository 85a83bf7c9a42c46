"""Inputs for a fuzz case: ordinary values, and IEEE edge values on a share of the cases.

Each input's values depend only on the case seed and the input's *name*, so the minimiser can
drop or add graph inputs without changing the values the remaining ones get.
"""

from __future__ import annotations

import zlib

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..feeds import input_hint

#: Values planted in float inputs of "special" cases: NaN, infinities, signed zeros, denormals
#: and magnitudes where fast approximations clamp (exp overflows just above 88.72).
SPECIAL_VALUES = np.array(
    [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-42, 88.5, -88.5, 100.0, -104.0, 1e4, -1e4],
    dtype=np.float64)
SPECIAL_FRACTION = 0.15


def input_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def make_feeds(model: onnx.ModelProto, seed: int, special: bool = False,
               shapes: dict | None = None) -> dict[str, np.ndarray]:
    """Feeds for every non-initializer graph input (``shapes`` gives concrete sizes for inputs
    with symbolic dims). Integer inputs honour a ``bound=N`` doc-string hint, else take values
    in ``[0, min(dims, 10))`` so they are valid indices; bools are coin flips."""
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        rng = input_rng(seed, vi.name)
        elem = vi.type.tensor_type.elem_type
        dtype = helper.tensor_dtype_to_np_dtype(elem)
        if shapes and vi.name in shapes:
            shape = tuple(shapes[vi.name])
        else:
            shape = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        if elem == TensorProto.BOOL:
            value = rng.random(shape) < 0.5
        elif np.issubdtype(dtype, np.floating):
            value = rng.standard_normal(shape)
            if special:
                plant = rng.random(shape) < SPECIAL_FRACTION
                value = np.where(plant, rng.choice(SPECIAL_VALUES, shape), value)
        else:
            hint, arg = input_hint(vi)
            high = int(arg) if hint == "bound" and arg else max(1, min([10, *shape]))
            value = rng.integers(0, high, shape)
        feeds[vi.name] = np.asarray(value).astype(dtype)
    return feeds

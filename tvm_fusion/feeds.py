"""Inputs for running a model: which shapes a model's inputs take, and random feeds for them.

The CLI (``--input-shape``), the report's numerics check, benchmarks and tests all feed models
through here, so every one of them runs a model at the same sizes on the same values. A graph
input's ``doc_string`` may carry a value-domain hint (below) so Log/Sqrt/Asin models get valid
values.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
from onnx import TensorProto, helper

from .symbolic import var_size

# A graph input whose ``doc_string`` starts with one of these words gets values from that
# domain in :func:`random_inputs`.
HINT_POSITIVE = "positive"  # abs(normal) + 0.1: Log, Sqrt, Reciprocal, divisors, Pow bases
HINT_UNIT = "unit_interval"  # uniform(-0.9, 0.9): Asin/Acos domain
HINT_ADDITIVE_MASK = "additive_mask"  # 0 for attended positions, -1e4 for the last quarter
HINT_BOUND = "bound"  # "bound=N": integer indices in [0, N)

__all__ = ["HINT_ADDITIVE_MASK", "HINT_BOUND", "HINT_POSITIVE", "HINT_UNIT", "graph_inputs",
           "input_hint", "random_inputs", "run_shapes", "shape_names", "shapes_for"]


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Graph inputs that are real inputs (old models also list their initializers as inputs)."""
    inits = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in inits]


def _static_shape(vi: onnx.ValueInfoProto, overrides: dict | None) -> tuple[int, ...]:
    overrides = overrides or {}
    if vi.name in overrides:
        return tuple(int(d) for d in overrides[vi.name])
    shape = []
    for i, dim in enumerate(vi.type.tensor_type.shape.dim):
        if dim.HasField("dim_value") and dim.dim_value > 0:
            shape.append(dim.dim_value)
        elif dim.HasField("dim_param") and dim.dim_param in overrides:
            shape.append(int(overrides[dim.dim_param]))
        else:
            label = dim.dim_param or "?"
            raise ValueError(
                f"graph input {vi.name!r} has a symbolic/unknown dim {i} ({label!r}); "
                f"pass shape_overrides={{{vi.name!r}: [...]}} or {{{label!r}: n}}"
            )
    return tuple(shape)


def shape_names(model: onnx.ModelProto) -> set[str]:
    """Names an input shape may be given for: graph inputs and ``dim_param`` dimensions."""
    inputs = graph_inputs(model)
    return {vi.name for vi in inputs} | {
        d.dim_param for vi in inputs for d in vi.type.tensor_type.shape.dim
        if d.HasField("dim_param") and d.dim_param}


def shapes_for(model: onnx.ModelProto, overrides: dict | None) -> dict | None:
    """The entries of ``overrides`` that name an input or dimension of ``model`` (one
    ``--input-shape`` list serves several models)."""
    if not overrides:
        return overrides
    names = shape_names(model)
    return {k: v for k, v in overrides.items() if k in names}


def run_shapes(model: onnx.ModelProto, overrides: dict | None = None) -> dict:
    """``shape_overrides`` for :func:`random_inputs` that make every graph input concrete.

    ``overrides`` maps a graph input to its full shape or a ``dim_param`` to a size (the CLI's
    ``--input-shape``); every symbolic dimension left is run at the size the cost model
    assumes for it (:func:`tvm_fusion.symbolic.var_size`: a ``symbolic_hint``, else 1 for a
    batch, 128 otherwise). A name that is neither raises ``ValueError`` naming it, as does a
    shape of the wrong rank or that contradicts a fixed dimension."""
    inputs = {vi.name: vi for vi in graph_inputs(model)}
    dims = {d.dim_param for vi in inputs.values() for d in vi.type.tensor_type.shape.dim
            if d.HasField("dim_param") and d.dim_param}
    resolved: dict = {}
    for name, value in (overrides or {}).items():
        sizes = [value] if isinstance(value, int) else list(value)
        if name in inputs:
            fixed = [d.dim_value if d.HasField("dim_value") else None
                     for d in inputs[name].type.tensor_type.shape.dim]
            if not fixed:
                raise ValueError(f"input shape {name}={','.join(map(str, sizes))}: {name} is a "
                                 f"scalar (rank 0), it has no shape to give")
            if len(sizes) != len(fixed) or any(
                    f and f != s for f, s in zip(fixed, sizes)):
                want = ",".join(str(f) if f else "?" for f in fixed)
                raise ValueError(f"input shape {name}={','.join(map(str, sizes))} does not fit "
                                 f"the model's [{want}]")
            resolved[name] = tuple(int(s) for s in sizes)
        elif name in dims and len(sizes) == 1:
            resolved[name] = int(sizes[0])
        else:
            raise ValueError(f"input shape {name!r}: not a graph input or symbolic dimension "
                             f"of the model (inputs: {', '.join(inputs) or 'none'}; symbolic "
                             f"dimensions: {', '.join(sorted(dims)) or 'none'})")
    implied: dict[str, int] = {}  # dim_params fixed by a full input shape
    for name, shape in list(resolved.items()):
        if name not in inputs:
            continue
        for d, size in zip(inputs[name].type.tensor_type.shape.dim, shape):
            if d.HasField("dim_param") and d.dim_param:
                known = resolved.get(d.dim_param) if d.dim_param not in inputs else None
                known = implied.get(d.dim_param, known)
                if known is not None and known != size:
                    raise ValueError(f"input shape {name}: {d.dim_param} is {size} here but "
                                     f"{known} elsewhere")
                implied[d.dim_param] = size
    for dim in sorted(dims - set(resolved)):
        resolved[dim] = implied.get(dim, var_size(dim))
    if any(int(v) < 1 for v in resolved.values() if isinstance(v, int)) or any(
            s < 1 for v in resolved.values() if isinstance(v, tuple) for s in v):
        raise ValueError("input shapes must be positive")
    return resolved


def input_hint(vi: onnx.ValueInfoProto) -> tuple[str, str]:
    """(hint word, argument) parsed from a graph input's doc_string, e.g. ("bound", "10")."""
    m = re.match(r"\s*([A-Za-z_]+)(?:\s*=\s*([^\s,;:]+))?", vi.doc_string or "")
    return (m.group(1), m.group(2) or "") if m else ("", "")


def random_inputs(
    model: onnx.ModelProto, seed: int = 0, shape_overrides: dict | None = None
) -> dict[str, np.ndarray]:
    """Deterministic random feeds for every graph input that is not an initializer.

    Floats are standard normal unless the input's ``doc_string`` carries a hint
    (``positive``, ``unit_interval``, ``additive_mask``); integers are small non-negative values
    (``input_ids`` 0..99, names containing ``mask`` all ones, ``bound=N`` 0..N-1, otherwise
    0..min(smallest dim, 10)-1) so they are valid indices; bools are fair coin flips.
    ``shape_overrides`` maps an input name to a full shape, or a ``dim_param`` name to a size;
    any other symbolic dim raises ``ValueError`` naming the input.
    """
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for vi in graph_inputs(model):
        if not vi.type.HasField("tensor_type"):
            raise ValueError(f"graph input {vi.name!r} is not a tensor")
        elem = vi.type.tensor_type.elem_type
        dtype = helper.tensor_dtype_to_np_dtype(elem)
        shape = _static_shape(vi, shape_overrides)
        hint, arg = input_hint(vi)
        lname = vi.name.lower()
        if elem == TensorProto.BOOL:
            value = rng.random(shape) < 0.5
        elif np.issubdtype(dtype, np.floating):
            if hint == HINT_POSITIVE:
                value = np.abs(rng.standard_normal(shape)) + 0.1
            elif hint == HINT_UNIT:
                value = rng.uniform(-0.9, 0.9, shape)
            elif hint == HINT_ADDITIVE_MASK:
                value = np.zeros(shape)
                if shape:
                    value[..., shape[-1] - shape[-1] // 4 :] = -1e4
            else:
                value = rng.standard_normal(shape)
        elif np.issubdtype(dtype, np.integer):
            if hint == HINT_BOUND and arg:
                high = int(arg)
            elif "input_ids" in lname:
                high = 100
            elif "mask" in lname:
                high = None
            else:
                high = max(1, min([10, *shape]))
            value = np.ones(shape) if high is None else rng.integers(0, high, shape)
        else:
            raise ValueError(f"graph input {vi.name!r} has unsupported element type {dtype}")
        feeds[vi.name] = np.asarray(value).astype(dtype)
    return feeds


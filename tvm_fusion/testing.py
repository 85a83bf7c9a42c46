"""Test and CLI helpers: random feeds, reference execution, single-op models, random DAGs.

Everything here exists so that tests and the command line check the fusion passes against an
independent ONNX executor (onnxruntime, or ``onnx.reference``) on the same inputs:

* :func:`random_inputs` builds feeds for a model's graph inputs, honouring value-domain hints
  (``doc_string`` on a graph input) so Log/Sqrt/Asin models get valid values;
* :func:`onnx_reference` runs the unfused ONNX model;
* :func:`single_op_model` / :data:`SINGLE_OP_EXPECTED` give one model per operator of DNNFusion's
  Table 2 with the mapping type the classifier must assign;
* :func:`random_dag_models` is a hypothesis strategy for property tests of the fusion planner;
* :func:`onnx_backend_model_dirs` / :func:`load_backend_case` expose the onnx package's backend
  test data as extra end-to-end cases;
* :func:`compare` is the one tolerance check everybody uses, with a readable failure message.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8

# ---------------------------------------------------------------------------------------------
# Value-domain hints. A graph input whose ``doc_string`` starts with one of these words gets
# values from that domain in :func:`random_inputs`.
# ---------------------------------------------------------------------------------------------
HINT_POSITIVE = "positive"  # abs(normal) + 0.1: Log, Sqrt, Reciprocal, divisors, Pow bases
HINT_UNIT = "unit_interval"  # uniform(-0.9, 0.9): Asin/Acos domain
HINT_ADDITIVE_MASK = "additive_mask"  # 0 for attended positions, -1e4 for the last quarter
HINT_BOUND = "bound"  # "bound=N": integer indices in [0, N)

__all__ = [
    "HINT_ADDITIVE_MASK",
    "HINT_BOUND",
    "HINT_POSITIVE",
    "HINT_UNIT",
    "SINGLE_OP_EXPECTED",
    "SINGLE_OP_TYPES",
    "TVM_UNSUPPORTED",
    "compare",
    "load_backend_case",
    "onnx_backend_model_dirs",
    "onnx_reference",
    "random_dag_models",
    "random_inputs",
    "run_shapes",
    "shape_names",
    "shapes_for",
    "run_tvm_stock",
    "single_op_model",
]


# ---------------------------------------------------------------------------------------------
# Feeds and reference execution
# ---------------------------------------------------------------------------------------------
def _graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
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
    inputs = _graph_inputs(model)
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
    from .symbolic import var_size

    inputs = {vi.name: vi for vi in _graph_inputs(model)}
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


def _hint(vi: onnx.ValueInfoProto) -> tuple[str, str]:
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
    for vi in _graph_inputs(model):
        if not vi.type.HasField("tensor_type"):
            raise ValueError(f"graph input {vi.name!r} is not a tensor")
        elem = vi.type.tensor_type.elem_type
        dtype = helper.tensor_dtype_to_np_dtype(elem)
        shape = _static_shape(vi, shape_overrides)
        hint, arg = _hint(vi)
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


def max_abs_error(got, expected) -> float:
    """Largest absolute difference over paired outputs (arrays or TVM tensors), in float64;
    empty outputs are skipped."""
    got = [np.asarray(g.numpy() if hasattr(g, "numpy") else g, "float64") for g in got]
    expected = [np.asarray(e, "float64") for e in expected]
    return float(max((np.abs(g - e).max() for g, e in zip(got, expected) if g.size),
                     default=0.0))


def onnx_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run the unfused model: onnxruntime CPU with graph optimisations off, else onnx.reference.

    Optimisations are off so the reference does not itself fuse (and re-associate) anything.
    ``onnx.reference.ReferenceEvaluator`` is used when onnxruntime is not installed, and also when
    onnxruntime refuses to *load* the model (it has no kernels for opsets < 7, which old
    pytorch-converted backend cases use).
    """
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - onnxruntime is a dev dependency
        ort = None
    sess = None
    if ort is not None:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.log_severity_level = 3
        try:
            sess = ort.InferenceSession(
                model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
            )
        except Exception as err:  # noqa: BLE001 - ORT raises its own untyped errors
            if "NOT_IMPLEMENTED" not in str(err):
                raise
    if sess is None:
        from onnx.reference import ReferenceEvaluator

        return [np.asarray(o) for o in ReferenceEvaluator(model).run(None, feeds)]
    return [np.asarray(o) for o in sess.run(None, feeds)]


def compare(
    outputs: Sequence[np.ndarray],
    reference: Sequence[np.ndarray],
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> float:
    """Check ``|out - ref| <= atol + rtol * |ref|`` element-wise; return the max abs error.

    Raises ``AssertionError`` naming the output, its shape and the max abs/rel error, because a
    bare ``allclose`` failure inside a fusion test says nothing about which block broke.
    """
    outputs, reference = list(outputs), list(reference)
    if len(outputs) != len(reference):
        raise AssertionError(f"got {len(outputs)} outputs, reference has {len(reference)}")
    worst = 0.0
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        out, ref = np.asarray(out), np.asarray(ref)
        if out.shape != ref.shape:
            raise AssertionError(f"output {i}: shape {out.shape} != reference shape {ref.shape}")
        if out.dtype.kind in "OSU" or ref.dtype.kind in "OSU":  # strings: exact match only
            if not np.array_equal(out, ref):
                raise AssertionError(f"output {i} (shape {out.shape}): string values differ")
            continue
        if out.dtype == np.bool_ or ref.dtype == np.bool_:
            out, ref = out.astype(np.int8), ref.astype(np.int8)
        o64, r64 = out.astype(np.float64), ref.astype(np.float64)
        if o64.size == 0:
            continue
        both = ~np.isnan(o64) & ~np.isnan(r64)
        err = abs_error(o64, r64)
        max_abs = float(err.max())
        rel = err / np.maximum(np.abs(r64), np.finfo(np.float64).tiny)
        max_rel = float(np.where(err > 0, rel, 0.0).max())
        bad = err > atol + rtol * np.abs(np.where(both, r64, 0.0))
        if bad.any():
            idx = tuple(int(j) for j in np.unravel_index(int(np.argmax(err)), err.shape))
            raise AssertionError(
                f"output {i} (shape {out.shape}, dtype {out.dtype}) out of tolerance "
                f"rtol={rtol}, atol={atol}: max abs err {max_abs:.3g}, max rel err {max_rel:.3g}, "
                f"{int(bad.sum())}/{bad.size} elements bad; worst at {idx}: "
                f"got {o64[idx]!r}, expected {r64[idx]!r}"
            )
        worst = max(worst, max_abs)
    return worst


def abs_error(out: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Element-wise ``|out - ref|`` in float64, IEEE-aware: 0 where both are NaN or the same
    infinity, inf where only one is NaN."""
    o64, r64 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    nan_mismatch = np.isnan(o64) != np.isnan(r64)
    both = ~np.isnan(o64) & ~np.isnan(r64)
    inf_same = np.isinf(o64) & (o64 == r64)
    with np.errstate(invalid="ignore"):  # inf - inf where both are the same infinity
        err = np.where(both & ~inf_same, np.abs(o64 - r64), 0.0)
    return np.where(nan_mismatch, np.inf, err)


def tolerance_for(dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for checking a build's output of ``dtype`` against a reference.

    A reduced-precision output is only as exact as its format: a one- or two-ulp difference in
    fp16 is ~1e-3 relative (bf16: ~1e-2), which fp32 tolerances call a failure. Integers and
    booleans (indices, masks, counts) must match exactly.
    """
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name in ("float16", "half"):
        return 1e-2, 1e-3
    if name == "bfloat16":
        return 5e-2, 1e-2
    if name.startswith(("float", "complex")):
        return 1e-3, 1e-4
    return 0.0, 0.0


# ---------------------------------------------------------------------------------------------
# Single-operator models (DNNFusion Table 2 plus the ops the passes rely on)
# ---------------------------------------------------------------------------------------------
def _vi(name: str, shape, elem: int = TensorProto.FLOAT, hint: str = "") -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape, doc_string=hint)


def _init(name: str, value, dtype=None) -> onnx.TensorProto:
    arr = np.asarray(value, dtype=dtype)
    if dtype is None and arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    return numpy_helper.from_array(arr, name)


class _Spec:
    """What one single-op model needs: inputs, initializers, outputs, attributes, opset."""

    def __init__(self, inputs, outputs, inits=(), attrs=None, opset=OPSET, node_inputs=None):
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.inits = list(inits)
        self.attrs = dict(attrs or {})
        self.opset = opset
        self.node_inputs = node_inputs  # default: the graph inputs, then the initializers


def _w(rng: np.random.Generator, shape, fan_in: int) -> np.ndarray:
    return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)


_X4 = [2, 8, 4, 4]  # default activation shape for elementwise ops


def _unary(hint: str = "") -> Callable[..., _Spec]:
    def build(rng, shape=None):
        shape = list(shape or _X4)
        return _Spec([_vi("x", shape, hint=hint)], [_vi("y", shape)])

    return build


def _binary(hint_b: str = "", hint_a: str = "", out_elem: int = TensorProto.FLOAT):
    def build(rng, shape=None):
        shape = list(shape or _X4)
        return _Spec(
            [_vi("a", shape, hint=hint_a), _vi("b", shape, hint=hint_b)],
            [_vi("y", shape, out_elem)],
        )

    return build


def _spec_cast(rng, shape=None):
    shape = list(shape or _X4)
    return _Spec(
        [_vi("x", shape)], [_vi("y", shape, TensorProto.INT32)], attrs={"to": TensorProto.INT32}
    )


def _spec_clip(rng, shape=None):
    shape = list(shape or _X4)
    inits = [_init("min", np.float32(-0.5)), _init("max", np.float32(0.5))]
    return _Spec([_vi("x", shape)], [_vi("y", shape)], inits)


def _spec_batchnorm(rng, shape=None):
    shape = list(shape or _X4)
    c = shape[1]
    inits = [
        _init("scale", 1 + 0.1 * rng.standard_normal(c)),
        _init("bias", 0.1 * rng.standard_normal(c)),
        _init("mean", 0.1 * rng.standard_normal(c)),
        _init("var", 0.5 + rng.random(c)),
    ]
    return _Spec([_vi("x", shape)], [_vi("y", shape)], inits, {"epsilon": 1e-5})


def _spec_concat(rng, shape=None):
    return _Spec(
        [_vi("a", [2, 4, 4, 4]), _vi("b", [2, 6, 4, 4])],
        [_vi("y", [2, 10, 4, 4])],
        attrs={"axis": 1},
    )


def _spec_leakyrelu(rng, shape=None):
    spec = _unary()(rng, shape)
    spec.attrs["alpha"] = 0.1
    return spec


def _spec_not(rng, shape=None):
    shape = list(shape or _X4)
    return _Spec([_vi("x", shape, TensorProto.BOOL)], [_vi("y", shape, TensorProto.BOOL)])


def _spec_prelu(rng, shape=None):
    shape = list(shape or _X4)
    slope = _init("slope", 0.25 * rng.random((shape[1], 1, 1)))
    return _Spec([_vi("x", shape)], [_vi("y", shape)], [slope])


def _spec_slice(rng, shape=None):
    inits = [
        _init("starts", [1, 0], np.int64),
        _init("ends", [7, 8], np.int64),
        _init("axes", [2, 3], np.int64),
        _init("steps", [1, 2], np.int64),
    ]
    return _Spec([_vi("x", [2, 8, 8, 8])], [_vi("y", [2, 8, 6, 4])], inits)


def _spec_split(rng, shape=None):
    return _Spec(
        [_vi("x", [2, 8, 4, 4])],
        [_vi("y0", [2, 3, 4, 4]), _vi("y1", [2, 5, 4, 4])],
        [_init("split", [3, 5], np.int64)],
        {"axis": 1},
    )


def _spec_where(rng, shape=None):
    shape = list(shape or _X4)
    return _Spec(
        [_vi("cond", shape, TensorProto.BOOL), _vi("a", shape), _vi("b", shape)], [_vi("y", shape)]
    )


def _spec_greater(rng, shape=None):
    return _binary(out_elem=TensorProto.BOOL)(rng, shape)


def _spec_expand(rng, shape=None):
    return _Spec([_vi("x", [4, 1])], [_vi("y", [2, 4, 5])], [_init("shape", [2, 4, 5], np.int64)])


def _spec_gather(rng, shape=None):
    return _Spec(
        [_vi("data", [10, 8]), _vi("indices", [3, 4], TensorProto.INT64, hint=f"{HINT_BOUND}=10")],
        [_vi("y", [3, 4, 8])],
        attrs={"axis": 0},
    )


def _spec_resize(rng, shape=None):
    return _Spec(
        [_vi("x", [1, 4, 4, 4])],
        [_vi("y", [1, 4, 8, 8])],
        [_init("scales", [1, 1, 2, 2], np.float32)],
        {"mode": "nearest"},
        node_inputs=["x", "", "scales"],  # roi is unused for nearest
    )


def _spec_upsample(rng, shape=None):
    # Upsample is deprecated since opset 10 (replaced by Resize); opset 9 is the newest version
    # where it is a valid operator, so this one model is built at opset 9.
    return _Spec(
        [_vi("x", [1, 4, 4, 4])],
        [_vi("y", [1, 4, 8, 8])],
        [_init("scales", [1, 1, 2, 2], np.float32)],
        {"mode": "nearest"},
        opset=9,
    )


def _spec_avgpool(rng, shape=None):
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1]}
    return _Spec([_vi("x", [1, 8, 8, 8])], [_vi("y", [1, 8, 8, 8])], attrs=attrs)


def _spec_maxpool(rng, shape=None):
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}
    return _Spec([_vi("x", [1, 8, 8, 8])], [_vi("y", [1, 8, 4, 4])], attrs=attrs)


def _spec_conv(rng, shape=None):
    inits = [_init("w", _w(rng, (16, 8, 3, 3), 72)), _init("b", 0.1 * rng.standard_normal(16))]
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    return _Spec([_vi("x", [1, 8, 8, 8])], [_vi("y", [1, 16, 8, 8])], inits, attrs)


def _spec_convtranspose(rng, shape=None):
    inits = [_init("w", _w(rng, (8, 4, 3, 3), 72)), _init("b", 0.1 * rng.standard_normal(4))]
    attrs = {
        "kernel_shape": [3, 3],
        "strides": [2, 2],
        "pads": [1, 1, 1, 1],
        "output_padding": [1, 1],
    }
    return _Spec([_vi("x", [1, 8, 4, 4])], [_vi("y", [1, 4, 8, 8])], inits, attrs)


def _spec_cumsum(rng, shape=None):
    return _Spec([_vi("x", [2, 8, 6])], [_vi("y", [2, 8, 6])], [_init("axis", 2, np.int64)])


def _spec_einsum(rng, shape=None):
    return _Spec(
        [_vi("a", [2, 4, 5]), _vi("b", [2, 5, 3])],
        [_vi("y", [2, 4, 3])],
        attrs={"equation": "bij,bjk->bik"},
    )


def _spec_gemm(rng, shape=None):
    # transB=1 with a [N, K] weight is how PyTorch exports nn.Linear through Gemm.
    inits = [_init("w", _w(rng, (6, 8), 8)), _init("c", 0.1 * rng.standard_normal(6))]
    attrs = {"alpha": 1.0, "beta": 1.0, "transB": 1}
    return _Spec([_vi("a", [4, 8])], [_vi("y", [4, 6])], inits, attrs)


def _spec_matmul(rng, shape=None):
    return _Spec([_vi("a", [2, 4, 8])], [_vi("y", [2, 4, 6])], [_init("w", _w(rng, (8, 6), 8))])


def _spec_instnorm(rng, shape=None):
    shape = list(shape or _X4)
    c = shape[1]
    inits = [
        _init("scale", 1 + 0.1 * rng.standard_normal(c)),
        _init("bias", 0.1 * rng.standard_normal(c)),
    ]
    return _Spec([_vi("x", shape)], [_vi("y", shape)], inits, {"epsilon": 1e-5})


def _spec_layernorm(rng, shape=None):
    inits = [
        _init("scale", 1 + 0.1 * rng.standard_normal(16)),
        _init("bias", 0.1 * rng.standard_normal(16)),
    ]
    return _Spec(
        [_vi("x", [2, 4, 16])], [_vi("y", [2, 4, 16])], inits, {"axis": -1, "epsilon": 1e-5}
    )


def _spec_reduce_attr(rng, shape=None):
    # ReduceMean/ReduceProd keep ``axes`` as an attribute up to opset 17.
    return _Spec([_vi("x", _X4)], [_vi("y", [2, 1, 4, 4])], attrs={"axes": [1], "keepdims": 1})


def _spec_reducesum(rng, shape=None):
    # ReduceSum takes ``axes`` as an input since opset 13.
    return _Spec(
        [_vi("x", _X4)], [_vi("y", [2, 8, 4])], [_init("axes", [3], np.int64)], {"keepdims": 0}
    )


def _spec_softmax(rng, shape=None):
    return _Spec([_vi("x", [2, 4, 16])], [_vi("y", [2, 4, 16])], attrs={"axis": -1})


def _spec_flatten(rng, shape=None):
    return _Spec([_vi("x", _X4)], [_vi("y", [2, 128])], attrs={"axis": 1})


def _spec_reshape(rng, shape=None):
    return _Spec([_vi("x", _X4)], [_vi("y", [2, 8, 16])], [_init("shape", [2, 8, 16], np.int64)])


def _spec_squeeze(rng, shape=None):
    return _Spec([_vi("x", [2, 1, 8, 1])], [_vi("y", [2, 8])], [_init("axes", [1, 3], np.int64)])


def _spec_unsqueeze(rng, shape=None):
    return _Spec([_vi("x", [2, 8, 4])], [_vi("y", [2, 1, 8, 4])], [_init("axes", [1], np.int64)])


def _spec_depthtospace(rng, shape=None):
    return _Spec([_vi("x", [1, 16, 4, 4])], [_vi("y", [1, 4, 8, 8])], attrs={"blocksize": 2})


def _spec_spacetodepth(rng, shape=None):
    return _Spec([_vi("x", [1, 4, 8, 8])], [_vi("y", [1, 16, 4, 4])], attrs={"blocksize": 2})


def _spec_transpose(rng, shape=None):
    return _Spec([_vi("x", _X4)], [_vi("y", [2, 4, 4, 8])], attrs={"perm": [0, 2, 3, 1]})


def _spec_gelu(rng, shape=None):
    # Gelu is an opset-20 operator; the model is built at opset 20 (IR version 9).
    shape = list(shape or _X4)
    return _Spec([_vi("x", shape)], [_vi("y", shape)], opset=20)


def _spec_pad(rng, shape=None):
    inits = [
        _init("pads", [0, 0, 1, 2, 0, 0, 1, 2], np.int64),
        _init("value", np.float32(0.5)),
    ]
    return _Spec([_vi("x", [1, 4, 4, 4])], [_vi("y", [1, 4, 6, 8])], inits, {"mode": "constant"})


def _spec_add_broadcast(rng, shape=None):
    # A true expansion: every input element is read by several outputs ([4,1] + [1,5] -> [4,5]).
    return _Spec([_vi("a", [4, 1]), _vi("b", [1, 5])], [_vi("y", [4, 5])])


def _spec_add_bias(rng, shape=None):
    # A per-channel constant bias: the output has the activation's shape, so no expansion.
    bias = _init("bias", 0.1 * rng.standard_normal((1, 8, 1, 1)))
    return _Spec([_vi("x", [1, 8, 4, 4])], [_vi("y", [1, 8, 4, 4])], [bias])


# op_type -> (ONNX op actually emitted, spec builder)
_SINGLE_OPS: dict[str, tuple[str, Callable[..., _Spec]]] = {
    # Table 2, One-to-One
    "Add": ("Add", _binary()),
    "Asin": ("Asin", _unary(HINT_UNIT)),
    "BatchNormalization": ("BatchNormalization", _spec_batchnorm),
    "Cast": ("Cast", _spec_cast),
    "Ceil": ("Ceil", _unary()),
    "Clip": ("Clip", _spec_clip),
    "Concat": ("Concat", _spec_concat),
    "Cos": ("Cos", _unary()),
    "Erf": ("Erf", _unary()),
    "Exp": ("Exp", _unary()),
    "Greater": ("Greater", _spec_greater),
    "LeakyRelu": ("LeakyRelu", _spec_leakyrelu),
    "Log": ("Log", _unary(HINT_POSITIVE)),
    "Not": ("Not", _spec_not),
    "PRelu": ("PRelu", _spec_prelu),
    "Reciprocal": ("Reciprocal", _unary(HINT_POSITIVE)),
    "Relu": ("Relu", _unary()),
    "Round": ("Round", _unary()),
    "Sigmoid": ("Sigmoid", _unary()),
    "Sin": ("Sin", _unary()),
    "Slice": ("Slice", _spec_slice),
    "Split": ("Split", _spec_split),
    "Sqrt": ("Sqrt", _unary(HINT_POSITIVE)),
    "Tanh": ("Tanh", _unary()),
    "Where": ("Where", _spec_where),
    # Table 2, One-to-Many
    "Expand": ("Expand", _spec_expand),
    "Gather": ("Gather", _spec_gather),
    "Resize": ("Resize", _spec_resize),
    "Upsample": ("Upsample", _spec_upsample),
    "AddBroadcast": ("Add", _spec_add_broadcast),
    # Table 2, Many-to-Many
    "AveragePool": ("AveragePool", _spec_avgpool),
    "Conv": ("Conv", _spec_conv),
    "ConvTranspose": ("ConvTranspose", _spec_convtranspose),
    "CumSum": ("CumSum", _spec_cumsum),
    "Einsum": ("Einsum", _spec_einsum),
    "Gemm": ("Gemm", _spec_gemm),
    "InstanceNormalization": ("InstanceNormalization", _spec_instnorm),
    "MaxPool": ("MaxPool", _spec_maxpool),
    "ReduceProd": ("ReduceProd", _spec_reduce_attr),
    "ReduceMean": ("ReduceMean", _spec_reduce_attr),
    "Softmax": ("Softmax", _spec_softmax),
    # Table 2, Reorganize
    "Flatten": ("Flatten", _spec_flatten),
    "Reshape": ("Reshape", _spec_reshape),
    "Squeeze": ("Squeeze", _spec_squeeze),
    "Unsqueeze": ("Unsqueeze", _spec_unsqueeze),
    # Table 2, Shuffle
    "DepthToSpace": ("DepthToSpace", _spec_depthtospace),
    "SpaceToDepth": ("SpaceToDepth", _spec_spacetodepth),
    "Transpose": ("Transpose", _spec_transpose),
    # Not in Table 2 but used by the paper (Table 4, §4.2, Table 5) or by the passes
    "Mul": ("Mul", _binary()),
    "Sub": ("Sub", _binary()),
    "Div": ("Div", _binary(hint_b=HINT_POSITIVE)),
    "Pow": ("Pow", _binary(hint_a=HINT_POSITIVE)),
    "MatMul": ("MatMul", _spec_matmul),
    "ReduceSum": ("ReduceSum", _spec_reducesum),
    "LayerNormalization": ("LayerNormalization", _spec_layernorm),
    "Gelu": ("Gelu", _spec_gelu),
    "Pad": ("Pad", _spec_pad),
    "AddBias": ("Add", _spec_add_bias),
}


#: Every op_type :func:`single_op_model` accepts, in Table 2 order.
SINGLE_OP_TYPES: tuple[str, ...] = tuple(_SINGLE_OPS)

O2O, O2M, M2M, REORG, SHUF = "ONE_TO_ONE", "ONE_TO_MANY", "MANY_TO_MANY", "REORGANIZE", "SHUFFLE"

_TABLE2_AND_EXTRAS = {
    O2O: (
        # Table 2, One-to-One
        "Add Asin BatchNormalization Cast Ceil Clip Concat Cos Erf Exp Greater LeakyRelu Log Not "
        "PRelu Reciprocal Relu Round Sigmoid Sin Slice Split Sqrt Tanh Where "
        # element-wise ops the paper uses in Table 4 / §6 / §4.4.1 (spec §1.3)
        "Mul Sub Div Pow "
        # Gelu is element-wise: one input element -> one output element
        "Gelu "
        # A per-channel constant bias is not an expansion (spec §8.1, "expanding_only" policy)
        "AddBias "
        # Pad copies each input element to exactly one output element at an offset (an
        # injective, Slice-like index map); the border elements are constants that read no input.
        # Nothing is replicated or reduced, so it is O2O like Slice/Concat.
        "Pad"
    ),
    # Table 2, One-to-Many; AddBroadcast is "Elementwise w/ broadcast" as a true expansion
    O2M: "Expand Gather Resize Upsample AddBroadcast",
    M2M: (
        # Table 2, Many-to-Many
        "AveragePool Conv ConvTranspose CumSum Einsum Gemm InstanceNormalization MaxPool "
        "ReduceProd ReduceMean Softmax "
        # MatMul like GEMM (Table 5), ReduceSum (§4.2), LayerNormalization like InstanceNorm
        "MatMul ReduceSum LayerNormalization"
    ),
    REORG: "Flatten Reshape Squeeze Unsqueeze",
    SHUF: "DepthToSpace SpaceToDepth Transpose",
}

#: The DNNFusion mapping type (paper Table 2, spec §1.3/§8.1) the classifier must give each model.
SINGLE_OP_EXPECTED: dict[str, str] = {
    op: kind for kind, ops in _TABLE2_AND_EXTRAS.items() for op in ops.split()
}
assert set(SINGLE_OP_EXPECTED) == set(_SINGLE_OPS)


def single_op_model(op_type: str, seed: int = 0, **kwargs) -> onnx.ModelProto:
    """A one-node ONNX model for ``op_type`` (a key of :data:`SINGLE_OP_EXPECTED`).

    Static shapes; weights are initializers; inputs whose domain is restricted carry a
    ``doc_string`` hint (``positive``/``unit_interval``/``bound=N``) that :func:`random_inputs`
    honours. Opset 17 / IR 8, except Upsample (opset 9: it was removed after 9) and Gelu (opset
    20 / IR 9: it was added in 20). Keyword arguments: ``shape`` (main input shape, for
    elementwise/normalisation ops), ``opset``, and anything else overrides a node attribute.
    """
    try:
        onnx_op, build = _SINGLE_OPS[op_type]
    except KeyError:
        raise ValueError(
            f"unknown single-op model {op_type!r}; valid: {', '.join(SINGLE_OP_TYPES)}"
        ) from None
    rng = np.random.default_rng(seed)
    shape = kwargs.pop("shape", None)
    opset = kwargs.pop("opset", None)
    spec = build(rng, shape=shape) if shape is not None else build(rng)
    spec.attrs.update(kwargs)
    if opset is not None:
        spec.opset = opset
    node_inputs = spec.node_inputs
    if node_inputs is None:
        node_inputs = [vi.name for vi in spec.inputs] + [t.name for t in spec.inits]
    node = helper.make_node(
        onnx_op, node_inputs, [vi.name for vi in spec.outputs], name=op_type.lower(), **spec.attrs
    )
    graph = helper.make_graph([node], f"single_{op_type}", spec.inputs, spec.outputs, spec.inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", spec.opset)], producer_name="tvm_fusion"
    )
    model.ir_version = IR_VERSION if spec.opset <= 17 else 9
    return model


# ---------------------------------------------------------------------------------------------
# Random DAGs (hypothesis)
# ---------------------------------------------------------------------------------------------
_MAX_ELEMS = 4096  # keeps every intermediate small so a property-test example runs in ~ms
_MAX_BOUND = 1e3  # rough |value| ceiling; ops that could exceed it are not drawn


class _DagBuilder:
    """Bookkeeping for one random DAG: tensors with shapes and a crude magnitude bound."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.shape: dict[str, tuple[int, ...]] = {}
        self.bound: dict[str, float] = {}
        self.order: list[str] = []  # tensors available as operands, in creation order
        self._n = 0

    def fresh(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def unread(self) -> list[str]:
        """Tensors no node reads yet."""
        read = {i for n in self.nodes for i in n.input}
        return [t for t in self.order if t not in read]

    def add_input(self, name: str, shape) -> None:
        self.shape[name], self.bound[name] = tuple(shape), 4.0
        self.order.append(name)

    def const(self, value, dtype=np.float32) -> str:
        name = self.fresh("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def node(self, op, inputs, shapes, bounds, **attrs) -> list[str]:
        outs = [self.fresh("t") for _ in shapes]
        self.nodes.append(helper.make_node(op, inputs, outs, name=self.fresh(f"{op}_"), **attrs))
        for o, sh, b in zip(outs, shapes, bounds, strict=True):
            self.shape[o], self.bound[o] = tuple(sh), float(b)
            self.order.append(o)
        return outs


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(np.broadcast_shapes(a, b))
    except ValueError:
        return None


def _prune(b: _DagBuilder, outputs: list[str]) -> list[onnx.NodeProto]:
    """Drop nodes that feed no graph output, so every node matters to the result."""
    needed, kept = set(outputs), []
    for node in reversed(b.nodes):
        if needed.intersection(node.output):
            kept.append(node)
            needed.update(node.input)
    return kept[::-1]


def random_dag_models(max_nodes: int = 12):
    """Hypothesis strategy: small random fp32 ONNX DAGs (3..``max_nodes`` nodes, static shapes).

    One input ``x`` [1, C, H, W] (C in 1..8, H/W in 2..8), sometimes a second input ``x2`` of the
    same or per-channel shape. Ops: Relu/Sigmoid/Tanh, Clip+Exp, Add/Mul/Sub of two tensors
    (possibly broadcasting), Add/Mul with a constant, ReduceMean/ReduceSum (keepdims) alone or
    broadcast back against their input, Reshape/Flatten, Transpose, MatMul with a constant weight,
    Conv 1x1/3x3 with padding, Softmax(-1), Concat/Split on axis 1. Operands are drawn from all
    earlier tensors, so multi-consumer edges are common; 1-2 outputs, one of which may be an
    intermediate that also feeds later nodes. Values stay tame (crude |value| bound < 1e3, no
    Div/Log/Pow). Every model passes ``onnx.checker.check_model(full_check=True)``.
    """
    from hypothesis import strategies as st

    @st.composite
    def _models(draw) -> onnx.ModelProto:
        c = draw(st.integers(1, 8))
        h = draw(st.integers(2, 8))
        w = draw(st.integers(2, 8))
        b = _DagBuilder(np.random.default_rng(draw(st.integers(0, 2**32 - 1))))
        inputs = [("x", (1, c, h, w))]
        if draw(st.booleans()):
            inputs.append(("x2", draw(st.sampled_from([(1, c, h, w), (1, c, 1, 1)]))))
        for name, shape in inputs:
            b.add_input(name, shape)
        target = draw(st.integers(3, max_nodes))

        def operand(first: bool = False) -> str:
            if first:
                return "x"  # the first node reads x, so x is never pruned away
            how = draw(st.integers(0, 2))
            # Prefer the newest tensor or an unread one, so few nodes end up pruned as dead.
            pool = b.order[-1:] if how == 0 else b.unread() if how == 1 else b.order
            pool = pool or b.order
            return pool[draw(st.integers(0, len(pool) - 1))]

        while len(b.nodes) < target:
            t = operand(first=not b.nodes)
            sh, r = b.shape[t], len(b.shape[t])
            kinds = ["unary", "exp", "binary", "const", "reduce", "reduce_bcast", "softmax"]
            if r >= 2:
                kinds += ["matmul", "flatten", "concat"]
            if r >= 3:
                kinds += ["reshape", "transpose"]
            if r == 4:
                kinds.append("conv")
            if r >= 2 and sh[1] >= 2:
                kinds.append("split")
            kind = draw(st.sampled_from(kinds))
            _emit_random_op(draw, st, b, kind, t)
        outputs = [b.order[-1]]
        # Fold unread leaves into the main output where shapes allow, instead of pruning them.
        for leaf in b.unread():
            if leaf == outputs[0] or len(b.nodes) >= max_nodes:
                continue
            out_shape = b.shape[outputs[0]]
            bound = b.bound[outputs[0]] + b.bound[leaf]
            if _broadcast(out_shape, b.shape[leaf]) == out_shape and bound <= _MAX_BOUND:
                (outputs[0],) = b.node("Add", [outputs[0], leaf], [out_shape], [bound])
        if draw(st.integers(0, 2)):
            read = {i for n in b.nodes for i in n.input}
            produced = [o for n in b.nodes for o in n.output if o != outputs[0]]
            # Half the time the extra output is an intermediate that later nodes also read.
            inner = [o for o in produced if o in read]
            pool = inner if inner and draw(st.booleans()) else produced
            if pool:
                outputs.append(pool[draw(st.integers(0, len(pool) - 1))])
        nodes = _prune(b, outputs)
        if not any("x" in n.input for n in nodes):
            # The main chain bypassed x: expose the first node (which reads x) as an output.
            outputs = [outputs[0], b.nodes[0].output[0]]
            nodes = _prune(b, outputs)
        while len(nodes) < 3:  # pruning can leave too few nodes: extend the main output
            (y,) = b.node("Relu", [outputs[0]], [b.shape[outputs[0]]], [b.bound[outputs[0]]])
            outputs[0] = y
            nodes = _prune(b, outputs)
        used = {i for n in nodes for i in n.input}
        graph = helper.make_graph(
            nodes,
            "random_dag",
            [_vi(name, list(shape)) for name, shape in inputs if name in used],
            [_vi(o, list(b.shape[o])) for o in outputs],
            [t for t in b.inits if t.name in used],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = IR_VERSION
        onnx.checker.check_model(model, full_check=True)
        return model

    return _models()


def _emit_random_op(draw, st, b: _DagBuilder, kind: str, t: str) -> None:
    """Append one drawn op (or a short fixed pattern) reading tensor ``t``."""
    sh, bd, r = b.shape[t], b.bound[t], len(b.shape[t])
    size = int(np.prod(sh))
    if kind == "unary" or bd > _MAX_BOUND / 10:
        # Also the fallback when the operand is already large: squash it.
        ops = ["Relu", "Sigmoid", "Tanh"] if bd <= _MAX_BOUND / 10 else ["Tanh"]
        op = draw(st.sampled_from(ops))
        b.node(op, [t], [sh], [bd if op == "Relu" else 1.0])
    elif kind == "exp":
        (clipped,) = b.node("Clip", [t, b.const(-3.0), b.const(3.0)], [sh], [min(bd, 3.0)])
        b.node("Exp", [clipped], [sh], [math.exp(min(bd, 3.0))])
    elif kind == "binary":
        op = draw(st.sampled_from(["Add", "Mul", "Sub"]))
        partners = []
        for p in b.order:
            out = _broadcast(sh, b.shape[p])
            if out is None or int(np.prod(out)) > _MAX_ELEMS:
                continue
            bound = bd * b.bound[p] if op == "Mul" else bd + b.bound[p]
            if bound <= _MAX_BOUND:
                partners.append((p, out, bound))
        if not partners:
            b.node("Tanh", [t], [sh], [1.0])
            return
        p, out, bound = partners[draw(st.integers(0, len(partners) - 1))]
        operands = [t, p] if draw(st.booleans()) else [p, t]
        b.node(op, operands, [out], [bound])
    elif kind == "const":
        op = draw(st.sampled_from(["Add", "Mul"]))
        cshapes = [(), (sh[-1],)]
        if r == 4:
            cshapes.append((1, sh[1], 1, 1))
        cshape = draw(st.sampled_from(cshapes))
        if op == "Mul":
            value = b.rng.uniform(0.5, 1.5, cshape)
            bound = bd * 1.5
        else:
            value = b.rng.standard_normal(cshape)
            bound = bd + 4.0
        b.node(op, [t, b.const(value)], [sh], [bound])
    elif kind in ("reduce", "reduce_bcast"):
        axis = draw(st.integers(1, r - 1)) if r >= 2 else 0
        op = draw(st.sampled_from(["ReduceMean", "ReduceSum"]))
        rshape = tuple(1 if i == axis else d for i, d in enumerate(sh))
        rbound = bd * (sh[axis] if op == "ReduceSum" else 1)
        if op == "ReduceSum":  # axes is an input since opset 13
            (red,) = b.node(op, [t, b.const([axis], np.int64)], [rshape], [rbound], keepdims=1)
        else:  # ReduceMean keeps the axes attribute until opset 18
            (red,) = b.node(op, [t], [rshape], [rbound], axes=[axis], keepdims=1)
        if kind == "reduce_bcast":
            bop = draw(st.sampled_from(["Sub", "Add", "Mul"]))
            bound = bd * rbound if bop == "Mul" else bd + rbound
            if bound > _MAX_BOUND:
                bop, bound = "Sub", bd + rbound
            b.node(bop, [t, red], [sh], [bound])
    elif kind == "softmax":
        b.node("Softmax", [t], [sh], [1.0], axis=-1)
    elif kind == "matmul":
        k = draw(st.integers(1, 8))
        weight = b.rng.standard_normal((sh[-1], k)) / math.sqrt(sh[-1])
        b.node("MatMul", [t, b.const(weight)], [(*sh[:-1], k)], [bd * 3.0])
    elif kind == "flatten":
        b.node("Flatten", [t], [(sh[0], size // sh[0])], [bd], axis=1)
    elif kind == "reshape":
        # Merge two adjacent non-batch axes, or split one with a non-trivial divisor.
        i = draw(st.integers(1, r - 2))
        new = (*sh[:i], sh[i] * sh[i + 1], *sh[i + 2 :])
        divisors = [d for d in range(2, sh[-1]) if sh[-1] % d == 0]
        if r == 3 and divisors and draw(st.booleans()):
            d = draw(st.sampled_from(divisors))
            new = (*sh[:-1], d, sh[-1] // d)
        b.node("Reshape", [t, b.const(list(new), np.int64)], [new], [bd])
    elif kind == "transpose":
        rest = draw(st.permutations(list(range(1, r))))
        perm = [0, *rest]
        b.node("Transpose", [t], [tuple(sh[p] for p in perm)], [bd], perm=perm)
    elif kind == "conv":
        k = draw(st.sampled_from([1, 3]))
        cout = draw(st.integers(1, 8))
        cin = sh[1]
        weight = b.rng.standard_normal((cout, cin, k, k)) / math.sqrt(cin * k * k)
        inputs = [t, b.const(weight)]
        if draw(st.booleans()):
            inputs.append(b.const(0.1 * b.rng.standard_normal(cout)))
        pad = k // 2
        b.node(
            "Conv", inputs, [(sh[0], cout, sh[2], sh[3])], [bd * 3.0 + 1.0],
            kernel_shape=[k, k], pads=[pad] * 4,
        )  # fmt: skip
    elif kind == "concat":
        partners = [
            p
            for p in b.order
            if len(b.shape[p]) == r
            and all(b.shape[p][i] == sh[i] for i in range(r) if i != 1)
            and size + int(np.prod(b.shape[p])) <= _MAX_ELEMS
        ]
        if not partners:
            b.node("Relu", [t], [sh], [bd])
            return
        p = partners[draw(st.integers(0, len(partners) - 1))]
        out = (sh[0], sh[1] + b.shape[p][1], *sh[2:])
        b.node("Concat", [t, p], [out], [max(bd, b.bound[p])], axis=1)
    elif kind == "split":
        first = draw(st.integers(1, sh[1] - 1))
        shapes = [(sh[0], first, *sh[2:]), (sh[0], sh[1] - first, *sh[2:])]
        b.node("Split", [t, b.const([first, sh[1] - first], np.int64)], shapes, [bd, bd], axis=1)
    else:  # pragma: no cover
        raise AssertionError(kind)


# ---------------------------------------------------------------------------------------------
# Stock TVM execution (no fusion on CPU: tvm.compile(mod, "llvm") uses the "default" pipeline)
# ---------------------------------------------------------------------------------------------
#: Single-op models that TVM 0.27's ONNX frontend cannot import/compile, with the error it gives.
#: Every other op of :data:`SINGLE_OP_TYPES` imports, compiles and matches onnxruntime.
TVM_UNSUPPORTED: dict[str, str] = {
    # relax/frontend/onnx Upsample._impl_v9 reads ``scales`` from the attributes (Upsample-7
    # form), but Upsample-9 passes it as an input, so the import dies with
    # "TypeError: object of type 'NoneType' has no len()". The Upsample-7 form (opset 7/8,
    # scales attribute) does import, but resize2d is called with the default rounding ("round")
    # instead of floor, so nearest upsampling by 2 gives [0,0,1,2,2,2,3,3] for [0,1,2,3]: wrong.
    "Upsample": "import fails: TypeError: object of type 'NoneType' has no len() (Upsample-9 "
    "scales input unsupported; the Upsample-7 form imports but rounds instead of flooring)",
}


def run_tvm_stock(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Import with ``from_onnx`` (weights as constants), ``tvm.compile(mod, "llvm")``, run on CPU.

    This is the unfused TVM baseline the fusion pipelines are compared against.
    """
    from .compile import compile_model, import_onnx, run

    executable = compile_model(import_onnx(model), "llvm", strategy="none")
    return run(executable, [feeds[vi.name] for vi in _graph_inputs(model)])


# ---------------------------------------------------------------------------------------------
# ONNX backend test data
# ---------------------------------------------------------------------------------------------
def _backend_data_root() -> Path:
    return Path(onnx.__file__).parent / "backend" / "test" / "data"


def onnx_backend_model_dirs(
    suites: Iterable[str] = ("light", "pytorch-converted", "pytorch-operator", "simple"),
) -> list[Path]:
    """The installed onnx package's backend test cases, sorted.

    For ``pytorch-converted``, ``pytorch-operator``, ``simple`` (and ``node``, ``real`` if
    asked) each entry is a directory with ``model.onnx`` and ``test_data_set_0/``. The ``light``
    suite has no such directories: its entries are the ``light_<name>.onnx`` files themselves
    (weight-free stand-ins of real CNNs whose expected output is ``light_<name>_output_0.pb``);
    :func:`load_backend_case` accepts both forms.
    """
    root = _backend_data_root()
    cases: list[Path] = []
    for suite in suites:
        sdir = root / suite
        if not sdir.is_dir():
            raise ValueError(f"no backend test suite {suite!r} under {root}")
        for p in sorted(sdir.iterdir()):
            if p.is_dir() and (p / "model.onnx").is_file() and (p / "test_data_set_0").is_dir():
                cases.append(p)
            elif p.is_file() and re.fullmatch(r"light_.+(?<!_output_\d)\.onnx", p.name):
                cases.append(p)
    return cases


def _read_tensor(path: Path) -> np.ndarray:
    t = onnx.TensorProto()
    t.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(t)


def _numbered(d: Path, prefix: str) -> list[Path]:
    files = [p for p in d.glob(f"{prefix}_*.pb") if re.fullmatch(rf"{prefix}_\d+\.pb", p.name)]
    return sorted(files, key=lambda p: int(p.stem.rsplit("_", 1)[1]))


def load_backend_case(
    path: str | Path,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[np.ndarray]]:
    """Load one backend case: (model, feeds by graph-input name, expected outputs).

    ``.pb`` inputs are matched to the non-initializer graph inputs by position (their stored
    names are often empty). For a ``light_*.onnx`` file the inputs are generated the way
    ``onnx.backend.test.runner`` does (``arange(n) / n``, unknown dims as 1), which is what its
    stored output was computed from. Caveat: the light models' weights are ConstantOfShape
    fills, so their stored outputs are constant (a uniform 1/1000 softmax): they check import,
    compile, run and shapes, but say little about numerics.
    """
    path = Path(path)
    if path.is_file():
        model = onnx.load(str(path))
        feeds = {}
        for vi in _graph_inputs(model):
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else 1 for d in vi.type.tensor_type.shape.dim
            )
            n = int(np.prod(shape))
            feeds[vi.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
        prefix = path.with_suffix("")
        expected = [
            _read_tensor(Path(f"{prefix}_output_{i}.pb")) for i in range(len(model.graph.output))
        ]
        return model, feeds, expected
    model = onnx.load(str(path / "model.onnx"))
    data = path / "test_data_set_0"
    in_files = _numbered(data, "input")
    inputs = _graph_inputs(model)
    if len(in_files) > len(inputs):
        raise ValueError(f"{path}: {len(in_files)} input files for {len(inputs)} graph inputs")
    feeds = {vi.name: _read_tensor(f) for vi, f in zip(inputs, in_files, strict=False)}
    expected = [_read_tensor(f) for f in _numbered(data, "output")]
    return model, feeds, expected


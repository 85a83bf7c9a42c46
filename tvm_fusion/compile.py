"""From an ONNX file (or a ``torch.export`` program) to a compiled module, with one-line errors
for bad input.

Models are imported through :mod:`tvm_fusion.frontend` (TVM's importers plus the repairs that
symbolic exports need).

``compile_model`` builds with tvm_fusion or, for comparison, with stock TVM: ``"tvm"`` is TVM's
own fused pipeline (``relax.get_default_pipeline``: FuseOps + FuseTIR), which is what stock TVM
runs on GPUs and what we compare kernel counts and numerics with; plain ``tvm.compile`` on CPU
does no fusion at all.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
import warnings

import numpy as np
import onnx
import onnx.numpy_helper
import tvm
from tvm import relax

from . import frontend
from .devices import require_codegen
from .native_log import EVERYTHING, filtered_stderr
from .numerics import onnx_reference
from .target import to_target
from .transform import Sequential, get_pipeline

_CALL_TIR = "relax.call_tir"
_CALL_DPS = "relax.call_dps_packed"


class ModelError(ValueError):
    """A model tvm_fusion cannot take, with a message that names the cause."""


def load_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    """Load and check an ONNX file; errors name the file and what is wrong with it."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelError(f"{path}: no such file")
    try:
        model = onnx.load(path)
    except Exception as err:
        raise ModelError(f"{path}: not a valid ONNX model ({_first_line(err)})") from None
    if not model.graph.node:
        raise ModelError(f"{path}: not a valid ONNX model (the graph has no nodes)")
    try:
        onnx.checker.check_model(model)
    except Exception as err:
        raise ModelError(f"{path}: ONNX checker rejects the model ({_first_line(err)})") from None
    _check_opset(path, model)
    return model


def _check_opset(path: str, model: onnx.ModelProto) -> None:
    """Refuse a default-domain opset newer than the installed ``onnx`` defines: the checker
    lets it through, but no operator schema of it exists here, so neither the importer nor the
    reference (ONNX Runtime refuses to load it) can know what its operators mean."""
    newest = onnx.defs.onnx_opset_version()
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > newest:
            raise ModelError(f"{path}: opset {opset.version} is newer than any this onnx "
                             f"{onnx.__version__} defines (at most {newest})")


def import_onnx(model: onnx.ModelProto, shape_dict: dict | None = None,
                report: frontend.ImportReport | None = None,
                node_names: bool = False) -> tvm.IRModule:
    """:func:`tvm_fusion.frontend.from_onnx` with weights as constants; a node that cannot be
    imported is named, not traced.

    ``node_names=True`` spans every binding with the name of the ONNX node it came from
    (:mod:`tvm_fusion.onnx_names`: TVM's importer keeps none), for reports and pictures.

    Where ONNX's own strict shape inference rejects the model too (a rank-0 input where an
    operator needs a 1-D tensor, say), the message gives ONNX's reason: the model is at fault
    then, not TVM."""
    check_gather_indices(model)
    printed = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
            warnings.simplefilter("ignore")
            return frontend.from_onnx(model, shape_dict=shape_dict, keep_params_in_input=False,
                                      report=report, node_names=node_names)
    except frontend.FrontendError as err:
        where, reason = err.where, err.reason
        _free_quietly(err)  # the failed import's BlockBuilder logs a C++ warning when freed
    except Exception as err:  # noqa: BLE001 (the importer raises anything)
        where, reason = "TVM's ONNX importer", _first_line(err)
        _free_quietly(err)
    invalid = _strict_inference_error(model)
    if invalid:
        raise ModelError(f"invalid ONNX model at {where}: {invalid}")
    raise ModelError(f"{where}: {reason}")


def load_model(path: str | os.PathLike):
    """An ONNX file (:func:`load_onnx`) or a ``torch.export.save``\\ d program (``.pt2``,
    :class:`tvm_fusion.frontend.TorchProgram`)."""
    if frontend.is_program_path(path):
        try:
            return frontend.load_program(path)
        except frontend.FrontendError as err:
            raise ModelError(str(err)) from None
    return load_onnx(path)


def import_model(model, report: frontend.ImportReport | None = None,
                 node_names: bool = False) -> tvm.IRModule:
    """The Relax module of an ONNX model or a torch.export program (:func:`load_model`);
    ``node_names``: an ONNX model's bindings spanned by their node names (:func:`import_onnx`;
    a program's FX nodes are not named)."""
    if isinstance(model, frontend.TorchProgram):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return model.import_module(report=report)
        except frontend.FrontendError as err:
            _free_quietly(err)
            raise ModelError(f"{model.path}: {err}") from None
    return import_onnx(model, report=report, node_names=node_names)


def model_signature(model) -> onnx.ModelProto:
    """What feeds a model (:mod:`tvm_fusion.feeds`): an ONNX model itself; a program's inputs
    as an inputs-only ONNX graph."""
    return model.signature if isinstance(model, frontend.TorchProgram) else model


def default_sizes(model) -> dict[str, int]:
    """Run sizes of a model's symbols when the user names none: a program's inside its
    ranges (:meth:`~tvm_fusion.frontend.TorchProgram.default_sizes`); an ONNX model's from
    :func:`tvm_fusion.symbolic.var_size` (nothing here)."""
    return model.default_sizes() if isinstance(model, frontend.TorchProgram) else {}


def reference_outputs(model, feeds: dict) -> list[np.ndarray]:
    """The reference a build is checked against: ONNX Runtime for an ONNX model, PyTorch for
    a torch.export program."""
    if isinstance(model, frontend.TorchProgram):
        return model.reference(feeds)
    return onnx_reference(model, feeds)


def model_nodes(model) -> int:
    """Operators of the model as given (ONNX nodes, or FX operator nodes)."""
    return model.nodes if isinstance(model, frontend.TorchProgram) else len(model.graph.node)


def check_gather_indices(model: onnx.ModelProto) -> None:
    """``ModelError`` naming the first Gather whose constant indices fall outside its data's
    axis (ONNX allows ``[-n, n)``; TVM's ``take`` would read outside the tensor). Indices that
    come from the inputs are clamped by the build instead
    (:mod:`tvm_fusion.relay_passes.take_bounds`)."""
    graph = model.graph
    constants = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                constants[node.output[0]] = value
    gathers = [n for n in graph.node if n.op_type == "Gather" and len(n.input) > 1
               and n.input[1] in constants]
    if not gathers:
        return
    shapes = {t.name: list(t.dims) for t in graph.initializer}
    if any(n.input[0] not in shapes for n in gathers):
        try:
            inferred = onnx.shape_inference.infer_shapes(model).graph
        except Exception:  # noqa: BLE001 (the importer will say what is wrong)
            inferred = graph
        for vi in [*inferred.input, *inferred.value_info, *inferred.output]:
            dims = vi.type.tensor_type.shape.dim
            shapes.setdefault(vi.name, [d.dim_value if d.HasField("dim_value") else None
                                        for d in dims])
    for node in gathers:
        dims = shapes.get(node.input[0])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if not dims or not -len(dims) <= axis < len(dims) or not dims[axis]:
            continue
        extent = int(dims[axis])
        indices = onnx.numpy_helper.to_array(constants[node.input[1]]).astype(np.int64)
        bad = indices[(indices < -extent) | (indices >= extent)]
        if bad.size:
            raise ModelError(f"Gather {node.name or node.output[0]!r}: index {int(bad.flat[0])} "
                             f"is out of range for axis {axis} of {node.input[0]!r} (size "
                             f"{extent}; ONNX allows {-extent}..{extent - 1})")


def _strict_inference_error(model: onnx.ModelProto) -> str | None:
    """ONNX's strict shape inference's complaint about ``model``, if it has one."""
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except Exception as err:  # noqa: BLE001 (InferenceError, or a checker error)
        text = " ".join(_first_line(err).split())
        text = re.sub(r"\[\w*Error\] (Inference error\(s\): )?|\(op_type:\w+\):\s*", "", text)
        return text.strip() or None
    return None


def _free_quietly(err: BaseException) -> None:
    """Drop ``err``'s frames with the process's stderr (fd 2) muted, so native objects the
    failed import abandoned log their destructor warnings nowhere rather than next to our
    one-line error."""
    with filtered_stderr(noise=EVERYTHING):
        err.__traceback__ = None
        gc.collect()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def fuse(mod: tvm.IRModule, target="llvm", strategy: str | None = None, **options):
    """The module after fusion (``FuseTIR`` done, before VM lowering), for counting kernels.

    ``strategy`` overrides the one of an ``options=Options(...)`` object when given; without
    either it is ``"dnnfusion"``."""
    tgt = to_target(target)
    with tgt:
        return Sequential(tgt, **_with_strategy(strategy, options))(mod)


def _with_strategy(strategy: str | None, options: dict) -> dict:
    return options if strategy is None else {**options, "strategy": strategy}


def compile_model(mod: tvm.IRModule, target="llvm", strategy: str | None = None, **options):
    """Compile a Relax module to a VM executable.

    ``strategy="dnnfusion"`` (the default, or an ``options=Options(...)`` object's) uses the
    tvm_fusion pipeline; ``"tvm"`` without other options is the stock fused pipeline
    (``relax.get_default_pipeline``); ``"none"`` is ``tvm.compile``'s CPU default, which does
    not fuse.
    """
    tgt = to_target(target)
    require_codegen(tgt)
    if strategy == "none" or (strategy == "tvm" and not options):
        with filtered_stderr():  # stock TVM's native noise (take's warning) kept out too
            if strategy == "none":
                return tvm.compile(mod, tgt)
            return tvm.compile(mod, tgt, relax_pipeline=relax.get_default_pipeline(tgt))
    pipeline = get_pipeline(tgt, **_with_strategy(strategy, options))
    return tvm.compile(mod, tgt, relax_pipeline=pipeline)


def count_kernels(mod: tvm.IRModule) -> int:
    """Kernel launches per run: ``call_tir``/``call_dps_packed`` calls in Relax functions."""
    count = 0

    def visit(node):
        nonlocal count
        if isinstance(node, relax.Call) and isinstance(node.op, tvm.ir.Op) and (
            node.op.name in (_CALL_TIR, _CALL_DPS)
        ):
            count += 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return count


def run(executable, inputs: list[np.ndarray], device=None) -> list[np.ndarray]:
    """Run ``main`` on numpy inputs; always returns a list of numpy outputs."""
    device = device or tvm.cpu()
    vm = relax.VirtualMachine(executable, device)
    result = vm["main"](*[tvm.runtime.tensor(x, device) for x in inputs])
    return flatten_outputs(result)


def flatten_outputs(value) -> list[np.ndarray]:
    """A VM result (a tensor, or nested tuples of them) as a flat list of numpy arrays."""
    if hasattr(value, "numpy"):
        return [value.numpy()]
    out: list[np.ndarray] = []
    for item in value:
        out.extend(flatten_outputs(item))
    return out


def graph_input_names(model: onnx.ModelProto) -> list[str]:
    """The ONNX graph inputs that are fed at run time, in the order ``main`` takes them.

    ``from_onnx`` keeps this order but renames inputs that are not valid identifiers (``"0"``
    becomes ``input_0``), so feeds must be matched by position, never by the Relax name.
    """
    initializers = {init.name for init in model.graph.initializer}
    return [vi.name for vi in model.graph.input if vi.name not in initializers]

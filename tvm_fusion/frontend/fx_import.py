"""``torch.export`` programs → Relax through TVM 0.27's importer, shapes pinned to torch's.

TVM's ``ExportedProgramImporter`` converts each FX node with a function of its converter table
(``create_convert_map``, which subclasses may extend; ``custom_convert_map`` is the same table
from outside). Every FX node carries the shape torch's own symbolic shape propagation gave it
(``node.meta["val"]``, sizes as sympy expressions over the program's ``Dim``\\ s). Here every
converter of the table is wrapped:

* its result's shape is compared with torch's; where TVM inferred none, or another expression
  (``min(s53, 512)`` for a slice torch knows is ``s53`` long, because ``s53 <= 512`` is one of
  the program's range constraints), the result is match-cast to torch's shape, so the next
  node sees the model's shape (the "pin_shapes" repair);
* a failure is one line naming the FX node (:class:`.errors.FrontendError`).

Converters TVM lacks or gets wrong are in :mod:`.fx_repairs`.
"""

from __future__ import annotations

import functools
import warnings

import tvm
from tvm import relax, sym, tirx
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from . import fx_repairs
from .errors import FrontendError, reason_of
from .onnx_import import ImportReport

ALL_FX_REPAIRS = fx_repairs.ALL_FX_REPAIRS

__all__ = ["ALL_FX_REPAIRS", "PinningImporter", "from_exported_program"]


class PinningImporter(ExportedProgramImporter):
    """TVM's ExportedProgram importer with torch's shapes pinned and converter repairs."""

    def __init__(self, repairs=ALL_FX_REPAIRS, report: ImportReport | None = None):
        unknown = set(repairs) - ALL_FX_REPAIRS
        if unknown:
            raise ValueError(f"unknown repair {sorted(unknown)[0]!r}; known: "
                             f"{', '.join(sorted(ALL_FX_REPAIRS))}")
        self.repairs = frozenset(repairs)
        self.report = report if report is not None else ImportReport()
        self.symbols: dict[str, tirx.Var] = {}
        self.pins: list = []  # (FX node, TVM's shape or None, torch's shape)
        self.analyzer = sym.Analyzer()
        super().__init__()

    # -- TVM's hooks --------------------------------------------------------------------------

    def create_convert_map(self):
        table = dict(super().create_convert_map())
        for name, repair in fx_repairs.CONVERTERS.items():
            if repair.repair in self.repairs:
                table[name] = functools.partial(_counted, repair, self, table.get(name))
        return {name: self._wrap(name, fn) for name, fn in table.items()}

    def create_input_vars(self, exported_program):
        params, user_inputs, ranges = super().create_input_vars(exported_program)
        for var in list(user_inputs.values()) + list(params.values()):
            for dim in getattr(var.ty, "shape", None) or []:
                for free in tirx.analysis.undefined_vars(dim, []):
                    self.symbols.setdefault(free.name, free)
        for name, var in self.symbols.items():
            low, high = ranges.get(name, (0, None))
            self.analyzer.update(var, sym.ConstIntBound(int(low), int(high or 2**40)))
        return params, user_inputs, ranges

    def _check_unsupported_func_type(self, nodes):
        for node in nodes:
            if node.op == "call_function" and node.target.__name__ not in self.convert_map:
                raise FrontendError(_where(node), f"operator {node.target.__name__} is not "
                                                  f"supported by TVM's ExportedProgram importer")

    # -- one node -----------------------------------------------------------------------------

    def _wrap(self, name, fn):
        def convert(node, *rest):
            failure = None
            try:
                out = fn(node, *rest)
            except FrontendError:
                raise
            except Exception as err:  # noqa: BLE001 (TVM's converters raise anything)
                failure = FrontendError(_where(node), reason_of(err))
            if failure is not None:  # outside the handler: TVM's error is not its context
                raise failure
            if "pin_shapes" in self.repairs:
                out = self._pin(node, out)
            return out
        return convert

    def _pin(self, node, out):
        """``out`` match-cast to torch's shape for ``node`` where TVM's differs or is unknown."""
        val = node.meta.get("val")
        if not isinstance(out, relax.Expr) or not isinstance(getattr(out, "ty", None),
                                                             relax.TensorType):
            return out
        shape = getattr(val, "shape", None)
        if shape is None or not hasattr(val, "dtype"):
            return out
        dims = [self.to_prim(d) for d in shape]
        if any(d is None for d in dims):
            return out
        have = out.ty.shape
        if have is not None and len(have) == len(dims) and all(
                _same(h, d) for h, d in zip(have, dims)):
            return out
        if have is not None and len(have) != len(dims):
            return out  # a rank TVM chose differently (a squeezed scalar): not ours to change
        self.report.repairs["pin_shapes"] += 1
        self.pins.append((_where(node), None if have is None else list(have), dims))
        if have is not None:
            # TVM 0.27 segfaults compiling a match_cast from one shape expression to another
            # ((1, max(s, 0)) to (1, s), in KillAfterLastUse): forget the shape first
            out = self.block_builder.match_cast(out, relax.TensorType(ndim=len(dims),
                                                                      dtype=out.ty.dtype))
        return self.block_builder.match_cast(out, relax.TensorType(dims, out.ty.dtype))

    def to_prim(self, size):
        """A torch size (int, SymInt) as a TIR expression over the program's symbols."""
        import torch

        if isinstance(size, int):
            return tirx.IntImm("int64", size)
        if isinstance(size, torch.SymInt):
            return _sympy_to_tir(size.node.expr, self.symbols)
        return None


def _same(a, b) -> bool:
    """Equal without the program's bounds (``4 * s`` is ``s * 4``; ``min(s53, 512)`` is not
    ``s53``: it is under ``s53 <= 512``, but the next node's shape inference does not know
    that, so such a shape is pinned)."""
    return bool(sym.Analyzer().can_prove_equal(a, b))


def _counted(repair, importer, stock, node, *rest):
    """``repair``'s conversion of ``node``, counted; TVM's (``stock``) where it does not apply."""
    out = repair(importer, node)
    if out is None:
        if stock is None:
            raise FrontendError(_where(node), "is not supported by TVM's ExportedProgram "
                                              "importer")
        return stock(node, *rest)
    importer.report.repairs[repair.repair] += 1
    return out


def _sympy_to_tir(expr, symbols: dict):
    """A sympy size expression (torch's) as TIR; None for what has no TIR counterpart."""
    import sympy
    from torch.utils._sympy import functions as tf

    if isinstance(expr, sympy.Integer):
        return tirx.IntImm("int64", int(expr))
    if isinstance(expr, sympy.Symbol):
        return symbols.get(str(expr))
    args = [_sympy_to_tir(a, symbols) for a in expr.args]
    if any(a is None for a in args):
        return None
    if isinstance(expr, sympy.Add):
        return functools.reduce(lambda a, b: a + b, args)
    if isinstance(expr, sympy.Mul):
        return functools.reduce(lambda a, b: a * b, args)
    if isinstance(expr, tf.FloorDiv):
        return tirx.floordiv(*args)
    if isinstance(expr, (tf.Mod, tf.PythonMod)):
        return tirx.floormod(*args)
    if isinstance(expr, sympy.Min):
        return functools.reduce(tirx.min, args)
    if isinstance(expr, sympy.Max):
        return functools.reduce(tirx.max, args)
    if isinstance(expr, tf.CeilDiv if hasattr(tf, "CeilDiv") else ()):
        return tirx.floordiv(args[0] + args[1] - 1, args[1])
    return None


def _where(node) -> str:
    target = getattr(node.target, "__name__", str(node.target))
    return f"FX node {node.name!r} ({target})"


def from_exported_program(program, *, keep_params_as_input=False, run_decompositions=True,
                          repairs=ALL_FX_REPAIRS, report: ImportReport | None = None
                          ) -> tvm.IRModule:
    """Import a ``torch.export.ExportedProgram`` with TVM's importer and the repairs.

    As ``tvm.relax.frontend.torch.from_exported_program`` (decomposed to core ATen first);
    ``repairs`` selects repairs (:data:`ALL_FX_REPAIRS`) and ``report`` receives which applied.
    The returned ``main`` takes the user inputs and returns a tuple of the outputs. Raises
    :class:`FrontendError` naming the FX node that cannot be imported."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if run_decompositions:
            program = program.run_decompositions()
        importer = PinningImporter(repairs=repairs, report=report)
        mod = importer.from_exported_program(program, keep_params_as_input, False, False, None)
    if importer.report.repairs.get("unexpanded_weight"):
        # the weights' broadcast_to that fx_repairs.bmm_of_an_expanded_matrix left unused:
        # bound to constants, FoldConstant would still materialise them
        mod = relax.transform.DeadCodeElimination()(mod)
    return mod

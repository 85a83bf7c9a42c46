"""The options of a tvm_fusion build: one frozen, typed object, grouped per paper.

:class:`Options` holds every knob, in groups (:class:`Planning`, :class:`Rewriting`,
:class:`SmartMem`, :class:`OptiFX`, :class:`Apollo`, :class:`Scheduling`, :class:`Profiling`);
each field carries its type, accepted values and documentation (``docs/options.md`` is
generated from them: ``scripts/build_options_doc.py``). Options are knobs only: what passes
produce is collected by :class:`tvm_fusion.instrument.Collector`, and test hooks are arguments
of the pass that takes them.

Everything that reads an option from a user goes through here: :meth:`Options.from_kwargs`
for the Python API's flat keywords (``Sequential(target, **options)``, ``get_pipeline``,
``compile_model``) and :func:`parse_cli_option` for the command line's ``-O key=value``. Both
are strict, because a silently misread option is a wrong build that looks right: ``"false"``
is not true, ``2.5`` is not an integer, and every error is one line naming the option and the
values it accepts. A group validates its values when it is made, so an :class:`Options` is
always valid.

This module is a leaf (standard library only), so the CLI can check options before it imports
TVM or loads a model; the accepted values of the choice options repeat the passes' own
constants, and ``tests/test_options.py`` checks that they agree.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import numbers
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GROUPS", "OPTIONS", "PRESETS", "SCHEMA", "Apollo", "OptiFX", "Option", "OptionError",
           "Options", "Planning", "Preset", "Profiling", "Rewriting", "Scheduling", "SmartMem",
           "check_option", "parse_cli_option", "parse_cli_options", "parse_table3"]


@dataclass(frozen=True)
class Option:
    """One option: its type (``kind``), default, accepted values and documentation.

    ``kind`` is one of ``bool``, ``int``, ``float`` (finite numbers; ``low``/``high`` bound them,
    inclusive), ``choice`` (one of ``choices``), ``path`` (a file path or None), ``rules``
    (rewrite-rule names or None), ``table3`` (colour overrides or None) and ``sizes`` (symbolic
    dimension names to positive sizes, or None). ``group`` is the :class:`Options` field that
    holds it.
    """

    name: str
    kind: str
    default: Any
    choices: tuple = ()
    low: float | None = None
    high: float | None = None
    doc: str = ""
    group: str = ""

    def accepted(self, cli: bool = False) -> str:
        """The accepted values in words, for error messages and the docs."""
        if self.kind == "bool":
            return "true or false (or 1, 0)" if cli else "True or False"
        if self.kind in ("int", "float"):
            what = "an integer" if self.kind == "int" else "a finite number"
            if self.low is not None and self.high is not None:
                return f"{what} from {_num(self.low)} to {_num(self.high)}"
            if self.low is not None:
                return f"{what} >= {_num(self.low)}"
            return what
        if self.kind == "choice":
            return "one of: " + ", ".join(str(c) for c in self.choices)
        if self.kind == "path":
            return "a file path, or none" if cli else "a file path (str or PathLike) or None"
        if self.kind == "rules":
            return ("comma-separated rule names (docs/rewrite.md), or none for all rules" if cli
                    else "a list of rule names (docs/rewrite.md), or None for all rules")
        if self.kind == "table3":
            return (f"FIRST:SECOND=COLOUR[,...] (or a JSON object) with types "
                    f"{', '.join(TABLE3_TYPES)} and colours {', '.join(COLOURS)}")
        return ("NAME=SIZE[,...] (or a JSON object), sizes positive integers" if cli
                else "a mapping of dimension names to positive ints, or None")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# Accepted values of the choice options; each repeats a constant of the pass that reads it
# (named in the comment), which tests/test_options.py checks.
STRATEGIES = ("dnnfusion", "apollo", "tvm")  # relay_passes.plan_fusion.STRATEGIES
BROADCAST_POLICIES = ("expanding_only", "strict")  # relay_passes.mapping_type
SEED_POLICIES = ("o2o_then_rest", "paper")  # relay_passes.fusion_plan
LAYOUT_POLICIES = ("reduction", "vector")  # layout.smartmem.POLICIES
CONV_LAYOUTS = ("auto", "NCHWc", "NCHW")  # layout.conv_pack.POLICIES
PROFILE_MODES = ("db", "measure", "off")  # tuning.oracle.MODES
CONV_CHAINS = ("cost_model", "paper_1.05", "off")  # relay_passes.conv_chains.MODES
APOLLO_RULES = ("practical", "paper")  # relay_passes.apollo.PROFILES
APOLLO_BLOCKLIST = ("db", "memory")  # relay_passes.apollo_feedback.BLOCKLIST_MODES

# Table 3's row/column types (MappingType.short, without Opaque) and colours; other spellings
# that MappingType.parse / Colour.parse accept map onto these.
TABLE3_TYPES = ("O2O", "O2M", "M2M", "Reorg", "Shuffle")
_TYPE_ALIASES = {"O2O": "O2O", "ONE_TO_ONE": "O2O", "O2M": "O2M", "ONE_TO_MANY": "O2M",
                 "M2M": "M2M", "MANY_TO_MANY": "M2M", "REORG": "Reorg", "REORGANIZE": "Reorg",
                 "SHUFFLE": "Shuffle"}
COLOURS = ("green", "yellow", "red")
_COLOUR_ALIASES = {"green": "green", "fuse_through": "green", "yellow": "yellow",
                   "fuse_depend": "yellow", "red": "red", "fuse_break": "red"}


# ------------------------------------------------------------------------------ the options

def _opt(kind: str, default: Any, doc: str, choices: tuple = (), low: float | None = None,
         high: float | None = None):
    """A group's field: its default, and its type, accepted values and documentation as the
    field's metadata (from which :data:`SCHEMA` and docs/options.md are made)."""
    return field(default=default, metadata={"kind": kind, "choices": choices, "low": low,
                                            "high": high, "doc": doc})


class _Group:
    """A group of options: each value is checked and normalised when the group is made."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _check_value(_BY_NAME[f.name], getattr(self, f.name)))


@dataclass(frozen=True)
class Planning(_Group):
    """Which operators share a kernel (DNNFusion §4.3; docs/design.md)."""

    strategy: str = _opt(
        "choice", "dnnfusion", choices=STRATEGIES,
        doc="The planner: `dnnfusion` (DNNFusion §4.3), `apollo` (Apollo's partitioner with "
            "scheduler feedback; docs/apollo.md) or `tvm` (stock FuseOps, kept pure: rewriting "
            "and layout elimination apply only to ours, so a comparison isolates the planner).")
    broadcast_policy: str = _opt(
        "choice", "expanding_only", choices=BROADCAST_POLICIES,
        doc="When an elementwise operator that broadcasts is One-to-Many (DNNFusion Table 2, "
            "ambiguous; docs/design.md): `expanding_only`, only when no non-constant, "
            "non-scalar input already spans the output (`a[m,1] + b[1,n]`); `strict`, "
            "whenever it broadcasts (the table literally).")
    seed_policy: str = _opt(
        "choice", "o2o_then_rest", choices=SEED_POLICIES,
        doc="Where blocks are seeded (DNNFusion Listing 1): `o2o_then_rest` goes on seeding "
            "from the fusible operators left once no One-to-One operator is (Reorganize/Shuffle, "
            "then One-to-Many, then Many-to-Many), so a `transpose → matmul` pair still fuses; "
            "`paper` stops there, as the listing does.")
    prefer_epilogues: bool = _opt(
        "bool", True,
        doc="Ours: DNNFusion Listing 1 grows successors first, which makes an elementwise chain "
            "between two Many-to-Many operators the *second* one's prologue; `True` tries "
            "producers first, so it becomes the first one's epilogue, as FuseOps and "
            "SmartMem's Table 5 \"try fuse\" do; `False` is the listing (Figure 3's plan).")
    max_ops_per_block: int = _opt(
        "int", 64, low=1,
        doc="The most operators in one block: DNNFusion step 2.2's \"empirical threshold\" "
            "(its value is unpublished).")
    attention: bool = _opt(
        "bool", True,
        doc="Ours (beyond the papers): an attention — `Q·Kᵀ`, element-wise score arithmetic "
            "(scale, masks, biases), softmax, `·V`, with the reshapes, transposes and GQA "
            "broadcasts around it — is planned as one block, found from mapping types and the "
            "TIR, and generated as online softmax over key tiles (FlashAttention), so no score "
            "matrix is ever written; Table 3 would keep its three Many-to-Many operators apart "
            "(docs/attention.md). `strategy=\"dnnfusion\"` only.")
    table3: dict | None = _opt(
        "table3", None,
        doc="Overrides of DNNFusion Table 3 (colours rebuilt): `{(first, second): colour}` "
            "with types `O2O`, `O2M`, `M2M`, `Reorg`, `Shuffle` and colours `green`, "
            "`yellow`, `red`; on the command line `-O table3=O2M:M2M=green,...` (above).")
    symbolic_hint: dict | None = _opt(
        "sizes", None,
        doc="Ours: `{name: size}`, e.g. `{\"seq\": 128, \"batch\": 4}`, the size a symbolic "
            "dimension (an ONNX `dim_param`) is costed at wherever a number is needed (bytes, "
            "FLOPs, yellow cells, tile choices); the module itself stays symbolic and runs at "
            "every size. Unnamed dimensions: 1 for batch-like names (`batch`, `batch_size`, "
            "`bs`, `n`, `b`), 128 otherwise (`tvm_fusion/symbolic.py`).")


@dataclass(frozen=True)
class Rewriting(_Group):
    """Rewriting by mathematical properties, before legalisation (DNNFusion §4.2;
    docs/rewrite.md)."""

    rewrite: bool = _opt("bool", True, doc="Run `RewriteByMathProperties` (DNNFusion §4.2).")
    rewrite_rules: list | None = _opt(
        "rules", None,
        doc="The rules to use, by name (DNNFusion Table 4; docs/rewrite.md lists them); "
            "`None`: all rules.")
    allow_fp_reassociation: bool = _opt(
        "bool", True,
        doc="`False` keeps only the rewrites that are exact in IEEE arithmetic (DNNFusion "
            "notes, erratum 5): reassociation changes rounding, `Exp`/`Recip` merges overflow.")


@dataclass(frozen=True)
class SmartMem(_Group):
    """Data layout: SmartMem's layout-transform elimination before planning
    (docs/smartmem.md), and DNNFusion §6's packed conv layout."""

    layout: bool = _opt("bool", True, doc="Run SmartMem's `EliminateLayoutTransforms`.")
    layout_policy: str = _opt(
        "choice", "reduction", choices=LAYOUT_POLICIES,
        doc="Which dimension a consumer wants contiguous: `reduction` (SmartMem §3.2.2: its "
            "reduction dimension) or `vector` (the output's innermost axis; slower on our CPU "
            "schedules, docs/smartmem.md).")
    layout_copies: int = _opt(
        "int", 1, low=0,
        doc="Extra layouts a producer may write when its consumers want more than one "
            "(SmartMem's redundant copies).")
    fuse_epilogues: bool = _opt(
        "bool", True,
        doc="SmartMem Table 5's *try fuse*: an ILD&Variable operator and its single "
            "ILI&Variable consumer (bias, activation) fuse during the elimination, so the "
            "planner cannot make the consumer the next anchor's prologue instead.")
    conv_layout: str = _opt(
        "choice", "auto", choices=CONV_LAYOUTS,
        doc="How dense convs run on `llvm` targets. `auto`: a conv with a constant weight and "
            "static channels and map (the batch may be symbolic) runs as the packed "
            "GEMM (im2col panels, "
            "tvm_fusion/layout/gemm_pack.py; with `pack_weights`, every strategy but Apollo's, "
            "which plans the graph as imported), the others "
            "are packed to `NCHW{lanes}c` (DNNFusion §6; TVM's `ConvertLayout`, TOPI "
            "`conv2d_NCHWc`) unless the model has grouped/depthwise convs (a layout change on "
            "every dense/grouped edge) or `conv_chains` is on; `NCHWc` packs every dense conv; "
            "`NCHW` keeps the direct NCHW conv. Packing is `strategy=\"dnnfusion\"` only "
            "(Apollo plans the graph as imported); tvm_fusion/layout/conv_pack.py.")


@dataclass(frozen=True)
class OptiFX(_Group):
    """Chains of convolutions fused into one kernel (OptiFX; docs/optifx.md)."""

    conv_chains: str = _opt(
        "choice", "off", choices=CONV_CHAINS,
        doc="OptiFX Algorithm 1/2: conv→conv chains fused when the per-kernel roofline "
            "improves by 1.05 (`cost_model`), or by the literal aggregate-intensity rule "
            "(`paper_1.05`); with `profile=\"measure\"` every candidate chain is timed fused and "
            "as planned, and the measurement decides. `off` by default: small gains on CPU.")


@dataclass(frozen=True)
class Apollo(_Group):
    """Apollo's partitioner, for `strategy="apollo"` (docs/apollo.md)."""

    apollo_rules: str = _opt(
        "choice", "practical", choices=APOLLO_RULES,
        doc="Apollo Table 1's rules: `practical`, or `paper`, exactly the extracted table.")
    apollo_layers: int = _opt(
        "int", 3, low=1, high=3,
        doc="Apollo §4's layers: 1 is Layer I only, 2 adds memory stitching, 3 parallelism "
            "stitching.")
    apollo_max_branches: int = _opt(
        "int", 7, low=2, high=7,
        doc="At most this many branches per stitched kernel (Apollo Appendix A).")
    apollo_stitch_bytes: int = _opt(
        "int", 32 << 20, low=1,
        doc="Layer III's resource check (ours): the largest working set of a packed kernel, "
            "in bytes.")
    apollo_schedule_budget_s: float = _opt(
        "float", 60.0, low=0,
        doc="Apollo §3's \"reasonable time\": a schedule that takes longer splits its "
            "partition (notes §3.3).")
    apollo_feedback_rounds: int = _opt(
        "int", 4, low=1, doc="Plan/build rounds of the feedback loop, at most.")
    apollo_blocklist: str = _opt(
        "choice", "db", choices=APOLLO_BLOCKLIST,
        doc="Where merges the scheduler sent back are remembered: `db`, in `profile_db` (table "
            "`apollo_blocklist`), so later builds never try them; `memory`, this build only.")


@dataclass(frozen=True)
class Scheduling(_Group):
    """Fused code generation (DNNFusion §4.4; docs/codegen.md)."""

    schedule: bool = _opt(
        "bool", True,
        doc="CPU targets: `ScheduleFusedBlocks`, one loop nest per fused block.")
    fast_math: bool = _opt(
        "bool", True,
        doc="Ours: scheduled CPU code uses vectorisable float32 exp/erf/tanh/sigmoid; `False`: "
            "TVM's exact ones.")
    pack_weights: bool = _opt(
        "bool", True,
        doc="Ours, CPU targets, every strategy (`tvm` included, like the schedules): a matmul "
            "with a constant weight gets it packed at compile time into GEMM panels and the "
            "packed GEMM kernel (docs/codegen.md); `False`: the register-tile schedule reads the "
            "weight as it is.")
    integer_qdq_convs: bool = _opt(
        "bool", True,
        doc="Ours, x86 CPU targets, with `pack_weights`: a QDQ conv (DequantizeLinear → Conv → "
            "QuantizeLinear, int8 weights) sums in int32 (AVX512-VNNI, or vpmaddwd) in a kernel "
            "of its own that reads and writes the quantized tensors "
            "(`tvm_fusion/layout/int8_conv.py`, docs/codegen.md); `False`, and where it does not "
            "apply (the reason in the module's `tvm_fusion.int8_convs` notes): float32 sums.")
    fusion_guard: bool = _opt(
        "bool", True,
        doc="Ours: after the CPU schedules, a kernel of several operators whose loop nests are "
            "estimated to do more than its operators apart (plus the traffic fusion saves, at "
            "`flops_per_byte`) is planned apart again, with the reason `fusion_loses` "
            "(`tvm_fusion/relay_passes/fusion_guard.py`). `strategy=\"dnnfusion\"`; Apollo's "
            "feedback splits such a kernel by undoing its last merge.")
    guard_kept_intermediates: bool = _opt(
        "bool", False,
        doc="Ours, with `fusion_guard`: a kernel whose schedule keeps a whole intermediate as "
            "workspace (a GLU's `split(x·W)` product) is also split after that intermediate's "
            "producer, so that the planner can reuse storage for it (`kept_intermediate`). Off "
            "by default: on the zoo it raised YOLOv8-n's planned memory (6.68 → 6.88 MB) and "
            "MobileBERT measured 1.09× slower with it (docs/benchmarks.md).")


@dataclass(frozen=True)
class Profiling(_Group):
    """Yellow cells: whether a Table 3 \"fuse depending on profiling\" pair fuses (DNNFusion
    §4.3; docs/profiling.md)."""

    profile: str = _opt(
        "choice", "db", choices=PROFILE_MODES,
        doc="`db` looks the pair up in the profiling database (a missing database falls back "
            "to the analytic oracle and says so), `measure` also builds and times what is "
            "missing and stores it, `off` asks the analytic oracle only.")
    profile_db: str | None = _opt(
        "path", None,
        doc="The profiling database (its location is ours); `None`: `$TVM_FUSION_DB`, else "
            "`~/.cache/tvm_fusion/profiling.db`.")
    latency_model: str | None = _opt(
        "path", None,
        doc="Ours: a trained XGBoost latency model, asked when the database has no entry.")
    flops_per_byte: float = _opt(
        "float", 10.0, low=0,
        doc="The analytic oracle (ours), asked when nothing else decides: the recomputed FLOPs "
            "one saved byte of intermediate traffic pays for.")


@dataclass(frozen=True)
class Options:
    """Every option of a tvm_fusion build, by group; frozen, and valid once made.

    ``Options()`` is the defaults; :meth:`from_kwargs` takes the flat keywords of
    ``Sequential(target, **options)`` (and ``preset``); :meth:`replace` changes some.
    """

    planning: Planning = field(default_factory=Planning)
    rewriting: Rewriting = field(default_factory=Rewriting)
    smartmem: SmartMem = field(default_factory=SmartMem)
    optifx: OptiFX = field(default_factory=OptiFX)
    apollo: Apollo = field(default_factory=Apollo)
    scheduling: Scheduling = field(default_factory=Scheduling)
    profiling: Profiling = field(default_factory=Profiling)

    @classmethod
    def from_kwargs(cls, **options) -> Options:
        """Options from flat keywords (``strategy="apollo"``, ``layout=False``, ...), each
        checked; ``preset`` (:data:`PRESETS`) first, the others over it.

        Raises ``OptionError`` (a ``ValueError``) naming the first unknown option or bad value.
        """
        options = _expand_preset(options)
        unknown = sorted(set(options) - set(_BY_NAME))
        if unknown:
            _spec(unknown[0])
        return cls(**{group: GROUPS[group](**{name: options[name] for name in names
                                              if name in options})
                      for group, names in _NAMES.items()})

    @classmethod
    def preset(cls, name: str) -> Options:
        """The options of a preset (:data:`PRESETS`)."""
        return cls.from_kwargs(preset=name)

    def replace(self, **options) -> Options:
        """A copy with ``options`` (flat keywords, as :meth:`from_kwargs`) changed."""
        return Options.from_kwargs(**{**self.to_kwargs(), **_expand_preset(options)})

    def to_kwargs(self) -> dict[str, Any]:
        """Every option by its flat name: what :meth:`from_kwargs` takes back."""
        return {name: getattr(getattr(self, group), name)
                for group, names in _NAMES.items() for name in names}


#: The groups, by their field of :class:`Options`.
GROUPS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Options)}
_NAMES: dict[str, tuple[str, ...]] = {
    group: tuple(f.name for f in dataclasses.fields(cls)) for group, cls in GROUPS.items()}

#: Every option, group by group, as the fields declare it.
SCHEMA: tuple[Option, ...] = tuple(
    Option(f.name, default=f.default, group=group, **f.metadata)
    for group, cls in GROUPS.items() for f in dataclasses.fields(cls))
_BY_NAME = {o.name: o for o in SCHEMA}

#: Every option by its flat name, with its default (the paper's value where it gives one).
OPTIONS: dict[str, Any] = {o.name: o.default for o in SCHEMA}


@dataclass(frozen=True)
class Preset:
    """A named set of options (as ONNX Runtime's optimisation levels are); options given with
    it win over it."""

    sets: dict[str, Any]
    doc: str


PRESETS: dict[str, Preset] = {
    "conservative": Preset(
        {"allow_fp_reassociation": False, "fast_math": False, "profile": "off"},
        "Numerics closest to stock TVM's and a plan that depends on nothing but the model: "
        "only IEEE-exact rewrites, TVM's exact transcendental functions, yellow cells from the "
        "analytic oracle (no profiling database)."),
    "default": Preset({}, "The defaults."),
    "aggressive": Preset(
        {"conv_chains": "cost_model", "profile": "measure"},
        "Fewer kernels where launches dominate (GPUs, phones): OptiFX conv chains, and yellow "
        "cells and chains not in the profiling database built and timed on this machine "
        "during the build (which then takes longer)."),
}
_PRESET = Option("preset", "choice", None, tuple(PRESETS),
                 doc="A named set of options (`PRESETS`), applied before the others.")


class OptionError(ValueError):
    """A bad option name or value; the message names the option and what it accepts."""


# What became of the options that were outputs or hooks, for the error that names them.
_MOVED = {
    "record": "plans are collected by tvm_fusion.instrument.Collector",
    "rewrite_record": "rewrite statistics are collected by tvm_fusion.instrument.Collector",
    "apollo_fail_hook": "a test hook: ApolloFuse(fail_hook=...), or Sequential's "
                        "apollo_fail_hook argument",
}


def _spec(name: str) -> Option:
    if name == "preset":
        return _PRESET
    if name not in _BY_NAME:
        moved = f" ({_MOVED[name]})" if name in _MOVED else ""
        raise OptionError(f"unknown tvm_fusion option {name!r}{moved}; valid options: "
                          f"{', '.join(OPTIONS)}, preset")
    return _BY_NAME[name]


def _expand_preset(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with ``preset`` replaced by what it sets (the options given win)."""
    options = dict(options)
    if "preset" not in options:
        return options
    return {**PRESETS[_check_value(_PRESET, options.pop("preset"))].sets, **options}


def check_option(name: str, value: Any) -> Any:
    """One option's value, validated and normalised as :class:`Options` does.

    Numbers are normalised (an ``int`` for an integer option, a ``float`` for a float one) and
    ``table3`` becomes ``{(first, second): colour}`` with the canonical names.
    """
    return _check_value(_spec(name), value)


def _bad(opt: Option, value: Any, why: str, cli: bool = False) -> OptionError:
    return OptionError(f"option {opt.name}={value!r} {why}; accepted: {opt.accepted(cli)}")


def _check_value(opt: Option, value: Any) -> Any:
    kind = opt.kind
    if kind == "bool":
        if isinstance(value, bool) or _is_numpy_bool(value):
            return bool(value)
        raise _bad(opt, value, "is not a boolean")
    if kind == "int":
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise _bad(opt, value, "is not an integer")
        return _in_range(opt, int(value))
    if kind == "float":
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise _bad(opt, value, "is not a number")
        if not math.isfinite(float(value)):
            raise _bad(opt, value, "is not finite")
        return _in_range(opt, float(value))
    if kind == "choice":
        if value not in opt.choices:
            raise OptionError(f"option {opt.name}={value!r} is not one of: "
                              + ", ".join(str(c) for c in opt.choices))
        return value
    if value is None:  # the remaining kinds all default to None
        return None
    if kind == "path":
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
        raise _bad(opt, value, "is not a path")
    if kind == "rules":
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise _bad(opt, value, "is not a list of rule names")
        rules = list(value)
        for rule in rules:  # names (or Rule objects); the pass checks that the names exist
            if not isinstance(getattr(rule, "name", rule), str):
                raise _bad(opt, value, f"has {rule!r}, which is not a rule name")
        return rules
    if kind == "table3":
        return _check_table3(opt, value)
    # sizes
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, numbers.Integral) and not isinstance(v, bool)
            and v >= 1 for k, v in value.items()):
        raise _bad(opt, value, "is not a mapping of names to positive sizes")
    return {k: int(v) for k, v in value.items()}


def _is_numpy_bool(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def _in_range(opt: Option, number: int | float) -> int | float:
    if (opt.low is not None and number < opt.low) or (opt.high is not None and number > opt.high):
        raise _bad(opt, number, "is out of range")
    return number


def _check_table3(opt: Option, value: Any) -> dict[tuple[str, str], str]:
    if not isinstance(value, Mapping):
        raise _bad(opt, value, "is not a mapping {(first, second): colour}")
    table = {}
    for key, colour in value.items():
        pair = _split_pair(key) if isinstance(key, str) else key
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise OptionError(f"option table3: key {key!r} is not a (first, second) pair of "
                              f"types ({', '.join(TABLE3_TYPES)})")
        table[(_table3_type(pair[0]), _table3_type(pair[1]))] = _table3_colour(colour)
    return table


def _split_pair(text: str) -> list[str]:
    return [part.strip() for part in re.split(r"->|[:,]", text)]


def _table3_type(value: Any) -> str:
    if isinstance(value, enum.Enum):  # a MappingType member
        value = value.name
    text = str(value).strip().upper().replace("-", "_")
    if text == "OPAQUE":
        raise OptionError("option table3: Table 3 has no Opaque row or column (opaque "
                          "operators never fuse)")
    if text not in _TYPE_ALIASES:
        raise OptionError(f"option table3: unknown mapping type {value!r}; accepted: "
                          f"{', '.join(TABLE3_TYPES)}")
    return _TYPE_ALIASES[text]


def _table3_colour(value: Any) -> str:
    if isinstance(value, enum.Enum):  # a Colour member
        value = value.value
    text = str(value).strip().lower()
    if text not in _COLOUR_ALIASES:
        raise OptionError(f"option table3: unknown colour {value!r}; accepted: "
                          f"{', '.join(COLOURS)} (or fuse_through, fuse_depend, fuse_break)")
    return _COLOUR_ALIASES[text]


# ------------------------------------------------------------------------------ command line

_NONE = ("none", "null")
_TRUE, _FALSE = ("true", "1"), ("false", "0")
_INT = re.compile(r"[+-]?\d+")


def parse_cli_options(pairs: Iterable[str] | None) -> dict[str, Any]:
    """``-O key=value`` pairs as a dict of checked values (only the options given, ``preset``
    included: :meth:`Options.from_kwargs` applies it)."""
    options = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise OptionError(f"option {pair!r} must be KEY=VALUE (see docs/options.md)")
        key, text = pair.split("=", 1)
        options[key.strip()] = parse_cli_option(key.strip(), text)
    return options


def parse_cli_option(name: str, text: str) -> Any:
    """The value of ``-O name=text``, parsed by the option's type and checked.

    Booleans: ``true``/``false``/``1``/``0`` (any case). Integers: digits only. Floats: a
    finite number. Choices: the value itself. Paths: the text, ``none`` for None. Rule lists:
    comma-separated names or a JSON list, ``none`` for all rules. ``table3``: see
    :func:`parse_table3`.
    """
    opt = _spec(name)
    text = text.strip()
    kind = opt.kind
    if kind == "bool":
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise _bad(opt, text, "is not a boolean", cli=True)
    if kind == "int":
        if not _INT.fullmatch(text):
            raise _bad(opt, text, "is not an integer", cli=True)
        value: Any = int(text)
    elif kind == "float":
        try:
            value = float(text)
        except ValueError:
            raise _bad(opt, text, "is not a number", cli=True) from None
    elif kind in ("path", "rules", "table3", "sizes") and text.lower() in _NONE:
        return None
    elif kind == "sizes":
        value = _json(opt, text) if text.startswith("{") else _parse_sizes(opt, text)
    elif kind == "rules":
        value = _json(opt, text) if text.startswith("[") else [
            r.strip() for r in text.split(",") if r.strip()]
    elif kind == "table3":
        value = parse_table3(text)
    else:  # choice, path
        value = text
    try:
        return _check_value(opt, value)
    except OptionError as err:  # say what the command line accepts
        raise OptionError(str(err).replace(opt.accepted(), opt.accepted(cli=True))) from None


def _parse_sizes(opt: Option, text: str) -> dict[str, int]:
    sizes = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, size = item.partition("=")
        if not name.strip() or not _INT.fullmatch(size.strip()):
            raise _bad(opt, text, f"has {item!r}, not NAME=SIZE", cli=True)
        sizes[name.strip()] = int(size)
    return sizes


def parse_table3(text: str) -> dict[tuple[str, str], str]:
    """``table3`` from its command-line text, as ``{(first, second): colour}``.

    ``O2M:M2M=green,M2M:M2M=yellow``; or a JSON object ``{"O2M:M2M": "green"}`` (``,`` or
    ``->`` between the types also do); or a JSON list of ``[first, second, colour]`` triples.
    Types are ``O2O, O2M, M2M, Reorg, Shuffle`` (any case), colours ``green, yellow, red``.
    """
    opt = _BY_NAME["table3"]
    text = text.strip()
    if text.startswith("{"):
        value = _json(opt, text)
    elif text.startswith("["):
        triples = _json(opt, text)
        if not isinstance(triples, list) or not all(
                isinstance(t, list) and len(t) == 3 for t in triples):
            raise _bad(opt, text, "is not a list of [first, second, colour] triples", cli=True)
        value = {(a, b): c for a, b, c in triples}
    else:
        value = {}
        for entry in filter(None, (e.strip() for e in text.split(","))):
            pair, sep, colour = entry.partition("=")
            first, colon, second = pair.partition(":")
            if not (sep and colon):
                raise OptionError(f"option table3: entry {entry!r} is not FIRST:SECOND=COLOUR; "
                                  f"accepted: {opt.accepted(cli=True)}")
            value[(first, second)] = colour
    return _check_table3(opt, value)


def _json(opt: Option, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise OptionError(f"option {opt.name}: {text!r} is not valid JSON ({err})") from None


"""The options of ``Sequential``: one table of names, types, accepted values and defaults.

Everything that reads an option from a user goes through here: :func:`check_options` for the
Python API (``Sequential(target, **options)``, ``get_pipeline``, ``compile_model``) and
:func:`parse_cli_option` for the command line's ``-O key=value``. Both are strict, because a
silently misread option is a wrong build that looks right: ``"false"`` is not true, ``2.5`` is
not an integer, and every error is one line naming the option and the values it accepts.

This module is a leaf (standard library only), so the CLI can check options before it imports
TVM or loads a model; the accepted values of the choice options repeat the passes' own
constants, and ``tests/test_options.py`` checks that they agree.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["OPTIONS", "SCHEMA", "Option", "check_option", "check_options", "parse_cli_option",
           "parse_cli_options", "parse_table3"]


@dataclass(frozen=True)
class Option:
    """One option: its type (``kind``), default, accepted values and whether ``-O`` sets it.

    ``kind`` is one of ``bool``, ``int``, ``float`` (finite numbers; ``low``/``high`` bound them,
    inclusive), ``choice`` (one of ``choices``), ``path`` (a file path or None), ``rules``
    (rewrite-rule names or None), ``table3`` (colour overrides or None), ``sizes`` (symbolic
    dimension names to positive sizes, or None), ``list`` (an output
    list, Python only) and ``hook`` (a callable, Python only).
    """

    name: str
    kind: str
    default: Any
    choices: tuple = ()
    low: float | None = None
    high: float | None = None
    doc: str = ""

    @property
    def cli(self) -> bool:
        """Whether ``-O`` can set it: outputs and hooks are Python objects."""
        return self.kind not in ("list", "hook")

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
        if self.kind == "sizes":
            return ("NAME=SIZE[,...] (or a JSON object), sizes positive integers" if cli
                    else "a mapping of dimension names to positive ints, or None")
        if self.kind == "list":
            return "a list (Python API only) or None"
        return "a callable (Python API only) or None"


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

_O = Option
SCHEMA: tuple[Option, ...] = (
    _O("strategy", "choice", "dnnfusion", STRATEGIES, doc="tvm: stock FuseOps, for comparison"),
    _O("broadcast_policy", "choice", "expanding_only", BROADCAST_POLICIES,
       doc="strict: the paper's Table 2 literally"),
    _O("seed_policy", "choice", "o2o_then_rest", SEED_POLICIES),
    _O("prefer_epilogues", "bool", True,
       doc="an elementwise chain between two anchors becomes the first one's epilogue"),
    _O("max_ops_per_block", "int", 64, low=1, doc="the paper's unnamed empirical threshold"),
    _O("table3", "table3", None, doc="{(first, second): colour} overrides of Table 3"),
    _O("flops_per_byte", "float", 10.0, low=0,
       doc="analytic yellow-cell oracle: recompute FLOPs one saved byte pays for"),
    _O("record", "list", None, doc="each run appends its ModulePlan (for reports)"),
    _O("schedule", "bool", True, doc="CPU targets: one loop nest per fused block"),
    _O("fast_math", "bool", True, doc="scheduled CPU code: vectorisable exp/erf/tanh/sigmoid"),
    _O("rewrite", "bool", True, doc="DNNFusion 4.2: RewriteByMathProperties"),
    _O("rewrite_rules", "rules", None, doc="rule names (None: all); docs/rewrite.md"),
    _O("allow_fp_reassociation", "bool", True, doc="False: only IEEE-exact rewrites"),
    _O("rewrite_record", "list", None, doc="each run appends its RewriteStats"),
    _O("layout", "bool", True, doc="SmartMem: EliminateLayoutTransforms before planning"),
    _O("layout_policy", "choice", "reduction", LAYOUT_POLICIES),
    _O("layout_copies", "int", 1, low=0,
       doc="extra layouts a producer may write for several consumers"),
    _O("conv_layout", "choice", "auto", CONV_LAYOUTS),
    _O("profile", "choice", "db", PROFILE_MODES, doc="yellow cells: look up, measure, or off"),
    _O("profile_db", "path", None, doc="None: $TVM_FUSION_DB or ~/.cache"),
    _O("latency_model", "path", None, doc="a trained XGBoost latency model"),
    _O("symbolic_hint", "sizes", None,
       doc="{name: size}: the sizes symbolic dims are costed at (tvm_fusion.symbolic)"),
    _O("conv_chains", "choice", "off", CONV_CHAINS, doc="OptiFX conv->conv chains"),
    _O("apollo_rules", "choice", "practical", APOLLO_RULES),
    _O("apollo_layers", "int", 3, low=1, high=3),
    _O("apollo_max_branches", "int", 7, low=2, high=7),
    _O("apollo_stitch_bytes", "int", 32 << 20, low=1),
    _O("apollo_schedule_budget_s", "float", 60.0, low=0),
    _O("apollo_feedback_rounds", "int", 4, low=1),
    _O("apollo_blocklist", "choice", "db", APOLLO_BLOCKLIST),
    _O("apollo_fail_hook", "hook", None, doc="fail_hook(name, primfunc) -> bool (tests)"),
)
del _O
_BY_NAME = {o.name: o for o in SCHEMA}

# Every option of Sequential with its default (the paper's value where it gives one).
OPTIONS: dict[str, Any] = {o.name: o.default for o in SCHEMA}


class OptionError(ValueError):
    """A bad option name or value; the message names the option and what it accepts."""


def _option(name: str) -> Option:
    if name not in _BY_NAME:
        raise OptionError(
            f"unknown tvm_fusion option {name!r}; valid options: {', '.join(OPTIONS)}")
    return _BY_NAME[name]


def check_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Every option with its default, ``options`` validated and normalised over them.

    Raises ``OptionError`` (a ``ValueError``) naming the first unknown option or bad value.
    Numbers are normalised (an ``int`` for an integer option, a ``float`` for a float one) and
    ``table3`` becomes ``{(first, second): colour}`` with the canonical names.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        _option(unknown[0])
    merged = dict(OPTIONS)
    for name, value in options.items():
        merged[name] = _check_value(_BY_NAME[name], value)
    return merged


def check_option(name: str, value: Any) -> Any:
    """One option's value, validated and normalised as :func:`check_options` does."""
    return _check_value(_option(name), value)


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
    if kind == "sizes":
        if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, numbers.Integral) and not isinstance(v, bool)
                and v >= 1 for k, v in value.items()):
            raise _bad(opt, value, "is not a mapping of names to positive sizes")
        return {k: int(v) for k, v in value.items()}
    if kind == "list":
        if callable(getattr(value, "append", None)):
            return value
        raise _bad(opt, value, "is not a list")
    if callable(value):  # hook
        return value
    raise _bad(opt, value, "is not callable")


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
    """``-O key=value`` pairs as a dict of checked values (only the options given)."""
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
    opt = _option(name)
    text = text.strip()
    kind = opt.kind
    if not opt.cli:
        raise OptionError(f"option {name} cannot be set on the command line; accepted: "
                          f"{opt.accepted()}")
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


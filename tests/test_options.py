"""Options are checked strictly: types, accepted values, the CLI's syntax of each type; the
typed object, its presets, and docs/options.md generated from it."""

import re
from pathlib import Path

import numpy as np
import pytest
from script_module import load_script

from tvm_fusion import options as opt
from tvm_fusion.options import OPTIONS, Options, parse_cli_option, parse_cli_options

ROOT = Path(__file__).parents[1]


def test_transform_keeps_exporting_the_defaults():
    from tvm_fusion import transform

    assert transform.OPTIONS is OPTIONS
    assert OPTIONS["max_ops_per_block"] == 64 and OPTIONS["table3"] is None
    assert Options().to_kwargs() == OPTIONS


def test_choices_repeat_the_passes_constants():
    from tvm_fusion.layout.conv_pack import POLICIES as CONV_LAYOUTS
    from tvm_fusion.layout.smartmem import POLICIES as LAYOUT_POLICIES
    from tvm_fusion.relay_passes.apollo.feedback import BLOCKLIST_MODES
    from tvm_fusion.relay_passes.apollo.partition import PROFILES as APOLLO_RULES
    from tvm_fusion.relay_passes.fusion_plan import SEED_POLICIES
    from tvm_fusion.relay_passes.fusion_table import Colour
    from tvm_fusion.relay_passes.mapping_type import BROADCAST_POLICIES, MappingType
    from tvm_fusion.relay_passes.optifx import MODES as CONV_CHAINS
    from tvm_fusion.relay_passes.plan_fusion import STRATEGIES
    from tvm_fusion.tuning.oracle import MODES as PROFILE_MODES

    for ours, theirs in [(opt.STRATEGIES, STRATEGIES), (opt.SEED_POLICIES, SEED_POLICIES),
                         (opt.BROADCAST_POLICIES, BROADCAST_POLICIES),
                         (opt.LAYOUT_POLICIES, LAYOUT_POLICIES), (opt.CONV_LAYOUTS, CONV_LAYOUTS),
                         (opt.PROFILE_MODES, PROFILE_MODES), (opt.CONV_CHAINS, CONV_CHAINS),
                         (opt.APOLLO_BLOCKLIST, BLOCKLIST_MODES),
                         (opt.APOLLO_RULES, APOLLO_RULES)]:
        assert set(ours) == set(theirs)
    assert set(opt.TABLE3_TYPES) == {m.short for m in MappingType if m != MappingType.OPAQUE}
    assert set(opt.COLOURS) == {c.value for c in Colour}
    for alias, short in opt._TYPE_ALIASES.items():  # every spelling means the same type
        assert MappingType.parse(alias).short == short


@pytest.mark.parametrize("name, value, message", [
    ("rewrite", "maybe", "option rewrite='maybe' is not a boolean; accepted: True or False"),
    ("fast_math", "False", "option fast_math='False' is not a boolean"),
    ("layout", 1, "option layout=1 is not a boolean"),
    ("max_ops_per_block", 2.5, "option max_ops_per_block=2.5 is not an integer"),
    ("max_ops_per_block", "8", "is not an integer; accepted: an integer >= 1"),
    ("max_ops_per_block", 0, "option max_ops_per_block=0 is out of range"),
    ("max_ops_per_block", True, "is not an integer"),
    ("apollo_max_branches", 9, "accepted: an integer from 2 to 7"),
    ("flops_per_byte", "10", "option flops_per_byte='10' is not a number"),
    ("flops_per_byte", float("nan"), "is not finite"),
    ("strategy", "fastest", "option strategy='fastest' is not one of: dnnfusion, apollo, tvm"),
    ("profile_db", 3, "option profile_db=3 is not a path"),
    ("rewrite_rules", "mul_merge_exp", "is not a list of rule names"),
    ("record", (), "unknown tvm_fusion option 'record' (plans are collected by "
                   "tvm_fusion.instrument.Collector)"),
    ("apollo_fail_hook", "x", "unknown tvm_fusion option 'apollo_fail_hook' (a test hook"),
    ("preset", "fastest", "option preset='fastest' is not one of: conservative, default"),
    ("table3", [("O2M", "M2M", "green")], "is not a mapping"),
    ("table3", {("O2M", "M2X"): "green"}, "unknown mapping type 'M2X'"),
    ("table3", {("O2M", "Opaque"): "green"}, "no Opaque row or column"),
    ("table3", {("O2M", "M2M"): "blue"}, "unknown colour 'blue'"),
    ("table3", {("O2M",): "green"}, "not a (first, second) pair"),
    ("bogus", 1, "unknown tvm_fusion option 'bogus'; valid options: strategy"),
])
def test_python_values_are_checked(name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Options.from_kwargs(**{name: value})


def test_python_values_are_normalised():
    from tvm_fusion.relay_passes.fusion_table import Colour, FusionTable
    from tvm_fusion.relay_passes.mapping_type import MappingType

    options = Options.from_kwargs(
        max_ops_per_block=np.int64(8), flops_per_byte=3, layout=np.bool_(False),
        profile_db=Path("/tmp/x.db"), table3={("o2m", "MANY_TO_MANY"): "fuse_through",
                                              "M2M:M2M": Colour.YELLOW,
                                              (MappingType.REORGANIZE, "Shuffle"): "red"})
    got = options.to_kwargs()
    assert got["max_ops_per_block"] == 8 and type(got["max_ops_per_block"]) is int
    assert got["flops_per_byte"] == 3.0 and type(got["flops_per_byte"]) is float
    assert got["layout"] is False and got["profile_db"] == "/tmp/x.db"
    assert got["table3"] == {("O2M", "M2M"): "green", ("M2M", "M2M"): "yellow",
                             ("Reorg", "Shuffle"): "red"}
    table = FusionTable(got["table3"])  # the canonical names are what FusionTable takes
    assert table.lookup(MappingType.ONE_TO_MANY, MappingType.MANY_TO_MANY).colour is Colour.GREEN
    assert Options.from_kwargs(**got) == options  # checking twice is a no-op
    assert options.planning.max_ops_per_block == 8 and options.smartmem.layout is False


def test_sequential_rejects_bad_values():
    from tvm_fusion.transform import Sequential

    with pytest.raises(ValueError, match="option rewrite='maybe' is not a boolean"):
        Sequential("llvm", rewrite="maybe")
    with pytest.raises(ValueError, match="option max_ops_per_block=2.5 is not an integer"):
        Sequential("llvm", max_ops_per_block=2.5)


@pytest.mark.parametrize("name, text, value", [
    ("rewrite", "true", True), ("rewrite", "False", False), ("layout", "0", False),
    ("fast_math", "1", True), ("fast_math", "TRUE", True),
    ("max_ops_per_block", "8", 8), ("layout_copies", "0", 0),
    ("flops_per_byte", "2.5", 2.5), ("flops_per_byte", "3", 3.0),
    ("apollo_schedule_budget_s", "1e-1", 0.1),
    ("strategy", "apollo", "apollo"), ("conv_chains", "paper_1.05", "paper_1.05"),
    ("profile_db", "/tmp/p.db", "/tmp/p.db"), ("profile_db", "none", None),
    ("rewrite_rules", "mul_merge_exp, add_merge_log", ["mul_merge_exp", "add_merge_log"]),
    ("rewrite_rules", '["mul_merge_exp"]', ["mul_merge_exp"]), ("rewrite_rules", "null", None),
    ("table3", "O2M:M2M=green,M2M:M2M=yellow",
     {("O2M", "M2M"): "green", ("M2M", "M2M"): "yellow"}),
    ("table3", "reorg:o2m=Fuse_Through", {("Reorg", "O2M"): "green"}),
    ("table3", '{"O2M,M2M": "green", "M2M->M2M": "red"}',
     {("O2M", "M2M"): "green", ("M2M", "M2M"): "red"}),
    ("table3", '[["O2M", "M2M", "yellow"]]', {("O2M", "M2M"): "yellow"}),
    ("table3", "none", None),
    ("symbolic_hint", "seq=128,batch=4", {"seq": 128, "batch": 4}),
    ("symbolic_hint", '{"seq": 3}', {"seq": 3}), ("symbolic_hint", "none", None),
])
def test_cli_syntax_of_each_type(name, text, value):
    assert parse_cli_option(name, text) == value


@pytest.mark.parametrize("pair, message", [
    ("rewrite=maybe", "option rewrite='maybe' is not a boolean; accepted: true or false"),
    ("fast_math=yes", "option fast_math='yes' is not a boolean"),
    ("max_ops_per_block=2.5", "option max_ops_per_block='2.5' is not an integer"),
    ("max_ops_per_block=abc", "option max_ops_per_block='abc' is not an integer"),
    ("max_ops_per_block=1e3", "is not an integer"),
    ("apollo_layers=4", "option apollo_layers=4 is out of range; accepted: an integer from 1"),
    ("flops_per_byte=abc", "option flops_per_byte='abc' is not a number"),
    ("flops_per_byte=inf", "is not finite"),
    ("seed_policy=Paper", "option seed_policy='Paper' is not one of: o2o_then_rest, paper"),
    ("table3=O2M:M2M", "entry 'O2M:M2M' is not FIRST:SECOND=COLOUR"),
    ("table3=O2M=green", "entry 'O2M=green' is not FIRST:SECOND=COLOUR"),
    ('table3={"O2M,M2M": "blue"}', "unknown colour 'blue'"),
    ('table3={"O2M": "green"}', "key 'O2M' is not a (first, second) pair"),
    ('table3={"O2M,M2M": ', "option table3: '{\"O2M,M2M\":' is not valid JSON"),
    ('table3=[["O2M", "M2M"]]', "is not a list of [first, second, colour] triples"),
    ("record=[]", "unknown tvm_fusion option 'record' (plans are collected by"),
    ("apollo_fail_hook=x", "unknown tvm_fusion option 'apollo_fail_hook'"),
    ("preset=fast", "option preset='fast' is not one of: conservative, default, aggressive"),
    ("no_equals_sign", "option 'no_equals_sign' must be KEY=VALUE"),
    ("bogus=1", "unknown tvm_fusion option 'bogus'"),
    ("symbolic_hint=seq=abc", "option symbolic_hint='seq=abc' has 'seq=abc', not NAME=SIZE"),
    ("symbolic_hint=seq=0", "is not a mapping of names to positive sizes"),
])
def test_cli_errors_name_the_option_and_accepted_values(pair, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        parse_cli_options([pair])
    assert "\n" not in str(info.value)


def test_docs_list_every_option_with_its_cli_syntax():
    text = (ROOT / "docs" / "options.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", text, flags=re.M))
    assert rows == set(OPTIONS)
    assert "O2M:M2M=green" in text and "true`, `false`, `1`, `0`" in text


# ------------------------------------------------------------------- the typed object, presets

def test_every_option_is_one_field_of_one_group():
    import dataclasses

    fields = [f.name for cls in opt.GROUPS.values() for f in dataclasses.fields(cls)]
    assert sorted(fields) == sorted(OPTIONS) and len(fields) == len(set(fields))
    assert set(opt.GROUPS) == {f.name for f in dataclasses.fields(Options)}
    options = Options.from_kwargs(strategy="apollo", layout_copies=np.int64(2),
                                  fuse_epilogues=False, apollo_layers=1)
    assert options.planning.strategy == "apollo" and options.apollo.apollo_layers == 1
    assert options.smartmem.layout_copies == 2 and options.smartmem.fuse_epilogues is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.planning.strategy = "tvm"


def test_groups_check_their_values_when_made():
    """An Options is valid however it is made: a group checks its fields itself."""
    with pytest.raises(ValueError, match=re.escape("option layout_copies=-1 is out of range")):
        opt.SmartMem(layout_copies=-1)
    with pytest.raises(ValueError, match="option strategy='fastest' is not one of"):
        Options(planning=opt.Planning(strategy="fastest"))
    assert opt.Profiling(flops_per_byte=3).flops_per_byte == 3.0


def test_replace_changes_only_what_it_names():
    base = Options.from_kwargs(layout=False)
    changed = base.replace(max_ops_per_block=8)
    assert (changed.smartmem.layout, changed.planning.max_ops_per_block) == (False, 8)
    assert base.planning.max_ops_per_block == 64  # frozen: a new object
    with pytest.raises(ValueError, match="unknown tvm_fusion option 'bogus'"):
        base.replace(bogus=1)


@pytest.mark.parametrize("name, changed", [
    ("conservative", {"allow_fp_reassociation": False, "fast_math": False, "profile": "off"}),
    ("default", {}),
    ("aggressive", {"conv_chains": "cost_model", "profile": "measure"}),
])
def test_presets_set_exactly_what_the_docs_say(name, changed):
    got = Options.preset(name).to_kwargs()
    assert {k: v for k, v in got.items() if OPTIONS[k] != v} == changed
    assert Options.from_kwargs(preset=name) == Options.preset(name)


def test_options_given_with_a_preset_win():
    options = Options.from_kwargs(preset="conservative", fast_math=True)
    assert options.scheduling.fast_math is True and options.profiling.profile == "off"
    pairs = parse_cli_options(["preset=aggressive", "profile=off"])
    assert Options.from_kwargs(**pairs).profiling.profile == "off"
    assert Options.from_kwargs(**pairs).optifx.conv_chains == "cost_model"


def test_sequential_takes_the_object_and_names_over_it():
    from tvm_fusion.target import host_target
    from tvm_fusion.transform import Sequential

    Sequential(host_target(), Options.preset("conservative"), layout=False)
    with pytest.raises(ValueError, match="option layout_copies=-1 is out of range"):
        Sequential(host_target(), Options(), layout_copies=-1)


def test_docs_are_generated_from_the_fields():
    build = load_script("build_options_doc")
    text = (ROOT / "docs" / "options.md").read_text()
    assert build.render(text) == text, "docs/options.md is stale: run scripts/build_options_doc.py"
    for preset in opt.PRESETS:
        assert f"| {preset} |" in text


def test_an_options_object_keeps_its_strategy_through_fuse_and_compile_model():
    """``fuse``/``compile_model`` have a ``strategy`` argument of their own: left out, the
    object's strategy holds; given, it wins (it used to overwrite the object's with its
    default)."""
    from tvm_fusion.compile import count_kernels, fuse, import_onnx
    from tvm_fusion.models import transformer_encoder_layer

    mod = import_onnx(transformer_encoder_layer())
    stock = Options.from_kwargs(strategy="tvm")
    assert (count_kernels(fuse(mod, "llvm", options=stock))
            == count_kernels(fuse(mod, "llvm", strategy="tvm")))
    assert (count_kernels(fuse(mod, "llvm", "dnnfusion", options=stock))
            == count_kernels(fuse(mod, "llvm")))
    assert count_kernels(fuse(mod, "llvm", options=stock)) != count_kernels(fuse(mod, "llvm"))

"""Options are checked strictly: types, accepted values, the CLI's syntax of each type."""

import re
from pathlib import Path

import numpy as np
import pytest

from tvm_fusion import options as opt
from tvm_fusion.options import OPTIONS, check_options, parse_cli_option, parse_cli_options


def test_transform_keeps_exporting_the_defaults():
    from tvm_fusion import transform

    assert transform.OPTIONS is OPTIONS
    assert OPTIONS["max_ops_per_block"] == 64 and OPTIONS["table3"] is None
    assert check_options({}) == OPTIONS


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
    ("record", (), "option record=() is not a list"),
    ("apollo_fail_hook", "x", "is not callable"),
    ("table3", [("O2M", "M2M", "green")], "is not a mapping"),
    ("table3", {("O2M", "M2X"): "green"}, "unknown mapping type 'M2X'"),
    ("table3", {("O2M", "Opaque"): "green"}, "no Opaque row or column"),
    ("table3", {("O2M", "M2M"): "blue"}, "unknown colour 'blue'"),
    ("table3", {("O2M",): "green"}, "not a (first, second) pair"),
    ("bogus", 1, "unknown tvm_fusion option 'bogus'; valid options: strategy"),
])
def test_python_values_are_checked(name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_options({name: value})


def test_python_values_are_normalised():
    from tvm_fusion.relay_passes.fusion_table import Colour, FusionTable
    from tvm_fusion.relay_passes.mapping_type import MappingType

    got = check_options({"max_ops_per_block": np.int64(8), "flops_per_byte": 3,
                         "layout": np.bool_(False), "profile_db": Path("/tmp/x.db"),
                         "table3": {("o2m", "MANY_TO_MANY"): "fuse_through",
                                    "M2M:M2M": Colour.YELLOW,
                                    (MappingType.REORGANIZE, "Shuffle"): "red"}})
    assert got["max_ops_per_block"] == 8 and type(got["max_ops_per_block"]) is int
    assert got["flops_per_byte"] == 3.0 and type(got["flops_per_byte"]) is float
    assert got["layout"] is False and got["profile_db"] == "/tmp/x.db"
    assert got["table3"] == {("O2M", "M2M"): "green", ("M2M", "M2M"): "yellow",
                             ("Reorg", "Shuffle"): "red"}
    table = FusionTable(got["table3"])  # the canonical names are what FusionTable takes
    assert table.lookup(MappingType.ONE_TO_MANY, MappingType.MANY_TO_MANY).colour is Colour.GREEN
    assert check_options(got) == got  # checking twice (Sequential, then its planner) is a no-op


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
    ("record=[]", "option record cannot be set on the command line"),
    ("apollo_fail_hook=x", "option apollo_fail_hook cannot be set on the command line"),
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
    text = (Path(__file__).parents[1] / "docs" / "options.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", text, flags=re.M))
    assert rows == set(OPTIONS)
    assert "O2M:M2M=green" in text and "true`, `false`, `1`, `0`" in text

"""Results of passes reach every Collector whose PassContext is active, and only those."""

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion.instrument import Collector, emit


@tvm.transform.module_pass(opt_level=0, name="test.EmitPlan")
def _emit_plan(mod, _ctx):
    emit("plans", "plan")
    return mod


@I.ir_module
class _Module:
    @R.function
    def main(x: R.Tensor((2,), "float32")) -> R.Tensor((2,), "float32"):
        return x


def test_collectors_receive_while_their_context_is_active():
    outer, inner = Collector(), Collector()
    _emit_plan(_Module)  # no collector: dropped
    with tvm.transform.PassContext(instruments=[outer]):
        _emit_plan(_Module)
        with tvm.transform.PassContext(instruments=[inner]):  # nested: both receive
            _emit_plan(_Module)
        with tvm.transform.PassContext(instruments=[outer]):  # twice active: once
            _emit_plan(_Module)
    _emit_plan(_Module)  # after the context: nothing
    assert outer.plans == ["plan"] * 3 and inner.plans == ["plan"]
    assert not outer.rewrite_stats and not outer.layout_blocks and not outer.texture_decisions


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="unknown result kind 'plan'"):
        emit("plan", None)


def test_a_failed_build_leaves_no_collector_active():
    collector = Collector()
    with pytest.raises(RuntimeError), tvm.transform.PassContext(instruments=[collector]):
        raise RuntimeError("the build failed")
    _emit_plan(_Module)
    assert collector.plans == []

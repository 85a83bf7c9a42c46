"""Random ONNX DAGs for property tests of the fusion planner (a hypothesis strategy)."""

from __future__ import annotations

import math

import numpy as np
import onnx

from ..models.graph import GraphBuilder, live_nodes

__all__ = ["random_dag_models"]


_MAX_ELEMS = 4096  # keeps every intermediate small so a property-test example runs in ~ms
_MAX_BOUND = 1e3  # rough |value| ceiling; ops that could exceed it are not drawn


class _DagBuilder(GraphBuilder):
    """Bookkeeping for one random DAG: tensors with shapes and a crude magnitude bound."""

    def __init__(self, rng: np.random.Generator):
        super().__init__("random_dag")
        self.rng = rng
        self.shape: dict[str, tuple[int, ...]] = {}
        self.bound: dict[str, float] = {}
        self.order: list[str] = []  # tensors available as operands, in creation order

    def unread(self) -> list[str]:
        """Tensors no node reads yet."""
        read = {i for n in self.nodes for i in n.input}
        return [t for t in self.order if t not in read]

    def add_input(self, name: str, shape) -> str:
        self.shape[name], self.bound[name] = tuple(shape), 4.0
        self.order.append(name)
        return super().add_input(name, list(shape))

    def const(self, value, dtype=np.float32) -> str:
        return self.add_initializer(self.fresh("c"), value, dtype)

    def node(self, op, inputs, shapes, bounds, **attrs) -> list[str]:
        outs = [self.fresh("t") for _ in shapes]
        self.add_node(op, inputs, outs, name=self.fresh(f"{op}_"), **attrs)
        for o, sh, b in zip(outs, shapes, bounds, strict=True):
            self.shape[o], self.bound[o] = tuple(sh), float(b)
            self.order.append(o)
        return outs


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(np.broadcast_shapes(a, b))
    except ValueError:
        return None


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
        # one below the cap: an op emits up to two nodes (Clip + Exp, a reduction and its
        # broadcast partner), so the last one may pass the target by one
        target = draw(st.integers(3, max_nodes - 1))

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
        nodes = live_nodes(b.nodes, outputs)
        if not any("x" in n.input for n in nodes):
            # The main chain bypassed x: expose the first node (which reads x) as an output.
            outputs = [outputs[0], b.nodes[0].output[0]]
            nodes = live_nodes(b.nodes, outputs)
        while len(nodes) < 3:  # pruning can leave too few nodes: extend the main output
            (y,) = b.node("Relu", [outputs[0]], [b.shape[outputs[0]]], [b.bound[outputs[0]]])
            outputs[0] = y
            nodes = live_nodes(b.nodes, outputs)
        for o in outputs:
            b.add_output(o, list(b.shape[o]))
        return b.model(prune=True)

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

"""Per conv of a QDQ model, how many int8 outputs tvm_fusion's kernels and ONNX Runtime
disagree on (and by how many steps): ONNX Runtime runs the model on one random input, each
conv (DequantizeLinear → Conv → QuantizeLinear) is extracted and compiled alone, run on ONNX
Runtime's int8 input of that conv, and its int8 output compared with ONNX Runtime's, with
integer sums and with float32 sums (``integer_qdq_convs=False``).

    python scripts/qdq_conv_agreement.py [MODEL] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx.utils

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tvm_fusion.compile import compile_model, import_onnx  # noqa: E402
from tvm_fusion.compile import run as run_vm  # noqa: E402
from tvm_fusion.feeds import random_inputs  # noqa: E402
from tvm_fusion.numerics import onnx_reference  # noqa: E402
from tvm_fusion.target import host_target  # noqa: E402


def conv_sites(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """(the int8 tensor a Conv's input DequantizeLinear reads, the Conv's QuantizeLinear
    output) per Conv of ``model``."""
    made = {o: n for n in model.graph.node for o in n.output}
    sites = []
    for node in model.graph.node:
        if node.op_type != "Conv":
            continue
        dq = made.get(node.input[0])
        q = next((n for n in model.graph.node if n.op_type == "QuantizeLinear"
                  and n.input[0] == node.output[0]), None)
        if dq is not None and dq.op_type == "DequantizeLinear" and q is not None:
            sites.append((dq.input[0], q.output[0]))
    return sites


def with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    model = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v for v in model.graph.value_info}
    known.update({v.name: v for v in model.graph.input})
    del model.graph.output[:]
    for name in dict.fromkeys(names):
        model.graph.output.append(known[name])
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="/work/main/models/resnet18_int8.onnx")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = onnx.load(args.model)
    sites = conv_sites(model)
    full = with_outputs(model, [n for site in sites for n in site])
    feeds = random_inputs(model, seed=args.seed)
    names = [o.name for o in full.graph.output]
    values = dict(zip(names, onnx_reference(full, feeds)))
    target = host_target()
    totals = {True: [0, 0, 0], False: [0, 0, 0]}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "model.onnx"
        onnx.save(onnx.shape_inference.infer_shapes(model), src)
        for i, (x_name, y_name) in enumerate(sites):
            part = Path(tmp) / f"conv{i}.onnx"
            onnx.utils.extract_model(str(src), str(part), [x_name], [y_name])
            sub = onnx.load(part)
            mod = import_onnx(sub)
            for integer in (True, False):
                out = run_vm(compile_model(mod, target, integer_qdq_convs=integer),
                             [values[x_name]])[0]
                diff = np.abs(out.astype(int) - values[y_name].astype(int))
                t = totals[integer]
                t[0] += int((diff > 0).sum())
                t[1] = max(t[1], int(diff.max()))
                t[2] += diff.size
    for integer, label in ((True, "integer sums"), (False, "float32 sums")):
        off, worst, size = totals[integer]
        print(f"{label}: {len(sites)} convs on ONNX Runtime's inputs, {off} of {size} int8 "
              f"outputs differ from ONNX Runtime's, by at most {worst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

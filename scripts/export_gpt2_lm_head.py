"""Export a GPT-2 *with* its language-model head, to check that the plan's page stays usable on
a large graph (issue 25: "GPT-2 with its head, about 1,000 operators").

The zoo's ``gpt2`` is ``GPT2Model`` (no head). This builds ``GPT2LMHeadModel`` from its config
(random, seeded weights; nothing fetched) with the full 50257-token vocabulary and a chosen
depth and width, and exports it like the zoo (TorchScript exporter, opset 17, static sequence
128, ONNX Runtime's shape folding, checked against PyTorch) through
``tvm_fusion.export_models.export_model``. A narrow width keeps the export cheap: the graph's
operators are the same at any width. Needs the ``models`` extra.

    python scripts/export_gpt2_lm_head.py --layers 24 --width 64 --out /tmp/gpt2_head
    tvm-fusion report /tmp/gpt2_head/gpt2_lm_head_24.onnx --no-check --html /tmp/gpt2.html
"""

import argparse
from pathlib import Path

from tvm_fusion.export_models import InputSpec, ModelSpec, export_model

VOCAB = 50257
SEQ = 128


def _build(layers: int, width: int, heads: int):
    def build():
        import torch

        from tvm_fusion import export_models

        transformers = export_models._transformers()  # torchvision made importable first

        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads,
                                         vocab_size=VOCAB, n_positions=1024, use_cache=False,
                                         attn_implementation="eager")
        model = transformers.GPT2LMHeadModel(config)

        class Logits(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids):
                return self.model(input_ids=input_ids, use_cache=False).logits

        return Logits()

    return build


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="transformer blocks (GPT-2: 12)")
    parser.add_argument("--width", type=int, default=64, help="n_embd (GPT-2: 768)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (GPT-2: 12)")
    parser.add_argument("--out", type=Path, default=Path("models"), help="folder to write into")
    args = parser.parse_args()
    spec = ModelSpec(f"gpt2_lm_head_{args.layers}", "transformer",
                     _build(args.layers, args.width, args.heads),
                     (InputSpec("input_ids", (1, SEQ), "int64", 0, VOCAB),), ("logits",),
                     note=f"GPT2LMHeadModel, {args.layers} layers, n_embd {args.width}")
    result = export_model(spec, args.out)
    if not result.ok:
        print(f"export failed: {result.error}")
        return 1
    print(f"wrote {args.out / (spec.name + '.onnx')}: {result.nodes} ONNX nodes "
          f"(max error vs PyTorch {result.max_err:.2e}, {result.seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Target constants and assembly inspection shared by the CPU GEMM tests."""

import re

import tvm

from tvm_fusion.compile import compile_model, import_onnx

ZEN3 = tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 1})
AVX512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 1})
AARCH64 = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                             "mattr": ["+neon"], "num-cores": 1})


def innermost_loops(asm: str, instruction: str) -> list[tuple[int, int, int]]:
    """(lines, matches of the ``instruction`` regex, vector stack accesses) of every innermost
    loop (a backward branch whose body holds no other loop) that has the instruction: a
    spilled accumulator or B vector is moved between a vector register and the stack (a
    reloaded pointer is a scalar register)."""
    lines = asm.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"^(\.?L\w+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.match(r"\s+(?:j\w+|b\.\w+|b|cbnz|cbz)\s+(?:\w+,\s*)*(\.?L\w+)\s*$", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append((labels[m.group(1)], i))
    out = []
    for start, end in loops:
        if any(s > start and e < end for s, e in loops):
            continue  # not innermost
        body = lines[start:end + 1]
        hits = sum(bool(re.search(instruction, x)) for x in body)
        stack = sum(bool(re.search(r"%[xyz]mm\d+.*\(%rsp\)|\(%rsp\).*%[xyz]mm\d+", x)
                         or re.search(r"\b[qv]\d+\b.*\[sp\b", x)) for x in body)
        if hits:
            out.append((len(body), hits, stack))
    return out


def fma_loops(asm: str) -> list[tuple[int, int, int]]:
    """(lines, FMAs, vector stack accesses) of every innermost loop that does FMAs."""
    return innermost_loops(asm, r"vfmadd|\bfmla\b")


def assembly(model, target) -> str:
    executable = compile_model(import_onnx(model), target)
    return "\n".join(m.inspect_source("asm") for m in executable.mod.imports)

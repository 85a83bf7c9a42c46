"""Every target through the registered pipeline (issue 19, item 3):
``tvm.compile(mod, target, relax_pipeline="tvm_fusion")`` builds a conv net, an encoder layer
and a symbolic-shape model for x86-64 and AArch64 CPUs, CUDA, OpenCL, Adreno (buffers and
textures), Vulkan and Metal, or says in one line that the installed TVM has no code generator
for the target. Nothing here runs a GPU kernel: the texture builds run on PoCL in
test_texture.py, the CUDA sources compile to PTX in test_cuda_codegen.py.
"""

from __future__ import annotations

import re
import tarfile
import warnings

import onnx
import pytest
import tvm

from tvm_fusion.cli import main
from tvm_fusion.compile import import_onnx
from tvm_fusion.models import symbolic, transformer_encoder_layer
from tvm_fusion.models.cnn import resnet_bottleneck
from tvm_fusion.target import check_llvm_cpu, to_target

TARGETS = {
    "x86-64": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64-v3"},
    "aarch64-neon": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]},
    "aarch64-a76": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a76"},
    "cuda": {"kind": "cuda", "arch": "sm_80"},
    "opencl": "opencl",
    "adreno": "qcom/adreno-opencl",
    "adreno-texture": "qcom/adreno-opencl-texture",
    "vulkan": "vulkan",
    "metal": "metal",
}
# what each target's generated code must show: an ISA's registers, or the device source
SIGNS = {
    "x86-64": ("asm", r"%ymm\d"),  # AVX2 (x86-64-v3)
    "aarch64-neon": ("asm", r"\bv\d+\.4s\b"),  # NEON vector registers
    "aarch64-a76": ("asm", r"\bv\d+\.4s\b"),
    "cuda": ("cuda", r"__global__"),
    "opencl": ("opencl", r"__kernel"),
    "adreno": ("opencl", r"__kernel"),
    "adreno-texture": ("opencl", r"__kernel"),
    "vulkan": ("vulkan", r""),
    "metal": ("metal", r"kernel void"),
}
MODELS = {
    "conv_net": lambda: resnet_bottleneck(channels=8, size=8, batchnorm=False),
    "encoder": lambda: transformer_encoder_layer(seq=16, hidden=32, heads=2, ffn=64),
    "symbolic": symbolic.mlp,  # x[batch, seq, 64]
}
# Metal's first matmul or conv makes DLight import TVM's tensor intrinsics (~20 s here, once
# per process): its rows are in the slow set
SLOW_TARGETS = {"metal"}


def _target(name: str) -> tvm.target.Target:
    target = to_target(TARGETS[name])
    return target if target.kind.name == "llvm" else tvm.target.Target(target, host="llvm")


def _has_codegen(name: str) -> bool:
    kind = _target(name).kind.name
    return tvm.get_global_func(f"target.build.{kind}", allow_missing=True) is not None


def _modules(module):
    yield module
    for imported in module.imports:
        yield from _modules(imported)


def _code(executable, kind: str) -> str:
    if kind == "asm":
        return "\n".join(m.inspect_source("asm") for m in _modules(executable.mod)
                         if m.kind == "llvm")
    return "\n".join(m.inspect_source() for m in _modules(executable.mod) if m.kind == kind)


def _cases():
    for target in TARGETS:
        for model in MODELS:
            marks = [pytest.mark.slow] if target in SLOW_TARGETS else []
            yield pytest.param(target, model, id=f"{target}-{model}", marks=marks)


@pytest.mark.parametrize("target, model", list(_cases()))
def test_the_registered_pipeline_builds_for_every_target(target, model):
    tgt = _target(target)
    mod = import_onnx(MODELS[model]())
    if not _has_codegen(target):
        name = {"vulkan": "Vulkan", "metal": "Metal", "cuda": "CUDA"}.get(tgt.kind.name)
        with pytest.raises(ValueError, match=f"has no {name or tgt.kind.name} code generator"
                                             rf" \(target\.build\.{tgt.kind.name} is not"):
            tvm.compile(mod, tgt, relax_pipeline="tvm_fusion")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DLight retries name their kernels
        executable = tvm.compile(mod, tgt, relax_pipeline="tvm_fusion")
    kind, sign = SIGNS[target]
    code = _code(executable, kind)
    assert re.search(sign, code), f"no {sign!r} in the {kind} code for {target}"
    if target == "adreno-texture" and model != "symbolic":  # symbolic tensors stay buffers
        assert "image2d_array_t" in code and "read_imagef(" in code
        assert "write_imagef(" in code


def test_a_cpu_of_another_architecture_is_one_line():
    """An Arm CPU named on an llvm target without an Arm triple: LLVM would ignore it (one
    warning per function) and compile for the triple's generic CPU. The line names the triple
    it belongs to; with that triple it builds (the parametrised test above)."""
    host = str(tvm.target.codegen.llvm_get_system_triple()).split("-", 1)[0]
    if host == "aarch64":
        pytest.skip("cortex-a76 is this machine's architecture")
    target = tvm.target.Target({"kind": "llvm", "mcpu": "cortex-a76"})
    with pytest.raises(ValueError, match='it is a CPU of aarch64: add "mtriple": '
                                         '"aarch64-linux-gnu"'):
        check_llvm_cpu(target)
    with pytest.raises(ValueError, match="LLVM knows no CPU 'cortex-a76'"):
        tvm.compile(import_onnx(symbolic.mlp()), target, relax_pipeline="tvm_fusion")
    check_llvm_cpu(tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                                      "mcpu": "cortex-a76"}))
    # a typo is named too, without a triple to suggest
    with pytest.raises(ValueError, match="name a CPU of that triple"):
        check_llvm_cpu(tvm.target.Target({"kind": "llvm", "mcpu": "znver99"}))


def _cli(capsys, *args) -> tuple[int, list[str]]:
    """``tvm-fusion ARGS`` in this process: its exit code and its stderr lines."""
    code = main(list(args))
    return code, capsys.readouterr().err.strip().splitlines()


def test_cli_compiles_for_other_machines(tmp_path, capsys):
    """``compile -o`` for CUDA (host code + CUDA source in one .so) and for an AArch64 CPU (a
    .tar of AArch64 objects, linked on the device; a .so needs that triple's cross g++), and
    one line with exit code 2 for an Arm CPU without its triple."""
    path = tmp_path / "net.onnx"
    onnx.save(resnet_bottleneck(channels=8, size=8, batchnorm=False), path)
    out = tmp_path / "cuda.so"
    code, err = _cli(capsys, "compile", str(path), "--target", "cuda", "-o", str(out))
    assert code == 0 and out.stat().st_size > 0, err
    arm = '{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a76"}'
    tar = tmp_path / "arm.tar"
    code, err = _cli(capsys, "compile", str(path), "--target", arm, "-o", str(tar))
    assert code == 0, err
    with tarfile.open(tar) as archive:
        objects = [m for m in archive.getmembers() if m.name.endswith(".o")]
        header = archive.extractfile(objects[0]).read(20)
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # AArch64
    if str(tvm.target.codegen.llvm_get_system_triple()).startswith("x86_64"):
        code, err = _cli(capsys, "compile", str(path), "--target",
                         '{"kind": "llvm", "mcpu": "cortex-a76"}', "-o", str(tmp_path / "x.so"))
        assert code == 2 and len(err) == 1, err
        assert 'add "mtriple": "aarch64-linux-gnu"' in err[0]


@pytest.mark.parametrize("kind", ["cuda", "vulkan", "metal"])
@pytest.mark.parametrize("command", ["report", "bench"])
def test_a_gpu_target_this_machine_cannot_run_is_one_line(tmp_path, capsys, kind, command):
    """``report`` (which runs the model to check it) and ``bench`` on a GPU target: one line
    and exit code 2 naming what is missing (the code generator, the runtime or the device),
    before any build."""
    if tvm.get_global_func(f"device_api.{kind}", allow_missing=True) is not None and (
            tvm.device(kind, 0).exist):
        pytest.skip(f"this TVM and machine can run {kind}")
    path = tmp_path / "net.onnx"
    onnx.save(resnet_bottleneck(channels=8, size=8, batchnorm=False), path)
    args = ["--out", str(tmp_path / "out")] if command == "bench" else []
    code, err = _cli(capsys, command, str(path), "--target", kind, *args)
    assert code == 2 and len(err) == 1, err
    name = {"cuda": "CUDA", "vulkan": "Vulkan", "metal": "Metal"}[kind]
    assert re.search(f"no {name} (code generator|runtime|device)", err[0]), err[0]

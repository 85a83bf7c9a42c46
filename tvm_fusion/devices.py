"""Can this machine build for a target, and run what it built? One clear line when not.

Two things a TVM wheel or a machine may lack, which otherwise surface deep inside TVM:

* a **code generator**: a wheel built without Vulkan has no ``target.build.vulkan``, and the
  first build of a kernel fails (inside a DLight schedule probe, which then gets the blame);
* a **device** to run on: a CUDA build compiles anywhere, but running it (the report's
  numerical check, ``bench``) fails with "CUDA runtime is not linked" where the wheel has no
  CUDA runtime (the PyPI wheel, even on a GPU machine) or the machine has no GPU.

Both are bad input (a ``ValueError``: the CLI's exit code 2), checked before any work starts.
"""

from __future__ import annotations

import json

import tvm

from .target import check_llvm_cpu, to_target

# host kinds: the CPU always exists and LLVM/C code generators come with every wheel we support
_HOST_KINDS = ("llvm", "c")
_NAMES = {"cuda": "CUDA", "vulkan": "Vulkan", "metal": "Metal", "opencl": "OpenCL",
          "rocm": "ROCm", "webgpu": "WebGPU", "hexagon": "Hexagon"}


def target_kind(target) -> str:
    """The kind of a target given as a ``Target``, a dict, JSON text or a target string.

    Read off the text where possible rather than building a ``Target``: building a CUDA target
    on a machine without ``nvcc`` logs a warning per call, which would precede the one line.
    Tags (``nvidia/geforce-rtx-4090``) are resolved by TVM."""
    if isinstance(target, tvm.target.Target):
        return target.kind.name
    if isinstance(target, dict):
        return str(target.get("kind", ""))
    text = str(target).strip()
    if text.startswith("{"):
        try:
            return str(json.loads(text).get("kind", ""))
        except (json.JSONDecodeError, AttributeError):
            return ""  # to_target names the problem
    word = text.split()[0] if text else ""
    if "/" in word:
        return to_target(text).kind.name
    return word


def display_name(kind: str) -> str:
    return _NAMES.get(kind, kind)


def require_codegen(target) -> None:
    """``ValueError`` when the installed TVM cannot generate code for ``target``'s kind, or
    when an ``llvm`` target names a CPU of another architecture than its triple's
    (:func:`tvm_fusion.target.check_llvm_cpu`)."""
    kind = target_kind(target)
    if kind == "llvm":
        check_llvm_cpu(to_target(target))
    if not kind or kind in _HOST_KINDS:
        return
    if tvm.get_global_func(f"target.build.{kind}", allow_missing=True) is None:
        raise ValueError(f"the installed TVM ({tvm.__version__}) has no {display_name(kind)} "
                         f"code generator (target.build.{kind} is not registered): build TVM "
                         f"with {display_name(kind)} enabled, or choose another target")


def require_device(target, hint: str = "") -> None:
    """``ValueError`` when no device of ``target``'s kind is present to run a build on.

    ``hint`` is what the caller can do instead (e.g. "pass --no-check")."""
    kind = target_kind(target)
    if not kind or kind in _HOST_KINDS:
        return
    try:
        device = tvm.device(kind, 0)
    except Exception:  # noqa: BLE001 (a kind with no runtime device type: nothing to check)
        return
    tail = f"; {hint}" if hint else ""
    if tvm.get_global_func(f"device_api.{kind}", allow_missing=True) is None:
        # the PyPI wheel: CUDA code is generated, but no CUDA runtime is linked to run it
        raise ValueError(f"the installed TVM ({tvm.__version__}) has no {display_name(kind)} "
                         f"runtime (device_api.{kind} is not registered), so it cannot run the "
                         f"--target {kind} build on any machine{tail}")
    if not device.exist:
        raise ValueError(f"no {display_name(kind)} device on this machine to run the "
                         f"--target {kind} build{tail}")

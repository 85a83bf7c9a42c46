"""Targets from what users write, the host CPU as a TVM target, and a warning for the bare
``llvm`` that is not it.

On x86-64 a bare ``"llvm"`` target is baseline x86-64 (SSE2): LLVM uses AVX2/AVX-512 only when
the target names a CPU. TVM 0.27 rejects ``-mcpu=native``, but
``tvm.target.codegen.llvm_get_system_cpu()`` names the host (``znver5``, ``rocketlake``…), so
the CLI's default target is :func:`host_target`; nothing here names a CPU model itself.
"""

from __future__ import annotations

import importlib
import json
import platform
import warnings

import tvm

from .threads import physical_cores

NATIVE = "native"  # the CLI's name for host_target()
_X86_64 = ("x86_64", "amd64", "x64")

__all__ = ["NATIVE", "check_llvm_cpu", "host_cpu", "host_target", "host_target_dict",
           "is_bare_x86_llvm", "to_target", "warn_if_bare_llvm"]

# triples suggested when an llvm target names a CPU of another architecture than its triple's
_SUGGESTED_TRIPLES = ("aarch64-linux-gnu", "x86_64-linux-gnu", "arm-linux-gnueabihf",
                      "riscv64-linux-gnu", "powerpc64le-linux-gnu")


def to_target(target) -> tvm.target.Target:
    """A ``Target`` from a ``Target``, a kind or tag string, a dict or JSON text; a bad one is
    a ``ValueError`` whose one line names it."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, str) and target.startswith("qcom/"):
        importlib.import_module("tvm.backend.adreno")  # registers the qcom/* tags
    if isinstance(target, str) and target.strip().startswith("{"):
        try:
            target = json.loads(target)
        except json.JSONDecodeError as err:
            raise ValueError(f"invalid target {target!r}: not valid JSON ({err})") from None
    try:
        return tvm.target.Target(target)
    except Exception as err:
        text = str(err).strip()
        first = text.splitlines()[0] if text else type(err).__name__
        raise ValueError(f"invalid target {target!r}: {first}") from None


def check_llvm_cpu(target: tvm.target.Target) -> None:
    """``ValueError`` when an ``llvm`` target names a CPU that LLVM does not know for the
    target's triple (this machine's when it names none): LLVM would warn once per function,
    ignore the CPU and compile for a generic one of the triple's architecture, e.g. x86-64 code
    for ``{"kind": "llvm", "mcpu": "cortex-a76"}`` on an x86-64 machine. The line says which
    triple the CPU belongs to."""
    if target.kind.name != "llvm":
        return
    cpu = str(target.attrs.get("mcpu", "") or "")
    if not cpu or cpu in ("generic", "native"):
        return
    codegen = tvm.target.codegen
    triple = str(target.attrs.get("mtriple", "") or "") or str(codegen.llvm_get_system_triple())
    try:
        if codegen.llvm_is_valid_cpu(cpu, triple):
            return
        known = set(codegen.llvm_get_targets())
        owners = [t for t in _SUGGESTED_TRIPLES if t.split("-", 1)[0] in known
                  and t != triple and codegen.llvm_is_valid_cpu(cpu, t)]
    except Exception:  # noqa: BLE001 (a TVM without LLVM's target queries: LLVM decides)
        return
    named = "" if target.attrs.get("mtriple") else " (this machine's: the target names none)"
    fix = (f'it is a CPU of {owners[0].split("-", 1)[0]}: add "mtriple": "{owners[0]}"'
           if owners else "name a CPU of that triple, or the triple of the CPU")
    raise ValueError(f"target {target}: LLVM knows no CPU {cpu!r} for the triple {triple}"
                     f"{named}, and would compile for a generic CPU of that triple; {fix}")


def host_cpu() -> str:
    """LLVM's name of the CPU this process runs on (``"generic"`` when LLVM cannot tell)."""
    try:
        return str(tvm.target.codegen.llvm_get_system_cpu()) or "generic"
    except Exception:  # noqa: BLE001 (a TVM built without LLVM)
        return "generic"


def host_target_dict() -> dict:
    """``{"kind": "llvm", "mcpu": <host CPU>, "num-cores": <physical cores>}``."""
    return {"kind": "llvm", "mcpu": host_cpu(), "num-cores": physical_cores()}


def host_target() -> tvm.target.Target:
    """The target for code that runs on this machine: its CPU's vector units, its cores."""
    return tvm.target.Target(host_target_dict())


def is_bare_x86_llvm(target: tvm.target.Target) -> bool:
    """An ``llvm`` target for x86-64 (named or the host's triple) that names no CPU and no
    features: it compiles for SSE2."""
    if target.kind.name != "llvm":
        return False
    attrs = target.attrs
    if str(attrs.get("mcpu", "") or "") or list(attrs.get("mattr", []) or []):
        return False
    triple = str(attrs.get("mtriple", "") or "")
    arch = triple.split("-", 1)[0] if triple else platform.machine()
    return arch.lower() in _X86_64


_warned = False


def warn_if_bare_llvm(target: tvm.target.Target) -> None:
    """Warn once per process when ``target`` is a bare x86-64 ``llvm`` (see the module)."""
    global _warned
    if _warned or not is_bare_x86_llvm(target):
        return
    _warned = True
    warnings.warn(
        f"tvm_fusion: target 'llvm' names no CPU, so LLVM compiles for baseline x86-64 "
        f"(SSE2, no AVX); name the CPU, e.g. {{'kind': 'llvm', 'mcpu': '{host_cpu()}'}} "
        f"(tvm.target.codegen.llvm_get_system_cpu()) or tvm_fusion.target.host_target()",
        UserWarning, stacklevel=3)

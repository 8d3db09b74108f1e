"""prime-kernels: CUDA kernels for training, one wheel, gated by a run-time registry.

Always gate, never import a kernel package directly::

    import prime_kernels

    if prime_kernels.is_available("flash_moe"):
        flash_moe = prime_kernels.load("flash_moe")

``status()`` maps every kernel to ``"available"`` or the one-sentence reason it is not.
Importing this module needs no GPU, no built extension and no torch import.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import json
from pathlib import Path
from types import ModuleType

from ._manifest import KernelSpec, arch_to_sm, load_manifest, parse_arch

__all__ = [
    "KERNELS",
    "build_info",
    "is_available",
    "is_built",
    "load",
    "spec",
    "status",
    "unavailable_reason",
]

_SPECS: dict[str, KernelSpec] = load_manifest()
KERNELS: tuple[str, ...] = tuple(_SPECS)
_BUILD_INFO_PATH = Path(__file__).with_name("_build_info.json")


def spec(name: str) -> KernelSpec:
    """The manifest entry of kernel ``name``; KeyError listing the known kernels otherwise."""
    try:
        return _SPECS[name]
    except KeyError:
        raise KeyError(
            f"unknown kernel {name!r}; known kernels: {', '.join(KERNELS) or '(none)'}"
        ) from None


@functools.cache
def build_info() -> dict:
    """What the build recorded: versions, git commit, and per kernel what it built."""
    try:
        return json.loads(_BUILD_INFO_PATH.read_text())
    except (OSError, ValueError):
        return {}


def _built_arch(name: str) -> tuple[str, ...]:
    recorded = build_info().get("kernels", {}).get(name, {})
    return tuple(recorded.get("arch") or spec(name).arch)


def _extension_file(name: str) -> Path | None:
    """The kernel's compiled extension in this install, or None (not built, or python-only)."""
    folder = Path(__file__).with_name(name)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (folder / f"_C{suffix}").is_file():
            return folder / f"_C{suffix}"
    return None


def is_built(name: str) -> bool:
    """True when the kernel's compiled extension is in this install (python-only: always).
    Looks for the file: importing it (and torch) is for :func:`unavailable_reason`."""
    return spec(name).python_only or _extension_file(name) is not None


def _missing_requirement(kernel: KernelSpec) -> str | None:
    for requirement in kernel.requires:
        module = requirement.replace("-", "_")
        if importlib.util.find_spec(module) is None:
            return requirement
    return None


def _device_capability(device) -> tuple[int, int] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    if device is None:
        device = torch.cuda.current_device()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def unavailable_reason(name: str, device=None) -> str | None:
    """None when kernel ``name`` can run on ``device`` (default: the current CUDA device);
    otherwise one sentence saying why not."""
    kernel = spec(name)
    if kernel.python_only:
        missing = _missing_requirement(kernel)
        return None if missing is None else f"{name} requires package {missing}."
    if not is_built(name):
        skipped = build_info().get("kernels", {}).get(name, {}).get("reason")
        detail = f" (the build skipped it: {skipped})" if skipped else ""
        return f"{name} is not compiled into this install{detail}."
    arch = _built_arch(name)
    sm_list = ", ".join(arch_to_sm(a) for a in arch)
    capability = _device_capability(device)
    if capability is None:
        return f"{name} requires a CUDA device ({sm_list})."
    if not any(parse_arch(a)[:2] == capability for a in arch):
        only = " only" if len(arch) == 1 else ""
        return (
            f"{name} requires {sm_list}, this device is sm_{capability[0]}{capability[1]} "
            f"({name} was built for {sm_list}{only})."
        )
    error = _load_error(name)
    if error is not None:
        return f"{name} is compiled into this install but does not load: {error.rstrip('.')}."
    return None


def is_available(name: str, device=None) -> bool:
    return unavailable_reason(name, device) is None


@functools.cache
def _import_kernel(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def _load_error(name: str) -> str | None:
    """Why the kernel's module does not import (an extension built against another torch or
    CUDA, a damaged file), or None; a failed import is not cached, so a fix is seen."""
    try:
        _import_kernel(name)
    except ImportError as error:
        return str(error)
    return None


def load(name: str) -> ModuleType:
    """The kernel's module (cached); RuntimeError carrying the reason when unavailable."""
    reason = unavailable_reason(name)
    if reason is not None:
        raise RuntimeError(reason)
    return _import_kernel(name)


def status() -> dict[str, str]:
    """Every kernel mapped to ``"available"`` or the reason it is not."""
    return {name: unavailable_reason(name) or "available" for name in KERNELS}

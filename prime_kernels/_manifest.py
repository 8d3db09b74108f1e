"""Parser and validator of ``prime_kernels/kernels.toml``.

One module for both readers: ``setup.py`` loads this file by path (the package itself may
not be built or importable yet), and the run-time registry imports it. It must therefore
depend on nothing but the standard library.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib

MANIFEST_PATH = Path(__file__).with_name("kernels.toml")

# "9.0a" (arch-specific), "10.0f" (family), "8.0" (plain): matched exactly at run time.
_ARCH_RE = re.compile(r"^(\d+)\.(\d+)([af]?)$")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_KEYS = {
    "description": str,
    "ops": str,
    "sources": list,
    "include-dirs": list,
    "arch": list,
    "cxx-std": int,
    "cxx-flags": list,
    "nvcc-flags": list,
    "python-only": bool,
    "requires": list,
}
_COMPILED_REQUIRED = ("ops", "sources", "arch", "cxx-std")
_COMPILED_ONLY = ("sources", "include-dirs", "arch", "cxx-std", "cxx-flags", "nvcc-flags")
_CXX_STANDARDS = (17, 20)


class ManifestError(ValueError):
    """A kernels.toml entry is malformed; the message names the kernel and the key."""


@dataclass(frozen=True)
class KernelSpec:
    name: str
    description: str
    ops: str | None = None
    sources: tuple[str, ...] = ()
    include_dirs: tuple[str, ...] = ()
    arch: tuple[str, ...] = ()
    cxx_std: int | None = None
    cxx_flags: tuple[str, ...] = ()
    nvcc_flags: tuple[str, ...] = ()
    python_only: bool = False
    requires: tuple[str, ...] = field(default_factory=tuple)

    @property
    def compiled(self) -> bool:
        return not self.python_only

    @property
    def sm_names(self) -> tuple[str, ...]:
        """``("sm_90a",)`` for ``arch = ["9.0a"]``."""
        return tuple(arch_to_sm(a) for a in self.arch)


def parse_arch(arch: str) -> tuple[int, int, str]:
    """``"9.0a"`` -> ``(9, 0, "a")``; raises ValueError on anything else."""
    match = _ARCH_RE.match(arch)
    if match is None:
        raise ValueError(f"{arch!r} is not a compute capability like '9.0a', '10.0f' or '8.0'")
    return int(match.group(1)), int(match.group(2)), match.group(3)


def arch_to_sm(arch: str) -> str:
    major, minor, suffix = parse_arch(arch)
    return f"sm_{major}{minor}{suffix}"


def arch_to_gencode(arch: str) -> str:
    """The explicit nvcc target for one arch: real machine code only, no PTX shipped."""
    major, minor, suffix = parse_arch(arch)
    cc = f"{major}{minor}{suffix}"
    return f"-gencode=arch=compute_{cc},code=sm_{cc}"


def _fail(kernel: str, key: str | None, message: str) -> ManifestError:
    where = f"kernels.toml [{kernel}]" + (f" key '{key}'" if key else "")
    return ManifestError(f"{where}: {message}")


def _string_list(kernel: str, key: str, value: list) -> tuple[str, ...]:
    if not all(isinstance(item, str) and item for item in value):
        raise _fail(kernel, key, "must be a list of non-empty strings")
    return tuple(value)


def _inside_kernel_folder(kernel: str, key: str, paths: tuple[str, ...]) -> None:
    for path in paths:
        normalized = os.path.normpath(path)
        if os.path.isabs(path) or normalized == ".." or normalized.startswith(".." + os.sep):
            raise _fail(
                kernel, key, f"path {path!r} is outside the kernel folder prime_kernels/{kernel}/"
            )


def _validate(kernel: str, table: object) -> KernelSpec:
    if not _NAME_RE.match(kernel):
        raise _fail(kernel, None, "a kernel name must be a Python identifier")
    if not isinstance(table, dict):
        raise _fail(kernel, None, "must be a table")
    for key, value in table.items():
        if key not in _KEYS:
            raise _fail(kernel, key, f"unknown key; known keys: {', '.join(sorted(_KEYS))}")
        if not isinstance(value, _KEYS[key]) or (_KEYS[key] is int and isinstance(value, bool)):
            raise _fail(kernel, key, f"must be of type {_KEYS[key].__name__}")

    description = table.get("description", "")
    if not description.strip():
        raise _fail(kernel, "description", "is missing; every kernel needs a description")

    python_only = table.get("python-only", False)
    if python_only:
        for key in _COMPILED_ONLY:
            if key in table:
                raise _fail(kernel, key, "is only valid for compiled kernels (python-only = true)")
    else:
        for key in _COMPILED_REQUIRED:
            if key not in table:
                raise _fail(kernel, key, "is missing; a compiled kernel needs it")
        if "requires" in table:
            raise _fail(kernel, "requires", "is only valid for python-only kernels")

    ops = table.get("ops")
    if ops is not None and not _NAME_RE.match(ops):
        raise _fail(kernel, "ops", f"{ops!r} is not a valid torch.ops namespace")

    sources = _string_list(kernel, "sources", table.get("sources", []))
    include_dirs = _string_list(kernel, "include-dirs", table.get("include-dirs", []))
    _inside_kernel_folder(kernel, "sources", sources)
    _inside_kernel_folder(kernel, "include-dirs", include_dirs)
    if not python_only and not sources:
        raise _fail(kernel, "sources", "must list at least one source file")

    arch = _string_list(kernel, "arch", table.get("arch", []))
    if not python_only and not arch:
        raise _fail(kernel, "arch", "must list at least one compute capability")
    for item in arch:
        try:
            parse_arch(item)
        except ValueError as error:
            raise _fail(kernel, "arch", str(error)) from None

    cxx_std = table.get("cxx-std")
    if cxx_std is not None and cxx_std not in _CXX_STANDARDS:
        raise _fail(kernel, "cxx-std", f"{cxx_std} is not one of {_CXX_STANDARDS}")

    return KernelSpec(
        name=kernel,
        description=description.strip(),
        ops=ops,
        sources=sources,
        include_dirs=include_dirs,
        arch=arch,
        cxx_std=cxx_std,
        cxx_flags=_string_list(kernel, "cxx-flags", table.get("cxx-flags", [])),
        nvcc_flags=_string_list(kernel, "nvcc-flags", table.get("nvcc-flags", [])),
        python_only=python_only,
        requires=_string_list(kernel, "requires", table.get("requires", [])),
    )


def parse_manifest(text: str) -> dict[str, KernelSpec]:
    """Kernel name -> spec, in manifest order. Raises ManifestError on any malformed entry."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ManifestError(f"kernels.toml is not valid TOML: {error}") from None
    specs = {name: _validate(name, table) for name, table in data.items()}
    namespaces: dict[str, str] = {}
    for spec in specs.values():
        if spec.ops is not None and spec.ops in namespaces:
            raise _fail(
                spec.name,
                "ops",
                f"namespace {spec.ops!r} is already registered by [{namespaces[spec.ops]}]",
            )
        if spec.ops is not None:
            namespaces[spec.ops] = spec.name
    return specs


def load_manifest(path: str | os.PathLike | None = None) -> dict[str, KernelSpec]:
    return parse_manifest(Path(path or MANIFEST_PATH).read_text())

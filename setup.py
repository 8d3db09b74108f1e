"""Build of prime-kernels: one extension ``prime_kernels.<name>._C`` per compiled kernel of
``prime_kernels/kernels.toml``.

Source builds are explicit: ``pip install --no-build-isolation -e .`` with torch and a CUDA
toolkit of torch's CUDA major present. A plain, isolated ``pip install .`` sees no torch and
compiles nothing. Variables:

- ``PRIME_KERNELS=a,b``: build only these kernels (an unknown name is an error);
- ``PRIME_KERNELS_REQUIRE=1``: a kernel that would be skipped fails the build instead;
- ``MAX_JOBS``: parallel compile jobs (read by torch's ninja build);
- a cross build for another CPU (scripts/build-wheels --aarch64): ``CC``/``CXX`` the
  cross compilers, ``PRIME_KERNELS_CROSS_TORCH`` the target's torch package (its headers
  and libraries), ``PRIME_KERNELS_CROSS_INCLUDE_DIRS`` / ``_LIB_DIRS`` (``:``-separated:
  the target's Python headers, cudart), ``PRIME_KERNELS_CROSS_NVCC_FLAGS`` and
  ``PRIME_KERNELS_CROSS_PLAT`` (the wheel's platform, e.g. linux_aarch64).

Extensions bind with the LibTorch stable ABI targeting torch 2.10 and the Python limited
API, so one wheel (``cp310-abi3``) imports under every torch >= 2.10 of the same CUDA major
and every CPython >= 3.10.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PACKAGE = "prime_kernels"
PACKAGE_DIR = ROOT / PACKAGE
VERSION = "0.1.0"
BUILD_INFO = "_build_info.json"
# Stable-ABI target: the oldest torch whose stable C++ API the extensions may use.
TORCH_TARGET_VERSION = "0x020a000000000000"  # 2.10
PY_LIMITED_API_TAG = "cp310"
# Device code in csrc/ is torch-free and wants cuda_bf16.h's operators, which torch's
# default nvcc flags switch off.
# The C++ runtime: every extension links the shared libstdc++ (libstdc++.so.6), the one torch
# runs on. A toolchain whose only libstdc++ is the static archive (a GCC installed without
# libstdc++.so, or -static-libstdc++ in CXX) would otherwise link a private copy of it into
# the extension, whose functions then run on the process's libstdc++ data: formatting a
# number into an error message crashes the process (SIGSEGV) or prints nothing. Named
# after the objects, so every libstdc++ symbol resolves from the shared library before the
# driver's own -lstdc++ is searched.
CXX_RUNTIME = "libstdc++.so.6"
# Defined by libstdc++ itself (std::ostream::_M_insert<long>), never by an extension that
# links it dynamically: its presence means a copy of the library was linked in.
STATIC_CXX_RUNTIME_MARKER = "_ZNSo9_M_insertIlEERSoT_"
NVCC_RESTORE_OPERATORS = [
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
]


def _load_manifest_module():
    spec = importlib.util.spec_from_file_location(
        "_prime_kernels_manifest", PACKAGE_DIR / "_manifest.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


manifest = _load_manifest_module()


def log(message: str) -> None:
    print(f"prime-kernels: {message}", file=sys.stderr, flush=True)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def selected_kernels(specs: dict) -> list[str]:
    """Manifest order, restricted by PRIME_KERNELS."""
    wanted = os.environ.get("PRIME_KERNELS", "").strip()
    if not wanted:
        return list(specs)
    names = [name.strip() for name in wanted.split(",") if name.strip()]
    unknown = [name for name in names if name not in specs]
    if unknown:
        raise SystemExit(
            f"prime-kernels: PRIME_KERNELS names unknown kernel(s) {', '.join(unknown)}; "
            f"known: {', '.join(specs)}"
        )
    return [name for name in specs if name in names]


def nvcc_version(nvcc: str) -> str | None:
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    match = re.search(r"release (\d+\.\d+)", text)
    return match.group(1) if match else None


def probe_toolkit() -> dict:
    """What the build environment offers: torch, its CUDA, nvcc. No exception escapes."""
    toolkit = {"torch": None, "torch_cuda": None, "cuda_home": None, "nvcc": None}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return toolkit
    toolkit["torch"] = torch.__version__
    toolkit["torch_cuda"] = torch.version.cuda
    cuda_home = cpp_extension.CUDA_HOME
    toolkit["cuda_home"] = cuda_home
    if cuda_home:
        nvcc = Path(cuda_home) / "bin" / "nvcc"
        if nvcc.exists():
            toolkit["nvcc"] = nvcc_version(str(nvcc))
    return toolkit


def skip_reason(spec, toolkit: dict, kernel_dir: Path) -> str | None:
    """Why this kernel cannot be built here, or None. One line, for the build log."""
    if spec.python_only:
        return None
    if toolkit["torch"] is None:
        return (
            "torch is not importable in the build environment "
            "(source builds are explicit: pip install --no-build-isolation -e .)"
        )
    if toolkit["torch_cuda"] is None:
        return f"torch {toolkit['torch']} is built without CUDA"
    if toolkit["nvcc"] is None:
        where = toolkit["cuda_home"] or "CUDA_HOME and PATH"
        return f"no nvcc found (looked in {where})"
    if toolkit["nvcc"].split(".")[0] != toolkit["torch_cuda"].split(".")[0]:
        return (
            f"nvcc is CUDA {toolkit['nvcc']} but torch {toolkit['torch']} is built with "
            f"CUDA {toolkit['torch_cuda']}; the CUDA majors must match"
        )
    missing = [src for src in spec.sources if not (kernel_dir / src).is_file()]
    if missing:
        return f"sources missing: {', '.join(missing)}"
    return None


def cross_setting(name: str) -> list[str]:
    value = os.environ.get(f"PRIME_KERNELS_CROSS_{name}", "").strip()
    return [part for part in value.split(os.pathsep) if part] if value else []


def is_cross_build() -> bool:
    return bool(cross_setting("TORCH"))


def cxx_runtime_link_args() -> list[str]:
    """Links the shared libstdc++, searched first where this process (which has imported
    torch) loaded it from, so the extension and torch share one C++ runtime (a cross
    build links the cross toolchain's own)."""
    if is_cross_build():
        return [f"-l:{CXX_RUNTIME}"]
    args = []
    try:
        with open("/proc/self/maps") as maps:
            loaded = {line.split()[-1] for line in maps if CXX_RUNTIME in line}
    except OSError:
        loaded = set()
    for path in sorted(loaded):
        if Path(path).name.startswith(CXX_RUNTIME):
            args.append(f"-L{Path(path).parent}")
            break
    return [*args, f"-l:{CXX_RUNTIME}"]


def static_cxx_runtime_reason(library: Path) -> str | None:
    """Why a built extension would crash on its first formatted error message, or None:
    it must need the shared libstdc++ and carry no copy of it (readelf, from binutils)."""
    readelf = shutil.which("readelf")
    if readelf is None:
        log(f"cannot check which libstdc++ {library.name} links: no readelf (binutils)")
        return None
    dynamic = subprocess.run([readelf, "-dW", str(library)], capture_output=True, text=True).stdout
    symbols = subprocess.run(
        [readelf, "--dyn-syms", "-W", str(library)], capture_output=True, text=True
    ).stdout
    # Columns: Num, Value, Size, Type, Bind, Vis, Ndx (UND: imported), Name[@version].
    defined = any(
        len(columns) >= 8
        and columns[6] != "UND"
        and columns[7].split("@")[0] == STATIC_CXX_RUNTIME_MARKER
        for columns in map(str.split, symbols.splitlines())
    )
    if f"[{CXX_RUNTIME}]" in dynamic and not defined:
        return None
    return (
        f"{library.name} carries its own copy of libstdc++ instead of linking {CXX_RUNTIME} "
        "(the C++ compiler links the static archive); next to torch's libstdc++ it crashes "
        "on error messages. Build with a C++ compiler that has libstdc++.so (set CXX)"
    )


# Compiled into every extension (see the file): keeps the wheels' glibc floor at 2.28.
MANYLINUX_COMPAT = PACKAGE_DIR / "include" / "prime_kernels" / "manylinux_compat.cpp"


DEFINES = [f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}", "-DUSE_CUDA"]


def nvcc_flags(spec) -> list[str]:
    """The kernel's nvcc flags besides torch's own and the include paths (also what
    tests/test_ptxas_report.py compiles with)."""
    cross_nvcc = []
    if is_cross_build():
        cross_nvcc = shlex.split(os.environ.get("PRIME_KERNELS_CROSS_NVCC_FLAGS", ""))
    return [
        f"-std=c++{spec.cxx_std}",
        *(manifest.arch_to_gencode(arch) for arch in spec.arch),
        *DEFINES,
        *NVCC_RESTORE_OPERATORS,
        *spec.nvcc_flags,
        *cross_nvcc,
    ]


def make_extension(spec, kernel_dir: Path):
    from torch.utils.cpp_extension import CUDAExtension

    # A cross build reads the target's torch and Python headers and links the target's
    # libraries: listed first, they shadow this machine's, which torch adds after them.
    cross_includes, cross_libs = [], []
    if is_cross_build():
        (torch_root,) = cross_setting("TORCH")
        cross_includes = cross_setting("INCLUDE_DIRS") + [
            f"{torch_root}/include",
            f"{torch_root}/include/torch/csrc/api/include",
        ]
        cross_libs = [f"{torch_root}/lib", *cross_setting("LIB_DIRS")]
    return CUDAExtension(
        name=f"{PACKAGE}.{spec.name}._C",
        sources=[str((kernel_dir / src).relative_to(ROOT)) for src in spec.sources]
        + [str(MANYLINUX_COMPAT.relative_to(ROOT))],
        include_dirs=[str(kernel_dir / inc) for inc in spec.include_dirs]
        + [str(PACKAGE_DIR / "include")]
        + cross_includes,
        library_dirs=cross_libs,
        extra_compile_args={
            "cxx": [f"-std=c++{spec.cxx_std}", "-O3", *DEFINES, *spec.cxx_flags],
            "nvcc": nvcc_flags(spec),
        },
        extra_link_args=cxx_runtime_link_args(),
        py_limited_api=True,
    )


def git_commit() -> str | None:
    if os.environ.get("PRIME_KERNELS_COMMIT"):
        return os.environ["PRIME_KERNELS_COMMIT"]
    try:
        result = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return None
    if result.returncode != 0:
        return None
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return result.stdout.strip() + ("-dirty" if dirty else "")


def plan_build():
    specs = manifest.load_manifest(PACKAGE_DIR / "kernels.toml")
    names = selected_kernels(specs)
    toolkit = probe_toolkit()
    require = env_flag("PRIME_KERNELS_REQUIRE")
    extensions, kernels = [], {}
    for name, spec in specs.items():
        if name not in names:
            kernels[name] = {"built": False, "reason": "not selected by PRIME_KERNELS"}
            continue
        kernel_dir = PACKAGE_DIR / name
        reason = skip_reason(spec, toolkit, kernel_dir)
        if reason is not None:
            if require:
                raise SystemExit(f"prime-kernels: {name} cannot be built: {reason}")
            log(f"skipping {name}: {reason}")
            kernels[name] = {"built": False, "reason": reason}
            continue
        if spec.python_only:
            kernels[name] = {"built": True, "python_only": True}
            continue
        log(f"building {name} for {', '.join(spec.sm_names)}")
        extensions.append(make_extension(spec, kernel_dir))
        kernels[name] = {"built": True, "arch": list(spec.arch), "sm": list(spec.sm_names)}
    build_info = {
        "version": VERSION,
        "git_commit": git_commit(),
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": toolkit["torch"],
        "torch_cuda": toolkit["torch_cuda"],
        "nvcc": toolkit["nvcc"],
        "torch_target_version": "2.10",
        "kernels": kernels,
    }
    return extensions, build_info


def write_build_info(build_info: dict, build_lib: str, in_source: bool) -> None:
    """Records what this build compiled inside the package (and in the source tree for
    in-place and editable builds, where the package is imported from there)."""
    text = json.dumps(build_info, indent=2) + "\n"
    targets = [Path(build_lib) / PACKAGE / BUILD_INFO]
    if in_source:
        targets.append(PACKAGE_DIR / BUILD_INFO)
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def log_compile_times(ninja_log: Path, logged_before: int) -> None:
    """One line per translation unit compiled in this build, slowest first, from the
    entries ninja appended to its log (start and end in ms per output)."""
    lines = read_lines(ninja_log)
    # ninja may have recompacted its log (fewer lines): then every entry is read.
    new = lines if len(lines) < logged_before else lines[logged_before:]
    latest = {}
    for line in new:
        fields = line.split("\t")
        if len(fields) >= 4 and fields[0].isdigit() and fields[1].isdigit():
            latest[fields[3]] = (int(fields[1]) - int(fields[0])) / 1000
    for output, seconds in sorted(latest.items(), key=lambda item: -item[1]):
        log(f"compiled {Path(output).name} in {seconds:.1f} s")


def command_classes(extensions: list, build_info: dict) -> dict:
    """build_py records what the build compiled (it runs in every build, also when nothing
    is compiled); build_ext is torch's BuildExtension (ninja, Py_LIMITED_API, its flags)
    when there is anything to compile."""

    class BuildPyWithMetadata(build_py):
        def run(self):
            super().run()
            write_build_info(build_info, self.build_lib, getattr(self, "editable_mode", False))

        def get_outputs(self, include_bytecode=True):
            return super().get_outputs(include_bytecode) + [
                str(Path(self.build_lib) / PACKAGE / BUILD_INFO)
            ]

    classes = {"build_py": BuildPyWithMetadata, "build_ext": build_ext}
    if extensions:
        from torch.utils.cpp_extension import BuildExtension

        class BuildExtWithMetadata(BuildExtension):
            def run(self):
                ninja_log = Path(self.build_temp) / ".ninja_log"
                logged_before = len(read_lines(ninja_log))
                super().run()
                log_compile_times(ninja_log, logged_before)
                for extension in self.extensions:
                    reason = static_cxx_runtime_reason(Path(self.get_ext_fullpath(extension.name)))
                    if reason is not None:
                        raise SystemExit(f"prime-kernels: {reason}")
                if self.inplace:
                    write_build_info(build_info, self.build_lib, in_source=True)

        classes["build_ext"] = BuildExtWithMetadata
    return classes


def main() -> None:
    extensions, build_info = plan_build()
    if extensions and shutil.which("ninja") is None:
        log("ninja not found: compiling serially (pip install ninja for MAX_JOBS parallelism)")
    # A regular install names the CUDA it is bound to; the stable ABI frees it from torch's
    # exact version (abi3 wheel, torch >= 2.10).
    version = VERSION
    options = {}
    if extensions:
        version += "+cu" + build_info["torch_cuda"].replace(".", "")
        options = {"bdist_wheel": {"py_limited_api": PY_LIMITED_API_TAG}}
        if is_cross_build() and os.environ.get("PRIME_KERNELS_CROSS_PLAT"):
            options["bdist_wheel"]["plat_name"] = os.environ["PRIME_KERNELS_CROSS_PLAT"]
    setup(
        version=version,
        packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
        package_data={PACKAGE: ["kernels.toml"]},
        exclude_package_data={"": ["csrc/*", "include/*"]},
        ext_modules=extensions,
        cmdclass=command_classes(extensions, build_info),
        options=options,
    )


# setuptools executes this file as __main__; tests import it to check the skip logic.
if __name__ == "__main__":
    main()

"""``python -m prime_kernels``: a report to paste into a bug.

Prints the install (version, what the build recorded), the runtime (torch, CUDA, Python,
GPU and capability) and per kernel its status and what it was built for. With a GPU
present, each available kernel that defines ``self_check()`` runs once on small random
inputs against its reference and prints the error and the time.
"""

from __future__ import annotations

import argparse
import platform
import sys

import prime_kernels


def _runtime_lines() -> list[str]:
    import torch

    lines = [
        f"python        {platform.python_version()} ({sys.executable})",
        f"torch         {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
    ]
    if not torch.cuda.is_available():
        lines.append("gpu           none visible to torch")
        return lines
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        lines.append(
            f"gpu {index}         {props.name}, sm_{props.major}{props.minor}, "
            f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
        )
    return lines


def _build_lines() -> list[str]:
    info = prime_kernels.build_info()
    if not info:
        return ["build         no build record (source tree without a build, or a plain install)"]
    return [
        f"build         prime-kernels {info.get('version')} at {info.get('git_commit')}, "
        f"{info.get('built_at')}",
        f"built with    nvcc {info.get('nvcc')}, torch {info.get('torch')} "
        f"(CUDA {info.get('torch_cuda')}), python {info.get('python')}, "
        f"stable ABI target torch {info.get('torch_target_version')}",
    ]


def _kernel_lines() -> list[str]:
    info = prime_kernels.build_info().get("kernels", {})
    lines = []
    for name in prime_kernels.KERNELS:
        spec = prime_kernels.spec(name)
        recorded = info.get(name, {})
        if spec.python_only:
            built = "python-only"
        elif recorded.get("built"):
            built = "built for " + ", ".join(recorded.get("sm", spec.sm_names))
        elif prime_kernels.is_built(name):
            built = "built (no build record)"
        else:
            built = "not built"
        reason = prime_kernels.unavailable_reason(name)
        lines.append(f"{name:<14}{'available' if reason is None else 'unavailable'}; {built}")
        if reason is not None:
            lines.append(f"{'':<14}{reason}")
    return lines


def _self_check_lines() -> list[str]:
    lines = []
    for name in prime_kernels.KERNELS:
        if not prime_kernels.is_available(name):
            continue
        module = prime_kernels.load(name)
        check = getattr(module, "self_check", None)
        if check is None:
            continue
        try:
            for label, error, ms in check():
                lines.append(f"{name:<14}{label:<40} rel. error {error:.2e}  {ms:8.3f} ms")
        except Exception as exc:  # a report must print even when a kernel is broken
            lines.append(f"{name:<14}self-check FAILED: {type(exc).__name__}: {exc}")
    return lines


def report(run_checks: bool = True) -> str:
    import torch

    sections = [
        "prime-kernels report",
        *_build_lines(),
        *_runtime_lines(),
        "",
        "kernels",
        *_kernel_lines(),
    ]
    if run_checks and torch.cuda.is_available():
        checks = _self_check_lines()
        sections += ["", "self-checks (small random inputs vs the kernel's reference)"]
        sections += checks or ["(no available kernel has a self-check on this device)"]
    return "\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime_kernels", description=__doc__)
    parser.add_argument(
        "--no-check", action="store_true", help="skip running the kernels on the GPU"
    )
    args = parser.parse_args(argv)
    print(report(run_checks=not args.no_check))
    return 0


if __name__ == "__main__":
    sys.exit(main())

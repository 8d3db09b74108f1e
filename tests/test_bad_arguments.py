"""Every bad argument of bad_arguments.py raises its ValueError from a process of its own:
with CPU tensors on any machine where the extension is built (the checks of dtypes, shapes
and values come before the device check), and with CUDA tensors on a GPU the kernel was
built for. A case whose process dies (a crash instead of an error) fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import prime_kernels
from prime_kernels import flash_moe

from . import bad_arguments

# The subprocesses import the same prime_kernels as this process.
PACKAGE_ROOT = str(Path(prime_kernels.__file__).resolve().parents[1])


def outcomes(device: str) -> dict[str, tuple[bool, str]]:
    if device not in _outcomes:
        path = os.environ.get("PYTHONPATH", "")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, path) if p)
        try:
            _outcomes[device] = bad_arguments.run_each_in_own_process(
                sorted(bad_arguments.cases_for(device)), device
            )
        finally:
            os.environ["PYTHONPATH"] = path
    return _outcomes[device]


_outcomes: dict[str, dict[str, tuple[bool, str]]] = {}


@pytest.mark.skipif(
    not flash_moe.EXTENSION_BUILT, reason="flash_moe is not compiled into this install"
)
@pytest.mark.parametrize("case", sorted(bad_arguments.cases_for("cpu")))
def test_cpu_tensors(case):
    passed, what = outcomes("cpu")[case]
    assert passed, what


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(bad_arguments.cases_for("cuda")))
def test_cuda_tensors(flash_moe, case):
    passed, what = outcomes("cuda")[case]
    assert passed, what

"""The run-time registry: CONTRACT.md's API and its exact reasons, on any machine."""

from __future__ import annotations

import pytest
import torch

import prime_kernels
from prime_kernels._manifest import KernelSpec


@pytest.fixture
def fresh_registry(monkeypatch):
    prime_kernels._import_kernel.cache_clear()
    yield prime_kernels
    prime_kernels._import_kernel.cache_clear()


def fake_device(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_kernels_in_manifest_order():
    assert prime_kernels.KERNELS == ("flash_moe",)
    assert prime_kernels.spec("flash_moe").ops == "prime_moe"


def test_unknown_name_lists_known_kernels():
    for call in (
        prime_kernels.spec,
        prime_kernels.is_built,
        prime_kernels.unavailable_reason,
        prime_kernels.is_available,
        prime_kernels.load,
    ):
        with pytest.raises(KeyError, match="unknown kernel 'nope'; known kernels: flash_moe"):
            call("nope")


def test_not_built(monkeypatch, fresh_registry):
    monkeypatch.setattr(prime_kernels, "is_built", lambda name: False)
    monkeypatch.setattr(prime_kernels, "build_info", lambda: {})
    reason = prime_kernels.unavailable_reason("flash_moe")
    assert reason == "flash_moe is not compiled into this install."
    assert not prime_kernels.is_available("flash_moe")
    assert prime_kernels.status() == {"flash_moe": reason}
    with pytest.raises(RuntimeError, match="not compiled into this install"):
        prime_kernels.load("flash_moe")


def test_not_built_says_why_the_build_skipped_it(monkeypatch):
    monkeypatch.setattr(prime_kernels, "is_built", lambda name: False)
    info = {"kernels": {"flash_moe": {"built": False, "reason": "no nvcc found (looked in X)"}}}
    monkeypatch.setattr(prime_kernels, "build_info", lambda: info)
    assert prime_kernels.unavailable_reason("flash_moe") == (
        "flash_moe is not compiled into this install "
        "(the build skipped it: no nvcc found (looked in X))."
    )


def test_no_device(monkeypatch):
    monkeypatch.setattr(prime_kernels, "is_built", lambda name: True)
    fake_device(monkeypatch, None)
    assert prime_kernels.unavailable_reason("flash_moe") == (
        "flash_moe requires a CUDA device (sm_90a)."
    )


def test_cpu_device_argument(monkeypatch):
    monkeypatch.setattr(prime_kernels, "is_built", lambda name: True)
    fake_device(monkeypatch, (9, 0))
    assert prime_kernels.unavailable_reason("flash_moe", device="cpu") == (
        "flash_moe requires a CUDA device (sm_90a)."
    )


def test_wrong_arch(monkeypatch):
    monkeypatch.setattr(prime_kernels, "is_built", lambda name: True)
    fake_device(monkeypatch, (10, 0))
    assert prime_kernels.unavailable_reason("flash_moe") == (
        "flash_moe requires sm_90a, this device is sm_100 (flash_moe was built for sm_90a only)."
    )
    fake_device(monkeypatch, (8, 0))
    assert "this device is sm_80" in prime_kernels.unavailable_reason("flash_moe", device=0)


def test_built_arch_comes_from_the_build_record(monkeypatch):
    monkeypatch.setattr(prime_kernels, "is_built", lambda name: True)
    info = {"kernels": {"flash_moe": {"built": True, "arch": ["10.0a"]}}}
    monkeypatch.setattr(prime_kernels, "build_info", lambda: info)
    fake_device(monkeypatch, (9, 0))
    assert prime_kernels.unavailable_reason("flash_moe") == (
        "flash_moe requires sm_100a, this device is sm_90 (flash_moe was built for sm_100a only)."
    )


def test_matching_device_is_available(monkeypatch):
    monkeypatch.setattr(prime_kernels, "is_built", lambda name: True)
    fake_device(monkeypatch, (9, 0))
    assert prime_kernels.unavailable_reason("flash_moe") is None
    assert prime_kernels.is_available("flash_moe")
    assert prime_kernels.status() == {"flash_moe": "available"}


def test_python_only_kernel_requirements(monkeypatch):
    specs = dict(prime_kernels._SPECS)
    specs["pyk"] = KernelSpec(
        name="pyk", description="pure", python_only=True, requires=("surely_not_installed_pkg",)
    )
    monkeypatch.setattr(prime_kernels, "_SPECS", specs)
    assert prime_kernels.is_built("pyk")
    assert prime_kernels.unavailable_reason("pyk") == (
        "pyk requires package surely_not_installed_pkg."
    )
    specs["pyk"] = KernelSpec(name="pyk", description="pure", python_only=True, requires=("json",))
    assert prime_kernels.unavailable_reason("pyk") is None


def test_load_is_cached(monkeypatch, fresh_registry):
    if prime_kernels.unavailable_reason("flash_moe") is not None:
        monkeypatch.setattr(prime_kernels, "unavailable_reason", lambda name, device=None: None)
    first = prime_kernels.load("flash_moe")
    assert prime_kernels.load("flash_moe") is first
    assert first.__name__ == "prime_kernels.flash_moe"


def test_registry_import_needs_no_torch():
    import subprocess
    import sys

    code = (
        "import sys, prime_kernels; "
        "assert 'torch' not in sys.modules, 'importing the registry imported torch'; "
        "print(prime_kernels.KERNELS)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "flash_moe" in result.stdout


def test_extension_that_does_not_load(monkeypatch):
    """A compiled extension that fails to import (built against another torch or CUDA, a
    damaged file) is a reason, not "available" followed by a missing op at the first call."""
    monkeypatch.setattr(prime_kernels, "is_built", lambda name: True)
    fake_device(monkeypatch, (9, 0))

    def broken(name):
        raise ImportError("_C.abi3.so: undefined symbol: aoti_torch_new_symbol")

    monkeypatch.setattr(prime_kernels, "_import_kernel", broken)
    reason = prime_kernels.unavailable_reason("flash_moe")
    assert reason == (
        "flash_moe is compiled into this install but does not load: "
        "_C.abi3.so: undefined symbol: aoti_torch_new_symbol."
    )
    assert prime_kernels.status() == {"flash_moe": reason}
    with pytest.raises(RuntimeError, match="does not load: _C.abi3.so: undefined symbol"):
        prime_kernels.load("flash_moe")


def test_damaged_extension_file(tmp_path):
    """The real import path, in a copy of the package whose extension is not a shared library:
    importing flash_moe fails naming the file and what it was built for, and the registry says
    so; without the file the package imports and its shape rules still answer."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    package = Path(prime_kernels.__file__).parent
    shutil.copytree(package, tmp_path / "prime_kernels", ignore=shutil.ignore_patterns("_C*.so"))
    extension = tmp_path / "prime_kernels" / "flash_moe" / "_C.abi3.so"
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "torch.cuda.current_device = lambda: 0\n"
        "torch.cuda.get_device_capability = lambda device=None: (9, 0)\n"
        "import prime_kernels\n"
        "print(prime_kernels.is_built('flash_moe'))\n"
        "print(prime_kernels.unavailable_reason('flash_moe'))\n"
        "try:\n"
        "    import prime_kernels.flash_moe as fm\n"
        "    print('imported', fm.EXTENSION_BUILT, fm.unsupported_shape_reason(4096, 1024))\n"
        "except ImportError as error:\n"
        "    print('ImportError:', error)\n"
    )

    def run():
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()

    assert run() == [
        "False",
        "flash_moe is not compiled into this install.",
        "imported False None",
    ]
    extension.write_bytes(b"not a shared library")
    built, reason, imported = run()
    assert built == "True"
    assert reason.startswith("flash_moe is compiled into this install but does not load: ")
    assert str(extension) in reason and "install the prime-kernels wheel" in reason
    assert imported.startswith("ImportError: prime_kernels.flash_moe's extension ")
    assert "was built for torch >= 2.10" in imported

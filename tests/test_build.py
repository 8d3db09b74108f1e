"""setup.py: skip reasons (with fake toolkits), PRIME_KERNELS selection and
PRIME_KERNELS_REQUIRE, and a throwaway kernel built from a temporary manifest, which proves
that adding a kernel needs only its folder and its table."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prime_kernels._manifest import parse_manifest

REPO = Path(__file__).resolve().parents[1]
GOOD_TOOLKIT = {"torch": "2.11.0+cu130", "torch_cuda": "13.0", "cuda_home": "/cuda", "nvcc": "13.0"}
KERNEL = parse_manifest(
    '[k]\ndescription = "d"\nops = "prime_k"\nsources = ["csrc/k.cu"]\narch = ["9.0a"]\n'
    "cxx-std = 17\n"
)["k"]


def load_setup_py():
    spec = importlib.util.spec_from_file_location("prime_kernels_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only; setup() runs as __main__
    return module


@pytest.fixture(scope="module")
def setup_module_():
    return load_setup_py()


@pytest.fixture
def kernel_dir(tmp_path):
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "k.cu").write_text("// source\n")
    return tmp_path


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"torch": None, "torch_cuda": None}, "torch is not importable in the build environment"),
        ({"torch_cuda": None}, "torch 2.11.0+cu130 is built without CUDA"),
        ({"nvcc": None}, "no nvcc found (looked in /cuda)"),
        ({"nvcc": None, "cuda_home": None}, "no nvcc found (looked in CUDA_HOME and PATH)"),
        (
            {"nvcc": "12.8"},
            "nvcc is CUDA 12.8 but torch 2.11.0+cu130 is built with CUDA 13.0; "
            "the CUDA majors must match",
        ),
    ],
)
def test_skip_reasons(setup_module_, kernel_dir, change, expected):
    toolkit = {**GOOD_TOOLKIT, **change}
    assert setup_module_.skip_reason(KERNEL, toolkit, kernel_dir).startswith(expected)


def test_missing_sources(setup_module_, tmp_path):
    reason = setup_module_.skip_reason(KERNEL, GOOD_TOOLKIT, tmp_path)
    assert reason == "sources missing: csrc/k.cu"


def test_suitable_toolkit(setup_module_, kernel_dir):
    assert setup_module_.skip_reason(KERNEL, GOOD_TOOLKIT, kernel_dir) is None


def test_fake_nvcc_is_probed(setup_module_, tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    toolkit = setup_module_.probe_toolkit()
    assert toolkit["nvcc"] == "12.4"
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "missing"))
    assert setup_module_.probe_toolkit()["nvcc"] is None


def test_prime_kernels_selection(setup_module_, monkeypatch):
    specs = {"a": KERNEL, "b": KERNEL, "c": KERNEL}
    monkeypatch.setenv("PRIME_KERNELS", "c, a")
    assert setup_module_.selected_kernels(specs) == ["a", "c"]
    monkeypatch.setenv("PRIME_KERNELS", "a,zzz")
    with pytest.raises(SystemExit, match="unknown kernel.*zzz; known: a, b, c"):
        setup_module_.selected_kernels(specs)
    monkeypatch.delenv("PRIME_KERNELS")
    assert setup_module_.selected_kernels(specs) == ["a", "b", "c"]


TINY_SOURCE = r"""
// A throwaway kernel: one CPU op through the stable ABI, compiled by nvcc for sm_90a.
#include <Python.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <sstream>
#include <stdexcept>

__global__ void tiny_scale_kernel(float* data, float factor) { data[threadIdx.x] *= factor; }

torch::stable::Tensor tiny_scale(torch::stable::Tensor x, double factor) {
  if (x.dim() != 1) {  // a number formatted by iostreams: what a second libstdc++ breaks
    std::ostringstream message;
    message << "x must be 1-D, got " << x.dim() << "-D";
    throw std::invalid_argument(message.str());
  }
  torch::stable::Tensor out = torch::stable::empty_like(x);
  const float* in = x.const_data_ptr<float>();
  float* result = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) result[i] = in[i] * static_cast<float>(factor);
  return out;
}

STABLE_TORCH_LIBRARY(prime_tiny, m) { m.def("scale(Tensor x, float factor) -> Tensor"); }
STABLE_TORCH_LIBRARY_IMPL(prime_tiny, CPU, m) { m.impl("scale", TORCH_BOX(&tiny_scale)); }

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
"""

TINY_MANIFEST = """
[tiny]
description = "throwaway kernel of the build test"
ops = "prime_tiny"
sources = ["csrc/tiny.cu"]
arch = ["9.0a"]
cxx-std = 17

[ghost]
description = "a kernel whose sources are missing"
ops = "prime_ghost"
sources = ["csrc/ghost.cu"]
arch = ["9.0a"]
cxx-std = 17
"""


def make_throwaway_repo(root: Path) -> Path:
    """A copy of the wheel's machinery with a manifest of its own: setup.py and the
    package's Python files, no edit to either; the new kernel is a folder and a table."""
    shutil.copy(REPO / "setup.py", root / "setup.py")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    package = root / "prime_kernels"
    package.mkdir()
    for name in ("__init__.py", "__main__.py", "_manifest.py"):
        shutil.copy(REPO / "prime_kernels" / name, package / name)
    if (REPO / "prime_kernels" / "include").is_dir():
        shutil.copytree(REPO / "prime_kernels" / "include", package / "include")
    (package / "kernels.toml").write_text(TINY_MANIFEST)
    (package / "tiny" / "csrc").mkdir(parents=True)
    (package / "tiny" / "csrc" / "tiny.cu").write_text(TINY_SOURCE)
    (package / "tiny" / "__init__.py").write_text(
        "import torch\n\nfrom . import _C  # noqa: F401\n\n\n"
        "def scale(x, factor):\n    return torch.ops.prime_tiny.scale(x, factor)\n"
    )
    (package / "ghost").mkdir()
    return root


def run_setup(root: Path, **env):
    return subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=root,
        env={**os.environ, "MAX_JOBS": "2", **env},
        capture_output=True,
        text=True,
    )


@pytest.mark.slow
def test_throwaway_kernel_builds_from_its_table(tmp_path):
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    root = make_throwaway_repo(tmp_path)

    required = run_setup(root, PRIME_KERNELS="tiny,ghost", PRIME_KERNELS_REQUIRE="1")
    assert required.returncode != 0
    assert "ghost cannot be built: sources missing: csrc/ghost.cu" in required.stderr

    unknown = run_setup(root, PRIME_KERNELS="tiny,nothere")
    assert unknown.returncode != 0 and "unknown kernel(s) nothere" in unknown.stderr

    built = run_setup(root, PRIME_KERNELS_REQUIRE="0")
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert "skipping ghost: sources missing: csrc/ghost.cu" in built.stderr
    assert "-gencode=arch=compute_90a,code=sm_90a" in built.stdout + built.stderr
    assert list((root / "prime_kernels" / "tiny").glob("_C*.so")), "no extension was built"

    info = json.loads((root / "prime_kernels" / "_build_info.json").read_text())
    assert info["kernels"]["tiny"] == {"built": True, "arch": ["9.0a"], "sm": ["sm_90a"]}
    assert info["kernels"]["ghost"]["built"] is False
    assert info["torch_target_version"] == "2.10" and info["nvcc"] and info["python"]

    check = textwrap.dedent(
        """
        import torch, prime_kernels
        assert prime_kernels.KERNELS == ("tiny", "ghost"), prime_kernels.KERNELS
        assert prime_kernels.is_built("tiny") and not prime_kernels.is_built("ghost")
        print(prime_kernels.unavailable_reason("ghost"))
        import prime_kernels.tiny as tiny
        x = torch.randn(37)
        torch.testing.assert_close(tiny.scale(x, 2.5), x * 2.5)
        try:
            tiny.scale(x.view(1, 37), 2.5)
        except ValueError as error:
            assert str(error) == "x must be 1-D, got 2-D", str(error)
        else:
            raise AssertionError("no error for a 2-D x")
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", check], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "ghost is not compiled into this install (the build skipped it: sources missing" in (
        result.stdout
    )
    assert result.stdout.strip().endswith("ok")

    # A compiler that links libstdc++ statically (as a GCC installed without libstdc++.so
    # does) still gives an extension on torch's shared libstdc++, whose error messages work.
    # Without the build's own link of libstdc++.so.6 this message lost its number here and
    # crashed the process (SIGSEGV) under another Python.
    wrappers = tmp_path / "static-libstdcxx"
    wrappers.mkdir()
    for name in ("gcc", "g++"):
        real = shutil.which(name)
        (wrappers / name).write_text(f'#!/bin/sh\nexec {real} -static-libstdc++ "$@"\n')
        (wrappers / name).chmod(0o755)
    shutil.rmtree(root / "build")
    static = run_setup(
        root, PRIME_KERNELS="tiny", CC=str(wrappers / "gcc"), CXX=str(wrappers / "g++")
    )
    assert static.returncode == 0, static.stdout[-3000:] + static.stderr[-3000:]
    assert f"{wrappers / 'g++'} " in static.stdout + static.stderr, "the wrapper did not link"
    (library,) = (root / "prime_kernels" / "tiny").glob("_C*.so")
    assert load_setup_py().static_cxx_runtime_reason(library) is None
    result = subprocess.run([sys.executable, "-c", check], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
def test_static_cxx_runtime_is_detected(tmp_path):
    """The build's check refuses a library that carries a copy of libstdc++."""
    source = tmp_path / "lib.cpp"
    source.write_text(
        "#include <sstream>\n#include <string>\n"
        "std::string format(long n) { std::ostringstream s; s << n; return s.str(); }\n"
    )
    check = load_setup_py().static_cxx_runtime_reason
    for flags, carries_copy in (([], False), (["-static-libstdc++"], True)):
        library = tmp_path / f"lib{len(flags)}.so"
        subprocess.run(
            ["g++", "-shared", "-fPIC", *flags, "-o", str(library), str(source)], check=True
        )
        reason = check(library)
        assert (reason is not None) == carries_copy, reason
        if carries_copy:
            assert "carries its own copy of libstdc++" in reason

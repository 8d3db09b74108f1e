"""ptxas's report on every CUDA translation unit of the manifest's kernels, compiled with the
flags setup.py gives them: no kernel spills registers and none has its wgmma serialized
(ptxas info C75xx, "wgmma.mma_async instructions are serialized"). Neither fails a build, and
either costs speed with no other sign: dh's epilogue once led ptxas to serialize every wgmma
of its kernel (2.12 ms instead of 1.59 at Qwen3-30B-A3B T = 32768, benchmarks/RESULTS.md),
and the only trace was one info line among the build's output. Needs nvcc, not a GPU."""

from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from prime_kernels._manifest import load_manifest

from .test_build import load_setup_py

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIR = REPO / "prime_kernels"
ENTRY = re.compile(r"Compiling entry function '(\S+)' for")
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
SERIALIZED = re.compile(r"\(C75\d\d\).*wgmma.*serialized.*")


def translation_units():
    """(kernel name, spec, source path) of every .cu source in the manifest."""
    units = []
    for name, spec in load_manifest(PACKAGE_DIR / "kernels.toml").items():
        if spec.python_only:
            continue
        units += [(name, spec, src) for src in spec.sources if src.endswith(".cu")]
    return units


UNITS = translation_units()


def compile_command(nvcc, setup, spec, kernel_dir: Path, source: str, output: Path) -> list:
    """setup.py's device flags for the kernel (torch's own only switch host code and the
    half/bf16 operators that setup.py turns back on), its include paths, ptxas -v."""
    from torch.utils.cpp_extension import include_paths

    includes = [kernel_dir / inc for inc in spec.include_dirs] + [PACKAGE_DIR / "include"]
    return [
        nvcc,
        "-c",
        str(kernel_dir / source),
        "-o",
        str(output),
        *setup.nvcc_flags(spec),
        *(f"-I{path}" for path in includes + include_paths()),
        "-Xptxas",
        "-v",
    ]


def parse_report(text: str) -> tuple[list[str], list[str]]:
    """(spilling functions with their byte counts; serialization notes) from ptxas -v. A
    spill line outside any named function counts too."""
    spilling, current = [], "?"
    for line in text.splitlines():
        entry = ENTRY.search(line)
        if entry:
            current = entry.group(1)
            continue
        spills = SPILLS.search(line)
        if spills and (int(spills.group(1)) or int(spills.group(2))):
            spilling.append(f"{current}: {spills.group(0)}")
    return spilling, [m.group(0) for m in SERIALIZED.finditer(text)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """ptxas's output for every translation unit, compiled in parallel."""
    setup = load_setup_py()
    cuda_home = setup.probe_toolkit()["cuda_home"]  # the toolkit the build compiles with
    nvcc = Path(cuda_home) / "bin" / "nvcc" if cuda_home else None
    if nvcc is None or not nvcc.exists():
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    out_dir = tmp_path_factory.mktemp("ptxas")

    def run(unit):
        name, spec, source = unit
        output = out_dir / f"{name}-{Path(source).stem}.o"
        cmd = compile_command(str(nvcc), setup, spec, PACKAGE_DIR / name, source, output)
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        return (name, source), result

    # An nvcc of these translation units takes up to ~2 GB: at most 4 at a time.
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        return dict(pool.map(run, UNITS))


@pytest.mark.parametrize(("name", "source"), [(n, s) for n, _, s in UNITS])
def test_no_spills_and_no_serialized_wgmma(reports, name, source):
    result = reports[(name, source)]
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"{source} does not compile:\n{report[-4000:]}"
    assert ENTRY.search(report), f"no ptxas report for {source}:\n{report[-2000:]}"
    spilling, serialized = parse_report(report)
    assert not serialized, f"{source}: ptxas serialized wgmma:\n" + "\n".join(serialized)
    assert not spilling, f"{source}: register spills:\n" + "\n".join(spilling)


def test_the_report_is_read():
    """parse_report on the lines ptxas prints: a spill and a serialization are both seen."""
    text = (
        "ptxas info    : Compiling entry function '_Z1kv' for 'sm_90a'\n"
        "ptxas info    : Function properties for _Z1kv\n"
        "    24 bytes stack frame, 32 bytes spill stores, 64 bytes spill loads\n"
        "ptxas info    : Compiling entry function '_Z1jv' for 'sm_90a'\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to program dependence on compiler-inserted WG.AR in divergent path in "
        "the function '_Z1kv'\n"
    )
    spilling, serialized = parse_report(text)
    assert spilling == ["_Z1kv: 32 bytes spill stores, 64 bytes spill loads"]
    assert len(serialized) == 1 and "C7520" in serialized[0]

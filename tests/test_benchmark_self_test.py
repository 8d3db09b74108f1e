"""The benchmarks' own self-tests (CPU): benchmarks/flash_moe.py --self-test, the forward and
training runs at a toy shape, with stand-ins for ours and for a peer timed at two settings,
through rows, speedups (against the peer at its best too), tables, the raw JSON, --merge and
--combine; and benchmarks/ab.py --self-test. The benchmarks' numbers are only as good as these
pipelines."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_self_test(script, *args):
    """Runs benchmarks/<script> --self-test with args on this tree; returns (stdout, stdout and
    stderr)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--self-test", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return result.stdout, output


def test_benchmark_self_test(tmp_path):
    stdout, output = run_self_test(
        "flash_moe.py",
        "--results",
        str(tmp_path / "RESULTS.md"),
        "--results-json",
        str(tmp_path / "flash_moe.json"),
    )
    assert "self-test passed" in stdout, output[-4000:]


def test_ab_self_test(tmp_path):
    """benchmarks/ab.py --self-test (CPU): three builds (this tree and two that link to its
    prime_kernels) in rotated rounds, their inputs compared, each child's import checked, the
    A/B and A/C ratios and the JSON."""
    _, output = run_self_test("ab.py", "--rounds", "3", "--json", str(tmp_path / "ab.json"))
    assert "self-test passed: 4 shapes, 3 builds, 3 rounds" in output, output[-4000:]


def test_gpu_clock_summaries():
    """harness.GpuClocks' summary of NVML samples (clock MHz, power W, clock-event reasons) and
    merge_clocks over a row's rounds; on CPU nothing is sampled."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("harness", ROOT / "benchmarks" / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)

    class Cpu:
        type = "cpu"

    with harness.GpuClocks(Cpu()) as clocks:
        pass
    assert clocks.summary() is None
    clocks.samples = [(1500, 690.0, 0x4), (1400, 700.0, 0x4 | 0x1), (1980, 300.0, 0x1)]
    first = clocks.summary()
    assert first == {
        "sm_clock_mhz": 1500,
        "power_w": 690.0,
        "power_capped": 0.667,
        "thermal": 0.0,
        "samples": 3,
    }
    clocks.samples = [(1200, 700.0, 0x20)]
    second = clocks.summary()
    assert second["thermal"] == 1.0 and second["power_capped"] == 0.0
    merged = harness.merge_clocks([first, None, second])
    assert merged["sm_clock_mhz"] == 1350 and merged["samples"] == 4
    assert merged["power_capped"] == round((0.667 + 0.0) / 2, 3)
    assert harness.merge_clocks([None, None]) is None


def test_commit_label_names_a_foreign_build(tmp_path):
    """A run's commit label names the extension's own commit where it was built from another
    (a .so copied into a checkout, or a checkout whose .git lags the tree)."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import harness
    finally:
        sys.path.pop(0)

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "prime_kernels").mkdir()
    (tmp_path / "README").write_text("x\n")
    git("add", "README")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    info = tmp_path / "prime_kernels" / "_build_info.json"
    env = os.environ.pop("PRIME_KERNELS_COMMIT", None)
    try:
        info.write_text(json.dumps({"git_commit": head}))
        assert harness.git_commit(tmp_path) == head[:7]
        info.write_text(json.dumps({"git_commit": "0123456789abcdef-dirty"}))
        assert harness.git_commit(tmp_path) == f"{head[:7]} (extension built from 0123456789ab)"
    finally:
        if env is not None:
            os.environ["PRIME_KERNELS_COMMIT"] = env


def test_results_json_reads_back_non_finite_numbers(tmp_path):
    """A training run's backward row whose fwd+bwd time is not above its training forward's
    (noise on a tiny shape) keeps ms = NaN, which the JSON holds as a string; --combine reads
    the raw numbers back and formats them, so read_json must give floats again."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import harness
    finally:
        sys.path.pop(0)

    path = tmp_path / "run.json"
    rows = [{"mode": "bwd", "ms": float("nan")}, {"ms": float("inf"), "x": 1.5}]
    harness.write_json(path, {"rows": rows})
    assert '"nan"' in path.read_text()
    back = harness.read_json(path)["rows"]
    assert math.isnan(back[0]["ms"]) and back[1]["ms"] == float("inf") and back[1]["x"] == 1.5
    assert harness.fmt_ms(back[0]["ms"]) == ""

"""The flash_moe benchmark's own self-test (benchmarks/flash_moe.py --self-test, CPU): the
forward and training runs at a toy shape, with stand-ins for ours and for a peer timed at two
settings, through rows, speedups (against the peer at its best too), tables, the raw JSON,
--merge and --combine. The benchmark's numbers are only as good as that pipeline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_benchmark_self_test(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "flash_moe.py"),
            "--self-test",
            "--results",
            str(tmp_path / "RESULTS.md"),
            "--results-json",
            str(tmp_path / "flash_moe.json"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "self-test passed" in result.stdout, output[-4000:]

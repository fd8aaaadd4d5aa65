"""scripts/gpu_check.py, the script a lent GPU machine runs in its few minutes: rehearsed on the CPU
here, so that it does not first fail there (it had, after a module it imported was renamed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import GRID, TINY

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_it_refuses_without_cuda_in_one_line(tmp_path):
    result = gpu_check("--out", str(tmp_path))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("gpu_check: error: ") and result.stderr.count("\n") == 1
    assert "has no CUDA device" in result.stderr and "rehearse it here with --device cpu" in result.stderr


def test_its_check_and_sweep_rehearse_on_the_cpu(tmp_path):
    sweep = [arg for arg in TINY if arg != "train.device=cpu"] + GRID
    result = gpu_check(
        *("--device", "cpu", "--out", str(tmp_path), "--parts", "check", "sweep", "--steps", "2", "--length", "4"),
        *("--sweep-jobs", "2", "--sweep-args", *sweep),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = result.stdout[result.stdout.index("## GPU check") :]
    assert "### check" in report and "| multihead | cpu |" in report and "of 512 sequences identical" in report
    assert "| transformer | cpu |" in report and "| mamba | cpu |" in report  # every model, not only the GRU's
    assert "Luong general twice on cpu, one seed: identical" in report
    assert "### sweep" in report and "8 runs finished" in report and "luong_general" in report


def test_a_part_stopped_at_its_time_limit_says_so_and_is_no_failure(tmp_path):
    sweep = [arg for arg in TINY if arg != "train.device=cpu"] + GRID
    result = gpu_check(
        *("--device", "cpu", "--out", str(tmp_path), "--parts", "sweep", "--sweep-limit", "1"),
        *("--sweep-jobs", "2", "--sweep-args", *sweep),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sweep: stopped at its time limit" in result.stdout and "FAILED" not in result.stdout
    assert "(stopped at its 1 s limit)" in result.stdout

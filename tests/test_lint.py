"""The code keeps to the linter and the formatter configured in pyproject.toml (ruff): a
violation fails the suite, so the test command is the whole check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import needs

ROOT = Path(__file__).resolve().parents[1]


@needs("ruff", "pip install -e '.[test]'")
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing(command):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr

"""The SLURM launcher's parts that need no SLURM (copytask.slurm): squeue's answers read, submitit's
log kept off the terminal, a job's log read for its cause, an unknown partition refused. The
launcher against a real SLURM: tests/test_slurm.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from copytask.config.checks import check_launcher
from copytask.console import ConfigError
from copytask.sweeps import slurm

LAUNCHER = "hydra_plugins.copytask_slurm_launcher.copytask_slurm_launcher.SlurmLauncher"


@pytest.fixture
def commands(tmp_path, monkeypatch):
    """commands(name=shell script body, ...): fake SLURM commands on PATH."""

    def put(**scripts: str) -> None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        for name, body in scripts.items():
            (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
            (bin_dir / name).chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    return put


def test_squeue_states_are_read_per_array_element(commands):
    commands(squeue='printf "12_0|RUNNING\\n12_1|PENDING\\n12_2|FAILED\\n"')
    assert slurm.queue_states({"12"}) == {"12_0": "RUNNING", "12_1": "PENDING", "12_2": "FAILED"}


def test_a_job_squeue_has_forgotten_is_no_state_and_a_silent_squeue_no_answer(commands):
    commands(squeue='echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1')
    assert slurm.queue_states({"12"}) == {}  # gone from the queue
    commands(squeue='echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1')
    assert slurm.queue_states({"12"}) is None  # ask again later


def test_accounting_is_read_from_the_controllers_config(commands):
    commands(scontrol='echo "AccountingStorageType   = accounting_storage/none"')
    assert not slurm.has_accounting()
    commands(scontrol='echo "AccountingStorageType   = accounting_storage/slurmdbd"')
    assert slurm.has_accounting()


def test_submitits_messages_go_to_the_sweep_log_not_the_terminal(tmp_path, capsys):
    logger = logging.getLogger("submitit")
    handlers, propagate = logger.handlers[:], logger.propagate
    with open(tmp_path / "slurm.log", "w") as log, slurm.quiet_submitit(log):
        logger.warning("Call #3 - Bypassing sacct error Command 'sacct' returned non-zero exit status 1.")
    assert "Bypassing sacct error" in (tmp_path / "slurm.log").read_text()
    captured = capsys.readouterr()
    assert "sacct" not in captured.out + captured.err
    assert logger.handlers == handlers and logger.propagate == propagate  # as it was


def test_a_failed_jobs_cause_is_its_logs_last_line_but_submitits_own(tmp_path):
    log = tmp_path / "12_0_log.err"
    log.write_text(
        "training...\nsrun: error: node17: task 0: Killed\nsubmitit WARNING (2026-12-01) - Bypassing signal SIGTERM\n\n"
    )
    assert slurm.last_line(log) == "srun: error: node17: task 0: Killed"
    assert slurm.last_line(tmp_path / "missing.err") == ""


def test_a_partition_the_cluster_does_not_have_is_refused_naming_those_it_has(commands):
    commands(srun="exit 0", sbatch="exit 0", sinfo='printf "cpu\\ngpu\\ngpu\\n"')
    check_launcher(LAUNCHER, "slurm", "gpu")  # there
    with pytest.raises(
        ConfigError,
        match=r"^hydra.launcher.partition=gpux: this cluster has no partition gpux \(sinfo lists cpu, gpu\)$",
    ):
        check_launcher(LAUNCHER, "slurm", "gpux")
    commands(sinfo="exit 1")  # the controller does not answer: sbatch will say
    check_launcher(LAUNCHER, "slurm", "gpux")


def test_the_plugin_is_where_hydra_finds_launchers():
    from hydra_plugins.copytask_slurm_launcher.copytask_slurm_launcher import SlurmLauncher

    assert f"{SlurmLauncher.__module__}.{SlurmLauncher.__name__}" == LAUNCHER
    config = (Path(__file__).parents[1] / "configs" / "hydra" / "launcher" / "slurm.yaml").read_text()
    assert f"_target_: {LAUNCHER}" in config

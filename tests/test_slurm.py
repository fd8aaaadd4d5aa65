"""Sweeps through `hydra/launcher=slurm` against a real one-node SLURM (tests/slurm_cluster.py):
the same runs and numbers as the local launcher, a quiet terminal without accounting, jobs killed
mid-run or cancelled named and continued by the rerun, a time limit and a preemption requeued and finished, a
GPU-less node named per job, a second sweep that leaves the first one's runs alone, and the
inputs SLURM refuses. Where the tests are not root (slurmd starts jobs as their user) they skip,
saying how to run them (docs/cluster.md)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from copytask import store
from copytask.sweeps.grid import compose_grid

from . import slurm_cluster
from .conftest import TINY, pythonpath, run_cli

# Under pytest-xdist each worker that runs some of these starts its own one-node SLURM (own ports,
# own folder): they do not share one.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(slurm_cluster.unavailable()), reason=f"no SLURM: {slurm_cluster.unavailable()}"),
]

# One CPU per job, so two jobs run at once on a two-core node; 1 GB each.
SLURM = ["hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1"]
GRID = ["attention=none,luong_general", "task.length=3", "seed=0"]
# A run with one checkpoint (at step 20) before its end; no early stop. A sweep that must be caught
# in the middle of it holds its first attempts at that checkpoint (`sweep_in_background`'s release).
STEPS = 40
LONG = [
    *(o for o in TINY if not o.startswith("train.steps=")),
    f"train.steps={STEPS}",
    "train.eval_every=20",
    "train.patience=null",
    "attention=none",
    "task.length=3",
    "seed=0",
]
SAME = ["token_acc", "seq_acc", "final_loss", "steps", "params"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node SLURM (installed first if need be) that the CLI's subprocesses submit to."""
    slurm_cluster.install()
    with slurm_cluster.one_node_slurm(tmp_path_factory.mktemp("slurm")) as env, pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        yield env


def metrics_of(runs_dir: Path, args: list[str]) -> dict[str, dict]:
    _, grid = compose_grid([*args, f"runs_dir={runs_dir}"])
    return {run.folder.name: store.read_json(run.folder / store.METRICS) for run in grid}


# On a sweep's PYTHONPATH: its jobs' first attempts hold at their checkpoint until released
HOLDS = Path(__file__).with_name("first_attempt_holds")


def holding(release: Path) -> dict[str, str]:
    """The environment of a sweep whose jobs' first attempts hold after their checkpoint until the file
    `release` exists (tests/first_attempt_holds), or SLURM signals or kills them."""
    return {**os.environ, "PYTHONPATH": pythonpath(HOLDS), "COPYTASK_TEST_RELEASE": str(release)}


def sweep_in_background(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "copytask", "sweep", *args],
        env=env or {**os.environ, "PYTHONPATH": pythonpath()},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_until(condition, what: str, process: subprocess.Popen | None = None, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            pytest.fail(f"the sweep ended (exit {process.returncode}) while waiting for {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def checkpointed_step(folder: Path) -> int:
    """The step of the run's checkpoint on disk (0: none yet)."""
    try:
        import torch

        return torch.load(folder / store.RESUME, weights_only=True)["progress"]["step"]
    except Exception:  # noqa: BLE001 - none yet, or being replaced as we read
        return 0


def job_ids(runs_dir: Path) -> dict[str, str]:
    """Each run's SLURM job id (`12_0`), from the sweep's log."""
    log = (runs_dir / ".sweep" / "slurm.log").read_text()
    return {run: job for job, run in re.findall(r": SLURM job (\S+): (\S+) \(", log)}


def job_processes(job: str) -> list[int]:
    """The processes of SLURM job `job` (`12_0`) on this node: submitit's Python, which trains the run."""
    array_job, _, task = job.partition("_")
    wanted = {f"SLURM_ARRAY_JOB_ID={array_job}".encode(), f"SLURM_ARRAY_TASK_ID={task}".encode()}
    found = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes()
            environ = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if b"submitit.core._submit" in command and wanted <= environ:
            found.append(int(proc.name))
    return found


def squeue_ids() -> list[str]:
    return subprocess.run(
        ["squeue", "--noheader", "--array", "--format=%i"], capture_output=True, text=True
    ).stdout.split()


def test_a_slurm_sweep_gives_the_local_launchers_runs_and_numbers_on_a_quiet_terminal(slurm, tmp_path):
    args = [*TINY, *GRID]
    local = sweep_in_background(
        [*args, f"runs_dir={tmp_path / 'local'}"], tmp_path / "local.txt"
    )  # side by side: the SLURM sweep mostly waits
    cluster = run_cli("sweep", *args, *SLURM, f"runs_dir={tmp_path / 'slurm'}")
    assert cluster.returncode == 0, cluster.stderr
    assert local.wait(timeout=300) == 0, (tmp_path / "local.txt").read_text()

    by_local, by_slurm = metrics_of(tmp_path / "local", args), metrics_of(tmp_path / "slurm", args)
    assert by_slurm.keys() == by_local.keys() and len(by_slurm) == 2  # the same run names
    for name in by_local:
        assert {key: by_slurm[name][key] for key in SAME} == {key: by_local[name][key] for key in SAME}
    # quiet: no launch lines, no sacct warning, one note that says where job states come from
    terminal = cluster.stdout + cluster.stderr
    assert "sacct" not in terminal.replace("(sacct fails)", "") and "[HYDRA]" not in terminal and "#0" not in terminal
    assert terminal.count("copytask: note: this SLURM keeps no accounting") == 1
    assert "sweep: 2/2 runs complete (2 trained now), 0 failed" in cluster.stdout
    log = (tmp_path / "slurm" / ".sweep" / "slurm.log").read_text()  # where the launch lines went
    assert all(f"{name} (" in log for name in by_slurm) and log.count("returned COMPLETED") == 2

    again = run_cli("sweep", *args, *SLURM, f"runs_dir={tmp_path / 'slurm'}")  # complete: nothing is submitted
    assert again.returncode == 0 and "2/2 runs complete (0 trained now)" in again.stdout
    assert (tmp_path / "slurm" / ".sweep" / "slurm.log").read_text().count("complete, not submitted") == 2


def test_killed_cancelled_and_preempted_jobs_are_named_or_requeued_and_the_rerun_continues_them(slurm, tmp_path):
    runs_dir = tmp_path / "runs"
    # three runs, one CPU each on a two-CPU node: two train, the third waits in the queue.
    # timeout_min=60: a signal this early is a preemption, which max_num_timeout does not count.
    args = [
        *(o for o in LONG if not o.startswith("seed=")),
        "seed=0,1,2",
        *SLURM,
        "hydra.launcher.timeout_min=60",
        "hydra.launcher.max_num_timeout=0",
        f"runs_dir={runs_dir}",
    ]
    killed, preempted, cancelled = compose_grid(args)[1]
    sweep = sweep_in_background(args, tmp_path / "sweep.txt", holding(tmp_path / "never"))  # held at step 20
    try:
        wait_until(
            lambda: min(checkpointed_step(killed.folder), checkpointed_step(preempted.folder)) == 20,
            "two runs' checkpoint",
            sweep,
        )
        jobs = job_ids(runs_dir)
        subprocess.run(["scancel", jobs[cancelled.folder.name]], check=True)  # still queued
        for pid in job_processes(jobs[killed.folder.name]):
            os.kill(pid, signal.SIGKILL)  # kill -9 (scancel does not stop a step under proctrack/linuxproc)
        subprocess.run(
            ["scancel", "--signal=USR2", jobs[preempted.folder.name]], check=True
        )  # what SLURM sends a job it preempts
        assert sweep.wait(timeout=240) == 1  # the summary names the failed jobs
    finally:
        sweep.kill()
    terminal = (tmp_path / "sweep.txt").read_text()
    failed = sorted(line for line in terminal.splitlines() if line.startswith("copytask: job failed:"))
    assert len(failed) == 2, terminal
    named = {run.folder.name: line for run in (killed, cancelled) for line in failed if run.folder.name in line}
    assert "ended CANCELLED without a result" in named[cancelled.folder.name]
    assert "without a result" in named[killed.folder.name]
    assert "1/3 runs complete (1 trained now), 2 failed" in terminal
    requeued = store.read_json(preempted.folder / store.METRICS)
    assert requeued["resumed_from"] == 20 and requeued["steps"] == STEPS
    job_log = next((runs_dir / ".sweep" / ".submitit").glob(f"{jobs[preempted.folder.name]}/*_log.err")).read_text()
    assert "this job is preempted" in job_log and "DUE TO JOB REQUEUE" in job_log
    killed_at = checkpointed_step(killed.folder)
    assert killed_at == 20 < STEPS and not store.is_complete(killed.folder)

    again = run_cli("sweep", *args)  # the same command: trains what is missing, the killed run from its checkpoint
    assert again.returncode == 0, again.stderr
    assert "3/3 runs complete (2 trained now), 0 failed" in again.stdout
    metrics = store.read_json(killed.folder / store.METRICS)
    assert metrics["resumed_from"] == killed_at and metrics["steps"] == STEPS
    assert store.read_json(cancelled.folder / store.METRICS)["resumed_from"] == 0
    assert not (killed.folder / store.FAILED).exists() and not (cancelled.folder / store.FAILED).exists()


def test_a_job_past_its_time_limit_is_requeued_and_finishes(slurm, tmp_path):
    runs_dir = tmp_path / "runs"
    # A two-minute limit, and a first attempt that holds after its checkpoint at step 20 until it is
    # signalled: SLURM signals the job (USR2, signal_delay_s before the limit, but slurmctld looks every
    # 30 s: 60 to 90 s after the start, when the run has written its checkpoint even where Python took
    # long to start on a loaded machine), submitit requeues it, and the requeued attempt continues the
    # run from its checkpoint to its end. (A one-minute limit signalled 20 to 50 s after the start:
    # once, on a loaded machine, before the first checkpoint, and the rerun then trained from step 0.)
    args = [
        *LONG,
        *SLURM,
        "hydra.launcher.timeout_min=2",
        "hydra.launcher.signal_delay_s=60",
        "hydra.launcher.max_num_timeout=3",
        f"runs_dir={runs_dir}",
    ]
    (run,) = compose_grid(args)[1]
    result = subprocess.run(
        [sys.executable, "-m", "copytask", "sweep", *args],
        capture_output=True,
        text=True,
        env=holding(tmp_path / "never"),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    metrics = store.read_json(run.folder / store.METRICS)
    assert metrics["resumed_from"] == 20 and metrics["steps"] == STEPS
    job_log = next((runs_dir / ".sweep" / ".submitit").glob("*/*_log.err")).read_text()
    assert "this job is timed-out" in job_log and "DUE TO JOB REQUEUE" in job_log


def test_train_device_cuda_on_a_node_without_a_gpu_fails_each_job_in_one_line(slurm, tmp_path):
    result = run_cli("sweep", *TINY, *GRID, *SLURM, "train.device=cuda", f"runs_dir={tmp_path}")
    assert result.returncode == 1
    failed = [line for line in result.stderr.splitlines() if line.startswith("copytask: job failed:")]
    assert len(failed) == 2
    node = os.uname().nodename.split(".")[0]
    assert all(f"train.device=cuda was requested but {node} has no CUDA device" in line for line in failed)
    assert "0/2 runs complete (0 trained now), 2 failed" in result.stdout


def test_a_second_sweep_while_the_first_runs_leaves_the_first_ones_runs_alone(slurm, tmp_path):
    runs_dir = tmp_path / "runs"
    # two CPUs per job: the node runs one job at a time, so the first sweep's second run waits in the
    # queue; the first run holds at its checkpoint (`holding`) until the second sweep has decided what to
    # submit (its checks build every job's model on torch's meta device first) and submitted it
    args = [
        *(o for o in LONG if not o.startswith("seed=")),
        "seed=0,1",
        *SLURM,
        "hydra.launcher.cpus_per_task=2",
        f"runs_dir={runs_dir}",
    ]
    first_run, second_run = compose_grid(args)[1]
    release = tmp_path / "release"
    first = sweep_in_background(args, tmp_path / "first.txt", holding(release))
    second = None
    try:
        wait_until(lambda: checkpointed_step(first_run.folder) == 20, "the first sweep's first run to hold", first)
        second = sweep_in_background(args, tmp_path / "second.txt")  # the same grid, the same runs_dir
        submitted = re.compile(rf": SLURM job \S+: {second_run.folder.name} \(")
        wait_until(
            lambda: len(submitted.findall((runs_dir / ".sweep" / "slurm.log").read_text())) == 2,
            "the second sweep to submit the first one's queued run",
            second,
        )
        release.touch()
        assert first.wait(timeout=300) == 0, (tmp_path / "first.txt").read_text()
        assert second.wait(timeout=300) == 0, (tmp_path / "second.txt").read_text()
    finally:
        for sweep in (first, second):
            if sweep is not None:
                sweep.kill()
    log = (runs_dir / ".sweep" / "slurm.log").read_text()
    assert f"{first_run.folder.name} being trained by another process, not submitted" in log
    # the first sweep's queued run: the second sweep's job found it held or complete, and trained nothing
    jobs_out = "".join(path.read_text() for path in (runs_dir / ".sweep" / ".submitit").glob("*/*_log.*"))
    assert jobs_out.count(f"{second_run.folder.name}: greedy token acc") == 1
    assert all(
        store.is_complete(run.folder) and store.read_json(run.folder / store.METRICS)["resumed_from"] == 0
        for run in (first_run, second_run)
    )


def test_a_partition_that_does_not_exist_is_refused_before_anything_is_submitted(slurm, tmp_path):
    result = run_cli("sweep", *TINY, *GRID, *SLURM, "hydra.launcher.partition=nope", f"runs_dir={tmp_path}")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "copytask: error: hydra.launcher.partition=nope: this cluster has no partition nope (sinfo lists debug)"
    )
    assert not squeue_ids()


def test_a_job_sbatch_refuses_is_one_line_naming_the_reason(slurm, tmp_path):
    result = run_cli("sweep", *TINY, *GRID, *SLURM, "hydra.launcher.mem_gb=100000", f"runs_dir={tmp_path}")
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == [
        "copytask: error: SLURM refused the sweep's 2 jobs, nothing was submitted: sbatch: error: "
        "Batch job submission failed: Requested node configuration is not available"
    ], result.stderr


def test_a_launcher_key_that_does_not_exist_is_refused_in_one_line(slurm, tmp_path):
    result = run_cli("sweep", *TINY, *GRID, *SLURM, "hydra.launcher.partion=debug", f"runs_dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.strip() == "copytask: error: unknown key 'hydra.launcher.partion'; `--cfg job` lists every key"

"""The SLURM launcher (`hydra/launcher=slurm`, the plugin in hydra_plugins/copytask_slurm_launcher):
Hydra's submitit SLURM launcher, with what a sweep on a cluster needs besides.

- Only the runs that are missing are submitted: a run that is complete (unless `retrain=true`) or
  that another process trains now (it holds the run's lock) gets no job, so the same sweep command
  again queues only what is left, and a second sweep over the same runs_dir does not queue the runs
  the first one is training.
- Job states come from `squeue` and the jobs' result files, not `sacct`: many clusters keep no
  accounting, and there submitit's sacct poll fails with a warning on every poll. A job that leaves
  the queue without a result (cancelled, killed, out of memory, timed out too often) is recorded in
  its run folder's failed.json with its SLURM state and log, so the sweep's summary names it and the
  sweep exits 1; the next sweep continues the run from its checkpoint.
- A quiet terminal: Hydra's per-job launch lines, submitit's messages and each job's id and state go
  to the sweep's log, `<hydra.sweep.dir>/slurm.log` (also to the terminal with `hydra.verbose=true`).
- `sbatch` refusing the jobs is one line naming its reason (exit 1); nothing was submitted.

A job signalled before its time limit or preempted is requeued by submitit (the launcher's
`checkpoint`, inherited), at most `max_num_timeout` times for time limits, and its run continues
from its last checkpoint (`training.checkpoints`). See docs/cluster.md.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

from .. import store
from ..config.hydra_internals import compose_job
from ..store.provenance import reused
from ..store.runs import OBJECTIVE

LOG = "slurm.log"  # in hydra.sweep.dir: each job's id, run and end, and submitit's messages
# squeue's states of a job that may still give a result (requeued jobs go back to PENDING)
ACTIVE = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SUSPENDED",
    "STAGE_OUT",
    "SIGNALING",
    "RESV_DEL_HOLD",
    "PREEMPTED",
}
# a job missing from squeue this long after submission has left the queue (squeue forgets ended jobs after MinJobAge)
QUEUE_GRACE_SECONDS = 30.0
# after a job ends, how long its result file may take to appear on a shared filesystem (submitit waits as
# long); less after a state that says the job died, when there is none to wait for but a slow filesystem's
RESULT_GRACE_SECONDS = 15.0
DIED = {"CANCELLED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE"}
DIED_GRACE_SECONDS = 5.0


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
    """Hydra's `Launcher.launch` for `launcher` (the plugin, Hydra's submitit SlurmLauncher, whose
    jobs are itself called on the nodes): submit the jobs whose runs are missing, wait for them, and
    return each job's JobReturn (the objective, or None for a run that failed or is trained elsewhere)."""
    import submitit  # as Hydra's plugin does: only once something is launched

    config = launcher.config
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if "mode" in config.hydra.sweep:  # as Hydra's launcher does
        sweep_dir.chmod(int(str(config.hydra.sweep.mode), 8))
    with open(sweep_dir / LOG, "a") as log, quiet_submitit(log):
        say = SweepLog(log, echo=bool(config.hydra.verbose))
        say(f"Submitit 'slurm' sweep output dir: {sweep_dir}")
        if not has_accounting():
            terminal(
                "copytask: note: this SLURM keeps no accounting (sacct fails): "
                "job states come from squeue and the jobs' result files"
            )
        returns: list[JobReturn | None] = []
        submit = []  # (job number, overrides, run folder)
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            folder, retrain = run_folder(config, overrides)
            if reused(folder, retrain):
                say(f"#{idx}: {folder.name} complete, not submitted")
                returns.append(
                    JobReturn(
                        overrides=list(overrides),
                        status=JobStatus.COMPLETED,
                        _return_value=store.read_json(folder / store.METRICS)[OBJECTIVE],
                    )
                )
            elif store.is_locked(folder):
                say(f"#{idx}: {folder.name} being trained by another process, not submitted")
                returns.append(JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED))
            else:
                submit.append((idx, list(overrides), folder))
                returns.append(None)
        if not submit:
            return returns
        jobs = submit_jobs(submitit, launcher, submit, log)
        for (idx, overrides, folder), job in zip(submit, jobs):
            say(f"#{idx}: SLURM job {job.job_id}: {folder.name} ({' '.join(filter_overrides(overrides))})")
        values = wait(jobs, folder_of={job.job_id: folder for (_, _, folder), job in zip(submit, jobs)}, say=say)
        value_of = {idx: value for (idx, _, _), value in zip(submit, values)}
        return [
            given or value_of[idx] or JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
            for idx, (given, overrides) in enumerate(zip(returns, job_overrides), start=initial_job_idx)
        ]


def run_folder(config: DictConfig, overrides: Sequence[str]) -> tuple[Path, bool]:
    """The run folder of the sweep's job with `overrides`, and whether it is to be trained again (`retrain`)."""
    job = compose_job(config, list(overrides))
    with open_dict(job):
        del job["hydra"]
    return store.run_dir(job), bool(job.get("retrain", False))


def submit_jobs(submitit: Any, launcher: Any, jobs: list[tuple[int, list[str], Path]], log: IO[str]) -> list[Any]:
    """Submit `jobs` (job number, overrides, folder) as one job array of `launcher` calls, with its
    parameters, as Hydra's launcher does; sbatch refusing them is one line and exit 1 (sbatch's own
    lines go to the log)."""
    from hydra.core.singleton import Singleton

    params = dict(launcher.params)
    executor = submitit.AutoExecutor(
        cluster="slurm", folder=params.pop("submitit_folder"), slurm_max_num_timeout=params.pop("max_num_timeout")
    )
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{key if key in shared else f"slurm_{key}": value for key, value in params.items()})
    arguments = [
        (overrides, "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()) for idx, overrides, _ in jobs
    ]
    try:
        with contextlib.redirect_stderr(log):  # submitit prints sbatch's whole error output there
            return executor.map_array(launcher, *zip(*arguments))
    except submitit.core.utils.FailedJobError as error:
        reason = [line for line in str(error).splitlines() if line.strip()]
        terminal(
            f"copytask: error: SLURM refused the sweep's {len(jobs)} jobs, nothing was submitted: "
            f"{reason[-1] if reason else error}"
        )
        raise SystemExit(1) from None


class SweepLog:
    """The sweep's log: a line with the time, to the file, and to stderr with `echo` (`hydra.verbose`)."""

    def __init__(self, log: IO[str], echo: bool) -> None:
        self.log, self.echo = log, echo

    def __call__(self, line: str) -> None:
        self.log.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")
        self.log.flush()
        if self.echo:
            terminal(line)


def terminal(line: str) -> None:
    """A line on stderr, above the sweep's progress bar (tqdm redraws the bar below it)."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)


@contextlib.contextmanager
def quiet_submitit(log: IO[str]) -> Iterator[None]:
    """Inside: submitit's log records (its handlers print to stdout and stderr, and Hydra's root
    handler prints them again) go to `log` only; after: its logger as it was."""
    logger = logging.getLogger("submitit")
    handlers, propagate = logger.handlers[:], logger.propagate
    handler = logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter("[%(asctime)s] submitit %(levelname)s: %(message)s"))
    logger.handlers[:], logger.propagate = [handler], False
    try:
        yield
    finally:
        logger.handlers[:], logger.propagate = handlers, propagate


def has_accounting() -> bool:
    """Whether this SLURM stores accounting (so that sacct answers), from `scontrol show config`."""
    try:
        config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    for line in config.splitlines():
        if line.split("=")[0].strip() == "AccountingStorageType":
            return line.split("=", 1)[1].strip() not in ("", "accounting_storage/none", "(null)")
    return False


def queue_states(array_ids: set[str]) -> dict[str, str] | None:
    """Each job (array element, `123_4`) of the job arrays `array_ids` that squeue still lists, with
    its state; None if squeue could not be asked (the caller asks again later)."""
    try:
        listed = subprocess.run(
            [
                "squeue",
                "--noheader",
                "--array",
                "--states=all",
                "--format=%i|%T",
                f"--jobs={','.join(sorted(array_ids))}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if listed.returncode:
        # squeue refuses the whole list once any of them is forgotten ("Invalid job id specified"): ask one by one
        if len(array_ids) > 1:
            states: dict[str, str] = {}
            for array_id in array_ids:
                one = queue_states({array_id})
                if one is None:
                    return None
                states |= one
            return states
        return {} if "Invalid job id" in listed.stderr else None
    return dict(line.split("|", 1) for line in listed.stdout.split() if "|" in line)


def wait(
    jobs: list[Any], folder_of: dict[str, Path], say: SweepLog, interval: float = 2.0, max_interval: float = 30.0
) -> list[JobReturn | None]:
    """Each job's JobReturn once all have ended, in order, or None for a job that failed without
    one. The result files are looked at every `interval` seconds, squeue less often as the sweep
    goes on (at most every `max_interval`), so a big sweep does not load the controller. A job that
    leaves the queue without a result gets a failed.json in its run folder (`record_failure`)."""
    values: dict[str, JobReturn | None] = {}
    submitted, last_asked, states = time.monotonic(), float("-inf"), {}
    ended_at: dict[str, float] = {}
    while len(values) < len(jobs):
        now = time.monotonic()
        if now - last_asked >= min(max_interval, max(interval, (now - submitted) / 8)):
            states = queue_states({job.job_id.split("_")[0] for job in jobs}) or states
            last_asked = now
        for job in jobs:
            if job.job_id in values:
                continue
            if job.paths.result_pickle.exists():
                values[job.job_id] = job_value(job, folder_of[job.job_id], say)
                continue
            state = states.get(job.job_id)
            if state in ACTIVE or state is None and now - submitted < QUEUE_GRACE_SECONDS:
                ended_at.pop(job.job_id, None)  # (again) in the queue: a requeued job
                continue
            if now - ended_at.setdefault(job.job_id, now) >= (
                DIED_GRACE_SECONDS if state in DIED else RESULT_GRACE_SECONDS
            ):
                record_failure(
                    folder_of[job.job_id],
                    f"SLURM job {job.job_id} ended {state or 'and left the queue'} without a result",
                    job,
                    say,
                )
                values[job.job_id] = None
        time.sleep(interval)
    return [values[job.job_id] for job in jobs]


def job_value(job: Any, folder: Path, say: SweepLog) -> JobReturn | None:
    """A job's JobReturn (Hydra's, made on the node) from its result file; None, with failed.json,
    for a job that raised."""
    try:
        value = job.result()
    except Exception as error:  # noqa: BLE001 - submitit's FailedJobError carries the job's traceback between two rules
        parts = str(error).split("-" * 22)
        trace = [line for line in (parts[1] if len(parts) > 2 else str(error)).splitlines() if line.strip()]
        record_failure(
            folder, f"SLURM job {job.job_id} raised {trace[-1] if trace else type(error).__name__}", job, say
        )
        return None
    say(f"SLURM job {job.job_id} ended: {folder.name} returned {value.status.name} {value._return_value}")
    return value


def record_failure(folder: Path, reason: str, job: Any, say: SweepLog) -> None:
    """Write failed.json for a job that left no record of its own (killed, cancelled), naming its
    last log line; not where another process trains the run now, and beside the replacement where the
    run is complete (`store.replacement.failure_folder`: complete results never look failed)."""
    log_line = last_line(job.paths.stderr)
    error = f"{reason}{f' ({log_line})' if log_line else ''}; log: {job.paths.stderr}"
    say(f"{folder.name}: {error}")
    if not store.is_locked(folder):
        store.write_json(store.replacement.failure_folder(folder) / store.FAILED, {"error": error, "traceback": None})


def last_line(path: Path) -> str:
    """The last non-empty line of a job's log that is not submitit's own chatter ('' if none)."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    lines = [line for line in lines if not line.startswith("submitit ")]
    return lines[-1] if lines else ""

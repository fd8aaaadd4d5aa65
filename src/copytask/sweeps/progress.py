"""A sweep's one progress bar (`SweepProgress`; a search's, `TrialProgress`): the work done, the runs
finished of the grid and how many jobs run at once (`jobs_at_once`), from the run folders, so that it
works the same under every launcher."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from omegaconf import DictConfig

from .. import console, store
from ..config.parallel import BASIC_LAUNCHER, JOBLIB_LAUNCHER
from ..store.runs import TRIAL_RECORD, GridRun


def jobs_at_once(hydra: DictConfig, jobs: int | None) -> int | None:
    """How many of a sweep's `jobs` (None: not known ahead, a search's) its launcher runs at once: one
    for Hydra's basic launcher, joblib's n_jobs as joblib reads it (negative: counted back from the
    cores), no more than a sweeper that proposes its jobs in batches puts in one (Optuna's n_jobs),
    nor than `jobs`. None where the launcher does not decide it (a SLURM queue, submitit)."""
    launcher = hydra.launcher.get("_target_")
    if launcher == BASIC_LAUNCHER:
        at_once = 1
    elif launcher == JOBLIB_LAUNCHER:
        from joblib import effective_n_jobs

        at_once = effective_n_jobs(hydra.launcher.n_jobs)
    else:
        return None
    return min([at_once, *(limit for limit in (jobs, hydra.sweeper.get("n_jobs")) if limit)])


def expected_cost(run: GridRun) -> float:
    """What a run is expected to cost, in units of one training step at length 1: its step budget
    times its mean length (a step's recurrences and attention grow with the length). Runs differ
    by 20x and more in a sweep, so a bar that counts runs gives an ETA that swings."""
    task = run.config.task
    mean_length = (task.min_length + task.length) / 2 if task.variable_length else task.length
    return run.config.train.steps * mean_length


class SweepProgress:
    """One progress bar for a whole sweep: the work done, each finished run (complete, or failed during this sweep)
    weighted by its `expected_cost` and each run in training by the share of its steps done, so that the ETA follows
    the work left rather than the runs left; the runs finished of the grid beside it, and the jobs at a time (`at_once`,
    where the launcher says). A thread polls the run folders, so it works the same under every launcher, in-process or
    not."""

    def __init__(self, runs: list[GridRun], enabled: bool, interval: float = 2.0, at_once: int | None = None) -> None:
        self.runs, self.started_at, self.at_once = runs, time.time(), at_once
        self.costs = [expected_cost(run) for run in runs]
        self.start(sum(self.costs), enabled, interval)

    def start(self, total: float | None, enabled: bool, interval: float) -> None:
        """Draw the bar at what is finished now and start the thread that moves it."""
        from tqdm.auto import tqdm

        self.done, cost = self.finished()
        clock = (
            "[{elapsed}<{remaining}]" if total is not None else "[{elapsed}]"
        )  # no total (a sweeper that does not say): no ETA
        # smoothing=0: the rate since the start, not tqdm's moving average, which a few large steps (one per
        # run) throw about
        self.bar = tqdm(
            total=total,
            initial=cost,
            desc=self.runs_done(self.done),
            disable=not enabled,
            file=console.bar_stream(),
            dynamic_ncols=True,
            mininterval=interval,
            smoothing=0,
            # no percentage beside the runs finished: it is of the work (a long run weighs more), not of the runs
            bar_format=("{desc} |{bar}| " if total is not None else "{desc} ") + clock,
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.poll, args=(interval,), daemon=True)
        self.thread.start()

    def runs_done(self, done: int) -> str:
        return f"sweep ({done}/{len(self.runs)} runs{self.at_a_time()})"

    def at_a_time(self) -> str:
        """How many jobs run at once, for the bar's description; nothing where the launcher does not say."""
        if self.at_once is None:
            return ""
        return f", {self.at_once} job{'' if self.at_once == 1 else 's'} at a time"

    def finished(self) -> tuple[int, float]:
        """How many runs have finished, and the work done: their expected cost together, plus the
        share of its step budget that each run in training has done, so that a long run moves the
        bar while it trains rather than all at once at its end."""
        done, work = 0, 0.0
        for run, cost in zip(self.runs, self.costs):
            status = run.status()
            if (
                status == "complete"
                or status == "failed"
                and (run.folder / store.FAILED).stat().st_mtime >= self.started_at
            ):
                done, work = done + 1, work + cost
            elif status == "running":
                work += cost * store.read_progress(run.folder)
        return done, work

    def update(self) -> bool:
        """Move the bar to the work done now; whether anything changed."""
        done, cost = self.finished()
        cost = max(cost, self.bar.n)  # never back: a run killed in training keeps what it was credited
        if (done, cost) == (self.done, self.bar.n):
            return False
        self.done = done
        self.bar.set_description_str(self.runs_done(done), refresh=False)
        self.bar.update(cost - self.bar.n)
        return True

    def poll(self, interval: float, refresh_every: float = 30.0) -> None:
        """Update on every finished run, and redraw the clock now and then: a sweep's log stays small."""
        last_refresh = time.monotonic()
        while not self.stop.wait(interval):
            if not self.update():
                if time.monotonic() - last_refresh <= refresh_every:
                    continue
                self.bar.refresh()
            last_refresh = time.monotonic()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.update()
        self.bar.close()


class TrialProgress(SweepProgress):
    """A search's bar: the trials finished of the sweeper's `n_trials`, from the trial records its
    jobs write into `sweep_dir` (a trial the sweeper has not proposed yet has no folder to look at,
    and no known cost: each trial counts one)."""

    def __init__(
        self, sweep_dir: Path, trials: int | None, enabled: bool, interval: float = 2.0, at_once: int | None = None
    ) -> None:
        self.sweep_dir, self.trials, self.started_at, self.at_once = sweep_dir, trials, time.time(), at_once
        self.start(trials, enabled, interval)

    def runs_done(self, done: int) -> str:
        of = f"/{self.trials}" if self.trials is not None else ""
        return f"search ({done}{of} trials{self.at_a_time()})"

    def finished(self) -> tuple[int, float]:
        done = 0
        for path in self.sweep_dir.glob(f"*/{TRIAL_RECORD}"):
            try:
                done += path.stat().st_mtime >= self.started_at  # a record of an earlier sweep is not this one's
            except OSError:  # replaced as we looked
                continue
        return done, done

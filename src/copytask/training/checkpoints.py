"""Resumable runs: at each evaluation a run saves all it needs to go on (store.RESUME, in its folder),
and a run started on a folder that holds one continues from that step, ending with exactly the
numbers it would have had uninterrupted (on CPU, bit for bit).

What is saved: the model, the optimizer, the LR schedule, the training data generator, torch's
global random state (dropout draws from it) and the run's own progress (step, history, the
early-stopping counter, training seconds so far). The held-out (and validation) sets, which
training excludes, are not: they are drawn again from the config's own seeds, as at the start.
The run's identity and `computation` are saved beside them, so a checkpoint is only ever read by the
run that wrote it, computing what this code computes.

A checkpoint that cannot be read (cut off, not a checkpoint, another run's, a model of another
shape) is set aside as store.UNREADABLE_RESUME with a warning, and the run starts from step 0.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from .. import console, store
from ..store.provenance import COMPUTATION

FORMAT = 1  # what a checkpoint holds; one of another format is not read
PROGRESS = {
    "step",
    "history",
    "hits",
    "seconds",
}  # where the run stood: the step, what history.csv will hold, the stopping count, training seconds


def save(
    folder: Path,
    cfg: DictConfig,
    progress: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    generator: torch.Generator,
    device: torch.device,
) -> None:
    """Write the run's checkpoint atomically: a kill leaves the previous one or this one. Not
    flushed to disk (fsync): a crash of the machine that loses it costs the run a restart from step
    0 (the unreadable file is set aside), never wrong numbers, and a run saves one every evaluation."""
    state = {
        "format": FORMAT,
        "identity": store.identity(cfg),
        "computation": COMPUTATION,
        "progress": progress,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "generator": generator.get_state(),
        "cpu_rng": torch.random.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    store.atomic_write(folder / store.RESUME, buffer.getvalue(), durable=False)


def load(folder: Path, cfg: DictConfig) -> dict[str, Any] | None:
    """The checkpoint in `folder` if it is this run's and readable; None if there is none. One that
    is unreadable is set aside (store.UNREADABLE_RESUME) with a CopytaskWarning, and None returned."""
    path = folder / store.RESUME
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError("not a copytask checkpoint of this version")
        if state["identity"] != store.identity(cfg):
            raise ValueError("it was written by a run with another config")
        if state.get("computation") != COMPUTATION:
            raise ValueError(
                f"it was computed by other code (computation {state.get('computation')}, not {COMPUTATION})"
            )
        if missing := PROGRESS - set(state["progress"]):
            raise ValueError(f"its progress has no {', '.join(sorted(missing))}")
    except Exception as error:  # noqa: BLE001 - torch.load and unpickling raise many types for a damaged file
        set_aside(path, error)
        return None
    return state


class UnusableCheckpoint(Exception):
    """A readable checkpoint that does not fit the run's objects (a model of another shape); it has
    been set aside, and the run is to start again from step 0 with objects built afresh."""


def restore(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    generator: torch.Generator,
    device: torch.device,
    folder: Path,
) -> dict[str, Any]:
    """Put the checkpoint's state into the run's freshly built objects; -> its progress (step,
    history, ...). UnusableCheckpoint, once it is set aside, if it does not fit them: some of the
    objects may then hold part of it."""
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        generator.set_state(state["generator"])
        torch.random.set_rng_state(state["cpu_rng"])
        if device.type == "cuda" and state["cuda_rng"] is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], device)
    except (RuntimeError, KeyError, ValueError, TypeError) as error:
        set_aside(folder / store.RESUME, error)
        raise UnusableCheckpoint(folder.name) from error
    return state["progress"]


def set_aside(path: Path, error: Exception) -> None:
    """Rename an unreadable checkpoint out of the way (kept for a look, not read again) and warn in
    one line, with the first line of `error` (torch's can run to a page)."""
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__
    aside = path.with_name(store.UNREADABLE_RESUME)
    path.replace(aside)
    console.warn(
        f"{path.parent.name}: its checkpoint {path.name} is unreadable ({reason}); "
        f"set aside as {aside.name}, training from step 0"
    )

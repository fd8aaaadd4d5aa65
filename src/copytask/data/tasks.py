"""The task registry: a task is which source position each output step copies, and the target
follows from it (output step t is the source symbol at that position, then EOS). Torch-free, so a
config check can name the registered tasks without importing torch.

A task takes `steps` (1, T) the output steps 0 .. T-1 and `lengths` (B, 1) the source lengths, and
returns (B, T) int64 the copied source position of each step: one row per sequence, and for t < length
a position inside that sequence's source, 0 .. length - 1 (what it returns past the length is not
read). `source_positions` holds every task to that contract. Add one with `@task("name")` and a
`configs/task/<name>.yaml` whose `name:` is it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

Task = Callable[["Tensor", "Tensor"], "Tensor"]
TASKS: dict[str, Task] = {}


def task(name: str) -> Callable[[Task], Task]:
    """Register a task under `name` (the config's `task.name`)."""

    def register(positions: Task) -> Task:
        TASKS[name] = positions
        return positions

    return register


def task_positions(name: str) -> Task:
    """The registered task `name`; a ValueError naming it and the registered ones if there is none."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


def source_positions(name: str, steps: Tensor, lengths: Tensor) -> Tensor:
    """Task `name`'s positions for `steps` (1, T) and `lengths` (B, 1) -> (B, T), 0 past each length
    (a valid index that nothing reads). A ValueError naming the task and what it returned where it
    breaks the contract: a silent broadcast or clamp would make wrong targets. The positions' values
    are checked on the host, where every batch is drawn; on a device only their shape and dtype."""
    import torch  # here, not at the top: a config check reads TASKS without torch

    positions = task_positions(name)(steps, lengths)
    expected = (lengths.size(0), steps.size(1))
    if not isinstance(positions, torch.Tensor):
        raise ValueError(f"task {name!r} returned a {type(positions).__name__}, not a tensor of positions")
    if positions.dtype != torch.long or tuple(positions.shape) != expected:
        raise ValueError(
            f"task {name!r} returned positions of dtype {positions.dtype} and shape {tuple(positions.shape)} for "
            f"{expected[0]} sequences of {expected[1]} output steps; a task returns one int64 row per sequence"
        )
    read = steps < lengths  # (B, T) the steps the task answers for
    if positions.device.type != "cpu":  # reading values would wait for the device (meta has none): checked where drawn
        return positions.masked_fill(~read, 0)
    outside = read & ((positions < 0) | (positions >= lengths))
    if bool(outside.any()):
        row, step = (int(i) for i in outside.nonzero()[0])
        raise ValueError(
            f"task {name!r} returned position {int(positions[row, step])} at output step {step} of a source of "
            f"length {int(lengths[row, 0])}; a position must be inside the source, 0 .. length - 1"
        )
    return positions.masked_fill(~read, 0)


@task("copy")
def copy(steps: Tensor, lengths: Tensor) -> Tensor:
    """Output step t copies source position t: the target is the source."""
    return steps.expand(lengths.size(0), -1)


@task("reverse")
def reverse(steps: Tensor, lengths: Tensor) -> Tensor:
    """Output step t copies source position length - 1 - t: the target is the source reversed."""
    return lengths - 1 - steps

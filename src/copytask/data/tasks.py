"""The task registry: a task is which source position each output step copies, and the target
follows from it (output step t is the source symbol at that position, then EOS). Torch-free, so a
config check can name the registered tasks without importing torch.

A task takes `steps` (1, T) the output steps 0 .. T-1 and `lengths` (B, 1) the source lengths, and
returns (B, T) the copied source position of each step; only steps t < length are read. Add one
with `@task("name")` and a `configs/task/<name>.yaml` whose `name:` is it.
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


@task("copy")
def copy(steps: Tensor, lengths: Tensor) -> Tensor:
    """Output step t copies source position t: the target is the source."""
    return steps.expand(lengths.size(0), -1)


@task("reverse")
def reverse(steps: Tensor, lengths: Tensor) -> Tensor:
    """Output step t copies source position length - 1 - t: the target is the source reversed."""
    return lengths - 1 - steps

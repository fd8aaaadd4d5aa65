"""The task registry: a task draws its sources (`Sources`) and says which source position each output step
copies (its `copies`); the target follows (output step t is the source symbol at that position, then EOS)
and may be shorter than the source. Torch-free at import, so a config check can name the registered tasks
and count their sequences without importing torch.

A task's `copies` takes a batch of sources, `src` (B, L) token ids (PAD past each length), their `lengths`
(B,) and the number of content symbols `vocab_size` (which tells them from the noise token, `vocab`), and
returns `(positions, target_lengths)`: positions (B, T) int64, for t < target_lengths[b] a position inside
sequence b's source, 0 .. length - 1 (what it returns past a target's end is not read), and target_lengths
(B,) int64, each from 0 to its source's length. `target_positions` holds every task to that contract.

Add one with `@task("name")` over its `copies` (its sources drawn as copy's, every position a uniform
content symbol, unless `sources=` says otherwise) and a `configs/task/<name>.yaml` whose `name:` is it.

Selective copying (Gu and Dao, 2023, section 3.1): `task.copied` = k content symbols at distinct positions
drawn uniformly, kept in order, every other position the noise token; the target is the k symbols in
order, then EOS (`AmongNoise`, `selective_copy`).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from itertools import combinations
from typing import TYPE_CHECKING, Any, NamedTuple

from .vocab import NUM_SPECIAL, noise_token, total_vocab

if TYPE_CHECKING:
    from torch import Generator, Tensor

Copies = Callable[["Tensor", "Tensor", int], tuple["Tensor", "Tensor"]]


class Sources:
    """How a task draws its sources: every position a content symbol, uniform and independent (copy's and
    reverse's). `copied` is `task.copied`, which only a subclass that `reads_copied` reads."""

    noise = False  # whether its sources hold the noise token (a model's vocabulary then has it: `vocabulary`)
    reads_copied = False  # whether task.copied says how it draws (else task.copied must be null)

    def shortest(self, copied: int | None) -> int:
        """The shortest source it draws."""
        return 1

    def draw(self, lengths: Tensor, width: int, vocab_size: int, copied: int | None, generator: Generator) -> Tensor:
        """Sources of `lengths` (B,) padded to `width`, from `generator` -> (B, width) token ids (what
        lies past a length is not read: the batch puts PAD there). Drawn where the generator lives."""
        import torch  # here, not at the top: a config check reads the registry without torch

        return torch.randint(
            NUM_SPECIAL, total_vocab(vocab_size), (len(lengths), width), generator=generator, device=generator.device
        )

    def log_count(self, length: int, vocab_size: int, copied: int | None) -> float:
        """The natural logarithm of `count` (which may be too large to compute)."""
        return length * math.log(vocab_size)

    def count(self, length: int, vocab_size: int, copied: int | None) -> int:
        """How many distinct sources of exactly `length` positions it draws (call where `log_count` is small)."""
        return vocab_size**length

    def every(self, length: int, vocab_size: int, copied: int | None) -> Tensor:
        """Each of the `count` sources of `length` positions once, in a fixed order -> (count, length)."""
        import torch

        digits = torch.arange(vocab_size**length)[:, None] // vocab_size ** torch.arange(length - 1, -1, -1)
        return digits % vocab_size + NUM_SPECIAL


UNIFORM = Sources()  # copy's sources: every task's unless it says otherwise


class AmongNoise(Sources):
    """Selective copying's sources (Gu and Dao, 2023, section 3.1): `copied` = k content symbols, uniform and
    independent, at k distinct positions drawn uniformly among each source's, the noise token everywhere
    else. Two sources with the same symbols at other positions are other sources (the three disjoint sets
    are keyed by the whole source, noise placement included)."""

    noise = True
    reads_copied = True

    def shortest(self, copied: int | None) -> int:
        return copied + 1  # at least one noise token: k < L

    def draw(self, lengths: Tensor, width: int, vocab_size: int, copied: int | None, generator: Generator) -> Tensor:
        import torch

        device = generator.device
        symbols = torch.randint(
            NUM_SPECIAL, total_vocab(vocab_size), (len(lengths), width), generator=generator, device=device
        )
        keys = torch.rand(len(lengths), width, generator=generator, device=device)  # (B, width)
        keys = keys.masked_fill(torch.arange(width, device=device) >= lengths[:, None], 2.0)  # past a length: last
        chosen = keys.argsort(1)[:, :copied]  # k distinct positions, uniform among each source's
        content = torch.zeros_like(keys, dtype=torch.bool).scatter(1, chosen, True)
        return symbols.masked_fill(~content, noise_token(vocab_size))

    def log_count(self, length: int, vocab_size: int, copied: int | None) -> float:
        layouts = math.lgamma(length + 1) - math.lgamma(copied + 1) - math.lgamma(length - copied + 1)
        return layouts + copied * math.log(vocab_size)

    def count(self, length: int, vocab_size: int, copied: int | None) -> int:
        return math.comb(length, copied) * vocab_size**copied

    def every(self, length: int, vocab_size: int, copied: int | None) -> Tensor:
        import torch

        layouts = torch.tensor(list(combinations(range(length), copied)), dtype=torch.long)  # (C(L, k), k)
        contents = UNIFORM.every(copied, vocab_size, None)  # (V^k, k)
        rows = torch.full((len(layouts) * len(contents), length), noise_token(vocab_size), dtype=torch.long)
        positions = layouts.repeat_interleave(len(contents), 0)  # each layout with every content in turn
        return rows.scatter(1, positions, contents.repeat(len(layouts), 1))


class Task(NamedTuple):
    """A registered task: which source position each output step copies, and how its sources are drawn."""

    copies: Copies
    sources: Sources


TASKS: dict[str, Task] = {}


def task(name: str, sources: Sources = UNIFORM) -> Callable[[Copies], Copies]:
    """Register `copies` as the task `name` (the config's `task.name`), its sources drawn by `sources`
    (by default every position a uniform content symbol)."""

    def register(copies: Copies) -> Copies:
        TASKS[name] = Task(copies, sources)
        return copies

    return register


def load_task(name: str, target: str) -> Task:
    """A task of the user's own, `task._target_` = `target` (`module.function`, a module on the Python path) under
    the label `name`: the module imported; the task it registers as `name` with `@task` (sources of its own), else
    its function registered as `name` with copy's sources. A ValueError, one line naming the module, where there
    is none."""
    module, _, function = target.rpartition(".")
    try:
        copies = getattr(importlib.import_module(module), function) if module else None
    except ImportError as error:
        raise ValueError(
            f"task._target_={target}: cannot import {module!r} ({error}); a module of your own must be on the Python "
            "path: run python -m copytask from its folder, or add the folder to PYTHONPATH"
        ) from None
    except AttributeError:
        raise ValueError(f"task._target_={target}: module {module!r} has no {function!r}") from None
    if not callable(copies):
        raise ValueError(f"task._target_={target} is not a function, module.function")
    if name not in TASKS or TASKS[name].copies is not copies:
        task(name)(copies)
    return TASKS[name]


def task_of(task: Any) -> Task:
    """A config's task (its `task` node): one of the user's own where it has a `_target_` (`load_task`), else the
    registered one by name (`get_task`). ValueError, one line, where there is none."""
    target = task.get("_target_")
    return load_task(task["name"], target) if target is not None else get_task(task["name"])


def get_task(name: str) -> Task:
    """The registered task `name`; a ValueError naming it and the registered ones if there is none."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


def vocabulary(name: str, vocab_size: int) -> int:
    """The embedding and output size of a model of task `name` over `vocab_size` content symbols: the
    noise token too where its sources hold it (a task that is not registered: none)."""
    registered = TASKS.get(name)
    return total_vocab(vocab_size, registered is not None and registered.sources.noise)


def target_positions(name: str, src: Tensor, lengths: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Task `name`'s `copies` of `src` (B, L) with `lengths` (B,) -> positions (B, T), 0 past each target's
    end (a valid index that nothing reads), and target lengths (B,). A ValueError naming the task and what
    it returned where it breaks the contract: a silent broadcast or clamp would make wrong targets. The
    positions' values are checked on the host, where every batch is drawn; on a device only their shape
    and dtype."""
    import torch

    returned = get_task(name).copies(src, lengths, vocab_size)
    if not (isinstance(returned, tuple) and len(returned) == 2):
        raise ValueError(
            f"task {name!r} returned a {type(returned).__name__}, not (positions, target lengths): a task returns "
            "the source position each output step copies and each target's length"
        )
    positions, target_lengths = returned
    for value, what in ((positions, "positions"), (target_lengths, "target lengths")):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"task {name!r} returned {what} as a {type(value).__name__}, not a tensor")
    if positions.dtype != torch.long or positions.dim() != 2 or positions.size(0) != src.size(0):
        raise ValueError(
            f"task {name!r} returned positions of dtype {positions.dtype} and shape {tuple(positions.shape)} for "
            f"{src.size(0)} sequences; a task returns one int64 row per sequence"
        )
    if target_lengths.dtype != torch.long or tuple(target_lengths.shape) != (src.size(0),):
        raise ValueError(
            f"task {name!r} returned target lengths of dtype {target_lengths.dtype} and shape "
            f"{tuple(target_lengths.shape)} for {src.size(0)} sequences; a task returns one int64 length per sequence"
        )
    read = torch.arange(positions.size(1), device=positions.device) < target_lengths[:, None]  # (B, T)
    if positions.device.type != "cpu":  # reading values would wait for the device (meta has none): checked where drawn
        return positions.masked_fill(~read, 0), target_lengths
    longer = (target_lengths < 0) | (target_lengths > lengths) | (target_lengths > positions.size(1))
    if bool(longer.any()):
        row = int(longer.nonzero()[0])
        raise ValueError(
            f"task {name!r} returned a target of length {int(target_lengths[row])} for a source of length "
            f"{int(lengths[row])} with {positions.size(1)} positions; a target is 0 .. length symbols long, each "
            "with its position"
        )
    outside = read & ((positions < 0) | (positions >= lengths[:, None]))
    if bool(outside.any()):
        row, step = (int(i) for i in outside.nonzero()[0])
        raise ValueError(
            f"task {name!r} returned position {int(positions[row, step])} at output step {step} of a source of "
            f"length {int(lengths[row])}; a position must be inside the source, 0 .. length - 1"
        )
    return positions.masked_fill(~read, 0), target_lengths


def _steps(src: Tensor) -> Tensor:
    """(1, L) the output steps 0 .. L - 1 of a target as long as the source."""
    import torch

    return torch.arange(src.size(1), device=src.device)[None, :]


@task("copy")
def copy(src: Tensor, lengths: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Output step t copies source position t: the target is the source."""
    return _steps(src).expand(src.size(0), -1), lengths


@task("reverse")
def reverse(src: Tensor, lengths: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Output step t copies source position length - 1 - t: the target is the source reversed."""
    return lengths[:, None] - 1 - _steps(src), lengths


@task("selective_copy", sources=AmongNoise())
def selective_copy(src: Tensor, lengths: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Output step t copies the t-th content symbol of the source: the target is its content symbols in
    order, the noise left out (Gu and Dao, 2023, section 3.1)."""
    import torch

    valid = _steps(src) < lengths[:, None]  # (B, L)
    content = valid & (src >= NUM_SPECIAL) & (src != noise_token(vocab_size))
    # a stable sort of "is not content" lists the content positions first, in source order
    positions = (~content).to(torch.uint8).sort(dim=1, stable=True).indices  # (B, L)
    target_lengths = content.sum(1)
    # as wide as the longest target (read on the host, where batches are drawn; elsewhere the source's width)
    width = int(target_lengths.max()) if len(src) and src.device.type == "cpu" else src.size(1)
    return positions[:, :width], target_lengths

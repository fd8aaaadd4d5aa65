"""What a run needs in memory and whether this machine holds it: the model's parameters counted without
torch (`parameter_count`), a training step's peak by what needs it (`memory_estimate`), and the refusal
of a configuration no machine here could train (`check_memory`), which `checks.validate` makes with
the estimate and `models.build.check_buildable` with the built model's exact count."""

from __future__ import annotations

import os

from omegaconf import DictConfig

from ..console import ConfigError
from ..data.tasks import vocabulary
from . import FLOAT, LONG, family_of


def parameter_count(cfg: DictConfig) -> int | None:
    """The trainable parameters of the model `models.build.build_model` builds from `cfg`, counted without
    torch by its family (tests check it against `recurrent.count_parameters`), but for a GRU model's attention's
    own: its class's (`models.build.check_buildable` counts the whole model); None for a family that cannot
    count without building it (a model of the user's own)."""
    return family_of(cfg).parameter_count(cfg)


def memory_estimate(
    cfg: DictConfig, parameters: int | None = None, attention_floats: dict[str, int] | None = None
) -> dict[str, int]:
    """Roughly the bytes a run needs at its peak, by what needs them, in float32: the parameters with
    their gradients and Adam's two moments, a training step's activations and what autograd saves
    of them (B = train.batch_size, T_enc = task.length, T_dec = T_enc + 1: the longest a target is), and the test and
    validation sets with the attention weights of their evaluation. `parameters`: the model's count
    (None: `parameter_count`'s, without torch); `attention_floats`: what a GRU model's attention keeps
    per attention weight beyond it, by what keeps it (its class's `training_floats`; None: nothing)."""
    task, train = cfg.task, cfg.train
    batch, t_enc, t_dec, heldout = train.batch_size, task.length, task.length + 1, train.eval_size + train.val_size
    attends, activations = family_of(cfg).activations(cfg)
    activations |= {part: floats * batch * t_dec * t_enc * FLOAT for part, floats in (attention_floats or {}).items()}
    if parameters is None:
        parameters = parameter_count(cfg) or 0  # a family that cannot count without torch: `check_buildable` will
    return {
        "the parameters, their gradients and Adam's moments": 4 * parameters * FLOAT,
        **activations,
        "the logits (B x T_dec x vocabulary)": 3 * batch * t_dec * vocabulary(task.name, task.vocab_size) * FLOAT,
        # its token ids (source, decoder input, target, decoded output) and, with attention, the weights kept
        (
            "the test and validation sets and their attention weights "
            "((train.eval_size + train.val_size) x T_dec x T_enc)"
        ): heldout * (4 * t_dec * LONG + attends * t_dec * t_enc * FLOAT),
    }


def machine_memory() -> int | None:
    """This machine's physical memory in bytes; None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return None


def human_bytes(count: float) -> str:
    """`23.4 GiB`."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if count < 1024:
            return f"{count:.1f} {unit}" if unit != "bytes" else f"{count:.0f} bytes"
        count /= 1024
    return f"{count:.3g} EiB"


def check_memory(
    cfg: DictConfig, parameters: int | None = None, attention_floats: dict[str, int] | None = None
) -> None:
    """ConfigError where `memory_estimate` (of `parameters` and `attention_floats`: see there) exceeds
    this machine's physical memory (`machine_memory`), naming the estimate, its largest part and the
    memory: a run that cannot fit is refused at once rather than killed by the OS after minutes.
    `validate` checks the estimate without the attention's own share (a lower bound: sizes no machine
    holds are refused without torch), `models.build.check_buildable` the whole. (With train.device=cuda
    the host's memory stands in for the GPU's, which this torch-free module cannot ask for.)"""
    memory = machine_memory()
    if memory is None:
        return
    parts = memory_estimate(cfg, parameters, attention_floats)
    needed = sum(parts.values())
    if needed > memory:
        largest = max(parts, key=parts.get)
        raise ConfigError(
            f"this configuration needs about {human_bytes(needed)} of memory to train, more than this machine's "
            f"{human_bytes(memory)}; the largest part, {human_bytes(parts[largest])}, is {largest} at "
            f"B=train.batch_size={cfg.train.batch_size} and T_enc=task.length={cfg.task.length}"
        )

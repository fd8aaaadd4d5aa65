"""What a run needs in memory and whether this machine holds it: the model's parameters counted without
torch (`parameter_count`), a training step's peak by what needs it (`memory_estimate`), and the refusal
of a configuration no machine here could train (`check_memory`), which `checks.validate` makes with
the estimate and `models.build.check_buildable` with the built model's exact count."""

from __future__ import annotations

import os

from omegaconf import DictConfig

from ..console import ConfigError
from ..data.tasks import vocabulary
from . import model_keys
from .model_keys import FLOAT, LONG


def parameter_count(cfg: DictConfig) -> int:
    """The trainable parameters of the model `models.build.build_model` builds from `cfg`, counted without
    torch (tests check it against `recurrent.count_parameters`), but for a GRU model's attention's own: its
    class's (`models.build.check_buildable` counts the whole model)."""
    if model_keys.is_transformer(cfg):
        return model_keys.transformer_parameter_count(cfg)
    if model_keys.model_name(cfg) == "mamba":
        return model_keys.mamba_parameter_count(cfg)
    vocab = vocabulary(cfg.task.name, cfg.task.vocab_size)
    embedding, hidden = cfg.model.embedding_size, cfg.model.hidden_size
    attention = cfg.attention

    def gru(
        inputs: int, size: int, directions: int = 1
    ) -> int:  # nn.GRU / nn.GRUCell: W_ih, W_hh, b_ih, b_hh per direction
        return directions * (3 * size * (inputs + size) + 6 * size)

    per_direction, directions = (hidden // 2, 2) if cfg.model.bidirectional else (hidden, 1)
    count = vocab * embedding + gru(embedding, per_direction, directions)  # the encoder
    count += vocab * embedding  # the decoder's embedding
    if attention.decoder == "plain":
        return count + gru(embedding, hidden) + hidden * vocab + vocab
    if attention.decoder == "bahdanau":
        return (
            count + gru(embedding + hidden, hidden) + 2 * hidden * vocab + vocab
        )  # context into the cell; readout from [s_t; c_t]
    if (
        attention.decoder == "rnnencdec"
    ):  # V and V' (c and s_0); the GRU's W, U and C (as a cell on [e; c]); readout from [s_t; e(y_{t-1}); c]
        return (
            count
            + 2 * (hidden * hidden + hidden)
            + gru(embedding + hidden, hidden)
            + (2 * hidden + embedding) * vocab
            + vocab
        )
    return (
        count + gru(embedding, hidden) + 2 * hidden * hidden + hidden + hidden * vocab + vocab
    )  # Luong: W_c, then the readout


# Floats a training step keeps per (row, position, hidden unit) of the GRUs: the input's share of
# the gates (3), the gates (3), the state, the Luong combination, and the gradients of the largest.
GRU_FLOATS = 10


def memory_estimate(
    cfg: DictConfig, parameters: int | None = None, attention_floats: dict[str, int] | None = None
) -> dict[str, int]:
    """Roughly the bytes a run needs at its peak, by what needs them, in float32: the parameters with
    their gradients and Adam's two moments, a training step's activations and what autograd saves
    of them (B = train.batch_size, T_enc = task.length, T_dec = T_enc + 1: the longest a target is), and the test and
    validation sets with the attention weights of their evaluation. `parameters`: the model's count
    (None: `parameter_count`'s, without torch); `attention_floats`: what a GRU model's attention keeps
    per attention weight beyond it, by what keeps it (its class's `training_floats`; None: nothing)."""
    task, train, model = cfg.task, cfg.train, cfg.model
    batch, t_enc, t_dec, heldout = train.batch_size, task.length, task.length + 1, train.eval_size + train.val_size
    if model_keys.is_transformer(cfg):
        attends, activations = True, model_keys.transformer_activations(cfg)
    elif model_keys.model_name(cfg) == "mamba":
        attends, activations = False, model_keys.mamba_activations(cfg)
    else:
        attention = cfg.attention
        attends = attention.score is not None
        # scores, masked scores, weights and a gradient per head; local attention adds its distances,
        # window and Gaussian
        weight_floats = 4 * attention.get("heads", 1) + (3 if attention.get("local") else 0)
        activations = {
            "the embeddings (B x (T_enc + T_dec) x model.embedding_size)": 2
            * batch
            * (t_enc + t_dec)
            * model.embedding_size
            * FLOAT,
            "the GRU states (B x (T_enc + T_dec) x model.hidden_size)": GRU_FLOATS
            * batch
            * (t_enc + t_dec)
            * model.hidden_size
            * FLOAT,
            "the attention weights (B x T_dec x T_enc)": attends * weight_floats * batch * t_dec * t_enc * FLOAT,
            **{part: floats * batch * t_dec * t_enc * FLOAT for part, floats in (attention_floats or {}).items()},
        }
    if parameters is None:
        parameters = parameter_count(cfg)
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

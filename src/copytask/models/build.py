"""The model a config describes: the GRU encoder-decoder with its attention, the Transformer, or Mamba."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from ..config.memory import check_memory
from ..config.model_keys import check_attention_name, is_transformer, model_name, position_rows
from ..config.schema import config_dir
from ..console import ConfigError
from ..data.tasks import vocabulary
from .attention import ATTENTION_TYPES, attention_type
from .mamba import MambaSeq2Seq
from .protocol import Seq2SeqModel
from .recurrent import Seq2Seq, count_parameters
from .transformer import TransformerSeq2Seq

# what `build_model` makes, and what training, the analysis and decode take (`models.protocol`)
Model = Seq2SeqModel


def build_model(
    cfg: DictConfig, model_class: type[nn.Module] = Seq2Seq, transformer_class: type[nn.Module] = TransformerSeq2Seq
) -> nn.Module:
    """The configured model: `transformer_class` for model=transformer, MambaSeq2Seq for model=mamba, else
    `model_class`, which may be any classes with TransformerSeq2Seq's and Seq2Seq's constructor and interface
    (the benchmark passes `reference.ReferenceTransformer` and `reference.ReferenceSeq2Seq`)."""
    if is_transformer(cfg):
        model = cfg.model
        return transformer_class(
            vocabulary(cfg.task.name, cfg.task.vocab_size),
            model.d_model,
            model.heads,
            model.layers,
            model.ff_size,
            model.positions,
            position_rows(cfg),
            model.dropout,
            fused=cfg.train.get("fused", True),
        )
    if model_name(cfg) == "mamba":
        model = cfg.model
        return MambaSeq2Seq(
            vocabulary(cfg.task.name, cfg.task.vocab_size),
            model.d_model,
            model.layers,
            model.d_state,
            model.d_conv,
            model.expand,
            fused=cfg.train.get("fused", True),
            selective=model.get("selective") is not False,  # absent from older runs: Mamba's own, selective
        )
    return model_class(
        vocab=vocabulary(cfg.task.name, cfg.task.vocab_size),
        decoder=cfg.attention.decoder,
        score=cfg.attention.score,
        embedding_size=cfg.model.embedding_size,
        hidden_size=cfg.model.hidden_size,
        attention_size=cfg.attention.size,
        bidirectional=cfg.model.bidirectional,
        heads=cfg.attention.get("heads", 1),  # absent from configs without multi-head and from older runs
        local=cfg.attention.get("local"),  # Luong's local attention: absent from global ones
        window=cfg.attention.get("window"),
        fused=cfg.train.get("fused", True),  # absent from older runs
    )


def check_buildable(cfg: DictConfig) -> None:
    """What the torch-free `config.checks.validate` leaves to the attention classes, refused in one
    ConfigError line: an `attention.score` no class is registered for and that imports no class of the
    user's own, a setting the class refuses (heads, Luong's local window, sizes), a model whose exact
    memory estimate (its parameter count and its attention's `training_floats`) exceeds the machine's,
    and a type of the user's own under an option's name (`config.model_keys.check_attention_name`, which
    `validate` makes where the type is another option's: no class refuses more specifically there). Run
    after `validate`, before anything is written. The model is built on the CPU, with torch's random
    state restored after it (`fork_rng`: the check draws nothing a run would), and at most a quarter of
    the memory `validate`'s estimate has let through; not on the meta device, whose random initialisers
    and `arange` import torch's compiler stack, two seconds of every `train` and `sweep` (docs/bench.md)."""
    score = cfg.attention.score
    if score is not None and score not in ATTENTION_TYPES:
        try:
            attention_type(score)
        except ValueError as error:
            if "." in str(score):
                raise ConfigError(str(error)) from None
            raise ConfigError(
                f"attention.score must be one of null, {', '.join(ATTENTION_TYPES)} or a class of your own "
                f"as module.Class, got {score!r}"
            ) from None
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model = build_model(cfg)
    except ValueError as error:  # validate has checked the rest: this is the attention class's refusal
        raise ConfigError(f"attention={cfg.attention.name}: {error}") from None
    check_memory(cfg, count_parameters(model), {} if model.attention is None else model.attention.training_floats())
    if model_name(cfg) == "gru":
        check_attention_name(cfg.attention, config_dir())

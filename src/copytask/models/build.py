"""The model a config describes: its family's class (`families`: the GRU encoder-decoder with its attention,
the Transformer, Mamba, or a class of the user's own named by `model._target_`), built with its family's
arguments."""

from __future__ import annotations

import importlib
import inspect

import torch
from omegaconf import DictConfig
from torch import nn

from ..config.schema import config_dir
from ..console import ConfigError
from ..data.tasks import vocabulary
from ..families import cannot_import, family_of
from ..families.gru import check_attention_name
from ..families.memory import check_memory
from .attention import ATTENTION_TYPES, attention_type
from .protocol import Seq2SeqModel
from .recurrent import count_parameters

# what `build_model` makes, and what training, the analysis and decode take (`models.protocol`)
Model = Seq2SeqModel


def model_class(cfg: DictConfig | dict) -> type[nn.Module]:
    """The class a config's family names (`Family.target`), imported; ConfigError, one line, where it cannot be."""
    target = family_of(cfg).target
    module, _, name = target.rpartition(".")
    try:
        kind = getattr(importlib.import_module(module), name)
    except ImportError as error:
        raise ConfigError(cannot_import("model._target_", target, str(error))) from None
    except AttributeError:
        raise ConfigError(f"model._target_={target}: module {module!r} has no {name!r}") from None
    if not (isinstance(kind, type) and issubclass(kind, nn.Module)):
        raise ConfigError(f"model._target_={target} is not a model class (models.protocol.Seq2SeqModel)")
    return kind


def build_model(cfg: DictConfig, kind: type[nn.Module] | None = None) -> nn.Module:
    """The configured model: its family's class, or `kind`, a class with its constructor and interface (the
    benchmark passes `reference.ReferenceSeq2Seq` and `reference.ReferenceTransformer`), given the vocabulary's
    size and the family's arguments (`Family.arguments`)."""
    kind, family = kind or model_class(cfg), family_of(cfg)
    vocab, arguments = vocabulary(cfg.task.name, cfg.task.vocab_size), family.arguments(cfg)
    try:
        inspect.signature(kind).bind(vocab, **arguments)
    except TypeError as error:  # a key its class does not take, or one it needs that its option lacks
        raise ConfigError(
            f"{family.option(cfg)}: {family.target}{inspect.signature(kind)} cannot take its config's keys: {error}"
        ) from None
    return kind(vocab, **arguments)


def check_buildable(cfg: DictConfig) -> None:
    """What the torch-free `config.checks.validate` leaves to the attention classes, refused in one
    ConfigError line: an `attention.score` no class is registered for and that imports no class of the
    user's own, a setting the class refuses (heads, Luong's local window, sizes), a model whose exact
    memory estimate (its parameter count and its attention's `training_floats`) exceeds the machine's,
    and a type of the user's own under an option's name (`families.gru.check_attention_name`, which
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
    family = family_of(cfg)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model = build_model(cfg)
    except ValueError as error:  # validate has checked the rest: this is a class's own refusal (an attention's)
        raise ConfigError(f"{family.option(cfg)}: {error}") from None
    parameters, attention = count_parameters(model), model.attention if family.reads_attention else None
    check_memory(cfg, parameters, {} if attention is None else attention.training_floats())  # its attention's own
    if family.reads_attention:
        check_attention_name(cfg.attention, config_dir())

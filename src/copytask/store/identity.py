"""A run's identity and its folder's name: its resolved config, less the keys that change where or
how fast it runs or what it saves, not what it computes, with values normalised (`1` and `1.0` are
one value). The name is readable (attention, task, length, seed) and ends in a hash of the identity."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..config.schema import flatten
from ..families import BY_TARGET, FAMILIES, family_of

# Keys that change where or how fast a run computes, or what it saves, not what it computes (results
# agree to float rounding); `analysis` and `report` only set how finished runs are analysed and drawn,
# `logger` which experiment tracker also sees them.
NOT_IDENTITY = (
    "runs_dir",
    "retrain",
    "train.device",
    "train.threads",
    "train.fused",
    "train.progress",
    "train.attention_samples",
    "analysis",
    "report",
    "logger",
)


# Keys whose value here is what the code computed before the key existed: at that value a key is left
# out of the identity, so that adding a key (with such a default) renames no existing run, and giving
# it explicitly (`attention.heads=1`) is the same run.
NEUTRAL = {
    "attention.heads": 1,
    "attention.local": None,
    "attention.variant": None,
    "model.name": "gru",
    "model.selective": True,  # Mamba's own selective SSM
    "task.copied": None,  # a task that does not read it (checks refuse any other value there)
    "task._target_": None,  # one of copytask's own tasks
}


# Keys that change nothing unless another key has a value: (key, condition on the config). Each model family
# reads its own keys (`Family.own_keys`); the attention group is the decoder of a family that reads it.
UNUSED_UNLESS = {
    "task.min_length": lambda config: config["task"].get("variable_length"),
    "train.warmup": lambda config: config["train"].get("schedule") == "onecycle",
    "attention.window": lambda config: config["attention"].get("local") is not None,
    "attention": lambda config: family_of(config).reads_attention,
    "model._target_": lambda config: config["model"].get("_target_") not in BY_TARGET,  # a built-in's: its name
    **{  # a key two families share (model.layers, model.d_model) is read by either
        f"model.{key}": lambda config, key=key: key in family_of(config).own_keys(config)
        for family in FAMILIES.values()
        for key in family.own_keys({"model": {"positions": "learned"}})
    },
}


def _pop(config: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        config = config.get(key, {})
    config.pop(leaf, None)


def _get(config: dict, dotted: str) -> Any:
    *parents, leaf = dotted.split(".")
    for key in parents:
        config = config.get(key, {})
    return config.get(leaf)


def _normalised(value: Any) -> Any:
    """One spelling per value: a whole float is an int (`train.clip=1` and `=1.0` are one computation)."""
    if isinstance(value, dict):
        return {key: _normalised(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_normalised(item) for item in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def identity(cfg: DictConfig | dict) -> dict[str, Any]:
    """What a run computes: its resolved config (or its plain values, `GridRun.resolved`) without the
    keys in NOT_IDENTITY, those at their NEUTRAL value and those UNUSED_UNLESS another key says so,
    with numbers in one spelling."""
    config = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else copy.deepcopy(cfg)
    for dotted in [
        dotted for dotted, condition in UNUSED_UNLESS.items() if not condition(config)
    ]:  # all read before any goes
        _pop(config, dotted)
    for dotted, value in NEUTRAL.items():
        if _get(config, dotted) == value:
            _pop(config, dotted)
    for dotted in NOT_IDENTITY:
        _pop(config, dotted)
    return _normalised(config)


def flat_identity(cfg: DictConfig | dict) -> dict[str, Any]:
    """`identity` with dotted keys (`model.hidden_size`) and lists as text, so that every value
    compares: the results table's setting columns and the trackers' hyperparameters."""
    return {key: str(value) if isinstance(value, list) else value for key, value in flatten(identity(cfg)).items()}


def architecture(cfg: DictConfig | dict) -> str:
    """What a run's model is, in a word, the first of its name: its family's (`Family.run_word`: a GRU model's
    attention type, `transformer`, `mamba_lti`, a model of the user's own's `model.name`). metrics.json records
    it as `attention`. (Read by item: a config or its plain values.)"""
    return family_of(cfg).run_word(cfg)


def model_label(cfg: DictConfig | dict) -> str:
    """How tables, figures and files name a run's model: its family's label (`Family.label`: a GRU model's
    attention type with its head count where it has several, so multi-head runs never mix with single-head
    ones)."""
    return family_of(cfg).label(cfg)


def run_name(cfg: DictConfig) -> str:
    """Readable and unique: `<architecture>-<task><length>-seed<seed>-<hash of the identity>`, the length
    followed by `k<task.copied>` for a task that reads it (`mamba-selective_copy64k8-seed0-...`)."""
    digest = hashlib.sha1(json.dumps(identity(cfg), sort_keys=True).encode()).hexdigest()[:8]
    task = cfg.task
    lengths = f"{task.min_length}-{task.length}" if task.variable_length else f"{task.length}"
    if task.get("copied") is not None:
        lengths += f"k{task.copied}"
    return f"{architecture(cfg)}-{task.name}{lengths}-seed{cfg.seed}-{digest}"


def run_dir(cfg: DictConfig) -> Path:
    return Path(cfg.runs_dir) / run_name(cfg)

"""The `model` config group (`model=gru`, the default, `model=transformer` and `model=mamba`): which keys each
model reads, the checks `checks.validate` makes of them (model=gru's with its decoder's, the attention group),
and the Transformer's and Mamba's parameter counts and memory. Torch-free, as `schema`, so a refusal is immediate.

Each model reads its own keys (MODEL_KEYS) and leaves the other's unused: those are left out of
a run's identity (`store.UNUSED_UNLESS`), as `attention.window` is without local attention, so
that a preset sizing the GRU (`experiment=quick`) also composes with `model=transformer`. The
`attention` group is model=gru's decoder: with another model anything but its default is
refused, since nothing would read it.

`check_model` is `checks.validate`'s check of the model group, and of the attention group that is model=gru's
decoder (`check_gru`), each refusal one ConfigError line; `check_label` its check of the label a GRU run is
named by (`attention.name`), against the names every built-in model gives its runs (`architecture`).
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..console import ConfigError
from ..data.tasks import vocabulary

MODELS = ("gru", "transformer", "mamba")
MODEL_KEYS = {
    "gru": ("embedding_size", "hidden_size", "bidirectional"),
    "transformer": ("layers", "heads", "d_model", "ff_size", "positions", "max_length", "dropout"),
    "mamba": ("layers", "d_model", "d_state", "d_conv", "expand", "selective"),
}
NULLABLE = ("model.max_length",)  # a key of the chosen model that may be null (null: task.length)
POSITIONS = ("sinusoidal", "learned")
MINIMUM = {
    "model.layers": 1,
    "model.heads": 1,
    "model.d_model": 1,
    "model.ff_size": 1,
    "model.max_length": 1,
    "model.d_state": 1,
    "model.d_conv": 1,
    "model.expand": 1,
}
MAX_HEADS = 8  # heads of a multi-head attention (attention.heads) or of the Transformer (model.heads)
DECODERS = ("plain", "bahdanau", "luong", "rnnencdec")
# attention.variant: which equations a decoder computes, where they changed after its runs were made, so that
# those runs' folders are not read as the new ones'. rnnencdec became Cho et al.'s (2014, appendix A.1) in
# issue 26; its earlier runs (the encoder's raw final state fed into the GRU's input) have no variant.
VARIANTS = {"rnnencdec": "cho2014"}
LOCAL = (None, "predictive", "monotonic")  # Luong's global, local-p and local-m attention
ATTENTION_TYPE = ("decoder", "score", "local")  # what an attention option computes (the other keys size it)
# A label (attention.name) is one word of a run's name, whose parts '-' joins, and the name of its folder in
# runs_dir and of its rows: lower case, as every built-in's name is, so that no two fold into one folder where
# a file system ignores case; short enough for a file name and a table's column.
LABEL = re.compile(r"[a-z][a-z0-9_]{0,31}")
LABEL_RULE = "a lowercase letter, then up to 31 lowercase letters, digits or underscores"


def model_name(cfg: DictConfig | dict) -> str:
    """`model.name` of a config (or of its plain-dict form); runs from before the `model` group
    have none and are GRU runs."""
    return cfg["model"].get("name") or "gru"


def is_transformer(cfg: DictConfig | dict) -> bool:
    return model_name(cfg) == "transformer"


def architecture(cfg: DictConfig | dict) -> str:
    """What a run's model is, in a word: a GRU model's attention type (`attention.name`), or
    `transformer` (sinusoidal positions) or `transformer_learned` for a Transformer, or `mamba`, or
    `mamba_lti` for Mamba with the selection ablated (`model.selective=false`: an LTI SSM). Run names
    start with it; metrics.json records it as `attention`. (Read by item: a config or its plain values.)"""
    model = cfg["model"]
    if is_transformer(cfg):
        return "transformer" if model["positions"] == "sinusoidal" else f"transformer_{model['positions']}"
    if model_name(cfg) == "mamba":
        return "mamba" if model.get("selective") in (True, None) else "mamba_lti"  # None: runs from before it
    return cfg["attention"]["name"]


def position_rows(cfg: DictConfig) -> int:
    """Rows of a learned position table: positions 0 .. max_length, the decoder's input being one
    longer (BOS + the target) than the longest source."""
    return (cfg.model.get("max_length") or cfg.task.length) + 1


def check_model(cfg: DictConfig, default_attention: DictConfig) -> None:
    """ConfigError unless `cfg.model` is a model that can run: its name one of MODELS, each of its keys
    set, the Transformer's well-formed; with a model other than gru `cfg.attention` must be
    `default_attention` (the attention group's default, composed)."""
    model, name = cfg.model, model_name(cfg)
    if name not in MODELS:
        raise ConfigError(
            f"model.name must be one of {', '.join(MODELS)}, got {name!r} "
            f"(choose a model with model={'|'.join(MODELS)})"
        )
    for key in MODEL_KEYS[name]:
        if model.get(key) is None and f"model.{key}" not in NULLABLE:
            raise ConfigError(f"model.{key} must not be null with model={name}")
    if name != "mamba" and model.get("selective") is not None:
        raise ConfigError(
            f"model.selective={str(model.selective).lower()} is model=mamba's (its SSM's Δ, B and C computed from the "
            f"input, or learned as parameters); model={name} has no such choice: leave it null"
        )
    if name == "gru":
        check_gru(cfg)
        return
    if cfg.attention != default_attention:
        own = "has its own attention (model.heads)" if name == "transformer" else "has no attention"
        raise ConfigError(
            f"attention={cfg.attention.name} (and every attention.* key) is model=gru's decoder; model={name} "
            f"{own}, so the attention group must stay at its default ({default_attention.name}); "
            "a sweep over architecture=... that is not a preset's drops the default grid's attention list with "
            "'~hydra.sweeper.params.attention'"
        )
    if name == "transformer":
        check_transformer(cfg)


def cannot_import(score: str, why: str) -> str:
    """The refusal of `attention.score=module.Class` whose module does not import, and `why`."""
    return (
        f"attention.score={score}: cannot import {score.rpartition('.')[0]!r} ({why}); a module of your own must be "
        "on the Python path: run python -m copytask from its folder, or add the folder to PYTHONPATH"
    )


def check_gru(cfg: DictConfig) -> None:
    """The GRU model's decoder and attention: a known decoder with its equations, an even hidden size
    for a bidirectional encoder, heads and Luong's local window where they apply, and a class of the
    user's own (`attention.score=module.Class`) in a module that is there to import (the class itself is
    checked where the model is built, with torch)."""
    model, attention = cfg.model, cfg.attention
    module = str(attention.score).rpartition(".")[0] if attention.score is not None else ""
    if module:
        try:
            found = importlib.util.find_spec(module) is not None
            why = f"No module named {module!r}"
        except (ImportError, ValueError) as error:  # a package on its path is not there, or is no package
            found, why = False, str(error)
        if not found:
            raise ConfigError(cannot_import(attention.score, why))
    if attention.decoder not in DECODERS:
        raise ConfigError(f"attention.decoder must be one of {', '.join(DECODERS)}, got {attention.decoder!r}")
    if attention.variant != VARIANTS.get(attention.decoder):  # the one set of equations each decoder computes
        expected, got = (
            VARIANTS.get(attention.decoder) or "null",
            "null" if attention.variant is None else repr(attention.variant),
        )
        raise ConfigError(f"attention.variant must be {expected} with attention.decoder={attention.decoder}, got {got}")
    if model.bidirectional and model.hidden_size % 2:
        raise ConfigError(f"model.hidden_size must be even with a bidirectional encoder, got {model.hidden_size}")
    if attention.heads > MAX_HEADS:
        raise ConfigError(f"attention.heads must be at most {MAX_HEADS}, got {attention.heads}")
    if attention.heads > 1 and attention.decoder != "luong":
        raise ConfigError(
            f"attention.heads={attention.heads} needs Luong attention with a multi-head score, "
            f"got attention={attention.name}"
        )
    if attention.local not in LOCAL:
        raise ConfigError(f"attention.local must be one of {', '.join(map(str, LOCAL))}, got {attention.local!r}")
    if attention.local is not None:
        if attention.decoder != "luong" or attention.heads > 1:
            raise ConfigError(
                f"attention.local={attention.local} needs single-head Luong attention, "
                f"got attention={attention.name} with {attention.heads} heads"
            )
        if attention.window is None:
            raise ConfigError(
                f"attention.window must be an integer >= 1 with attention.local={attention.local}, got null"
            )
    if model.hidden_size % attention.heads:
        raise ConfigError(
            f"model.hidden_size ({model.hidden_size}) must be divisible by attention.heads ({attention.heads})"
        )


def check_label(attention: DictConfig, config_dir: str) -> None:
    """ConfigError unless a GRU run's label, `attention.name`, is a plain name (LABEL: a path would put the run
    folder elsewhere, '' name it '-copy20-...') that no built-in has: not the name of a model or of another
    model's runs (`reserved_labels`), and an attention option's only with that option's type
    (`check_attention_name`; here only where the config has some option's type, so that where it has none
    an attention class's more specific refusal comes first: `models.build.check_buildable` checks it then)."""
    name = attention.name
    if not LABEL.fullmatch(name):
        raise ConfigError(
            f"attention.name must be a plain name ({LABEL_RULE}: it names the run's folder and its rows), got {name!r}"
        )
    reserved = reserved_labels(config_dir)
    if name in reserved:
        raise ConfigError(
            f"attention.name must not name one of copytask's own models or their runs ({', '.join(reserved)}), "
            f"got {name!r}: give your attention type a name of its own"
        )
    if tuple(attention.get(key) for key in ATTENTION_TYPE) in attention_types(config_dir).values():
        check_attention_name(attention, config_dir)


def check_attention_name(attention: DictConfig, config_dir: str) -> None:
    """ConfigError where `attention.name`, which names the run and its rows in every table, is an option of
    configs/attention/ whose type (ATTENTION_TYPE: its decoder, score and local window) is not this config's:
    a score or decoder given on the command line without a name of its own (`attention.score=my_scores.Cosine`
    on the default option would be labelled luong_general), or another option's name."""
    option = attention_types(config_dir).get(attention.name)
    if option is None:
        return
    differs = [key for key, value in zip(ATTENTION_TYPE, option) if value != attention.get(key)]
    if differs:
        given = " ".join(f"attention.{key}={attention.get(key)}" for key in differs)
        raise ConfigError(
            f"{given} is not attention={attention.name}'s type, yet the run would be named {attention.name}: "
            "give it a name of its own, attention.name=NAME"
        )


@functools.cache  # read once a process: a sweep checks every job's label
def attention_types(config_dir: str) -> dict[str, tuple]:
    """Each option of configs/attention/, by name, and its type (ATTENTION_TYPE's values)."""
    types = {}
    for path in sorted((Path(config_dir) / "attention").glob("*.yaml")):
        option = attention_option(config_dir, path.stem)
        types[path.stem] = tuple(option.get(key) for key in ATTENTION_TYPE)
    return types


@functools.cache
def reserved_labels(config_dir: str) -> tuple[str, ...]:
    """The names a GRU run may not take since a built-in that is no attention option has them: the options of
    configs/model/ and configs/architecture/ and the models' names, and what each model's runs are named
    (`architecture`, for every setting of the keys it reads) other than model=gru's, whose runs take their
    attention option's."""
    root = Path(config_dir)
    names = {path.stem for group in ("model", "architecture") for path in (root / group).glob("*.yaml")}
    names.update(MODELS)
    names.update(
        architecture({"model": {"name": name, "positions": positions, "selective": selective}})
        for name in MODELS
        if name != "gru"
        for positions in POSITIONS
        for selective in (True, False)
    )
    return tuple(sorted(names - set(attention_types(config_dir))))


def check_transformer(cfg: DictConfig) -> None:
    """ConfigError unless model=transformer's keys are well-formed (the others are `check_model`'s)."""
    model = cfg.model
    if model.heads > MAX_HEADS:
        raise ConfigError(f"model.heads must be at most {MAX_HEADS}, got {model.heads}")
    if model.d_model % model.heads:
        raise ConfigError(f"model.d_model ({model.d_model}) must be divisible by model.heads ({model.heads})")
    if model.positions not in POSITIONS:
        raise ConfigError(f"model.positions must be one of {', '.join(POSITIONS)}, got {model.positions!r}")
    if not 0 <= model.dropout < 1:  # also refuses nan
        raise ConfigError(f"model.dropout must be a number in [0, 1), got {model.dropout!r}")
    if model.positions == "learned" and model.max_length is not None and model.max_length < cfg.task.length:
        raise ConfigError(
            f"model.max_length ({model.max_length}) must be at least task.length ({cfg.task.length}): "
            "the learned table covers every trained position"
        )


def transformer_parameter_count(cfg: DictConfig) -> int:
    """The trainable parameters of `transformer.TransformerSeq2Seq` for `cfg`: nn.Transformer (its
    layers and final norms), the source and target embeddings, a learned position table, the readout."""
    vocab, model = vocabulary(cfg.task.name, cfg.task.vocab_size), cfg.model
    d, ff, layers = model.d_model, model.ff_size, model.layers
    attention = 4 * d * d + 4 * d  # in_proj (3d x d) and its bias, out_proj (d x d) and its bias
    feed_forward = 2 * d * ff + ff + d
    norm = 2 * d
    encoder_layer = attention + feed_forward + 2 * norm
    decoder_layer = 2 * attention + feed_forward + 3 * norm
    count = layers * (encoder_layer + decoder_layer) + 2 * norm  # nn.Transformer's final encoder and decoder norms
    count += 2 * vocab * d + d * vocab + vocab  # embeddings, readout
    if model.positions == "learned":
        count += position_rows(cfg) * d
    return count


def mamba_parameter_count(cfg: DictConfig) -> int:
    """The trainable parameters of `mamba.MambaSeq2Seq` for `cfg`: per layer its RMSNorm and block (the input
    projection to x and z, the depthwise convolution, the projections of Δ, B and C, A_log, D, the output
    projection), but the encoder's last layer without the gate, D and output projection (nothing reads its
    output); the source and target embeddings, the final norm and the readout. With model.selective=false,
    Δ (E), B and C (N) are parameters in place of their projections."""
    vocab, model = vocabulary(cfg.task.name, cfg.task.vocab_size), cfg.model
    d, n, k = model.d_model, model.d_state, model.d_conv
    inner, rank = model.expand * d, -(-d // 16)  # E, and R = ceil(d / 16)
    if model.get("selective") is False:
        selection = inner + 2 * n  # Δ's bias, B, C
    else:
        selection = inner * (rank + 2 * n) + rank * inner + inner  # x_proj, then dt_proj's weight and bias
    state = d * inner + inner * k + inner + selection + inner * n  # x, conv, Δ B C, A
    readout = d * inner + inner + inner * d  # z, D, the output projection
    layer = d + state + readout  # the RMSNorm's weight first
    return 2 * model.layers * layer - readout + 2 * vocab * d + d + d * vocab + vocab


FLOAT, LONG = 4, 8  # bytes of a float32 number and of a token id


def transformer_activations(cfg: DictConfig) -> dict[str, int]:
    """Roughly the bytes of a Transformer training step's activations, by what needs them (the
    entries of `memory.memory_estimate` that are the Transformer's own)."""
    task, model = cfg.task, cfg.model
    batch, t_enc, t_dec, d = cfg.train.batch_size, task.length, task.length + 1, model.d_model
    positions = (t_enc + t_dec) * model.layers
    # per position and layer: about a dozen d-wide activations and the feed-forward block's, forward and gradient
    activations = 2 * batch * positions * (12 * d + 2 * model.ff_size) * FLOAT
    # scores and weights per head: encoder self, decoder self and cross attention
    weights = 4 * batch * model.heads * model.layers * (t_enc * t_enc + t_dec * t_dec + t_dec * t_enc) * FLOAT
    return {
        "the layers' activations (B x (T_enc + T_dec) x model.layers x model.d_model)": activations,
        "the attention weights (B x model.heads x model.layers x T^2)": weights,
    }


def mamba_activations(cfg: DictConfig) -> dict[str, int]:
    """Roughly the bytes of a Mamba training step's activations, by what needs them (the entries of
    `memory.memory_estimate` that are Mamba's own): the SSM states, B x T x layers x E x N floats where the scan
    runs in torch's ops (discretised A and B x, the states and their gradients; the CPU kernel keeps far less),
    and a few dozen E-wide activations per position and layer."""
    task, model = cfg.task, cfg.model
    batch, positions, inner = cfg.train.batch_size, 2 * task.length + 1, model.expand * model.d_model
    per_position = batch * positions * model.layers * inner
    return {
        "the SSM states (B x (T_enc + T_dec) x model.layers x E x model.d_state, E = model.expand x model.d_model)": (
            6 * per_position * model.d_state * FLOAT
        ),
        "the layers' activations (B x (T_enc + T_dec) x model.layers x E)": (
            24 * per_position + 8 * model.d_conv * per_position
        )
        * FLOAT,
    }


def default_attention(config_dir: str) -> DictConfig:
    """The attention group's default option (configs/config.yaml's defaults list) as composed."""
    root = Path(config_dir)
    defaults = OmegaConf.to_container(OmegaConf.load(root / "config.yaml").defaults)
    [name] = [entry["attention"] for entry in defaults if isinstance(entry, dict) and "attention" in entry]
    return attention_option(config_dir, name)


def attention_option(config_dir: str, name: str) -> DictConfig | None:
    """configs/attention/<name>.yaml as Hydra composes it, without Hydra: the options of its group that its
    defaults list extends (`luong_local_m` extends `luong_local`), then its own keys; None where there is none."""
    path = Path(config_dir) / "attention" / f"{name}.yaml"
    if not path.is_file():
        return None
    own = OmegaConf.load(path)
    extends = [entry for entry in own.pop("defaults", []) if entry != "_self_"]
    return OmegaConf.merge(*(attention_option(config_dir, option) for option in extends), own)

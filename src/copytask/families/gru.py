"""The GRU encoder-decoders (`model=gru`, `models.recurrent.Seq2Seq`): a GRU encoder and a decoder with no
attention, Bahdanau's or Luong's (any registered score, global or local) or Cho et al.'s, chosen by the attention
group, which is this family's own. Its runs are named by their attention type (`attention.name`, with the head
count where there are several), a plain name of the user's own for a type of their own."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from ..console import ConfigError
from ..data.tasks import vocabulary
from . import (
    FLOAT,
    LABEL,
    LABEL_RULE,
    MAX_HEADS,
    Config,
    Family,
    attention_option,
    builtin_names,
    cannot_import,
    register,
)

DECODERS = ("plain", "bahdanau", "luong", "rnnencdec")
# attention.variant: which equations a decoder computes, where they changed after its runs were made, so that
# those runs' folders are not read as the new ones'. rnnencdec became Cho et al.'s (2014, appendix A.1) in
# issue 26; its earlier runs (the encoder's raw final state fed into the GRU's input) have no variant.
VARIANTS = {"rnnencdec": "cho2014"}
LOCAL = (None, "predictive", "monotonic")  # Luong's global, local-p and local-m attention
ATTENTION_TYPE = ("decoder", "score", "local")  # what an attention option computes (the other keys size it)
# Floats a training step keeps per (row, position, hidden unit) of the GRUs: the input's share of
# the gates (3), the gates (3), the state, the Luong combination, and the gradients of the largest.
GRU_FLOATS = 10


@dataclass
class Keys:
    embedding_size: int
    hidden_size: int
    bidirectional: bool


@register
class GRU(Family):
    name = "gru"
    target = "copytask.models.recurrent.Seq2Seq"
    keys = Keys
    minimum = {"embedding_size": 1, "hidden_size": 1}
    reads_attention = True
    handed_over = "a GRU decoder's initial state"

    def check(self, config: DictConfig, config_dir: str) -> None:
        check_decoder(config)
        check_label(config.attention, config_dir)

    def label(self, config: Config) -> str:
        """The attention type's name, with the head count where there are several (`luong_general-4heads`), so
        that multi-head runs never mix with single-head ones in a table."""
        attention = config["attention"]
        heads = attention.get("heads", 1)
        return attention["name"] if heads == 1 else f"{attention['name']}-{heads}heads"

    def run_word(self, config: Config) -> str:
        """The attention type's name (the head count is in the identity the name's hash is of)."""
        return config["attention"]["name"]

    def heads(self, config: Config) -> int:
        return config["attention"].get("heads", 1)

    def option(self, config: Config) -> str:
        return f"attention={config['attention']['name']}"

    def arguments(self, config: DictConfig) -> dict:
        attention, model = config.attention, config.model
        return {
            "decoder": attention.decoder,
            "score": attention.score,
            "embedding_size": model.embedding_size,
            "hidden_size": model.hidden_size,
            "attention_size": attention.size,
            "bidirectional": model.bidirectional,
            "heads": attention.get("heads", 1),  # absent from configs without multi-head and from older runs
            "local": attention.get("local"),  # Luong's local attention: absent from global ones
            "window": attention.get("window"),
            "fused": config.train.get("fused", True),  # absent from older runs
        }

    def parameter_count(self, config: DictConfig) -> int:
        """The encoder and decoder, but for the attention's own parameters: its class's (`models.build.
        check_buildable` counts the whole model)."""
        vocab = vocabulary(config.task.name, config.task.vocab_size)
        embedding, hidden, attention = config.model.embedding_size, config.model.hidden_size, config.attention

        def gru(inputs: int, size: int, directions: int = 1) -> int:  # W_ih, W_hh, b_ih, b_hh per direction
            return directions * (3 * size * (inputs + size) + 6 * size)

        per_direction, directions = (hidden // 2, 2) if config.model.bidirectional else (hidden, 1)
        count = vocab * embedding + gru(embedding, per_direction, directions)  # the encoder
        count += vocab * embedding  # the decoder's embedding
        if attention.decoder == "plain":
            return count + gru(embedding, hidden) + hidden * vocab + vocab
        if attention.decoder == "bahdanau":  # the context into the cell; the readout from [s_t; c_t]
            return count + gru(embedding + hidden, hidden) + 2 * hidden * vocab + vocab
        if attention.decoder == "rnnencdec":  # V and V' (c and s_0); the GRU on [e; c]; readout from [s_t; e; c]
            readout = (2 * hidden + embedding) * vocab + vocab
            return count + 2 * (hidden * hidden + hidden) + gru(embedding + hidden, hidden) + readout
        return count + gru(embedding, hidden) + 2 * hidden * hidden + hidden + hidden * vocab + vocab  # Luong: W_c

    def activations(self, config: DictConfig) -> tuple[bool, dict[str, int]]:
        task, model, attention = config.task, config.model, config.attention
        batch, t_enc, t_dec = config.train.batch_size, task.length, task.length + 1
        attends = attention.score is not None
        # scores, masked scores, weights and a gradient per head; local attention adds its distances, window and
        # Gaussian
        weight_floats = 4 * attention.get("heads", 1) + (3 if attention.get("local") else 0)
        return attends, {
            "the embeddings (B x (T_enc + T_dec) x model.embedding_size)": (
                2 * batch * (t_enc + t_dec) * model.embedding_size * FLOAT
            ),
            "the GRU states (B x (T_enc + T_dec) x model.hidden_size)": (
                GRU_FLOATS * batch * (t_enc + t_dec) * model.hidden_size * FLOAT
            ),
            "the attention weights (B x T_dec x T_enc)": attends * weight_floats * batch * t_dec * t_enc * FLOAT,
        }

    def reads(self, config: Config) -> str:
        score = config["attention"]["score"]
        if score is None:
            return "the encoder's final state handed over, `model.hidden_size`"
        if score == "linear":
            return (
                "S and z, `attention.size` x (`model.hidden_size` + 1), and the final state handed over, "
                "`model.hidden_size`"
            )
        return "the final state handed over and every encoder state, (length + 1) x `model.hidden_size`"

    def fixed_state(self, config: Config) -> tuple[int, str] | None:
        """Linear attention's hand-over (the encoder's final state, whatever `attention.size`)."""
        return (config["model"]["hidden_size"], "hand-over") if config["attention"]["score"] == "linear" else None

    def describe(self, configs: list[DictConfig], values: Callable[[list[DictConfig], str], str]) -> str:
        encoder = values(configs, "model.bidirectional", lambda both: "bidirectional" if both else "unidirectional")
        return (
            f"- Model: GRU encoder-decoder, hidden size {values(configs, 'model.hidden_size')}, embedding size "
            f"{values(configs, 'model.embedding_size')}, {encoder} encoder."
        )


def check_decoder(config: DictConfig) -> None:
    """The decoder and its attention: a known decoder with its equations, an even hidden size for a bidirectional
    encoder, heads and Luong's local window where they apply, and a class of the user's own
    (`attention.score=module.Class`) in a module that is there to import (the class itself is checked where the
    model is built, with torch)."""
    model, attention = config.model, config.attention
    module = str(attention.score).rpartition(".")[0] if attention.score is not None else ""
    if module:
        try:
            found = importlib.util.find_spec(module) is not None
            why = f"No module named {module!r}"
        except (ImportError, ValueError) as error:  # a package on its path is not there, or is no package
            found, why = False, str(error)
        if not found:
            raise ConfigError(cannot_import("attention.score", attention.score, why))
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


def reserved_labels(config_dir: str) -> tuple[str, ...]:
    """The names a GRU run may not take since a built-in that is no attention option has them (`builtin_names`
    less the attention options', a GRU run's own)."""
    return tuple(sorted(builtin_names(config_dir) - set(attention_types(config_dir))))

"""The Transformer (`model=transformer`, `models.transformer.TransformerSeq2Seq`): torch's nn.Transformer
encoder-decoder with sinusoidal or learned positions. Its attention is its own (`model.heads`), not the attention
group's; its runs are named `transformer`, or `transformer_learned` with a learned position table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig

from ..console import ConfigError
from ..data.tasks import vocabulary
from . import FLOAT, MAX_HEADS, Config, Family, register

POSITIONS = ("sinusoidal", "learned")


@dataclass
class Keys:
    layers: int
    heads: int
    d_model: int
    ff_size: int
    positions: str
    max_length: int | None  # learned positions: the longest source the table covers (null: task.length)
    dropout: float


def position_rows(config: DictConfig) -> int:
    """Rows of a learned position table: positions 0 .. max_length, the decoder's input being one longer (BOS +
    the target) than the longest source."""
    return (config.model.get("max_length") or config.task.length) + 1


@register
class Transformer(Family):
    name = "transformer"
    target = "copytask.models.transformer.TransformerSeq2Seq"
    keys = Keys
    minimum = {"layers": 1, "heads": 1, "d_model": 1, "ff_size": 1, "max_length": 1}
    nullable = ("max_length",)
    attention_words = "has its own attention (model.heads)"
    counterfactual_note = (
        " A Transformer's drops mean something else than a GRU model's: its counterfactual replaces the weights of "
        "every cross-attention layer (the map shown is the last layer's), and its encoder's self-attention has "
        "already mixed the source into every memory position, so uniform or fixed cross-attention does not cut its "
        "access to the source, where a GRU attention model is left with its decoder's initial state. Compare drops "
        "within an architecture, not across."
    )

    def check(self, config: DictConfig, config_dir: str) -> None:
        model = config.model
        if model.heads > MAX_HEADS:
            raise ConfigError(f"model.heads must be at most {MAX_HEADS}, got {model.heads}")
        if model.d_model % model.heads:
            raise ConfigError(f"model.d_model ({model.d_model}) must be divisible by model.heads ({model.heads})")
        if model.positions not in POSITIONS:
            raise ConfigError(f"model.positions must be one of {', '.join(POSITIONS)}, got {model.positions!r}")
        if not 0 <= model.dropout < 1:  # also refuses nan
            raise ConfigError(f"model.dropout must be a number in [0, 1), got {model.dropout!r}")
        if model.positions == "learned" and model.max_length is not None and model.max_length < config.task.length:
            raise ConfigError(
                f"model.max_length ({model.max_length}) must be at least task.length ({config.task.length}): "
                "the learned table covers every trained position"
            )

    def own_keys(self, config: Config) -> list[str]:
        """model.max_length only with learned positions: sinusoids are defined at every length."""
        keys = super().own_keys(config)
        return keys if config["model"].get("positions") == "learned" else [key for key in keys if key != "max_length"]

    def label(self, config: Config) -> str:
        positions = config["model"]["positions"]
        return "transformer" if positions == "sinusoidal" else f"transformer_{positions}"

    def labels(self) -> list[str]:
        return [self.label({"model": {"positions": positions}}) for positions in POSITIONS]

    def heads(self, config: Config) -> int:
        return config["model"]["heads"]

    def arguments(self, config: DictConfig) -> dict:
        model = config.model
        return {
            "d_model": model.d_model,
            "heads": model.heads,
            "layers": model.layers,
            "ff_size": model.ff_size,
            "positions": model.positions,
            "position_rows": position_rows(config),
            "dropout": model.dropout,
            "fused": config.train.get("fused", True),
        }

    def parameter_count(self, config: DictConfig) -> int:
        """nn.Transformer (its layers and final norms), the source and target embeddings, a learned position
        table, the readout."""
        vocab, model = vocabulary(config.task.name, config.task.vocab_size), config.model
        d, ff, layers = model.d_model, model.ff_size, model.layers
        attention = 4 * d * d + 4 * d  # in_proj (3d x d) and its bias, out_proj (d x d) and its bias
        feed_forward = 2 * d * ff + ff + d
        norm = 2 * d
        encoder_layer = attention + feed_forward + 2 * norm
        decoder_layer = 2 * attention + feed_forward + 3 * norm
        count = layers * (encoder_layer + decoder_layer) + 2 * norm  # nn.Transformer's final norms
        count += 2 * vocab * d + d * vocab + vocab  # embeddings, readout
        if model.positions == "learned":
            count += position_rows(config) * d
        return count

    def activations(self, config: DictConfig) -> tuple[bool, dict[str, int]]:
        task, model = config.task, config.model
        batch, t_enc, t_dec, d = config.train.batch_size, task.length, task.length + 1, model.d_model
        positions = (t_enc + t_dec) * model.layers
        # per position and layer: about a dozen d-wide activations and the feed-forward block's, forward and gradient
        activations = 2 * batch * positions * (12 * d + 2 * model.ff_size) * FLOAT
        # scores and weights per head: encoder self, decoder self and cross attention
        weights = 4 * batch * model.heads * model.layers * (t_enc * t_enc + t_dec * t_dec + t_dec * t_enc) * FLOAT
        return True, {
            "the layers' activations (B x (T_enc + T_dec) x model.layers x model.d_model)": activations,
            "the attention weights (B x model.heads x model.layers x T^2)": weights,
        }

    def reads(self, config: Config) -> str:
        return "every encoder output, length x `model.d_model`"

    def describe(self, configs: list[DictConfig], values: Callable[[list[DictConfig], str], str]) -> str:
        return (
            f"- Transformer: torch's nn.Transformer, {values(configs, 'model.layers')} layers each side, "
            f"{values(configs, 'model.heads')} heads, d_model {values(configs, 'model.d_model')}, "
            f"feed-forward {values(configs, 'model.ff_size')}, "
            f"{values(configs, 'model.positions')} positions, dropout {values(configs, 'model.dropout')}."
        )

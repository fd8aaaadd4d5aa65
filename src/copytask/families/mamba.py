"""Mamba (`model=mamba`, `models.mamba.MambaSeq2Seq`; Gu and Dao, 2023): a selective state-space
encoder-decoder whose decoder's layers start from the encoder's final states, no attention; with
`model.selective=false` an LTI SSM, the selection ablated. Its runs are named `mamba` and `mamba_lti`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig

from ..data.tasks import vocabulary
from . import FLOAT, Config, Family, register


@dataclass
class Keys:
    layers: int
    d_model: int
    d_state: int
    d_conv: int
    expand: int
    selective: bool


@register
class Mamba(Family):
    name = "mamba"
    target = "copytask.models.mamba.MambaSeq2Seq"
    keys = Keys
    minimum = {"layers": 1, "d_model": 1, "d_state": 1, "d_conv": 1, "expand": 1}
    exclusive = {"selective": "its SSM's Δ, B and C computed from the input, or learned as parameters"}
    handed_over = "Mamba's SSM state and convolution window per layer"

    def label(self, config: Config) -> str:
        """`mamba_lti` with the selection ablated (`model.selective=false`); runs from before the key are Mamba's."""
        return "mamba" if config["model"].get("selective") in (True, None) else "mamba_lti"

    def labels(self) -> list[str]:
        return ["mamba", "mamba_lti"]

    def arguments(self, config: DictConfig) -> dict:
        model = config.model
        return {
            "d_model": model.d_model,
            "layers": model.layers,
            "d_state": model.d_state,
            "d_conv": model.d_conv,
            "expand": model.expand,
            "selective": model.get("selective") is not False,  # absent from older runs: Mamba's own, selective
            "fused": config.train.get("fused", True),
        }

    def parameter_count(self, config: DictConfig) -> int:
        """Per layer its RMSNorm and block (the input projection to x and z, the depthwise convolution, the
        projections of Δ, B and C, A_log, D, the output projection), but the encoder's last layer without the
        gate, D and output projection (nothing reads its output); the source and target embeddings, the final
        norm and the readout. With model.selective=false, Δ (E), B and C (N) are parameters in place of their
        projections."""
        vocab, model = vocabulary(config.task.name, config.task.vocab_size), config.model
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

    def activations(self, config: DictConfig) -> tuple[bool, dict[str, int]]:
        """The SSM states, B x T x layers x E x N floats where the scan runs in torch's ops (discretised A and
        B x, the states and their gradients; the CPU kernel keeps far less), and a few dozen E-wide activations
        per position and layer."""
        task, model = config.task, config.model
        batch, positions, inner = config.train.batch_size, 2 * task.length + 1, model.expand * model.d_model
        per_position = batch * positions * model.layers * inner
        states = (
            "the SSM states (B x (T_enc + T_dec) x model.layers x E x model.d_state, E = model.expand x model.d_model)"
        )
        return False, {
            states: 6 * per_position * model.d_state * FLOAT,
            "the layers' activations (B x (T_enc + T_dec) x model.layers x E)": (
                (24 + 8 * model.d_conv) * per_position * FLOAT
            ),
        }

    def reads(self, config: Config) -> str:
        return (
            "every layer's SSM state and convolution window, `model.layers` x `model.expand` x `model.d_model` x "
            "(`model.d_state` + `model.d_conv` - 1)"
        )

    def fixed_state(self, config: Config) -> tuple[int, str] | None:
        """The convolution windows: every layer's last K - 1 inputs, whatever `model.d_state`."""
        model = config["model"]
        return model["layers"] * model["expand"] * model["d_model"] * (model["d_conv"] - 1), "convolution window"

    def describe(self, configs: list[DictConfig], values: Callable[[list[DictConfig], str], str]) -> str:
        return (
            f"- Mamba: {values(configs, 'model.layers')} layers each side, d_model {values(configs, 'model.d_model')}, "
            f"state size {values(configs, 'model.d_state')}, convolution width {values(configs, 'model.d_conv')}, "
            f"expansion {values(configs, 'model.expand')}; each decoder layer starts from its encoder layer's state."
        )

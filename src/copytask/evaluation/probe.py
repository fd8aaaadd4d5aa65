"""What the summary vector holds: a linear probe of it for the symbol at each source position.

The summary vector is a GRU decoder's initial state (`decoder.initial_state` of the encoder's final
state): all that the baseline's decoder sees of the source, and the same vector in the attention
models. A linear map from it to one-hot symbols, one block of outputs per source position, is fitted
by ridge regression in closed form (deterministic, no optimiser, no random number) on fresh sequences
drawn as training batches are, none of them in the run's validation or test set, and scored by its
argmax on the held-out set: accuracy by source position, chance 1 / vocab_size.

A linear probe is a lower bound on what the vector holds: a symbol it cannot read may still be there
in a form a non-linear read-out (such as the decoder) gets at. As a control (Hewitt and Liang, 2019)
the same probe reads the vector of the run's model before training (its initial weights, from the
run's seed): the gap is what training put there, not what a probe reads out of any random encoding.
A Transformer's decoder reads every encoder state, and has no summary vector to probe.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import Tensor

from ..data.batches import Batch
from ..data.splits import draw_excluding, heldout_keys
from ..data.vocab import NUM_SPECIAL
from ..models.build import Model, build_model

CHUNK = 1024  # sequences encoded at once


@torch.no_grad()
def summary_vectors(model: Model, batch: Batch) -> Tensor:
    """The decoder's initial state for each sequence of `batch` -> (B, S), float64."""
    vectors = []
    for start in range(0, len(batch), CHUNK):
        part = batch.select(slice(start, start + CHUNK))
        _, final = model.encoder(part.src, part.src_lengths)
        vectors.append(model.decoder.initial_state(final).double())
    return torch.cat(vectors)


def one_hot_sources(batch: Batch, vocab_size: int) -> Tensor:
    """The source symbols as one-hot blocks, one per position -> (B, T_enc * vocab_size), float64; zero
    past a sequence's length."""
    symbols = (batch.src - NUM_SPECIAL).clamp(min=0)  # (B, T_enc) content symbol 0 .. V - 1 (PAD: masked below)
    one_hot = torch.nn.functional.one_hot(symbols, vocab_size).double()
    valid = torch.arange(batch.src.size(1), device=batch.src.device) < batch.src_lengths[:, None]
    return (one_hot * valid[..., None]).flatten(1)


def fit(features: Tensor, targets: Tensor, ridge: float) -> tuple[Tensor, Tensor]:
    """Ridge regression with an intercept, in closed form: features (N, S), targets (N, K) ->
    weights (S, K), bias (K,) minimising |X W + b - Y|^2 / N + ridge |W|^2."""
    mean_x, mean_y = features.mean(0), targets.mean(0)
    x, y = features - mean_x, targets - mean_y
    gram = x.T @ x / len(x) + ridge * torch.eye(x.size(1), dtype=x.dtype, device=x.device)
    weights = torch.linalg.lstsq(gram, x.T @ y / len(x)).solution  # lstsq: a singular gram (ridge 0) too
    return weights, mean_y - mean_x @ weights


def position_accuracy(
    weights: Tensor, bias: Tensor, features: Tensor, batch: Batch, vocab_size: int
) -> list[float | None]:
    """The probe's argmax against each source position's symbol: accuracy by position over the
    sequences that have it (None where none does)."""
    scores = (features @ weights + bias).view(len(features), -1, vocab_size)  # (B, T_enc, V)
    right = scores.argmax(-1) == (batch.src - NUM_SPECIAL)
    valid = torch.arange(batch.src.size(1), device=batch.src.device) < batch.src_lengths[:, None]
    hits, counts = (right & valid).sum(0), valid.sum(0)
    return [None if n == 0 else h / n for h, n in zip(hits.tolist(), counts.tolist())]


def fitting_set(cfg: DictConfig, size: int, seed: int) -> Batch:
    """`size` sequences drawn as the run's training batches are (its lengths, its task), from `seed`,
    none of them in its validation or test set."""
    *_, heldout = heldout_keys(cfg)
    return draw_excluding(cfg, size, torch.Generator().manual_seed(seed), heldout, "probe's fitting set")


def untrained(cfg: DictConfig) -> Model:
    """The run's model before training: built on the CPU from its seed, as training builds it, with
    the caller's random state put back."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(cfg.seed)
        return build_model(cfg).eval()


def probe_summary(model: Model, cfg: DictConfig, heldout: Batch, size: int, ridge: float, seed: int) -> dict | None:
    """The probe of the summary vector of `model` (trained) and of the run's untrained model, fitted on
    `fitting_set(cfg, size, seed)` and scored on `heldout` -> {"trained", "untrained": accuracy by source
    position, "chance", "fit_size", "ridge"}; None for a model without one (the Transformer)."""
    if not hasattr(model, "encoder"):
        return None
    device = heldout.src.device
    fitting, vocab_size = fitting_set(cfg, size, seed).to(device), cfg.task.vocab_size
    targets = one_hot_sources(fitting, vocab_size)
    result = {"chance": 1 / vocab_size, "fit_size": size, "ridge": ridge}
    for name, probed in (("trained", model), ("untrained", untrained(cfg).to(device))):
        weights, bias = fit(summary_vectors(probed, fitting), targets, ridge)
        result[name] = position_accuracy(weights, bias, summary_vectors(probed, heldout), heldout, vocab_size)
    return result

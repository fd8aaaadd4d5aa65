"""Evaluation: build a configured model, load a finished run's, and score greedy decoding (no
teacher forcing) on a set of sequences (`splits` draws them). Training, the analysis, decode and
the benchmark all score through `sequence_scores`, so a number means the same wherever it is
printed: an output ends at its first EOS, and a content position after it is wrong whatever the
decoder emits there."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from . import store
from .data import EOS, Batch, total_vocab
from .devices import resolve_device
from .model import Seq2Seq
from .model_config import is_transformer, position_rows
from .transformer import TransformerSeq2Seq


def build_model(cfg: DictConfig, model_class: type[nn.Module] = Seq2Seq, transformer_class: type[nn.Module] = TransformerSeq2Seq) -> nn.Module:
    """The configured model: `transformer_class` for model=transformer, else `model_class`, which may
    be any classes with TransformerSeq2Seq's and Seq2Seq's constructor and interface (the benchmark
    passes `reference.ReferenceTransformer` and `reference.ReferenceSeq2Seq`)."""
    if is_transformer(cfg):
        model = cfg.model
        return transformer_class(
            total_vocab(cfg.task.vocab_size), model.d_model, model.heads, model.layers, model.ff_size,
            model.positions, position_rows(cfg), model.dropout, fused=cfg.train.get("fused", True),
        )
    return model_class(
        vocab=total_vocab(cfg.task.vocab_size),
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


# Sequences greedily decoded at once on CPU. Smaller pieces keep a decoder step's tensors in cache:
# 512 held-out sequences at length 80 took Bahdanau 0.46 s in one piece and 0.29 s in pieces of 128
# (Luong general 0.27 -> 0.23 s; the baseline, with no attention tensors, 0.08 -> 0.10 s).
EVAL_CHUNK = 128


@torch.no_grad()
def evaluate(model: nn.Module, batch: Batch, chunk_size: int | None = None) -> dict:
    """Greedy decoding (no teacher forcing) on `batch`, scored by `sequence_scores`: token accuracy
    over the content positions, exact-sequence accuracy (every symbol and the EOS right) and the
    share of outputs that ended early (an EOS before the target's end). Also returns the decoded
    tokens (B, T_dec) and attention weights (B, T_dec, T_enc) or None. `chunk_size` sequences are
    decoded at a time: by default EVAL_CHUNK on CPU, all at once on a GPU."""
    if chunk_size is None:
        chunk_size = len(batch) if batch.src.is_cuda else EVAL_CHUNK
    was_training = model.training
    model.eval()
    tokens, weights = [], []
    for start in range(0, len(batch), chunk_size):
        part = batch.select(slice(start, start + chunk_size))
        out, w = model.greedy(part.src, part.src_lengths, steps=batch.tgt_out.size(1))
        tokens.append(_pad_to(out, batch.tgt_out.size(1)))
        weights.append(None if w is None else _pad_to(w, batch.src.size(1), dim=2))
    model.train(was_training)
    tokens = torch.cat(tokens)
    scores = sequence_scores(tokens, batch)
    return {
        "token_acc": scores.hits.sum().item() / scores.symbols.sum().item(),
        "seq_acc": scores.exact.float().mean().item(),
        "ended_early": scores.early.float().mean().item(),
        "tokens": tokens,
        "weights": None if weights[0] is None else torch.cat(weights),
    }


class Scores(NamedTuple):
    """Per sequence (B,): content symbols right, content symbols, whether the whole target is right
    (every symbol and the EOS), and whether the output ended early (an EOS before the target's)."""

    hits: torch.Tensor
    symbols: torch.Tensor
    exact: torch.Tensor
    early: torch.Tensor


def output_mask(tokens: torch.Tensor) -> torch.Tensor:
    """Greedy output (B, T_dec) -> (B, T_dec) True up to and with each output's first EOS: the
    output itself. An output without EOS runs to the end."""
    eos = tokens == EOS
    return (eos.cumsum(1) - eos.long()) == 0  # no EOS before this position


def sequence_scores(tokens: torch.Tensor, batch: Batch) -> Scores:
    """Greedy output `tokens` (B, T_dec) against `batch`: an output ends at its first EOS, so a
    content position after it is wrong, whatever the decoder emitted there; an output that never
    emits EOS is scored over the target's length. The one scoring rule of every number."""
    correct = (tokens == batch.tgt_out) & output_mask(tokens)
    content = batch.content_mask
    early = ((tokens == EOS) & content).any(1)
    return Scores((correct & content).sum(1), content.sum(1), (correct | ~batch.target_mask).all(1), early)


def rounded(weights: torch.Tensor) -> list:
    """Attention weights as nested lists with four decimals: small enough for a length-80 map in
    JSON, exact enough for a heatmap."""
    return weights.double().mul(1e4).round().div(1e4).tolist()


def _pad_to(t: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    missing = size - t.size(dim)
    if missing == 0:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = missing
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


def load_run(folder: Path, device: str = "cpu") -> tuple[DictConfig, Seq2Seq]:
    """A finished run's resolved config and its trained model on `device` (auto: a GPU where there
    is one), in eval mode. The checkpoint loads onto the CPU first, wherever it was saved."""
    cfg = OmegaConf.load(Path(folder) / store.CONFIG)
    with torch.random.fork_rng(devices=[]):  # the initialisation, overwritten at once, draws from the global generator
        model = build_model(cfg)
    checkpoint = torch.load(Path(folder) / store.CHECKPOINT, map_location="cpu", weights_only=True)
    model.load_state_dict(checkpoint["model"])
    return cfg, model.to(resolve_device(device)).eval()

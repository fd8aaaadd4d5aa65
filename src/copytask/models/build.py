"""The model a config describes: the GRU encoder-decoder with its attention, or the Transformer."""

from __future__ import annotations


from omegaconf import DictConfig
from torch import nn

from ..data.vocab import total_vocab
from .recurrent import Seq2Seq
from ..config.model_keys import is_transformer, position_rows
from .transformer import TransformerSeq2Seq

Model = Seq2Seq | TransformerSeq2Seq  # what `build_model` makes, and what training, the analysis and decode take


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



"""The one protocol of a model: what training, greedy decoding, beam search, the analysis, `decode` and the report
need of it, and what a model may offer beyond that. Every model copytask builds keeps it, its own (the GRU
encoder-decoders, the Transformer, Mamba) and a user's from their own module (configs/model/<name>.yaml naming
the class by `_target_`); its family (`copytask.families`) says what configures it.

What every model gives, the least a user writes (`Seq2SeqModel`, subclassed):
- `__init__(self, vocab: int, **keys)`: `vocab` is V, the vocabulary's size (the content symbols, PAD, BOS and
  EOS, and the noise token where the task's sources hold it); `keys` are the model's own keys as its config gives
  them (configs/model/<name>.yaml less `_target_` and `name`). A setting it cannot build is a ValueError, which
  is refused in one line before anything is written.
- `forward(src, src_lengths, tgt_in) -> (logits, weights)`: teacher forcing. src (B, T_enc) token ids, PAD past
  each length; src_lengths (B,); tgt_in (B, T_dec), BOS then the target but its last token -> logits
  (B, T_dec, V) and the attention weights (B, T_dec, T_enc) that made them, or None. Row b depends on row b only.

What a model may offer (each analysis asks, and says in one line what it cannot show where a model does not):
- a fast step, `decoding(src, src_lengths, steps, need_weights) -> Decoding` (`models.decoding`: the source read
  once, one token fed a step, `reorder` for beam search). The default, `PrefixDecoding`, runs `forward` again on
  the growing prefix at every step: right, and slower by a factor of the target's length.
- attention weights: `forward` returns them, and `attentions` lists the `Attention` modules whose weights a
  counterfactual replaces (`attention`: the one whose weights are the maps): maps, alignment, counterfactuals
  and heatmaps.
- `summary_state(src, src_lengths) -> (B, S)`: what it hands its decoder of the source, the linear probe's input.
- `state_floats(length) -> int`: floats per sequence its decoder can read of a source of `length` symbols (None:
  not said; the state figure leaves the run out).
- `longest_source`: the longest source it is defined at (None: any).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .decoding import greedy_search


class Seq2SeqModel(nn.Module):
    """What every model gives and the defaults of what it may offer (see the module)."""

    def forward(self, src: Tensor, src_lengths: Tensor, tgt_in: Tensor) -> tuple[Tensor, Tensor | None]:
        """Teacher forcing: -> logits (B, T_dec, V), weights (B, T_dec, T_enc) or None."""
        raise NotImplementedError(f"{type(self).__name__} must define forward(src, src_lengths, tgt_in)")

    @property
    def attention(self) -> nn.Module | None:
        """The attention whose weights are the model's maps; None: no attention to show."""
        return None

    @property
    def attentions(self) -> list[nn.Module]:
        """Every attention a counterfactual replaces (`Attention.intervention`); empty: none."""
        return [] if self.attention is None else [self.attention]

    @property
    def longest_source(self) -> int | None:
        """The longest source the model is defined at; None: any."""
        return None

    def state_floats(self, length: int) -> int | None:
        """Floats per sequence the decoder can read of a source of `length` symbols; None: not said."""
        return None

    def decoding(self, src: Tensor, src_lengths: Tensor, steps: int, need_weights: bool = True) -> PrefixDecoding:
        """A decoding of up to `steps` steps fed one token a step (`models.decoding`): by default `forward` on the
        growing prefix."""
        return PrefixDecoding(self, src, src_lengths, need_weights)

    @torch.no_grad()
    def greedy(
        self, src: Tensor, src_lengths: Tensor, steps: int, need_weights: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """Greedy decoding, each step fed its own previous prediction: -> tokens (B, steps), weights
        (B, steps, T_enc) or None (no attention, or no `need_weights`)."""
        return greedy_search(self.decoding(src, src_lengths, steps, need_weights), src.size(0), steps, src.device)


class PrefixDecoding:
    """A model's `forward` run again at each step on the tokens fed so far (BOS first): the decoding of a model
    without a step of its own. Each step costs a teacher-forced pass over the prefix."""

    def __init__(self, model: nn.Module, src: Tensor, src_lengths: Tensor, need_weights: bool):
        self.model, self.src, self.src_lengths, self.need_weights = model, src, src_lengths, need_weights
        self.prefix = src.new_empty((src.size(0), 0))  # (B, t): the tokens fed so far

    def step(self, tokens: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        """tokens (B,) fed at output step t -> logits (B, V) of the next token, weights (B, T_enc) or None."""
        self.prefix = torch.cat([self.prefix, tokens[:, None]], dim=1)
        logits, weights = self.model(self.src, self.src_lengths, self.prefix)
        return logits[:, -1], weights[:, -1] if weights is not None and self.need_weights else None

    def reorder(self, rows: Tensor) -> None:
        """Row i becomes row `rows[i]` (beam search's parents: rows of the same source, so only the prefix moves)."""
        self.prefix = self.prefix.index_select(0, rows)

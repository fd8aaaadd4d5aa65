"""Issue 88: one protocol for a model (`models.protocol`). A model that gives only its constructor and `forward`
decodes by the protocol's default, `forward` run again on the growing prefix: greedy decoding and beam search
must then give what a model's own fast step gives, and the model offers nothing else (no attention, no
summary state, no state floats)."""

from __future__ import annotations

import pytest
import torch

from copytask.data import splits
from copytask.models.beam import beam_search
from copytask.models.build import build_model
from copytask.models.protocol import PrefixDecoding, Seq2SeqModel

from .conftest import TINY


class ForwardOnly(Seq2SeqModel):
    """A built model's `forward`, and nothing else of it: what a user's model gives at the least."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.inner = model

    def forward(self, src, src_lengths, tgt_in):
        return self.inner(src, src_lengths, tgt_in)


@pytest.mark.parametrize(
    "model", [["attention=bahdanau"], ["attention=none"], ["model=mamba", "model.d_model=8", "model.d_state=2"]]
)
def test_forward_alone_decodes_as_the_models_own_step(make_config, model):
    cfg = make_config(*TINY, *model, "task.length=5")
    torch.manual_seed(0)
    built = build_model(cfg).eval()
    wrapped = ForwardOnly(built).eval()
    assert isinstance(wrapped.decoding(torch.zeros(1, 1, dtype=torch.long), torch.ones(1), 3), PrefixDecoding)
    batch = splits.test_batch(cfg)
    steps = batch.tgt_out.size(1)
    fast, fast_weights = built.greedy(batch.src, batch.src_lengths, steps)
    slow, slow_weights = wrapped.greedy(batch.src, batch.src_lengths, steps)
    assert torch.equal(fast, slow)
    assert (fast_weights is None) == (slow_weights is None)
    if fast_weights is not None:
        torch.testing.assert_close(fast_weights, slow_weights)
    fast_beams = beam_search(built, batch.src, batch.src_lengths, steps, 3)
    slow_beams = beam_search(wrapped, batch.src, batch.src_lengths, steps, 3)
    assert torch.equal(fast_beams.tokens, slow_beams.tokens)
    torch.testing.assert_close(fast_beams.scores, slow_beams.scores)


def test_a_model_that_gives_only_forward_offers_nothing_else(make_config):
    wrapped = ForwardOnly(build_model(make_config(*TINY, "attention=bahdanau")))
    assert wrapped.attention is None and wrapped.attentions == [] and wrapped.longest_source is None
    assert wrapped.state_floats(10) is None and not hasattr(wrapped, "summary_state")
    with pytest.raises(NotImplementedError, match="must define forward"):
        Seq2SeqModel()(torch.zeros(1, 1), torch.ones(1), torch.zeros(1, 1))

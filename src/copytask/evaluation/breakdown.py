"""Where a model's accuracy is lost: in what the decoder knows, or in decoding on its own outputs.

A collapse under greedy decoding mixes two causes: information missing from what the decoder gets
from the encoder, and errors that compound once the decoder feeds on its own outputs (exposure
bias). Three measurements on the same held-out sequences pull them apart:

- teacher forcing: the argmax at each step given the true prefix. Every step gets the right history,
  so nothing compounds; the output still ends at its first EOS (`data.scoring`). On the whole test
  set, as greedy decoding (every reported greedy number).
- beam search at several widths (`models.beam`): how much a search over the decoder's own
  distribution recovers; width 1 is greedy decoding, run as a beam search. On the first
  `analysis.eval_size` test sequences: a wide beam costs several greedy decodings.
- accuracy by output position, greedy and teacher-forced: where in the sequence the output goes wrong.

Every output is scored by the one rule (`data.scoring`); what the summary vector holds is `probe`'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from omegaconf import DictConfig
from torch import Tensor

from ..data.batches import Batch
from ..data.scoring import accuracy
from ..models.beam import beam_search
from ..models.build import Model
from ..models.chunks import over_chunks, pad_to
from ..models.greedy import EVAL_CHUNK
from .probe import probe_summary

BEAM_ROWS = 512  # decoder rows (sequences x beams) a beam search runs at once on CPU: a step's tensors stay in cache


@dataclass(frozen=True)
class Settings:
    """What `measure` computes: the analysis.* keys of the same names (configs/config.yaml)."""

    beam_widths: tuple[int, ...] = (1, 4)  # empty: no beam search
    length_normalise: bool = False
    probe_size: int | None = 2048  # None: no probe
    probe_ridges: tuple[float, ...] = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
    probe_seed: int = 1

    @classmethod
    def from_config(cls, analysis: DictConfig) -> Settings:
        return cls(
            tuple(analysis.beam_widths or ()),
            analysis.length_normalise,
            analysis.probe_size,
            tuple(float(ridge) for ridge in analysis.probe_ridges),
            analysis.probe_seed,
        )

    def record(self) -> dict:
        """As analysis.json records them (and `is_analysed` compares them)."""
        return asdict(self) | {"beam_widths": list(self.beam_widths), "probe_ridges": list(self.probe_ridges)}


def teacher_forced(model: Model, batch: Batch, chunk_size: int = EVAL_CHUNK) -> Tensor:
    """The argmax at every step given the true prefix (`batch.tgt_in`) -> tokens (B, T_dec), PAD past
    the target of a chunk's longest sequence."""

    def argmax(part: Batch) -> Tensor:
        logits, _ = model(part.src, part.src_lengths, part.tgt_in)  # (b, t_dec <= T_dec, V)
        return pad_to(logits.argmax(-1), batch.tgt_out.size(1))

    return over_chunks(model, batch, chunk_size, argmax)


def beam_tokens(model: Model, batch: Batch, width: int, length_normalise: bool = False) -> Tensor:
    """Beam search of `width` on `batch`, BEAM_ROWS decoder rows at a time (all at once on a GPU)
    -> tokens (B, T_dec)."""
    chunk_size = len(batch) if batch.src.is_cuda else max(1, BEAM_ROWS // width)
    steps = batch.tgt_out.size(1)

    def search(part: Batch) -> Tensor:
        return beam_search(model, part.src, part.src_lengths, steps, width, length_normalise, need_weights=False).tokens

    return over_chunks(model, batch, chunk_size, search)


def breakdown(
    model: Model, test: Batch, greedy: Tensor, beam_size: int | None, widths: list[int], length_normalise: bool
) -> dict:
    """Greedy (its `greedy` tokens (B, T_dec) on `test`) and teacher-forced accuracy on `test`, and beam
    search's at each of `widths` on its first `beam_size` sequences (None: all) -> {"sequences": B,
    "greedy": ..., "teacher_forced": ... (each `data.scoring.accuracy`), "beam_sequences": n, "beam": [{"width",
    "token_acc", "seq_acc"}, ...]}."""
    beam_set = test.select(slice(0, beam_size))
    result = {
        "sequences": len(test),
        "greedy": accuracy(greedy, test),
        "teacher_forced": accuracy(teacher_forced(model, test), test),
        "beam_sequences": len(beam_set),
    }
    rows = []
    for width in widths:
        scored = accuracy(beam_tokens(model, beam_set, width, length_normalise), beam_set)
        rows.append({"width": width, "token_acc": scored["token_acc"], "seq_acc": scored["seq_acc"]})
    result["beam"] = rows
    return result


def measure(
    model: Model, cfg: DictConfig, test: Batch, greedy: Tensor, beam_size: int | None, steps: int, settings: Settings
) -> dict:
    """`breakdown` on the test set (beams on its first `beam_size` sequences), and the probe of the summary
    vector (`probe.probe_summary`, off the run's first `steps` training batches; None for a Transformer or
    with no probe_size) -> analysis.json's `breakdown`, with its settings."""
    result = {"settings": settings.record()}
    result |= breakdown(model, test, greedy, beam_size, list(settings.beam_widths), settings.length_normalise)
    if settings.probe_size:
        result["probe"] = probe_summary(
            model, cfg, test, settings.probe_size, list(settings.probe_ridges), settings.probe_seed, steps
        )
    return result

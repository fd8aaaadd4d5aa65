"""A trained run's greedy output (or beam search's, `beam` K > 1) as values: `decode` -> `Decoded`.

Loads a run folder's config and checkpoint and greedy-decodes sequences written by hand (`"g d d c"`
or `gddc`; for selective copying with the noise token `_`, `"_ g _ _ d"`) or drawn at random at any length
the task draws (longer than trained too: length generalisation by hand), and returns the token ids,
scores and attention weights as arrays (`Decoded`): one map per head for a multi-head model, else the
model's one map. `copytask.decode` is this function;
`python -m copytask decode` prints what it returns (`cli_decode`).

The request, the run folder and the symbols are checked before torch is imported, so a refusal
(DecodeError) comes at once. The model runs torch's own ops (the definition the fused CPU kernels are
checked against, to float rounding): loading the kernels would cost a few sequences more than it saves.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from .. import store
from ..config.checks import check_beam_width
from ..console import ConfigError
from ..data.tasks import task_of
from ..data.vocab import EOS, noise_token, parse_symbols, symbol


class DecodeError(ConfigError):
    """A decode request that cannot be answered; the message names the value and what is allowed."""


def read_run(folder: Path) -> DictConfig:
    """The resolved config of the run in `folder`; DecodeError unless it is a run folder with a checkpoint."""
    if not folder.is_dir():
        raise DecodeError(f"{str(folder)!r} is not a run folder: it does not exist")
    if not (folder / store.CONFIG).is_file():
        raise DecodeError(
            f"{str(folder)!r} is not a run folder (no {store.CONFIG}); give one that train or sweep wrote, runs/<name>"
        )
    if not (folder / store.CHECKPOINT).is_file():
        raise DecodeError(f"{str(folder)!r} has no {store.CHECKPOINT}: its training has not finished, or it failed")
    return store.read_config(folder)


@dataclass
class Decoded:
    """Greedy decoding of B sequences by a trained run's model (token ids as `data.vocab` numbers them)."""

    run: str  # the run folder's name
    config: DictConfig  # the run's resolved config
    source: np.ndarray  # (B, T_enc) source tokens, PAD past each sequence's length
    lengths: np.ndarray  # (B,)
    output: np.ndarray  # (B, T_dec) greedy output, T_dec the longest target's length + 1 (T_enc + 1 for copy)
    target: np.ndarray  # (B, T_dec) target + EOS, PAD past it
    hits: np.ndarray  # (B,) content symbols right, up to the output's first EOS (`scoring.sequence_scores`)
    symbols: np.ndarray  # (B,) content symbols
    exact: np.ndarray  # (B,) every symbol and the EOS right
    weights: np.ndarray | None  # (B, heads, T_dec, T_enc) attention weights; None without attention
    beam: int = 1  # the beam search's width (1: greedy decoding)

    @property
    def token_acc(self) -> float:
        """Token accuracy over every content symbol of the B sequences."""
        return float(self.hits.sum() / self.symbols.sum())

    def text(self, i: int) -> dict[str, list[str]]:
        """Sequence `i` as symbols: its `input` (the noise token `_`), `output` (up to and with its first EOS:
        what follows is not part of the output) and `target` (up to and with its EOS)."""
        vocab_size, length = self.config.task.vocab_size, int(self.lengths[i])
        output, target = self.output[i].tolist(), self.target[i].tolist()
        end = output.index(EOS) + 1 if EOS in output else len(output)
        return {
            "input": [symbol(t, vocab_size) for t in self.source[i, :length].tolist()],
            "output": [symbol(t, vocab_size) for t in output[:end]],
            "target": [symbol(t, vocab_size) for t in target[: target.index(EOS) + 1]],
        }


def decode(
    run_dir: Path | str,
    symbols: str | None = None,
    random: int | None = None,
    length: int | None = None,
    seed: int = 0,
    beam: int = 1,
    length_normalise: bool = False,
) -> Decoded:
    """Greedy-decode `symbols` (`"g d d c"` or `gddc`) with the model of the run in `run_dir`, or
    `random` sequences of `length` symbols (default: the trained length) drawn from `seed`, on
    the CPU; with `beam` K > 1, beam search of width K (`models.beam`, `length_normalise` as there).
    DecodeError (a ConfigError) for a request that cannot be answered: a bad request
    before torch loads, an unreadable checkpoint or a length the model is not defined at after."""
    run_dir = Path(run_dir)
    try:
        check_beam_width(beam, "--beam")
    except ConfigError as error:
        raise DecodeError(str(error)) from None
    cfg = read_run(run_dir)
    task, text = cfg.task, (symbols or "").strip()
    try:
        sources = task_of(task).sources
    except ValueError as error:
        raise DecodeError(f"{run_dir.name} was trained on a task that is not here: {error}") from None
    if text and random is not None:
        raise DecodeError("give symbols or --random N, not both")
    if random is None:
        if length is not None:
            raise DecodeError("--length goes with --random; the length of given symbols is their number")
        sequences = [parse_symbols(text, task.vocab_size, noise=sources.noise)]
        if sources.noise and all(token == noise_token(task.vocab_size) for token in sequences[0]):
            raise DecodeError(f"task {task.name} copies the content symbols among the noise (_): give at least one")
    else:
        sequences = None
        for name, value in (("--random", random), ("--length", length)):
            if value is not None and value < 1:
                raise DecodeError(f"{name} must be at least 1, got {value}")
        shortest = sources.shortest(task.get("copied"))
        if length is not None and length < shortest:
            raise DecodeError(
                f"--length must be at least {shortest} for task {task.name} with task.copied={task.copied}, "
                f"got {length}"
            )
    return _decode(run_dir, cfg, sequences, random, length or cfg.task.length, seed, beam, length_normalise)


def _decode(
    run_dir: Path,
    cfg: DictConfig,
    sequences: list[list[int]] | None,
    count: int,
    length: int,
    seed: int,
    beam: int,
    length_normalise: bool,
) -> Decoded:
    import torch  # here, not at import: the checks above answer without it

    from ..data.batches import make_batch, task_batch
    from ..data.scoring import sequence_scores
    from ..models.beam import beam_search
    from .load import load_run

    try:
        # a few sequences: the CPU and torch's own ops are quick enough, and answer sooner than the kernels load
        model, _ = load_run(run_dir, device="cpu", fused=False)
    except (OSError, RuntimeError, KeyError, ValueError, EOFError, pickle.UnpicklingError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""  # torch's key mismatches span lines
        raise DecodeError(f"cannot load {run_dir / store.CHECKPOINT}: {type(error).__name__}: {first}") from None
    task, vocab_size = cfg.task.name, cfg.task.vocab_size
    longest = model.longest_source
    asked = length if sequences is None else len(sequences[0])
    if longest is not None and asked > longest:
        raise DecodeError(
            f"{run_dir.name} has learned positions up to length {longest} (model.max_length): "
            f"it is not defined at length {asked}"
        )
    if sequences is None:
        generator = torch.Generator().manual_seed(seed)
        batch = make_batch(task, count, length, vocab_size, generator, copied=cfg.task.get("copied"))
    else:
        batch = task_batch(task, torch.tensor(sequences), torch.tensor([len(sequences[0])]), vocab_size)
    steps = batch.tgt_out.size(1)
    if beam > 1:  # the best beam's tokens and weights (mean over heads)
        tokens, _, weights = beam_search(model, batch.src, batch.src_lengths, steps, beam, length_normalise)
    else:
        tokens, weights = model.greedy(batch.src, batch.src_lengths, steps)  # weights: mean over heads
    heads = model.attention.heads if model.attention is not None else 1
    per_head = heads > 1 and beam == 1  # a beam's heads are not kept: its map is their mean
    if per_head:
        from .analysis import head_weights  # with the analysis' pandas: only for a model that has several heads

        maps = head_weights(model, batch)
    else:
        maps = weights[:, None] if weights is not None else None
    scores = sequence_scores(tokens, batch)
    return Decoded(
        run_dir.name,
        cfg,
        batch.src.numpy(),
        batch.src_lengths.numpy(),
        tokens.numpy(),
        batch.tgt_out.numpy(),
        scores.hits.numpy(),
        scores.symbols.numpy(),
        scores.exact.numpy(),
        None if maps is None else maps.numpy(),
        beam,
    )

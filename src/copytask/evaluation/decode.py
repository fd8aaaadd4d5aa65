"""A trained run's greedy output (or beam search's, `--beam K`): `decode` (values) and
`python -m copytask decode RUN_DIR SYMBOLS | --random N [--length L] [--beam K]` (text).

Loads a run folder's config and checkpoint and greedy-decodes sequences written by hand (`"g d d c"`
or `gddc`) or drawn at random at any length (longer than trained too: length generalisation by
hand). `decode` returns the token ids, scores and attention weights as arrays (`Decoded`); the
command prints for each sequence its input, output (up to its first EOS) and target aligned, `^`
under every wrong output symbol, its token accuracy, and the attention as a text heatmap
(`text_heatmap`): one map per head for a multi-head model, else the model's one map. `--png FILE`
draws the first sequence's map as the report does (`figures.plot_attention`).

The arguments, the run folder and the symbols are checked before torch is imported, so a refusal
is one line at once: `copytask: error: ...`, exit status 2.
"""

from __future__ import annotations

import argparse
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from .. import store
from ..config.checks import check_beam_width
from ..config.model_keys import model_name
from ..config.schema import MAX_BEAM
from ..console import ConfigError, refuse
from ..data.vocab import EOS, parse_symbols, symbol

SHADES = " ░▒▓█"  # attention weight 0, 0.25, 0.5, 0.75, 1 (each weight rounded to the nearest)
COPIED = "◂"  # after the cell of the source position an output step copies
WRONG = "^"


class DecodeError(ConfigError):
    """A decode request that cannot be answered; the message names the value and what is allowed."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as every copytask refusal, instead of argparse's usage block
        raise DecodeError(f"decode: {message} (python -m copytask decode --help)")


def parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m copytask decode",
        description="Greedy-decode sequences with a trained run's model and show its attention.",
    )
    parser.add_argument("run_dir", type=Path, help="a run folder written by train or sweep (runs/<name>)")
    parser.add_argument(
        "symbols", nargs="*", help="the source: symbols separated by spaces ('g d d c') or letters together (gddc)"
    )
    parser.add_argument("--random", type=int, metavar="N", help="decode N random sequences instead")
    parser.add_argument(
        "--length", type=int, metavar="L", help="with --random: their length, any length (default: the trained one)"
    )
    parser.add_argument("--seed", type=int, default=0, help="with --random: the seed they are drawn from (default 0)")
    parser.add_argument(
        "--png", type=Path, metavar="FILE", help="also draw the (first) sequence's attention as the report does"
    )
    parser.add_argument(
        "--beam", type=int, default=1, metavar="K", help=f"beam search of width K, 1 to {MAX_BEAM} (default 1: greedy)"
    )
    parser.add_argument(
        "--length-normalise", action="store_true", help="with --beam: rank hypotheses by log-probability / length"
    )
    return parser


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
    return OmegaConf.load(folder / store.CONFIG)


def alignment_lines(source: list[str], output: list[str], target: list[str]) -> list[str]:
    """Input, output and target symbols in columns (each as wide as its widest symbol), then a line
    with `^` under every output symbol that differs from the target, and under every target symbol
    an output that ended early did not reach."""
    widths = [max(len(cells[i]) for cells in (source, output, target) if i < len(cells)) for i in range(len(target))]

    def line(name: str, cells: list[str]) -> str:
        return (f"{name:<8}" + " ".join(cell.ljust(width) for cell, width in zip(cells, widths))).rstrip()

    marks = [WRONG if i >= len(output) or output[i] != want else " " for i, want in enumerate(target)]
    return [line("input", source), line("output", output), line("target", target), line("", marks)]


def text_heatmap(weights: list[list[float]], source: list[str], rows: list[str], copied: list[int]) -> list[str]:
    """Attention weights (T_dec, T_enc) as text: one row per output step (labelled with `rows`), one
    cell per source position (headed by `source`), each weight as a shade of SHADES, and COPIED after
    the cell of the position `copied[t]` that output step t copies (the rows past `copied` copy none)."""
    width = max(len(name) for name in source) + 1
    label = max(len(name) for name in rows)
    lines = [" " * (label + 1) + "".join(name.ljust(width) for name in source).rstrip()]
    for step, (name, row) in enumerate(zip(rows, weights)):
        cells = []
        for position, weight in enumerate(row):
            mark = COPIED if step < len(copied) and copied[step] == position else " "
            cells.append(SHADES[round(weight * (len(SHADES) - 1))] * (width - 1) + mark)
        lines.append(f"{name:>{label}} {''.join(cells)}".rstrip())
    return lines


@dataclass
class Decoded:
    """Greedy decoding of B sequences by a trained run's model (token ids as `data.vocab` numbers them)."""

    run: str  # the run folder's name
    config: DictConfig  # the run's resolved config
    source: np.ndarray  # (B, T_enc) content ids, PAD past each sequence's length
    lengths: np.ndarray  # (B,)
    output: np.ndarray  # (B, T_dec) greedy output, T_dec = T_enc + 1
    target: np.ndarray  # (B, T_dec) target + EOS
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
        """Sequence `i` as symbols: its `input`, `output` (up to and with its first EOS: what
        follows is not part of the output) and `target`."""
        vocab_size, length = self.config.task.vocab_size, int(self.lengths[i])
        output = self.output[i].tolist()
        end = output.index(EOS) + 1 if EOS in output else len(output)
        return {
            "input": [symbol(t, vocab_size) for t in self.source[i, :length].tolist()],
            "output": [symbol(t, vocab_size) for t in output[:end]],
            "target": [symbol(t, vocab_size) for t in self.target[i, : length + 1].tolist()],
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
    text = (symbols or "").strip()
    if text and random is not None:
        raise DecodeError("give symbols or --random N, not both")
    if random is None:
        if length is not None:
            raise DecodeError("--length goes with --random; the length of given symbols is their number")
        sequences = [parse_symbols(text, cfg.task.vocab_size)]
    else:
        sequences = None
        for name, value in (("--random", random), ("--length", length)):
            if value is not None and value < 1:
                raise DecodeError(f"{name} must be at least 1, got {value}")
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
    from .analysis import head_weights
    from .load import load_run

    try:
        model, _ = load_run(run_dir, device="cpu")  # a few sequences: the CPU is quick enough
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
        batch = make_batch(task, count, length, vocab_size, torch.Generator().manual_seed(seed))
    else:
        batch = task_batch(task, torch.tensor(sequences), torch.tensor([len(sequences[0])]))
    steps = batch.tgt_out.size(1)
    if beam > 1:  # the best beam's tokens and weights (mean over heads)
        tokens, _, weights = beam_search(model, batch.src, batch.src_lengths, steps, beam, length_normalise)
    else:
        tokens, weights = model.greedy(batch.src, batch.src_lengths, steps)  # weights: mean over heads
    heads = model.attention.heads if model.attention is not None else 1
    per_head = heads > 1 and beam == 1  # a beam's heads are not kept: its map is their mean
    maps = head_weights(model, batch) if per_head else (weights[:, None] if weights is not None else None)
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


def main(args: list[str]) -> int:
    """`python -m copytask decode ...`; returns the exit status (2: a refusal, in one line)."""
    try:
        options = parser().parse_args(args)
    except SystemExit as done:  # --help
        return done.code or 0
    except DecodeError as error:
        return refuse(error)
    try:
        decoded = decode(
            options.run_dir,
            " ".join(options.symbols),
            options.random,
            options.length,
            options.seed,
            options.beam,
            options.length_normalise,
        )
    except ValueError as error:  # DecodeError, and parse_symbols' refusals
        return refuse(error)
    print_decoded(decoded, options.png)
    return 0


def print_decoded(decoded: Decoded, png: Path | None) -> None:
    """The command's text for `decoded` (see the module), and the first sequence's map drawn to `png`."""
    cfg, weights = decoded.config, decoded.weights
    task, heads = cfg.task.name, 1 if weights is None else weights.shape[1]
    label = store.model_label(cfg)
    trained = f"{cfg.task.min_length}-{cfg.task.length}" if cfg.task.get("variable_length") else cfg.task.length
    search = f", beam search of width {decoded.beam}" if decoded.beam > 1 else ""
    print(f"{decoded.run}: {label}, task {task}, trained at length {trained}{search}")
    if weights is None:
        chosen = f"attention={cfg.attention.name}" if model_name(cfg) == "gru" else f"model={model_name(cfg)}"
        print(f"no attention ({chosen}): no heatmap")
    else:
        which = f"one map per head ({heads} heads)" if heads > 1 else "the model's attention"
        print(
            f"attention: {which}; rows output steps, columns source positions; shade = weight "
            f"('{SHADES[0]}' 0, {SHADES[1]} 0.25, {SHADES[2]} 0.5, {SHADES[3]} 0.75, {SHADES[4]} 1); "
            f"{COPIED} the copied position"
        )
    from ..data.batches import copied_source_positions

    for i in range(len(decoded.source)):
        text = decoded.text(i)
        print()
        print("\n".join(alignment_lines(text["input"], text["output"], text["target"])))
        hits, symbols = int(decoded.hits[i]), int(decoded.symbols[i])
        print(
            f"token accuracy {hits}/{symbols} ({100 * hits / symbols:.1f}%), "
            f"sequence {'right' if decoded.exact[i] else 'wrong'}"
        )
        if weights is None:
            continue
        copied = copied_source_positions(task, len(text["input"]))
        for head in range(heads):
            if heads > 1:
                print(f"head {head}")
            rows = weights[i, head, : len(text["output"]), : len(text["input"])]
            print("\n".join(text_heatmap(rows.tolist(), text["input"], text["output"], copied)))
    if len(decoded.source) > 1:
        print(
            f"\nover the {len(decoded.source)} sequences: token accuracy {100 * decoded.token_acc:.1f}%, "
            f"{int(decoded.exact.sum())} of {len(decoded.source)} sequences right"
        )
    if png is not None and weights is not None:
        from ..figures import plot_attention

        sample = {"source": decoded.source[0].tolist(), "target": decoded.target[0].tolist(),
                  "output": decoded.output[0].tolist(),
                  "weights": (weights[0] if heads > 1 else weights[0, 0]).tolist()}  # fmt: skip
        decoding = f"beam {decoded.beam}" if decoded.beam > 1 else "greedy"
        title = f"{label}, {decoding} (token acc {100 * decoded.hits[0] / decoded.symbols[0]:.1f}%)"
        print(f"attention map: {plot_attention(sample, cfg.task.vocab_size, task, title, png)}")
    elif png is not None:
        print("no attention map to draw: the model has no attention")

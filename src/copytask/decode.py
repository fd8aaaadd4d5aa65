"""`python -m copytask decode RUN_DIR SYMBOLS | --random N [--length L]`: a trained run's greedy output.

Loads a run folder's config and checkpoint, greedy-decodes sequences written by hand (`"g d d c"`
or `gddc`) or drawn at random at any length (longer than trained too: length generalisation by
hand), and prints for each its input, output and target aligned, `^` under every wrong output
symbol, its token accuracy, and the attention as a text heatmap (`text_heatmap`): one map per head
for a multi-head model, else the model's one map. `--png FILE` draws the first sequence's map as
the report does (`analysis_figures.plot_attention`).

The arguments, the run folder and the symbols are checked before torch is imported, so a refusal
is one line at once: `copytask: error: ...`, exit status 2.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from . import store
from .vocab import parse_symbols, symbol

SHADES = " ░▒▓█"  # attention weight 0, 0.25, 0.5, 0.75, 1 (each weight rounded to the nearest)
COPIED = "◂"  # after the cell of the source position an output step copies
WRONG = "^"


class DecodeError(ValueError):
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
    parser.add_argument("symbols", nargs="*", help="the source: symbols separated by spaces ('g d d c') or letters together (gddc)")
    parser.add_argument("--random", type=int, metavar="N", help="decode N random sequences instead")
    parser.add_argument("--length", type=int, metavar="L", help="with --random: their length, any length (default: the trained one)")
    parser.add_argument("--seed", type=int, default=0, help="with --random: the seed they are drawn from (default 0)")
    parser.add_argument("--png", type=Path, metavar="FILE", help="also draw the (first) sequence's attention as the report does")
    return parser


def read_run(folder: Path) -> DictConfig:
    """The resolved config of the run in `folder`; DecodeError unless it is a run folder with a checkpoint."""
    if not folder.is_dir():
        raise DecodeError(f"{str(folder)!r} is not a run folder: it does not exist")
    if not (folder / store.CONFIG).is_file():
        raise DecodeError(f"{str(folder)!r} is not a run folder (no {store.CONFIG}); give one that train or sweep wrote, runs/<name>")
    if not (folder / store.CHECKPOINT).is_file():
        raise DecodeError(f"{str(folder)!r} has no {store.CHECKPOINT}: its training has not finished, or it failed")
    return OmegaConf.load(folder / store.CONFIG)


def alignment_lines(source: list[str], output: list[str], target: list[str]) -> list[str]:
    """Input, output and target symbols in columns (each as wide as its widest symbol), then a line
    with `^` under every output symbol that differs from the target."""
    widths = [max(len(cells[i]) for cells in (source, output, target) if i < len(cells)) for i in range(len(target))]

    def line(name: str, cells: list[str]) -> str:
        return (f"{name:<8}" + " ".join(cell.ljust(width) for cell, width in zip(cells, widths))).rstrip()

    marks = [(WRONG if out != want else " ") for out, want in zip(output, target)]
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


def main(args: list[str]) -> int:
    """`python -m copytask decode ...`; returns the exit status (2: a refusal, in one line)."""
    try:
        options = parser().parse_args(args)
    except SystemExit as done:  # --help
        return done.code or 0
    except DecodeError as error:
        return _refuse(error)
    try:
        cfg = read_run(options.run_dir)
        text = " ".join(options.symbols)
        if text.strip() and options.random is not None:
            raise DecodeError("give symbols or --random N, not both")
        if options.random is None:
            if options.length is not None:
                raise DecodeError("--length goes with --random; the length of given symbols is their number")
            sequences = [parse_symbols(text, cfg.task.vocab_size)]
        else:
            sequences = None
            for name, value in (("--random", options.random), ("--length", options.length)):
                if value is not None and value < 1:
                    raise DecodeError(f"{name} must be at least 1, got {value}")
    except ValueError as error:  # DecodeError, and parse_symbols' refusals
        return _refuse(error)
    return decode(options, cfg, sequences)


def _refuse(error: Exception) -> int:
    print(f"copytask: error: {error}", file=sys.stderr)
    return 2


def decode(options: argparse.Namespace, cfg: DictConfig, sequences: list[list[int]] | None) -> int:
    """Decode `sequences` (token ids), or `options.random` random ones, and print each (see the module)."""
    import torch  # here, not at import: the checks above answer without it

    from .analysis import copied_source_positions, head_weights, load_run
    from .data import make_batch, task_batch
    from .train import sequence_scores

    task, vocab_size = cfg.task.name, cfg.task.vocab_size
    try:
        _, model = load_run(options.run_dir, device="cpu")  # a few sequences: the CPU is quick enough
    except (OSError, RuntimeError, KeyError, ValueError, EOFError, pickle.UnpicklingError) as error:
        return _refuse(DecodeError(f"cannot load {options.run_dir / store.CHECKPOINT}: {type(error).__name__}: {error}"))
    if sequences is None:
        length = options.length or cfg.task.length
        batch = make_batch(task, options.random, length, vocab_size, torch.Generator().manual_seed(options.seed))
    else:
        batch = task_batch(task, torch.tensor(sequences), torch.tensor([len(sequences[0])]))
    tokens, weights = model.greedy(batch.src, batch.src_lengths, steps=batch.tgt_out.size(1))  # weights: mean over heads
    attention = model.attention
    heads = attention.heads if attention is not None else 1
    maps = head_weights(model, batch) if heads > 1 else (weights[:, None] if weights is not None else None)  # (B, heads, T_dec, T_enc)
    hits, symbols, exact = sequence_scores(tokens, batch)

    trained = f"{cfg.task.min_length}-{cfg.task.length}" if cfg.task.get("variable_length") else cfg.task.length
    print(f"{options.run_dir.name}: {store.attention_label(cfg.attention.name, heads)}, task {task}, trained at length {trained}")
    if attention is None:
        print("no attention (attention=none): no heatmap")
    else:
        which = f"one map per head ({heads} heads)" if heads > 1 else "the model's attention"
        print(f"attention: {which}; rows output steps, columns source positions; shade = weight "
              f"('{SHADES[0]}' 0, {SHADES[1]} 0.25, {SHADES[2]} 0.5, {SHADES[3]} 0.75, {SHADES[4]} 1); {COPIED} the copied position")
    for i in range(len(batch)):
        source, output, target = (
            [symbol(t, vocab_size) for t in row.tolist()] for row in (batch.src[i], tokens[i], batch.tgt_out[i])
        )
        print()
        print("\n".join(alignment_lines(source, output, target)))
        print(f"token accuracy {int(hits[i])}/{int(symbols[i])} ({100 * hits[i] / symbols[i]:.1f}%), "
              f"sequence {'right' if exact[i] else 'wrong'}")
        if maps is None:
            continue
        copied = copied_source_positions(task, len(source))
        for head in range(heads):
            if heads > 1:
                print(f"head {head}")
            print("\n".join(text_heatmap(maps[i, head].tolist(), source, output, copied)))
    if len(batch) > 1:
        print(f"\nover the {len(batch)} sequences: token accuracy {100 * hits.sum() / symbols.sum():.1f}%, "
              f"{int(exact.sum())} of {len(batch)} sequences right")
    if options.png is not None and maps is not None:
        from .analysis_figures import plot_attention

        sample = {"source": batch.src[0].tolist(), "target": batch.tgt_out[0].tolist(), "output": tokens[0].tolist(),
                  "weights": (maps[0] if heads > 1 else maps[0, 0]).tolist()}  # fmt: skip
        title = f"{store.attention_label(cfg.attention.name, heads)}, greedy (token acc {100 * hits[0] / symbols[0]:.1f}%)"
        print(f"attention map: {plot_attention(sample, vocab_size, task, title, options.png)}")
    elif options.png is not None:
        print("no attention map to draw: the model has no attention")
    return 0

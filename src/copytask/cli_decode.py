"""`python -m copytask decode RUN_DIR SYMBOLS | --random N [--length L] [--beam K]`: the command line's
part of decode, over `api.decode` (`evaluation.decode` returns the values this prints).

For each sequence it prints its input (selective copying's noise as `_`), output (up to its first EOS) and
target aligned, `^` under every wrong output symbol, its token accuracy, and the attention as a text heatmap
(`text_heatmap`): one map per head for a multi-head model, else the model's one map. `--png FILE` draws the
first sequence's map as the report does (`figures.plot_attention`).

The arguments, the run folder and the symbols are checked before torch is imported, so a refusal
is one line at once: `copytask: error: ...`, exit status 2.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from . import api, store
from .config.schema import MAX_BEAM
from .console import TERMINAL_WIDTH, refuse
from .evaluation.decode import Decoded, DecodeError
from .families import family_of

SHADES = " ░▒▓█"  # attention weight 0, 0.25, 0.5, 0.75, 1 (each weight rounded to the nearest)
COPIED = "◂"  # after the cell of the source position an output step copies
WRONG = "^"


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


def alignment_lines(source: list[str], output: list[str], target: list[str]) -> list[str]:
    """Input, output and target symbols in columns, then a line with `^` under every output symbol that
    differs from the target, and under every target symbol an output that ended early did not reach. A
    column is as wide as its widest symbol but a line's last, which nothing follows: an output's EOS
    (`</s>`) hangs past its column rather than widening it and opening a gap in the lines above and below.
    Where the target is not the source's length (selective copying: its content symbols), the input is a
    line of its own, and output and target are aligned with each other."""
    aligned = (source, output, target) if len(target) == len(source) + 1 else (output, target)
    widths = [max([1, *(len(cells[i]) for cells in aligned if i < len(cells) - 1)]) for i in range(len(target))]

    def line(name: str, cells: list[str]) -> str:
        return (f"{name:<8}" + " ".join(cell.ljust(width) for cell, width in zip(cells, widths))).rstrip()

    marks = [WRONG if i >= len(output) or output[i] != want else " " for i, want in enumerate(target)]
    first = line("input", source) if len(aligned) == 3 else f"{'input':<8}" + " ".join(source)
    return [first, line("output", output), line("target", target), line("", marks)]


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
        return refuse(error)
    try:
        decoded = api.decode(
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
    heading = f"{decoded.run}: {label}, task {task}, trained at length {trained}{search}"
    # the run's name whole, to be copied (breaking at its hyphens would split it)
    print(textwrap.fill(heading, TERMINAL_WIDTH, break_long_words=False, break_on_hyphens=False))
    if weights is None:
        chosen = family_of(cfg).option(cfg)
        print(f"no attention ({chosen}): no heatmap")
    else:
        which = f"one map per head ({heads} heads)" if heads > 1 else "the model's attention"
        print(f"attention: {which}; rows output steps, columns source positions;")
        print(
            f"shade = weight ('{SHADES[0]}' 0, {SHADES[1]} 0.25, {SHADES[2]} 0.5, {SHADES[3]} 0.75, {SHADES[4]} 1); "
            f"{COPIED} the copied position"
        )
    from .data.batches import copied_source_positions

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
        length = int(decoded.lengths[i])
        copied = copied_source_positions(task, decoded.source[i, :length].tolist(), cfg.task.vocab_size)
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
        from .figures import plot_attention

        sample = {"source": decoded.source[0].tolist(), "target": decoded.target[0].tolist(),
                  "output": decoded.output[0].tolist(),
                  "weights": (weights[0] if heads > 1 else weights[0, 0]).tolist()}  # fmt: skip
        decoding = f"beam {decoded.beam}" if decoded.beam > 1 else "greedy"
        title = f"{label}, {decoding} (token acc {100 * decoded.hits[0] / decoded.symbols[0]:.1f}%)"
        print(f"attention map: {plot_attention(sample, cfg.task.vocab_size, task, title, png)}")
    elif png is not None:
        print("no attention map to draw: the model has no attention")

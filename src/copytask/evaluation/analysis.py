"""Evidence beyond the heatmap, computed from finished run folders (evaluation only, never training).

- Counterfactual attention (Jain and Wallace, 2019): greedy token accuracy with the model's own
  weights, and with its weights replaced after the softmax by uniform weights over the valid
  positions, by its own weights permuted among the valid positions, or by all weight on one fixed
  position. The drop from its own accuracy says how much the output depends on *where* it attends.
- Alignment: how often the attention argmax at an output step lands on the source position being
  copied at that step, and the mean weight on that position (selective copying: the position of the
  t-th content symbol, so a hit is attention that skips the noise to it).
- Length generalisation: a model evaluated on fixed-length held-out sets at other lengths.
- Per-length accuracy: a model evaluated on one mixed-length set (padding and masks in place),
  its accuracy grouped by each sequence's length; the curve of a variable-length model.

Every set scored here is held out (`splits.heldout_at_length`): no sequence of it was in the run's
training batches (replayed from its seed) or in its validation set. Where a length has fewer such
sequences than asked, its row says how many it was scored on (and a length with none is not
scored), and a variable-length run records how holding sequences out changed its training's
length mix (`splits.training_length_mix`). Outputs are scored up to their first EOS
(`scoring.sequence_scores`), also the alignment: steps after an output's end are not counted.

Step convention: row t of the attention weights (B, T_dec, T_enc) is the attention used to produce
output token t in greedy decoding. Bahdanau computes it from the state before the step, s_{t-1},
Luong from the state after it, s_t; either way it serves output token t, so the source position
being copied at row t is t for copy, length - 1 - t for reverse and the t-th content symbol's for
selective copying (`batches.copied_positions`). The EOS row is not scored.

A length its task does not draw (selective copying's k or fewer positions) is not scored: its row says so.

`analyze(folders)` writes `analysis.json` into each complete run folder (derived data, the only
file besides training's own that may be added to a run folder): the sweep calls it on its grid's
runs before the report, `python -m copytask analyze` on every run in runs_dir.
`reporting.analysis_tables` turns the files into tables for printing and for the report.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig
from torch import Tensor
from tqdm.auto import tqdm

from .. import console, store
from ..data.batches import Batch, copied_positions
from ..data.scoring import accuracy, output_mask, sequence_scores
from ..data.splits import (
    copied,
    heldout_at_length,
    sequence_count,
    test_batch,
    training_length_mix,
    unscorable,
)
from ..models.attention import Attention, Intervention
from ..models.build import Model
from ..models.greedy import evaluate
from ..store.provenance import ANALYSIS_COMPUTATION, computed_elsewhere, provenance
from ..training.devices import resolve_device, run_settings, torch_threads
from . import COUNTERFACTUALS
from .breakdown import Settings, measure
from .load import load_run

FIXED_POSITION = 0  # the `fixed` counterfactual puts all weight here (always a valid position)
PER_LENGTH_SIZE = 64  # held-out sequences per length in the per-length evaluation


# --- counterfactual weights: (weights (B, N, T_enc), mask (B, T_enc)) -> (B, N, T_enc) ------------
# N is every (head, step) row the attention computes at once; each row is replaced on its own.


def uniform_weights(weights: Tensor, mask: Tensor) -> Tensor:
    """Equal weight on every valid position of each row, zero on padding."""
    uniform = mask.to(weights.dtype) / mask.sum(-1, keepdim=True)  # (B, T_enc)
    return uniform[:, None, :].expand_as(weights)


def permuted_weights(generator: torch.Generator) -> Intervention:
    """An intervention that shuffles each row's weights among its valid positions: the row keeps
    its values (so its sum) and padding keeps zero weight (so its support)."""

    def permute(weights: Tensor, mask: Tensor) -> Tensor:
        valid = mask[:, None, :].expand_as(weights)  # (B, N, T_enc)
        inf = torch.tensor(float("inf"), device=weights.device)
        # Both orders list the valid positions first: `source` in random order, `target` in order.
        keys = torch.rand(weights.shape, generator=generator).to(weights.device)
        source = torch.where(valid, keys, inf).argsort(-1)
        positions = torch.arange(weights.size(-1), device=weights.device, dtype=keys.dtype).expand_as(keys)
        target = torch.where(valid, positions, inf).argsort(-1)
        return torch.zeros_like(weights).scatter(-1, target, weights.gather(-1, source))

    return permute


def fixed_weights(weights: Tensor, mask: Tensor) -> Tensor:
    """All weight on FIXED_POSITION (on the last valid position of a shorter sequence)."""
    last = mask.sum(-1) - 1  # (B,) masks are prefixes: the last valid position
    position = last.clamp(max=FIXED_POSITION)
    one_hot = torch.nn.functional.one_hot(position, mask.size(-1)).to(weights.dtype)  # (B, T_enc)
    return one_hot[:, None, :].expand_as(weights)


@contextmanager
def intervention(attention: Attention, replace: Intervention) -> Iterator[None]:
    """Apply `replace` to the attention weights inside the `with` block."""
    attention.intervention = replace
    try:
        yield
    finally:
        attention.intervention = None


def counterfactual_accuracy(model: Model, batch: Batch, seed: int = 0) -> dict[str, float]:
    """Greedy token accuracy on `batch` under each counterfactual in COUNTERFACTUALS. The replaced
    weights act at every decoding step, so later steps see the consequences of earlier ones, and in
    every attention of the model (`model.attentions`: a Transformer's every cross-attention layer)."""
    replacements = {
        "uniform": uniform_weights,
        "permuted": permuted_weights(torch.Generator().manual_seed(seed)),
        "fixed": fixed_weights,
    }
    accuracy = {}
    for name, replace in replacements.items():
        with ExitStack() as stack:
            for attention in model.attentions:
                stack.enter_context(intervention(attention, replace))
            accuracy[name] = evaluate(model, batch, need_weights=False)["token_acc"]
    return accuracy


# --- alignment ---------------------------------------------------------------------------------


def alignment(weights: Tensor, tokens: Tensor, batch: Batch, task: str, vocab_size: int) -> dict[str, float]:
    """weights (B, T_dec, T_enc) and output `tokens` (B, T_dec) from greedy decoding on `batch` (of `task` over
    `vocab_size` content symbols) -> over all content output steps before the output's end (its first EOS),
    `hit`: the fraction whose attention argmax is the copied position, `mass`: the mean weight on it,
    `adjacent`: the fraction whose argmax is a neighbour of it. With a bidirectional encoder the state next
    to a symbol also carries that symbol, and trained models do attend there."""
    target = copied_positions(task, batch, vocab_size, weights.size(1))  # (B, T_dec)
    content = batch.content_mask & output_mask(tokens)  # (B, T_dec) output steps that copy a symbol
    distance = (weights.argmax(-1) - target).abs()[content]
    mass = weights.gather(-1, target[..., None]).squeeze(-1)[content]
    return {
        "hit": (distance == 0).float().mean().item(),
        "mass": mass.mean().item(),
        "adjacent": (distance == 1).float().mean().item(),
    }


def head_weights(model: Model, batch: Batch) -> Tensor:
    """Each head's weights in greedy decoding: -> (B, heads, T_dec, T_enc), T_dec = batch's target length."""
    attention = model.attention
    recorded = []

    def record(weights: Tensor, mask: Tensor) -> Tensor:  # rows are (head, step), head-major
        recorded.append(weights.view(weights.size(0), attention.heads, -1, weights.size(-1)))
        return weights

    with intervention(attention, record):
        model.greedy(batch.src, batch.src_lengths, batch.tgt_out.size(1), need_weights=False)  # the hook has them
    return torch.cat(recorded, dim=2)


# --- accuracy across lengths ---------------------------------------------------------------------


def length_generalisation(
    model: Model, cfg: DictConfig, lengths: list[int], eval_size: int | None = None, seen: set[bytes] | None = None
) -> list[dict]:
    """Greedy accuracy at each test length on `eval_size` (None: train.eval_size) held-out sequences of
    that length (`splits.heldout_at_length`; `seen`: the run's `splits.unscorable` sequences, needed
    at a length it trains at). Each row says how many sequences it was `scored` on; a length with fewer
    held-out sequences than asked gets a `note`, one with none no accuracy (None). A model with
    learned positions is not defined past its table: such a length gets no accuracy and a note
    saying why, never a number from positions it does not have."""
    device, rows = next(model.parameters()).device, []
    longest, size = model.longest_source, eval_size or cfg.train.eval_size
    for length in lengths:
        if longest is not None and length > longest:
            note = f"not defined: the learned position table covers lengths up to {longest} (model.max_length)"
            rows.append({"test_length": length, "token_acc": None, "seq_acc": None, "scored": 0, "note": note})
            continue
        if not sequence_count(cfg, length):
            note = f"not defined: task {cfg.task.name} with task.copied={copied(cfg)} has no source of length {length}"
            rows.append({"test_length": length, "token_acc": None, "seq_acc": None, "scored": 0, "note": note})
            continue
        batch, available = heldout_at_length(cfg, length, size, seen)
        row = {"test_length": length, "token_acc": None, "seq_acc": None, "scored": available}
        if available < size:
            row["note"] = held_out_note(cfg, length, available, size)
        if available:
            result = evaluate(model, batch.to(device), need_weights=False)
            row |= {"token_acc": result["token_acc"], "seq_acc": result["seq_acc"]}
        rows.append(row)
    return rows


def held_out_note(cfg: DictConfig, length: int, available: int, size: int) -> str:
    """Why a length is scored on fewer than `size` sequences (or not at all) in the run `cfg`'s task."""
    scored = f"scored on {available} sequences" if available else "not scored"
    return (
        f"{scored}: only {available} of the {sequence_count(cfg, length):,} sequences of length {length} are "
        f"neither trained on nor in the validation set (asked for {size})"
    )


def accuracy_by_length(batch: Batch, tokens: Tensor) -> pd.DataFrame:
    """Greedy output `tokens` (B, T_dec) for `batch` -> one row per source length present:
    count, token accuracy (content positions) and exact-sequence accuracy (EOS included)."""
    scores = sequence_scores(tokens, batch)
    per_sequence = pd.DataFrame(
        {"length": batch.src_lengths.tolist(), "hits": scores.hits.tolist(), "symbols": scores.symbols.tolist(),
         "exact": scores.exact.tolist()}
    )  # fmt: skip
    grouped = per_sequence.groupby("length")
    table = grouped.agg(
        count=("exact", "size"), hits=("hits", "sum"), symbols=("symbols", "sum"), seq_acc=("exact", "mean")
    )
    table["token_acc"] = table.hits / table.symbols
    return table.reset_index()[["length", "count", "token_acc", "seq_acc"]]


def per_length_batch(cfg: DictConfig, seen: set[bytes], per_length: int = PER_LENGTH_SIZE) -> tuple[Batch, list[str]]:
    """A mixed-length held-out set for a variable-length run: up to `per_length` held-out sequences
    of each length in [min_length, length] (`splits.heldout_at_length`; `seen`: the run's
    `splits.unscorable` sequences), padded to `length` and shuffled, so every decoding chunk mixes lengths and runs
    through the masks as in training. -> the batch and a note for each length with fewer."""
    task, parts, notes = cfg.task, [], []
    for length in range(task.min_length, task.length + 1):
        batch, available = heldout_at_length(cfg, length, per_length, seen)
        if available < per_length:
            notes.append(held_out_note(cfg, length, available, per_length))
        if available:
            parts.append(batch)
    whole = Batch.concat(parts, task.length)
    order = torch.randperm(len(whole), generator=torch.Generator().manual_seed(cfg.train.eval_seed))
    return whole.select(order), notes


def per_length_accuracy(model: Model, batch: Batch) -> pd.DataFrame:
    """Greedy accuracy on a mixed-length `batch`, one row per length (see `accuracy_by_length`)."""
    batch = batch.to(next(model.parameters()).device)
    return accuracy_by_length(batch, evaluate(model, batch, need_weights=False)["tokens"])


# --- run folders ---------------------------------------------------------------------------------


def analyze_run(
    folder: Path,
    lengths: list[int],
    eval_size: int | None = None,
    device: str = "auto",
    settings: Settings = Settings(),
) -> dict:
    """Everything above for one run folder, on `device`, and where its accuracy is lost (`breakdown`, with
    `settings`) -> the content of its analysis.json. Fixed-length evaluations use the first `eval_size`
    sequences of the run's held-out set (None: all)."""
    model, cfg = load_run(folder, device)
    device = next(model.parameters()).device
    task = cfg.task
    # what its training drew (replayed) and its validation set, where an evaluation set could hold some
    steps = store.read_json(folder / store.METRICS)["steps"]  # the training batches it drew
    seen = unscorable(cfg, steps) if task.variable_length else None
    analysis = {
        "run": folder.name,
        "attention": store.model_label(cfg),
        "task": task.name,
        "length": task.length,
        "min_length": task.min_length if task.variable_length else task.length,
        "seed": cfg.seed,
        "eval_size": eval_size,
        "device": device.type,
        **provenance(ANALYSIS_COMPUTATION, cfg),
        "length_generalisation": length_generalisation(model, cfg, lengths, eval_size, seen),
    }
    if task.variable_length:
        batch, notes = per_length_batch(cfg, seen)
        per_length = per_length_accuracy(model, batch).rename(columns={"length": "test_length"})
        analysis["per_length"] = per_length.to_dict("records")
        analysis["per_length_notes"] = notes
        analysis["length_mix"] = training_length_mix(cfg)
    test = test_batch(cfg).to(device)
    greedy = evaluate(model, test)  # on the whole test set, as every reported greedy number; the weights: alignment
    analysis["breakdown"] = measure(model, cfg, test, greedy["tokens"], eval_size, steps, settings)
    if model.attention is None:
        return analysis
    # the counterfactuals and the alignment: on the first eval_size test sequences, greedy's rows of them
    heldout = test.select(slice(0, eval_size))
    t_dec, t_enc = heldout.tgt_out.size(1), heldout.src.size(1)
    tokens, weights = greedy["tokens"][: len(heldout), :t_dec], greedy["weights"][: len(heldout), :t_dec, :t_enc]
    scores = {"own": accuracy(tokens, heldout)["token_acc"], **counterfactual_accuracy(model, heldout, seed=cfg.seed)}
    analysis["counterfactual"] = scores
    analysis["drop"] = {name: scores["own"] - scores[name] for name in COUNTERFACTUALS}
    analysis["alignment"] = alignment(weights, tokens, heldout, task.name, task.vocab_size)
    if model.attention.heads > 1:
        first = heldout.select(slice(0, 1))  # trimmed to its own lengths: weights (1, heads, T_dec, L)
        analysis["head_weights"] = {
            "source": first.src[0].tolist(),
            "target": first.tgt_out[0].tolist(),
            "weights": store.rounded(head_weights(model, first)[0]),
        }
    return analysis


def is_analysed(
    folder: Path, lengths: list[int], eval_size: int | None, device: str = "cpu", settings: Settings = Settings()
) -> bool:
    """Whether `folder` has an analysis.json made by this code (it records ANALYSIS_COMPUTATION) with
    `eval_size` on `device` (cpu | cuda; one without a device was made on CPU) and the breakdown's
    `settings` that covers every test length."""
    try:
        done = store.read_json(folder / store.ANALYSIS)
        tested = {row["test_length"] for row in done["length_generalisation"]}
        same = done["breakdown"]["settings"] == settings.record() and done.get("computation") == ANALYSIS_COMPUTATION
    except (OSError, ValueError, KeyError, TypeError):  # none yet, from before the breakdown, or corrupt: (re)analyse
        return False
    return (
        same and tested >= set(lengths) and done.get("eval_size") == eval_size and done.get("device", "cpu") == device
    )


def reanalysed_line(folders: list[Path]) -> str | None:
    """Where analyses among `folders` were made by other code, the line that says how many are made
    again, and why; None where there are none."""
    recorded = []
    for folder in folders:
        try:
            done = store.read_json(folder / store.ANALYSIS)
        except (OSError, ValueError):  # none yet, or corrupt
            continue
        if isinstance(done, dict) and done.get("computation") != ANALYSIS_COMPUTATION:
            recorded.append(done.get("computation"))
    if not recorded:
        return None
    why = computed_elsewhere(recorded, ANALYSIS_COMPUTATION, ("analysis", "analyses"))
    return f"{len(recorded)} {'analysis' if len(recorded) == 1 else 'analyses'} made by other code ({why}): made again"


def _trained_length(folder: Path) -> int | None:
    """The length a complete run was trained at; None, with a warning naming the run, if its
    metrics.json is missing or unreadable (such a run is not analysed)."""
    if not store.is_complete(folder):
        return None
    try:
        return int(store.read_json(folder / store.METRICS)["length"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        console.warn(f"skipping {folder}: unreadable {store.METRICS}: {error}")
        return None


def analyze(
    folders: Iterable[Path],
    lengths: list[int] | None = None,
    eval_size: int | None = None,
    threads: int | None = 1,
    progress: bool = True,
    device: str = "auto",
    settings: Settings = Settings(),
) -> int:
    """Write analysis.json into each complete run folder in `folders`, with length generalisation
    at every length of `lengths` (default: the lengths the folders were trained at), the breakdown
    with `settings` (`evaluation.breakdown`), using
    `threads` torch CPU threads (None: torch's default), on `device` (`train.device`'s values;
    ConfigError if this machine has no such device). A run already analysed that way is
    skipped; a run whose analysis fails is named in a warning and the others go on. Returns how
    many runs were analysed now."""
    trained = {folder: length for folder in folders if (length := _trained_length(folder)) is not None}
    folders = list(trained)
    if lengths is None:
        lengths = sorted(set(trained.values()))
    device = resolve_device(device)
    if line := reanalysed_line(folders):
        console.log.info(line)
    analysed = 0
    with torch_threads(threads):
        for folder in tqdm(
            folders, desc="analyze", unit="run", disable=not progress, file=console.bar_stream(), dynamic_ncols=True
        ):
            if is_analysed(folder, lengths, eval_size, device.type, settings):
                continue
            try:
                with run_settings(device):
                    result = analyze_run(folder, lengths, eval_size, device.type, settings)
                store.write_json(folder / store.ANALYSIS, result)
                analysed += 1
            except Exception as error:  # noqa: BLE001 - one run's failure must not stop the others
                console.warn(f"analysis of {folder} failed: {type(error).__name__}: {error}")
    return analysed

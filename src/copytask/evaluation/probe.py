"""What the summary vector holds: a linear probe of it for each symbol the decoder must copy, in source order.

The summary vector is what a model hands its decoder of the source, flattened (`model.summary_state`):
a GRU decoder's initial state, all that the baseline's decoder sees of the source (the same vector
in the attention models). A linear map from it to one-hot symbols, one block of outputs per copied
symbol, is fitted by ridge regression in closed form (deterministic, no optimiser) and scored by its
argmax on the run's test set: accuracy by copied symbol, chance 1 / vocab_size.

Which symbols: those at the positions the task copies (`tasks`), in source order, the j-th label the
symbol at the j-th copied position. For copy and reverse every position is copied, so label j is the
symbol at source position j (accuracy by source position). For selective copying label j is the j-th
content symbol, wherever it sits among the noise: what the decoder needs to write its j-th output, not
the noise or where it lies (the vector may hold those too; this probe does not ask). The probe therefore
asks the same question of both tasks, whether the k symbols to be written can be read out, and its
accuracy by position reads by content symbol on selective copying.

The fitting sequences are drawn as the run's training batches are (its task, its lengths), from a
stream of their own (`analysis.probe_seed`), and none of them is a sequence the run has seen: every
one its training batches drew (replayed from its seed, for the steps it trained), its validation set
and its test set are drawn again. Where a length has too few such sequences, the probe is fitted on
those there are, and says so. The ridge penalty is chosen among `analysis.probe_ridges` by the
probe's accuracy on a quarter of the fitting sequences held out of the fit, then refitted on all.

A linear probe is a lower bound on what the vector holds: a symbol it cannot read may still be there
in a form a non-linear read-out (such as the decoder) gets at. Two controls, each for what it is:

- the untrained model: the same probe on the vector of the run's model before training (its initial
  weights, from the run's seed), as Conneau et al. (2018) read untrained encoders: the gap is what
  training put there, not what a probe reads out of any random encoding;
- a control task (Hewitt and Liang, 2019): the same probe on the trained vector, fitted to random
  labels, each (position, symbol) pair given a label drawn uniformly from the V symbols; selectivity is
  the task's accuracy minus the control task's. Drawn per pair, the labels merge symbols at a position
  (several get one label), so its chance is the commonest label's share at each position, above 1 / V.
  What it measures here is not what Hewitt and Liang's measures: least squares is linear in its targets
  and fits each output on its own, so at one penalty the probe's score for a control label is the sum
  of its scores for the symbols the label merges. The control task reads the
  task's own scores at a coarser, random grain; it can be right where the task is wrong and wrong where
  the task is right, so it is neither easier nor harder. Every control keyed on (position, symbol) is
  such a relabelling of the task, the symbol at each position: a bijective one (the task's chance) gives
  exactly the task's accuracy, selectivity 0 by construction, and a merging one this coarsening. So
  selectivity cannot tell what the vector holds from what the probe learns on this task; the untrained
  model is the control of what training put there.
"""

from __future__ import annotations

import hashlib

import torch
from omegaconf import DictConfig
from torch import Tensor

from ..console import ConfigError
from ..data.batches import Batch
from ..data.splits import draw_excluding, heldout_keys, sequence_count, training_sequences, unseen_at_length
from ..data.tasks import target_positions
from ..data.vocab import NUM_SPECIAL
from ..models.build import Model, build_model
from ..models.chunks import over_chunks

CHUNK = 1024  # sequences encoded at once
CHOICE_SHARE = 0.25  # of the fitting sequences: held out of the fit to choose the ridge penalty


def summary_vectors(model: Model, batch: Batch) -> Tensor:
    """What the model hands its decoder of each sequence of `batch` -> (B, S), float64."""
    return over_chunks(model, batch, CHUNK, lambda part: model.summary_state(part.src, part.src_lengths).double())


def source_labels(batch: Batch, task: str, vocab_size: int) -> tuple[Tensor, Tensor]:
    """The symbols `task` copies of each source of `batch`, in source order, as labels 0 .. V - 1 (see the
    module) -> labels (B, T) (0 past a target's length) and valid (B, T); T = T_enc for copy and reverse."""
    positions, target_lengths = target_positions(task, batch.src, batch.src_lengths, vocab_size)  # (B, T), (B,)
    valid = torch.arange(positions.size(1), device=positions.device) < target_lengths[:, None]
    in_order = positions.masked_fill(~valid, positions.size(1) + batch.src.size(1)).sort(1).values  # past: last
    labels = batch.src.gather(1, in_order.masked_fill(~valid, 0)) - NUM_SPECIAL
    return labels.masked_fill(~valid, 0), valid


def one_hot(labels: Tensor, valid: Tensor, classes: int) -> Tensor:
    """labels (B, T_enc) -> one-hot blocks, one per position, (B, T_enc * classes), float64; zero where not valid."""
    return (torch.nn.functional.one_hot(labels, classes).double() * valid[..., None]).flatten(1)


def ridge_path(features: Tensor, targets: Tensor, ridges: list[float]) -> list[tuple[Tensor, Tensor]]:
    """Ridge regression with an intercept, in closed form, at each penalty of `ridges` (> 0): features
    (N, S), targets (N, K) -> [(weights (S, K), bias (K,))] minimising |X W + b - Y|^2 / N + ridge |W|^2.
    One eigendecomposition of the centred Gram matrix serves every penalty."""
    mean_x, mean_y = features.mean(0), targets.mean(0)
    x, y = features - mean_x, targets - mean_y
    eigenvalues, eigenvectors = torch.linalg.eigh(x.T @ x / len(x))
    projected = eigenvectors.T @ (x.T @ y / len(x))  # (S, K)
    fits = []
    for ridge in ridges:
        weights = eigenvectors @ (projected / (eigenvalues.clamp(min=0) + ridge)[:, None])
        fits.append((weights, mean_y - mean_x @ weights))
    return fits


def position_accuracy(
    weights: Tensor, bias: Tensor, features: Tensor, labels: Tensor, valid: Tensor, classes: int
) -> list[float | None]:
    """The probe's argmax against each position's label: accuracy by position over the sequences
    that have it (None where none does)."""
    scores = (features @ weights + bias).view(len(features), -1, classes)  # (B, T_enc, classes)
    right = scores.argmax(-1) == labels
    hits, counts = (right & valid).sum(0), valid.sum(0)
    return [None if n == 0 else h / n for h, n in zip(hits.tolist(), counts.tolist())]


def mean_accuracy(accuracies: list[float | None]) -> float:
    scored = [value for value in accuracies if value is not None]
    return sum(scored) / len(scored)


def fit_probe(features: Tensor, labels: Tensor, valid: Tensor, classes: int, ridges: list[float]):
    """The probe of `features` (N, S) for `labels` (N, T_enc): the penalty of `ridges` whose fit on all
    but the first CHOICE_SHARE of the sequences reads those best (mean accuracy over positions; the
    larger penalty of a tie), refitted on all -> (weights, bias, ridge)."""
    held = max(1, int(len(features) * CHOICE_SHARE))
    targets = one_hot(labels, valid, classes)
    fits = ridge_path(features[held:], targets[held:], ridges)
    choice = [
        mean_accuracy(position_accuracy(w, b, features[:held], labels[:held], valid[:held], classes)) for w, b in fits
    ]
    best = max(range(len(ridges)), key=lambda i: (choice[i], ridges[i]))
    (weights, bias), *_ = ridge_path(features, targets, [ridges[best]])
    return weights, bias, ridges[best]


def probe_stream(seed: int, purpose: str) -> torch.Generator:
    """A generator of the probe's own for `purpose` ("fitting set", "control task"): `seed` hashed with
    it, so that no run's own streams (its `seed`, train.val_seed, train.eval_seed) draw the same numbers."""
    digest = hashlib.sha256(f"copytask probe {purpose} {seed}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def fitting_set(cfg: DictConfig, size: int, seed: int, steps: int) -> tuple[Batch, str | None]:
    """Up to `size` sequences drawn as the run's training batches are (its task, its lengths) from
    `probe_stream(seed)`, none of them in its first `steps` training batches, its validation set or its
    test set -> the batch and, where fewer than `size` such sequences exist, a note saying so."""
    test, validation, heldout = heldout_keys(cfg)
    seen = training_sequences(cfg, steps, heldout) | heldout
    task = cfg.task
    if task.variable_length:
        try:
            return draw_excluding(cfg, size, probe_stream(seed, "fitting set"), seen, "probe's fitting set"), None
        except ConfigError:
            raise ConfigError(
                f"the probe's fitting set: too few sequences of task.length={task.min_length}-{task.length} that the "
                f"run has not seen to draw {size}; lower analysis.probe_size"
            ) from None
    stream = probe_stream(seed, "fitting set")
    batch, available = unseen_at_length(cfg, task.length, size, stream, seen, "probe's fitting set")
    if available == size:
        return batch, None
    return batch, (
        f"fitted on {available} sequences: only {available} of the {sequence_count(cfg, task.length):,} sequences "
        f"of length {task.length} are in none of the run's training batches, validation or test set "
        f"(asked for {size})"
    )


def untrained(cfg: DictConfig) -> Model:
    """The run's model before training: built on the CPU from its seed, as training builds it, with
    the caller's random state put back."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(cfg.seed)
        return build_model(cfg).eval()


def control_labels(cfg: DictConfig, seed: int, slots: int) -> Tensor:
    """The control task's labels (Hewitt and Liang, 2019): (slots, V), entry [i, s] the label of symbol s
    as the i-th copied symbol (the symbol at source position i for copy and reverse, whose `slots` are
    task.length), drawn uniformly from the V symbols (so symbols share labels: see the module)."""
    vocab_size = cfg.task.vocab_size
    return torch.randint(vocab_size, (slots, vocab_size), generator=probe_stream(seed, "control task"))


def probe_summary(
    model: Model, cfg: DictConfig, test: Batch, size: int, ridges: list[float], seed: int, steps: int
) -> dict | None:
    """The probe of the summary vector of `model` (trained) and of the run's untrained model for the
    source symbols, and of the trained one for the control task's labels, each fitted on
    `fitting_set(cfg, size, seed, steps)` and scored on `test` -> {"trained", "untrained", "control":
    accuracy by source position, "chance", "control_chance" (by position), "ridge" (each one's penalty),
    "fit_size", "scored", "note" (where fewer sequences than asked)}; None for a model without a summary
    vector (the Transformer)."""
    if not hasattr(model, "summary_state"):
        return None
    device, vocab_size = test.src.device, cfg.task.vocab_size
    fitting, note = fitting_set(cfg, size, seed, steps)
    fitting = fitting.to(device)
    (fit_labels, fit_valid), (test_labels, test_valid) = (
        source_labels(batch, cfg.task.name, vocab_size) for batch in (fitting, test)
    )
    control = control_labels(cfg, seed, fit_labels.size(1)).to(device)

    def relabelled(labels: Tensor) -> Tensor:  # (B, T_enc): each position's symbol -> its control label
        return control[torch.arange(labels.size(1), device=device), labels]

    trained = summary_vectors(model, fitting), summary_vectors(model, test)
    baseline = untrained(cfg).to(device)
    probes = {  # name -> (fitting and test features, fitting and test labels)
        "trained": (trained, (fit_labels, test_labels)),
        "untrained": ((summary_vectors(baseline, fitting), summary_vectors(baseline, test)), (fit_labels, test_labels)),
        "control": (trained, (relabelled(fit_labels), relabelled(test_labels))),
    }
    result = {"chance": 1 / vocab_size, "fit_size": len(fitting), "scored": len(test), "ridge": {}}
    for name, ((fit_features, test_features), (fit_on, score_on)) in probes.items():
        weights, bias, ridge = fit_probe(fit_features, fit_on, fit_valid, vocab_size, ridges)
        result[name] = position_accuracy(weights, bias, test_features, score_on, test_valid, vocab_size)
        result["ridge"][name] = ridge
    counts = torch.nn.functional.one_hot(control, vocab_size).sum(1)  # (T_enc, V): symbols given each label
    result["control_chance"] = (counts.max(-1).values / vocab_size).tolist()
    if note:
        result["note"] = note
    return result

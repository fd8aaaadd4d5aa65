"""One training run: validate the config, train with teacher forcing, evaluate by greedy decoding
on the validation set at every evaluation (the history, early stopping), score the test set once at
the end (every reported number), and write the run folder (config, history, checkpoint, attention
samples, and metrics.json last)."""

from __future__ import annotations

import io
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm.auto import tqdm

from .. import store
from ..config.checks import validate
from ..config.schema import flatten
from ..data.batches import Batch
from ..data.splits import heldout_keys, training_batch
from ..data.vocab import PAD
from ..families import family_of
from ..kernels.ops import runs_fused
from ..models.build import build_model, check_buildable
from ..models.greedy import evaluate
from ..models.recurrent import count_parameters
from ..store import replacement
from ..store.provenance import provenance, reused
from . import checkpoints, trackers
from .devices import host, resolve_device, run_settings, torch_state
from .optimizer import FlatAdam, adam, lr_schedule


class NonFiniteLoss(FloatingPointError):
    """The training loss became NaN or inf: the run diverged; the message names the run and step."""


class RunInProgress(RuntimeError):
    """Another process is training this run now (it holds the run's lock); the message names the run."""


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, clip: float) -> torch.Tensor:
    """One teacher-forced update: cross-entropy over the real target positions, gradient norm
    clipped to `clip`. -> the loss, detached (no host sync, so a GPU step stays asynchronous)."""
    logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)  # (B, T_dec, V)
    loss = F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if isinstance(optimizer, FlatAdam):
        optimizer.clip_grad_norm_(clip)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.detach()


def train(cfg: DictConfig, model_class: type[nn.Module] | None = None) -> dict:
    """Train one run and write its folder; returns metrics.json's content. A run whose complete
    results already exist is read, not trained again, unless `retrain=true`, it was computed by other
    code (it records another `computation`, or none), or a retraining of it was stopped (it goes on).
    Then the new run trains in a staging folder beside the old one (`store.replacement`), which every
    reader still finds, whole, until the new results are complete and take its place in one step.
    An interrupted run, or retraining, continues from its checkpoint. Raises RunInProgress if another
    process is training the run now, NonFiniteLoss if it diverges. Torch's thread count and random
    state are as they were when it returns. `model_class`: see `build.build_model` (None: the family's class)."""
    validate(cfg)
    check_buildable(cfg)
    folder = store.run_dir(cfg)
    lock = store.lock_run(folder)
    if lock is None:
        raise RunInProgress(f"{folder.name}: being trained by another process (it holds {store.lock_path(folder)})")
    with lock:  # it covers the run's staging folder too
        replacement.settle(folder)  # what a killed process left half done
        retrain = cfg.get("retrain", False)
        if reused(folder, retrain):
            return store.read_json(folder / store.METRICS)
        replacing = store.is_complete(folder)
        target = replacement.begin(folder) if replacing else folder
        if not store.is_complete(target):  # a replacement complete before a kill only takes its place
            if target.exists():  # an interrupted or failed run: no one else writes here while we hold the lock
                clear_leftovers(target, keep_checkpoint=replacing or not retrain)
            train_into(cfg, target, model_class)
        if replacing:
            replacement.swap(folder)
        return store.read_json(folder / store.METRICS)


def train_into(cfg: DictConfig, folder: Path, model_class: type[nn.Module] | None) -> None:
    """Train the run of `cfg` in `folder` (its run folder, or its replacement's staging folder), from
    the checkpoint there if any, and write metrics.json last."""
    device = resolve_device(cfg.train.device)
    with (
        trackers.open_run(cfg, store.run_name(cfg)) as tracker,  # it closes before the run is complete
        torch_state(cfg.train.threads, device),
        run_settings(device),
    ):
        try:
            metrics = _train_locked(cfg, folder, device, model_class, tracker)
        except checkpoints.UnusableCheckpoint:  # set aside: from step 0, with everything built afresh
            metrics = _train_locked(cfg, folder, device, model_class, tracker)
    store.write_json(folder / store.METRICS, metrics)  # last: marks the run complete
    (folder / store.RESUME).unlink(missing_ok=True)  # a complete run never resumes


def clear_leftovers(folder: Path, keep_checkpoint: bool) -> None:
    """Empty the folder of an interrupted or failed run but for its checkpoint (with
    `keep_checkpoint`, to continue from it), a checkpoint set aside as unreadable, and the mark of a
    replacement's staging folder."""
    keep = {store.UNREADABLE_RESUME, replacement.MARK} | ({store.RESUME} if keep_checkpoint else set())
    for path in folder.iterdir():
        if path.name not in keep:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def summary_line(metrics: dict, folder: Path) -> str:
    """The one line the command line prints for a finished run."""
    return (
        f"{metrics['run']}: greedy token acc {metrics['token_acc']:.2%} (chance {metrics['chance']:.1%} per token), "
        f"seq acc {metrics['seq_acc']:.2%}, {metrics['steps']} steps, {metrics['train_seconds']:.1f} s, "
        f"{metrics['params']:,} params"
        + (f", resumed from step {metrics['resumed_from']}" if metrics.get("resumed_from") else "")
        + f" -> {folder}"
    )


@dataclass
class Run:
    """One run's objects and where it stands: what the training loop advances and a checkpoint saves."""

    cfg: DictConfig
    folder: Path
    device: torch.device
    tracker: trackers.RunLogger
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    generator: torch.Generator  # the training batches' draws
    excluded: set[bytes]  # what `training_batch` leaves out: the keys of every test and validation sequence
    test: Batch
    validation: Batch
    fused: bool  # the model runs in the C++ kernels
    provenance: dict  # what made the run (`store.provenance`): code, libraries, `computation`
    step: int = 0  # the last step trained
    history: list[dict] = field(default_factory=list)  # one entry per evaluation: what history.csv holds
    hits: int = 0  # evaluations in a row at the target accuracy (early stopping)
    resumed_from: int = 0  # the step this run continued from after an interruption (0: trained in one go)
    started: float = 0.0  # the clock's zero (time.perf_counter): earlier than now for a resumed run

    @property
    def name(self) -> str:
        """The run's name: its folder's, also while it trains in a replacement's staging folder."""
        return store.run_name(self.cfg)

    def checkpoint(self) -> None:
        """Save all the run needs to go on from its current step: the objects' state and where it stands."""
        seconds = time.perf_counter() - self.started
        progress = {"step": self.step, "history": self.history, "hits": self.hits, "seconds": seconds}
        objects = self.model, self.optimizer, self.schedule, self.generator
        checkpoints.save(self.folder, self.cfg, progress, *objects, self.device)


def _train_locked(
    cfg: DictConfig,
    folder: Path,
    device: torch.device,
    model_class: type[nn.Module] | None,
    tracker: trackers.RunLogger,
) -> dict:
    """`train`'s work, in `folder` (new, or holding the checkpoint of an interrupted run, from which
    it continues), under the run's lock: every file but metrics.json, whose content it returns.
    `tracker` gets what the folder gets. UnusableCheckpoint for a checkpoint that does not fit the run."""
    run = set_up(cfg, folder, device, model_class, tracker)
    resume(run)
    training_loop(run)
    return finish(run)


def set_up(
    cfg: DictConfig,
    folder: Path,
    device: torch.device,
    model_class: type[nn.Module] | None,
    tracker: trackers.RunLogger,
) -> Run:
    """The run's folder with its config, and its objects built afresh from the seed: the model, the
    optimizer, its schedule, the training generator and the test and validation sets."""
    folder.mkdir(parents=True, exist_ok=True)
    store.atomic_write(folder / store.CONFIG, OmegaConf.to_yaml(cfg, resolve=True))
    # the model's initialisation (on the CPU) and, on a GPU, its own draws (`torch_state` puts the caller's state back)
    torch.random.default_generator.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    model = build_model(cfg, model_class).to(device)
    made_by = provenance(config=cfg)
    tracker.log_params(store.flat_identity(cfg) | flatten(made_by))  # own_code by kind: own_code.model, ...
    fused = runs_fused(model)  # loads the kernels (builds them on first use) before the clock starts
    test, validation, excluded = heldout_keys(cfg)  # training draws again every sequence of either
    test, validation = test.to(device), validation.to(device)
    optimizer = adam(model, cfg.train.lr, device)
    schedule = lr_schedule(optimizer, cfg.train)
    return Run(
        cfg, folder, device, tracker, model, optimizer, schedule, generator, excluded, test, validation, fused, made_by
    )


def resume(run: Run) -> None:
    """Continue from the folder's checkpoint, if it holds one of this run, and start the clock (a
    resumed run's goes on from its checkpoint)."""
    progress = {"step": 0, "history": [], "hits": 0, "seconds": 0.0}
    if (state := checkpoints.load(run.folder, run.cfg)) is not None:
        objects = run.model, run.optimizer, run.schedule, run.generator
        progress = checkpoints.restore(state, *objects, run.device, run.folder)
    run.step = run.resumed_from = progress["step"]
    run.history, run.hits = progress["history"], progress["hits"]
    for entry in run.history:  # the tracker run is new (it replaces the stopped one's): it gets the curves so far
        run.tracker.log_metrics(entry["step"], {key: value for key, value in entry.items() if key != "step"})
    run.started = time.perf_counter() - progress["seconds"]


def training_loop(run: Run) -> None:
    """Train to the step budget, evaluating on the validation set every `train.eval_every` steps and
    at the last: each evaluation adds to the history, may stop the run early and, unless the run
    ends there, saves a checkpoint. NonFiniteLoss if the training loss became NaN or inf."""
    cfg, steps = run.cfg, run.cfg.train.steps
    loss_sum, loss_count = torch.zeros((), device=run.device), 0
    # The first step whose loss was NaN or inf (0: none), kept on the device and read at each
    # evaluation: reading the loss on the host every step would stall a GPU with a sync per step.
    nonfinite_step = torch.zeros((), dtype=torch.long, device=run.device)
    bar = tqdm(
        total=steps,
        initial=run.step,
        desc=run.name,
        unit="step",
        disable=not cfg.train.progress,
        dynamic_ncols=True,
    )
    with bar:
        for step in range(run.step + 1, steps + 1):
            batch = training_batch(cfg, run.generator, run.excluded).to(run.device)
            loss = train_step(run.model, run.optimizer, batch, cfg.train.clip)
            run.schedule.step()
            run.step = step
            loss_sum += loss
            loss_count += 1
            nonfinite_step = torch.where((nonfinite_step == 0) & ~loss.isfinite(), step, nonfinite_step)
            bar.update()
            if step % cfg.train.eval_every == 0 or step == steps:
                stop_if_diverged(run, int(nonfinite_step))
                entry = record_evaluation(run, loss_sum.item() / loss_count)
                loss_sum.zero_()
                loss_count = 0
                bar.set_postfix(loss=f"{entry['loss']:.4f}", val_acc=f"{entry['val_token_acc']:.3f}")
                run.hits = run.hits + 1 if entry["val_token_acc"] >= cfg.train.target_acc else 0
                if cfg.train.patience and run.hits >= cfg.train.patience:
                    break
                if step < steps:  # the run goes on: what it needs to continue from here if it is stopped
                    run.checkpoint()


def stop_if_diverged(run: Run, first_nonfinite: int) -> None:
    """NonFiniteLoss naming the run and the first step whose loss was NaN or inf (0: none, and nothing happens)."""
    if first_nonfinite:
        (run.folder / store.PROGRESS).unlink(missing_ok=True)
        raise NonFiniteLoss(
            f"{run.name}: the training loss became NaN or inf at step {first_nonfinite} (the run diverged: "
            f"try a lower train.lr); stopped at step {run.step}, nothing saved"
        )


def record_evaluation(run: Run, loss: float) -> dict:
    """Greedy decoding on the validation set at the current step, with `loss`, the mean training loss
    since the last evaluation: added to the history, sent to the tracker, and the run's progress
    file updated. -> the history entry."""
    result = evaluate(run.model, run.validation, need_weights=False)  # its scores only
    entry = {
        "step": run.step,
        "loss": loss,
        "val_token_acc": result["token_acc"],
        "val_seq_acc": result["seq_acc"],
        "seconds": time.perf_counter() - run.started,
    }
    run.history.append(entry)
    run.tracker.log_metrics(run.step, {key: value for key, value in entry.items() if key != "step"})
    # a sweep's bar credits the work of runs in training
    store.write_progress(run.folder, run.step, run.cfg.train.steps)
    return entry


def finish(run: Run) -> dict:
    """Score the test set (every reported number) at the step where training stopped and write the
    run folder's results but metrics.json: the history, the model, the attention samples. -> the metrics."""
    train_seconds = time.perf_counter() - run.started
    result = evaluate(run.model, run.test)  # with the weights: the attention samples' maps
    (run.folder / store.PROGRESS).unlink(missing_ok=True)
    store.atomic_write(run.folder / store.HISTORY, pd.DataFrame(run.history).to_csv(index=False))
    buffer = io.BytesIO()
    torch.save({"model": run.model.state_dict(), "config": OmegaConf.to_container(run.cfg, resolve=True)}, buffer)
    store.atomic_write(run.folder / store.CHECKPOINT, buffer.getvalue())
    samples = attention_samples(run.cfg, run.test, result)
    store.write_json(run.folder / store.ATTENTION, samples)
    metrics = run_metrics(run, result, train_seconds)
    run.tracker.log_metrics(metrics["steps"], {name: metrics[key] for name, key in trackers.FINAL_METRICS.items()})
    if run.tracker.active and samples["samples"] and samples["samples"][0]["weights"] is not None:
        log_heatmap(run.tracker, samples["samples"][0], run.cfg, metrics)
    return metrics


def run_metrics(run: Run, result: dict, train_seconds: float) -> dict:
    """metrics.json's content: what the run was, the test set's scores (`result`), the last
    evaluation's, what training took, and what made the run."""
    cfg, final = run.cfg, run.history[-1]
    return {
        "attention": store.architecture(cfg),
        "heads": family_of(cfg).heads(cfg),
        "task": cfg.task.name,
        "length": cfg.task.length,
        "min_length": cfg.task.min_length if cfg.task.variable_length else cfg.task.length,
        "vocab_size": cfg.task.vocab_size,
        "seed": cfg.seed,
        "token_acc": result["token_acc"],
        "seq_acc": result["seq_acc"],
        "ended_early": result["ended_early"],
        "val_token_acc": final["val_token_acc"],
        "val_seq_acc": final["val_seq_acc"],
        "chance": 1.0 / cfg.task.vocab_size,
        "params": count_parameters(run.model),
        # what the decoder can read of a source of the trained (variable lengths: the longest) length, per sequence
        "state_floats": run.model.state_floats(cfg.task.length),
        "steps": final["step"],
        "step_budget": cfg.train.steps,
        "final_loss": final["loss"],
        "train_seconds": train_seconds,
        "device": str(run.device),
        "host": host(),
        "threads": torch.get_num_threads(),
        "fused": run.fused,
        "resumed_from": run.resumed_from,
        "run": run.name,
    } | run.provenance


def log_heatmap(tracker: trackers.RunLogger, sample: dict, cfg: DictConfig, metrics: dict) -> None:
    """The attention map of the first held-out example, drawn as the report draws it, as the image `attention`."""
    from ..figures import plot_attention  # matplotlib: only for a tracker

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "attention.png"
        title = (
            f"{store.model_label(cfg)}, length {cfg.task.length}, seed {cfg.seed} "
            f"(token acc {100 * metrics['token_acc']:.1f}%)"
        )
        plot_attention(sample, cfg.task.vocab_size, cfg.task.name, title, path)
        tracker.log_image(path)


def attention_samples(cfg: DictConfig, heldout: Batch, result: dict) -> dict:
    """The first few test examples: source, target, greedy output and attention weights
    (output step x source position), trimmed to each example's real source and target lengths."""
    samples = []
    for i in range(min(cfg.train.attention_samples, len(heldout))):
        length, steps = int(heldout.src_lengths[i]), int(heldout.tgt_lengths[i]) + 1  # steps: the target and EOS
        weights = result["weights"]
        samples.append(
            {
                "source": heldout.src[i, :length].tolist(),
                "target": heldout.tgt_out[i, :steps].tolist(),
                "output": result["tokens"][i, :steps].tolist(),
                "weights": None if weights is None else store.rounded(weights[i, :steps, :length]),
            }
        )
    return {"attention": store.architecture(cfg), "task": cfg.task.name, "samples": samples}

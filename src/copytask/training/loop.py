"""One training run: validate the config, train with teacher forcing, evaluate by greedy decoding
on the validation set at every evaluation (the history, early stopping), score the test set once at
the end (every reported number), and write the run folder (config, history, checkpoint, attention
samples, and metrics.json last)."""

from __future__ import annotations

import io
import shutil
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from . import checkpoints, trackers
from .. import store
from ..config.checks import validate
from ..data.vocab import PAD
from ..data.batches import Batch
from .devices import host, resolve_device, run_settings
from .devices import torch_state
from .optimizer import FlatAdam, adam
from ..models.build import build_model, check_buildable
from ..models.greedy import evaluate, rounded
from .splits import heldout_keys, training_batch
from ..kernels.ops import runs_fused
from ..config.model_keys import is_transformer
from ..models.recurrent import Seq2Seq, count_parameters


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


def train(cfg: DictConfig, model_class: type[nn.Module] = Seq2Seq) -> dict:
    """Train one run and write its folder; returns metrics.json's content. A run whose complete
    results already exist is read, not trained again, unless `retrain=true`, and then its old folder
    is kept until the new results are complete (and put back if training fails). Raises
    RunInProgress if another process is training the run now, NonFiniteLoss if it diverges.
    Torch's thread count and random state are as they were when it returns. `model_class`: see
    `evaluation.build_model`."""
    validate(cfg)
    check_buildable(cfg)
    folder = store.run_dir(cfg)
    lock = store.lock_run(folder)
    if lock is None:
        raise RunInProgress(f"{folder.name}: being trained by another process (it holds {store.lock_path(folder)})")
    with lock:
        previous = None
        retrain = cfg.get("retrain", False)
        if store.is_complete(folder):
            if not retrain:
                return store.read_json(folder / store.METRICS)
            previous = folder.with_name(f".{folder.name}.replaced")  # a dot folder: no listing of runs sees it
            shutil.rmtree(previous, ignore_errors=True)
            folder.rename(previous)
        elif folder.exists():  # an interrupted or failed run: no one else writes here while we hold the lock
            clear_leftovers(folder, keep_checkpoint=not retrain)
        try:
            device = resolve_device(cfg.train.device)
            with trackers.open_run(cfg, folder.name) as tracker, torch_state(cfg.train.threads, device), run_settings(device):  # the tracker closes before the run is complete
                try:
                    metrics = _train_locked(cfg, folder, device, model_class, tracker)
                except checkpoints.UnusableCheckpoint:  # set aside: from step 0, with everything built afresh
                    metrics = _train_locked(cfg, folder, device, model_class, tracker)
            store.write_json(folder / store.METRICS, metrics)  # last: marks the run complete
            (folder / store.RESUME).unlink(missing_ok=True)  # a complete run never resumes
        except BaseException:
            if previous is not None:  # the finished run comes back: a failed retrain loses nothing
                shutil.rmtree(folder, ignore_errors=True)
                previous.rename(folder)
            raise
        if previous is not None:
            shutil.rmtree(previous)
        return metrics


def clear_leftovers(folder: Path, keep_checkpoint: bool) -> None:
    """Empty the folder of an interrupted or failed run but for its checkpoint (with
    `keep_checkpoint`, to continue from it) and a checkpoint set aside as unreadable."""
    keep = {store.UNREADABLE_RESUME, store.RESUME} if keep_checkpoint else {store.UNREADABLE_RESUME}
    for path in folder.iterdir():
        if path.name not in keep:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def summary_line(metrics: dict, folder: Path) -> str:
    """The one line the command line prints for a finished run."""
    return (
        f"{metrics['run']}: greedy token acc {metrics['token_acc']:.2%}, seq acc {metrics['seq_acc']:.2%} "
        f"(chance {metrics['chance']:.1%}), {metrics['steps']} steps, {metrics['train_seconds']:.1f} s, "
        f"{metrics['params']:,} params" + (f", resumed from step {metrics['resumed_from']}" if metrics.get("resumed_from") else "")
        + f" -> {folder}"
    )


def _train_locked(cfg: DictConfig, folder: Path, device: torch.device, model_class: type[nn.Module], tracker: trackers.RunLogger) -> dict:
    """`train`'s work, in `folder` (new, or holding the checkpoint of an interrupted run, from which
    it continues), under the run's lock: every file but metrics.json, whose content it returns.
    `tracker` gets what the folder gets. UnusableCheckpoint for a checkpoint that does not fit the run."""
    folder.mkdir(parents=True, exist_ok=True)
    store.atomic_write(folder / store.CONFIG, OmegaConf.to_yaml(cfg, resolve=True))

    # the model's initialisation (on the CPU) and, on a GPU, its own draws; `torch_state` restores the caller's random state
    torch.random.default_generator.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    model = build_model(cfg, model_class).to(device)
    tracker.log_params(store.flat_identity(cfg))
    fused = runs_fused(model)  # loads the kernels (builds them on first use) before the clock starts
    test, validation, excluded = heldout_keys(cfg)  # training draws again every sequence of either
    test, validation = test.to(device), validation.to(device)
    steps = cfg.train.steps
    optimizer = adam(model, cfg.train.lr, device)
    if cfg.train.schedule == "onecycle":
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, cfg.train.lr, total_steps=steps, pct_start=cfg.train.warmup)
    else:
        schedule = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)

    # Where the run stands after an evaluation (all a checkpoint needs besides the objects' state).
    progress = {"step": 0, "history": [], "hits": 0, "seconds": 0.0}
    if (state := checkpoints.load(folder, cfg)) is not None:
        progress = checkpoints.restore(state, model, optimizer, schedule, generator, device, folder)
    resumed_from, history, hits = progress["step"], progress["history"], progress["hits"]
    for entry in history:  # the tracker run is new (it replaces the stopped one's): it gets the curves so far
        tracker.log_metrics(entry["step"], {key: value for key, value in entry.items() if key != "step"})
    loss_sum, loss_count = torch.zeros((), device=device), 0
    # The first step whose loss was NaN or inf (0: none), kept on the device and read at each
    # evaluation: reading the loss on the host every step would stall a GPU with a sync per step.
    nonfinite_step = torch.zeros((), dtype=torch.long, device=device)
    started = time.perf_counter() - progress["seconds"]  # a resumed run's clock goes on from its checkpoint
    bar = tqdm(total=steps, initial=resumed_from, desc=folder.name, unit="step", disable=not cfg.train.progress, dynamic_ncols=True)
    for step in range(resumed_from + 1, steps + 1):
        batch = training_batch(cfg, generator, excluded).to(device)
        loss = train_step(model, optimizer, batch, cfg.train.clip)
        schedule.step()
        loss_sum += loss
        loss_count += 1
        nonfinite_step = torch.where((nonfinite_step == 0) & ~loss.isfinite(), step, nonfinite_step)
        bar.update()

        if step % cfg.train.eval_every == 0 or step == steps:
            if first := int(nonfinite_step):
                bar.close()
                (folder / store.PROGRESS).unlink(missing_ok=True)
                raise NonFiniteLoss(
                    f"{folder.name}: the training loss became NaN or inf at step {first} (the run diverged: "
                    f"try a lower train.lr); stopped at step {step}, nothing saved"
                )
            result = evaluate(model, validation)
            history.append(
                {
                    "step": step,
                    "loss": loss_sum.item() / loss_count,
                    "val_token_acc": result["token_acc"],
                    "val_seq_acc": result["seq_acc"],
                    "seconds": time.perf_counter() - started,
                }
            )
            tracker.log_metrics(step, {key: value for key, value in history[-1].items() if key != "step"})
            loss_sum.zero_()
            loss_count = 0
            bar.set_postfix(loss=f"{history[-1]['loss']:.4f}", val_acc=f"{result['token_acc']:.3f}")
            store.write_progress(folder, step, steps)  # a sweep's bar credits the work of runs in training
            hits = hits + 1 if result["token_acc"] >= cfg.train.target_acc else 0
            if cfg.train.patience and hits >= cfg.train.patience:
                break
            if step < steps:  # the run goes on: what it needs to continue from here if it is stopped
                progress = {"step": step, "history": history, "hits": hits, "seconds": time.perf_counter() - started}
                checkpoints.save(folder, cfg, progress, model, optimizer, schedule, generator, device)
    bar.close()
    train_seconds = time.perf_counter() - started
    result = evaluate(model, test)  # the numbers reported: the test set's, at the step where training stopped
    (folder / store.PROGRESS).unlink(missing_ok=True)

    store.atomic_write(folder / store.HISTORY, pd.DataFrame(history).to_csv(index=False))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "config": OmegaConf.to_container(cfg, resolve=True)}, buffer)
    store.atomic_write(folder / store.CHECKPOINT, buffer.getvalue())
    samples = attention_samples(cfg, test, result)
    store.write_json(folder / store.ATTENTION, samples)
    final = history[-1]
    metrics = {
        "attention": store.architecture(cfg),
        "heads": cfg.model.heads if is_transformer(cfg) else cfg.attention.get("heads", 1),
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
        "params": count_parameters(model),
        "steps": final["step"],
        "step_budget": steps,
        "final_loss": final["loss"],
        "train_seconds": train_seconds,
        "device": str(device),
        "host": host(),
        "threads": torch.get_num_threads(),
        "fused": fused,
        "resumed_from": resumed_from,  # the step this run continued from after an interruption (0: trained in one go)
        "run": folder.name,
    }
    tracker.log_metrics(final["step"], {name: metrics[key] for name, key in trackers.FINAL_METRICS.items()})
    if tracker.active and samples["samples"] and samples["samples"][0]["weights"] is not None:
        log_heatmap(tracker, samples["samples"][0], cfg, metrics)
    return metrics


def log_heatmap(tracker: trackers.RunLogger, sample: dict, cfg: DictConfig, metrics: dict) -> None:
    """The attention map of the first held-out example, drawn as the report draws it, as the image `attention`."""
    from ..reporting.figures import plot_attention  # matplotlib: only for a tracker

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "attention.png"
        title = f"{store.model_label(cfg)}, length {cfg.task.length}, seed {cfg.seed} (token acc {100 * metrics['token_acc']:.1f}%)"
        plot_attention(sample, cfg.task.vocab_size, cfg.task.name, title, path)
        tracker.log_image(path)


def attention_samples(cfg: DictConfig, heldout: Batch, result: dict) -> dict:
    """The first few test examples: source, target, greedy output and attention weights
    (output step x source position), trimmed to each example's real length."""
    samples = []
    for i in range(min(cfg.train.attention_samples, len(heldout))):
        length = int(heldout.src_lengths[i])
        weights = result["weights"]
        samples.append(
            {
                "source": heldout.src[i, :length].tolist(),
                "target": heldout.tgt_out[i, : length + 1].tolist(),
                "output": result["tokens"][i, : length + 1].tolist(),
                "weights": None if weights is None else rounded(weights[i, : length + 1, :length]),
            }
        )
    return {"attention": store.architecture(cfg), "task": cfg.task.name, "samples": samples}

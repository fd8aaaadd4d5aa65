"""One training run: validate the config, train with teacher forcing, evaluate by greedy decoding
on a fixed held-out set, and write the run folder (config, history, checkpoint, attention
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

from . import loggers, store
from .config import validate
from .data import PAD, Batch, make_batch, total_vocab
from .devices import fused_adam, host, resolve_device, run_settings
from .kernels import runs_fused
from .model import Seq2Seq, count_parameters


class NonFiniteLoss(FloatingPointError):
    """The training loss became NaN or inf: the run diverged; the message names the run and step."""


def build_model(cfg: DictConfig, model_class: type[nn.Module] = Seq2Seq) -> nn.Module:
    """The configured model; `model_class` may be any class with Seq2Seq's constructor and
    interface (the benchmark passes `reference.ReferenceSeq2Seq`)."""
    return model_class(
        vocab=total_vocab(cfg.task.vocab_size),
        decoder=cfg.attention.decoder,
        score=cfg.attention.score,
        embedding_size=cfg.model.embedding_size,
        hidden_size=cfg.model.hidden_size,
        attention_size=cfg.attention.size,
        bidirectional=cfg.model.bidirectional,
        heads=cfg.attention.get("heads", 1),  # absent from configs without multi-head and from older runs
        local=cfg.attention.get("local"),  # Luong's local attention: absent from global ones
        window=cfg.attention.get("window"),
        fused=cfg.train.get("fused", True),  # absent from older runs
    )


def sample_batch(cfg: DictConfig, batch_size: int, generator: torch.Generator) -> Batch:
    task = cfg.task
    min_length = task.min_length if task.variable_length else None
    return make_batch(task.name, batch_size, task.length, task.vocab_size, generator, min_length)


def eval_batch(cfg: DictConfig) -> Batch:
    """The fixed held-out set: drawn from its own seed, never seen in training (`training_batch`)."""
    return sample_batch(cfg, cfg.train.eval_size, torch.Generator().manual_seed(cfg.train.eval_seed))


def sequence_keys(batch: Batch) -> set[bytes]:
    """Each row's source sequence (padded to the task's length, so its length is part of it) as bytes."""
    return {row.tobytes() for row in batch.src.cpu().numpy()}


def training_batch(cfg: DictConfig, generator: torch.Generator, heldout: set[bytes]) -> Batch:
    """A training batch with no sequence of the held-out set (`sequence_keys`): rows that are one are
    drawn again. Short lengths need it: at length 5 there are 59,049 sequences, and a run's batches
    would otherwise hold about three quarters of the 512 held-out ones by the end of training."""
    batch = sample_batch(cfg, cfg.train.batch_size, generator)
    while seen := [i for i, row in enumerate(batch.src.cpu().numpy()) if row.tobytes() in heldout]:
        fresh = sample_batch(cfg, len(seen), generator)
        for name in ("src", "src_lengths", "tgt_in", "tgt_out"):
            getattr(batch, name)[seen] = getattr(fresh, name)
    return batch


# Sequences greedily decoded at once on CPU. Smaller pieces keep a decoder step's tensors in cache:
# 512 held-out sequences at length 80 took Bahdanau 0.46 s in one piece and 0.29 s in pieces of 128
# (Luong general 0.27 -> 0.23 s; the baseline, with no attention tensors, 0.08 -> 0.10 s).
EVAL_CHUNK = 128


@torch.no_grad()
def evaluate(model: Seq2Seq, batch: Batch, chunk_size: int | None = None) -> dict:
    """Greedy decoding (no teacher forcing) on `batch`: token accuracy over the content positions,
    and exact-sequence accuracy (every symbol and the EOS right). Also returns the decoded tokens
    (B, T_dec) and attention weights (B, T_dec, T_enc) or None. `chunk_size` sequences are decoded
    at a time: by default EVAL_CHUNK on CPU, all at once on a GPU."""
    if chunk_size is None:
        chunk_size = len(batch) if batch.src.is_cuda else EVAL_CHUNK
    was_training = model.training
    model.eval()
    tokens, weights = [], []
    for start in range(0, len(batch), chunk_size):
        part = batch.select(slice(start, start + chunk_size))
        out, w = model.greedy(part.src, part.src_lengths, steps=batch.tgt_out.size(1))
        tokens.append(_pad_to(out, batch.tgt_out.size(1)))
        weights.append(None if w is None else _pad_to(w, batch.src.size(1), dim=2))
    model.train(was_training)
    tokens = torch.cat(tokens)
    hits, symbols, exact = sequence_scores(tokens, batch)
    return {
        "token_acc": hits.sum().item() / symbols.sum().item(),
        "seq_acc": exact.float().mean().item(),
        "tokens": tokens,
        "weights": None if weights[0] is None else torch.cat(weights),
    }


def sequence_scores(tokens: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy output `tokens` (B, T_dec) against `batch` -> per sequence (B,): content symbols right,
    content symbols, and whether the whole target (every symbol and the EOS) is right."""
    correct = tokens == batch.tgt_out
    content = batch.content_mask
    return (correct & content).sum(1), content.sum(1), (correct | ~batch.target_mask).all(1)


def rounded(weights: torch.Tensor) -> list:
    """Attention weights as nested lists with four decimals: small enough for a length-80 map in
    JSON, exact enough for a heatmap."""
    return weights.double().mul(1e4).round().div(1e4).tolist()


def _pad_to(t: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    missing = size - t.size(dim)
    if missing == 0:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = missing
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, clip: float) -> torch.Tensor:
    """One teacher-forced update: cross-entropy over the real target positions, gradient norm
    clipped to `clip`. -> the loss, detached (no host sync, so a GPU step stays asynchronous)."""
    logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)  # (B, T_dec, V)
    loss = F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.detach()


def train(cfg: DictConfig, model_class: type[nn.Module] = Seq2Seq) -> dict | None:
    """Train one run and write its folder; returns metrics.json's content. A run whose complete
    results already exist is not trained again unless `retrain=true`, and then its old folder is
    kept until the new results are complete (and put back if training fails); one that another
    process is training now is skipped with a warning, and None is returned. Raises NonFiniteLoss
    if the run diverges. `model_class`: see `build_model`."""
    validate(cfg)
    folder = store.run_dir(cfg)
    lock = store.lock_run(folder)
    if lock is None:
        store.warn(f"{folder.name}: being trained by another process (it holds {store.lock_path(folder)}); skipped")
        return None
    with lock:
        previous = None
        if store.is_complete(folder):
            if not cfg.get("retrain", False):
                print(f"{folder.name}: already complete, skipped (retrain=true trains it again)")
                return store.read_json(folder / store.METRICS)
            previous = folder.with_name(f".{folder.name}.replaced")  # a dot folder: no listing of runs sees it
            shutil.rmtree(previous, ignore_errors=True)
            folder.rename(previous)
        elif folder.exists():  # leftovers of an interrupted or failed run: no one else writes here while we hold the lock
            shutil.rmtree(folder)
        try:
            with loggers.open_run(cfg, folder.name) as tracker, run_settings(cfg.train.device):  # closed before the run is marked complete
                metrics = _train_locked(cfg, folder, model_class, tracker)
            store.write_json(folder / store.METRICS, metrics)  # last: marks the run complete
        except BaseException:
            if previous is not None:  # the finished run comes back: a failed retrain loses nothing
                shutil.rmtree(folder, ignore_errors=True)
                previous.rename(folder)
            raise
        if previous is not None:
            shutil.rmtree(previous)
        print(
            f"{folder.name}: greedy token acc {metrics['token_acc']:.2%}, seq acc {metrics['seq_acc']:.2%} "
            f"(chance {metrics['chance']:.1%}), {metrics['steps']} steps, {metrics['train_seconds']:.1f} s, "
            f"{metrics['params']:,} params -> {folder}"
        )
        return metrics


def _train_locked(cfg: DictConfig, folder: Path, model_class: type[nn.Module], tracker: loggers.RunLogger) -> dict:
    """`train`'s work, in a fresh `folder`, under the run's lock: every file but metrics.json, whose
    content it returns. `tracker` gets what the folder gets."""
    folder.mkdir(parents=True)
    store.atomic_write(folder / store.CONFIG, OmegaConf.to_yaml(cfg, resolve=True))

    device = resolve_device(cfg.train.device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    model = build_model(cfg, model_class).to(device)
    tracker.log_params(store.flat_identity(cfg))
    fused = runs_fused(model)  # loads the kernels (builds them on first use) before the clock starts
    heldout = eval_batch(cfg)
    excluded = sequence_keys(heldout)
    heldout = heldout.to(device)
    steps = cfg.train.steps
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr, fused=fused_adam(device))
    if cfg.train.schedule == "onecycle":
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, cfg.train.lr, total_steps=steps, pct_start=cfg.train.warmup)
    else:
        schedule = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)

    history, hits, loss_sum, loss_count = [], 0, torch.zeros((), device=device), 0
    # The first step whose loss was NaN or inf (0: none), kept on the device and read at each
    # evaluation: reading the loss on the host every step would stall a GPU with a sync per step.
    nonfinite_step = torch.zeros((), dtype=torch.long, device=device)
    started = time.perf_counter()
    bar = tqdm(total=steps, desc=folder.name, unit="step", disable=not cfg.train.progress, dynamic_ncols=True)
    for step in range(1, steps + 1):
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
                raise NonFiniteLoss(
                    f"{folder.name}: the training loss became NaN or inf at step {first} (the run diverged: "
                    f"try a lower train.lr); stopped at step {step}, nothing saved"
                )
            result = evaluate(model, heldout)
            history.append(
                {
                    "step": step,
                    "loss": loss_sum.item() / loss_count,
                    "token_acc": result["token_acc"],
                    "seq_acc": result["seq_acc"],
                    "seconds": time.perf_counter() - started,
                }
            )
            tracker.log_metrics(step, {key: value for key, value in history[-1].items() if key != "step"})
            loss_sum.zero_()
            loss_count = 0
            bar.set_postfix(loss=f"{history[-1]['loss']:.4f}", acc=f"{result['token_acc']:.3f}")
            hits = hits + 1 if result["token_acc"] >= cfg.train.target_acc else 0
            if cfg.train.patience and hits >= cfg.train.patience:
                break
    bar.close()
    train_seconds = time.perf_counter() - started

    store.atomic_write(folder / store.HISTORY, pd.DataFrame(history).to_csv(index=False))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "config": OmegaConf.to_container(cfg, resolve=True)}, buffer)
    store.atomic_write(folder / store.CHECKPOINT, buffer.getvalue())
    samples = attention_samples(cfg, heldout, result)
    store.write_json(folder / store.ATTENTION, samples)
    final = history[-1]
    metrics = {
        "attention": cfg.attention.name,
        "heads": cfg.attention.get("heads", 1),
        "task": cfg.task.name,
        "length": cfg.task.length,
        "min_length": cfg.task.min_length if cfg.task.variable_length else cfg.task.length,
        "vocab_size": cfg.task.vocab_size,
        "seed": cfg.seed,
        "token_acc": final["token_acc"],
        "seq_acc": final["seq_acc"],
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
        "run": folder.name,
    }
    tracker.log_metrics(final["step"], {name: metrics[key] for name, key in loggers.FINAL_METRICS.items()})
    if tracker.active and samples["samples"] and samples["samples"][0]["weights"] is not None:
        log_heatmap(tracker, samples["samples"][0], cfg, metrics)
    return metrics


def log_heatmap(tracker: loggers.RunLogger, sample: dict, cfg: DictConfig, metrics: dict) -> None:
    """The attention map of the first held-out example, drawn as the report draws it, as the image `attention`."""
    from .analysis_figures import plot_attention  # matplotlib: only for a tracker

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "attention.png"
        title = f"{store.attention_label(cfg.attention.name, metrics['heads'])}, length {cfg.task.length}, seed {cfg.seed} (token acc {100 * metrics['token_acc']:.1f}%)"
        plot_attention(sample, cfg.task.vocab_size, cfg.task.name, title, path)
        tracker.log_image(path)


def attention_samples(cfg: DictConfig, heldout: Batch, result: dict) -> dict:
    """The first few held-out examples: source, target, greedy output and attention weights
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
    return {"attention": cfg.attention.name, "task": cfg.task.name, "samples": samples}

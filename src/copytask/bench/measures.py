"""What `python -m copytask bench` measures (the package's docstring says what it reports): one
training step's time, FLOPs and this machine's matmul rate, a short run's peak memory in a fresh
process, and time to the target accuracy, for the project's models and the classical reference."""

from __future__ import annotations

import copy
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from torch.utils.flop_counter import FlopCounterMode
from tqdm.auto import tqdm

from .. import store
from ..config.schema import config_dir
from ..data.batches import Batch
from ..data.splits import sample_batch, test_batch
from ..evaluation.breakdown import beam_tokens
from ..families import family_of
from ..models.build import build_model
from ..models.greedy import evaluate
from ..training.devices import fused_adam, resolve_device
from ..training.loop import train, train_step
from ..training.optimizer import adam
from .reference import ReferenceSeq2Seq, ReferenceTransformer

CLASSICAL = ("none", "bahdanau", "luong_dot", "luong_general", "luong_concat")  # the reference's GRU models
ATTENTIONS = (  # every option of configs/attention/, the classical ones first, and model=transformer and mamba
    *CLASSICAL,
    *sorted({path.stem for path in (Path(config_dir()) / "attention").glob("*.yaml")} - set(CLASSICAL)),
    "transformer",
    "mamba",
)
REFERENCED = (*CLASSICAL, "transformer")  # what the reference implements
# The overrides that choose a benchmarked model: `attention=<name>` (a GRU model), except these.
MODEL_OVERRIDES = {"transformer": ["model=transformer"], "mamba": ["model=mamba"]}
# Each implementation's classes by model family, as build_model takes them (none: the family's own class).
IMPLEMENTATIONS = {"project": {}, "reference": {"gru": ReferenceSeq2Seq, "transformer": ReferenceTransformer}}


def implementations(attention: str) -> list[str]:
    """The implementations of an attention type: the project's, and the reference's for REFERENCED ones."""
    return list(IMPLEMENTATIONS) if attention in REFERENCED else ["project"]


TARGET_ATTENTIONS = ("bahdanau", "luong_general")
# Time to target, each implementation with its usual optimiser settings (config overrides). The
# reference's are those of the classical tutorials (e.g. bentrevett/pytorch-seq2seq, PyTorch's
# seq2seq translation tutorial): Adam at its default learning rate, no schedule. Without a
# schedule the step budget changes nothing but where a run that never gets there gives up.
TARGET_SETTINGS = {
    "own": {"project": [], "reference": ["train.schedule=constant", "train.lr=1e-3", "train.steps=6000"]},
    "same": {"project": [], "reference": []},
}
# A smoke run: short sequences, a small batch, one fresh process per implementation for memory,
# and one thread (more threads on a busy machine make steps slower: docs/bench.md).
QUICK = {
    "lengths": [5, 10],
    "repeats": 2,
    "warmup": 1,
    "gemm_size": 256,
    "memory_attentions": ["luong_general"],
    "overrides": ["train.batch_size=8", "train.threads=1"],
}

Setup = tuple[torch.nn.Module, torch.optim.Optimizer, Batch, float]  # train_step's arguments


def bench_config(attention: str, length: int, overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        chosen = MODEL_OVERRIDES.get(attention, [f"attention={attention}"])
        return compose("config", overrides=[*chosen, f"task.length={length}", *overrides])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def setups(cfg: DictConfig, device: torch.device) -> dict[str, Setup]:
    """Project and (for REFERENCED attention) reference model with the same weights, on one batch:
    the project's with the optimiser its runs train with (training.adam), the reference with torch's
    Adam over its parameters, as the tutorials train it."""
    batch = sample_batch(cfg, cfg.train.batch_size, torch.Generator().manual_seed(cfg.seed)).to(device)
    with torch.random.fork_rng(devices=[]):  # the initialisation draws from the global generator: seeded, then restored
        torch.manual_seed(cfg.seed)
        models = {
            name: build_model(cfg, IMPLEMENTATIONS[name].get(family_of(cfg).name)).to(device)
            for name in implementations(store.architecture(cfg))
        }
    if "reference" in models:
        models["reference"].load_state_dict(models["project"].state_dict())

    def optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
        if name == "project":
            return adam(model, cfg.train.lr, device)
        return torch.optim.Adam(model.parameters(), lr=cfg.train.lr, fused=fused_adam(device))

    return {name: (m, optimizer(name, m), batch, cfg.train.clip) for name, m in models.items()}


def step_seconds(setup: Setup, device: torch.device) -> float:
    synchronize(device)
    started = time.perf_counter()
    train_step(*setup)
    synchronize(device)
    return time.perf_counter() - started


def step_flops(setup: Setup) -> int:
    """Matrix-product FLOPs of one training step, forward and backward, counted on torch's CPU ops,
    in a copy of the step (the benchmarked model is left as it is): the counter does not see the
    products inside the fused kernels, nor those of cuDNN's GRU (it has no formula for `_cudnn_rnn`),
    which are the same ones."""
    model, optimizer, batch, clip = setup
    model = copy.deepcopy(model).cpu()
    for module in model.modules():
        if getattr(module, "fused", False):
            module.fused = False
    adam = torch.optim.Adam(model.parameters(), lr=optimizer.param_groups[0]["lr"])
    with FlopCounterMode(display=False) as counter:
        train_step(model, adam, batch.to("cpu"), clip)
    return counter.get_total_flops()


def matmul_rate(device: torch.device, size: int, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` float32 (size x size) @ (size x size) products."""
    generator = torch.Generator(device).manual_seed(0)  # not the caller's global one
    a, b = (torch.randn(size, size, device=device, generator=generator) for _ in range(2))
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


def speed(
    lengths: list[int],
    overrides: list[str],
    repeats: int,
    warmup: int,
    device: torch.device,
    attentions: Sequence[str] = ATTENTIONS,
) -> pd.DataFrame:
    """ms/step, tokens/s and FLOPs for every (attention, length, implementation), of `attentions`
    and Luong general (what vs_luong_general divides by)."""
    rows = []
    chosen = [attention for attention in ATTENTIONS if attention in attentions or attention == "luong_general"]
    setups_per_length = sum(len(implementations(attention)) for attention in chosen)
    bar = tqdm(total=len(lengths) * setups_per_length * (warmup + repeats), desc="step times", unit="step")
    for length in lengths:
        cfgs = {attention: bench_config(attention, length, overrides) for attention in chosen}
        runs = {
            (attention, name): setup for attention, cfg in cfgs.items() for name, setup in setups(cfg, device).items()
        }
        seconds: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
        for round_ in range(warmup + repeats):  # interleaved: drift on a shared machine hits all alike
            for key, setup in runs.items():
                bar.set_postfix_str(f"length {length} {key[0]} {key[1]}")
                elapsed = step_seconds(setup, device)
                if round_ >= warmup:
                    seconds[key].append(elapsed)
                bar.update()
        for (attention, name), setup in runs.items():
            cfg = cfgs[attention]
            median = statistics.median(seconds[attention, name])
            target_tokens = cfg.train.batch_size * (length + 1)
            rows.append(
                {
                    "attention": attention,
                    "length": length,
                    "implementation": name,
                    "batch_size": cfg.train.batch_size,
                    "ms_per_step": 1e3 * median,
                    "tokens_per_s": target_tokens / median,
                    "gflop_per_step": step_flops(setup) / 1e9,
                }
            )
    bar.close()
    return pd.DataFrame(rows)


MEMORY_CHILD = (
    "import json, sys; from copytask.bench.measures import training_memory; "
    "print(json.dumps(training_memory(*json.loads(sys.argv[1]))))"
)


def training_memory(attention: str, implementation: str, length: int, overrides: list[str], steps: int) -> dict:
    """Runs in a fresh process: `steps` training steps. -> peak memory of the process (CPU: max
    RSS; CUDA: max allocated) and its growth over training (activations, gradients, Adam state), MiB."""
    cfg = bench_config(attention, length, overrides)
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())  # its own process, which ends after this
    device = resolve_device(cfg.train.device)
    setup = setups(cfg, device)[implementation]

    def peak() -> float:
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device) / 2**20
        status = Path("/proc/self/status")
        if status.exists():  # Linux; ru_maxrss would include the parent's peak from before exec
            line = next(line for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
            return int(line.split()[1]) / 2**10  # kB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # macOS: bytes

    before = peak()
    for _ in range(steps):
        train_step(*setup)
    synchronize(device)
    return {"peak_mb": peak(), "train_mb": peak() - before}


def memory(attentions: list[str], length: int, overrides: list[str], steps: int) -> pd.DataFrame:
    """training_memory for every (attention, implementation), each in its own process."""
    package_root = Path(__file__).resolve().parents[2]  # this checkout's copytask, not another install
    # before the caller's PYTHONPATH, and no empty entry where it has none (that would put the working folder first)
    path = [str(package_root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    keys = [(attention, name) for attention in attentions for name in implementations(attention)]

    def measure(key: tuple[str, str]) -> dict:
        args = json.dumps([*key, length, overrides, steps])
        out = subprocess.run(
            [sys.executable, "-c", MEMORY_CHILD, args], env=env, capture_output=True, text=True, check=True
        )
        return {
            "attention": key[0],
            "implementation": key[1],
            "length": length,
            **json.loads(out.stdout.strip().splitlines()[-1]),
        }

    # two at a time: the processes' memory does not interfere, and the wait halves
    with ThreadPoolExecutor(2) as pool:
        rows = list(tqdm(pool.map(measure, keys), total=len(keys), desc=f"peak memory, length {length}", unit="run"))
    return pd.DataFrame(rows)


def time_to_target(
    attentions: list[str], length: int, overrides: list[str], settings: str, runs_dir: Path
) -> pd.DataFrame:
    """Train each attention type with each implementation, with TARGET_SETTINGS[settings], until
    the target accuracy is first reached on the validation set. -> seconds and steps to it (NaN if
    never reached within the budget) and the seconds trained in all."""
    rows = []
    for attention in attentions:
        # the reference trains for CLASSICAL ones, GRU models
        for name in implementations(attention) if attention in CLASSICAL else ["project"]:
            cls, own = IMPLEMENTATIONS[name].get("gru"), TARGET_SETTINGS[settings][name]
            cfg = bench_config(attention, length, [*own, *overrides, f"runs_dir={runs_dir / name}", "train.patience=1"])
            folder = store.run_dir(cfg)
            shutil.rmtree(folder, ignore_errors=True)  # measure afresh, never reuse a finished run
            train(cfg, cls)
            history = pd.read_csv(folder / store.HISTORY)
            hit = history[history.val_token_acc >= cfg.train.target_acc].head(1)
            rows.append(
                {
                    "attention": attention,
                    "implementation": name,
                    "length": length,
                    "target_s": hit.seconds.item() if len(hit) else float("nan"),
                    "target_steps": hit.step.item() if len(hit) else float("nan"),
                    "target_trained_s": history.seconds.iloc[-1],
                    "target_settings": f"lr {cfg.train.lr:g} {cfg.train.schedule}, budget {cfg.train.steps}",
                }
            )
    return pd.DataFrame(rows)


def decoding_speed(
    attentions: list[str], length: int, overrides: list[str], widths: list[int], sequences: int, device: torch.device
) -> pd.DataFrame:
    """Seconds to decode the first `sequences` test sequences at `length` greedily (width 1) and by beam
    search of each of `widths` (the analysis' decoders), with the project's model of each attention type
    (untrained: it rarely emits EOS, so every search runs its full length, as a trained model's does until
    the EOS at the end), and each time over greedy's (`vs_greedy`)."""
    rows = []
    for attention in attentions:
        cfg = bench_config(attention, length, [*overrides, f"train.eval_size={max(sequences, 1)}"])
        with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
            torch.manual_seed(cfg.seed)
            model = build_model(cfg).to(device).eval()
        batch = test_batch(cfg).select(slice(0, sequences)).to(device)
        decoders = {1: lambda: evaluate(model, batch, need_weights=False)} | {
            width: lambda width=width: beam_tokens(model, batch, width) for width in widths
        }
        for width, decode in decoders.items():
            synchronize(device)
            started = time.perf_counter()
            decode()
            synchronize(device)
            rows.append(
                {"attention": attention, "length": length, "width": width, "seconds": time.perf_counter() - started}
            )
    table = pd.DataFrame(rows)
    greedy = table[table.width == 1].set_index("attention").seconds
    return table.assign(vs_greedy=table.seconds / table.attention.map(greedy))

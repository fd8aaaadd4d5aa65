"""Training speed of the project against the classical reference (`models.reference`), measured in
one run on one machine, so that the ratio holds even where absolute times drift.

    python -m copytask bench [--quick] [--time-to-target] [--csv PATH] [key=value ...]

The key=value overrides are the training configs' (`train.threads=1`, `train.device=cuda`,
`train.batch_size=128`, ...). Per attention type and length it measures:

- ms per training step (forward, backward, clipping, Adam) and target tokens per second:
  both models share weights and batch; every round times each (attention, implementation)
  once, interleaved, and the median over the rounds after warm-up is reported. The reference
  implements the CLASSICAL attention types and model=transformer (as `transformer`, the
  tutorials' Transformer: `reference.ReferenceTransformer`); every other option of
  configs/attention/ (scaled dot, multi-head, local, Cho et al.'s RNN encoder-decoder, ...) is the
  project's only, and `vs_luong_general` compares every type's step with Luong general's;
- FLOPs of one step (matrix products only, `FlopCounterMode`, on torch's ops: the project's
  kernels do the same products) and the fraction of this machine's matmul rate (a large
  `torch.mm`) the step reaches;
- at the longest length, peak memory of a short training run in a fresh process;
- with --time-to-target, wall time and steps to the target greedy token accuracy at the
  longest length for Bahdanau and Luong general, with patience 1, so a run stops at the first
  hit. Each implementation trains with its own usual settings (TARGET_SETTINGS): the project with
  its defaults (Adam, one-cycle schedule peaking at 6e-3, a 1200-step budget), the reference as the
  tutorials train it (Adam at its default 1e-3, constant, up to 6000 steps). Sizes, batch,
  clipping and evaluation are the same. `--target-settings same` trains both with the project's.
"""

from __future__ import annotations

import argparse
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

from . import store
from .config.schema import config_dir
from .data.batches import Batch
from .kernels import build, ops
from .models.build import build_model
from .models.recurrent import Seq2Seq
from .models.reference import ReferenceSeq2Seq, ReferenceTransformer
from .models.transformer import TransformerSeq2Seq
from .training.devices import cpu_model, fused_adam, resolve_device, run_settings
from .training.loop import train, train_step
from .training.optimizer import adam
from .training.splits import sample_batch

CLASSICAL = ("none", "bahdanau", "luong_dot", "luong_general", "luong_concat")  # the reference's GRU models
ATTENTIONS = (  # every option of configs/attention/, the classical ones first, and model=transformer
    *CLASSICAL,
    *sorted({path.stem for path in (Path(config_dir()) / "attention").glob("*.yaml")} - set(CLASSICAL)),
    "transformer",
)
REFERENCED = (*CLASSICAL, "transformer")  # what the reference implements
# The overrides that choose a benchmarked model: `attention=<name>` (a GRU model), except these.
MODEL_OVERRIDES = {"transformer": ["model=transformer"]}
# Each implementation's classes: (the GRU models', model=transformer's), as build_model takes them.
IMPLEMENTATIONS = {"project": (Seq2Seq, TransformerSeq2Seq), "reference": (ReferenceSeq2Seq, ReferenceTransformer)}


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
    torch.manual_seed(cfg.seed)
    models = {
        name: build_model(cfg, *IMPLEMENTATIONS[name]).to(device) for name in implementations(store.architecture(cfg))
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
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
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
    "import json, sys; from copytask.bench import training_memory; "
    "print(json.dumps(training_memory(*json.loads(sys.argv[1]))))"
)


def training_memory(attention: str, implementation: str, length: int, overrides: list[str], steps: int) -> dict:
    """Runs in a fresh process: `steps` training steps. -> peak memory of the process (CPU: max
    RSS; CUDA: max allocated) and its growth over training (activations, gradients, Adam state), MiB."""
    cfg = bench_config(attention, length, overrides)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
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
    package_root = str(Path(__file__).resolve().parents[1])  # this checkout's copytask, not another install
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
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
        # training.train builds its model_class for model=gru only: the reference trains for CLASSICAL ones
        for name in implementations(attention) if attention in CLASSICAL else ["project"]:
            (cls, _), own = IMPLEMENTATIONS[name], TARGET_SETTINGS[settings][name]
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


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {os.cpu_count()} cores"


def wide(long: pd.DataFrame) -> pd.DataFrame:
    """One row per (attention, length): each measure for project and reference, the speedup, and the
    project's step time against Luong general's at the same length."""
    table = long.pivot_table(
        index=["attention", "length", "batch_size"], columns="implementation", aggfunc="first", sort=False, dropna=False
    )
    table.columns = [f"{measure}_{name}" for measure, name in table.columns]
    table = table.reset_index()
    table.insert(3, "speedup", table.ms_per_step_reference / table.ms_per_step_project)
    if "luong_general" in set(table.attention):
        general = table[table.attention == "luong_general"].set_index("length").ms_per_step_project
        table.insert(4, "vs_luong_general", table.ms_per_step_project / table.length.map(general))
    if "target_s_project" in table:
        table.insert(4, "target_speedup", table.target_s_reference / table.target_s_project)
    return table


def parse(argv: list[str]) -> argparse.Namespace:
    """`python -m copytask bench`'s options and overrides (`--quick` filled in)."""
    parser = argparse.ArgumentParser(
        prog="python -m copytask bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. train.threads=1 train.device=cuda")
    parser.add_argument("--lengths", type=int, nargs="+", default=[20, 80])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per configuration (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--memory-steps", type=int, default=3, help="training steps of the peak-memory run")
    parser.add_argument(
        "--attentions",
        nargs="+",
        default=list(ATTENTIONS),
        choices=ATTENTIONS,
        help="the step-time table's attention types (Luong general is always timed too: vs_luong_general)",
    )
    parser.add_argument(
        "--memory-attentions", nargs="+", choices=ATTENTIONS, help="the peak-memory runs' (default: --attentions)"
    )
    parser.add_argument("--gemm-size", type=int, default=2048, help="matrix size of the matmul-rate measurement")
    parser.add_argument("--time-to-target", action="store_true", help="also train to the target accuracy (minutes)")
    parser.add_argument("--target-attentions", nargs="+", default=list(TARGET_ATTENTIONS), choices=ATTENTIONS)
    parser.add_argument(
        "--target-settings",
        choices=list(TARGET_SETTINGS),
        default="own",
        help="own: each implementation its usual optimiser settings; same: both the project's",
    )
    parser.add_argument("--csv", type=Path, default=Path("runs/bench/bench.csv"))
    parser.add_argument("--quick", action="store_true", help=f"a smoke run of seconds: {QUICK}")
    # Overrides first: argparse would take one after a list option (--memory-attentions a b key=value)
    # as one of its values.
    overrides = [arg for arg in argv if "=" in arg and not arg.startswith("-")]
    args = parser.parse_args([*overrides, *(arg for arg in argv if arg not in overrides)])
    args.memory_attentions = args.memory_attentions or args.attentions
    if args.quick:
        args.lengths, args.repeats, args.warmup, args.gemm_size = (
            QUICK["lengths"],
            QUICK["repeats"],
            QUICK["warmup"],
            QUICK["gemm_size"],
        )
        args.memory_steps, args.memory_attentions = 1, QUICK["memory_attentions"]
        args.overrides = [*QUICK["overrides"], *args.overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    cfg = bench_config(ATTENTIONS[0], args.lengths[0], args.overrides)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.train.device)
    fused = ops.runs_fused(build_model(cfg).to(device))
    project = f"fused CPU kernels ({build.build_name_and_flags()[0]})" if fused else "torch ops"
    description = (
        f"{machine(device)}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"device {device}; project on {project}"
    )
    print(f"copytask bench on {description}", file=sys.stderr)

    longest = max(args.lengths)
    with run_settings(device):  # the steps a run computes: on CUDA full float32 (no TF32), deterministic algorithms
        parts = [
            speed(args.lengths, args.overrides, args.repeats, args.warmup, device, args.attentions),
            memory(args.memory_attentions, longest, args.overrides, args.memory_steps),
        ]
        if args.time_to_target:
            parts.append(
                time_to_target(
                    args.target_attentions,
                    longest,
                    args.overrides,
                    args.target_settings,
                    args.csv.parent / "time_to_target",
                )
            )
        rate = matmul_rate(device, args.gemm_size)
    long = parts[0]
    for part in parts[1:]:
        long = long.merge(part, on=["attention", "length", "implementation"], how="left")
    table = wide(long)
    for name in IMPLEMENTATIONS:
        table[f"matmul_peak_fraction_{name}"] = (
            table[f"gflop_per_step_{name}"] * 1e9 / (table[f"ms_per_step_{name}"] / 1e3) / rate
        )
    table["matmul_gflops"] = rate / 1e9
    table["machine"] = description

    args.csv.parent.mkdir(parents=True, exist_ok=True)
    store.atomic_write(args.csv, table.to_csv(index=False))
    shown = [
        "attention",
        "length",
        "speedup",
        "vs_luong_general",
        "ms_per_step_project",
        "ms_per_step_reference",
        "tokens_per_s_project",
        "tokens_per_s_reference",
        "peak_mb_project",
        "peak_mb_reference",
        "train_mb_project",
        "train_mb_reference",
        "matmul_peak_fraction_project",
        "matmul_peak_fraction_reference",
    ]
    if args.time_to_target:
        shown += [
            "target_speedup",
            "target_s_project",
            "target_s_reference",
            "target_steps_project",
            "target_steps_reference",
        ]
        trained = table.dropna(subset=["target_settings_project"]).iloc[0]
        print(
            f"time to target with {args.target_settings} settings: project {trained.target_settings_project}; "
            f"reference {trained.target_settings_reference}",
            file=sys.stderr,
        )
    print(f"\n{description}; matmul rate {rate / 1e9:.1f} GFLOP/s ({args.gemm_size}^3 float32)")
    print(table[shown].to_string(index=False, float_format=lambda x: f"{x:.3g}", na_rep="-"))
    print(f"\nwritten to {args.csv}")
    return 0

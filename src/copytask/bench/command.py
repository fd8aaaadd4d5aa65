"""`python -m copytask bench`: its options, the measurements (`measures`) in one run, and the table
printed and written to CSV (see the package's docstring)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pandas as pd
import torch

from .. import store
from ..cpu_dispatch import cpu_model
from ..kernels import build, ops
from ..models.build import build_model
from ..training.devices import resolve_device, run_settings, torch_threads
from . import __doc__ as DESCRIPTION
from .measures import (
    ATTENTIONS,
    IMPLEMENTATIONS,
    QUICK,
    TARGET_ATTENTIONS,
    TARGET_SETTINGS,
    bench_config,
    decoding_speed,
    matmul_rate,
    memory,
    speed,
    time_to_target,
)


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
        prog="python -m copytask bench", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
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
    parser.add_argument(
        "--beams", type=int, nargs="+", default=[], metavar="K", help="also time beam search of these widths"
    )
    parser.add_argument("--beam-sequences", type=int, default=512, help="held-out sequences decoded per width")
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


SHOWN = [
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
SHOWN_TO_TARGET = [
    "target_speedup",
    "target_s_project",
    "target_s_reference",
    "target_steps_project",
    "target_steps_reference",
]


def measure(args: argparse.Namespace, device: torch.device) -> tuple[pd.DataFrame, float]:
    """Every measurement `args` asks for, in one run: the long table (one row per attention, length
    and implementation) and this machine's matmul rate, FLOP/s."""
    longest = max(args.lengths)
    with run_settings(device):  # the steps a run computes: on CUDA full float32 (no TF32), deterministic algorithms
        parts = [
            speed(args.lengths, args.overrides, args.repeats, args.warmup, device, args.attentions),
            memory(args.memory_attentions, longest, args.overrides, args.memory_steps),
        ]
        if args.time_to_target:
            runs_dir = args.csv.parent / "time_to_target"
            parts.append(
                time_to_target(args.target_attentions, longest, args.overrides, args.target_settings, runs_dir)
            )
        rate = matmul_rate(device, args.gemm_size)
    long = parts[0]
    for part in parts[1:]:
        long = long.merge(part, on=["attention", "length", "implementation"], how="left")
    return long, rate


def table_of(long: pd.DataFrame, rate: float, description: str) -> pd.DataFrame:
    """`wide(long)` with each implementation's fraction of the matmul rate and the machine."""
    table = wide(long)
    for name in IMPLEMENTATIONS:
        table[f"matmul_peak_fraction_{name}"] = (
            table[f"gflop_per_step_{name}"] * 1e9 / (table[f"ms_per_step_{name}"] / 1e3) / rate
        )
    table["matmul_gflops"] = rate / 1e9
    table["machine"] = description
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    cfg = bench_config(ATTENTIONS[0], args.lengths[0], args.overrides)
    with torch_threads(cfg.train.threads):
        device = resolve_device(cfg.train.device)
        with torch.random.fork_rng(devices=[]):  # a model built only to ask: its initialisation draws
            fused = ops.runs_fused(build_model(cfg).to(device))
        project = f"fused CPU kernels ({build.build_name_and_flags()[0]})" if fused else "torch ops"
        description = (
            f"{machine(device)}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"device {device}; project on {project}"
        )
        print(f"copytask bench on {description}", file=sys.stderr)
        long, rate = measure(args, device)
        if args.beams:
            with run_settings(device):
                decoding = decoding_speed(
                    args.attentions, max(args.lengths), args.overrides, args.beams, args.beam_sequences, device
                )
    table = table_of(long, rate, description)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    store.atomic_write(args.csv, table.to_csv(index=False))
    shown = SHOWN
    if args.time_to_target:
        shown = SHOWN + SHOWN_TO_TARGET
        trained = table.dropna(subset=["target_settings_project"]).iloc[0]
        print(
            f"time to target with {args.target_settings} settings: project {trained.target_settings_project}; "
            f"reference {trained.target_settings_reference}",
            file=sys.stderr,
        )
    print(f"\n{description}; matmul rate {rate / 1e9:.1f} GFLOP/s ({args.gemm_size}^3 float32)")
    print(table[shown].to_string(index=False, float_format=lambda x: f"{x:.3g}", na_rep="-"))
    if args.beams:
        path = args.csv.with_name(f"{args.csv.stem}_decoding.csv")
        store.atomic_write(path, decoding.assign(machine=description).to_csv(index=False))
        print(f"\ndecoding {args.beam_sequences} held-out sequences at length {max(args.lengths)}: greedy, beam search")
        print(decoding.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
        print(f"written to {path}")
    print(f"\nwritten to {args.csv}")
    return 0

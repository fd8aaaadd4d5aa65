"""The benchmark's smoke run: the CSV has a row per (attention, length) and sensible numbers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch

from copytask.bench import measures
from copytask.bench.command import main, parse
from copytask.bench.measures import (
    ATTENTIONS,
    QUICK,
    REFERENCED,
    bench_config,
    decoding_speed,
    memory,
    setups,
    speed,
    step_flops,
    time_to_target,
)

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)


@pytest.mark.slow  # about 30 s on two idle cores: model set-up, FLOP counting, two fresh processes
def test_quick_bench_writes_the_table(tmp_path):
    csv = tmp_path / "bench.csv"
    threads, random_state = torch.get_num_threads(), torch.random.get_rng_state()
    torch.set_num_threads(threads + 1)  # --quick runs on one thread: the caller's count differs from it
    try:
        assert main(["--quick", "--csv", str(csv)]) == 0
        assert torch.get_num_threads() == threads + 1  # bench's own thread count ends with it
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.random.get_rng_state(), random_state)  # the models were seeded on a fork
    table = pd.read_csv(csv)
    assert sorted(zip(table.attention, table.length)) == sorted((a, n) for a in ATTENTIONS for n in QUICK["lengths"])
    referenced = table.attention.isin(REFERENCED)
    assert not referenced.all()  # scaled_dot, multihead and local attention: the project's only
    assert referenced[table.attention == "transformer"].all()  # the tutorials' Transformer is the reference's
    for name, rows in (("project", table.attention.notna()), ("reference", referenced)):
        for measure in ("ms_per_step", "tokens_per_s", "gflop_per_step", "matmul_peak_fraction"):
            assert (table.loc[rows, f"{measure}_{name}"] > 0).all(), f"{measure}_{name}"
        measured = table.attention.isin(QUICK["memory_attentions"]) & (table.length == max(QUICK["lengths"]))
        assert (table.loc[measured, f"peak_mb_{name}"] > 0).all()
        assert table.loc[~measured, f"peak_mb_{name}"].isna().all()
    assert table.loc[~referenced, "ms_per_step_reference"].isna().all()
    assert (table.speedup[referenced] > 0).all() and (table.matmul_gflops > 0).all()
    general = table[table.attention == "luong_general"].set_index("length").ms_per_step_project
    assert table.vs_luong_general.tolist() == pytest.approx(
        (table.ms_per_step_project / table.length.map(general)).tolist()
    )
    assert table.machine.nunique() == 1


def test_setting_up_a_model_leaves_the_global_random_state_alone():
    cfg = bench_config("luong_general", 5, ["train.batch_size=4"])
    before = torch.random.get_rng_state()
    setups(cfg, torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), before)


def test_the_memory_runs_path_has_this_checkout_first_and_no_empty_entry(monkeypatch):
    """An empty PYTHONPATH entry is the working folder: a child would import a copytask found there."""
    seen = []

    def run(args, env, **kwargs):
        seen.append(env["PYTHONPATH"])
        return subprocess.CompletedProcess(args, 0, stdout='{"peak_mb": 1.0, "train_mb": 0.5}\n')

    monkeypatch.setattr(measures.subprocess, "run", run)
    for caller in (None, "/elsewhere"):
        if caller is None:
            monkeypatch.delenv("PYTHONPATH", raising=False)
        else:
            monkeypatch.setenv("PYTHONPATH", caller)
        memory(["luong_general"], 5, [], 1)
    source = str(Path(measures.__file__).resolve().parents[2])
    assert seen == [source] * 2 + [os.pathsep.join([source, "/elsewhere"])] * 2  # project and reference each


def test_the_step_table_times_the_attentions_asked_and_luong_general():
    """`bench --attentions transformer`: the Transformer's rows and Luong general's (vs_luong_general
    divides by it), both implementations each, and the memory runs default to the same choice."""
    options = parse(["--attentions", "transformer", "train.threads=1"])
    assert options.attentions == options.memory_attentions == ["transformer"] and options.overrides == [
        "train.threads=1"
    ]
    table = speed(
        [3], QUICK["overrides"], repeats=1, warmup=0, device=torch.device("cpu"), attentions=options.attentions
    )
    assert sorted(set(zip(table.attention, table.implementation))) == [
        (a, n) for a in ("luong_general", "transformer") for n in ("project", "reference")
    ]


def test_time_to_target_trains_each_implementation_with_its_own_settings(tmp_path):
    tiny = [
        "train.steps=20",
        "train.eval_every=10",
        "train.target_acc=0",
        "train.batch_size=8",
        "train.eval_size=16",
        "train.progress=false",
    ]
    table = time_to_target(["luong_general"], 5, tiny, "own", tmp_path)
    rows = table.set_index("implementation")
    assert list(rows.index) == ["project", "reference"]
    assert (rows.target_steps == 10).all()  # a target of 0 is met at the first evaluation, and patience is 1
    assert (rows.target_s > 0).all() and (rows.target_trained_s >= rows.target_s).all()
    assert rows.target_settings["project"] == "lr 0.006 onecycle, budget 20"
    assert rows.target_settings["reference"] == "lr 0.001 constant, budget 20"  # tiny's budget comes last


@pytest.mark.parametrize("attention", ["none", "bahdanau", "luong_concat"])
def test_flops_count_the_products_inside_the_fused_kernels(attention):
    """The counter cannot see into the C++ kernels: a step's FLOPs must not depend on them."""
    counted = {}
    for fused in ("true", "false"):
        cfg = bench_config(attention, 6, ["train.batch_size=4", f"train.fused={fused}"])
        project = setups(cfg, torch.device("cpu"))["project"]
        counted[fused] = step_flops(project)
        assert all(module.fused == (fused == "true") for module in project[0].modules() if hasattr(module, "fused"))
    assert counted["true"] == counted["false"] > 0


def test_the_decoding_table_times_greedy_and_each_beam_width_in_the_same_run():
    state = torch.random.get_rng_state()
    table = decoding_speed(["none", "transformer"], 4, QUICK["overrides"], [2, 3], 8, torch.device("cpu"))
    assert sorted(zip(table.attention, table.width)) == [(a, w) for a in ("none", "transformer") for w in (1, 2, 3)]
    assert (table.seconds > 0).all() and table[table.width == 1].vs_greedy.tolist() == [1.0, 1.0]
    assert torch.equal(torch.random.get_rng_state(), state)  # the models' initialisation drew from a fork

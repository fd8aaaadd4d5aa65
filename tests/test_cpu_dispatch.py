"""Issue 87: torch's CPU dispatch is pinned where copytask starts torch (`copytask.cpu_dispatch`), and every
run records what was in force. torch reads its dispatch once, at its first operation, so each run here is a
process of its own, started as users start it: the command line, a parallel sweep's workers, the API. On a
CPU without AVX-512 an unpinned run already computes under AVX2, so these tests pin another level (torch's
`default`) through copytask's own setting and see the run record it and compute other numbers; and they see
a run under the default setting equal, bit for bit, the same run with ATEN_CPU_CAPABILITY=avx2 set by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from copytask import cpu_dispatch
from copytask.store import provenance

from .conftest import TINY, pythonpath

PINS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", cpu_dispatch.SETTING)
AVX2 = cpu_dispatch.unpinnable("avx2") is None  # this CPU can be pinned to AVX2
# the run's numbers besides its time (fused=false: torch's ops, whose kernels the dispatch picks, and no
# build of the fused kernels for another instruction set)
RUN = [*TINY, "train.fused=false"]
# a run at the default sizes long enough for the kernels' rounding to show in its loss: MKL_CBWR=AVX2 (MKL's
# reproducible branch, another path than its own on an AVX2 CPU) and torch's portable kernels each move it in the
# sixth digit, where a tiny run computes the same under either
AS_TRAINED = [
    "train.device=cpu",
    "task.length=10",
    "train.steps=200",
    "train.eval_every=100",
    "train.eval_size=64",
    "train.val_size=64",
    "train.threads=1",
    "train.progress=false",
]
NUMBERS = ("final_loss", "token_acc", "seq_acc", "val_token_acc", "history")


def started(args: list[str], runs_dir: Path, **env: str) -> subprocess.CompletedProcess:
    """`python ARGS` in a fresh process with none of the pin's variables but `env`: the test process's
    own are the pin's (conftest imports copytask), which a child would inherit and keep."""
    clean = {key: value for key, value in os.environ.items() if key not in PINS}
    clean |= {"PYTHONPATH": pythonpath(), "HYDRA_FULL_ERROR": "0", **env}
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=clean, cwd=runs_dir.parent, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done


def trained(runs_dir: Path) -> list[dict]:
    """The metrics.json of every run in `runs_dir`, by run name, each with its history's numbers (`history`)."""
    runs = []
    for path in sorted(runs_dir.glob("*/metrics.json")):
        rows = [line.split(",") for line in path.with_name("history.csv").read_text().splitlines()]
        seconds = rows[0].index("seconds")  # the wall clock, the one column that differs run to run
        runs.append(json.loads(path.read_text()) | {"history": [row[:seconds] + row[seconds + 1 :] for row in rows]})
    return runs


def numbers(metrics: dict) -> dict:
    return {key: metrics[key] for key in NUMBERS}


def train_cli(runs_dir: Path, run: list[str] = RUN, **env: str) -> dict:
    started(["-m", "copytask", "train", *run, f"runs_dir={runs_dir}"], runs_dir, **env)
    [metrics] = trained(runs_dir)
    return metrics


@pytest.mark.slow
@pytest.mark.skipif(not AVX2, reason=f"this CPU cannot be pinned to AVX2: {cpu_dispatch.unpinnable('avx2')}")
def test_the_command_line_pins_avx2_as_if_set_by_hand_and_another_level_computes_other_numbers(tmp_path):
    pinned = train_cli(tmp_path / "pinned", AS_TRAINED)
    by_hand = train_cli(tmp_path / "by_hand", AS_TRAINED, ATEN_CPU_CAPABILITY="avx2")
    portable = train_cli(tmp_path / "default", AS_TRAINED, COPYTASK_CPU_CAPABILITY="default")
    assert (pinned["cpu_capability"], pinned["mkl_enable_instructions"], pinned["onednn_max_cpu_isa"]) == (
        "AVX2",
        "AVX2",
        "AVX2",
    )
    assert pinned["cpu"] == cpu_dispatch.cpu_model()
    assert (
        by_hand["cpu_capability"] == "AVX2" and by_hand["mkl_enable_instructions"] is None
    )  # the user's own: left alone
    assert numbers(pinned) == numbers(by_hand)  # bit for bit
    assert (portable["cpu_capability"], portable["mkl_enable_instructions"], portable["onednn_max_cpu_isa"]) == (
        "DEFAULT",
        "SSE4_2",
        "SSE41",
    )
    assert portable["run"] == pinned["run"]  # the dispatch is recorded, not part of the name
    assert portable["final_loss"] != pinned["final_loss"]  # other kernels, other rounding


@pytest.mark.slow
def test_a_parallel_sweeps_workers_and_the_api_compute_under_the_level_chosen(tmp_path):
    runs_dir = tmp_path / "swept"
    grid = ["hydra/launcher=parallel", "hydra.launcher.n_jobs=2", "seed=0,1", "task.length=3", "attention=none"]
    started(
        ["-m", "copytask", "sweep", *TINY, *grid, f"runs_dir={runs_dir}"], runs_dir, COPYTASK_CPU_CAPABILITY="default"
    )
    swept = trained(runs_dir)
    assert len(swept) == 2 and {metrics["cpu_capability"] for metrics in swept} == {"DEFAULT"}
    api = tmp_path / "api"
    program = f"import copytask; copytask.train(copytask.compose({[*RUN, f'runs_dir={api}']!r}))"
    started(["-c", program], api, COPYTASK_CPU_CAPABILITY="default")
    assert [metrics["cpu_capability"] for metrics in trained(api)] == ["DEFAULT"]


@pytest.mark.slow
def test_where_torch_started_first_the_run_records_what_was_in_force_and_says_so_once(tmp_path):
    runs_dir = tmp_path / "runs"
    runs = [[*RUN, f"runs_dir={runs_dir}", f"seed={seed}"] for seed in (0, 1)]
    program = (
        "import torch; torch.ones(2).sum()\n"  # torch's first operation fixes its dispatch: AVX2 or wider here
        "import copytask\n"
        f"for overrides in {runs!r}: copytask.train(copytask.compose(overrides))"
    )
    done = started(["-c", program], runs_dir, COPYTASK_CPU_CAPABILITY="default")
    in_force = {metrics["cpu_capability"] for metrics in trained(runs_dir)}
    assert len(in_force) == 1 and in_force != {"DEFAULT"}
    said = [line for line in done.stderr.splitlines() if "CPU dispatch is" in line]
    assert len(said) == 1 and "torch ran an operation before copytask was imported" in said[0], done.stderr


def test_a_level_that_is_no_choice_is_refused_in_one_line_before_anything_is_written(tmp_path):
    runs_dir = tmp_path / "runs"
    env = {key: value for key, value in os.environ.items() if key not in PINS}
    env |= {"PYTHONPATH": pythonpath(), "HYDRA_FULL_ERROR": "0", cpu_dispatch.SETTING: "avx9000"}
    done = subprocess.run(
        [sys.executable, "-m", "copytask", "train", *TINY, f"runs_dir={runs_dir}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2 and not runs_dir.exists()
    assert done.stderr.splitlines() == [
        "copytask: error: COPYTASK_CPU_CAPABILITY='avx9000' is not a level copytask pins: "
        "choose one of avx2, default, native"
    ]


@pytest.mark.parametrize(
    ("machine", "flags", "why"),
    [
        ("aarch64", None, "this CPU (aarch64) is not x86, so it has no AVX2"),
        ("x86_64", "fpu sse sse2 sse4_1", "this CPU has no AVX2"),
        ("x86_64", None, "copytask reads a CPU's features on Linux only"),
    ],
    ids=["arm", "x86_without_avx2", "features_unknown"],
)
def test_a_cpu_that_cannot_run_avx2_is_not_pinned_and_the_run_says_why(monkeypatch, tmp_path, machine, flags, why):
    cpuinfo = tmp_path / "cpuinfo"
    if flags is not None:
        cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n")
    monkeypatch.setattr(cpu_dispatch.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu_dispatch, "CPUINFO", cpuinfo)
    environ: dict[str, str] = {}
    cpu_dispatch.pin(environ)
    assert environ == {}  # an AVX2 kernel on a CPU without AVX2 would stop the process
    assert why in cpu_dispatch.unpinnable("avx2")
    note = cpu_dispatch.not_pinned("DEFAULT", environ)
    assert note.startswith("torch's CPU dispatch is DEFAULT, not the AVX2 copytask pins (") and why in note


def test_the_users_own_settings_are_left_alone(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: sse avx avx2 fma avx512f\n")
    monkeypatch.setattr(cpu_dispatch, "CPUINFO", cpuinfo)
    monkeypatch.setattr(cpu_dispatch.platform, "machine", lambda: "x86_64")
    cases = [  # given -> pinned, and whether an AVX-512 dispatch in force would be noted
        ({}, {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, True),
        (
            {"MKL_ENABLE_INSTRUCTIONS": "AVX512"},
            {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX2"},
            True,
        ),
        ({"ATEN_CPU_CAPABILITY": "avx512"}, {"ATEN_CPU_CAPABILITY": "avx512"}, False),  # the user's: no pin at all
        ({cpu_dispatch.SETTING: "native"}, {cpu_dispatch.SETTING: "native"}, False),  # the pin turned off
    ]
    for given, pinned, noted in cases:
        environ = dict(given)
        cpu_dispatch.pin(environ)
        assert environ == pinned, given
        assert (cpu_dispatch.not_pinned("AVX512", environ) is not None) == noted, given


def test_a_table_of_runs_under_different_dispatch_says_so():
    same = {"computation": 1, "commit": "abc", "cpu_capability": "AVX2"}
    line = provenance.mixed_line({"a": same, "b": same | {"cpu_capability": "AVX512"}})
    assert (
        line
        == "note: these runs were made under different CPU dispatch (cpu_capability AVX2: a; cpu_capability AVX512: b)"
    )

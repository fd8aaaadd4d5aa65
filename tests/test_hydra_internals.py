"""The Hydra internals copytask relies on (copytask.hydra_internals), each on a small known case:
a Hydra release that changes them fails here first."""

from __future__ import annotations

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from copytask.config import config_dir
from copytask.hydra_internals import compose, override_args, sweep_jobs


def test_override_args_separates_hydra_flags_from_overrides():
    assert override_args(["--cfg", "job", "seed=1", "task.length=5,10"]) == ["seed=1", "task.length=5,10"]


def test_a_sweep_expands_like_the_basic_sweeper_with_the_command_line_replacing_a_list():
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            master = compose(["experiment=quick", "seed=3,4"], multirun=True)  # quick sweeps attention x length x seed
            jobs, swept = sweep_jobs(master)
            jobs = list(jobs)  # composed as read: while Hydra is initialised
            single = compose(["seed=7"], multirun=False)
    finally:
        GlobalHydra.instance().clear()

    assert swept == {"attention", "task.length", "seed"}
    assert [job[0] for job in jobs][:2] == [
        ["task.length=5", "attention=none", "seed=3", "experiment=quick"],  # the default grid's key order: length first
        ["task.length=5", "attention=none", "seed=4", "experiment=quick"],
    ]
    assert len(jobs) == 2 * 2 * 2
    assert {(config.attention.name, config.task.length, config.seed) for _, config in jobs} == {
        (attention, length, seed) for attention in ("none", "luong_general") for length in (5, 10) for seed in (3, 4)
    }
    assert all(config.model.hidden_size == 32 for _, config in jobs)  # the preset applies to every job
    assert single.seed == 7 and "hydra" in single

"""The Hydra internals copytask relies on (copytask.hydra_internals), each on a small known case:
a Hydra release that changes them fails here first."""

from __future__ import annotations

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from copytask.config.hydra_internals import (
    compose,
    compose_job,
    configs_digest,
    override_args,
    proposes_jobs,
    search_samples,
    search_space,
    sweep_jobs,
)
from copytask.config.schema import config_dir

from .conftest import OPTUNA


def test_override_args_separates_hydra_flags_from_overrides():
    assert override_args(["--cfg", "job", "seed=1", "task.length=5,10"]) == ["seed=1", "task.length=5,10"]


@pytest.mark.slow
def test_a_sweep_expands_like_the_basic_sweeper_with_the_command_line_replacing_a_list():
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            master = compose(["experiment=quick", "seed=3,4"], multirun=True)  # quick sweeps attention x length x seed
            batches, swept = sweep_jobs(master)
            jobs = [(overrides, compose_job(master, overrides)) for overrides in batches]  # while Hydra is initialised
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


@OPTUNA
def test_a_search_space_reads_as_the_optuna_sweeper_reads_it():
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            basic = compose(["experiment=quick"], multirun=True)
            master = compose(["hparams_search=baseline", "train.clip=2", "train.lr=interval(1e-3,1e-2)"], multirun=True)
            fixed, searched = search_space(master)
            samples = search_samples(master)
            job = compose_job(master, [*fixed, *samples])
    finally:
        GlobalHydra.instance().clear()

    assert not proposes_jobs(basic.hydra) and proposes_jobs(master.hydra)
    # the default grid's keys are fixed by the preset; a fixed value on the command line beats the preset's range
    assert (
        fixed[:3] == ["task.length=20", "attention=none", "seed=0"] and "train.clip=2" in fixed
    )  # in the default grid's key order
    # the batch size is not searched: every trial gets the attention models' examples per step
    assert list(searched) == ["train.lr", "train.warmup", "model.hidden_size", "model.bidirectional"]
    assert samples[:3] == [
        "train.lr=0.001",
        "train.warmup=0.05",
        "model.hidden_size=32",
    ]  # the command line's interval replaced the preset's
    assert (job.train.lr, job.train.clip, job.model.hidden_size, job.model.bidirectional) == (0.001, 2, 32, True)


def test_the_configs_digest_follows_the_yaml_files_of_the_search_path_not_where_they_are(tmp_path, monkeypatch):
    """What a sweep records of the configs its grid was composed from (issue 88, part 5): a changed YAML file of a
    searchpath folder changes it; another file, or the same folder named by another path, does not."""
    own = tmp_path / "my_configs" / "experiment"
    own.mkdir(parents=True)
    (own / "mine.yaml").write_text("seed: 0\n")
    monkeypatch.chdir(tmp_path)  # Hydra reads a file:// path from the folder it runs in
    digest = configs_digest(["file://my_configs"])

    assert digest != configs_digest()
    assert configs_digest([f"file://{tmp_path / 'my_configs'}"]) == configs_digest(["my_configs"]) == digest
    (own / "notes.txt").write_text("not a config")
    assert configs_digest(["file://my_configs"]) == digest
    (own / "mine.yaml").write_text("seed: 1\n")
    assert configs_digest(["file://my_configs"]) != digest

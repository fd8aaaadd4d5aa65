"""The store's guarantees: durable atomic writes with the umask's permissions, unfinished runs
recognised as such, and one process per run (docs/reliability.md)."""

from __future__ import annotations

import os
import stat

import pytest

from copytask import store
from copytask.sweep import GridRun
from copytask.train import train

from .conftest import TINY


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)], ids=["022", "027", "002"])
def test_atomic_write_gives_the_permissions_the_umask_gives(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        store.atomic_write(tmp_path / "results.csv", "a,b\n1,2\n")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "results.csv").stat().st_mode) == mode


def test_atomic_write_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    data = b"x" * 10_000
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.fstat(fd).st_size))  # the whole content has reached the file
        fsync(fd)

    def recording_replace(source, target):
        events.append(("replace", os.stat(source).st_size))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    store.atomic_write(tmp_path / "checkpoint.pt", data)

    assert events == [("fsync", len(data)), ("replace", len(data))]
    assert (tmp_path / "checkpoint.pt").read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary file left behind


@pytest.mark.parametrize("keep", [0, 40], ids=["empty", "truncated"])
def test_cut_short_metrics_is_unfinished_and_the_run_is_trained_again(make_config, keep):
    cfg = make_config(*TINY)
    first = train(cfg)
    folder = store.run_dir(cfg)
    metrics = folder / store.METRICS
    metrics.write_text(metrics.read_text()[:keep])  # what a crash before the data reached the disk leaves

    assert not store.is_complete(folder)
    assert GridRun((), "", cfg).status() == "incomplete"  # the sweep's summary agrees
    again = train(cfg)  # trained again from scratch, to the same result
    assert {key: again[key] for key in ("run", "steps", "final_loss", "token_acc")} == {
        key: first[key] for key in ("run", "steps", "final_loss", "token_acc")
    }
    assert store.read_json(metrics) == again

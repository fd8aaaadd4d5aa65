"""The one-node SLURM fixture itself (tests/slurm_cluster.py): it finds the daemons where Debian
puts them whatever PATH says, and installs system packages only when asked."""

from __future__ import annotations

import os
import shutil

import pytest

from . import slurm_cluster


def test_without_the_packages_the_tests_skip_saying_how_unless_asked_to_install(monkeypatch):
    monkeypatch.setattr(slurm_cluster, "installed", lambda: False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.delenv("COPYTASK_SLURM_TESTS", raising=False)
    monkeypatch.delenv(slurm_cluster.INSTALL, raising=False)
    reason = slurm_cluster.unavailable()
    assert reason is not None and "apt-get install slurm-wlm munge" in reason and f"{slurm_cluster.INSTALL}=1" in reason
    monkeypatch.setenv(slurm_cluster.INSTALL, "1")
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kwargs: f"/usr/bin/{name}")  # apt-get is there
    assert slurm_cluster.unavailable() is None  # asked: the fixture installs them


@pytest.mark.skipif(shutil.which("munged", path="/usr/sbin") is None, reason="munge is not installed in /usr/sbin")
def test_the_daemons_are_found_where_path_lacks_the_sbin_folders(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/local/bin:/usr/bin:/bin")  # a fresh shell's, or env -i's
    assert slurm_cluster.daemon("munged") == "/usr/sbin/munged"

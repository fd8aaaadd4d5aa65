"""A real one-node SLURM for the tests: munged, slurmctld and slurmd on this machine, with every
file (slurm.conf, munge key and socket, state, spool, logs) in one temporary folder, started
without systemd and stopped afterwards, leaving no daemon. Where Debian's `slurm-wlm` and `munge`
are missing, they are installed with apt-get only when asked: COPYTASK_INSTALL_SLURM=1 (CI sets it).

It needs root (slurmd starts jobs as their user), so elsewhere `unavailable()` says why and how to
get it (docs/cluster.md: in a root container on a laptop). Jobs see this SLURM through the
SLURM_CONF environment variable that `start` returns: sbatch, squeue, scancel and the jobs' srun
read it, and the jobs inherit it (sbatch exports the submitting environment).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
HOW = "run them as root, e.g. in a Debian container on a laptop: docs/cluster.md#the-tests"
# Where Debian puts the daemons: a user's PATH (and a fresh shell's) often lacks the sbin folders.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
INSTALL = "COPYTASK_INSTALL_SLURM"  # =1: the tests may apt-get install slurm-wlm and munge where they are missing


def unavailable() -> str | None:
    """Why this machine cannot run the SLURM tests (None: it can, installing the packages if asked)."""
    if os.environ.get("COPYTASK_SLURM_TESTS") == "0":
        return "COPYTASK_SLURM_TESTS=0"
    if os.name != "posix" or os.geteuid() != 0:
        return f"the SLURM tests start munged, slurmctld and slurmd, which needs root; {HOW}"
    if installed():
        return None
    if os.environ.get(INSTALL) != "1":
        return (
            f"slurm-wlm and munge are not installed: apt-get install slurm-wlm munge, "
            f"or set {INSTALL}=1 to let the tests do it"
        )
    if shutil.which("apt-get") is None:
        return f"slurm-wlm and munge are not installed and there is no apt-get to install them; {HOW}"
    return None


def daemon(name: str) -> str | None:
    """The path of a SLURM or munge program, on PATH or where Debian installs it."""
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SYSTEM_PATH}")


def installed() -> bool:
    return all(daemon(name) for name in DAEMONS)


def install() -> None:
    """apt-get install slurm-wlm and munge where a daemon is missing (about a minute, once per
    machine), one test process at a time (pytest-xdist's workers would race for dpkg's lock).
    Only where COPYTASK_INSTALL_SLURM=1 asks for it (`unavailable` skips the tests otherwise)."""
    if installed():
        return
    with FileLock(Path(tempfile.gettempdir()) / "copytask-slurm-install.lock"):
        if installed():
            return
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", *PACKAGES], check=True, env=env, capture_output=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def slurm_conf(folder: Path, node: str, cpus: int, memory_mb: int) -> str:
    """One node that is also the controller; no accounting storage (as on many small clusters, and
    what makes submitit's sacct calls fail); a requeued job may start again after 5 s, not the
    default 120 s (`cred_expire`); processes tracked by their parent (no cgroups in a container)."""
    return f"""\
ClusterName=copytask
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge/munge.socket,cred_expire=5
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MinJobAge=300
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@contextmanager
def one_node_slurm(folder: Path, timeout: float = 60.0) -> Iterator[dict[str, str]]:
    """Inside: a running one-node SLURM whose files are all in `folder`; yields the environment
    variables that point clients at it (SLURM_CONF). After: every daemon it started is stopped."""
    folder = Path(folder)
    for sub in ("munge", "state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    node = socket.gethostname().split(".")[0]
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 - 512
    conf = folder / "slurm.conf"
    conf.write_text(slurm_conf(folder, node, os.cpu_count() or 1, memory_mb))
    env = {"SLURM_CONF": str(conf)}
    daemon_env = {**os.environ, **env}
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    started: list[subprocess.Popen] = []
    try:
        munge = folder / "munge"
        started.append(
            subprocess.Popen(
                [
                    daemon("munged"),
                    "--foreground",
                    "--force",
                    f"--key-file={key}",
                    f"--socket={munge}/munge.socket",
                    f"--pid-file={munge}/munged.pid",
                    f"--log-file={munge}/munged.log",
                    f"--seed-file={munge}/munged.seed",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
        wait_for(lambda: (munge / "munge.socket").exists(), timeout, "munged's socket", folder, started)
        started.append(
            subprocess.Popen(
                [daemon("slurmctld"), "-D", "-i", "-f", str(conf)],
                env=daemon_env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
        started.append(
            subprocess.Popen(
                [daemon("slurmd"), "-D", "-f", str(conf)],
                env=daemon_env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )

        def node_idle() -> bool:
            state = subprocess.run(
                [daemon("sinfo"), "--noheader", "--format=%t"], env=daemon_env, capture_output=True, text=True
            )
            return state.stdout.strip() == "idle"

        wait_for(node_idle, timeout, "the node to be idle in sinfo", folder, started)
        yield env
    finally:
        for process in reversed(started):
            process.terminate()
        for process in reversed(started):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_for(condition, timeout: float, what: str, folder: Path, started: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        dead = [process.args[0] for process in started if process.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "".join(f"\n--- {log.name}:\n{log.read_text()[-2000:]}" for log in sorted(folder.rglob("*.log")))
            raise RuntimeError(f"one-node SLURM: waited for {what}; {', '.join(dead) or 'none'} exited{logs}")
        time.sleep(0.5)

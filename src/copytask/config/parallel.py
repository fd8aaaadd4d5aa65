"""How many jobs `hydra/launcher=parallel` runs at once: one one-thread job per core this process may
use, fewer where the memory available would not hold them (`parallel_jobs`). configs/hydra/launcher/
parallel.yaml asks for it as `n_jobs: ${copytask.parallel_jobs:}`, a resolver `schema` registers as it
registers the schema, so the number is read from the machine when the launcher starts (`--cfg all
--resolve` shows it); `hydra.launcher.n_jobs=N` replaces it.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from ..console import ConfigError

RESOLVER = "copytask.parallel_jobs"
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
JOBLIB_LAUNCHER = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"  # what parallel.yaml extends
# A job's resident memory at its peak, in MiB, with a margin: the presets' largest jobs measured with torch's CPU
# build and with its CUDA build, which maps its CUDA libraries even without a GPU (docs/bench.md, "Memory"). The
# margin is for a job's CUDA context on a GPU, which those figures lack.
JOB_MIB = 1536


def parallel_jobs(cores: int, available_mib: float | None, job_mib: float = JOB_MIB) -> int:
    """One job per core, fewer where `available_mib` (None: not known) holds fewer jobs of `job_mib`
    each; at least one."""
    jobs = cores if available_mib is None else min(cores, int(available_mib // job_mib))
    return max(jobs, 1)


def usable_cores() -> int:
    """The cores this process may use, as joblib counts them for its workers' threads (each gets
    OMP_NUM_THREADS = this // n_jobs): the CPU affinity (taskset, a cpuset), a container's CPU quota
    and LOKY_MAX_CPU_COUNT all lower it."""
    from joblib import cpu_count  # the launcher's own library: imported only by a sweep that uses it

    return cpu_count()


def available_mib() -> float | None:
    """The memory new processes can have without swapping, in MiB: Linux's MemAvailable (free memory
    and the caches the kernel can drop); elsewhere the physical memory; None where neither is known.
    A container's memory limit is not read (Linux reports the host's)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or a name this system lacks
        return None


def machine_jobs() -> int:
    """`parallel_jobs` on this machine, now: the resolver's value."""
    return parallel_jobs(usable_cores(), available_mib())


def register_resolver() -> None:
    """Register `${copytask.parallel_jobs:}` with OmegaConf, once per process (the name is copytask's).
    Cached in the config that resolves it, so the launcher and the sweep's progress line read one number."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, machine_jobs, use_cache=True)


def check_n_jobs(launcher: DictConfig) -> None:
    """ConfigError for a joblib launcher's `n_jobs=0`, which joblib refuses only once the sweep has
    started (a negative number is joblib's: -1 one job per core, -2 all cores but one, ...)."""
    if launcher.get("_target_") == JOBLIB_LAUNCHER and launcher.n_jobs == 0:
        raise ConfigError(
            "hydra.launcher.n_jobs=0: the parallel launcher needs at least one job at a time "
            "(leave it out for one per core, as memory allows)"
        )

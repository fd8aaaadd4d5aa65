"""Which device a run uses, and the CUDA settings a run needs to compute what its name says.

A run's identity leaves `train.device` out (`store.NOT_IDENTITY`): a CPU run and a CUDA run of one
config are one run, which holds only if they agree to float rounding. Two CUDA defaults break that:
TF32 (cuBLAS matmuls and cuDNN's GRU round their inputs to 10 bits of mantissa on Ampere and later)
and non-deterministic algorithms (two runs with one seed differ). `run_settings` turns both off for
the duration of a run and puts the previous settings back after it: they are process-wide, and a
library leaves them as it found them.

One setting cannot be made from inside a library: cuBLAS is deterministic only with
`CUBLAS_WORKSPACE_CONFIG=:4096:8` (or `:16:8`) in the environment before the process first calls
cuBLAS, which fixes its workspace for the life of the process. `python -m copytask` sets it for its
own process, and the jobs it launches inherit it; a program that imports copytask sets it itself
(`run_settings` warns once per run where it is missing).
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..config.checks import check_device
from ..config.schema import DETERMINISTIC_CUBLAS


def resolve_device(name: str) -> torch.device:
    """`train.device` (auto | cpu | cuda) -> the device, checked here, on the machine that runs it:
    ConfigError naming this machine if it has no CUDA device for `cuda`."""
    check_device(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def host() -> str:
    """This machine's name: where a run trained (metrics.json `host`), which a SLURM sweep's nodes
    make differ from run to run."""
    return socket.gethostname()


def fused_adam(device: torch.device) -> bool | None:
    """Adam's `fused` argument: one kernel for all parameters on CUDA (a launch per parameter tensor
    otherwise); None on CPU, torch's default, so that CPU runs compute what they always have."""
    return True if device.type == "cuda" else None


def _precision_flags() -> list[tuple[object, str, object]]:
    """(object, attribute, value inside a run) for the float32 precision of matmuls and cuDNN.
    torch >= 2.9 has per-backend `fp32_precision`, and refuses to mix it with the older `allow_tf32`."""
    backends = torch.backends
    if hasattr(backends.cuda.matmul, "fp32_precision"):
        return [
            (backends.cuda.matmul, "fp32_precision", "ieee"),
            (backends.cudnn.conv, "fp32_precision", "ieee"),
            (backends.cudnn.rnn, "fp32_precision", "ieee"),
        ]
    return [(backends.cuda.matmul, "allow_tf32", False), (backends.cudnn, "allow_tf32", False)]


@contextmanager
def run_settings(device: torch.device | str) -> Iterator[None]:
    """Inside the block, on CUDA: full float32 (no TF32) in matmuls and cuDNN, and deterministic
    algorithms (cuDNN's, and torch's `use_deterministic_algorithms`, in warn-only mode: an op with no
    deterministic version warns, naming itself, rather than stopping a run). Everything is restored on
    leaving. On other devices (`auto` resolved here) it changes nothing: CPU runs compute what they
    always have."""
    if not isinstance(device, torch.device):
        device = resolve_device(device)
    if device.type != "cuda":
        yield
        return
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in DETERMINISTIC_CUBLAS:
        warnings.warn(
            "copytask: CUBLAS_WORKSPACE_CONFIG is not set, so cuBLAS may make this CUDA run irreproducible; "
            f"set CUBLAS_WORKSPACE_CONFIG={DETERMINISTIC_CUBLAS[0]} in the environment before the process "
            "first uses CUDA (`python -m copytask` does)"
        )
    flags = [
        *_precision_flags(),
        (torch.backends.cudnn, "deterministic", True),
        (torch.backends.cudnn, "benchmark", False),
    ]
    previous = [getattr(owner, name) for owner, name, _ in flags]
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        for owner, name, value in flags:
            setattr(owner, name, value)
        torch.use_deterministic_algorithms(True, warn_only=True)
        yield
    finally:
        for (owner, name, _), value in zip(flags, previous):
            setattr(owner, name, value)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


def cpu_despite_gpus(gpus_per_node: int | None, trained_on: list[str | None]) -> str | None:
    """The warning for a sweep whose launcher gave each job GPUs (`hydra.launcher.gpus_per_node`)
    while some of its runs trained on CPU (`trained_on`: each complete run's metrics.json `device`):
    with `train.device=auto` a node whose torch has no CUDA trains on CPU without a word. None if
    nothing to say."""
    on_cpu = sum(device == "cpu" for device in trained_on)
    if not gpus_per_node or not on_cpu:
        return None
    return (
        f"{on_cpu} of {len(trained_on)} complete runs trained on CPU although "
        f"hydra.launcher.gpus_per_node={gpus_per_node}: "
        "the nodes' torch may be a CPU-only build (torch.version.cuda is None); train.device=cuda makes such a job "
        "fail, naming its node, instead"
    )


def thread_count(threads: int | None) -> int:
    """The torch CPU threads a run uses: `train.threads`, or where it is null the OMP_NUM_THREADS that
    a launcher (joblib: cores / jobs; SLURM: the CPUs a job got) or the user set, else one. torch's
    own default, every core, spin-waits its OpenMP threads for one another when anything else needs
    a core, so runs that share a machine slow each other down many times over; one thread each, they
    hardly do (scripts/bench_threads.py; docs/bench.md, Threads and a shared machine)."""
    if threads:
        return threads
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else 1


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Inside: `threads` torch CPU threads (None: as they are); after: as they were."""
    previous = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def torch_state(threads: int | None, device: torch.device) -> Iterator[None]:
    """Inside: `thread_count(threads)` torch CPU threads and torch's global random state forked (the
    CPU's, and `device`'s own if it is a GPU), so that the run can seed and draw from it; after:
    both as they were. Only the run's device: forking every GPU's state would start CUDA on each of
    them, also for a CPU run on a GPU machine."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch_threads(thread_count(threads)):
        yield


def gpu_name() -> str | None:
    import torch  # by now the jobs have imported it, if they ran in this process

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None

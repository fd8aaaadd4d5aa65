"""Building and loading copytask's fused CPU kernels (`csrc/`, used by `kernels.ops`).

The kernels are compiled by torch.utils.cpp_extension the first time they are needed (30-60 s),
or ahead of time by `python -m copytask build`, under $TORCH_EXTENSIONS_DIR or
`torch.utils.cpp_extension.get_default_build_root()`, in a folder named after a hash of the
sources, the compiler flags and the torch and Python versions: a build is made once and never
replaced, so checkouts and virtual environments sharing a machine never rebuild each other's.
That needs a C++ compiler and ninja. Where they cannot be built, one warning says why and the
torch code runs. Loading them changes no process-wide setting; they keep one freed buffer (the
additive score's tanh saved for the backward pass, csrc/common.h) for their next call.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import json
import logging
import os
import platform
import shutil
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from types import ModuleType

import filelock
import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = [
    CSRC / name
    for name in ("bindings.cpp", "gru.cpp", "additive.cpp", "bahdanau.cpp", "attention.cpp", "layers.cpp", "mamba.cpp")
]
# -ffast-math lets the compiler vectorise the sums over a row; it is a compile flag only, so
# the library is not linked with the start-up code that would set flush-to-zero for the process.
# -fno-finite-math-only keeps NaN and inf meaning what they mean, so that they propagate as in torch.
CFLAGS = ["-O3", "-ffast-math", "-fno-finite-math-only"]
# AVX2 and FMA make the kernels' loops faster where the CPU has them (torch says whether it does;
# docs/bench.md, Speed levers); the build is named after the instruction set, so machines that share
# a home directory (a cluster's nodes) never load a build their CPU cannot run.
AVX2 = ("AVX2", "AVX512")
# How long to wait for another process's build (one takes 30-60 s) before going on without the
# kernels: a process holding the lock that long is stuck, and training must not hang on it.
BUILD_WAIT_S = 600.0
RETRY = "retry with `python -m copytask build`"


def build_name_and_flags() -> tuple[str, list[str]]:
    """The build's name and its compiler flags. The name ends in a hash of everything the library
    depends on (sources, flags, the CPU architecture, torch and Python versions), so a build is
    never replaced, and nodes of different kinds that share a home directory each have their own."""
    avx2 = torch.backends.cpu.get_cpu_capability() in AVX2
    flags = [*CFLAGS, "-mavx2", "-mfma"] if avx2 else CFLAGS
    key = hashlib.sha256()
    for part in (
        torch.__version__,
        str(torch.version.git_version),
        sys.implementation.cache_tag,
        platform.machine(),
        *flags,
    ):
        key.update(part.encode() + b"\0")
    for path in sorted(CSRC.iterdir()):
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"copytask_kernels{'_avx2' if avx2 else ''}_{key.hexdigest()[:16]}", flags


@contextmanager
def _quiet_torch_builder() -> Iterator[None]:
    """torch's C++ extension builder without its log records below ERROR: on a CUDA build of torch
    without a GPU its import logs "No CUDA runtime is found, using CUDA_HOME=...", which says
    nothing about these CPU-only kernels, and a build logs its compiler banners (a failed build is
    reported by `kernel()`, once, in one line). The logger's level is restored after."""
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        torch_log.setLevel(level)


def _cpp_extension() -> ModuleType:
    # torch 2.7 prints the CUDA_HOME line to stderr at import (2.11 and 2.13 log it)
    with _quiet_torch_builder(), redirect_stderr(io.StringIO()):
        from torch.utils import cpp_extension
    return cpp_extension


def build_root() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or _cpp_extension().get_default_build_root())


def toolchain() -> str:
    """What a build depends on besides its sources and flags: the compiler and ninja torch would call."""
    return json.dumps({"cxx": shutil.which(os.environ.get("CXX", "c++")), "ninja": shutil.which("ninja")})


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled kernels, or None (after one warning that says why) where they cannot be built.
    A failed build is remembered in the build root until the toolchain changes, so that a machine
    without a compiler does not try again, and warn at length, in every run."""
    name, flags = build_name_and_flags()
    directory = build_root() / name
    failed, lock = directory.with_name(name + ".failed"), directory.with_name(name + ".lock")
    try:
        remembered = json.loads(failed.read_text())
        if remembered["toolchain"] == toolchain():
            warnings.warn(
                f"copytask: the fused CPU kernels did not build on this machine ({remembered['reason']}); "
                f"using torch's ops, slower on CPU; {RETRY}"
            )
            return None
    except (OSError, ValueError, KeyError, TypeError):  # no failure remembered (or an unreadable note): build
        pass
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        # An OS lock (flock): released when its holder exits, however it exits.
        with filelock.FileLock(lock, timeout=BUILD_WAIT_S):
            return _load(name, flags, directory)
    except filelock.Timeout:
        warnings.warn(
            f"copytask: another process has held {lock} for {BUILD_WAIT_S:.0f} s, building the fused CPU "
            "kernels; using torch's ops, slower on CPU"
        )
    except Exception as error:  # no compiler, no ninja, unsupported platform: the torch code still works
        compiler = os.environ.get("CXX", "c++")
        reason = failure_reason(error)
        if shutil.which(compiler) is None:
            reason = f"no C++ compiler: {compiler!r} is not on PATH"
        failed.write_text(json.dumps({"toolchain": toolchain(), "reason": reason}))
        warnings.warn(
            f"copytask: could not build the fused CPU kernels ({reason}); using torch's ops, slower on CPU; {RETRY}"
        )
    return None


def failure_reason(error: Exception) -> str:
    """One line on why a build failed: the compiler's first error where it gave one (a failed build's
    message starts with the compiler's command line), else the message's first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    compiled = [line for line in lines if " error: " in line or line.startswith("error: ")]
    return (compiled or lines or [type(error).__name__])[0][:240]


def _load(name: str, flags: list[str], directory: Path) -> ModuleType:
    """Import the build in `directory`, or make it there first. Called holding the build's lock."""
    if (directory / "lock").exists():  # torch's own lock, left by a build killed midway: its files cannot be trusted
        shutil.rmtree(directory)
    library = directory / f"{name}.so"
    if not library.exists():
        print(
            f"copytask: compiling the fused CPU kernels into {directory} (once: a minute or two)",
            file=sys.stderr,
            flush=True,
        )
        directory.mkdir(exist_ok=True)  # a failed build leaves its folder
        with _quiet_torch_builder(), warnings.catch_warnings():  # a failure is reported by kernel(), once, in one line
            warnings.simplefilter("ignore")
            return _cpp_extension().load(
                name, [str(path) for path in SOURCES], extra_cflags=flags, build_directory=str(directory), verbose=False
            )
    # Imported as it is, without asking ninja whether it is up to date: its name says what it was built from, and
    # another checkout's identical sources (other paths) would make ninja rebuild a library someone has loaded.
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def retry_build() -> None:
    """Forget a remembered failed build, so that the next `kernel()` tries again."""
    name = build_name_and_flags()[0]
    (build_root() / f"{name}.failed").unlink(missing_ok=True)
    kernel.cache_clear()

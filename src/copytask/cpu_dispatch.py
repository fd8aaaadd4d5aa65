"""torch's CPU dispatch, pinned before torch starts: the same digits on every x86 machine.

torch chooses its vectorised CPU kernels once, at its first operation: the level ATEN_CPU_CAPABILITY names,
else the widest the CPU runs (AVX-512 on some x86 CPUs, AVX2 on most). MKL and oneDNN choose their own paths
the same way, up to the instruction set MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA allow. (Not MKL_CBWR:
its reproducible AVX2 branch is another path than MKL's own on an AVX2 CPU, and moved README's Luong general
at length 10 on one, seed 0 from 99.61% to 99.00%.) Kernels of another width round differently, and training is
chaotic: on an AVX-512 CPU README's table came back in 2 of its 15 rows, and in all 15 under AVX2's kernels.
So `import copytask` pins all three to AVX2 (`pin`) where the CPU has it, each unless the user has set it,
and leaves them all alone where the user has set ATEN_CPU_CAPABILITY. The command line, the jobs a sweep
launches (each imports copytask before torch) and a program that imports copytask before torch's first
operation compute under it; each run records what was in force (`store.provenance`).

COPYTASK_CPU_CAPABILITY chooses the level: `avx2` (the default), `default` (torch's portable kernels) or
`native` (no pin: torch's own choice, the widest; docs/bench.md gives its speed). This is the one
process-wide setting copytask makes on import: the libraries read these variables at their first use, so
they cannot be set for a run and put back after it.
"""

from __future__ import annotations

import os
import platform
from collections.abc import MutableMapping
from pathlib import Path

SETTING = "COPYTASK_CPU_CAPABILITY"
NATIVE = "native"  # no pin
# copytask's level -> the variables that pin it, in torch's, MKL's and oneDNN's words (the last two on x86 only)
LEVELS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}
CHOICES = (*LEVELS, NATIVE)
TORCH = "ATEN_CPU_CAPABILITY"
X86 = ("x86_64", "amd64", "i386", "i686")
CPUINFO = Path("/proc/cpuinfo")


def level(environ: MutableMapping[str, str] = os.environ) -> str:
    """The level COPYTASK_CPU_CAPABILITY chooses (`avx2` where unset), as given: `check_setting` refuses
    one that is not a choice."""
    return environ.get(SETTING, "avx2").strip().lower() or "avx2"


def check_setting(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Why COPYTASK_CPU_CAPABILITY cannot be used, in one line; None where it can."""
    if level(environ) in CHOICES:
        return None
    return f"{SETTING}={environ[SETTING]!r} is not a level copytask pins: choose one of {', '.join(CHOICES)}"


def pin(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set the chosen level's variables in `environ`, each unless it is set: nothing where the user set
    ATEN_CPU_CAPABILITY, chose `native` or no level, or where the CPU cannot run the level (`unpinnable`)."""
    chosen = level(environ)
    if TORCH in environ or chosen not in LEVELS or unpinnable(chosen):
        return
    x86 = platform.machine().lower() in X86
    for key, value in LEVELS[chosen].items():
        if key == TORCH or x86:
            environ.setdefault(key, value)


def unpinnable(chosen: str) -> str | None:
    """Why this CPU cannot be pinned to `chosen` (a key of LEVELS), in a few words; None where it can. AVX2
    needs an x86 CPU whose features this can read without torch (Linux's /proc/cpuinfo) and that has AVX2
    and FMA (what torch asks of its AVX2 kernels): torch takes ATEN_CPU_CAPABILITY at its word, and an AVX2
    kernel on a CPU without it would stop the process."""
    if chosen != "avx2":
        return None
    machine = platform.machine() or "unknown"
    if machine.lower() not in X86:
        return f"this CPU ({machine}) is not x86, so it has no AVX2"
    flags = cpu_field("flags")
    if flags is None:
        return f"copytask reads a CPU's features on Linux only ({platform.system()} here): set {TORCH}=avx2 yourself"
    if not {"avx2", "fma"} <= set(flags.split()):
        return "this CPU has no AVX2"
    return None


def cpu_field(name: str) -> str | None:
    """The first processor's field `name` in Linux's /proc/cpuinfo; None where there is none."""
    if not CPUINFO.is_file():
        return None
    for line in CPUINFO.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def cpu_model() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    return cpu_field("model name") or platform.processor() or platform.machine()


def not_pinned(capability: str, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Where torch's CPU dispatch in force (`capability`, as torch.backends.cpu names it) is not the level
    copytask pins, the line that says so and why; None where it is, or where the user chose it (their own
    ATEN_CPU_CAPABILITY, or `native`)."""
    chosen = level(environ)
    if chosen not in LEVELS or environ.get(TORCH, "").lower() not in ("", LEVELS[chosen][TORCH]):
        return None
    if capability.lower() == LEVELS[chosen][TORCH]:
        return None
    why = unpinnable(chosen) or "torch ran an operation before copytask was imported"
    return (
        f"torch's CPU dispatch is {capability}, not the {chosen.upper()} copytask pins ({why}): runs trained "
        f"here may not give the digits of runs under {chosen.upper()}"
        + (", README's table among them" if chosen == "avx2" else "")
    )

"""The first runs of copytask on a GPU, prepared for a machine lent for a few minutes:

    python scripts/gpu_check.py [--out runs/gpu_check] [--parts check bench sweep suite]

- check: trains one run per attention setting (configs/attention), the Transformer and Mamba at length 40
  (`--length`) on cuda, every training step under torch.cuda.set_sync_debug_mode("error"), so that a host sync in
  a step stops its run; trains Luong general again on cuda (is a CUDA run reproducible?) and once on cpu (how far
  apart are the devices after training?); greedy-decodes one run's held-out set on cuda and on cpu,
  analyses it on cuda, and decodes it with `python -m copytask decode` (a GPU checkpoint on the CPU);
- bench: `python -m copytask bench --lengths 80` on cuda and on cpu;
- sweep: README's default sweep (45 runs) on cuda with the parallel launcher, timed, and its table;
- suite: the fast tests (`pytest -m "not slow"`), tests/test_cuda.py among them;
then prints the tables for docs/bench.md. Each of sweep and suite stops at its time limit
(--sweep-limit 240 s, --suite-limit 180 s) and says how far it got (not a failure: the exit status
is 1 only where a part failed), so that the whole fits a lent machine's 15 minutes with its start
(the parts' times: docs/bench.md). Refuses in one line without CUDA; `--device cpu` rehearses it
all on a machine without one (cpu against cpu, and no sync check).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ["--lengths", "80"]
MEMORY_ATTENTIONS = ["bahdanau", "luong_general"]  # the peak-memory children: each starts CUDA afresh (seconds)
PARTS = ("check", "bench", "sweep", "suite")


def run_logged(command: list[str], log: Path, limit: float | None = None) -> tuple[int | None, str, float]:
    """Run `command` in ROOT with this checkout's sources, its output appended to `log`:
    (exit status, or None if it passed `limit` seconds and was stopped with its children; output; seconds)."""
    paths = [str(ROOT / "src"), os.environ.get("PYTHONPATH")]  # an empty entry would put the working folder first
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path)}
    started = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=limit)
        status = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the command and the workers it started
        output, _ = process.communicate()
        status = None
    with open(log, "a") as file:
        file.write(f"$ {' '.join(command)}\n{output}\n")
    return status, output, time.perf_counter() - started


def copytask(*args: str, out: Path, limit: float | None = None) -> tuple[int | None, str, float]:
    """`python -m copytask ARGS`, logged to OUT/<command>.log."""
    return run_logged([sys.executable, "-m", "copytask", *args], out / f"{args[0]}.log", limit)


def training_check(out: Path, device: str, steps: int, length: int, started: float) -> tuple[list[str], bool]:
    """The check part on `device` (cuda; cpu rehearses it): (its report's lines, whether every run trained)."""
    import pandas as pd
    import torch
    from hydra import compose, initialize_config_dir

    from copytask import store
    from copytask.config.schema import config_dir
    from copytask.data import splits
    from copytask.evaluation import analysis
    from copytask.evaluation.load import load_run
    from copytask.models.greedy import evaluate
    from copytask.training import loop

    step = loop.train_step

    def checked_step(*step_args):
        torch.cuda.set_sync_debug_mode("error")  # a host sync inside the step raises
        try:
            return step(*step_args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    if device == "cuda":
        loop.train_step = checked_step  # what train() calls every step: this script's process only

    attentions = sorted(path.stem for path in (Path(config_dir()) / "attention").glob("*.yaml"))
    models = {name: [f"attention={name}"] for name in attentions} | {
        "transformer": ["model=transformer"],
        "mamba": ["model=mamba"],
    }

    def config(name: str, on: str, runs: str):
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            return compose(
                "config",
                overrides=[
                    *models[name],
                    f"task.length={length}",
                    f"train.device={on}",
                    f"train.steps={steps}",
                    "train.eval_every=100",
                    "train.progress=false",
                    "train.patience=null",
                    "retrain=true",
                    f"runs_dir={out / runs}",
                ],
            )

    def run(attention: str, on: str, runs: str) -> dict:
        cfg = config(attention, on, runs)
        try:
            metrics = loop.train(cfg)
            error = ""
        except Exception as failure:  # noqa: BLE001 - one setting's failure is a finding, not the end of the check
            metrics, error = {}, f"{type(failure).__name__}: {str(failure).splitlines()[0][:120]}"
        history = store.run_dir(cfg) / store.HISTORY
        return {
            "attention": attention,
            "device": on,
            "error": error,
            "folder": store.run_dir(cfg),
            "history": pd.read_csv(history) if history.is_file() and not error else None,
            **metrics,
        }

    gpu = device
    rows = [run(name, gpu, gpu) for name in models]
    print(f"trained {len(rows)} runs on {gpu} ({time.perf_counter() - started:.0f} s)", flush=True)
    again = run("luong_general", gpu, f"{gpu}_again")
    on_cpu = run("luong_general", "cpu", "cpu")
    first = next(row for row in rows if row["attention"] == "luong_general")
    print(f"trained Luong general again on {gpu} and on cpu ({time.perf_counter() - started:.0f} s)", flush=True)

    # decoding on both devices, analysis on cuda, the decode command on the CPU
    folder = first["folder"]
    agree, analysed, decoded = "-", "-", "-"
    if not first["error"]:
        cfg = config("luong_general", gpu, gpu)
        tokens = {}
        for on in (gpu, "cpu"):
            model, _ = load_run(folder, device=on)
            tokens[on] = evaluate(model, splits.test_batch(cfg).to(on))["tokens"].cpu()
        agree = f"{int((tokens[gpu] == tokens['cpu']).all(1).sum())} of {len(tokens['cpu'])}"
        analysis.analyze([folder], lengths=[length], eval_size=128, progress=False, device=gpu)
        recorded = store.read_json(folder / store.ANALYSIS) if (folder / store.ANALYSIS).is_file() else {}
        drop = recorded.get("drop", {}).get("uniform", float("nan"))
        analysed = f"device {recorded.get('device')}, drop under uniform {drop:.3f}"
        status, output, _ = copytask("decode", str(folder), "--random", "2", "--length", str(length), out=out)
        decoded = "ok" if status == 0 else f"exit {status}: {output.strip().splitlines()[-1:]}"

    watched = '`torch.cuda.set_sync_debug_mode("error")`' if gpu == "cuda" else "no sync check (a CPU rehearsal)"
    lines = [
        f"Training at length {length}, {steps} steps, every step under {watched}:",
        "",
        "| attention | device | token acc | seq acc | train s | ms per step (with build) | fused | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in [*rows, again, on_cpu]:
        if row["error"]:
            lines.append(f"| {row['attention']} | {row['device']} | - | - | - | - | - | {row['error']} |")
        else:
            lines.append(
                f"| {row['attention']} | {row['device']} | {row['token_acc']:.3f} | {row['seq_acc']:.3f} "
                f"| {row['train_seconds']:.1f} "
                f"| {1e3 * row['train_seconds'] / row['steps']:.1f} | {row['fused']} | no host sync in a step |"
            )

    def same(a: dict, b: dict) -> str:
        if a["history"] is None or b["history"] is None:
            return "-"
        loss = (a["history"].loss - b["history"].loss).abs().max()
        return "identical" if loss == 0 else f"differ (largest loss difference {loss:.2e})"

    lines += [
        "",
        f"- Luong general twice on {gpu}, one seed: {same(first, again)}",
        f"- Luong general on {gpu} against cpu: {same(first, on_cpu)}",
        f"- greedy outputs on the held-out set, {gpu} against cpu (same checkpoint): {agree} sequences identical",
        f"- analysis on {gpu}: {analysed}; `copytask decode` of the {gpu} checkpoint on CPU: {decoded}",
    ]
    return lines, not any(row["error"] for row in [*rows, again, on_cpu])


def bench_tables(out: Path, gpu: str, started: float) -> tuple[list[str], bool]:
    """The bench part: `bench --lengths 80` on `gpu` (cuda; cpu rehearses it) and on cpu, side by side."""
    import pandas as pd

    benches = []
    for device in (gpu, "cpu"):
        csv = out / f"bench_{device}_{len(benches)}.csv"
        status, _, _ = copytask(
            "bench",
            f"train.device={device}",
            *BENCH,
            "--memory-attentions",
            *MEMORY_ATTENTIONS,
            "--csv",
            str(csv),
            out=out,
        )
        benches.append(pd.read_csv(csv) if status == 0 else None)
        done = "done" if status == 0 else "failed, see bench.log"
        print(f"bench on {device}: {done} ({time.perf_counter() - started:.0f} s)", flush=True)
    if any(table is None for table in benches):
        return ["bench failed: see bench.log"], False
    cuda, cpu = (table.set_index("attention") for table in benches)
    lines = [
        f"`python -m copytask bench --lengths 80` (batch {int(cpu.batch_size.iloc[0])}); "
        f"cuda: {cuda.machine.iloc[0]}; cpu: {cpu.machine.iloc[0]}",
        "",
        "| attention | cuda ms/step | cpu ms/step | cpu / cuda | cuda reference ms/step "
        "| cuda speedup vs reference | cuda GFLOP/step | cuda peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for attention in cuda.index:
        c, p = cuda.loc[attention], cpu.loc[attention]
        lines.append(
            f"| {attention} | {c.ms_per_step_project:.1f} | {p.ms_per_step_project:.1f} "
            f"| {p.ms_per_step_project / c.ms_per_step_project:.2f} "
            f"| {c.ms_per_step_reference:.1f} | {c.speedup:.2f} | {c.gflop_per_step_project:.3f} "
            f"| {c.peak_mb_project:.0f} |"
        )
    return lines, True


def verdict(status: int | None, failures: bool = False) -> bool | None:
    """A part's verdict from its exit status: True (ok), False (failed) or None (stopped at its time limit
    with nothing failed so far: how far it got is the measurement)."""
    return None if status is None and not failures else status == 0 and not failures


def default_sweep(out: Path, device: str, jobs: int, limit: float, extra: list[str]) -> tuple[list[str], bool | None]:
    """The sweep part: README's default sweep on `device`, timed, then its `compare` table."""
    runs_dir = out / "sweep"
    launcher = ["hydra/launcher=parallel", f"hydra.launcher.n_jobs={jobs}"]
    status, _, seconds = copytask(
        "sweep", f"train.device={device}", *launcher, f"runs_dir={runs_dir}", *extra, out=out, limit=limit
    )
    finished = len(list(runs_dir.glob("*/metrics.json")))
    ended = f"exit {status}" if status is not None else f"stopped at its {limit:.0f} s limit"
    lines = [
        f"`python -m copytask sweep train.device={device} {' '.join(launcher + extra)}`: {finished} runs finished "
        f"in {seconds:.0f} s ({ended})",
    ]
    _, table, _ = copytask("compare", f"runs_dir={runs_dir}", out=out)
    return [*lines, "", *table.rstrip().splitlines()], verdict(status)


def fast_suite(out: Path, jobs: int, limit: float) -> tuple[list[str], bool | None]:
    """The suite part: `pytest -m "not slow"`, its failures and its summary line."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "not slow",
        "-n",
        str(jobs),
        "-q",
        "-rfE",
        "-p",
        "no:cacheprovider",
    ]
    status, output, seconds = run_logged(command, out / "pytest.log", limit)
    failed = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    summary = output.strip().splitlines()[-1:] if output.strip() else ["(no output)"]
    ended = f"exit {status}" if status is not None else f"stopped at its {limit:.0f} s limit"
    line = f"`{' '.join(command[1:])}` in {seconds:.0f} s ({ended}): {summary[0]}"
    return [line, *failed], verdict(status, bool(failed))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: rehearse it all without a GPU")
    parser.add_argument("--steps", type=int, default=200, help="check: training steps per run (evaluated every 100)")
    parser.add_argument("--length", type=int, default=40, help="check: the copy task's length")
    parser.add_argument("--sweep-jobs", type=int, default=12, help="sweep: jobs side by side")
    parser.add_argument("--sweep-limit", type=float, default=240, help="sweep: seconds before it is stopped")
    parser.add_argument("--sweep-args", nargs="*", default=[], help="sweep: more overrides (a smaller grid)")
    parser.add_argument("--suite-jobs", type=int, default=8, help="suite: pytest-xdist workers")
    parser.add_argument("--suite-limit", type=float, default=180, help="suite: seconds before it is stopped")
    args = parser.parse_args()
    # Before torch touches CUDA: cuBLAS fixes its workspace at its first call (training.devices).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    host = socket.gethostname()
    if args.device == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        print(
            f"gpu_check: error: {host} has no CUDA device (torch {torch.__version__}, {build}); "
            "run this where one is, or rehearse it here with --device cpu",
            file=sys.stderr,
        )
        return 2

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "no GPU (rehearsal on cpu)"
    print(
        f"gpu_check on {host}: {gpu}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{os.cpu_count()} CPU cores; parts: {' '.join(args.parts)}",
        flush=True,
    )
    status, _, _ = copytask("build", out=out)
    print(f"fused CPU kernels: {'built' if status == 0 else 'not built (CPU runs use torch ops)'}", flush=True)

    parts = {
        "check": lambda: training_check(out, args.device, args.steps, args.length, started),
        "bench": lambda: bench_tables(out, args.device, started),
        "sweep": lambda: default_sweep(out, args.device, args.sweep_jobs, args.sweep_limit, args.sweep_args),
        "suite": lambda: fast_suite(out, args.suite_jobs, args.suite_limit),
    }
    report, passed = [f"## GPU check: {gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, host {host}"], True
    for part in args.parts:
        lines, ok = parts[part]()
        passed &= ok is not False
        report += ["", f"### {part}", "", *lines]
        said = {True: "ok", False: "FAILED", None: "stopped at its time limit"}[ok]
        print(f"{part}: {said} ({time.perf_counter() - started:.0f} s)", flush=True)
    print("\n" + "\n".join(report))
    print(f"\ngpu_check: {time.perf_counter() - started:.0f} s in all; logs and CSVs in {out}")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())

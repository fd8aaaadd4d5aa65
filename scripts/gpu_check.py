"""The first run of copytask on a GPU (issue 20), prepared for a machine lent for a few minutes:

    python scripts/gpu_check.py [--out runs/gpu_check] [--steps 200]

1. trains one run per attention setting (configs/attention) at length 40 on cuda, every training
   step under torch.cuda.set_sync_debug_mode("error"), so that a host sync in a step stops its run;
2. trains Luong general again on cuda (same seed: is a CUDA run reproducible?) and once on cpu
   (how far apart are the devices after training?);
3. greedy-decodes the held-out set of one run on cuda and on cpu, analyses it on cuda, and decodes
   it with `python -m copytask decode` (a checkpoint saved on a GPU, loaded on the CPU);
4. runs `python -m copytask bench --lengths 80` on cuda and on cpu;
then prints the tables for docs/bench.md. Under 5 minutes on one GPU and 16 cores (the kernel
build, if the machine has not made it, adds up to a minute). Refuses in one line without CUDA.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LENGTH = 40
BENCH = ["--lengths", "80"]
MEMORY_ATTENTIONS = ["bahdanau", "luong_general"]  # the peak-memory children: each starts CUDA afresh (seconds)


def copytask(*args: str, out: Path) -> subprocess.CompletedProcess:
    """`python -m copytask ARGS` with this checkout's sources; its output goes to OUT/<command>.log too."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "copytask", *args], capture_output=True, text=True, env=env, cwd=ROOT
    )
    with open(out / f"{args[0]}.log", "a") as log:
        log.write(f"$ python -m copytask {' '.join(args)}\n{result.stdout}{result.stderr}\n")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (evaluated every 100)")
    args = parser.parse_args()
    # Before torch touches CUDA: cuBLAS fixes its workspace at its first call (copytask.devices).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        print(
            f"gpu_check: error: {socket.gethostname()} has no CUDA device (torch {torch.__version__}, {build}); "
            "run this where one is",
            file=sys.stderr,
        )
        return 2

    import pandas as pd
    from hydra import compose, initialize_config_dir

    from copytask import store
    from copytask.config.schema import config_dir
    from copytask.evaluation import analysis
    from copytask.models import build
    from copytask.training import loop, splits

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    gpu = torch.cuda.get_device_name(0)
    print(
        f"gpu_check on {socket.gethostname()}: {gpu}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"cuDNN {torch.backends.cudnn.version()}, {os.cpu_count()} CPU cores",
        flush=True,
    )
    built = copytask("build", out=out)
    print(
        f"fused CPU kernels: {'built' if built.returncode == 0 else 'not built (CPU runs use torch ops)'}", flush=True
    )

    step = loop.train_step

    def checked_step(*step_args):
        torch.cuda.set_sync_debug_mode("error")  # a host sync inside the step raises
        try:
            return step(*step_args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    loop.train_step = checked_step  # what train() calls every step: this script's process only

    def config(attention: str, device: str, runs: str):
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            return compose(
                "config",
                overrides=[
                    f"attention={attention}",
                    f"task.length={LENGTH}",
                    f"train.device={device}",
                    f"train.steps={args.steps}",
                    "train.eval_every=100",
                    "train.progress=false",
                    "train.patience=null",
                    "retrain=true",
                    f"runs_dir={out / runs}",
                ],
            )

    def run(attention: str, device: str, runs: str) -> dict:
        cfg = config(attention, device, runs)
        try:
            metrics = loop.train(cfg)
            error = ""
        except Exception as failure:  # noqa: BLE001 - one setting's failure is a finding, not the end of the check
            metrics, error = {}, f"{type(failure).__name__}: {str(failure).splitlines()[0][:120]}"
        history = store.run_dir(cfg) / store.HISTORY
        return {
            "attention": attention,
            "device": device,
            "runs": runs,
            "error": error,
            "folder": store.run_dir(cfg),
            "history": pd.read_csv(history) if history.is_file() and not error else None,
            **metrics,
        }

    attentions = sorted(path.stem for path in (Path(config_dir()) / "attention").glob("*.yaml"))
    rows = [run(attention, "cuda", "cuda") for attention in attentions]
    print(f"trained {len(rows)} runs on cuda ({time.perf_counter() - started:.0f} s)", flush=True)
    again = run("luong_general", "cuda", "cuda_again")
    on_cpu = run("luong_general", "cpu", "cpu")
    first = next(row for row in rows if row["attention"] == "luong_general")
    print(f"trained Luong general again on cuda and on cpu ({time.perf_counter() - started:.0f} s)", flush=True)

    # 3. decoding on both devices, analysis on cuda, the decode command on the CPU
    folder = first["folder"]
    agree, analysed, decoded = "-", "-", "-"
    if not first["error"]:
        cfg = config("luong_general", "cuda", "cuda")
        tokens = {}
        for device in ("cuda", "cpu"):
            model, _ = build.load_run(folder, device=device)
            tokens[device] = build.evaluate(model, splits.test_batch(cfg).to(device))["tokens"].cpu()
        agree = f"{int((tokens['cuda'] == tokens['cpu']).all(1).sum())} of {len(tokens['cpu'])}"
        analysis.analyze([folder], lengths=[LENGTH], eval_size=128, progress=False, device="cuda")
        recorded = store.read_json(folder / store.ANALYSIS) if (folder / store.ANALYSIS).is_file() else {}
        drop = recorded.get("drop", {}).get("uniform", float("nan"))
        analysed = f"device {recorded.get('device')}, drop under uniform {drop:.3f}"
        result = copytask("decode", str(folder), "--random", "2", "--length", str(LENGTH), out=out)
        decoded = (
            "ok" if result.returncode == 0 else f"exit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}"
        )

    # 4. the benchmark on both devices
    benches = {}
    for device in ("cuda", "cpu"):
        csv = out / f"bench_{device}.csv"
        result = copytask(
            "bench",
            f"train.device={device}",
            *BENCH,
            "--memory-attentions",
            *MEMORY_ATTENTIONS,
            "--csv",
            str(csv),
            out=out,
        )
        benches[device] = pd.read_csv(csv) if result.returncode == 0 else None
        print(
            f"bench on {device}: {'done' if result.returncode == 0 else 'failed, see bench.log'} "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )

    print(f"\n## GPU check: {gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, host {socket.gethostname()}\n")
    print(
        f"Training at length {LENGTH}, {args.steps} steps, every step under "
        '`torch.cuda.set_sync_debug_mode("error")`:\n'
    )
    print("| attention | device | token acc | seq acc | train s | ms per step (with build) | fused | result |")
    print("|---|---|---|---|---|---|---|---|")
    for row in [*rows, again, on_cpu]:
        if row["error"]:
            print(f"| {row['attention']} | {row['device']} | - | - | - | - | - | {row['error']} |")
        else:
            print(
                f"| {row['attention']} | {row['device']} | {row['token_acc']:.3f} | {row['seq_acc']:.3f} "
                f"| {row['train_seconds']:.1f} "
                f"| {1e3 * row['train_seconds'] / row['steps']:.1f} | {row['fused']} | no host sync in a step |"
            )

    def same(a: dict, b: dict) -> str:
        if a["history"] is None or b["history"] is None:
            return "-"
        loss = (a["history"].loss - b["history"].loss).abs().max()
        return "identical" if loss == 0 else f"differ (largest loss difference {loss:.2e})"

    print(f"\n- Luong general twice on cuda, one seed: {same(first, again)}")
    print(f"- Luong general on cuda against cpu: {same(first, on_cpu)}")
    print(f"- greedy outputs on the held-out set, cuda against cpu (same checkpoint): {agree} sequences identical")
    print(f"- analysis on cuda: {analysed}; `copytask decode` of the GPU checkpoint on CPU: {decoded}")
    if all(table is not None for table in benches.values()):
        cuda, cpu = (benches[device].set_index("attention") for device in ("cuda", "cpu"))
        print(
            f"\n`python -m copytask bench --lengths 80` (batch {int(cpu.batch_size.iloc[0])}); "
            f"cuda: {cuda.machine.iloc[0]}; cpu: {cpu.machine.iloc[0]}\n"
        )
        print(
            "| attention | cuda ms/step | cpu ms/step | cpu / cuda | cuda reference ms/step "
            "| cuda speedup vs reference | cuda GFLOP/step | cuda peak MiB |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for attention in cuda.index:
            c, p = cuda.loc[attention], cpu.loc[attention]
            print(
                f"| {attention} | {c.ms_per_step_project:.1f} | {p.ms_per_step_project:.1f} "
                f"| {p.ms_per_step_project / c.ms_per_step_project:.2f} "
                f"| {c.ms_per_step_reference:.1f} | {c.speedup:.2f} | {c.gflop_per_step_project:.3f} "
                f"| {c.peak_mb_project:.0f} |"
            )
    print(f"\ngpu_check: {time.perf_counter() - started:.0f} s in all; logs and CSVs in {out}")
    return 1 if any(row["error"] for row in [*rows, again, on_cpu]) else 0


if __name__ == "__main__":
    raise SystemExit(main())

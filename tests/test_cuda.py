"""The device path on cuda, where there is one; skipped elsewhere (tests/test_device.py checks it
without a GPU, on torch's meta device). Every other training test pins the CPU (conftest's TINY).

On a GPU: every attention type trains with no host read inside a training step; a CUDA run repeats
bit for bit and agrees with the CPU run of its config to float rounding (the two are one run: the
device is not part of a run's identity); one checkpoint decodes alike on both devices; and a sweep
with its analysis runs on cuda through the command line."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest
import torch

from copytask import store
from copytask.config.schema import DETERMINISTIC_CUBLAS
from copytask.data import splits
from copytask.evaluation.load import load_run
from copytask.models.greedy import evaluate
from copytask.training import loop

from .conftest import ATTENTION_OPTIONS, GRID, TINY, run_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# cuBLAS is deterministic only when this is set before its first call in the process (training.devices)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS[0])

ATTENTIONS = list(ATTENTION_OPTIONS)
CUDA = [*(arg for arg in TINY if arg != "train.device=cpu"), "train.device=cuda", "task.length=6"]


@pytest.fixture
def no_host_sync(monkeypatch):
    """Every training step under torch.cuda.set_sync_debug_mode("error"): a host read in a step raises."""
    step = loop.train_step

    def checked(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(loop, "train_step", checked)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_every_attention_type_trains_on_cuda_without_a_host_sync(make_config, no_host_sync, attention):
    metrics = loop.train(make_config(*CUDA, f"attention={attention}"))
    assert metrics["device"].startswith("cuda") and metrics["fused"] is False
    assert 0.0 <= metrics["token_acc"] <= 1.0


def history(cfg) -> pd.DataFrame:
    return pd.read_csv(store.run_dir(cfg) / store.HISTORY)


def test_a_cuda_run_repeats_bit_for_bit_and_agrees_with_the_cpu_to_float_rounding(make_config, tmp_path):
    runs = {}
    for name, device in (("cuda", "cuda"), ("again", "cuda"), ("cpu", "cpu")):
        cfg = make_config(*CUDA, f"train.device={device}", f"runs_dir={tmp_path / name}")
        loop.train(cfg)
        runs[name] = history(cfg)
    assert runs["cuda"].loss.tolist() == runs["again"].loss.tolist()
    assert (runs["cuda"].loss - runs["cpu"].loss).abs().max() < 1e-4


def test_a_gpu_checkpoint_decodes_alike_on_both_devices(make_config):
    cfg = make_config(*CUDA, "train.eval_size=64")
    loop.train(cfg)
    tokens = {}
    for device in ("cuda", "cpu"):
        model, run_cfg = load_run(store.run_dir(cfg), device=device)
        tokens[device] = evaluate(model, splits.test_batch(run_cfg).to(device))["tokens"].cpu()
    assert torch.equal(tokens["cuda"], tokens["cpu"])


def test_a_sweep_trains_and_analyses_on_cuda(tmp_path):
    runs_dir = tmp_path / "runs"
    tiny = [arg for arg in TINY if arg != "train.device=cpu"]
    result = run_cli("sweep", *tiny, *GRID, "train.device=cuda", f"runs_dir={runs_dir}")
    assert result.returncode == 0, result.stderr
    metrics = [json.loads(path.read_text()) for path in runs_dir.glob(f"*/{store.METRICS}")]
    assert len(metrics) == 8 and {m["device"] for m in metrics} == {"cuda"}
    analysed = [json.loads(path.read_text()) for path in runs_dir.glob(f"*/{store.ANALYSIS}")]
    assert len(analysed) == 8 and {a["device"] for a in analysed} == {"cuda"}

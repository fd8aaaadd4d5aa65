"""Device placement and host syncs, checked without a GPU: the model on torch's `meta` device (whose
tensors have shapes but no data, so any host read raises and any CPU tensor mixed in is refused), a
TorchFunctionMode that counts host reads over a training step as a GPU runs it, checkpoints from a
GPU, SLURM submission from a machine without one, and the CUDA settings a run makes and undoes."""

from __future__ import annotations

import io
import os
import re
import socket
import zipfile
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from copytask import store
from copytask.bench import measures
from copytask.config import checks
from copytask.config.checks import analysis_device, validate
from copytask.console import ConfigError
from copytask.data.batches import task_batch
from copytask.data.splits import sample_batch
from copytask.evaluation import analysis
from copytask.evaluation.load import load_run
from copytask.kernels import ops
from copytask.models.build import build_model
from copytask.sweeps.grid import check_grid
from copytask.training import devices
from copytask.training.loop import train, train_step

from .conftest import ATTENTION_OPTIONS, TINY, run_cli

ATTENTIONS = list(ATTENTION_OPTIONS)
SMALL = ["model.hidden_size=8", "model.embedding_size=8", "task.length=6", "train.batch_size=4"]
RAGGED = ["task.variable_length=true", "task.min_length=2"]

# Tensor methods and torch functions that read a tensor's values on the host: on a GPU each waits
# for every kernel queued before it.
HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.masked_select,
    torch.masked_select,
    torch.Tensor.unique,
    torch.unique,
}


def _device_argument(args, kwargs) -> torch.device | None:
    for value in (*args, kwargs.get("device")):
        if isinstance(value, (str, torch.device)):
            return torch.device(value)
    return None


class HostTraffic(TorchFunctionMode):
    """Records `reads` (host reads of tensor values, and copies to the CPU) and `copies` (tensors
    made from host data or copied from the CPU onto another device) by the function that does them."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.copies: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            self.reads.append(func.__name__)
        elif func is torch.Tensor.to:
            target = _device_argument(args[1:], kwargs)
            if target is not None and target.type == "cpu" and args[0].device.type != "cpu":
                self.reads.append("to(cpu)")
            if target is not None and target.type != "cpu" and args[0].device.type == "cpu":
                self.copies.append("to")
        elif func in (torch.tensor, torch.as_tensor) and _device_argument((), kwargs) not in (
            None,
            torch.device("cpu"),
        ):
            self.copies.append(func.__name__)
        return func(*args, **kwargs)


@pytest.fixture
def config(make_config):
    def _config(attention: str, *extra: str):
        return make_config(*TINY, *SMALL, f"attention={attention}", *extra)

    return _config


def interventions() -> dict:
    return {
        "uniform": analysis.uniform_weights,
        "permuted": analysis.permuted_weights(torch.Generator().manual_seed(0)),
        "fixed": analysis.fixed_weights,
    }


@pytest.mark.slow
@pytest.mark.parametrize("ragged", [False, True], ids=["fixed", "ragged"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_step_decoding_and_interventions_run_on_the_meta_device(config, attention, ragged):
    """Nothing is read on the host and no CPU tensor is mixed in: what runs on meta runs on a GPU
    without waiting for it (the CPU's fused kernels step aside there, as on CUDA)."""
    cfg = config(attention, *(RAGGED if ragged else []))
    model = build_model(cfg).to("meta")
    batch = sample_batch(cfg, cfg.train.batch_size, torch.Generator().manual_seed(0)).to("meta")
    assert batch.src.is_meta and batch.src_lengths.is_meta
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr)
    loss = train_step(model, optimizer, batch, cfg.train.clip)
    assert loss.is_meta and loss.shape == ()
    steps = batch.tgt_out.size(1)
    with HostTraffic() as traffic:
        tokens, weights = model.greedy(batch.src, batch.src_lengths, steps=steps)
    assert traffic.copies == []  # e.g. no tensor of the step's position made on the host per step
    assert tokens.shape == (len(batch), steps) and tokens.is_meta
    if model.attention is None:
        assert weights is None
        return
    assert weights.shape == (len(batch), steps, batch.src.size(1))
    for name, replace in interventions().items():
        with analysis.intervention(model.attention, replace):
            tokens, _ = model.greedy(batch.src, batch.src_lengths, steps=steps)
        assert tokens.shape == (len(batch), steps), name


@pytest.mark.parametrize("ragged", [False, True], ids=["fixed", "ragged"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_training_step_as_a_gpu_runs_it_reads_nothing_on_the_host(config, monkeypatch, attention, ragged):
    """The CUDA path on CPU: torch's ops (the fused kernels are CPU-only), the lengths treated as
    living on a device, and Adam as CUDA gets it (fused). Not one host read in the whole step."""
    monkeypatch.setattr(ops, "on_host", lambda lengths: False, raising=False)  # absent before the device path existed
    cfg = config(attention, "train.fused=false", *(RAGGED if ragged else []))
    model = build_model(cfg)
    batch = sample_batch(cfg, cfg.train.batch_size, torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr, fused=devices.fused_adam(torch.device("cuda")))
    with HostTraffic() as traffic:
        train_step(model, optimizer, batch, cfg.train.clip)
    assert traffic.reads == []


@pytest.mark.parametrize("ragged", [False, True], ids=["fixed", "ragged"])
def test_the_counter_sees_the_host_reads_of_the_cpu_path(config, ragged):
    """The counter itself: on the CPU the lengths are read on the host (free there), and it sees it."""
    cfg = config("luong_general", "train.fused=false", *(RAGGED if ragged else []))
    model = build_model(cfg)
    batch = sample_batch(cfg, cfg.train.batch_size, torch.Generator().manual_seed(0))
    with HostTraffic() as traffic:
        train_step(model, torch.optim.Adam(model.parameters()), batch, cfg.train.clip)
    assert "__bool__" in traffic.reads and ("cpu" in traffic.reads) == ragged


@pytest.mark.parametrize("bidirectional", [True, False])
def test_the_gru_without_host_reads_computes_what_packing_does(bidirectional):
    """`ops.GRU` on lengths that live on a device gives packing's states, final states and
    gradients: zero states past each length, each direction's last real state."""
    torch.manual_seed(0)
    gru = ops.GRU(5, 6, bidirectional, fused=False).double()
    x = torch.randn(4, 7, 5, dtype=torch.double, requires_grad=True)
    hx = torch.randn(2 if bidirectional else 1, 4, 6, dtype=torch.double, requires_grad=True)
    lengths = torch.tensor([7, 3, 1, 5])
    packed = gru(x, hx, lengths)
    unpacked = gru._unpacked(x, hx, lengths)
    for got, want in zip(unpacked, packed):
        torch.testing.assert_close(got, want)
    assert unpacked[0][1, 3:].abs().max() == 0
    grads = [
        torch.autograd.grad(out[0].sin().sum() + out[1].cos().sum(), [x, hx, *gru.parameters()])
        for out in (packed, unpacked)
    ]
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("task", ["copy", "reverse"])
def test_task_batches_are_made_on_their_symbols_device(task):
    symbols = torch.randint(3, 8, (4, 5)).to("meta")
    batch = task_batch(task, symbols, torch.tensor([5, 2, 3, 1]).to("meta"), 5)
    assert all(t.is_meta for t in (batch.src, batch.src_lengths, batch.tgt_in, batch.tgt_out))
    assert batch.tgt_in.shape == batch.tgt_out.shape == (4, 6)


def test_a_batch_moves_as_one_buffer_with_its_values():
    cfg_batch = task_batch("reverse", torch.randint(3, 8, (4, 5)), torch.tensor([5, 2, 3, 1]), 5)
    moved = cfg_batch.to("meta")
    for name in ("src", "src_lengths", "tgt_in", "tgt_out"):
        assert getattr(moved, name).shape == getattr(cfg_batch, name).shape
    assert cfg_batch.to("cpu") is cfg_batch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_batch_reaches_the_gpu_intact():
    batch = task_batch("reverse", torch.randint(3, 8, (4, 5)), torch.tensor([5, 2, 3, 1]), 5)
    moved = batch.to("cuda")
    for name in ("src", "src_lengths", "tgt_in", "tgt_out"):
        assert torch.equal(getattr(moved, name).cpu(), getattr(batch, name))


@pytest.fixture
def trained_run(make_config):
    cfg = make_config(*TINY, "train.steps=2", "train.eval_every=2", "attention=luong_general", "task.length=3")
    train(cfg)
    return store.run_dir(cfg)


def tag_as_cuda(path: Path) -> None:
    """Rewrite the checkpoint at `path` as a GPU run saves it: every storage tagged `cuda:0`."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    registry = list(torch.serialization._package_registry)
    try:
        torch.serialization.register_package(-1, lambda storage: "cuda:0", lambda storage, location: None)
        buffer = io.BytesIO()
        torch.save(state, buffer)
    finally:
        torch.serialization._package_registry[:] = registry
    path.write_bytes(buffer.getvalue())


def test_a_checkpoint_saved_on_a_gpu_loads_on_the_cpu(trained_run, monkeypatch):
    checkpoint = trained_run / store.CHECKPOINT
    before = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    tag_as_cuda(checkpoint)
    with zipfile.ZipFile(checkpoint) as archive:
        pickled = archive.read(next(name for name in archive.namelist() if name.endswith("data.pkl")))
    assert b"cuda:0" in pickled and b"\x8c\x03cpu" not in pickled
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(checkpoint, weights_only=True)  # the tags are real: without map_location it wants a GPU
    model, _ = load_run(trained_run, device="cpu")
    for name, value in model.state_dict().items():
        assert value.device.type == "cpu" and torch.equal(value, before[name]), name


@pytest.fixture
def fake_slurm(fake_slurm, monkeypatch):
    """conftest's login node (srun and sbatch on PATH), without CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.slow
def test_a_gpu_sweep_is_submitted_from_a_machine_without_a_gpu(fake_slurm, tmp_path):
    grid = check_grid([*TINY, f"runs_dir={tmp_path / 'runs'}", "hydra/launcher=slurm", "train.device=cuda"])
    assert len(grid) == 4 and {run.config.train.device for run in grid} == {"cuda"}
    with pytest.raises(ConfigError, match="train.device must be one of auto, cpu, cuda, got 'gpu'"):
        check_grid([*TINY, "hydra/launcher=slurm", "train.device=gpu"])  # a bad name is still refused at once
    with pytest.raises(
        ConfigError, match=r"task.length must be an integer >= 1, got 0 \(in the grid: task.length=5,0\)"
    ):
        check_grid([*TINY, "hydra/launcher=slurm", "task.length=5,0"])  # and so is everything else


def test_a_slurm_sweep_on_cuda_is_analysed_where_the_login_node_can():
    slurm = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert analysis_device("cuda", slurm) == "auto" and analysis_device("cpu", slurm) == "cpu"
    assert analysis_device("cuda", "hydra._internal.core_plugins.basic_launcher.BasicLauncher") == "cuda"


def test_the_job_on_a_node_without_a_gpu_fails_naming_the_node(fake_slurm, make_config):
    with pytest.raises(ConfigError) as error:
        validate(make_config(*TINY, "train.device=cuda"))  # what `train` checks first, on the node
    message = str(error.value)
    assert "\n" not in message and socket.gethostname() in message and "train.device=cuda" in message


def test_a_local_sweep_on_cuda_is_still_checked_here(fake_slurm):
    with pytest.raises(ConfigError, match=f"{socket.gethostname()} has no CUDA device"):
        check_grid([*TINY, "train.device=cuda"])


def test_where_a_cuda_driver_loads_torch_is_asked_and_its_build_named(monkeypatch):
    monkeypatch.setattr(checks, "has_cuda_driver", lambda: True)  # as on a GPU node whose device is gone or busy
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=rf"has no CUDA device \(torch {re.escape(torch.__version__)}, "):
        checks.check_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    checks.check_device("cuda")


@pytest.mark.slow
def test_the_slurm_launcher_without_slurm_is_refused_in_one_line(tmp_path):
    path = os.pathsep.join(
        d
        for d in os.environ["PATH"].split(os.pathsep)
        if not (Path(d) / "srun").exists() and not (Path(d) / "sbatch").exists()
    )
    env_path = os.environ["PATH"]
    try:
        os.environ["PATH"] = path
        result = run_cli("sweep", *TINY, f"runs_dir={tmp_path / 'runs'}", "hydra/launcher=slurm")
    finally:
        os.environ["PATH"] = env_path
    assert result.returncode == 2 and not (tmp_path / "runs").exists()
    assert result.stderr.strip() == (
        "copytask: error: hydra/launcher=slurm needs a SLURM cluster (srun and sbatch not on PATH here); "
        "on this machine use the default launcher (basic: one job at a time) or hydra/launcher=parallel"
    )


def test_analyze_honours_and_records_its_device(trained_run, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # `auto` would pick CUDA: `cpu` must keep to the CPU
    assert analysis.analyze([trained_run], lengths=[3], eval_size=8, progress=False, device="cpu") == 1
    recorded = store.read_json(trained_run / store.ANALYSIS)
    assert recorded["device"] == "cpu"
    assert analysis.is_analysed(trained_run, [3], 8, "cpu") and not analysis.is_analysed(trained_run, [3], 8, "cuda")
    assert analysis.analyze([trained_run], lengths=[3], eval_size=8, progress=False, device="cpu") == 0
    store.write_json(
        trained_run / store.ANALYSIS, recorded | {"device": "cuda"}
    )  # made on a GPU: a CPU analysis replaces it
    assert analysis.analyze([trained_run], lengths=[3], eval_size=8, progress=False, device="cpu") == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="has no CUDA device"):
        analysis.analyze([trained_run], lengths=[3], progress=False, device="cuda")


def test_an_analysis_without_a_device_was_made_on_the_cpu(trained_run):
    analysis.analyze([trained_run], lengths=[3], eval_size=8, progress=False, device="cpu")
    recorded = store.read_json(trained_run / store.ANALYSIS)
    del recorded["device"]
    store.write_json(trained_run / store.ANALYSIS, recorded)
    assert analysis.is_analysed(trained_run, [3], 8, "cpu")


def precision_state() -> dict:
    flags = {f"{id(owner)}.{name}": getattr(owner, name) for owner, name, _ in devices._precision_flags()}
    return flags | {
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    }


def test_a_cuda_run_computes_in_full_float32_deterministically_and_restores_the_settings(monkeypatch):
    """The settings are flags: they can be set and read without a GPU."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    outside = precision_state()
    with devices.run_settings(torch.device("cuda")):
        inside = precision_state()
        assert all(getattr(owner, name) == value for owner, name, value in devices._precision_flags())
        assert inside["cudnn.deterministic"] and not inside["cudnn.benchmark"] and inside["deterministic"]
    assert precision_state() == outside
    with devices.run_settings(torch.device("cpu")):  # CPU runs compute what they always have
        assert precision_state() == outside
    with pytest.raises(KeyError), devices.run_settings(torch.device("cuda")):
        raise KeyError("a failed run")
    assert precision_state() == outside


def test_a_cuda_run_without_the_cublas_setting_says_how_to_make_it(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with pytest.warns(UserWarning, match="CUBLAS_WORKSPACE_CONFIG=:4096:8"), devices.run_settings(torch.device("cuda")):
        pass


def test_adam_is_fused_on_cuda_only():
    assert devices.fused_adam(torch.device("cuda")) is True
    assert devices.fused_adam(torch.device("cpu")) is None  # torch's default: CPU runs keep their numbers


def test_a_sweep_that_asked_for_gpus_and_trained_on_cpu_says_so():
    assert devices.cpu_despite_gpus(0, ["cpu", "cpu"]) is None
    assert devices.cpu_despite_gpus(None, ["cpu"]) is None
    assert devices.cpu_despite_gpus(1, ["cuda", "cuda"]) is None
    warning = devices.cpu_despite_gpus(1, ["cuda", "cpu", "cpu"])
    assert warning.startswith("2 of 3 complete runs trained on CPU although hydra.launcher.gpus_per_node=1")


def test_flops_are_counted_on_a_cpu_copy_of_the_step(monkeypatch):
    """cuDNN's GRU has no FLOP formula: the step is counted on a CPU copy, and the benchmarked model is left alone."""
    cfg = measures.bench_config("bahdanau", 6, ["train.batch_size=4"])
    setup = measures.setups(cfg, torch.device("cpu"))["project"]
    before = {name: value.clone() for name, value in setup[0].state_dict().items()}
    counted_on = []
    real_step = measures.train_step
    monkeypatch.setattr(
        measures, "train_step", lambda model, *rest: counted_on.append(model) or real_step(model, *rest)
    )
    flops = measures.step_flops(setup)
    assert flops > 0 and len(counted_on) == 1 and counted_on[0] is not setup[0]
    assert all(p.device.type == "cpu" for p in counted_on[0].parameters())
    assert all(torch.equal(value, before[name]) for name, value in setup[0].state_dict().items())


def test_a_cpu_run_on_a_gpu_machine_leaves_the_gpus_random_states_alone(make_config, monkeypatch):
    """Forking every GPU's random state initialises CUDA on each of them, in every CPU job. Two GPUs
    are simulated where torch's `fork_rng` asks for them (`torch.cuda.device_count`), not through
    `torch.cuda.is_available`: with PyPI's CUDA build of torch, Adam's step asks torch's accelerator
    whether to check for graph capture, and a GPU it was told of but that is not there makes it raise."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    touched = []
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, name=name, **kwargs: touched.append(name))
    before = torch.random.get_rng_state()
    metrics = train(make_config(*TINY, "train.device=cpu"))
    assert metrics["device"] == "cpu" and touched == []
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's CPU random state, as it was

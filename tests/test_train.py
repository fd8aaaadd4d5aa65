import copy
import itertools
import json
from collections.abc import Callable

import pytest
import torch

from copytask import cli, store
from copytask.config.checks import validate
from copytask.console import ConfigError
from copytask.data import splits
from copytask.data.batches import Batch
from copytask.kernels import ops
from copytask.models.build import build_model
from copytask.models.greedy import evaluate
from copytask.reporting.tables import wilson
from copytask.sweeps.grid import compose_grid
from copytask.training import devices, loop
from copytask.training.loop import NonFiniteLoss, train, train_step
from copytask.training.optimizer import FlatAdam

from .conftest import TINY, run_cli

RUN_FILES = {store.CONFIG, store.METRICS, store.HISTORY, store.CHECKPOINT, store.ATTENTION}


def test_a_run_records_its_progress_while_it_trains_and_not_once_complete(make_config, monkeypatch):
    recorded = []
    write_progress = store.write_progress
    monkeypatch.setattr(
        store,
        "write_progress",
        lambda folder, step, steps: (
            recorded.append((step, steps, store.is_complete(folder))) or write_progress(folder, step, steps)
        ),
    )
    cfg = make_config(*TINY, "train.steps=6", "train.eval_every=2", "train.target_acc=1.0", "train.patience=5")
    loop.train(cfg)
    assert recorded == [(2, 6, False), (4, 6, False), (6, 6, False)]
    assert not (store.run_dir(cfg) / store.PROGRESS).exists() and store.read_progress(store.run_dir(cfg)) == 0.0


@pytest.mark.slow
def test_train_through_the_cli_writes_a_complete_run_folder(tmp_path):
    result = run_cli("train", *TINY, "attention=bahdanau", f"runs_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name != store.LOCKS]
    assert folder.name.startswith("bahdanau-copy5-seed0-")
    assert RUN_FILES <= {p.name for p in folder.iterdir()}
    metrics = json.loads((folder / store.METRICS).read_text())
    for key in (
        "attention",
        "length",
        "seed",
        "token_acc",
        "seq_acc",
        "chance",
        "params",
        "steps",
        "train_seconds",
        "device",
    ):
        assert key in metrics
    assert metrics["attention"] == "bahdanau" and metrics["length"] == 5 and metrics["steps"] == 10
    assert metrics["fused"] == (ops.kernel() is not None)  # the encoder and decoder ran in the kernels
    samples = json.loads((folder / store.ATTENTION).read_text())["samples"]
    assert len(samples[0]["weights"]) == 6 and len(samples[0]["weights"][0]) == 5  # (T_dec, T_enc)
    assert folder.name in result.stdout  # the one-line summary names the run


@pytest.mark.parametrize(
    "override, named",
    [
        ("task.length=0", "task.length"),
        ("task.vocab_size=1", "task.vocab_size"),
        ("train.batch_size=0", "train.batch_size"),
        ("train.steps=0", "train.steps"),
        ("train.device=tpu", "'tpu'"),
        ("task.name=sort", "'sort'"),
        ("attention.decoder=transformer", "'transformer'"),
        ("train.schedule=cosine", "'cosine'"),
        ("train.warmup=2", "train.warmup must be a fraction between 0 and 1, got 2"),
        ("train.clip=0", "train.clip must be a positive number, got 0"),
        ("train.target_acc=99", r"train.target_acc must be a number in \[0, 1\], got 99"),
        ("train.attention_samples=-1", "train.attention_samples must be an integer >= 0, got -1"),
    ],
)
def test_bad_values_are_refused_before_training(make_config, override, named):
    cfg = make_config(*TINY, override)
    with pytest.raises(ConfigError, match=named):
        validate(cfg)
    with pytest.raises(ConfigError):
        train(cfg)
    assert not (tmp := store.run_dir(cfg)).exists(), tmp


@pytest.mark.parametrize(
    "override, message",
    [
        ("task.length=oops", "task.length must be an integer >= 1, got 'oops'"),
        ("task.length=2.5", "task.length must be an integer >= 1, got 2.5"),
        ("train.lr=fast", "train.lr must be a number, got 'fast'"),
        ("train.fused=maybe", "train.fused must be true or false, got 'maybe'"),
        ("attention.window=wide", "attention.window must be an integer >= 1, got 'wide'"),
        ("train.steps=null", "train.steps must not be null"),
    ],
)
@pytest.mark.slow
def test_a_value_of_the_wrong_type_is_refused_by_the_schema_in_one_line(override, message):
    with pytest.raises(ConfigError) as refused:
        compose_grid([override], multirun=False)  # Hydra refuses it while composing, before validate
    assert str(refused.value) == message


@pytest.mark.parametrize(
    "override, message",
    [
        ("analysis.eval_size=0", "analysis.eval_size must be an integer >= 1, got 0"),
        ("analysis.probe_size=1", "analysis.probe_size must be an integer >= 2, got 1"),
        ("analysis.threads=2000", "analysis.threads must be an integer from 1 to 1024, got 2000"),
    ],
)
def test_analyze_refuses_an_analysis_key_out_of_its_bounds_before_it_reads_a_run(tmp_path, capsys, override, message):
    (tmp_path / "a-run").mkdir()  # a runs_dir, so that only the value is wrong (eval_size=0 analysed every run)
    assert cli.main(["analyze", f"runs_dir={tmp_path}", override]) == 2
    assert capsys.readouterr().err.strip() == f"copytask: error: {message}"


def test_a_key_added_with_plus_that_nothing_reads_is_refused(make_config):
    """Hydra adds `+model.depth=2` to the config; nothing reads it, yet it would rename the run."""
    with pytest.raises(ConfigError, match=r"^unknown key 'model.depth'"):
        validate(make_config(*TINY, "+model.depth=2"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_refused_where_there_is_none(make_config):
    with pytest.raises(ConfigError, match="no CUDA device"):
        validate(make_config(*TINY, "train.device=cuda"))


@pytest.mark.slow
def test_cli_bad_input_is_one_clear_line_and_a_failing_exit(tmp_path):
    result = run_cli("train", *TINY, "task.length=0", f"runs_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip() == "copytask: error: task.length must be an integer >= 1, got 0"
    assert not list(tmp_path.iterdir())
    unknown = run_cli("train", "attention=foo", f"runs_dir={tmp_path}", cwd=tmp_path)
    assert unknown.returncode == 2
    assert unknown.stderr.strip().startswith("copytask: error: attention=foo: no such option; choose one of")
    assert len(unknown.stderr.strip().splitlines()) == 1 and "luong_general" in unknown.stderr  # names what is allowed
    typo = run_cli("train", "attention=bahdanu", f"runs_dir={tmp_path}", cwd=tmp_path)
    assert typo.returncode == 2 and len(typo.stderr.strip().splitlines()) == 1
    assert "attention=bahdanu: no such option; did you mean attention=bahdanau?" in typo.stderr


def test_train_help_says_what_each_key_means_and_trains_nothing(tmp_path, capsys):
    from copytask.cli import main

    assert main(["train", "attention=bahdanau", f"runs_dir={tmp_path}", "--help"]) == 0
    output = capsys.readouterr().out
    assert "task.length=20: source symbols" in output  # the default and the comment of configs/task/copy.yaml
    assert "attention.size=32: attention (hidden) size of the additive score" in output  # of the chosen option
    assert "* attention=bahdanau" in output and "attention=luong_dot" in output  # every option, the chosen one marked
    assert "experiment=capacity" in output and not any(tmp_path.iterdir())


def test_same_config_and_seed_give_the_same_metrics(make_config, tmp_path):
    first = train(make_config(*TINY, "attention=bahdanau", f"runs_dir={tmp_path / 'a'}"))
    second = train(make_config(*TINY, "attention=bahdanau", f"runs_dir={tmp_path / 'b'}"))
    for key in ("token_acc", "seq_acc", "final_loss", "steps", "params", "run"):
        assert first[key] == second[key], key
    third = train(make_config(*TINY, "attention=bahdanau", "seed=1", f"runs_dir={tmp_path / 'c'}"))
    assert third["final_loss"] != first["final_loss"]


@pytest.mark.parametrize("attention", ["none", "bahdanau", "luong_general"])
def test_greedy_evaluation_in_pieces_equals_one_piece(make_config, attention):
    cfg = make_config(
        *TINY, f"attention={attention}", "train.eval_size=50", "task.variable_length=true", "task.min_length=2"
    )
    torch.manual_seed(0)
    model, heldout = build_model(cfg), splits.test_batch(cfg)
    whole, pieces = evaluate(model, heldout, chunk_size=len(heldout)), evaluate(model, heldout, chunk_size=16)
    assert torch.equal(whole["tokens"], pieces["tokens"])  # 16 does not divide 50: a short last piece
    assert whole["token_acc"] == pieces["token_acc"] and whole["seq_acc"] == pieces["seq_acc"]
    if attention != "none":
        torch.testing.assert_close(whole["weights"], pieces["weights"])


@pytest.mark.parametrize("seed", [0, 1234], ids=["seed0", "seed=eval_seed"])
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # train_step is replaced
def test_no_heldout_sequence_is_ever_trained_on(make_config, monkeypatch, seed):
    """Length 2 has 81 sequences and the test and validation sets hold 40 of them: without the
    exclusion about 40% of training rows would be held-out ones. With seed == train.eval_seed the
    training generator starts where the test set's did, so its first batch would be the test set."""
    cfg = make_config(
        *TINY, "task.length=2", "train.eval_size=24", "train.patience=null", f"seed={seed}", "train.eval_seed=1234"
    )
    test, validation = splits.test_batch(cfg), splits.validation_batch(cfg)
    heldout = {tuple(row) for row in test.src.tolist()}
    validating = {tuple(row) for row in validation.src.tolist()}
    assert not heldout & validating  # the validation set holds no test sequence
    heldout |= validating
    trained = []
    monkeypatch.setattr(
        "copytask.training.loop.train_step",
        lambda model, optimizer, batch, clip: trained.append(batch) or torch.tensor(1.0),
    )
    train(cfg)
    rows = [tuple(row) for batch in trained for row in batch.src.tolist()]
    assert len(trained) == 10 and len(rows) == 80
    assert not heldout & set(rows)
    first = trained[0]  # the redrawn rows are whole sequences: target = source, then EOS
    assert torch.equal(first.tgt_out[:, :2], first.src) and torch.equal(first.tgt_in[:, 1:], first.src)


def test_interrupted_run_never_looks_complete_and_is_trained_again(make_config, monkeypatch):
    cfg = make_config(*TINY)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr("copytask.training.loop.evaluate", interrupt)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    folder = store.run_dir(cfg)
    assert folder.exists() and not store.is_complete(folder)
    metrics = train(cfg)
    assert store.is_complete(folder) and metrics["steps"] == 10


def test_complete_run_is_skipped(make_config, monkeypatch):
    cfg = make_config(*TINY)
    first = train(cfg)
    monkeypatch.setattr(
        "copytask.training.loop.build_model", lambda cfg: pytest.fail("a complete run was trained again")
    )
    assert train(cfg) == first


def test_early_stop_once_target_holds(make_config):
    metrics = train(make_config(*TINY, "train.steps=40", "train.target_acc=0.0", "train.patience=2"))
    assert metrics["steps"] == 10 and metrics["step_budget"] == 40  # two evaluations at the target, 5 steps apart


@pytest.mark.slow
def test_attention_learns_to_copy_length_10(make_config):
    """The default run at length 10 holds the 99% target on its validation set within the budget, and the
    test set agrees to its own sampling error: the target lies inside the test accuracy's 95% Wilson
    interval. Training stops on the validation set, so the test set may land a little below the target,
    and does on one torch version (docs/reliability.md, Python versions and torch builds)."""
    cfg = make_config("task.length=10", "train.progress=false", "train.eval_every=50", "train.device=cpu")
    metrics = train(cfg)
    assert metrics["val_token_acc"] >= cfg.train.target_acc and metrics["steps"] < cfg.train.steps, metrics
    tokens = cfg.train.eval_size * cfg.task.length
    assert wilson(metrics["token_acc"], tokens)[1] >= cfg.train.target_acc, metrics
    assert metrics["chance"] == pytest.approx(1 / 9)


def diverging(poison: Callable[[Batch], bool]):
    """train_step, but every parameter turns NaN before a step whose batch `poison` picks: what a
    too-large update does, whatever the kernels make of NaN inputs (the output layer is NaN too)."""
    real_step = train_step

    def step(model, optimizer, batch, clip):
        if poison(batch):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.fill_(float("nan"))
        return real_step(model, optimizer, batch, clip)

    return step


def test_nonfinite_loss_stops_the_run_naming_it_and_the_step(make_config, monkeypatch):
    cfg = make_config(*TINY)  # evaluations at steps 5 and 10
    steps = itertools.count(1)
    monkeypatch.setattr("copytask.training.loop.train_step", diverging(lambda batch: next(steps) == 7))

    with pytest.raises(
        NonFiniteLoss, match=rf"^{store.run_name(cfg)}: .* at step 7 .* stopped at step 10, nothing saved"
    ):
        train(cfg)
    assert not store.is_complete(store.run_dir(cfg)) and not (store.run_dir(cfg) / store.METRICS).exists()


@pytest.mark.slow
def test_a_diverging_run_is_a_failed_job_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("copytask.training.loop.train_step", diverging(lambda batch: batch.src.size(1) == 6))

    with pytest.raises(SystemExit) as exit:  # the sweep, in this process: jobs at length 6 diverge
        cli.main(["sweep", *TINY, f"runs_dir={tmp_path}", "attention=none", "task.length=6,3", "seed=0"])

    assert exit.value.code == 1
    _, (diverged, fine) = compose_grid([*TINY, f"runs_dir={tmp_path}", "attention=none", "task.length=6,3", "seed=0"])
    error = store.read_json(diverged.folder / store.FAILED)["error"]
    assert error.startswith(f"NonFiniteLoss: {diverged.folder.name}: ") and "at step 1 " in error
    assert not (diverged.folder / store.METRICS).exists()
    assert store.is_complete(fine.folder)  # trained after the failed job
    assert "1/2 runs complete (1 trained now), 1 failed" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("vocab_size, chance", [(4, "25.0%"), (16, "6.2%")])
def test_chance_and_the_summary_follow_the_vocabulary(tmp_path, vocab_size, chance):
    """Chance is 1 / task.vocab_size at any vocabulary, in metrics.json, the run's summary line and
    compare's table; the data use exactly the content symbols of that vocabulary."""
    from copytask.reporting.tables import comparison_table, load, summarise

    grid_overrides = [
        *TINY,
        f"runs_dir={tmp_path}",
        f"task.vocab_size={vocab_size}",
        "attention=none,luong_general",
        "seed=0,1",
    ]
    _, grid = compose_grid(grid_overrides)
    for run in grid:
        metrics = train(run.config)
        assert metrics["chance"] == pytest.approx(1 / vocab_size) and metrics["vocab_size"] == vocab_size
        assert f"(chance {chance} per token)" in loop.summary_line(metrics, run.folder)  # the line the command prints
    heldout = splits.test_batch(grid[0].config)
    assert set(heldout.src.unique().tolist()) == set(range(3, 3 + vocab_size))  # every content symbol, no other
    assert build_model(grid[0].config).decoder.out.out_features == 3 + vocab_size

    loaded = load(grid)
    table = comparison_table(summarise(loaded.table, loaded.settings), loaded.settings, wide=True)
    assert len(table) == 4 and set(table["chance %"]) == {chance.rstrip("%")}  # 2 attention types x 2 lengths


def test_a_run_takes_one_thread_unless_a_launcher_or_the_user_says_more(make_config, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    untold = [override for override in TINY if override != "train.threads=1"]
    assert train(make_config(*untold))["threads"] == 1  # torch's own default would take every core
    assert devices.thread_count(3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # as joblib and the SLURM launcher's setup do
    assert devices.thread_count(None) == 2


@pytest.mark.parametrize("overrides", [["attention=luong_general"], ["model=transformer"]])
def test_flat_adam_computes_torchs_adam_on_the_separate_tensors_to_the_bit(make_config, overrides):
    """A run's CPU optimiser (FlatAdam: every parameter a view of one buffer) against
    torch's Adam on the model's own tensors: after steps with clipping, the same parameters bit for
    bit, and each gradient still a view of the optimiser's one gradient buffer."""
    cfg = make_config(*TINY, *overrides)
    generator = torch.Generator().manual_seed(0)
    batches = [splits.sample_batch(cfg, 16, generator) for _ in range(5)]
    models = []
    for flat in (True, False):
        torch.manual_seed(0)
        model = build_model(cfg)
        optimizer = FlatAdam(model, lr=1e-2) if flat else torch.optim.Adam(model.parameters(), lr=1e-2)
        for batch in batches:
            train_step(model, optimizer, batch, clip=0.1)  # a small clip: every step clips
        models.append(model)
        if flat:
            (buffer,) = optimizer.param_groups[0]["params"]
            start, end = buffer.grad.data_ptr(), buffer.grad.data_ptr() + buffer.grad.numel() * 4
            assert all(start <= p.grad.data_ptr() < end for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(*(model.parameters() for model in models)))


def test_flat_adam_goes_on_from_the_state_torchs_adam_saved(make_config):
    """A resumable checkpoint written before FlatAdam holds torch's Adam state of the separate
    tensors: FlatAdam takes it, and the run goes on to the same parameters bit for bit as with
    torch's Adam."""
    cfg = make_config(*TINY, "model=transformer")
    generator = torch.Generator().manual_seed(0)
    batches = [splits.sample_batch(cfg, 16, generator) for _ in range(6)]
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for batch in batches[:3]:
        train_step(model, optimizer, batch, clip=0.1)
    resumed = build_model(cfg)
    resumed.load_state_dict(model.state_dict())
    flat = FlatAdam(resumed, lr=1e-2)
    flat.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as a checkpoint file holds it: not the live tensors
    for batch in batches[3:]:
        train_step(model, optimizer, batch, clip=0.1)
        train_step(resumed, flat, batch, clip=0.1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))

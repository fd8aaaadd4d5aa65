"""Property-based tests (hypothesis) of three contracts, over drawn inputs rather than chosen ones:

- every input has an answer: an override list drawn from the whole space the command line takes,
  junk included, either trains a 2-step run that writes a complete folder with finite metrics in
  runs_dir and nothing outside it, named for what it is (a built-in's name only on that built-in),
  or is refused with one ConfigError line before anything is written (in process, and a sample
  through the real CLI: exit 0, or exit 2 with one line on stderr);
- attention: weights sum to 1 over the real source positions and are exactly 0 on padding (and
  outside a local window), each sequence of a mixed batch gets what it gets alone, and the fused
  kernels agree with torch's ops;
- a run's name is stable under equivalent spellings of its config and differs with the computation.

Examples are derandomized (the same ones on every run) and few: docs/reliability.md says how many.
Inputs that failed once are pinned with @example.
"""

from __future__ import annotations

import copy
import math
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import copytask
from copytask import store
from copytask.config.schema import config_dir
from copytask.console import ConfigError
from copytask.data.batches import task_batch
from copytask.families import family_of
from copytask.models.attention import ATTENTION_TYPES
from copytask.models.build import build_model

from .conftest import ATTENTION_OPTIONS, NO_ATTENTION, TASK_OPTIONS, pythonpath

ATTENTIONS = list(ATTENTION_OPTIONS)
ARCHITECTURES = sorted(path.stem for path in (Path(config_dir()) / "architecture").glob("*.yaml"))
# What built-in runs of another model than the GRU are named (model=mamba_lti: mamba_lti-copy20-...)
MODELS = [path.stem for path in (Path(config_dir()) / "model").glob("*.yaml")]
MODEL_RUN_NAMES = {*MODELS, *ARCHITECTURES} - set(ATTENTIONS)
RUN_FILES = {store.CONFIG, store.METRICS, store.HISTORY, store.CHECKPOINT, store.ATTENTION}
# Small, fast and quiet defaults; a drawn override of the same key comes later and wins.
# Each model reads its own sizes and leaves the other's unused, so both are here.
QUIET = [
    "train.device=cpu",  # the CPU also where a GPU is: tests/test_cuda.py runs the device path
    "train.progress=false",
    "train.threads=1",
    "train.steps=2",
    "train.eval_every=1",
    "task.length=4",
    "model.hidden_size=8",
    "model.embedding_size=4",
    "train.batch_size=4",
    "train.eval_size=8",
    "train.val_size=8",
    "model.d_model=8",
    "model.heads=2",
    "model.layers=1",
    "model.ff_size=8",
    "model.d_state=4",
]


def compose(overrides: list[str]):
    """The config of `python -m copytask train <overrides>`, validated: ConfigError if refused."""
    return copytask.compose(overrides)


def train_run(cfg) -> dict:
    return copytask.train(cfg)


@contextmanager
def time_limit(seconds: int):
    """Fail, rather than hang, if the block runs longer than `seconds` (SIGALRM: the main thread)."""

    def expired(signum, frame):
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# -- the configuration space ------------------------------------------------------------------


def number(value: float) -> str:
    return repr(value)


# Values that can run, kept tiny so that a 2-step run takes a fraction of a second.
VALID = {
    "attention": st.sampled_from(ATTENTIONS),
    "model": st.sampled_from(["gru", "transformer", "mamba"]),
    "architecture": st.sampled_from(ARCHITECTURES),
    "task": st.sampled_from(list(TASK_OPTIONS)),
    "task.length": st.integers(1, 6),
    "task.vocab_size": st.integers(2, 12),
    "task.variable_length": st.booleans().map(str).map(str.lower),
    "task.min_length": st.integers(1, 6),
    "task.copied": st.integers(1, 5).map(str) | st.just("null"),  # task=selective_copy's k (null for the others)
    "attention.heads": st.integers(1, 4),
    "attention.size": st.integers(1, 8),  # the additive score's size, linear attention's feature size
    "attention.window": st.integers(1, 4),
    "attention.variant": st.sampled_from(["null", "cho2014"]),  # cho2014 with attention=rnnencdec only
    # a registered score, or a class named by its import path as a user's own is (docs/models.md); under an
    # option's name only where the type is that option's
    "attention.score": st.sampled_from([*ATTENTION_TYPES, "copytask.models.dot_attention.DotAttention"]),
    "attention.name": st.sampled_from(["mine", *ATTENTIONS]),
    "model.hidden_size": st.sampled_from([1, 2, 4, 6, 8, 12]),
    "model.embedding_size": st.integers(1, 8),
    "model.bidirectional": st.booleans().map(str).map(str.lower),
    "model.layers": st.integers(1, 2),
    "model.heads": st.integers(1, 4),
    "model.d_model": st.sampled_from([1, 2, 4, 6, 8]),
    "model.ff_size": st.integers(1, 8),
    "model.positions": st.sampled_from(["sinusoidal", "learned"]),
    "model.max_length": st.integers(1, 8).map(str) | st.just("null"),
    "model.dropout": st.floats(0, 0.9).map(number),
    "model.d_state": st.integers(1, 4),
    "model.d_conv": st.integers(1, 5),
    "model.expand": st.integers(1, 3),
    "model.selective": st.booleans().map(str).map(str.lower) | st.just("null"),  # model=mamba's only (else null)
    "analysis.lengths": st.lists(st.integers(1, 9), min_size=1, max_size=3).map(
        lambda lengths: f"[{','.join(map(str, lengths))}]"
    ),
    "analysis.beam_widths": st.lists(st.integers(1, 64), max_size=3).map(lambda w: f"[{','.join(map(str, w))}]")
    | st.just("null"),
    "analysis.length_normalise": st.booleans().map(str).map(str.lower),
    "analysis.probe_size": st.integers(2, 4096).map(str) | st.just("null"),
    "analysis.probe_ridges": st.lists(st.floats(0, 10).map(number), max_size=3).map(lambda r: f"[{','.join(r)}]"),
    "analysis.probe_seed": st.integers(0, 2**32),
    "train.batch_size": st.integers(1, 8),
    "train.eval_size": st.integers(1, 16),
    "train.val_size": st.integers(1, 16),
    "train.steps": st.integers(1, 3),
    "train.schedule": st.sampled_from(["onecycle", "constant"]),
    "train.warmup": st.floats(0.01, 0.99).map(number),
    "train.clip": st.floats(1e-3, 10).map(number) | st.just("1"),
    "train.eval_every": st.integers(1, 3),
    "train.lr": st.floats(1e-4, 0.1).map(number) | st.just("1"),
    "train.target_acc": st.floats(0, 1).map(number),
    "train.patience": st.integers(1, 3).map(str) | st.just("null"),
    "train.attention_samples": st.integers(0, 5),
    "train.eval_seed": st.integers(0, 2**32),
    "train.val_seed": st.integers(0, 2**32),
    "seed": st.integers(0, 2**32),
    "report.note": st.sampled_from(["null", "'what this grid shows'", "''"]),
    "hparams_search": st.just("baseline"),  # `train` under the search's preset: one run with its fixed settings
}
# Junk for any key: out of range, huge (refused as sizes no machine holds), of the wrong type, empty.
JUNK_VALUES = st.sampled_from(
    [
        "0",
        "-1",
        "-1000000",
        "1000000000000",
        "10**30",
        "1" + "0" * 30,
        "2.5",
        "1e400",
        "nan",
        "inf",
        "-inf",
        "",
        "' '",
        "oops",
        "true",
        "null",
        "[1,2]",
        "{a: 1}",
        "-0.0",
        "???",  # OmegaConf's missing value
    ]
)
JUNK_OVERRIDES = st.sampled_from(
    [
        "task.lenght=3",
        "+model.depth=2",
        "~task.length",
        "attention=bogus",
        "task=sort",
        "experiment=nope",
        "model=big",
        "train=fast",
        "=3",
        "task.length",
        "seed=1=2",
        "hparams_search=nope",
        "attention.score=no_such_module.Score",  # a class of one's own that does not import
        "attention.score=copytask.models.attention.Nothing",
        "attention.score=copytask.console.ConfigError",  # not an attention class
        # labels (attention.name) that are no plain name, or a built-in's
        "attention.name=../x",
        "attention.name=a/b",
        "attention.name=",
        "attention.name=Mine",
        "attention.name=luong_general-4heads",
        "attention.name=mamba",
        "attention.name=transformer_learned",
        "attention.name=gru",
    ]
)


@st.composite
def valid_overrides(draw) -> list[str]:
    """A few keys of VALID with drawn values, in a drawn order."""
    keys = draw(st.lists(st.sampled_from(sorted(VALID)), unique=True, max_size=8))
    return [f"{key}={draw(VALID[key])}" for key in keys]


def not_a_long_run(override: str) -> bool:
    """A huge train.steps is a long run, not junk: the one huge value no check can refuse."""
    key, value = override.split("=", 1)
    return key != "train.steps" or not value.isdigit()


@st.composite
def any_overrides(draw) -> list[str]:
    """Valid overrides, and in most examples some junk among them."""
    overrides = draw(valid_overrides())
    for _ in range(draw(st.integers(0, 2))):
        junk = draw(
            st.builds("{}={}".format, st.sampled_from(sorted(VALID)), JUNK_VALUES).filter(not_a_long_run)
            | JUNK_OVERRIDES
        )
        overrides.insert(draw(st.integers(0, len(overrides))), junk)
    return overrides


def assert_complete(folder: Path, metrics: dict) -> None:
    assert RUN_FILES <= {path.name for path in folder.iterdir()}, folder
    assert store.is_complete(folder) and store.read_json(folder / store.METRICS) == metrics
    for key in ("token_acc", "seq_acc", "final_loss", "chance", "train_seconds"):
        assert math.isfinite(metrics[key]), (key, metrics[key])
    assert 0 <= metrics["token_acc"] <= 1 and 0 <= metrics["seq_acc"] <= 1


def assert_named_for_what_it_is(cfg, folder: Path, metrics: dict) -> None:
    """A run's label (its folder's first word, its rows') is a built-in's only where the run is that built-in:
    an attention option's where the GRU's attention has the option's type, a model's where it is that model."""
    label, parts = metrics["attention"], folder.name.split("-")  # label, task and lengths, seed, hash
    assert len(parts) == 4 and parts[0] == label != "" and parts[1].startswith(cfg.task.name), folder.name
    if family_of(cfg).reads_attention:
        assert label not in MODEL_RUN_NAMES, label
        if label in ATTENTION_OPTIONS:
            option, type_keys = ATTENTION_OPTIONS[label], ("decoder", "score", "local")
            assert all(cfg.attention.get(key) == option.get(key) for key in type_keys), (label, cfg.attention)


def assert_one_line(error: ConfigError) -> None:
    message = str(error)
    assert message.strip() and "\n" not in message, repr(message)


PROPERTY = settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow  # trains runs (docs/reliability.md: the quick tier)
@PROPERTY
@given(any_overrides())
@example(["task.vocab_size=2", "task.length=3", "train.eval_size=16"])  # issue 19: looped for ever
@example(
    ["attention=scaled_dot", "task=reverse", "task.length=1000000", "model.embedding_size=1000000"]
)  # issue 19: killed for memory
# Found by this test; each was a traceback, or a NaN loss after the run folder was written:
@example(["task=selective_copy", "task.copied=2", "architecture=mamba"])  # issue 82: k among noise, target of k
@example(["task=selective_copy", "task.copied=4"])  # k >= L (QUIET's task.length=4)
@example(["=3"])  # Hydra's ValueError
@example(["attention=[1,2]"])  # Hydra's TypeError
@example(["train.lr=nan"])
@example(["train.lr=1e400"])  # inf
@example(["train.clip=nan"])
@example(["seed=" + "1" + "0" * 30])  # torch's generators take 64 bits
@example(["train.eval_seed=18446744073709551616"])
@example(["train.steps=2", "train.warmup=0.5"])  # a 1-step warm-up: ZeroDivisionError in OneCycleLR
@example(["analysis.beam_widths=[4,65]"])  # past the widest beam
@example(["analysis.probe_ridges=[nan]"])
@example(["analysis.probe_ridges=[]"])
# Labels that trained before issue 87 (part 8): outside runs_dir, '-copy4-...', a GRU named as Mamba
@example(["attention.name=../x"])
@example(["attention.name="])
@example(["attention.name=mamba"])
@example(["attention=luong_general", "attention.name=bahdanau"])
def test_every_override_list_trains_or_is_refused_in_one_line_before_anything_is_written(overrides):
    with tempfile.TemporaryDirectory() as scratch, time_limit(60):
        runs_dir = Path(scratch) / "runs"
        try:
            cfg = compose([*QUIET, *overrides, f"runs_dir={runs_dir}"])
        except ConfigError as error:
            assert_one_line(error)
            assert not runs_dir.exists()
            return
        metrics = train_run(cfg)
        folder = store.run_dir(cfg)
        assert folder.parent == runs_dir and sorted(Path(scratch).iterdir()) == [runs_dir], folder
        assert_complete(folder, metrics)
        assert_named_for_what_it_is(cfg, folder, metrics)


CLI_SETTINGS = settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow  # trains runs (docs/reliability.md: the quick tier)
@CLI_SETTINGS
@given(any_overrides())
def test_the_command_line_trains_or_answers_in_one_line_with_exit_status_2(overrides):
    with tempfile.TemporaryDirectory() as scratch:
        runs_dir = Path(scratch) / "runs"
        env = {**os.environ, "PYTHONPATH": pythonpath(), "HYDRA_FULL_ERROR": "0"}
        command = [sys.executable, "-m", "copytask", "train", *QUIET, *overrides, f"runs_dir={runs_dir}"]
        process = subprocess.run(command, capture_output=True, text=True, env=env, cwd=scratch, timeout=120)
        if process.returncode == 2:
            [line] = process.stderr.strip().splitlines()
            assert line.startswith("copytask: error: ")
            assert not runs_dir.exists()
        else:
            assert process.returncode == 0, process.stderr
            assert sorted(Path(scratch).iterdir()) == [runs_dir]  # nothing beside runs_dir
            [folder] = [path for path in runs_dir.iterdir() if path.name != store.LOCKS]
            assert_complete(folder, store.read_json(folder / store.METRICS))


# -- the attention contract -------------------------------------------------------------------


def attention_config(attention: str):
    """A tiny model's config per attention option (and `transformer`: model=transformer); hidden 8 keeps
    4 heads and both directions whole. A local window of D = 1 (3 positions): the drawn sources of 4-7
    reach past it, where local attention must give weights of exactly 0."""
    if attention == "transformer":
        return compose(["model=transformer", "model.d_model=8", "model.heads=2", "model.ff_size=8"])
    return compose(
        [f"attention={attention}", "model.hidden_size=8", "model.embedding_size=4", "attention.window=1"]
        if "window" in ATTENTION_OPTIONS[attention]
        else [f"attention={attention}", "model.hidden_size=8", "model.embedding_size=4"]
    )


CONFIGS: dict[str, object] = {}


@st.composite
def mixed_batches(draw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """src (B, T) with PAD past each length (lengths >= 1, the longest T), lengths (B,), tgt_in (B, T + 1)."""
    lengths = draw(st.lists(st.integers(1, 7), min_size=1, max_size=5))
    longest = max(lengths)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    symbols = torch.randint(3, 12, (len(lengths), longest), generator=generator)
    batch = task_batch("copy", symbols, torch.tensor(lengths), 9)  # symbols 3 .. 11: 9 content symbols
    return batch.src, batch.src_lengths, batch.tgt_in


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    st.sampled_from([*(name for name in ATTENTIONS if name not in NO_ATTENTION), "transformer"]),
    mixed_batches(),
    st.integers(0, 2**16),
)
def test_attention_weights_keep_the_contract_on_mixed_length_batches(attention, batch, seed):
    src, lengths, tgt_in = batch
    if attention not in CONFIGS:
        CONFIGS[attention] = attention_config(attention)
    cfg = CONFIGS[attention]
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        logits, weights = model(src, lengths, tgt_in)  # weights (B, T_dec, T_enc)
    batch_size, t_dec, t_enc = weights.shape
    valid = torch.arange(t_enc)[None, :] < lengths[:, None]  # (B, T_enc)
    assert (weights.masked_select(~valid[:, None, :]) == 0).all()  # exactly zero on padding
    assert (weights >= 0).all() and torch.isfinite(weights).all()
    totals = weights.sum(-1)  # (B, T_dec)
    local = cfg.attention.get("local")
    if local == "predictive":  # times a Gaussian that is not renormalised: at most 1
        assert (totals <= 1 + 1e-5).all() and (totals > 0).all()
    else:
        torch.testing.assert_close(totals, torch.ones_like(totals))
    if local is not None:  # zero outside [p_t - D, p_t + D]; local-m's p_t is the step, at most the length
        aligned = torch.minimum(torch.arange(t_dec)[None, :], lengths[:, None])  # (B, T_dec)
        outside = (torch.arange(t_enc)[None, None, :] - aligned[:, :, None]).abs() > cfg.attention.window
        if local == "monotonic":
            assert (weights.masked_select(outside) == 0).all()
        else:  # local-p's window is at most 2D + 1 positions wide
            assert ((weights > 0).sum(-1) <= 2 * cfg.attention.window + 1).all()
    for row in range(batch_size):  # each sequence alone, trimmed to its own length
        length = int(lengths[row])
        with torch.no_grad():
            alone_logits, alone_weights = model(
                src[row : row + 1, :length], lengths[row : row + 1], tgt_in[row : row + 1, : length + 1]
            )
        torch.testing.assert_close(alone_weights[0], weights[row, : length + 1, :length], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(alone_logits[0], logits[row, : length + 1], atol=1e-5, rtol=1e-4)
    if not any(getattr(module, "fused", False) for module in model.modules()):
        return  # no fused kernels to compare (tests/test_kernels.py: CI builds them)
    plain = copy.deepcopy(model)  # the same weights through torch's own ops
    for module in plain.modules():
        if hasattr(module, "fused"):
            module.fused = False
    with torch.no_grad():
        plain_logits, plain_weights = plain(src, lengths, tgt_in)
    torch.testing.assert_close(plain_weights, weights, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(plain_logits, logits, atol=1e-5, rtol=1e-4)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    mixed_batches(),
    st.integers(1, 4),  # model.d_state
    st.integers(1, 5),  # model.d_conv
    st.integers(1, 2),  # model.layers
    st.booleans(),  # model.selective: the LTI SSM of the selection ablated too
    st.integers(0, 2**16),
)
def test_mamba_gives_each_sequence_of_a_mixed_batch_what_it_gets_alone(batch, d_state, d_conv, layers, selective, seed):
    """The state a Mamba encoder hands over is the one after each sequence's own last symbol, whatever the
    padding: logits and the summary state per sequence as alone, and the fused scan as torch's loop."""
    src, lengths, tgt_in = batch
    sizes = [f"model.d_state={d_state}", f"model.d_conv={d_conv}", f"model.layers={layers}"]
    sizes.append(f"model.selective={str(selective).lower()}")
    cfg = compose(["model=mamba", "model.d_model=8", *sizes])
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    plain = copy.deepcopy(model)
    plain.fused = False
    with torch.no_grad():
        logits, _ = model(src, lengths, tgt_in)
        summary = model.summary_state(src, lengths)
        torch.testing.assert_close(plain(src, lengths, tgt_in)[0], logits, atol=1e-5, rtol=1e-4)
        for row in range(len(lengths)):
            length = int(lengths[row])
            alone = src[row : row + 1, :length], lengths[row : row + 1]
            alone_logits, _ = model(*alone, tgt_in[row : row + 1, : length + 1])
            torch.testing.assert_close(alone_logits[0], logits[row, : length + 1], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(model.summary_state(*alone)[0], summary[row], atol=1e-6, rtol=1e-5)


# -- run names --------------------------------------------------------------------------------

# Keys that change the computation, with two values each that every option accepts.
COMPUTATION = {
    "task.length": ("4", "5"),
    "task.vocab_size": ("5", "6"),
    "task": tuple(TASK_OPTIONS)[:2],
    "seed": ("0", "1"),
    "model.hidden_size": ("8", "12"),
    "model.embedding_size": ("4", "6"),
    "model.bidirectional": ("true", "false"),
    "train.batch_size": ("4", "5"),
    "train.eval_size": ("8", "9"),
    "train.steps": ("2", "3"),
    "train.lr": ("0.01", "0.02"),
    "train.clip": ("1", "2"),
    "train.eval_every": ("1", "2"),
    "train.eval_seed": ("7", "8"),
    "train.val_size": ("8", "9"),
    "train.val_seed": ("7", "8"),
    "train.target_acc": ("0.9", "1"),
    "train.patience": ("2", "null"),
    "attention": ("luong_general", "bahdanau"),
}
# Spellings of one computation: (key, value) pairs that leave it as it is when added.
NEUTRAL = [
    ("attention.heads", "1"),
    ("train.threads", "1"),
    ("train.progress", "false"),
    ("train.fused", "false"),
    ("train.attention_samples", "2"),
    ("task.variable_length", "false"),
    ("train.schedule", "onecycle"),
    ("task.min_length", "3"),
    ("runs_dir", "elsewhere"),
    ("analysis.eval_size", "7"),
    ("model", "gru"),
    ("model.d_model", "16"),
    ("model.layers", "3"),
    ("model.d_state", "8"),
    ("analysis.lengths", "[5,9]"),
    ("analysis.beam_widths", "[2]"),
    ("analysis.probe_size", "null"),
    ("task.copied", "null"),
    ("model.selective", "null"),
]  # model=gru reads no Transformer or Mamba key


def whole_float(value: str) -> str:
    """`1` -> `1.0`: another spelling of a whole number (only keys whose type is a float take it)."""
    return f"{value}.0" if value.isdigit() else value


FLOAT_KEYS = ("train.lr", "train.clip", "train.target_acc")


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    st.dictionaries(st.sampled_from(sorted(COMPUTATION)), st.integers(0, 1), max_size=5),
    st.sampled_from(sorted(COMPUTATION)),
    st.lists(st.sampled_from(NEUTRAL), unique=True, max_size=3),
    st.randoms(use_true_random=False),
)
def test_a_run_name_is_stable_under_spellings_and_changes_with_the_computation(chosen, changed, neutral, order):
    base = {key: COMPUTATION[key][index] for key, index in {changed: 0, **chosen}.items()}
    plain = [f"{key}={value}" for key, value in base.items()]
    spelled = [f"{key}={whole_float(value) if key in FLOAT_KEYS else value}" for key, value in base.items()]
    spelled += [f"{key}={value}" for key, value in neutral]
    order.shuffle(spelled)
    flipped = {**base, changed: COMPUTATION[changed][1 - COMPUTATION[changed].index(base[changed])]}

    name = store.run_name(compose(plain))
    assert store.run_name(compose(spelled)) == name
    assert store.run_name(compose([f"{key}={value}" for key, value in flipped.items()])) != name

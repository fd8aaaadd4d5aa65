"""Linear attention (`attention=linear`, Katharopoulos et al., 2020) against its per-position definition,
the state every model's decoder reads of the source (`state_floats`) as results.csv, `compare` and the
report show it, and experiment=fixed_state."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import copytask
from copytask import store
from copytask.cli import main
from copytask.console import ConfigError
from copytask.data.batches import length_mask, make_batch
from copytask.data.vocab import total_vocab
from copytask.models.attention import make_attention
from copytask.models.build import build_model
from copytask.models.linear_attention import LinearAttention
from copytask.models.recurrent import Seq2Seq
from copytask.reporting import tables
from copytask.reporting.breakdown_tables import breakdown_columns
from copytask.reporting.state_section import STATE_FIGURE, least_state, plot_state, rank_table
from copytask.reporting.tables import state_varies

from .conftest import ATTENTION_OPTIONS

B, T_DEC, T_ENC, H, D_K = 3, 5, 7, 8, 4


def inputs(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    query, states = torch.randn(B, T_DEC, H, dtype=dtype), torch.randn(B, T_ENC, H, dtype=dtype)
    return query, states, length_mask(torch.tensor([7, 4, 2]), T_ENC)


def linear(d_k: int = D_K, dtype=torch.float32) -> LinearAttention:
    torch.manual_seed(1)
    return make_attention("linear", H, H, d_k).to(dtype)


def by_hand(attention: LinearAttention, query, states, mask):
    """Eq. (4) of Katharopoulos et al., the per-position form, written out: weights (B, T_dec, T_enc) and their
    mean of the states."""
    phi = lambda x: F.elu(x) + 1  # noqa: E731
    q, k = (
        phi(query @ attention.query_proj.weight.T + attention.query_proj.bias),
        phi(states @ attention.key_proj.weight.T + attention.key_proj.bias),
    )
    similarity = torch.einsum("btd,bsd->bts", q, k) * mask[:, None, :]
    weights = similarity / similarity.sum(-1, keepdim=True)
    return weights @ states, weights


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_summary_form_is_the_per_position_form(dtype):
    """phi(Q_t)^T S / phi(Q_t)^T z (what forward computes from `summarise`) equals the per-position weights'
    mean of the states, by hand and through the intervention path, to float rounding."""
    query, states, mask = inputs(0, dtype)
    attention = linear(dtype=dtype)
    keys = attention.project_keys(states)
    summary = attention.summarise(keys, states, mask)
    assert summary.shape == (B, D_K, H + 1)
    context, weights = attention(query, keys, states, mask, summary=summary)
    want_context, want_weights = by_hand(attention, query, states, mask)
    torch.testing.assert_close(context, want_context)
    torch.testing.assert_close(weights, want_weights)
    torch.testing.assert_close(attention(query, keys, states, mask), (context, weights))  # summarised in the call
    unweighted, none = attention(query, keys, states, mask, summary=summary, need_weights=False)
    assert torch.equal(unweighted, context) and none is None  # S and z alone: the same context to the bit
    attention.intervention = lambda weights, mask: weights  # the per-position path, weights unchanged
    per_position, _ = attention(query, keys, states, mask, summary=summary)
    torch.testing.assert_close(per_position, context)
    if dtype == torch.float64:  # equal to float rounding, not merely close
        assert (per_position - context).abs().max() < 1e-12


def test_weights_are_attention_weights_and_padding_adds_nothing():
    query, states, mask = inputs(2)
    attention = linear()
    states[1, 4:] = 1e3  # padding must not reach S, z or the weights however large it is
    keys = attention.project_keys(states)
    context, weights = attention(query, keys, states, mask)
    assert (weights >= 0).all() and (weights[~mask[:, None, :].expand_as(weights)] == 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, T_DEC))
    for b, length in enumerate(mask.sum(-1).tolist()):  # each sequence alone: the same summary and output
        alone = states[b : b + 1, :length]
        alone_keys, alone_mask = attention.project_keys(alone), mask[b : b + 1, :length]
        torch.testing.assert_close(
            attention.summarise(keys, states, mask)[b], attention.summarise(alone_keys, alone, alone_mask)[0]
        )
        alone_context, alone_weights = attention(query[b : b + 1], alone_keys, alone, alone_mask)
        torch.testing.assert_close(context[b], alone_context[0])
        torch.testing.assert_close(weights[b, :, :length], alone_weights[0])


def test_an_intervention_replaces_the_weights_the_context_is_made_of():
    query, states, mask = inputs(3)
    attention = linear()
    attention.intervention = lambda weights, mask: (mask[:, None, :] / mask.sum(-1)[:, None, None]).expand_as(
        weights
    )  # uniform
    context, weights = attention(query, attention.project_keys(states), states, mask)
    mean = (states * mask[..., None]).sum(1) / mask.sum(-1, keepdim=True)
    torch.testing.assert_close(context, mean[:, None].expand_as(context))
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, T_DEC))


@pytest.mark.parametrize("d_k, length", [(3, 12), (2, 9), (16, 6)])
def test_the_weight_matrix_has_rank_at_most_the_feature_size(d_k, length):
    """The premise of the fixed_state prediction: T_dec x T_enc weights of rank <= d_k, so past L = d_k no
    weights are the one-hot alignment (the identity, rank L); with d_k >= L the rank reaches L."""
    torch.manual_seed(4)
    attention = make_attention("linear", H, H, d_k).double()
    states, query = torch.randn(2, length, H).double(), torch.randn(2, length, H).double()
    _, weights = attention(query, attention.project_keys(states), states, torch.ones(2, length, dtype=torch.bool))
    ranks = torch.linalg.matrix_rank(weights)
    assert (ranks == min(d_k, length)).all()


class Reads(TorchFunctionMode):
    """The torch functions called on any of `tensors` (the very tensors, not copies) while it is on, by name:
    what reads them, their shape aside."""

    SHAPE = {"__get__", "size", "dim"}  # .shape, .size(), .dim(): no value is read

    def __init__(self, *tensors: torch.Tensor) -> None:
        super().__init__()
        self.tensors, self.calls = tensors, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        taken = any(arg is tensor for arg in (*args, *kwargs.values()) for tensor in self.tensors)
        if taken and getattr(func, "__name__", "") not in self.SHAPE:
            self.calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **kwargs)


def test_the_decoder_reads_only_the_summary_and_the_state_handed_over():
    """What `state_floats` counts: with the memory's per-position keys and values replaced by noise and its
    summary kept, every greedy step's logits are the same; only the weights (per position) change. Asked for
    no weights (as greedy decoding is where only its tokens are read), a step reads S, z and the hand-over
    alone: no function takes the keys or the values, and the logits are the same to the bit."""
    torch.manual_seed(5)
    model = Seq2Seq(total_vocab(6), "luong", "linear", embedding_size=8, hidden_size=16, attention_size=4).eval()
    batch = make_batch("copy", 4, 9, 6, torch.Generator().manual_seed(5), min_length=2)
    real = model.decoding(batch.src, batch.src_lengths, 10)
    noisy = model.decoding(batch.src, batch.src_lengths, 10)
    unread = model.decoding(batch.src, batch.src_lengths, 10, need_weights=False)
    keys, values, summary = noisy.memory
    assert summary.shape == (4, 4, 17)
    noisy.memory = (torch.rand_like(keys), torch.randn_like(values), summary)
    tokens = torch.full((4,), 1, dtype=torch.long)
    for t in range(10):
        logits, weights = real.step(tokens, t)
        noisy_logits, noisy_weights = noisy.step(tokens, t)
        torch.testing.assert_close(noisy_logits, logits)
        assert not torch.allclose(noisy_weights, weights)
        with Reads(*unread.memory[:2]) as reads:
            unread_logits, unread_weights = unread.step(tokens, t)
        assert reads.calls == [] and unread_weights is None
        assert torch.equal(unread_logits, logits)
        tokens = logits.argmax(-1)
    with Reads(*real.memory[:2]) as reads:  # the maps read every position's key
        real.step(tokens, 10 - 1)
    assert "transpose" in reads.calls


def measured_state(model, src, lengths) -> int:
    """Floats per sequence of what a model's decoding holds of the source: the hand-over (the encoder's final
    state) and the attention's memory (its summary where it has one, else every encoder state); a
    Transformer's encoder output."""
    if hasattr(model, "encode"):
        memory, _ = model.encode(src, lengths)
        return memory[0].numel()
    _, final = model.encoder(src, lengths)
    memory = model.decoding(src, lengths, 2).memory
    if memory is None:
        return final[0].numel()
    read = memory[2] if len(memory) == 3 and memory[2] is not None else memory[1]
    return final[0].numel() + read[0].numel()


@pytest.mark.parametrize(
    "overrides", [[f"attention={name}"] for name in ATTENTION_OPTIONS] + [["model=transformer"]], ids=str
)
def test_state_floats_is_what_each_decoder_holds_of_the_source(make_config, overrides):
    cfg = make_config(*overrides, "task.length=7", "model.hidden_size=16", "attention.size=4")
    model = build_model(cfg).eval()
    batch = make_batch("copy", 2, 7, cfg.task.vocab_size, torch.Generator().manual_seed(0))
    assert model.state_floats(7) == measured_state(model, batch.src, batch.src_lengths)
    grows = cfg.model.name == "transformer" or cfg.attention.score not in (None, "linear")
    assert (model.state_floats(14) > model.state_floats(7)) == grows  # only the states of every position grow
    if cfg.attention.score == "linear" and cfg.model.name == "gru":
        assert model.state_floats(7) == 16 + 4 * (16 + 1)  # H + d_k x (d_h + 1)


def test_linear_attention_refuses_what_it_cannot_do(make_config):
    with pytest.raises(ValueError, match="heads=2 needs a"):
        make_attention("linear", H, H, D_K, heads=2)
    with pytest.raises(ValueError, match="linear attention reads a summary of the whole source, not a window"):
        make_attention("linear", H, H, D_K, local="monotonic", window=2)
    for size in (None, 0):
        with pytest.raises(ValueError, match=rf"feature size d_k\) >= 1, got {size}"):
            make_attention("linear", H, H, size)
    for overrides, says in [
        (["attention.heads=2"], "attention=linear: heads=2 needs a"),
        (["attention.local=monotonic", "attention.window=2"], "attention=linear: linear attention reads a summary"),
        (["attention.size=null"], "attention=linear: linear attention needs attention_size"),
    ]:
        with pytest.raises(ConfigError, match=says):
            copytask.compose(["attention=linear", *overrides])


# -- state floats in results.csv, compare and the report --------------------------------------------------

SMALL = [
    "train.device=cpu",
    "train.steps=10",
    "train.eval_every=5",
    "train.eval_size=16",
    "train.val_size=16",
    "train.batch_size=8",
    "model.embedding_size=8",
    "train.threads=1",
    "train.progress=false",
    "hydra/launcher=basic",
    "analysis.beam_widths=[1]",
    "analysis.probe_size=null",
]
TINY_GRID = [
    "experiment=fixed_state",
    "architecture=fixed_state/none_hidden16,fixed_state/none_hidden32,fixed_state/linear_features16,fixed_state/linear_features8",
    "task.length=6,12",
    "seed=0",
]


@pytest.fixture(scope="module")
def fixed_state_runs(tmp_path_factory):
    """experiment=fixed_state shrunk (two sizes of each family, lengths 6 and 12, one seed), swept and reported."""
    runs_dir = tmp_path_factory.mktemp("fixed_state") / "runs"
    copytask.sweep([*SMALL, *TINY_GRID], runs_dir=runs_dir)
    return runs_dir


def test_every_run_records_its_state_and_results_and_compare_show_it(fixed_state_runs, capsys):
    results = pd.read_csv(fixed_state_runs / tables.RESULTS_CSV)
    assert len(results) == 8 and results[tables.STATE_FLOATS].notna().all()
    for row in results.itertuples():
        model, _ = copytask.load_run(fixed_state_runs / row.run)
        assert (
            row.state_floats
            == model.state_floats(row.length)
            == store.read_json(fixed_state_runs / row.run / store.METRICS)["state_floats"]
        )
    baseline = results[results["attention"] == "none"].set_index("model.hidden_size")
    assert set(baseline[tables.STATE_FLOATS]) == {16, 32}  # the hand-over vector
    linear = results[results["attention"] == "linear"].set_index("attention.size")
    assert set(linear[tables.STATE_FLOATS]) == {64 + 8 * 65, 64 + 16 * 65}  # H + d_k x (H + 1)
    summary = copytask.compare(fixed_state_runs)
    assert sorted(summary[tables.STATE_FLOATS].unique()) == [16, 32, 584, 1104]
    capsys.readouterr()
    assert main(["compare", f"runs_dir={fixed_state_runs}"]) == 0
    printed = capsys.readouterr().out
    assert "state floats" in printed and "1,104" in printed  # a grid of state sizes: in the narrow table too


def test_runs_from_before_show_an_empty_state_not_an_error(fixed_state_runs, tmp_path):
    import shutil

    copy = tmp_path / "runs"
    shutil.copytree(fixed_state_runs, copy)
    results = pd.read_csv(copy / tables.RESULTS_CSV)
    old = results["run"].iloc[0]
    metrics = store.read_json(copy / old / store.METRICS)
    del metrics["state_floats"]
    store.write_json(copy / old / store.METRICS, metrics)
    summary = copytask.compare(copy)
    shown = tables.comparison_table(summary, ["model.hidden_size", "attention.size"], wide=True)
    assert (shown["state floats per sequence"] == "").sum() == 1 and summary[tables.STATE_FLOATS].isna().sum() == 1
    copytask.report(copy)
    again = pd.read_csv(copy / tables.RESULTS_CSV).set_index("run")
    assert math.isnan(again.loc[old, tables.STATE_FLOATS]) and again[tables.STATE_FLOATS].notna().sum() == 7


def test_the_sweeps_analysis_checks_linear_attention_as_any_attention(fixed_state_runs):
    """Counterfactual weights, alignment and beam search ran on its per-position weights."""
    results = pd.read_csv(fixed_state_runs / tables.RESULTS_CSV)
    for run in results.loc[results["attention"] == "linear", "run"]:
        analysis = store.read_json(fixed_state_runs / run / store.ANALYSIS)
        assert {"own", "uniform", "permuted", "fixed"} == set(analysis["counterfactual"])
        assert all(
            math.isfinite(value) for value in [*analysis["counterfactual"].values(), *analysis["alignment"].values()]
        )
        assert "beam1_token_acc" in breakdown_columns(analysis)


def test_the_report_draws_accuracy_against_state_from_real_runs(fixed_state_runs):
    report = (fixed_state_runs / "report" / "report.md").read_text()
    assert (fixed_state_runs / "report" / STATE_FIGURE).stat().st_size > 0
    assert f"![accuracy against state floats]({STATE_FIGURE})" in report
    assert "none: the encoder's final state handed over" in report and "linear: S and z" in report
    assert "Jelassi et al. (ICML 2024)" in report and "V = 9" in report
    section = report.split("### Linear attention past its feature size")[1].split("\n#")[0]  # up to the next heading
    assert "| linear | 8 |" in section and "| linear | 16 |" in section
    assert section.count(" * |") == 1  # L = 12 past d_k = 8, and nothing else
    assert section.count(") |") + section.count(") * |") == 4  # each cell with its weight on the copied position
    assert "transformer" not in report.split("## Accuracy against state size")[1].split("##")[0]


def fake_summary(families: dict[str, list[int]], lengths=(10, 20), vocab_size=9) -> pd.DataFrame:
    """A summary as `tables.summarise` gives it: per family its state sizes, accuracy falling with length and
    rising with the state."""
    rows = []
    for family, states in families.items():
        for length in lengths:
            for state in states:
                acc = min(1.0, 0.1 + state / (40 * length))
                rows.append(
                    {
                        "attention": family,
                        "length": length,
                        "token_acc": acc,
                        "token_acc_lo": acc - 0.05,
                        "token_acc_hi": acc + 0.05,
                        "seq_acc": acc**length,
                        "seq_acc_lo": math.nan,
                        "seq_acc_hi": math.nan,
                        "chance": 1 / vocab_size,
                        tables.STATE_FLOATS: state,
                    }
                )
    return pd.DataFrame(rows)


def test_the_state_figure_draws_every_family_and_length_with_the_bound(tmp_path, monkeypatch):
    """Drawn from a fake table, for whatever families it holds (a state-space model among them): a line per
    family and length on a log axis, a grey line per length at the least state that holds it, titles that fit."""
    from copytask.reporting import state_section

    drawn, real_save = {}, state_section.save

    def record(figure, path):
        drawn["figure"] = figure
        return real_save(figure, path)

    monkeypatch.setattr(state_section, "save", record)
    summary = fake_summary({"none": [16, 32, 64], "linear": [264, 528], "mamba": [40, 160, 640]})
    assert state_varies(summary) and not state_varies(summary[summary[tables.STATE_FLOATS].isin([16, 264, 40])])
    path = plot_state(summary, [], tmp_path / STATE_FIGURE)
    assert path.stat().st_size > 0
    figure = drawn["figure"]
    token = figure.axes[0]
    assert token.get_xscale() == "log"
    labels = [line.get_label() for line in token.lines]
    for family in ("none", "linear", "mamba"):
        for length in (10, 20):
            assert f"{family}, length {length}" in labels
    bounds = {line.get_label(): line.get_xdata()[0] for line in token.lines if line.get_label().startswith("bound")}
    assert bounds == {f"bound, length {length}": pytest.approx(least_state(length, 9)) for length in (10, 20)}
    assert least_state(80, 9) == pytest.approx(80 * math.log2(9) / 32)
    figure.canvas.draw()
    for title in [figure._suptitle, *(axis.title for axis in figure.axes)]:
        extent = title.get_window_extent()
        assert extent.x0 >= 0 and extent.x1 <= figure.bbox.width, title.get_text()


def test_a_table_without_state_floats_draws_no_state_figure():
    summary = fake_summary({"none": [16, 32]}).drop(columns=[tables.STATE_FLOATS])
    assert not state_varies(summary)
    assert not state_varies(fake_summary({"none": [16, 32]}).assign(**{tables.STATE_FLOATS: pd.NA}))
    loaded = tables.Loaded(pd.DataFrame({"run": [], "attention": [], "length": [], "token_acc": []}), {}, [], {}, [])
    assert rank_table(loaded).empty


@pytest.mark.slow
def test_the_preset_sweeps_each_family_over_its_own_size(monkeypatch):
    from copytask.sweeps.grid import check_grid

    grid = check_grid(["experiment=fixed_state", "task.length=80", "seed=0"])
    sizes = {}
    for run in grid:
        cfg = run.config
        family = cfg.model.name if cfg.model.name == "mamba" else cfg.attention.name
        size = {"none": cfg.model.get("hidden_size"), "linear": cfg.attention.size, "mamba": cfg.model.get("d_state")}
        size = size[family]
        sizes.setdefault(family, []).append(size)
        assert cfg.runs_dir == "runs/fixed_state" and cfg.train.steps == 1200  # the default budget
        if family == "linear":
            assert cfg.model.hidden_size == 64
    assert sizes == {"none": [128, 64, 32, 16], "linear": [64, 32, 16, 8], "mamba": [16, 4, 1]}

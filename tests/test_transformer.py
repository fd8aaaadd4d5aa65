"""model=transformer (torch's nn.Transformer) and attention=rnnencdec (Cho et al., 2014): their
definitions, decoding, masks, parameter counts and configs, and a tiny run through the real CLI."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from copytask import analysis, store
from copytask.config import ConfigError
from copytask.validation import parameter_count, validate
from copytask.data import BOS, make_batch
from copytask.evaluation import build_model
from copytask.model import count_parameters

from .conftest import TINY, run_cli

# A small Transformer: two layers so that the decoder's cache and the last layer both matter.
SMALL = ["model=transformer", "model.d_model=16", "model.heads=2", "model.layers=2", "model.ff_size=24"]
TINY_TRANSFORMER = [*TINY, "model=transformer", "model.d_model=8", "model.heads=2", "model.layers=1", "model.ff_size=16"]


def trained_a_little(model: nn.Module, cfg, steps: int = 30) -> nn.Module:
    """A few Adam steps on the copy task: weights away from their initialisation, so that argmaxes differ
    between steps and positions and the tests below test something."""
    from copytask.splits import sample_batch
    from copytask.training import train_step

    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        train_step(model, optimizer, sample_batch(cfg, 16, generator), 1.0)
    return model.eval()


@pytest.fixture(params=[SMALL, [*SMALL, "model.positions=learned"], ["attention=rnnencdec", "model.hidden_size=16"]],
                ids=["sinusoidal", "learned", "rnnencdec"])
def model_and_config(request, make_config):
    cfg = make_config("task.length=7", "task.variable_length=true", "task.min_length=2", *request.param)
    torch.manual_seed(0)
    return trained_a_little(build_model(cfg), cfg), cfg


def mixed_batch(cfg, size: int = 6):
    return make_batch("copy", size, cfg.task.length, cfg.task.vocab_size, torch.Generator().manual_seed(3), min_length=2)


def test_greedy_equals_the_teacher_forced_argmax_fed_its_own_outputs(model_and_config):
    model, cfg = model_and_config
    batch = mixed_batch(cfg)
    tokens, weights = model.greedy(batch.src, batch.src_lengths, steps=batch.tgt_out.size(1))
    fed = torch.cat([torch.full_like(tokens[:, :1], BOS), tokens[:, :-1]], dim=1)  # its own outputs as the decoder input
    with torch.no_grad():
        logits, forced_weights = model(batch.src, batch.src_lengths, fed)
    assert torch.equal(logits.argmax(-1), tokens)
    assert len(set(tokens.flatten().tolist())) > 2  # trained enough to say different things
    if weights is not None:
        torch.testing.assert_close(weights, forced_weights, atol=1e-5, rtol=1e-4)


def test_a_mixed_length_batch_gives_each_sequence_what_it_gets_alone(model_and_config):
    model, cfg = model_and_config
    batch = mixed_batch(cfg)
    assert batch.src_lengths.unique().numel() > 1
    with torch.no_grad():
        logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
        tokens, weights = model.greedy(batch.src, batch.src_lengths, steps=batch.tgt_out.size(1))
    for i in range(len(batch)):
        alone = batch.select(slice(i, i + 1))  # trimmed to its own length
        length = int(alone.src_lengths[0])
        with torch.no_grad():
            own_logits, _ = model(alone.src, alone.src_lengths, alone.tgt_in)
            own_tokens, own_weights = model.greedy(alone.src, alone.src_lengths, steps=length + 1)
        torch.testing.assert_close(logits[i, : length + 1], own_logits[0], atol=1e-5, rtol=1e-4)
        assert torch.equal(tokens[i, : length + 1], own_tokens[0])
        if weights is not None:
            torch.testing.assert_close(weights[i, : length + 1, :length], own_weights[0], atol=1e-5, rtol=1e-4)
            assert weights[i, :, length:].abs().max() == 0  # no weight on padding


def test_the_decoder_is_causal(model_and_config):
    model, cfg = model_and_config
    batch = mixed_batch(cfg)
    with torch.no_grad():
        logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
        for t in range(1, batch.tgt_in.size(1)):
            changed = batch.tgt_in.clone()
            changed[:, t:] = torch.randint(3, 12, changed[:, t:].shape, generator=torch.Generator().manual_seed(t))
            changed_logits, _ = model(batch.src, batch.src_lengths, changed)
            torch.testing.assert_close(changed_logits[:, :t], logits[:, :t], atol=1e-5, rtol=1e-4)
            assert not torch.allclose(changed_logits[:, t:], logits[:, t:])  # what comes after does see it


def test_the_decoder_layers_compute_what_torchs_own_forward_computes(make_config):
    cfg = make_config("task.length=6", *SMALL, "model.dropout=0.0")
    torch.manual_seed(0)
    model = trained_a_little(build_model(cfg), cfg)
    batch = mixed_batch(cfg)
    src_mask = batch.src_mask
    causal = torch.ones(batch.tgt_in.size(1), batch.tgt_in.size(1), dtype=torch.bool).triu(1)  # True: masked
    with torch.no_grad():
        memory, _ = model.encode(batch.src, batch.src_lengths)
        # nn.Transformer's own forward on the same embeddings and masks
        decoded = model.transformer(
            model._embed(model.src_embedding, batch.src), model._embed(model.tgt_embedding, batch.tgt_in), tgt_mask=causal,
            src_key_padding_mask=~src_mask, tgt_key_padding_mask=batch.tgt_in == 0, memory_key_padding_mask=~src_mask, tgt_is_causal=True,
        )
        logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
    valid = batch.target_mask
    torch.testing.assert_close(logits[valid], model.out(decoded)[valid], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("overrides", [SMALL, [*SMALL, "model.positions=learned", "model.max_length=30"], ["model=transformer"]])
def test_parameter_counts(make_config, overrides):  # the GRU models': tests/test_limits.py
    cfg = make_config(*overrides)
    assert count_parameters(build_model(cfg)) == parameter_count(cfg)


def test_the_default_transformer_is_near_luong_generals_size(make_config):
    transformer, luong = parameter_count(make_config("model=transformer")), parameter_count(make_config("attention=luong_general"))
    assert abs(transformer - luong) / luong < 0.05


def test_a_learned_table_covers_max_length_and_no_more(make_config):
    cfg = make_config(*SMALL, "model.positions=learned", "model.max_length=9", "task.length=6")
    model = build_model(cfg).eval()
    assert model.longest_source == 9
    rows = analysis.length_generalisation(model, cfg, [6, 9, 12], eval_size=4)
    assert [row["token_acc"] is None for row in rows] == [False, False, True]
    assert "not defined" in rows[2]["note"]
    batch = make_batch("copy", 2, 12, cfg.task.vocab_size, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="learned positions cover sources up to 9"):
        model.greedy(batch.src, batch.src_lengths, steps=13)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model=transformer", "attention=bahdanau"], "attention=bahdanau (and every attention.* key) is model=gru's decoder"),
        (["model=transformer", "attention.size=3"], "the attention group must stay at its default"),
        (["model=transformer", "model.heads=3"], "must be divisible by model.heads"),
        (["model=transformer", "model.positions=rotary"], "model.positions must be one of sinusoidal, learned"),
        (["model=transformer", "model.positions=learned", "model.max_length=10"], "must be at least task.length"),
        (["model=transformer", "model.dropout=1.0"], "model.dropout must be a number in [0, 1)"),
        (["model=transformer", "model.layers=0"], "model.layers must be an integer >= 1"),
        (["model=transformer", "model.d_model=null"], "model.d_model must not be null with model=transformer"),
        (["model.hidden_size=null"], "model.hidden_size must not be null with model=gru"),
        (["analysis.lengths=[0,5]"], "analysis.lengths must be null or a list of integers >= 1"),
    ],
)
def test_refusals_are_one_line(make_config, overrides, message):
    with pytest.raises(ConfigError) as refused:
        validate(make_config(*overrides))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_run_names_keep_the_gru_runs_and_name_the_new_ones(make_config):
    # the names these runs have had since the validation set (commit d3a649a; before it, since commit 289b03a,
    # d488c388 and efc64378): the model group and architecture presets rename no GRU run
    assert store.run_name(make_config("model=gru")) == store.run_name(make_config()) == "luong_general-copy20-seed0-49c90a6e"
    bahdanau = store.run_name(make_config("attention=bahdanau"))
    assert store.run_name(make_config("architecture=bahdanau")) == bahdanau == "bahdanau-copy20-seed0-5fa3dde3"
    assert store.run_name(make_config("model=transformer")).startswith("transformer-copy20-seed0-")
    assert store.run_name(make_config("architecture=transformer_learned")).startswith("transformer_learned-copy20-seed0-")
    assert store.run_name(make_config("attention=rnnencdec")).startswith("rnnencdec-copy20-seed0-")
    # the other model's keys are not read, so not part of the run
    assert store.run_name(make_config("model=transformer", "model.hidden_size=8")) == store.run_name(make_config("model=transformer"))
    assert store.run_name(make_config("model.d_model=8")) == store.run_name(make_config())
    assert store.run_name(make_config("model=transformer", "model.d_model=16")) != store.run_name(make_config("model=transformer"))


def test_maps_heads_and_counterfactuals_go_through_the_cross_attention(make_config):
    cfg = make_config("task.length=6", *SMALL)
    torch.manual_seed(0)
    model = trained_a_little(build_model(cfg), cfg)
    batch = make_batch("copy", 8, 6, cfg.task.vocab_size, torch.Generator().manual_seed(5))
    tokens, weights = model.greedy(batch.src, batch.src_lengths, steps=7)
    heads = analysis.head_weights(model, batch)  # (B, heads, T_dec, T_enc): the last layer's
    assert heads.shape == (8, 2, 7, 6)
    torch.testing.assert_close(heads.mean(1), weights, atol=1e-5, rtol=1e-4)
    assert len(model.attentions) == 2  # every layer's cross-attention is replaced by a counterfactual
    seen = []

    def uniform(w, mask):
        seen.append(w.shape)
        return analysis.uniform_weights(w, mask)

    with analysis.intervention(model.attentions[0], uniform), analysis.intervention(model.attentions[1], uniform):
        _, replaced = model.greedy(batch.src, batch.src_lengths, steps=7)
    assert len(seen) == 2 * 7  # both layers, every step
    torch.testing.assert_close(replaced, torch.full_like(replaced, 1 / 6))


def test_a_tiny_transformer_run_through_the_cli_and_decode_on_it(tmp_path):
    runs_dir = tmp_path / "runs"
    trained = run_cli("train", *TINY_TRANSFORMER, f"runs_dir={runs_dir}")
    assert trained.returncode == 0, trained.stderr
    [folder] = store.complete_runs(runs_dir)
    assert folder.name.startswith("transformer-copy5-seed0-")
    metrics = store.read_json(folder / store.METRICS)
    assert metrics["attention"] == "transformer" and metrics["params"] == parameter_count_of(folder)
    samples = store.read_json(folder / store.ATTENTION)["samples"]
    assert len(samples[0]["weights"]) == 6 and len(samples[0]["weights"][0]) == 5  # (T_dec, T_enc) of the mean map
    decoded = run_cli("decode", str(folder), "a b c d e")
    assert decoded.returncode == 0, decoded.stderr
    assert "transformer, task copy" in decoded.stdout and "head 1" in decoded.stdout
    analysed = run_cli("analyze", f"runs_dir={runs_dir}", "analysis.lengths=[3,5,8]", "train.progress=false")
    assert analysed.returncode == 0, analysed.stderr
    result = store.read_json(folder / store.ANALYSIS)
    assert [row["test_length"] for row in result["length_generalisation"]] == [3, 5, 8]
    assert set(result["counterfactual"]) == {"own", "uniform", "permuted", "fixed"}
    assert len(result["head_weights"]["weights"]) == 2  # per head


def parameter_count_of(folder) -> int:
    from omegaconf import OmegaConf

    return parameter_count(OmegaConf.load(folder / store.CONFIG))



def test_a_sweep_mixing_gru_and_transformer_models_is_analysed_at_the_lengths_asked(tmp_path):
    runs_dir = tmp_path / "runs"
    grid = ["architecture=transformer,rnnencdec,luong_general", "~hydra.sweeper.params.attention", "task.length=3", "seed=0",
            "analysis.lengths=[3,5]"]
    small = ["model.d_model=8", "model.heads=2", "model.layers=1", "model.ff_size=16"]
    swept = run_cli("sweep", *TINY, *small, *grid, f"runs_dir={runs_dir}")
    assert swept.returncode == 0, swept.stderr
    names = sorted(folder.name.split("-")[0] for folder in store.complete_runs(runs_dir))
    assert names == ["luong_general", "rnnencdec", "transformer"]
    for folder in store.complete_runs(runs_dir):
        tested = [row["test_length"] for row in store.read_json(folder / store.ANALYSIS)["length_generalisation"]]
        assert tested == [3, 5]
    compared = run_cli("compare", *TINY, *small, *grid, f"runs_dir={runs_dir}")
    assert compared.returncode == 0, compared.stderr
    assert "transformer" in compared.stdout and "rnnencdec" in compared.stdout
    assert (runs_dir / "report" / "extrapolation.png").is_file()
    assert "Transformer: torch's nn.Transformer, 1 layers each side" in (runs_dir / "report" / "report.md").read_text()


def test_scaled_embeddings_start_on_the_scale_of_the_positions(make_config):
    """Vaswani et al.'s N(0, 1/d) times sqrt(d): torch's N(0, 1) times sqrt(d) started 5.7 times larger
    than the sinusoids and drowned the positions (13% token accuracy at length 80 on the default budget)."""
    cfg = make_config("model=transformer")
    torch.manual_seed(0)
    model = build_model(cfg)
    tokens = torch.arange(3, 12)[None]  # every content symbol
    scaled = model.src_embedding(tokens) * model.d_model**0.5
    positions = model.positions(torch.arange(80))
    ratio = scaled.pow(2).mean().sqrt() / positions.pow(2).mean().sqrt()
    assert 0.5 < ratio < 2
    assert model.src_embedding.weight[0].abs().max() == 0 == model.tgt_embedding.weight[0].abs().max()  # PAD stays zero

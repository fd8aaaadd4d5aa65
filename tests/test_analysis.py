"""Counterfactual weights, alignment, per-length evaluation and `analyze` through the real CLI."""

import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from copytask import cli, figures, store
from copytask.config import schema
from copytask.console import CopytaskWarning
from copytask.data import batches
from copytask.data.batches import make_batch, task_batch
from copytask.data.tasks import TASKS
from copytask.data.vocab import EOS, noise_token, total_vocab
from copytask.evaluation import analysis
from copytask.families import FAMILIES
from copytask.models.greedy import evaluate
from copytask.models.recurrent import Seq2Seq
from copytask.reporting import analysis_figures, analysis_tables

LENGTHS = torch.tensor([5, 3, 1])
T_ENC = 5

# the analysed runs' labels -> their family: the tiny sweep's GRU models
GRU_FAMILIES = defaultdict(lambda: FAMILIES["gru"])


def masked_random_weights(rows: int = 4, seed: int = 0):
    """Softmax weights (3, rows, T_enc) that are zero on padding, and their mask (3, T_enc)."""
    mask = torch.arange(T_ENC)[None, :] < LENGTHS[:, None]
    scores = torch.randn(len(LENGTHS), rows, T_ENC, generator=torch.Generator().manual_seed(seed))
    return torch.softmax(scores.masked_fill(~mask[:, None, :], float("-inf")), -1), mask


@pytest.mark.slow
def test_uniform_weights_are_uniform_over_valid_positions_only():
    weights, mask = masked_random_weights()
    uniform = analysis.uniform_weights(weights, mask)
    assert uniform.shape == weights.shape
    for row, length in enumerate(LENGTHS.tolist()):
        torch.testing.assert_close(uniform[row, :, :length], torch.full((4, length), 1 / length))
        assert (uniform[row, :, length:] == 0).all()


def test_permuted_weights_keep_sum_and_support_but_move_the_weight():
    weights, mask = masked_random_weights(rows=50)
    permuted = analysis.permuted_weights(torch.Generator().manual_seed(0))(weights, mask)
    torch.testing.assert_close(permuted.sum(-1), weights.sum(-1))
    assert (permuted[~mask[:, None, :].expand_as(permuted)] == 0).all()  # support: padding stays at zero
    torch.testing.assert_close(permuted.sort(-1).values, weights.sort(-1).values)  # the same values, moved
    assert not torch.allclose(permuted[0], weights[0])  # a length-5 row is really shuffled


def test_fixed_weights_put_everything_on_one_valid_position():
    weights, mask = masked_random_weights()
    fixed = analysis.fixed_weights(weights, mask)
    assert (fixed[..., analysis.FIXED_POSITION] == 1).all() and (fixed.sum(-1) == 1).all()


def hand_built(task: str, lengths: torch.Tensor, on_target: float = 1.0):
    """A batch of `task` (sources of `lengths` over 9 symbols, 2 of them copied for selective copying) and
    weights (B, T_dec, T_enc) with `on_target` on each step's copied position, the rest spread."""
    t_enc, generator = int(lengths.max()), torch.Generator().manual_seed(0)
    sources = TASKS[task].sources
    batch = task_batch(task, sources.draw(lengths, t_enc, 9, 2, generator), lengths, 9)
    copied = batches.copied_positions(task, batch, 9)  # (B, T_dec)
    weights = torch.zeros(len(lengths), batch.tgt_out.size(1), t_enc)
    for b, (length, steps) in enumerate(zip(lengths.tolist(), batch.tgt_lengths.tolist())):
        for t in range(steps):
            weights[b, t, :length] = (1 - on_target) / max(length - 1, 1)
            weights[b, t, copied[b, t]] = on_target
    return weights, batch


@pytest.mark.parametrize("task", ["copy", "reverse", "selective_copy"])
def test_alignment_of_a_hand_built_matrix(task):
    lengths = torch.tensor([4, 2, 3]) if task != "selective_copy" else torch.tensor([6, 3, 5])
    diagonal, batch = hand_built(task, lengths)
    assert analysis.alignment(diagonal, batch.tgt_out, batch, task, 9) == {"hit": 1.0, "mass": 1.0, "adjacent": 0.0}
    spread, _ = hand_built(task, lengths, on_target=0.7)
    result = analysis.alignment(spread, batch.tgt_out, batch, task, 9)
    assert result["hit"] == 1.0 and result["mass"] == pytest.approx(0.7)
    if task == "selective_copy":  # row t on source position t, as copy's: a hit only where no noise comes before
        t_dec = batch.tgt_out.size(1)
        in_order = torch.eye(t_dec, diagonal.size(-1)).expand_as(diagonal)  # (B, T_dec, T_enc)
        skipped = batches.copied_positions(task, batch, 9) != torch.arange(t_dec)  # (B, T_dec)
        result = analysis.alignment(in_order, batch.tgt_out, batch, task, 9)
        expected = 1 - skipped[batch.content_mask].float().mean().item()
        assert 0 < expected < 1 and result["hit"] == pytest.approx(expected)
        return
    # the other task's matrix (anti-diagonal for copy, diagonal for reverse) mostly misses
    other, _ = hand_built("reverse" if task == "copy" else "copy", lengths)
    assert analysis.alignment(other, batch.tgt_out, batch, task, 9)["hit"] == pytest.approx(
        1 / 9
    )  # only the middle of length 3 agrees


def test_attention_one_position_off_counts_as_adjacent_not_hit():
    lengths = torch.tensor([4, 3])
    diagonal, batch = hand_built("copy", lengths)
    shifted = torch.zeros_like(diagonal)
    shifted[:, 1:] = diagonal[:, :-1]  # row t attends t - 1, as trained models do at long lengths
    shifted[:, 0, 0] = 1.0
    result = analysis.alignment(shifted, batch.tgt_out, batch, "copy", 9)
    content_steps = int(lengths.sum())
    assert result["hit"] == pytest.approx(2 / content_steps)  # only row 0 of each sequence
    assert result["adjacent"] == pytest.approx(1 - 2 / content_steps)


def test_alignment_leaves_out_the_steps_after_an_outputs_end():
    """An output that emitted EOS at step 1 has ended: its later rows of attention produce no output."""
    lengths = torch.tensor([4, 3])
    diagonal, batch = hand_built("copy", lengths)
    shifted = diagonal.roll(1, dims=2)  # every row one position off: no hit
    shifted[0, 0] = diagonal[0, 0]  # but the first step of the first sequence hits
    tokens = batch.tgt_out.clone()
    tokens[0, 1] = EOS
    result = analysis.alignment(shifted, tokens, batch, "copy", 9)
    assert result["hit"] == pytest.approx(1 / (2 + 3))  # steps 0-1 of the first sequence, 0-2 of the second


def test_reverse_targets_are_the_reversed_sources():
    batch = make_batch("reverse", 16, 7, 5, torch.Generator().manual_seed(3), min_length=1)
    for src, tgt, length in zip(batch.src, batch.tgt_out, batch.src_lengths.tolist()):
        assert tgt[:length].tolist() == src[:length].flip(0).tolist()
        assert tgt[length] == EOS


def tiny_model(heads: int = 1) -> Seq2Seq:
    torch.manual_seed(0)  # untrained: its outputs are arbitrary but depend on every input it sees
    return Seq2Seq(total_vocab(4), "luong", "general", embedding_size=8, hidden_size=8, heads=heads).eval()


@pytest.mark.slow
def test_interventions_act_inside_greedy_decoding_and_are_removed_after():
    model = tiny_model(heads=2)
    batch = make_batch("copy", 6, 5, 4, torch.Generator().manual_seed(1), min_length=2)
    with analysis.intervention(model.attention, analysis.uniform_weights):
        weights = evaluate(model, batch)["weights"]  # (B, T_dec, T_enc)
    assert model.attention.intervention is None
    expected = batch.src_mask.float() / batch.src_lengths[:, None]
    torch.testing.assert_close(weights, expected[:, None, :].expand_as(weights))


def test_per_length_evaluation_mixes_lengths_with_masks_in_place():
    with initialize_config_dir(config_dir=schema.config_dir(), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "task.variable_length=true",
                "task.min_length=2",
                "task.length=6",
                "task.vocab_size=4",
                "train.eval_size=16",
                "train.val_size=16",
            ],
        )
    model = tiny_model()
    batch, notes = analysis.per_length_batch(cfg, seen=set(), per_length=8)
    assert notes == []
    assert not batch.src_mask.all()  # padded: decoding runs through the masks
    table = analysis.per_length_accuracy(model, batch)
    assert table.length.tolist() == [2, 3, 4, 5, 6] and table["count"].sum() == len(batch)
    mixed = evaluate(model, batch)
    assert (mixed["weights"][~batch.src_mask[:, None, :].expand_as(mixed["weights"])] == 0).all()
    for row in table.itertuples():
        rows = batch.src_lengths == row.length
        alone = batch.select(rows)  # one length: no padding at all
        assert alone.src_mask.all()
        result = evaluate(model, alone)
        # each sequence decodes as if alone: same attention and tokens, so the same accuracy
        torch.testing.assert_close(mixed["weights"][rows, : row.length + 1, : row.length], result["weights"])
        assert torch.equal(mixed["tokens"][rows, : row.length + 1], result["tokens"])
        assert (row.token_acc, row.seq_acc) == pytest.approx((result["token_acc"], result["seq_acc"]))


@pytest.fixture(scope="module")
def analysed_runs(tmp_path_factory) -> Path:
    """Two tiny runs trained and analysed through the real CLI: a 2-head Luong general model on
    copy and a variable-length baseline on reverse."""
    runs_dir = tmp_path_factory.mktemp("runs")
    tiny = [
        "experiment=quick",
        "model.hidden_size=8",
        "model.embedding_size=8",
        "train.steps=4",
        "train.eval_every=4",
        "train.eval_size=16",
        "train.val_size=16",
        "train.progress=false",
        f"runs_dir={runs_dir}",
    ]
    assert cli.main(["train", *tiny, "attention=luong_general", "attention.heads=2", "task.length=4"]) == 0
    assert (
        cli.main(
            [
                "train",
                *tiny,
                "attention=none",
                "task=reverse",
                "task.variable_length=true",
                "task.min_length=2",
                "task.length=3",
            ]
        )
        == 0
    )
    assert cli.main(["analyze", f"runs_dir={runs_dir}"]) == 0
    return runs_dir


def test_analyze_writes_analysis_json_for_every_complete_run(analysed_runs, capsys):
    folders = {f.name.split("-")[0]: f for f in store.complete_runs(analysed_runs)}
    attended = store.read_json(folders["luong_general"] / store.ANALYSIS)
    metrics = store.read_json(folders["luong_general"] / store.METRICS)
    assert attended["attention"] == "luong_general-2heads"
    assert attended["counterfactual"]["own"] == pytest.approx(metrics["token_acc"])  # the same held-out set
    assert set(attended["drop"]) == set(analysis_tables.COUNTERFACTUALS)
    assert 0 <= attended["alignment"]["hit"] <= 1
    assert [row["test_length"] for row in attended["length_generalisation"]] == [3, 4]  # lengths in runs_dir
    assert torch.tensor(attended["head_weights"]["weights"]).shape == (2, 5, 4)
    baseline = store.read_json(folders["none"] / store.ANALYSIS)
    assert "counterfactual" not in baseline and [row["test_length"] for row in baseline["per_length"]] == [2, 3]
    # length 2 has 81 sequences, some trained on or validating: fewer than 64 are held out, and it says so
    [note] = baseline["per_length_notes"]
    assert "of the 81 sequences of length 2" in note and baseline["per_length"][0]["count"] < analysis.PER_LENGTH_SIZE

    # analysed runs are skipped: a second analyze leaves the files alone
    stamps = {f: (f / store.ANALYSIS).stat().st_mtime_ns for f in folders.values()}
    capsys.readouterr()
    assert cli.main(["analyze", f"runs_dir={analysed_runs}"]) == 0
    assert stamps == {f: (f / store.ANALYSIS).stat().st_mtime_ns for f in folders.values()}
    printed = capsys.readouterr().out
    assert "luong_general-2heads" in printed and "length generalisation" in printed
    assert "held-out sets at short lengths" in printed and note in printed


def test_analyze_skips_a_corrupt_run_with_a_warning_naming_it(analysed_runs, tmp_path):
    runs_dir = tmp_path / "runs"
    shutil.copytree(analysed_runs, runs_dir)
    corrupt, intact = store.complete_runs(runs_dir)
    for folder in (corrupt, intact):
        (folder / store.ANALYSIS).unlink()
    # readable but damaged (a half-written one means an unfinished run, which analyze never sees)
    (corrupt / store.METRICS).write_text('{"attention": "luong_general"}')
    with pytest.warns(CopytaskWarning, match=f"skipping {re.escape(str(corrupt))}"):
        assert cli.main(["analyze", f"runs_dir={runs_dir}"]) == 0
    assert (intact / store.ANALYSIS).is_file() and not (corrupt / store.ANALYSIS).exists()


def test_figures_are_drawn_from_the_analysis_files(analysed_runs, tmp_path):
    import matplotlib.pyplot as plt

    analyses = [store.read_json(folder / store.ANALYSIS) for folder in store.complete_runs(analysed_runs)]
    paths = [
        analysis_figures.plot_counterfactual(
            analysis_tables.analysis_table(analyses).assign(chance=1 / 9), tmp_path / "counterfactual.png"
        ),
        analysis_figures.plot_length_generalisation(
            analysis_tables.length_generalisation_table(analyses), tmp_path / "generalisation.png"
        ),
    ]
    attended = next(f for f in store.complete_runs(analysed_runs) if f.name.startswith("luong_general"))
    paths.append(
        analysis_figures.plot_head_weights(
            json.loads((attended / store.ANALYSIS).read_text()), 9, tmp_path / "heads.png"
        )
    )
    figure, ax = plt.subplots()
    analysis_figures.plot_per_length(ax, analysis_tables.per_length_table(analyses))
    assert len(ax.lines) == 1
    plt.close(figure)
    assert all(path.stat().st_size > 1000 for path in paths)


NOISE = noise_token(9)


@pytest.mark.parametrize(
    "task, source, expected",
    [("copy", [3, 4, 5, 6], [0, 1, 2, 3]), ("reverse", [3, 4, 5, 6], [3, 2, 1, 0]),
     ("selective_copy", [NOISE, 4, NOISE, 6], [1, 3])],
)  # fmt: skip
def test_copied_source_positions_are_the_alignment_targets(task, source, expected):
    """Selective copying's output step t copies the t-th content symbol, wherever the noise puts it."""
    assert batches.copied_source_positions(task, source, 9) == expected
    batch = task_batch(task, torch.tensor([source, [7, 8, 0, 0]]), torch.tensor([4, 2]), 9)
    assert batches.copied_positions(task, batch, 9)[0].tolist()[: len(expected)] == expected  # what alignment scores


@pytest.mark.parametrize("task", ["copy", "reverse"])
def test_attention_maps_outline_the_copied_cell_of_every_content_step(task):
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    length = 5
    sample = {"source": [3, 4, 5, 6, 7], "target": [3, 4, 5, 6, 7, EOS], "output": [3, 4, 4, 6, 7, EOS]}
    figure, ax = plt.subplots()
    figures.draw_attention(ax, torch.rand(length + 1, length).numpy(), sample, 9, task)
    boxes = [patch for patch in ax.patches if isinstance(patch, Rectangle)]
    cells = {(round(box.get_y() + 0.5), round(box.get_x() + 0.5)) for box in boxes}  # (output step, source position)
    plt.close(figure)
    assert len(boxes) == length  # the EOS row copies nothing
    assert cells == {(step, step if task == "copy" else length - 1 - step) for step in range(length)}


def test_a_selective_copying_map_outlines_each_content_symbol_and_greys_the_noise():
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    sample = {"source": [NOISE, 3, 4, NOISE, 5], "target": [3, 4, 5, EOS], "output": [3, 4, 5, EOS]}
    figure, ax = plt.subplots()
    figures.draw_attention(ax, torch.rand(4, 5).numpy(), sample, 9, "selective_copy")
    boxes = [patch for patch in ax.patches if isinstance(patch, Rectangle)]
    cells = {(round(box.get_y() + 0.5), round(box.get_x() + 0.5)) for box in boxes}
    grey = [label.get_text() for label in ax.get_xticklabels() if label.get_color() == "grey"]
    plt.close(figure)
    assert cells == {(0, 1), (1, 2), (2, 4)} and grey == ["_", "_"]


def test_counterfactual_figure_is_in_percent_with_a_chance_line(monkeypatch, tmp_path):
    drawn = []
    monkeypatch.setattr(analysis_figures, "save", lambda figure, path, dpi=120: drawn.append(figure) or path)
    rows = [
        {
            "run": f"r{length}",
            "attention": "bahdanau",
            "task": "copy",
            "length": length,
            "train_length": str(length),
            "seed": 0,
            "own": 0.9,
            "uniform": 0.3,
            "permuted": 0.2,
            "fixed": 0.15,
            "chance": 0.25,
        }
        for length in (5, 10)
    ]
    analysis_figures.plot_counterfactual(pd.DataFrame(rows), tmp_path / "counterfactual.png")

    (ax,) = [ax for ax in drawn[0].axes if ax.get_visible()]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["own"].get_ydata()) == pytest.approx([90, 90])
    assert ax.get_ylim()[1] > 100 and "%" in ax.get_ylabel()
    chance = lines["chance (25.0%)"]
    assert chance.get_linestyle() == "--" and list(chance.get_ydata()) == [25, 25]
    [legend] = drawn[0].legends  # one legend for the figure, under the panels (none over the data)
    assert ax.get_legend() is None and "chance (25.0%)" in [text.get_text() for text in legend.get_texts()]


@pytest.mark.parametrize("attentions", [["bahdanau"], ["bahdanau", "luong_general"]])
def test_the_counterfactual_legend_lies_inside_the_figure(monkeypatch, tmp_path, attentions):
    drawn = []
    monkeypatch.setattr(analysis_figures, "save", lambda figure, path, dpi=120: drawn.append(figure) or path)
    rows = [
        {"run": f"{attention}{length}", "attention": attention, "task": "copy", "length": length,
         "train_length": str(length), "seed": 0, "own": 0.9, "uniform": 0.3, "permuted": 0.2, "fixed": 0.15,
         "chance": 1 / 9}
        for attention in attentions
        for length in (5, 10)
    ]  # fmt: skip
    analysis_figures.plot_counterfactual(pd.DataFrame(rows), tmp_path / "counterfactual.png")

    [figure] = drawn
    figure.draw_without_rendering()  # laid out by the figure's renderer, as savefig lays it out
    [legend] = figure.legends
    extent, bounds = legend.get_window_extent(), figure.bbox
    assert bounds.x0 <= extent.x0 and extent.x1 <= bounds.x1, (extent, bounds)  # not cut at either edge
    assert bounds.y0 <= extent.y0 and extent.y1 <= bounds.y1, (extent, bounds)


def test_analyze_writes_the_breakdown_and_the_report_draws_it(analysed_runs, tmp_path):
    """Greedy, teacher-forced, beam and by-position accuracy for every run, the probe for GRU models;
    width 1 is greedy; other settings analyse the runs again."""
    from copytask.reporting.breakdown_section import PROBE_FIGURE, breakdown_section

    folders = {f.name.split("-")[0]: f for f in store.complete_runs(analysed_runs)}
    attended = store.read_json(folders["luong_general"] / store.ANALYSIS)["breakdown"]
    assert attended["settings"]["beam_widths"] == [1, 4]
    assert attended["greedy"]["token_acc"] == pytest.approx(attended_metrics(folders)["token_acc"])
    assert [row["width"] for row in attended["beam"]] == [1, 4]
    assert attended["beam"][0]["token_acc"] == attended["greedy"]["token_acc"]
    for decoding in ("greedy", "teacher_forced"):
        by_position = attended[decoding]["by_position"]
        assert len(by_position) == 4 and sum(by_position) / 4 == pytest.approx(attended[decoding]["token_acc"])
    probe = attended["probe"]
    assert len(probe["trained"]) == len(probe["untrained"]) == 4 and probe["chance"] == pytest.approx(1 / 9)
    variable = store.read_json(folders["none"] / store.ANALYSIS)["breakdown"]
    assert len(variable["probe"]["trained"]) == 3  # sources of lengths 2 and 3: positions 1-3

    analyses = [store.read_json(folder / store.ANALYSIS) for folder in folders.values()]
    lines, figures = breakdown_section(analyses, None, tmp_path, GRU_FAMILIES)
    assert [path.name for path in figures] == ["accuracy_by_position.png", PROBE_FIGURE]
    assert all(path.stat().st_size > 0 for path in figures)
    assert any("teacher-forced % [95% CI]" in line and "beam 4 %" in line for line in lines)

    runs_dir = tmp_path / "runs"
    shutil.copytree(analysed_runs, runs_dir)
    assert cli.main(["analyze", f"runs_dir={runs_dir}", "analysis.beam_widths=[2]", "analysis.probe_size=null"]) == 0
    again = store.read_json(store.complete_runs(runs_dir)[0] / store.ANALYSIS)["breakdown"]
    assert [row["width"] for row in again["beam"]] == [2] and "probe" not in again


def attended_metrics(folders: dict) -> dict:
    return store.read_json(folders["luong_general"] / store.METRICS)


def test_an_analysis_records_what_made_it_and_one_made_by_other_code_is_made_again(analysed_runs, tmp_path, capsys):
    """analysis.json records its own computation and the provenance a run records; `analyze` makes again,
    saying how many and why in one line, an analysis that records another computation or none."""
    from copytask.store.provenance import ANALYSIS_COMPUTATION, PROVENANCE_KEYS

    runs_dir = tmp_path / "runs"
    shutil.copytree(analysed_runs, runs_dir)
    older, current = store.complete_runs(runs_dir)
    made = store.read_json(current / store.ANALYSIS)
    assert made["computation"] == ANALYSIS_COMPUTATION and set(PROVENANCE_KEYS) <= set(made)
    store.write_json(
        older / store.ANALYSIS, {k: v for k, v in made.items() if k != "computation"} | {"run": older.name}
    )
    stamp = (current / store.ANALYSIS).stat().st_mtime_ns
    capsys.readouterr()
    assert cli.main(["analyze", f"runs_dir={runs_dir}"]) == 0
    line = (
        "1 analysis made by other code (1 analysis records no computation (made before copytask recorded it); "
        f"this code's is {ANALYSIS_COMPUTATION}): made again"
    )
    assert line in capsys.readouterr().out.splitlines()
    assert store.read_json(older / store.ANALYSIS)["computation"] == ANALYSIS_COMPUTATION
    assert (current / store.ANALYSIS).stat().st_mtime_ns == stamp  # this code's analysis is reused


def test_the_reports_probe_paragraph_speaks_only_of_the_models_it_holds(analysed_runs, tmp_path):
    from copytask.reporting.breakdown_section import breakdown_section

    analyses = [store.read_json(folder / store.ANALYSIS) for folder in store.complete_runs(analysed_runs)]
    lines, _ = breakdown_section(analyses, None, tmp_path, GRU_FAMILIES)
    assert not any("ransformer" in line for line in lines)  # a GRU-only report
    transformer = json.loads(json.dumps(analyses[0]))
    transformer |= {"run": "transformer-copy4-seed0", "attention": "transformer"}
    del transformer["breakdown"]["probe"]
    lines, _ = breakdown_section([*analyses, transformer], None, tmp_path, GRU_FAMILIES)
    assert any(line.endswith("No summary vector to probe: transformer.") for line in lines)

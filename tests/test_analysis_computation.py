"""Issue 74: `store.provenance.ANALYSIS_COMPUTATION` says which analyses are reused, so it must change
whenever what an analysis computes changes. This test keeps it honest, as tests/test_computation.py does
for runs: the tiny deterministic run of each of its models (every attention config, the Transformer and
Mamba; trained once for both tests, `conftest.trained_once`) is analysed, and the analysis' numbers (the
breakdown: teacher-forced and beam accuracy; the probe and its inputs; the counterfactuals and the alignment
where the model has attention; a score at another length) and a beam's output and score must equal the values
recorded here, to a tolerance that float rounding stays inside. A model without recorded values fails,
printing the values to record.

When a change to the analysis makes this fail on purpose: raise ANALYSIS_COMPUTATION and record the new
values here, in the same commit. A change to what runs compute moves these numbers too (the runs are
other runs): then record them anew together with tests/test_computation.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from copytask.data import splits
from copytask.evaluation.analysis import analyze_run
from copytask.evaluation.breakdown import Settings
from copytask.evaluation.load import load_run
from copytask.evaluation.probe import summary_vectors
from copytask.models.beam import beam_search
from copytask.store.provenance import ANALYSIS_COMPUTATION

from .test_computation import EVAL_SIZE, LENGTH, MODELS, RECORDED_HERE, run_overrides

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)

RECORDED_WITH = 2  # the ANALYSIS_COMPUTATION the values below were recorded with
SETTINGS = Settings(beam_widths=(1, 3), probe_size=256)
BEAM_SIZE = 32  # analysis.eval_size: the beams', the counterfactuals' and the alignment's sequences
OTHER_LENGTH = 6
BEAM_WIDTH, BEAMS = 3, 2  # the best beam of width 3 of the first 2 test sequences: its tokens and score
# model -> the analysis' numbers (`numbers`, `searched_and_probed`), with the fused CPU kernels, torch 2.13.0+cpu
RECORDED = {
    "bahdanau": {
        "greedy_token_acc": 0.375, "greedy_seq_acc": 0.0, "teacher_forced_token_acc": 0.4453125,
        "teacher_forced_seq_acc": 0.0, "beam1_token_acc": 0.328125, "beam3_token_acc": 0.359375,
        "probe_trained": 0.57421875, "probe_untrained": 0.61328125, "probe_control": 0.58984375,
        "length6_token_acc": 0.1875, "counterfactual_own": 0.328125, "counterfactual_uniform": 0.2890625,
        "counterfactual_permuted": 0.3125, "counterfactual_fixed": 0.2578125, "alignment_hit": 0.359375,
        "alignment_mass": 0.30600160360336304, "alignment_adjacent": 0.40625, "beam3_tokens_0": [6, 6, 6, 5, 2],
        "beam3_score_0": -4.10260009765625, "beam3_tokens_1": [10, 11, 2, 0, 0], "beam3_score_1": -4.761932849884033,
        "probe_input_size": 16, "probe_input_mean_abs": 0.6387043374608083,
    },
    "linear": {
        "greedy_token_acc": 0.39453125, "greedy_seq_acc": 0.03125, "teacher_forced_token_acc": 0.453125,
        "teacher_forced_seq_acc": 0.03125, "beam1_token_acc": 0.3828125, "beam3_token_acc": 0.2734375,
        "probe_trained": 0.55078125, "probe_untrained": 0.61328125, "probe_control": 0.60546875,
        "length6_token_acc": 0.2604166666666667, "counterfactual_own": 0.3828125, "counterfactual_uniform": 0.296875,
        "counterfactual_permuted": 0.296875, "counterfactual_fixed": 0.2578125, "alignment_hit": 0.31496062874794006,
        "alignment_mass": 0.2678820788860321, "alignment_adjacent": 0.4409448802471161,
        "beam3_tokens_0": [6, 6, 6, 2, 0], "beam3_score_0": -3.702810287475586, "beam3_tokens_1": [11, 10, 9, 9, 2],
        "beam3_score_1": -5.965219497680664, "probe_input_size": 16, "probe_input_mean_abs": 0.6892457417321269,
    },
    "luong_concat": {
        "greedy_token_acc": 0.3671875, "greedy_seq_acc": 0.03125, "teacher_forced_token_acc": 0.4375,
        "teacher_forced_seq_acc": 0.03125, "beam1_token_acc": 0.3125, "beam3_token_acc": 0.3359375,
        "probe_trained": 0.5625, "probe_untrained": 0.61328125, "probe_control": 0.6328125,
        "length6_token_acc": 0.21875, "counterfactual_own": 0.3125, "counterfactual_uniform": 0.28125,
        "counterfactual_permuted": 0.3046875, "counterfactual_fixed": 0.265625, "alignment_hit": 0.3125,
        "alignment_mass": 0.2805618643760681, "alignment_adjacent": 0.4140625, "beam3_tokens_0": [6, 6, 6, 2, 0],
        "beam3_score_0": -3.421327590942383, "beam3_tokens_1": [11, 10, 9, 9, 2], "beam3_score_1": -5.616724967956543,
        "probe_input_size": 16, "probe_input_mean_abs": 0.6810746916175958,
    },
    "luong_dot": {
        "greedy_token_acc": 0.35546875, "greedy_seq_acc": 0.03125, "teacher_forced_token_acc": 0.4921875,
        "teacher_forced_seq_acc": 0.03125, "beam1_token_acc": 0.3203125, "beam3_token_acc": 0.3671875,
        "probe_trained": 0.62890625, "probe_untrained": 0.61328125, "probe_control": 0.62109375,
        "length6_token_acc": 0.1875, "counterfactual_own": 0.3203125, "counterfactual_uniform": 0.25,
        "counterfactual_permuted": 0.28125, "counterfactual_fixed": 0.28125, "alignment_hit": 0.4285714328289032,
        "alignment_mass": 0.360767662525177, "alignment_adjacent": 0.4126984179019928,
        "beam3_tokens_0": [6, 6, 5, 2, 0], "beam3_score_0": -2.893130302429199, "beam3_tokens_1": [11, 10, 10, 2, 0],
        "beam3_score_1": -2.7255051136016846, "probe_input_size": 16, "probe_input_mean_abs": 0.6051320766185029,
    },
    "luong_general": {
        "greedy_token_acc": 0.4609375, "greedy_seq_acc": 0.03125, "teacher_forced_token_acc": 0.5859375,
        "teacher_forced_seq_acc": 0.03125, "beam1_token_acc": 0.421875, "beam3_token_acc": 0.3515625,
        "probe_trained": 0.578125, "probe_untrained": 0.61328125, "probe_control": 0.55859375,
        "length6_token_acc": 0.20833333333333334, "counterfactual_own": 0.421875, "counterfactual_uniform": 0.234375,
        "counterfactual_permuted": 0.3515625, "counterfactual_fixed": 0.2734375, "alignment_hit": 0.546875,
        "alignment_mass": 0.4739072024822235, "alignment_adjacent": 0.328125, "beam3_tokens_0": [6, 5, 5, 10, 2],
        "beam3_score_0": -3.380323648452759, "beam3_tokens_1": [11, 11, 11, 10, 2],
        "beam3_score_1": -4.05051326751709, "probe_input_size": 16, "probe_input_mean_abs": 0.6481802038848343,
    },
    "luong_local": {
        "greedy_token_acc": 0.75390625, "greedy_seq_acc": 0.328125, "teacher_forced_token_acc": 0.74609375,
        "teacher_forced_seq_acc": 0.328125, "beam1_token_acc": 0.7265625, "beam3_token_acc": 0.7265625,
        "probe_trained": 0.5859375, "probe_untrained": 0.61328125, "probe_control": 0.61328125,
        "length6_token_acc": 0.28125, "counterfactual_own": 0.7265625, "counterfactual_uniform": 0.2578125,
        "counterfactual_permuted": 0.3203125, "counterfactual_fixed": 0.234375, "alignment_hit": 0.9453125,
        "alignment_mass": 0.6453726887702942, "alignment_adjacent": 0.0546875, "beam3_tokens_0": [4, 6, 6, 5, 2],
        "beam3_score_0": -1.4032506942749023, "beam3_tokens_1": [11, 10, 4, 4, 2],
        "beam3_score_1": -3.2181849479675293, "probe_input_size": 16, "probe_input_mean_abs": 0.6745599246632992,
    },
    "luong_local_m": {
        "greedy_token_acc": 0.4375, "greedy_seq_acc": 0.109375, "teacher_forced_token_acc": 0.640625,
        "teacher_forced_seq_acc": 0.109375, "beam1_token_acc": 0.421875, "beam3_token_acc": 0.4453125,
        "probe_trained": 0.58984375, "probe_untrained": 0.61328125, "probe_control": 0.58984375,
        "length6_token_acc": 0.3020833333333333, "counterfactual_own": 0.421875, "counterfactual_uniform": 0.2734375,
        "counterfactual_permuted": 0.3515625, "counterfactual_fixed": 0.2578125, "alignment_hit": 0.546875,
        "alignment_mass": 0.48667195439338684, "alignment_adjacent": 0.453125, "beam3_tokens_0": [9, 6, 5, 2, 0],
        "beam3_score_0": -3.098201036453247, "beam3_tokens_1": [11, 11, 10, 9, 2],
        "beam3_score_1": -3.102753162384033, "probe_input_size": 16, "probe_input_mean_abs": 0.6727945061611535,
    },
    "multihead": {
        "greedy_token_acc": 0.41796875, "greedy_seq_acc": 0.015625, "teacher_forced_token_acc": 0.51953125,
        "teacher_forced_seq_acc": 0.015625, "beam1_token_acc": 0.453125, "beam3_token_acc": 0.4765625,
        "probe_trained": 0.50390625, "probe_untrained": 0.61328125, "probe_control": 0.55078125,
        "length6_token_acc": 0.24479166666666666, "counterfactual_own": 0.453125, "counterfactual_uniform": 0.234375,
        "counterfactual_permuted": 0.265625, "counterfactual_fixed": 0.2265625, "alignment_hit": 0.546875,
        "alignment_mass": 0.38530024886131287, "alignment_adjacent": 0.3515625, "beam3_tokens_0": [9, 6, 9, 6, 2],
        "beam3_score_0": -5.089253902435303, "beam3_tokens_1": [11, 10, 4, 4, 2], "beam3_score_1": -4.544064044952393,
        "probe_input_size": 16, "probe_input_mean_abs": 0.6488614887452968,
    },
    "none": {
        "greedy_token_acc": 0.2890625, "greedy_seq_acc": 0.0, "teacher_forced_token_acc": 0.2734375,
        "teacher_forced_seq_acc": 0.0, "beam1_token_acc": 0.265625, "beam3_token_acc": 0.25, "probe_trained": 0.53125,
        "probe_untrained": 0.61328125, "probe_control": 0.57421875, "length6_token_acc": 0.19270833333333334,
        "beam3_tokens_0": [6, 6, 3, 2, 0], "beam3_score_0": -5.828609943389893, "beam3_tokens_1": [9, 10, 10, 2, 0],
        "beam3_score_1": -5.2385687828063965, "probe_input_size": 16, "probe_input_mean_abs": 0.66426930677153,
    },
    "rnnencdec": {
        "greedy_token_acc": 0.31640625, "greedy_seq_acc": 0.0, "teacher_forced_token_acc": 0.36328125,
        "teacher_forced_seq_acc": 0.0, "beam1_token_acc": 0.2890625, "beam3_token_acc": 0.3359375,
        "probe_trained": 0.46484375, "probe_untrained": 0.625, "probe_control": 0.5390625,
        "length6_token_acc": 0.19791666666666666, "beam3_tokens_0": [6, 9, 6, 9, 2],
        "beam3_score_0": -4.217342853546143, "beam3_tokens_1": [11, 9, 11, 9, 2], "beam3_score_1": -5.75809383392334,
        "probe_input_size": 32, "probe_input_mean_abs": 0.5985499581033764,
    },
    "scaled_dot": {
        "greedy_token_acc": 0.3359375, "greedy_seq_acc": 0.0, "teacher_forced_token_acc": 0.421875,
        "teacher_forced_seq_acc": 0.0, "beam1_token_acc": 0.28125, "beam3_token_acc": 0.25,
        "probe_trained": 0.6328125, "probe_untrained": 0.61328125, "probe_control": 0.64453125,
        "length6_token_acc": 0.15625, "counterfactual_own": 0.28125, "counterfactual_uniform": 0.2578125,
        "counterfactual_permuted": 0.2578125, "counterfactual_fixed": 0.2890625, "alignment_hit": 0.4094488322734833,
        "alignment_mass": 0.27954697608947754, "alignment_adjacent": 0.3937007784843445,
        "beam3_tokens_0": [6, 6, 5, 2, 0], "beam3_score_0": -3.566981792449951, "beam3_tokens_1": [10, 10, 2, 0, 0],
        "beam3_score_1": -3.5014662742614746, "probe_input_size": 16, "probe_input_mean_abs": 0.6410979505492378,
    },
    "mamba": {
        "greedy_token_acc": 0.140625, "greedy_seq_acc": 0.0, "teacher_forced_token_acc": 0.1640625,
        "teacher_forced_seq_acc": 0.0, "beam1_token_acc": 0.1171875, "beam3_token_acc": 0.125, "probe_trained": 1.0,
        "probe_untrained": 0.99609375, "probe_control": 1.0, "length6_token_acc": 0.041666666666666664,
        "beam3_tokens_0": [8, 11, 8, 8, 2], "beam3_score_0": -8.014002799987793, "beam3_tokens_1": [4, 11, 4, 11, 2],
        "beam3_score_1": -7.955204010009766, "probe_input_size": 448, "probe_input_mean_abs": 0.3179493896005455,
    },
    "mamba_lti": {
        "greedy_token_acc": 0.14453125, "greedy_seq_acc": 0.0, "teacher_forced_token_acc": 0.140625,
        "teacher_forced_seq_acc": 0.0, "beam1_token_acc": 0.1484375, "beam3_token_acc": 0.140625, "probe_trained": 1.0,
        "probe_untrained": 0.99609375, "probe_control": 1.0, "length6_token_acc": 0.06770833333333333,
        "beam3_tokens_0": [4, 11, 4, 8, 2], "beam3_score_0": -7.699857234954834, "beam3_tokens_1": [4, 4, 8, 8, 2],
        "beam3_score_1": -7.789144039154053, "probe_input_size": 448, "probe_input_mean_abs": 0.3567305814581994,
    },
    "transformer": {
        "greedy_token_acc": 0.2421875, "greedy_seq_acc": 0.0, "teacher_forced_token_acc": 0.28515625,
        "teacher_forced_seq_acc": 0.0, "beam1_token_acc": 0.2734375, "beam3_token_acc": 0.203125,
        "length6_token_acc": 0.171875, "counterfactual_own": 0.2734375, "counterfactual_uniform": 0.2890625,
        "counterfactual_permuted": 0.203125, "counterfactual_fixed": 0.2578125, "alignment_hit": 0.3253968358039856,
        "alignment_mass": 0.2952961325645447, "alignment_adjacent": 0.4285714328289032,
        "beam3_tokens_0": [9, 7, 7, 2, 0], "beam3_score_0": -4.366495609283447, "beam3_tokens_1": [7, 7, 11, 2, 0],
        "beam3_score_1": -5.073150634765625,
    },
    "reverse": {
        "greedy_token_acc": 0.62109375, "greedy_seq_acc": 0.15625, "teacher_forced_token_acc": 0.68359375,
        "teacher_forced_seq_acc": 0.15625, "beam1_token_acc": 0.6171875, "beam3_token_acc": 0.609375,
        "probe_trained": 0.5234375, "probe_untrained": 0.61328125, "probe_control": 0.5859375,
        "length6_token_acc": 0.28125, "counterfactual_own": 0.6171875, "counterfactual_uniform": 0.28125,
        "counterfactual_permuted": 0.234375, "counterfactual_fixed": 0.2734375, "alignment_hit": 0.6796875,
        "alignment_mass": 0.5764690041542053, "alignment_adjacent": 0.28125, "beam3_tokens_0": [5, 10, 6, 2, 0],
        "beam3_score_0": -2.7674245834350586, "beam3_tokens_1": [9, 10, 11, 11, 2], "beam3_score_1": -4.400009632110596,
        "probe_input_size": 16, "probe_input_mean_abs": 0.6600865780912955,
    },
    "selective_copy": {
        "greedy_token_acc": 0.5234375, "greedy_seq_acc": 0.28125, "teacher_forced_token_acc": 0.6015625,
        "teacher_forced_seq_acc": 0.28125, "beam1_token_acc": 0.484375, "beam3_token_acc": 0.4375,
        "probe_trained": 0.7265625, "probe_untrained": 0.8359375, "probe_control": 0.65625, "length6_token_acc": 0.5,
        "counterfactual_own": 0.484375, "counterfactual_uniform": 0.3125, "counterfactual_permuted": 0.40625,
        "counterfactual_fixed": 0.34375, "alignment_hit": 0.46875, "alignment_mass": 0.4597071707248688,
        "alignment_adjacent": 0.265625, "beam3_tokens_0": [6, 6, 2], "beam3_score_0": -2.3158299922943115,
        "beam3_tokens_1": [10, 10, 2], "beam3_score_1": -2.6216206550598145, "probe_input_size": 16,
        "probe_input_mean_abs": 0.6439095659675331,
    },
    "transformer_learned": {
        "greedy_token_acc": 0.18359375, "greedy_seq_acc": 0.0, "teacher_forced_token_acc": 0.19140625,
        "teacher_forced_seq_acc": 0.0, "beam1_token_acc": 0.1640625, "beam3_token_acc": 0.1796875,
        "length6_token_acc": None, "counterfactual_own": 0.1640625, "counterfactual_uniform": 0.140625,
        "counterfactual_permuted": 0.1484375, "counterfactual_fixed": 0.078125, "alignment_hit": 0.5390625,
        "alignment_mass": 0.3232444226741791, "alignment_adjacent": 0.1875, "beam3_tokens_0": [6, 7, 11, 10, 2],
        "beam3_score_0": -7.2667717933654785, "beam3_tokens_1": [7, 7, 7, 7, 2], "beam3_score_1": -5.743780136108398,
    },
}  # fmt: skip
CHANGE = (
    "what an analysis computes has changed. If that is meant, raise ANALYSIS_COMPUTATION in "
    "src/copytask/store/provenance.py and record this test's values anew, together (analyses of the old "
    "computation are then made again); if not, the change broke something"
)


def numbers(analysis: dict) -> dict[str, float]:
    """The analysis' numbers, flat: accuracies are shares of the test set's tokens or sequences."""
    breakdown = analysis["breakdown"]
    flat = {
        f"{name}_{key}": breakdown[name][key]
        for name in ("greedy", "teacher_forced")
        for key in ("token_acc", "seq_acc")
    }
    flat |= {f"beam{row['width']}_token_acc": row["token_acc"] for row in breakdown["beam"]}
    probe = breakdown["probe"]  # None: no summary vector (the Transformer)
    if probe is not None:
        flat |= {f"probe_{name}": sum(probe[name]) / len(probe[name]) for name in ("trained", "untrained", "control")}
    other = next(row for row in analysis["length_generalisation"] if row["test_length"] == OTHER_LENGTH)
    flat[f"length{OTHER_LENGTH}_token_acc"] = other["token_acc"]
    flat |= {f"counterfactual_{key}": value for key, value in analysis.get("counterfactual", {}).items()}
    flat |= {f"alignment_{key}": value for key, value in analysis.get("alignment", {}).items()}
    return flat


def searched_and_probed(folder: Path) -> dict:
    """What the analysis' beam search and probe start from, where its accuracies could hide a change: the best
    beam's tokens and log-probability for each of the first BEAMS test sequences, and the summary vectors the
    probe reads of the test set (their size and mean absolute value), where the model has one."""
    model, cfg = load_run(folder)
    test = splits.test_batch(cfg)
    first = test.select(slice(0, BEAMS))
    beams = beam_search(model, first.src, first.src_lengths, first.tgt_out.size(1), BEAM_WIDTH)
    flat = {}
    for i, (tokens, score) in enumerate(zip(beams.tokens.tolist(), beams.scores.tolist(), strict=True)):
        flat |= {f"beam{BEAM_WIDTH}_tokens_{i}": tokens, f"beam{BEAM_WIDTH}_score_{i}": score}
    if hasattr(model, "summary_state"):
        vectors = summary_vectors(model, test)  # (B, S)
        flat |= {"probe_input_size": vectors.size(1), "probe_input_mean_abs": vectors.abs().mean().item()}
    return flat


def tolerance(key: str) -> dict:
    """The alignment's mass is a mean of weights, a beam's score a sum of log-probabilities, the probe's input
    a mean of floats: to 1e-6 relative on the torch the values were recorded with (RECORDED_HERE), 1e-4 on
    another; tokens and sizes are equal or not. An accuracy is exact on the recorded torch; on another, it may
    move by one token of its set where float rounding tips a near-tied argmax."""
    if "tokens" in key or key == "probe_input_size":
        return {"abs": 0}
    if key in ("alignment_mass", "probe_input_mean_abs") or "score" in key:
        return {"rel": 1e-6 if RECORDED_HERE else 1e-4}
    if RECORDED_HERE:
        return {"abs": 0}
    if key.startswith(("beam", "counterfactual", "alignment")):
        return {"abs": 1.5 / (BEAM_SIZE * LENGTH)}
    if key.startswith("probe"):
        return {"abs": 1.5 / (EVAL_SIZE * LENGTH)}
    return {"abs": 1.5 / EVAL_SIZE}


def test_the_values_were_recorded_with_this_analysis_computation():
    assert ANALYSIS_COMPUTATION == RECORDED_WITH, (
        f"ANALYSIS_COMPUTATION is {ANALYSIS_COMPUTATION}, but tests/test_analysis_computation.py's values were "
        f"recorded with {RECORDED_WITH}: record them anew with the new code and set RECORDED_WITH"
    )


@pytest.mark.parametrize("model", MODELS)
def test_a_tiny_analysis_computes_the_recorded_numbers(trained_once, model):
    run = trained_once(run_overrides(model, fused=True))  # test_computation's run, as trained
    analysis = analyze_run(run.folder, [LENGTH, OTHER_LENGTH], BEAM_SIZE, "cpu", SETTINGS)
    assert analysis["computation"] == ANALYSIS_COMPUTATION
    found = numbers(analysis) | searched_and_probed(run.folder)
    assert found["greedy_token_acc"] == run.metrics["token_acc"], "the breakdown's greedy decoding is not the run's"
    assert model in RECORDED, (
        f"no analysis numbers recorded for {model}: what its analysis computes is unguarded. Record what it "
        f"computed in RECORDED: {model!r}: {found}"
    )
    assert set(found) == set(RECORDED[model]), f"{model}: numbers {sorted(found)} are not the recorded ones"
    for key, recorded in RECORDED[model].items():
        assert found[key] == (recorded if recorded is None else pytest.approx(recorded, **tolerance(key))), (
            f"{model}: {key} is {found[key]}, recorded {recorded}: {CHANGE}"
        )

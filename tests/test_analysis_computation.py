"""Issue 74: `store.provenance.ANALYSIS_COMPUTATION` says which analyses are reused, so it must change
whenever what an analysis computes changes. This test keeps it honest, as tests/test_computation.py does
for runs: a tiny deterministic run with attention and one without are trained on the CPU and analysed,
and the analysis' numbers (the breakdown, the probe, the counterfactuals, the alignment, a score at
another length) must equal the values recorded here, to a tolerance that float rounding stays inside.

When a change to the analysis makes this fail on purpose: raise ANALYSIS_COMPUTATION and record the new
values here, in the same commit. A change to what runs compute moves these numbers too (the runs are
other runs): then record them anew together with tests/test_computation.py's."""

from __future__ import annotations

import pytest

import copytask
from copytask.evaluation.analysis import analyze_run
from copytask.evaluation.breakdown import Settings
from copytask.store.provenance import ANALYSIS_COMPUTATION

from .conftest import TINY
from .test_computation import BUDGET, EVAL_SIZE, LENGTH

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)

RECORDED_WITH = 2  # the ANALYSIS_COMPUTATION the values below were recorded with
SETTINGS = Settings(beam_widths=(1, 3), probe_size=256)
BEAM_SIZE = 32  # analysis.eval_size: the beams', the counterfactuals' and the alignment's sequences
OTHER_LENGTH = 6
# run -> the analysis' numbers (`numbers`), with the fused CPU kernels, torch 2.13.0+cpu
RECORDED = {
    "none": {
        "greedy_token_acc": 0.2890625, "greedy_seq_acc": 0.0, "teacher_forced_token_acc": 0.2734375,
        "teacher_forced_seq_acc": 0.0, "beam1_token_acc": 0.265625, "beam3_token_acc": 0.25,
        "probe_trained": 0.53125, "probe_untrained": 0.61328125, "probe_control": 0.57421875,
        "length6_token_acc": 0.19270833333333334,
    },
    "luong_general": {
        "greedy_token_acc": 0.4609375, "greedy_seq_acc": 0.03125, "teacher_forced_token_acc": 0.5859375,
        "teacher_forced_seq_acc": 0.03125, "beam1_token_acc": 0.421875, "beam3_token_acc": 0.3515625,
        "probe_trained": 0.578125, "probe_untrained": 0.61328125, "probe_control": 0.55859375,
        "length6_token_acc": 0.20833333333333334, "counterfactual_own": 0.421875, "counterfactual_uniform": 0.234375,
        "counterfactual_permuted": 0.3515625, "counterfactual_fixed": 0.2734375, "alignment_hit": 0.546875,
        "alignment_mass": 0.4739072024822235, "alignment_adjacent": 0.328125,
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
    probe = breakdown["probe"]
    flat |= {f"probe_{name}": sum(probe[name]) / len(probe[name]) for name in ("trained", "untrained", "control")}
    other = next(row for row in analysis["length_generalisation"] if row["test_length"] == OTHER_LENGTH)
    flat[f"length{OTHER_LENGTH}_token_acc"] = other["token_acc"]
    flat |= {f"counterfactual_{key}": value for key, value in analysis.get("counterfactual", {}).items()}
    flat |= {f"alignment_{key}": value for key, value in analysis.get("alignment", {}).items()}
    return flat


def tolerance(key: str) -> dict:
    """An accuracy may move by one token of its set where float rounding tips a near-tied argmax; the
    alignment's mass is a mean of weights."""
    if key == "alignment_mass":
        return {"rel": 1e-4}
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


@pytest.mark.parametrize("attention", RECORDED)
def test_a_tiny_analysis_computes_the_recorded_numbers(tmp_path, attention):
    cfg = copytask.compose([*TINY, f"attention={attention}", *BUDGET, "train.fused=true", f"runs_dir={tmp_path}"])
    metrics = copytask.train(cfg)
    folder = next(path for path in tmp_path.iterdir() if not path.name.startswith("."))
    analysis = analyze_run(folder, [LENGTH, OTHER_LENGTH], BEAM_SIZE, "cpu", SETTINGS)
    assert analysis["computation"] == ANALYSIS_COMPUTATION
    found = numbers(analysis)
    assert found["greedy_token_acc"] == metrics["token_acc"], "the breakdown's greedy decoding is not the run's"
    assert set(found) == set(RECORDED[attention]), f"{attention}: numbers {sorted(found)} are not the recorded ones"
    for key, recorded in RECORDED[attention].items():
        assert found[key] == pytest.approx(recorded, **tolerance(key)), (
            f"{attention}: {key} is {found[key]}, recorded {recorded}: {CHANGE}"
        )

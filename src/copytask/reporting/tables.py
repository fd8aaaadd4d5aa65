"""A grid's finished runs as one table, and its summary over seeds (mean and 95% t-interval,
widened to the held-out set's binomial uncertainty for accuracies).

Each run's metrics.json, and its analysis.json where `copytask analyze` has written one, is read
here; a run whose metrics.json is corrupt is skipped with a warning that names it (a corrupt
analysis.json only loses its analysis), so a half-written or damaged folder never stops
`compare` or `report`. Runs are labelled by `store.model_label`: multi-head runs stand apart,
Transformers read `transformer`.

A sweep is a table: every config key whose value differs between the runs (besides the attention
type, the length and the seed) is a *setting* column of the table, named by its dotted key
(`model.hidden_size`). Summaries group by every setting, the length and the attention type:
nothing is ever averaged but seeds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from scipy import special  # not scipy.stats, whose import alone took about a second of every compare

from .. import console, store
from ..console import ConfigError
from ..families import Family, family_of
from ..store.provenance import mixed_line, own_code_line
from ..store.runs import GridRun
from .breakdown_tables import breakdown_columns

RESULTS_CSV = "results.csv"
COLUMNS = ("attention", "length", "seed", "token_acc", "seq_acc", "chance", "params", "steps", "train_seconds", "run")
ALIGNMENT_COLUMNS = (
    "align_hit",
    "align_mass",
    "align_adjacent",
)  # from analysis.json, empty for runs without attention or analysis
# from metrics.json: floats per sequence the decoder can read of a source of the run's length; empty for runs from
# before it was recorded
STATE_FLOATS = "state_floats"
TARGET_STEP = "target_step"  # from history.csv: the first evaluation step at train.target_acc, empty if never reached
# from analysis.json's breakdown, empty where there is none: the teacher-forced accuracy, then (`breakdown_columns`)
# each beam width's and the probe's
TEACHER_FORCED = ("tf_token_acc", "tf_seq_acc")
BASELINE = "none"
CONFIDENCE = 0.95
# Identity keys that are columns of their own (`seed`, `length`), never settings.
OWN_COLUMNS = ("seed", "task.length")


@dataclass
class Loaded:
    """The grid's usable runs, and the rest with the reason each one is left out."""

    table: pd.DataFrame  # one row per complete run: COLUMNS, ALIGNMENT_COLUMNS, the settings, the rest of metrics.json
    runs: dict[str, GridRun]  # run folder name -> grid run, for the rows of `table`
    missing: list[tuple[GridRun, str]]
    analyses: dict[str, dict]  # run folder name -> its analysis.json, for the rows of `table` that have one
    settings: list[str]  # the config keys that vary between the rows, dotted, in config order (see `setting_keys`)
    # where the rows were made by different code, the line that says so under a table of them (`provenance.mixed_line`)
    mixed: str | None = None

    def families(self) -> dict[str, Family]:
        """Each model label of the rows -> its family (`families`): what a section says of a model's runs."""
        return {store.model_label(run.config): family_of(run.config) for run in self.runs.values()}


def read_analysis(folder: Path) -> dict | None:
    """A run's analysis.json, or None if it has none (or a corrupt one: warned, naming the run)."""
    path = folder / store.ANALYSIS
    if not path.is_file():
        return None
    try:
        return store.read_json(path)
    except (OSError, ValueError) as error:
        console.warn(f"skipping {store.ANALYSIS} of {folder}: {type(error).__name__}: {error}")
        return None


def target_step(folder: Path, target: float) -> float:
    """The first evaluation step whose greedy token accuracy on the validation set reached `target`
    (the run's train.target_acc), from its history.csv; NaN if none did (or the history cannot be read)."""
    try:
        history = pd.read_csv(folder / store.HISTORY)
        hit = history["step"][history["val_token_acc"] >= target]
    except (OSError, ValueError, KeyError):  # pandas' parser and empty-data errors are ValueErrors
        return math.nan
    return float(hit.iloc[0]) if len(hit) else math.nan


def setting_keys(configs: pd.DataFrame, attention: pd.Series) -> list[str]:
    """The columns of `configs` (one row per run, dotted keys) whose values differ between runs,
    besides OWN_COLUMNS. An `attention.*` or `model.*` key is a setting only where it varies among
    runs of one attention type or model (`attention.size=16,32`, `model.hidden_size=32,64`): between
    them it is part of what each is (a GRU has a hidden size, a Transformer a `model.d_model`)."""
    keys = []
    for key in configs.columns:
        values = configs[key]
        if key in OWN_COLUMNS or values.nunique(dropna=False) < 2:
            continue
        if (
            key.startswith(("attention.", "model."))
            and values.groupby(attention.to_numpy()).nunique(dropna=False).max() < 2
        ):
            continue
        keys.append(key)
    return keys


def load(grid: list[GridRun]) -> Loaded:
    """Read metrics.json (and analysis.json) of every complete run in `grid`; warn about and skip the rest."""
    rows, runs, missing, analyses, configs = [], {}, [], {}, []
    for run in grid:
        status = run.status()
        if status == "complete":
            config = run.resolved  # plain values: no DictConfig made per run (docs/bench.md, the answers)
            reason = run.config_failure() if config is None else None  # a run a sweep's record names
            try:
                metrics = store.read_json(run.folder / store.METRICS)
                missing_keys = [key for key in COLUMNS if key not in metrics]
                if missing_keys:
                    raise ValueError(f"no {', '.join(missing_keys)}")
            except (OSError, ValueError, TypeError) as error:
                reason = f"corrupt {store.METRICS} ({error})"
            if reason is not None:
                console.warn(f"skipping {run.folder}: {reason}")
                missing.append((run, reason))
                continue
            metrics["attention"] = store.model_label(config)
            metrics[TARGET_STEP] = target_step(run.folder, config["train"]["target_acc"])
            metrics["eval_size"] = config["train"]["eval_size"]  # the sequences each accuracy is a share of (`scored`)
            analysis = read_analysis(run.folder)
            if analysis is not None:
                analyses[metrics["run"]] = analysis
                metrics |= {f"align_{key}": value for key, value in analysis.get("alignment", {}).items()}
                metrics |= breakdown_columns(analysis)
            rows.append(metrics)
            configs.append(store.flat_identity(config))
            runs[metrics["run"]] = run
        else:
            if status == "incomplete":  # a half-written folder; failed runs are named by their sweep
                console.warn(f"skipping {run.folder}: {run.failure()}")
            missing.append((run, run.failure()))
    table, settings = pd.DataFrame(rows), []
    if not table.empty:
        configs = pd.DataFrame(configs)
        settings = setting_keys(configs, table["attention"])
        table = pd.concat([table, configs[settings]], axis=1)
        first = [*COLUMNS, STATE_FLOATS, TARGET_STEP, *ALIGNMENT_COLUMNS, *TEACHER_FORCED, *settings]
        table = table.reindex(columns=[*first, *(c for c in table.columns if c not in first)])
        table[STATE_FLOATS] = table[STATE_FLOATS].astype("Int64")  # a count, empty where a run has none
    made_by = {row["run"]: row for row in rows}
    mixed = " ".join(filter(None, [mixed_line(made_by), own_code_line(made_by)])) or None
    return Loaded(table, runs, missing, analyses, settings, mixed)


def save(loaded: Loaded, runs_dir: Path) -> Path:
    """runs_dir/results.csv, written atomically: one row per run, its settings, and `config`, the
    path of its resolved config.yaml relative to runs_dir."""
    path = Path(runs_dir) / RESULTS_CSV
    breakdown = [c for c in loaded.table.columns if c.startswith(("beam", "probe"))]
    table = loaded.table[
        [*COLUMNS, STATE_FLOATS, TARGET_STEP, *ALIGNMENT_COLUMNS, *TEACHER_FORCED, *breakdown, *loaded.settings]
    ].copy()
    table["config"] = [f"{run}/{store.CONFIG}" for run in table["run"]]
    store.atomic_write(path, table.to_csv(index=False))
    return path


def interval(values: pd.Series, trials: int | None = None) -> tuple[float, float, float]:
    """Mean and 95% t-interval over seeds; the interval is NaN with a single seed.

    With `trials`, the values are shares of that many scored items (the tokens or sequences of one
    held-out set), and the interval is widened to hold the Wilson interval of the mean over them:
    the held-out set's own sampling uncertainty, which a t-interval hides where every seed scores
    the same (all at 100% or at 0%: zero width). Every seed scores the same held-out set
    (train.eval_seed), so seeds do not add trials."""
    n, mean = len(values), float(values.mean())
    if n < 2:
        return mean, math.nan, math.nan
    half = special.stdtrit(n - 1, 0.5 + CONFIDENCE / 2) * float(values.std(ddof=1)) / math.sqrt(n)  # t quantile
    low, high = mean - half, mean + half
    if trials:
        wilson_low, wilson_high = wilson(mean, trials)
        low, high = min(low, wilson_low), max(high, wilson_high)
    return mean, low, high


def wilson(share: float, trials: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a share of `trials` scored items (one held-out set's sampling
    error), in Newcombe's form (1998), as scipy.stats.binomtest(...).proportion_ci(method="wilson")
    computes it: tests/test_intervals.py holds it to that."""
    successes = round(share * trials)
    p, z = successes / trials, special.ndtri(0.5 + CONFIDENCE / 2)
    denominator = 2 * (trials + z**2)
    centre = (2 * trials * p + z**2) / denominator
    half = z / denominator * math.sqrt(4 * trials * p * (1 - p) + z**2)
    return (0.0 if successes == 0 else centre - half), (1.0 if successes == trials else centre + half)


def scored(group: pd.DataFrame, sequences: str = "eval_size") -> dict[str, int | None]:
    """How many tokens and sequences one evaluation of the runs in `group` scores (token_acc and
    seq_acc are shares of them): train.eval_size sequences (the column `sequences`: `breakdown_sequences`
    for the breakdown's) of task.length symbols, or with variable lengths of (min_length + length) / 2
    on average. None for a table without the column."""
    if sequences not in group or group[sequences].isna().any():
        return {"token_acc": None, "seq_acc": None}
    sequences = int(group[sequences].min())
    shortest = (
        group["min_length"].fillna(group["length"]) if "min_length" in group else group["length"]
    )  # older runs have none
    return {"token_acc": round(sequences * float((shortest + group["length"]).min()) / 2), "seq_acc": sequences}


def summarise(table: pd.DataFrame, settings: list[str] = ()) -> pd.DataFrame:
    """One row per (settings..., length, attention), baseline first within each: seeds, mean and
    interval of token and sequence accuracy (never narrower than the held-out set's own
    uncertainty where the table has `eval_size`: see `interval`) and of the steps to the target accuracy (over the
    `reached` runs that got there), chance, params, state floats (NA where the runs have none), and the gap of
    each mean to the mean of the baseline with the same settings and length (empty where there is no such baseline;
    `attention.*` settings are not matched, as the baseline has no attention)."""
    keys = [*settings, "length", "attention"]
    rows = []
    for values, group in table.groupby(keys, sort=False, dropna=False):
        row = dict(zip(keys, values)) | {"seeds": group["seed"].nunique()}
        trials = scored(group)
        for metric in ("token_acc", "seq_acc"):
            row[metric], row[f"{metric}_lo"], row[f"{metric}_hi"] = interval(group[metric], trials[metric])
        if TEACHER_FORCED[0] in group and group[TEACHER_FORCED[0]].notna().all():
            trials = scored(group, "breakdown_sequences")
            for metric, share in zip(TEACHER_FORCED, ("token_acc", "seq_acc")):
                row[metric], row[f"{metric}_lo"], row[f"{metric}_hi"] = interval(group[metric], trials[share])
        # the step's mean is over the seeds that got there; a table from before it was recorded has none
        reached = group.get(TARGET_STEP, pd.Series(dtype=float)).dropna()
        row[TARGET_STEP], row[f"{TARGET_STEP}_lo"], row[f"{TARGET_STEP}_hi"] = interval(reached)
        row["reached"] = len(reached)
        row["chance"] = group["chance"].iloc[0]
        row["params"] = group["params"].iloc[0]
        row[STATE_FLOATS] = group[STATE_FLOATS].iloc[0] if STATE_FLOATS in group else pd.NA
        rows.append(row)
    summary = pd.DataFrame(rows)
    order = [BASELINE] + [a for a in dict.fromkeys(table["attention"]) if a != BASELINE]
    summary["attention"] = pd.Categorical(summary["attention"], categories=order, ordered=True)
    summary = summary.sort_values(keys, na_position="first").reset_index(drop=True)
    summary["attention"] = summary["attention"].astype(str)
    match = [key for key in keys[:-1] if not key.startswith("attention.")]
    baseline = summary.loc[summary["attention"] == BASELINE, [*match, "token_acc", "seq_acc"]]
    paired = summary[match].merge(baseline, on=match, how="left")  # keeps summary's row order
    for metric in ("token_acc", "seq_acc"):
        summary[f"{metric}_gap"] = summary[metric].to_numpy() - paired[metric].to_numpy()
        summary.loc[summary["attention"] == BASELINE, f"{metric}_gap"] = math.nan
    return summary


def numeric(values: pd.Series) -> bool:
    """Whether a column holds numbers (booleans are not: True and False are no axis)."""
    return pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values)


def x_column(x: str, loaded: Loaded) -> str:
    """The results column `report.x` names (`task.length` is `length`); ConfigError unless it is
    the length or a numeric setting of the grid."""
    column = "length" if x == "task.length" else x
    table = loaded.table
    numbers = [key for key in loaded.settings if numeric(table[key])]
    if column != "length" and column not in numbers:
        choices = ", ".join(["task.length", *numbers])
        raise ConfigError(f"report.x must be task.length or a numeric key swept in this grid ({choices}), got {x!r}")
    return column


def ordered(values: Iterable[object]) -> list:
    """A setting's values in order, where runs of other models mix them with None (a key their model lacks) or
    values of another type: each type's values in order, None last."""
    return sorted(values, key=lambda value: (value is None, type(value).__name__, value))


def setting_value(value: object) -> str:
    """A setting's value as a table or a title shows it: `1e-3` rather than `0.001000`, `-` for none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def count(value: object) -> str:
    """`1,104`; empty where there is none (NaN, NA)."""
    return "" if pd.isna(value) else f"{int(value):,}"


def percent(value: float) -> str:
    return "" if math.isnan(value) else f"{100 * value:.1f}"


def with_interval(mean: float, low: float, high: float) -> str:
    """`99.8 [99.5, 100.0]` in percent; the interval is clipped to [0, 100] (accuracies)."""
    if math.isnan(low):
        return percent(mean)
    return f"{percent(mean)} [{percent(max(low, 0.0))}, {percent(min(high, 1.0))}]"


def comparison_table(summary: pd.DataFrame, settings: list[str] = (), wide: bool = False) -> pd.DataFrame:
    """`summarise`'s numbers as strings for a terminal or markdown, accuracies in percent: the columns a
    reader needs (NARROW, and the chance where it differs between rows), which fit 100 columns of a
    terminal; `wide`: every column (teacher-forced accuracy, steps to target, parameters, state floats)."""
    table = full_table(summary, settings)
    if wide:
        return table
    keep = [*(key for key in settings if key in table), *NARROW]
    if table["chance %"].nunique() > 1:
        keep.insert(keep.index("token acc % [95% CI]"), "chance %")
    if state_varies(summary):  # a grid of state sizes: the size is what a reader compares
        keep.insert(keep.index("token acc % [95% CI]"), "state floats per sequence")
    renamed = {f"token gap vs {BASELINE}": f"gap vs {BASELINE}", "state floats per sequence": "state floats"}
    return table[keep].rename(columns=renamed)


def state_varies(summary: pd.DataFrame) -> bool:
    """Whether some model's state floats take two values or more at one length (a grid that sizes the state)."""
    if STATE_FLOATS not in summary or summary[STATE_FLOATS].isna().all():
        return False
    return bool((summary.groupby(["attention", "length"])[STATE_FLOATS].nunique() > 1).any())


# compare's columns by default (`comparison_table`); `compare --wide` prints every column
NARROW = ("length", "attention", "seeds", "token acc % [95% CI]", "seq acc % [95% CI]", f"token gap vs {BASELINE}")


def full_table(summary: pd.DataFrame, settings: list[str] = ()) -> pd.DataFrame:
    """Every column of `comparison_table`."""

    def gap(value: float) -> str:
        return "" if math.isnan(value) else f"{100 * value:+.1f}"

    def steps(row) -> str:
        """`650 [520, 780]`, with `(2/3)` where only some runs reached the target; `never` where none did."""
        if row.reached == 0:
            return "never"
        text = f"{row.target_step:,.0f}"
        if not math.isnan(row.target_step_lo):
            text += f" [{max(row.target_step_lo, 0):,.0f}, {row.target_step_hi:,.0f}]"
        return text + (f" ({row.reached}/{row.seeds})" if row.reached < row.seeds else "")

    return pd.DataFrame(
        {
            **{key: summary[key].map(setting_value) for key in settings},
            "length": summary["length"],
            "attention": summary["attention"],
            "seeds": summary["seeds"],
            "token acc % [95% CI]": [
                with_interval(r.token_acc, r.token_acc_lo, r.token_acc_hi) for r in summary.itertuples()
            ],
            "seq acc % [95% CI]": [with_interval(r.seq_acc, r.seq_acc_lo, r.seq_acc_hi) for r in summary.itertuples()],
            **teacher_forced_column(summary),
            "steps to target [95% CI]": [steps(r) for r in summary.itertuples()],
            "chance %": summary["chance"].map(percent),
            "params": summary["params"].map("{:,}".format),
            "state floats per sequence": summary.get(STATE_FLOATS, pd.Series(pd.NA, summary.index)).map(count),
            f"token gap vs {BASELINE}": summary["token_acc_gap"].map(gap),
            f"seq gap vs {BASELINE}": summary["seq_acc_gap"].map(gap),
        }
    )


def teacher_forced_column(summary: pd.DataFrame) -> dict[str, list[str]]:
    """The teacher-forced token accuracy with its interval, where every row has one (all runs analysed)."""
    if "tf_token_acc" not in summary or summary["tf_token_acc"].isna().any():
        return {}
    values = [with_interval(r.tf_token_acc, r.tf_token_acc_lo, r.tf_token_acc_hi) for r in summary.itertuples()]
    return {"teacher-forced token acc % [95% CI]": values}


def narrow_note(tasks: list[str], chance: list[float]) -> str:
    """The lines `compare` prints above its default table (`comparison_table`), none over 100 columns."""
    per_token = f"; chance {percent(chance[0])}% per token" if len(set(chance)) == 1 else ""
    return (
        f"{'/'.join(tasks)} task: greedy accuracy on the held-out test set in %, mean over seeds [95% interval,\n"
        f"none with one seed]; gap: token accuracy minus {BASELINE}'s{per_token}; every column: --wide"
    )


def table_note(tasks: list[str], teacher_forced: bool = False) -> str:
    """The lines `compare --wide` prints above `comparison_table(..., wide=True)` (`teacher_forced`: it has
    that column)."""
    note = (
        f"{'/'.join(tasks)} task, test-set accuracies in %, mean over seeds with 95% t-interval "
        "(none with one seed; for accuracies never\n"
        "narrower than the test set's own 95% Wilson interval); "
        f"gap = mean - {BASELINE}'s mean; steps to target: the first evaluation at\n"
        "train.target_acc greedy token accuracy on the validation set, "
        "over the seeds that reached it (k/n where not all did)"
    )
    if teacher_forced:
        note += (
            ";\nteacher-forced: the argmax given the true prefix, on the same test sequences as greedy decoding, "
            "scored up to the first EOS"
        )
    return note


def markdown_table(frame: pd.DataFrame) -> str:
    """`frame` as a markdown table, its columns as the header."""
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)

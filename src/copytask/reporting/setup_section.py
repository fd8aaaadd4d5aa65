"""report.md's Setup section: what the runs of a report were, from their configs, metrics and the
last sweep's record (`report.write_report` puts it first)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .. import store
from ..families import family_of
from ..store.runs import SWEEP_RECORD, TRAINED_BY
from . import tables


def setup_section(loaded: tables.Loaded, runs_dir: Path) -> list[str]:
    """What the runs were: every sentence states the values of the runs it describes, one value
    where all share it, the list where they differ; then what varies, the hardware and the wall time."""
    table = loaded.table
    configs = [loaded.runs[run].config for run in table["run"]]
    attentions = ", ".join(dict.fromkeys(table["attention"]))
    lengths = ", ".join(map(str, sorted(table["length"].unique())))
    seeds = ", ".join(map(str, sorted(table["seed"].unique())))
    varying = [key for key in ("attention", "length", "seed") if table[key].nunique() > 1] + loaded.settings
    swept = ", ".join(
        f"`{key}` ({', '.join(map(tables.setting_value, tables.ordered(table[key].unique())))})" for key in varying
    )
    chance = ", ".join(f"{100 * value:.1f}%" for value in sorted(table["chance"].unique(), reverse=True))
    return [
        "## Setup",
        "",
        f"- Task: `{values(configs, 'task.name')}`, {values(configs, 'task.vocab_size')} content symbols "
        f"(chance token accuracy {chance}), lengths {lengths}.",
        f"- Attention types: {attentions}; seeds: {seeds}. Swept: {swept or 'nothing'}.",
        *model_lines(configs),
        training_line(configs),
        f"- Evaluation: greedy decoding (no teacher forcing) on {values(configs, 'train.eval_size')} held-out "
        f"sequences (seed {values(configs, 'train.eval_seed')}).",
        f"- Hardware (from the runs): device {', '.join(map(str, table['device'].unique()))}, "
        f"torch threads {', '.join(map(str, table['threads'].unique()))}.",
        f"- Compute: {table['train_seconds'].sum():.0f} s of training summed over {len(table)} runs.",
        *last_sweep_line(runs_dir),
    ]


def values(configs: list[DictConfig], key: str, show=tables.setting_value) -> str:
    """`64`, or `16, 32, 64 (per setting)` where the runs (their `configs`) differ."""
    found = tables.ordered({OmegaConf.select(cfg, key) for cfg in configs})
    return show(found[0]) if len(found) == 1 else f"{', '.join(map(show, found))} (per setting)"


def model_lines(configs: list[DictConfig]) -> list[str]:
    """A line on the models of each family the runs have (`Family.describe`), in the order the runs first have it."""
    families = {}
    for cfg in configs:
        families.setdefault(family_of(cfg).name, []).append(cfg)
    return [family_of(group[0]).describe(group, values) for group in families.values()]


def training_line(configs: list[DictConfig]) -> str:
    """The budget, optimiser, schedule and early stopping every attention type gets."""
    if {cfg.train.patience for cfg in configs} == {None}:
        early_stop = "no early stop"
    else:
        target = values(configs, "train.target_acc", lambda accuracy: f"{accuracy:.0%}")
        early_stop = (
            f"stops early once held-out token accuracy is >= {target} "
            f"at {values(configs, 'train.patience')} evaluations in a row"
        )
    return (
        f"- Training: budget {values(configs, 'train.steps')} steps of batch {values(configs, 'train.batch_size')}, "
        f"Adam, {values(configs, 'train.schedule')} schedule peaking at lr {values(configs, 'train.lr')}, gradient "
        f"clipping {values(configs, 'train.clip')}; {early_stop}. Each attention type gets the same."
    )


def last_sweep_line(runs_dir: Path) -> list[str]:
    """The last finished sweep in `runs_dir` from its record: its command, launcher, runs and wall
    time; where it trained none of its runs, also the record of the last sweep that trained any (its
    `TRAINED_BY`), whose wall time is the runs'; nothing while it runs or where there has been none."""
    record_path = runs_dir / SWEEP_RECORD
    record = store.read_json(record_path) if record_path.is_file() else {}
    if "wall_seconds" not in record:  # a finished sweep's record, not one still running
        return []
    sweep = f"- Last sweep in `{runs_dir}`: `{record['command']}` ({record.get('launcher')} launcher)"
    if record["trained"]:
        return [f"{sweep} {training(record)}"]
    return [
        f"{sweep} trained none of its {record['jobs']} runs ({record['wall_seconds']:.0f} s wall time, finished "
        f"{record['finished']}). {trained_by(record)}"
    ]


def training(record: dict) -> str:
    """What a sweep's `record` says of its training: the runs it trained, its wall time, when and where
    it finished, and its analysis' share of the time."""
    return (
        f"trained {record['trained']} of {record['jobs']} runs in **{record['wall_seconds']:.0f} s wall time**, "
        f"finished {record['finished']} on {record['machine']} with {record['cpus']} CPUs"
        + (f" and a {record['gpu']}" if record.get("gpu") else "")
        + (f"; its analysis took {record['analysis_seconds']:.0f} s of that." if "analysis_seconds" in record else ".")
    )


def trained_by(record: dict) -> str:
    """Who trained the runs of a sweep (`record`) that trained none: the last sweep that trained any, which
    its record kept, or that no record of one is left (they were trained by `train`, or by another grid)."""
    if not (before := record.get(TRAINED_BY)):
        return "No record is left of the sweep that trained them: the Compute line above gives their training time."
    command = "the same command" if before["command"] == record["command"] else f"`{before['command']}`"
    return f"The last sweep that trained any of them, {command} ({before.get('launcher')} launcher), {training(before)}"

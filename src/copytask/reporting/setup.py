"""report.md's Setup section: what the runs of a report were, from their configs, metrics and the
last sweep's record (`reporting.write_report` puts it first)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .. import store
from . import tables
from ..store.grid import SWEEP_RECORD
from ..config.model_keys import is_transformer


def setup_section(loaded: tables.Loaded, runs_dir: Path) -> list[str]:
    """What the runs were: every sentence states the values of the runs it describes, one value
    where all share it, the list where they differ; then what varies, the hardware and the wall time."""
    table = loaded.table
    configs = [loaded.runs[run].config for run in table["run"]]

    gru = [cfg for cfg in configs if not is_transformer(cfg)]
    transformers = [cfg for cfg in configs if is_transformer(cfg)]

    def values(key: str, show=tables.setting_value, among: list[DictConfig] = configs) -> str:
        """`64`, or `16, 32, 64 (per setting)` where the runs (`among` them) differ."""
        found = sorted({OmegaConf.select(cfg, key) for cfg in among}, key=lambda value: (value is None, str(type(value)), value))
        return show(found[0]) if len(found) == 1 else f"{', '.join(map(show, found))} (per setting)"

    attentions = ", ".join(dict.fromkeys(table["attention"]))
    lengths = ", ".join(map(str, sorted(table["length"].unique())))
    seeds = ", ".join(map(str, sorted(table["seed"].unique())))
    varying = [key for key in ("attention", "length", "seed") if table[key].nunique() > 1] + loaded.settings
    swept = ", ".join(f"`{key}` ({', '.join(map(tables.setting_value, sorted(table[key].unique())))})" for key in varying)
    chance = ", ".join(f"{100 * value:.1f}%" for value in sorted(table["chance"].unique(), reverse=True))
    patience = {cfg.train.patience for cfg in configs}
    early_stop = (
        "no early stop" if patience == {None}
        else f"stops early once held-out token accuracy is >= {values('train.target_acc', lambda v: f'{v:.0%}')} "
        f"at {values('train.patience')} evaluations in a row"
    )  # fmt: skip
    encoder = values("model.bidirectional", lambda bidirectional: "bidirectional" if bidirectional else "unidirectional", gru)
    models = [
        f"- Model: GRU encoder-decoder, hidden size {values('model.hidden_size', among=gru)}, embedding size "
        f"{values('model.embedding_size', among=gru)}, {encoder} encoder."
    ] if gru else []  # fmt: skip
    if transformers:
        models.append(
            f"- Transformer: torch's nn.Transformer, {values('model.layers', among=transformers)} layers each side, "
            f"{values('model.heads', among=transformers)} heads, d_model {values('model.d_model', among=transformers)}, "
            f"feed-forward {values('model.ff_size', among=transformers)}, {values('model.positions', among=transformers)} positions, "
            f"dropout {values('model.dropout', among=transformers)}."
        )
    lines = [
        "## Setup",
        "",
        f"- Task: `{values('task.name')}`, {values('task.vocab_size')} content symbols (chance token accuracy {chance}), "
        f"lengths {lengths}.",
        f"- Attention types: {attentions}; seeds: {seeds}. Swept: {swept or 'nothing'}.",
        *models,
        f"- Training: budget {values('train.steps')} steps of batch {values('train.batch_size')}, Adam, {values('train.schedule')} "
        f"schedule peaking at lr {values('train.lr')}, gradient clipping {values('train.clip')}; {early_stop}. "
        "Each attention type gets the same.",
        f"- Evaluation: greedy decoding (no teacher forcing) on {values('train.eval_size')} held-out sequences "
        f"(seed {values('train.eval_seed')}).",
        f"- Hardware (from the runs): device {', '.join(map(str, table['device'].unique()))}, "
        f"torch threads {', '.join(map(str, table['threads'].unique()))}.",
        f"- Compute: {table['train_seconds'].sum():.0f} s of training summed over {len(table)} runs.",
    ]
    record_path = runs_dir / SWEEP_RECORD
    record = store.read_json(record_path) if record_path.is_file() else {}
    if "wall_seconds" in record:  # a finished sweep's record, not one still running
        lines.append(
            f"- Last sweep in `{runs_dir}`: `{record['command']}` ({record.get('launcher')} launcher) trained "
            f"{record['trained']} of {record['jobs']} runs in **{record['wall_seconds']:.0f} s wall time**, "
            f"finished {record['finished']} on {record['machine']} with {record['cpus']} CPUs"
            + (f" and a {record['gpu']}" if record.get("gpu") else "")
            + (f"; its analysis took {record['analysis_seconds']:.0f} s of that." if "analysis_seconds" in record else ".")
        )
    return lines

"""The run store: a run's identity and folder name (`identity`), the files of a run folder with
atomic writes and locks (`folders`), the runs a grid or folder holds with their status and the
records a sweep leaves (`runs`), what made a run (`provenance`, which decides which complete runs
are reused), and how complete results are replaced without ever being lost (`replacement`). Training
writes through it; compare, report and the API read through it.

`store.X` is `folders.X` or `identity.X`: the two halves of one concept, read together;
`store.provenance` and `store.replacement` are their own."""

from . import provenance, replacement
from .folders import (
    ANALYSIS,
    ATTENTION,
    CHECKPOINT,
    CONFIG,
    FAILED,
    HISTORY,
    LOCKS,
    METRICS,
    PROGRESS,
    RESUME,
    UNREADABLE_RESUME,
    atomic_write,
    complete_runs,
    is_complete,
    is_locked,
    lock_path,
    lock_run,
    read_config,
    read_json,
    read_progress,
    read_resolved,
    rounded,
    write_json,
    write_progress,
)
from .identity import (
    NEUTRAL,
    NOT_IDENTITY,
    UNUSED_UNLESS,
    architecture,
    flat_identity,
    identity,
    model_label,
    run_dir,
    run_name,
)

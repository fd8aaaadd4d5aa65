"""For tests/test_slurm.py's sweeps whose jobs must be caught training, put on the PYTHONPATH of such a
sweep only (its SLURM jobs inherit it, with COPYTASK_TEST_RELEASE). In the first attempt of a SLURM
job (SLURM_RESTART_COUNT is set once SLURM has requeued it), the run holds right after writing a
checkpoint until the file COPYTASK_TEST_RELEASE names exists, or the job is signalled or killed: a
test acts on a job that has a checkpoint and has surely not finished, however fast or loaded the
machine, and no run needs more steps than one checkpoint and its end. Requeued attempts train
through."""

import os
import time
from pathlib import Path

if os.environ.get("SLURM_JOB_ID") and not os.environ.get("SLURM_RESTART_COUNT"):
    from copytask.training import checkpoints

    real_save = checkpoints.save
    release = Path(os.environ["COPYTASK_TEST_RELEASE"])

    def save_then_hold(*args, **kwargs):
        real_save(*args, **kwargs)
        while not release.exists():  # SLURM's signals reach submitit's handler between the sleeps
            time.sleep(0.1)

    checkpoints.save = save_then_hold

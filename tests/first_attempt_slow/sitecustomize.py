"""For tests/test_slurm.py's time-limit test, put on PYTHONPATH of its sweep only: in the first
attempt of a SLURM job (SLURM_RESTART_COUNT is set once SLURM has requeued it), each training step
takes 80 ms longer, so the run is surely still training when SLURM signals the job before its
two-minute limit, however fast the machine. Requeued attempts train at full speed."""

import os
import time

if os.environ.get("SLURM_JOB_ID") and not os.environ.get("SLURM_RESTART_COUNT"):
    from copytask.training import loop

    real_step = loop.train_step

    def slow_step(*args, **kwargs):
        time.sleep(0.08)
        return real_step(*args, **kwargs)

    loop.train_step = slow_step

"""Many runs: a grid composed and checked whole, and which runs compare and report see (`grid`);
Hydra jobs, the sweep's progress and its end (`jobs`); and SLURM (`slurm`)."""

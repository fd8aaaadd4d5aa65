"""Many runs: a grid composed and checked whole, and which runs compare and report see (`grid`);
Hydra jobs and the sweep's end (`jobs`); its progress bar (`progress`); and SLURM (`slurm`)."""

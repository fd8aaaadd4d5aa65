"""Many runs: Hydra jobs, the sweep's progress and its end (`jobs`), and SLURM (`slurm`)."""

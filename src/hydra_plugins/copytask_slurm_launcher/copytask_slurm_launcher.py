"""copytask's SLURM launcher (`hydra/launcher=slurm`), where Hydra looks for launchers: Hydra loads
a launcher only from the `hydra_plugins` namespace, and imports every module there at start, so
this one stays small; the code is `copytask.sweeps.slurm`."""

from collections.abc import Sequence

from hydra.core.utils import JobReturn

from hydra_plugins.hydra_submitit_launcher import submitit_launcher


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    """Hydra's submitit SLURM launcher with copytask's submission, job states and terminal
    (`copytask.sweeps.slurm.launch`); each job runs, and is requeued (`checkpoint`), as in Hydra's."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from copytask.sweeps.slurm import launch

        return launch(self, job_overrides, initial_job_idx)

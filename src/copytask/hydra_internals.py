"""The Hydra internals copytask uses, in one place: Hydra 1.3 has no public API for them.

- `override_args(args)`: tell Hydra's own flags (`--cfg job`) from overrides, with Hydra's parser
  (a flag it does not have is a ConfigError);
- `compose(overrides, multirun)`: a config composed as Hydra composes it for `train` or `sweep`,
  hydra node included (the Compose API leaves the sweeper's params and the run mode out);
- `sweep_jobs(master)`: the jobs Hydra's basic sweeper launches for a multirun config, each as its
  overrides and its composed config (a search space it cannot expand is a ConfigError);
- `own_global_hydra()`: a block with no GlobalHydra, after which the caller's is back as it was.

All need an initialised GlobalHydra (inside a Hydra app, or `initialize_config_dir`).
tests/test_hydra_internals.py checks each against a small known case, so a Hydra release that
changes them fails there, loudly, before anything else does.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig

from .config import ConfigError


def override_args(args: list[str]) -> list[str]:
    """The overrides among a Hydra command line's `args` (flags and their values left out);
    ConfigError, in one line, for a flag Hydra does not have (argparse would print its usage block)."""
    parser = get_args_parser()

    def refuse(message: str) -> None:
        raise ConfigError(f"{message} (keys are set as key=value; --help lists them, --hydra-help Hydra's flags)")

    parser.error = refuse
    return parser.parse_intermixed_args(args).overrides


def compose(overrides: list[str], multirun: bool, config_name: str = "config") -> DictConfig:
    """`config_name` with `overrides`, as Hydra composes it for a run (multirun: for a sweep, before
    its jobs are expanded)."""
    hydra = GlobalHydra.instance().hydra
    if multirun:
        return hydra.compose_config(config_name, ["hydra.mode=MULTIRUN", *overrides], run_mode=RunMode.MULTIRUN)
    return hydra.compose_config(config_name, overrides, run_mode=RunMode.RUN)


def sweep_jobs(master: DictConfig) -> tuple[Iterator[tuple[list[str], DictConfig]], set[str]]:
    """The jobs the basic sweeper launches for `master`, in launch order, each as (overrides, config
    with its hydra node), composed one by one as the iterator is read, and the keys swept over more
    than one value. The sweeper's params come first, then the command line's overrides, which
    replace a swept key's list."""
    loader = GlobalHydra.instance().config_loader()
    params = [f"{key}={value}" for key, value in (master.hydra.sweeper.params or {}).items()]
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(params + list(master.hydra.overrides.task))
    for override in parsed:
        if override.is_sweep_override() and not override.is_discrete_sweep():  # the basic sweeper would raise with a traceback
            raise ConfigError(
                f"{override.input_line}: the basic sweeper takes lists (a,b,c), range(start,stop,step) and choice(a,b), "
                f"not {override.value_type.name.lower().removesuffix('_sweep')}(...), which is for an optimising sweeper"
            )
    [batches] = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    swept = {override.get_key_element() for override in parsed if override.is_sweep_override()}
    return ((list(overrides), loader.load_sweep_config(master, list(overrides))) for overrides in batches), swept


@contextmanager
def own_global_hydra() -> Iterator[None]:
    """Inside: no GlobalHydra, for copytask to initialise its own (composing, or a sweep); after:
    the one the caller had initialised, if any, as it was (Hydra keeps one per process)."""
    callers = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:
        yield
    finally:  # Hydra's own run may have replaced the instance (its launchers restore singletons)
        GlobalHydra.instance().clear()
        GlobalHydra.instance().hydra = callers

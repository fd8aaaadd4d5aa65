"""The Hydra internals copytask uses, in one place: Hydra 1.3 has no public API for them.

- `override_args(args)`: tell Hydra's own flags (`--cfg job`) from overrides, with Hydra's parser
  (a flag it does not have is a ConfigError);
- `compose(overrides, multirun)`: a config composed as Hydra composes it for `train` or `sweep`,
  hydra node included (the Compose API leaves the sweeper's params and the run mode out);
- `sweep_jobs(master)`: the jobs Hydra's basic sweeper launches for a multirun config, each as its
  overrides (a search space it cannot expand is a ConfigError), and `swept_keys(master)` the keys
  it varies;
- `compose_job(master, overrides)`: one job's config, as the sweeper's launcher composes it;
- `proposes_jobs(master.hydra)`, `search_space(master)` and `search_samples(master)`: whether the
  sweeper chooses its jobs as it goes (Optuna), and for such a sweeper its search space as
  overrides, and a value of each searched key (one the Optuna sweeper cannot take is a ConfigError);
- `own_global_hydra()`: a block with no GlobalHydra, after which the caller's is back as it was;
- `configs_digest(searchpath)`: a digest of the config files a grid is composed from, configs/ and
  the folders of `hydra.searchpath` found as Hydra finds them (`file://` and bare paths from the
  current folder, `pkg://` packages).

`compose`, `sweep_jobs`, `compose_job`, `search_space` and `search_samples` need an initialised
GlobalHydra (inside a Hydra app, or `initialize_config_dir`).
tests/test_hydra_internals.py checks each against a small known case, so a Hydra release that
changes them fails there, loudly, before anything else does.
"""

from __future__ import annotations

import hashlib
import importlib.resources
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.types import RunMode
from omegaconf import DictConfig

from .schema import ConfigError, config_dir


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


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def sweep_overrides(master: DictConfig, with_loader: bool = True) -> list[Override]:
    """The sweeper's params, then the command line's overrides, parsed (OverrideParseException for
    one Hydra's grammar cannot read). `with_loader=False`: without GlobalHydra's config loader, which
    only a glob over a group's options needs to list its values."""
    params = [f"{key}={value}" for key, value in (master.hydra.sweeper.get("params") or {}).items()]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader() if with_loader else None)
    return parser.parse_overrides(params + list(master.hydra.overrides.task))


def swept_keys(master: DictConfig) -> set[str]:
    """The keys a multirun config sweeps (`sweep_jobs`' second value), read without composing a job."""
    return {override.get_key_element() for override in sweep_overrides(master, False) if override.is_sweep_override()}


def proposes_jobs(hydra: DictConfig) -> bool:
    """Whether the sweeper of a config's `hydra` node chooses its jobs as it goes (Optuna, Nevergrad,
    Ax: each trial from the results so far) rather than expanding a grid before the first job, as the
    basic one does."""
    return hydra.sweeper._target_ != BASIC_SWEEPER


def search_space(master: DictConfig) -> tuple[list[str], dict[str, Override]]:
    """For a sweeper that proposes its jobs (`proposes_jobs(master.hydra)`): the overrides every
    trial has, and the searched keys with their overrides. As the Optuna sweeper reads them: a later
    override of a key replaces an earlier one, and a fixed value of a key beats a searched one."""
    fixed, searched = {}, {}
    for override in sweep_overrides(master):
        key = override.get_key_element()
        if override.is_sweep_override():
            searched[key] = override
        else:
            fixed[key] = override.input_line
    return list(fixed.values()), {key: override for key, override in searched.items() if key not in fixed}


def search_samples(master: DictConfig) -> list[str]:
    """One override per searched key (`search_space`) at a value the sweeper may propose: the first
    choice, the low end of an interval. ConfigError, naming the override, for one the Optuna sweeper
    cannot take (a glob, an interval whose ends are reversed), which it would raise mid-sweep."""
    _, searched = search_space(master)
    if master.hydra.sweeper._target_ == OPTUNA_SWEEPER:
        from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides  # optuna: only for its sweeps

        for override in searched.values():
            try:
                create_params_from_overrides([override.input_line])
            except (
                ValueError,
                TypeError,
                AssertionError,
                NotImplementedError,
            ) as error:  # what the plugin would raise in the sweep
                raise ConfigError(
                    f"{override.input_line}: the Optuna sweeper searches choice(a,b), range(start,stop,step), "
                    f"interval(low,high) and tag(log,interval(low,high))"
                    + (f", and says: {error}" if str(error) else "")
                ) from None
    return [
        f"{key}={next(o.sweep_string_iterator()) if o.is_discrete_sweep() else o.value().start}"
        for key, o in searched.items()
    ]


def compose_job(master: DictConfig, overrides: list[str]) -> DictConfig:
    """The config, hydra node included, of the job that `master`'s sweeper launches with `overrides`."""
    return GlobalHydra.instance().config_loader().load_sweep_config(master, list(overrides))


def sweep_jobs(master: DictConfig) -> tuple[list[list[str]], set[str]]:
    """The jobs the basic sweeper launches for `master`, in launch order, each as its overrides
    (`compose_job` composes one), and the keys swept over more than one value. The sweeper's params
    come first, then the command line's overrides, which replace a swept key's list."""
    parsed = sweep_overrides(master)
    for override in parsed:
        if (
            override.is_sweep_override() and not override.is_discrete_sweep()
        ):  # the basic sweeper would raise with a traceback
            raise ConfigError(
                f"{override.input_line}: the basic sweeper takes lists (a,b,c), range(start,stop,step) and "
                f"choice(a,b), not {override.value_type.name.lower().removesuffix('_sweep')}(...), which is for an "
                "optimising sweeper"
            )
    [batches] = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return [list(overrides) for overrides in batches], swept_keys(master)


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


def configs_digest(searchpath: Iterable[str] = ()) -> str:
    """A digest of every YAML file under configs/ and under each folder of `searchpath` (a config's
    `hydra.searchpath`), by its path in that folder and its contents: what composing a grid reads. The
    same digest, the same grid from the same overrides (a sweep records it: `sweeps.grid.select_runs`
    reads the grid from the record, without composing it, while it holds). A folder's own path is left
    out, so that a checkout or runs_dir moved elsewhere still matches; an entry of another scheme
    (`structured://`) counts by its name."""
    digest = hashlib.sha256()
    for number, entry in enumerate([f"file://{config_dir()}", *searchpath]):
        scheme, _, where = entry.rpartition("://")
        if scheme in ("", "file"):  # a bare path is a file path to Hydra too
            root = Path(where)
            files = sorted(root.rglob("*.yaml")) if root.is_dir() else []
            found = [(path.relative_to(root).as_posix(), path.read_bytes()) for path in files]
        elif scheme == "pkg":  # as Hydra's ImportlibResourcesConfigSource reads it
            try:
                found = package_yaml(importlib.resources.files(where.replace("/", ".").rstrip(".")))
            except ModuleNotFoundError:  # composing says so, where it needs the package
                found = []
        else:
            found = [(entry, b"")]
        for name, data in found:
            digest.update(f"{number}\0{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def package_yaml(folder: importlib.resources.abc.Traversable, prefix: str = "") -> list[tuple[str, bytes]]:
    """Each YAML file under a package's `folder`, by its path there, with its contents, in name order."""
    found = []
    for item in sorted(folder.iterdir(), key=lambda item: item.name):
        if item.is_dir():
            found += package_yaml(item, f"{prefix}{item.name}/")
        elif item.name.endswith(".yaml"):
            found.append((f"{prefix}{item.name}", item.read_bytes()))
    return found

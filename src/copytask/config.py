"""Where the Hydra configs live, and copytask's one kind of config error.

Hydra's own composition errors (an unknown key, a config-group option that does not exist, an
override it cannot parse) are turned into `ConfigError`s here, so every command answers bad
input the same way: one line, `copytask: error: ...`, exit status 2.
"""

from __future__ import annotations

import difflib
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """A config value that cannot be run; the message names the value and what is allowed."""


def config_dir() -> str:
    """configs/ inside the package (wheel install) or at the top of the checkout (editable install)."""
    packaged = Path(__file__).resolve().parent / "configs"
    return str(packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "configs")


def dotted_keys(cfg: DictConfig) -> list[str]:
    """Every leaf key of `cfg` as `group.key` (hydra's own node left out)."""
    keys = []

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                keys.append(f"{prefix}{key}")

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return [key for key in keys if not key.startswith("hydra.")]


@contextmanager
def hydra_errors(known_keys: list[str]) -> Iterator[None]:
    """Turn Hydra's composition errors inside the block into one-line ConfigErrors; an unknown key
    gets the closest of `known_keys` instead of Hydra's advice to add it with `+`."""
    try:
        yield
    except MissingConfigException as error:
        group, _, option = str(error.missing_cfg_file).rpartition("/")
        options = ", ".join(error.options or [])
        raise ConfigError(f"{group}={option}: no such option; choose one of {options}") from None
    except OverrideParseException as error:
        raise ConfigError(str(error).strip().splitlines()[0]) from None
    except ConfigCompositionException as error:
        unknown = re.match(r"Could not override '([^']+)'", str(error))
        if unknown is None:
            raise ConfigError(str(error).strip().splitlines()[0]) from None
        raise ConfigError(unknown_key(unknown[1], known_keys)) from None


def unknown_key(key: str, known_keys: list[str]) -> str:
    """`unknown key 'task.lenght'; did you mean task.length?`"""
    close = difflib.get_close_matches(key, known_keys, n=1, cutoff=0.6)
    return f"unknown key {key!r}" + (f"; did you mean {close[0]}?" if close else "; `--cfg job` lists every key")

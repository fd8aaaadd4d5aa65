"""A model class of the user's own, from their own module: `model._target_: my_models.LSTMSeq2Seq` and a label,
`model.name`, in configs/model/<name>.yaml in a folder on `hydra.searchpath` (docs/models.md). Its keys are that
file's, given to its constructor as they are, after the vocabulary's size; it keeps `models.protocol`. Its runs
are named by its label, a plain name no built-in has.

Torch-free: the module is looked for, not imported, so a missing one is refused at once; the class itself is
checked where the model is built (`models.build.check_buildable`: what its constructor refuses, a ValueError
or TypeError, in one line).
"""

from __future__ import annotations

import importlib.util

from omegaconf import DictConfig

from ..console import ConfigError
from . import FAMILIES, LABEL, LABEL_RULE, Config, Family, builtin_names, cannot_import

NOT_ARGUMENTS = ("_target_", "name")  # what the model node holds besides the class's keys


class OwnFamily(Family):
    """The family of one class of the user's own, named by its import path."""

    def __init__(self, target: str, name: str | None):
        self.target, self.name = target, name or ""

    def own_keys(self, config: Config) -> list[str]:
        """Every key of its model node but `_target_` and `name`, and those only a built-in family reads, left null
        (the schema holds them for the built-in options)."""
        builtin = {key for family in FAMILIES.values() for key in family.own_keys({"model": {"positions": "learned"}})}
        model = config["model"]
        return [key for key in model if key not in NOT_ARGUMENTS and not (key in builtin and model[key] is None)]

    def check(self, config: DictConfig, config_dir: str) -> None:
        """Its module there to import, and its label a plain name that no built-in model, option or
        architecture has."""
        module = self.target.rpartition(".")[0]
        try:
            found = bool(module) and importlib.util.find_spec(module) is not None
            why = f"No module named {module!r}" if module else "not module.Class"
        except (ImportError, ValueError) as error:  # a package on its path is not there, or is no package
            found, why = False, str(error)
        if not found:
            raise ConfigError(cannot_import("model._target_", self.target, why))
        if not LABEL.fullmatch(self.name):
            raise ConfigError(
                f"model.name must be a plain name ({LABEL_RULE}: it labels your model's runs and rows), got "
                f"{self.name!r}"
            )
        if self.name in builtin_names(config_dir):
            raise ConfigError(
                f"model.name={self.name} is the name of one of copytask's own models, options or architectures: give "
                "your model a name of its own"
            )

    def option(self, config: Config) -> str:
        return f"model={self.name}"

    def describe(self, configs: list[DictConfig], values) -> str:
        keys = ", ".join(f"{key} {values(configs, f'model.{key}')}" for key in self.own_keys(configs[0]))
        return f"- {self.name}: `{self.target}`, a model of the user's own" + (f"; {keys}." if keys else ".")

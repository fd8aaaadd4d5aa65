"""Configs: every key's type (the schema Hydra checks), the model group's keys, every check of a
runnable config in one place, the Hydra internals copytask uses, and copytask's channels to the
person running it (refusals, warnings, log lines). Torch-free, so a bad input is refused at once."""

"""Configs: every key's type (the schema Hydra checks), the model group's keys, every check of a
runnable config in one place and the Hydra internals copytask uses. Torch-free, so a bad input is
refused at once."""

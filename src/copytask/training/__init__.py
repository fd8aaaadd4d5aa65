"""One training run: the three disjoint data sets (`splits`), devices and threads (`devices`), the
optimiser (`optimizer`), resumable checkpoints (`checkpoints`), experiment trackers (`trackers`)
and the loop that ties them together (`loop`)."""

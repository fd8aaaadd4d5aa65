"""One training run: devices and threads (`devices`), the optimiser (`optimizer`), resumable
checkpoints (`checkpoints`), experiment trackers (`trackers`) and the loop that ties them together
with the data's three disjoint sets (`loop`)."""

"""What a sequence is: the vocabulary, the task registry (how a target follows from its source,
and which source position each output step copies), batches and masks, and the one scoring rule
of a greedy output. Torch and nothing of copytask's above it."""

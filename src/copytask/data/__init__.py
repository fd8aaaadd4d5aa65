"""What a sequence is: the vocabulary, the task registry (how a target follows from its source,
and which source position each output step copies), batches and masks, the three disjoint sets a
run draws (`splits`) and the one scoring rule of a greedy output. Torch and copytask's `console`
only."""

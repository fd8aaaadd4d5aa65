"""Training speed of the project against the classical reference (`bench.reference`), measured in
one run on one machine, so that the ratio holds even where absolute times drift.

    python -m copytask bench [--quick] [--time-to-target] [--csv PATH] [key=value ...]

The key=value overrides are the training configs' (`train.threads=1`, `train.device=cuda`,
`train.batch_size=128`, ...). Per attention type and length it measures:

- ms per training step (forward, backward, clipping, Adam) and target tokens per second:
  both models share weights and batch; every round times each (attention, implementation)
  once, interleaved, and the median over the rounds after warm-up is reported. The reference
  implements the CLASSICAL attention types and model=transformer (as `transformer`, the
  tutorials' Transformer: `reference.ReferenceTransformer`); every other option of
  configs/attention/ (scaled dot, multi-head, local, Cho et al.'s RNN encoder-decoder, ...) and
  model=mamba (as `mamba`) are the project's only, and `vs_luong_general` compares every type's step
  with Luong general's;
- FLOPs of one step (matrix products only, `FlopCounterMode`, on torch's ops: the project's
  kernels do the same products) and the fraction of this machine's matmul rate (a large
  `torch.mm`) the step reaches;
- at the longest length, peak memory of a short training run in a fresh process;
- with --beams K ..., at the longest length, the time to decode 512 held-out sequences (`--beam-sequences`)
  greedily and by beam search of each width K (the analysis' `breakdown.beam_tokens`), in the same
  run, with each width's time over greedy's (`vs_greedy`), in <csv>_decoding.csv;
- with --time-to-target, wall time and steps to the target greedy token accuracy at the
  longest length for Bahdanau and Luong general, with patience 1, so a run stops at the first
  hit. Each implementation trains with its own usual settings (TARGET_SETTINGS): the project with
  its defaults (Adam, one-cycle schedule peaking at 6e-3, a 1200-step budget), the reference as the
  tutorials train it (Adam at its default 1e-3, constant, up to 6000 steps). Sizes, batch,
  clipping and evaluation are the same. `--target-settings same` trains both with the project's.
"""

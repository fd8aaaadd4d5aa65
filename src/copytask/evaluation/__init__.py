"""Evaluation of finished runs: loading a trained model (`load`), the evidence beyond the heatmap
(`analysis`: counterfactual attention, alignment, length generalisation) and greedy decoding of
any input (`decode`)."""

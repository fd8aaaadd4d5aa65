"""Evaluation of finished runs: loading a trained model (`load`), the evidence beyond the heatmap
(`analysis`: counterfactual attention, alignment, length generalisation) and greedy decoding of
any input (`decode`)."""

# What the analysis replaces attention weights by (`analysis.counterfactual_accuracy`), by the names analysis.json
# gives them. Here, not in analysis.py, so that the report reads them without importing torch.
COUNTERFACTUALS = ("uniform", "permuted", "fixed")

"""Reporting from run folders alone (it never trains): the results table and its summary over
seeds (`tables`), the analysis' tables (`analysis_tables`), figures (the `*_figures` modules plot
with `copytask.figures`), report.md (`report`, with its setup section in `setup_section`) and the
report of a hyperparameter search (`search`)."""

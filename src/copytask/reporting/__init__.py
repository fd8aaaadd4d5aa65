"""Reporting from run folders alone (it never trains): the results table and its summary over
seeds (`tables`), the analysis' tables (`analysis_tables`), figures (`figures` draws, the
`*_figures` modules plot), report.md (`report`, with its setup section in `setup`) and the report
of a hyperparameter search (`search`)."""

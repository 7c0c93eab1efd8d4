"""Reporting: what a run's records say about it (the goodput of `ftslurm report`), and the
prose of the run commands (`notes`). Pure: the CLI reads the state and prints."""

"""Reporting: what a run's records say about it (the goodput of `ftslurm report`)."""

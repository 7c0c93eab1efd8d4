"""Integrations: code written for other tools run by ftslurm as it is (submitit's executor
plugin: `ftslurm.integrations.submitit`)."""

"""ftslurm: Slurm-native fault tolerance for long distributed PyTorch training runs."""

__version__ = "0.1.0"

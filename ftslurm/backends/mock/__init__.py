"""The mock scheduler: a simulated Slurm that runs jobs as local processes.

`MockScheduler` implements the scheduler protocol over a simulated cluster (`model`), whose
state lives in a folder shared by every process that uses it (`store`); jobs run as real
local processes with the environment a Slurm job sees (`procs`, `jobwrap`, `srun`); a
controller process moves time forward (`controller`).
"""

from ftslurm.backends.mock.backend import MockScheduler
from ftslurm.backends.mock.model import MockConfig, MockNodeSpec

__all__ = ["MockConfig", "MockNodeSpec", "MockScheduler"]

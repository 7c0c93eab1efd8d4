"""Pure rendering of the local cluster's configuration files.

Nothing here touches the disk or starts a process: `render_*` take a `ClusterLayout`
and return file contents, so the configuration can be unit-tested and read in one place.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ClusterLayout:
    """Where everything of one local cluster lives, and which ports it uses."""

    root: Path
    hostname: str
    nodes: int = 4
    cpus_per_node: int = 2
    memory_mb: int = 2000
    cluster_name: str = "ftslurmlocal"
    partition: str = "debug"
    base_port: int = 16800
    slurmd_timeout: int = 10
    min_job_age: int = 60  # Slurm's default is 300; shorter keeps the MinJobAge test short
    kill_wait: int = 30
    # Job ids from 20001, where a fresh Slurm starts at 1: apart from the mock's (from a
    # block of 1000 from 100000), so a job id in a log names one job. No
    # rendezvous port depends on it where a run directory exists (the launchers publish
    # the port they bound); ranks of several tasks without the launcher still derive one
    # (`ftslurm.core.contract.rendezvous_port`).
    first_job_id: int = 20001
    db_password: str = "ftslurm-local"
    # Daemons and clients run from another Slurm release's root filesystem (rootfs.py);
    # clients are then wrapper scripts in `bin_dir`, put first on PATH by env.sh.
    chrooted: bool = False

    @property
    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    @property
    def ctld_port(self) -> int:
        return self.base_port + 17

    @property
    def dbd_port(self) -> int:
        return self.base_port + 19

    @property
    def mysql_port(self) -> int:
        return self.base_port + 6

    @property
    def slurmd_ports(self) -> tuple[int, int]:
        first = self.base_port + 101
        return first, first + self.nodes - 1

    # --- paths -------------------------------------------------------------
    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def cgroup_conf(self) -> Path:
        return self.etc / "cgroup.conf"

    @property
    def slurmdbd_conf(self) -> Path:
        return self.etc / "slurmdbd.conf"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket"

    @property
    def munge_key(self) -> Path:
        return self.munge_dir / "munge.key"

    @property
    def mysql_dir(self) -> Path:
        return self.root / "mysql"

    @property
    def mysql_socket(self) -> Path:
        return self.mysql_dir / "mysqld.sock"

    @property
    def bin_dir(self) -> Path:
        """Wrapper scripts for a chrooted release's clients (sbatch, squeue, ...)."""
        return self.root / "bin"

    @property
    def env_file(self) -> Path:
        """A shell snippet (`. env.sh`) that points Slurm's clients at this cluster."""
        return self.root / "env.sh"

    def pid_file(self, daemon: str) -> Path:
        return self.run_dir / f"{daemon}.pid"

    def slurmd_pid_file(self, node: str) -> Path:
        return self.run_dir / f"slurmd-{node}.pid"


def render_slurm_conf(lay: ClusterLayout) -> str:
    first, last = lay.slurmd_ports
    nodes = f"n[1-{lay.nodes}]" if lay.nodes > 1 else "n1"
    ports = f"{first}-{last}" if lay.nodes > 1 else str(first)
    return f"""\
# Written by ftslurm's local cluster harness; regenerated on every `up`.
ClusterName={lay.cluster_name}
SlurmctldHost={lay.hostname}(127.0.0.1)
SlurmctldPort={lay.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={lay.munge_socket}
StateSaveLocation={lay.state_dir}
SlurmdSpoolDir={lay.spool}/%n
SlurmctldPidFile={lay.pid_file("slurmctld")}
SlurmdPidFile={lay.run_dir}/slurmd-%n.pid
SlurmctldLogFile={lay.log_dir}/slurmctld.log
SlurmdLogFile={lay.log_dir}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout={lay.slurmd_timeout}
MinJobAge={lay.min_job_age}
KillWait={lay.kill_wait}
FirstJobId={lay.first_job_id}
JobRequeue=1
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStoreFlags=job_comment
AccountingStorageHost=127.0.0.1
AccountingStoragePort={lay.dbd_port}
# The munge socket to use for slurmdbd connections (Slurm reuses this key for it).
AccountingStoragePass={lay.munge_socket}
JobCompType=jobcomp/none
NodeName={nodes} NodeHostname={lay.hostname} NodeAddr=127.0.0.1 Port={ports} CPUs={lay.cpus_per_node} RealMemory={lay.memory_mb} State=UNKNOWN
PartitionName={lay.partition} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP
"""


def render_slurmdbd_conf(lay: ClusterLayout) -> str:
    return f"""\
# Written by ftslurm's local cluster harness.
AuthType=auth/munge
AuthInfo=socket={lay.munge_socket}
DbdHost={lay.hostname}
DbdAddr=127.0.0.1
DbdPort={lay.dbd_port}
SlurmUser=root
PidFile={lay.pid_file("slurmdbd")}
LogFile={lay.log_dir}/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={lay.mysql_port}
StorageUser=slurm
StoragePass={lay.db_password}
StorageLoc=slurm_acct_db
"""


def render_cgroup_conf(lay: ClusterLayout) -> str:
    """Slurm 24.11's slurmd initialises its cgroup plugin even with proctrack/linuxproc and
    task/none, and stops when /sys/fs/cgroup is not there (as in its chroot): the local
    cluster tracks processes itself, so the plugin is switched off. 22.05 reads no such file."""
    return "# Written by ftslurm's local cluster harness.\nCgroupPlugin=disabled\n"


def render_env_sh(lay: ClusterLayout) -> str:
    """`export` lines for a shell: SLURM_CONF, and for a chrooted release the wrapper
    folder first on PATH (the host's own clients are another release)."""
    text = f"export SLURM_CONF={shlex.quote(str(lay.slurm_conf))}\n"
    if lay.chrooted:
        text += f'export PATH={shlex.quote(str(lay.bin_dir))}:"$PATH"\n'
    return text

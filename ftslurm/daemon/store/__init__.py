"""The daemon's durable state: one SQLite database (WAL) in the state directory.

Its parts, each described in its own module:
    schema.py      the tables, their migrations, the column lists and the row <-> record
                   converters
    connection.py  the connection (WAL, or a rollback journal on a network filesystem), the
                   schema version, transactions, and the one-line errors of sqlite's
    runs.py        runs, attempts and events; compare-and-set writes, one writer of run state
    requests.py    what commands ask the daemon to do, and the node flags
    lock.py        one daemon per state directory: the per-host file lock, the lease row
    guard.py       against lost state: the mark of committed events, the run mirrors, the
                   integrity check and the backup
    db.py          `Store`: the database of one state directory, made of the parts above
    recover.py     putting the backup back and rebuilding lost runs (`ftslurm daemon recover`)

The rest of ftslurm imports what it uses from here (`from ftslurm.daemon.store import Store`).
"""

from ftslurm.daemon.store.connection import (
    BUSY_TIMEOUT_S,
    DB_NAME,
    DB_SUFFIXES,
    RECOVER_HINT,
    DiskFull,
    StaleRecord,
    StateDamaged,
    StateError,
    os_state_error,
    sqlite_errors,
    state_error,
)
from ftslurm.daemon.store.db import Store
from ftslurm.daemon.store.guard import (
    BACKUP_NAME,
    MARK_NAME,
    RUN_MIRROR,
    RUNS_DIR,
    mark_backend,
    marked_backends,
    mirror_run,
    mirrored_runs,
    read_mark,
    update_mirror,
    write_mark,
)
from ftslurm.daemon.store.lock import (
    LOCK_NAME,
    DaemonAlreadyRunning,
    DaemonLock,
    lock_name,
    this_host,
)
from ftslurm.daemon.store.recover import (
    DAMAGED_PREFIX,
    LOST_RUN,
    Restored,
    rebuild_runs,
    recover_state,
    restore_backup,
)
from ftslurm.daemon.store.requests import Request
from ftslurm.daemon.store.schema import MIGRATIONS, SCHEMA_VERSION

__all__ = [
    "BACKUP_NAME",
    "BUSY_TIMEOUT_S",
    "DAMAGED_PREFIX",
    "DB_NAME",
    "DB_SUFFIXES",
    "LOCK_NAME",
    "LOST_RUN",
    "MARK_NAME",
    "MIGRATIONS",
    "RECOVER_HINT",
    "RUNS_DIR",
    "RUN_MIRROR",
    "SCHEMA_VERSION",
    "DaemonAlreadyRunning",
    "DaemonLock",
    "DiskFull",
    "Request",
    "Restored",
    "StaleRecord",
    "StateDamaged",
    "StateError",
    "Store",
    "lock_name",
    "mark_backend",
    "marked_backends",
    "mirror_run",
    "mirrored_runs",
    "os_state_error",
    "read_mark",
    "rebuild_runs",
    "recover_state",
    "restore_backup",
    "sqlite_errors",
    "state_error",
    "this_host",
    "update_mirror",
    "write_mark",
]

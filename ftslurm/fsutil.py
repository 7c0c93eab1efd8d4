"""Small filesystem helpers for writes that matter: atomic JSON, private directories."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftslurm.core.contract import SHARING_MODES, JobEnv
from ftslurm.errors import ConfigError


def fsync_dir(path: Path | str) -> None:
    """Make a rename or creation in folder `path` durable (best effort: not every
    filesystem lets a folder be fsynced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path | str, data: bytes, mode: int = 0o644) -> None:
    """Write `data` so that readers see the old file or the new one, never a torn one: a
    temporary file in the same folder, fsync, rename, then fsync of the folder."""
    path = Path(path)
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        replace_durably(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def temp_path(path: Path | str) -> Path:
    """The temporary name `path` is written under before `replace_durably` (same folder)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def replace_durably(tmp: Path | str, path: Path | str) -> None:
    """Make the finished file `tmp` durable, rename it to `path`, fsync the folder: readers
    see the old file or the new one, never a torn one."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)


def write_json_atomic(path: Path | str, data: Any, mode: int = 0o644) -> None:
    """`data` as JSON, written atomically (`write_bytes_atomic`)."""
    write_bytes_atomic(path, json.dumps(data).encode(), mode)


def read_json(path: Path | str) -> Any:
    """The parsed file, or None when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def private_dir(path: Path | str) -> Path:
    """Create `path` (and missing parents) as a folder only its owner can use (0700) and
    return it. A folder that already exists keeps its mode (ftslurm never changes the mode
    of a folder it did not create), but one other users can write to is refused: state
    kept there could be changed or removed by them. `ConfigError` (one line) when it
    cannot be used: a file is in the way, a parent is a file, no permission."""
    path = Path(path)
    try:
        make_dirs(path, 0o700)
        if writable_by_others(path):
            raise ConfigError(
                f"{path} can be written by other users (mode {stat.filemode(path.stat().st_mode)})"
                ": ftslurm keeps runs only in a folder of your own",
                hint="point it at a folder only you can write, e.g. a new subfolder",
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(path))
    except OSError as exc:
        raise folder_error(path, exc) from None
    return path


def writable_by_others(path: Path | str) -> bool:
    """Whether users other than the owner may create or remove files in folder `path`."""
    return bool(Path(path).stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def make_dirs(path: Path | str, mode: int) -> Path:
    """`mkdir -p` whose created folders get `mode` (less the umask), the last one exactly
    `mode`; folders that exist already are left as they are."""
    target = path = Path(path)
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=mode)
        except FileExistsError:  # made by someone else meanwhile: theirs, left alone
            if not folder.is_dir():
                raise
            continue
        os.chmod(folder, mode)  # the umask may have taken bits `mode` asks for
    return target


def restrict(folder: Path | str, dir_mode: int, file_mode: int) -> None:
    """Give `folder` (which this process created) and everything in it these modes."""
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, dir_mode)
        for name in files:
            os.chmod(os.path.join(root, name), file_mode)


def sharing_modes(sharing: str | None = None) -> tuple[int, int]:
    """(folder mode, file mode) for checkpoints: `sharing` if given, else the job's
    setting ($FTSLURM_CHECKPOINT_SHARING, default private)."""
    if sharing is None:
        sharing = JobEnv.from_environ(os.environ).checkpoint_sharing
    if sharing not in SHARING_MODES:
        raise ConfigError(
            f"checkpoint sharing {sharing!r}: must be one of {', '.join(SHARING_MODES)}"
        )
    return SHARING_MODES[sharing]


def folder_error(path: Path | str, exc: OSError) -> ConfigError:
    """The one-line error for a folder `path` that cannot be created or written."""
    path = Path(path)
    if isinstance(exc, FileExistsError) or (path.exists() and not path.is_dir()):
        return ConfigError(f"{path} is not a folder (a file of that name is in the way)")
    if isinstance(exc, NotADirectoryError):
        return ConfigError(f"cannot create folder {path}: a part of that path is a file")
    if isinstance(exc, PermissionError):
        return ConfigError(f"cannot write to folder {path}: permission denied")
    return ConfigError(f"cannot use folder {path}: {exc.strerror or exc}")


def memory_base(environ: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """Where the memory checkpoint tier keeps its node areas (`ftslurm.memory_checkpoint`):
    $FTSLURM_MEMORY_DIR, else /dev/shm/ftslurm-<uid> (the temporary folder without
    /dev/shm); `uid` is the process owner's (default: this process's)."""
    configured = JobEnv.from_environ(os.environ if environ is None else environ).memory_dir
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    owner = os.getuid() if uid is None else uid
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"ftslurm-{owner}"


def forget_node_memory(base: Path, node: str) -> None:
    """Remove every run's memory tier area of `node` under `base` (a lost node's memory)."""
    for area in base.glob(f"*/{node}"):
        shutil.rmtree(area, ignore_errors=True)


# Filesystems whose files other hosts share (statfs f_type, from linux/magic.h and the
# vendors' headers): SQLite's WAL needs shared memory between its users, which such a
# filesystem cannot give across hosts. FUSE counts as one: it often is (sshfs, s3fs, ...).
NETWORK_FILESYSTEMS = {
    0x6969: "NFS",
    0xFF534D42: "CIFS",
    0xFE534D42: "SMB2",
    0x517B: "SMB",
    0x0BD00BD0: "Lustre",
    0x47504653: "GPFS",
    0x19830326: "BeeGFS",
    0x00C36400: "CephFS",
    0x5346414F: "AFS",
    0xAAD7AAEA: "PanFS",
    0x01021997: "9P",
    0x65735546: "FUSE",
}


def filesystem_type(path: Path | str) -> int | None:
    """statfs(2)'s f_type of the filesystem holding `path` (its nearest existing parent),
    or None where it cannot be asked (not Linux, no libc)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
        if libc.statfs(os.fsencode(path), buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF  # f_type comes first


def network_filesystem(path: Path | str) -> str | None:
    """The name of the network filesystem holding `path` (NFS, Lustre, GPFS, ...), or None
    for a local one (or one that cannot be told)."""
    kind = filesystem_type(path)
    return None if kind is None else NETWORK_FILESYSTEMS.get(kind)


STATE_FS_ENV = "FTSLURM_STATE_FS"  # "network" or "local" overrides what statfs says


def shared_between_hosts(path: Path | str) -> bool:
    """Whether files under `path` must be treated as shared between hosts: what
    `FTSLURM_STATE_FS` says ("network" or "local"; "auto" or unset: ask statfs)."""
    forced = os.environ.get(STATE_FS_ENV, "").strip().lower()
    if forced in ("network", "local"):
        return forced == "network"
    if forced not in ("", "auto"):
        raise ConfigError(f"{STATE_FS_ENV}={forced!r}: must be 'network', 'local' or 'auto'")
    return network_filesystem(path) is not None


def sqlite_journal_mode(shared: bool) -> str:
    """SQLite's journal mode for a database on a filesystem shared between hosts or not:
    WAL keeps its index in memory mapped by every user (the `-shm` file), which two hosts
    cannot share; a rollback journal needs only POSIX locks, which network filesystems
    give across hosts (docs/daemon.md, "Deploying at a site")."""
    return "delete" if shared else "wal"

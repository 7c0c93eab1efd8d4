"""Small filesystem helpers for writes that matter: atomic JSON, private directories."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftslurm.core.contract import JobEnv
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
    """Create `path` (and parents) and make it 0700; `ConfigError` (one line) when it cannot
    be: a file is in the way, a parent is a file, no permission."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(path))
    except OSError as exc:
        raise folder_error(path, exc) from None
    return path


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


def memory_base(environ: Mapping[str, str] | None = None) -> Path:
    """Where the memory checkpoint tier keeps its node areas (`ftslurm.memory_checkpoint`):
    $FTSLURM_MEMORY_DIR, else /dev/shm/ftslurm-<uid> (the temporary folder without
    /dev/shm)."""
    configured = JobEnv.from_environ(os.environ if environ is None else environ).memory_dir
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"ftslurm-{os.getuid()}"


def forget_node_memory(base: Path, node: str) -> None:
    """Remove every run's memory tier area of `node` under `base` (a lost node's memory)."""
    for area in base.glob(f"*/{node}"):
        shutil.rmtree(area, ignore_errors=True)

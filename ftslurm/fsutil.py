"""Small filesystem helpers for writes that matter: atomic JSON, private directories."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


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
    """Create `path` (and parents) and make it 0700."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path

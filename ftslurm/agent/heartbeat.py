"""Heartbeats between a rank and the launcher that watches it: one small shared-memory
record per rank, written by the rank at a cost of about a microsecond, read by the
launcher from outside the rank's process (so a rank stuck holding the GIL is still seen).

Layout of `<dir>/rank-<local_rank>.hb` (little-endian, 64 bytes):
    0  f64  last heartbeat (CLOCK_MONOTONIC seconds; 0 = none yet)
    8  f64  start of the open section (0 = no section open)
   16  i64  id of the open section (-1 = none); names in `<dir>/sections.json`
   24  i64  current step (-1 = unknown)
   32  f64  when the rank attached (monotonic)
   40  i64  pid of the rank
Every field is one aligned 8-byte store, so a reader never sees a torn value; readers
may see a heartbeat and a section change in either order, which the timeouts tolerate.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from ftslurm.fsutil import read_json, write_json_atomic

SIZE = 64
_F64, _I64 = struct.Struct("<d"), struct.Struct("<q")
# Well-known sections have fixed ids; others are numbered from 16 in order of first use.
KNOWN_SECTIONS = {"setup": 0, "step": 1, "checkpointing": 2, "compute": 3}


def record_path(directory: Path | str, local_rank: int) -> Path:
    return Path(directory) / f"rank-{local_rank}.hb"


class HeartbeatWriter:
    """The rank's side. Cheap: every call is a couple of 8-byte stores into shared memory."""

    def __init__(self, directory: Path | str, local_rank: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = record_path(directory, local_rank)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._ids = dict(KNOWN_SECTIONS)
        _F64.pack_into(self._mm, 0, 0.0)
        _F64.pack_into(self._mm, 8, 0.0)
        _I64.pack_into(self._mm, 16, -1)
        _I64.pack_into(self._mm, 24, -1)
        _F64.pack_into(self._mm, 32, time.monotonic())
        _I64.pack_into(self._mm, 40, os.getpid())

    def beat(self, step: int | None = None) -> None:
        if step is not None:
            _I64.pack_into(self._mm, 24, step)
        _F64.pack_into(self._mm, 0, time.monotonic())

    def open_section(self, name: str, since: float | None = None) -> None:
        """Enter section `name` (opened at `since`, monotonic; default now: an outer
        section resumed after a nested one keeps its own start)."""
        section = self._ids.get(name)
        if section is None:
            section = self._register(name)
        now = time.monotonic()
        _I64.pack_into(self._mm, 16, section)
        _F64.pack_into(self._mm, 8, now if since is None else since)
        _F64.pack_into(self._mm, 0, now)

    def close_section(self) -> None:
        now = time.monotonic()
        _F64.pack_into(self._mm, 8, 0.0)
        _I64.pack_into(self._mm, 16, -1)
        _F64.pack_into(self._mm, 0, now)

    def _register(self, name: str) -> int:
        path = self.directory / "sections.json"
        names = read_json(path) or {}
        if name not in names:
            names[name] = 16 + len(names)
            write_json_atomic(path, names)
        self._ids[name] = int(names[name])
        return self._ids[name]

    def close(self) -> None:
        self._mm.close()


@dataclass(frozen=True)
class Beat:
    last_beat: float | None
    section: str | None
    section_start: float | None
    step: int | None
    attached_at: float
    pid: int


def read_beat(directory: Path | str, local_rank: int) -> Beat | None:
    """The rank's record as it is now, or None if the rank has not attached yet."""
    try:
        with open(record_path(directory, local_rank), "rb") as f:
            data = f.read(SIZE)
    except FileNotFoundError:
        return None
    if len(data) < SIZE:
        return None
    last, start = _F64.unpack_from(data, 0)[0], _F64.unpack_from(data, 8)[0]
    section_id, step = _I64.unpack_from(data, 16)[0], _I64.unpack_from(data, 24)[0]
    names = {v: k for k, v in KNOWN_SECTIONS.items()}
    if section_id >= 16:
        custom = read_json(Path(directory) / "sections.json") or {}
        names.update({v: k for k, v in custom.items()})
    return Beat(
        last_beat=last or None,
        section=names.get(section_id) if section_id >= 0 else None,
        section_start=start or None if section_id >= 0 else None,
        step=step if step >= 0 else None,
        attached_at=_F64.unpack_from(data, 32)[0],
        pid=_I64.unpack_from(data, 40)[0],
    )  # fmt: skip


@dataclass(frozen=True)
class Timeouts:
    """Seconds a section may stay open, and the longest gap between heartbeats while no
    section is open. None means infinite. `initial` bounds the time from a rank's start
    to its first heartbeat or section."""

    sections: dict[str, float | None]
    out_of_section: float | None = None
    initial: float | None = None


def hang_reason(beat: Beat, timeouts: Timeouts, now: float) -> str | None:
    """Why this rank counts as hung at `now`, or None (pure)."""
    if beat.section is not None and beat.section_start is not None:
        limit = timeouts.sections.get(beat.section)
        if limit is not None and now - beat.section_start > limit:
            return (f"section {beat.section!r} open for {now - beat.section_start:.1f}s "
                    f"(timeout {limit:g}s)")  # fmt: skip
        return None
    if beat.last_beat is None:
        if timeouts.initial is not None and now - beat.attached_at > timeouts.initial:
            return f"no heartbeat {now - beat.attached_at:.1f}s after start " \
                   f"(timeout {timeouts.initial:g}s)"
        return None
    if timeouts.out_of_section is not None and now - beat.last_beat > timeouts.out_of_section:
        return (f"no heartbeat for {now - beat.last_beat:.1f}s outside any section "
                f"(timeout {timeouts.out_of_section:g}s)")  # fmt: skip
    return None

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
from dataclasses import dataclass, replace
from pathlib import Path

from ftslurm.core.contract import HeartbeatDir
from ftslurm.core.settings import RECOVERY_SECTION
from ftslurm.fsutil import read_json, write_json_atomic

SIZE = 64
_F64, _I64 = struct.Struct("<d"), struct.Struct("<q")
# Well-known sections have fixed ids; others are numbered from 16 in order of first use.
KNOWN_SECTIONS = {"setup": 0, "step": 1, "checkpointing": 2, "compute": 3, RECOVERY_SECTION: 4}

# Hang detection defaults (DEFAULT_*) live with the run's settings (ftslurm.core.settings).
# After DEFAULT_WARMUP_STEPS steps of a round the running limit is tightened to
# SAFETY_FACTOR x the longest step seen, never below FLOOR_S (`learned`); the same factor
# and floor tighten limits across attempts.
SAFETY_FACTOR = 3.0
FLOOR_S = 30.0


# The record's word at offset 48: 0 (a record written before this word existed reads 0 too)
# for a rank that sends heartbeats, CPU_WATCHED for one that only attaches.
CPU_WATCHED = 1


def record_path(directory: Path | str, local_rank: int) -> Path:
    return HeartbeatDir(directory).record(local_rank)


class HeartbeatWriter:
    """The rank's side. Cheap: every call is a couple of 8-byte stores into shared memory."""

    def __init__(self, directory: Path | str, local_rank: int, beats: bool = True) -> None:
        """`beats=False`: the rank attaches (its signal handlers are in place) but sends no
        heartbeats; the launcher then judges it by its CPU time, as a rank without a record."""
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
        self._beats = beats
        _I64.pack_into(self._mm, 48, 0 if beats else CPU_WATCHED)

    def _alive(self) -> None:
        """A first sign of life from a rank that attached without heartbeats: from now on
        the launcher judges it by them."""
        self._beats = True
        _I64.pack_into(self._mm, 48, 0)

    def beat(self, step: int | None = None) -> None:
        if not self._beats:
            self._alive()
        if step is not None:
            _I64.pack_into(self._mm, 24, step)
        _F64.pack_into(self._mm, 0, time.monotonic())

    def open_section(self, name: str, since: float | None = None) -> None:
        """Enter section `name` (opened at `since`, monotonic; default now: an outer
        section resumed after a nested one keeps its own start)."""
        if not self._beats:
            self._alive()
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
        path = HeartbeatDir(self.directory).sections
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
    beats: bool = True  # False: the rank sends no heartbeats; judge it by its CPU time


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
        custom = read_json(HeartbeatDir(directory).sections) or {}
        names.update({v: k for k, v in custom.items()})
    return Beat(
        last_beat=last or None,
        section=names.get(section_id) if section_id >= 0 else None,
        section_start=start or None if section_id >= 0 else None,
        step=step if step >= 0 else None,
        attached_at=_F64.unpack_from(data, 32)[0],
        pid=_I64.unpack_from(data, 40)[0],
        beats=_I64.unpack_from(data, 48)[0] != CPU_WATCHED,
    )


@dataclass(frozen=True)
class Timeouts:
    """Seconds a section with its own limit may stay open (`sections`), and the running
    timeout `out_of_section`: the longest time without a sign of life (a heartbeat, a
    section entered or left) while no section with its own limit is open. None means
    infinite. `initial` bounds the time from a rank's start to its first heartbeat or
    section; `warmup_steps` is how many steps of a round pass before the running timeout
    is learned from the pace (`learned`; None: not learned)."""

    sections: dict[str, float | None]
    out_of_section: float | None = None
    initial: float | None = None
    warmup_steps: int | None = None


def _own_limit(beat: Beat, timeouts: Timeouts) -> bool:
    return beat.section is not None and beat.section in timeouts.sections


def silence(beat: Beat, timeouts: Timeouts, now: float) -> float:
    """How long the rank has shown no sign of life the rules below look at (pure)."""
    if _own_limit(beat, timeouts) and beat.section_start is not None:
        return now - beat.section_start
    return now - (beat.last_beat if beat.last_beat is not None else beat.attached_at)


def hang_reason(beat: Beat, timeouts: Timeouts, now: float) -> str | None:
    """Why this rank counts as hung at `now`, or None (pure)."""
    if _own_limit(beat, timeouts) and beat.section_start is not None:
        limit = timeouts.sections[beat.section]  # type: ignore[index]
        if limit is not None and now - beat.section_start > limit:
            return (
                f"section {beat.section!r} open for {now - beat.section_start:.1f}s "
                f"(timeout {limit:g}s)"
            )
        return None
    if beat.last_beat is None:
        if timeouts.initial is not None and now - beat.attached_at > timeouts.initial:
            return (
                f"no heartbeat {now - beat.attached_at:.1f}s after start "
                f"(timeout {timeouts.initial:g}s)"
            )
        return None
    limit = timeouts.out_of_section
    if limit is not None and now - beat.last_beat > limit:
        where = f"in section {beat.section!r}" if beat.section else "outside any section"
        return f"no sign of life for {now - beat.last_beat:.1f}s {where} (timeout {limit:g}s)"
    return None


@dataclass(frozen=True)
class Pace:
    """What the launcher saw of one rank's steps in the current round (a value)."""

    step: int | None = None  # the last step seen
    at: float | None = None  # its heartbeat time
    steps: int = 0  # steps seen completed in this round
    longest: float | None = None  # the longest time per step after the warm-up
    own_section: bool = False  # the current step passed through a section with its own limit


def observe_pace(pace: Pace, beat: Beat, timeouts: Timeouts) -> Pace:
    """`pace` updated with a new look at the rank's record (pure). A step counts once
    `timeouts.warmup_steps` steps of the round are done, unless it passed through a section
    with its own limit (a checkpoint: that one has its own timeout)."""
    own = _own_limit(beat, timeouts)
    if beat.step is None or beat.last_beat is None:
        return pace
    if pace.step is None or pace.at is None or beat.step < pace.step:
        return Pace(beat.step, beat.last_beat, own_section=own)
    if beat.step == pace.step:
        return replace(pace, own_section=True) if own and not pace.own_section else pace
    advanced = beat.step - pace.step
    longest = pace.longest
    warm = timeouts.warmup_steps is not None and pace.steps >= timeouts.warmup_steps
    if warm and not (pace.own_section or own):
        longest = max(longest or 0.0, (beat.last_beat - pace.at) / advanced)
    return Pace(beat.step, beat.last_beat, pace.steps + advanced, longest, own)


def learned(
    timeouts: Timeouts, pace: Pace, factor: float = SAFETY_FACTOR, floor_s: float = FLOOR_S
) -> Timeouts:
    """The running timeout tightened by the pace seen after the warm-up (pure): `factor` x
    the longest step, at least `floor_s`, never looser than configured; off stays off."""
    if pace.longest is None or timeouts.out_of_section is None:
        return timeouts
    limit = min(timeouts.out_of_section, max(floor_s, factor * pace.longest))
    return replace(timeouts, out_of_section=limit)


@dataclass(frozen=True)
class CpuWatch:
    """A rank without a heartbeat record, watched by its CPU time (a value)."""

    cpu: float  # CPU seconds of the rank's processes at the reference sample
    at: float  # when that sample was taken
    busy_at: float  # the last time it was seen using CPU


IDLE_CPU_SHARE = 0.01  # less CPU than this share of the wall time counts as idle


def watch_cpu(watch: CpuWatch | None, cpu: float, now: float, window: float) -> CpuWatch:
    """`watch` updated with a CPU sample (pure): every `window` seconds, busy if the rank
    used more than IDLE_CPU_SHARE of the wall time since the last reference sample."""
    if watch is None:
        return CpuWatch(cpu, now, now)
    if now - watch.at < window:
        return watch
    busy = cpu - watch.cpu > IDLE_CPU_SHARE * (now - watch.at)
    return CpuWatch(cpu, now, now if busy else watch.busy_at)


def idle_reason(watch: CpuWatch | None, limit: float | None, now: float) -> str | None:
    """Why a rank that never wrote heartbeats counts as hung: no CPU use for `limit`."""
    if watch is None or limit is None or now - watch.busy_at <= limit:
        return None
    return f"no CPU use for {now - watch.busy_at:.1f}s and no heartbeats (timeout {limit:g}s)"

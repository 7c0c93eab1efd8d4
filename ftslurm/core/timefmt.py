"""Slurm's time-limit syntax, parsed and formatted, and durations in words (pure)."""

from __future__ import annotations

import re

from ftslurm.errors import ConfigError

UNLIMITED_WORDS = frozenset({"UNLIMITED", "INFINITE", "NONE", "N/A", "PARTITION_LIMIT"})

_FORMS = [
    # (regex, field names) in the forms `sbatch --time` accepts.
    (re.compile(r"^(\d+)$"), ("m",)),
    (re.compile(r"^(\d+):(\d+)$"), ("m", "s")),
    (re.compile(r"^(\d+):(\d+):(\d+)$"), ("h", "m", "s")),
    (re.compile(r"^(\d+)-(\d+)$"), ("d", "h")),
    (re.compile(r"^(\d+)-(\d+):(\d+)$"), ("d", "h", "m")),
    (re.compile(r"^(\d+)-(\d+):(\d+):(\d+)$"), ("d", "h", "m", "s")),
]
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_time_limit(text: str) -> int | None:
    """Seconds in a Slurm time limit ("90", "1:30:00", "2-12", ...); None for no limit
    (UNLIMITED, infinite, and zero, which sbatch reads as "no time limit").

    Raises ConfigError with a one-line message for anything `sbatch --time` would reject.
    """
    value = text.strip()
    if value.upper() in UNLIMITED_WORDS:
        return None
    for pattern, names in _FORMS:
        match = pattern.match(value)
        if match:
            seconds = sum(int(v) * _SECONDS[n] for v, n in zip(match.groups(), names, strict=True))
            return seconds or None
    raise ConfigError(
        f"malformed time limit {text!r}",
        hint="use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED",
    )


def format_time_limit(seconds: int | None) -> str:
    """The inverse of parse_time_limit, rounded up to whole minutes for sbatch."""
    if seconds is None:
        return "UNLIMITED"
    minutes = -(-seconds // 60)
    days, rest = divmod(minutes, 1440)
    hours, mins = divmod(rest, 60)
    return f"{days}-{hours:02d}:{mins:02d}:00" if days else f"{hours:02d}:{mins:02d}:00"


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m05s', 65 -> '1m05s', 4.25 -> '4.2s', 90061 -> '1d01h01m'."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours:02d}h{minutes:02d}m"
    return f"{hours}h{minutes:02d}m{s:02d}s" if hours else f"{minutes}m{s:02d}s"

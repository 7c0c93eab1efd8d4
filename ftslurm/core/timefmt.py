"""Slurm's time-limit syntax, parsed and formatted, and durations in words (pure)."""

from __future__ import annotations

import re

from ftslurm.errors import ConfigError

UNLIMITED_WORDS = frozenset({"UNLIMITED", "INFINITE", "NONE", "N/A", "PARTITION_LIMIT"})

_FORMS = [
    # (regex, field names) in the forms `sbatch --time` accepts. ASCII digits only (`\d`
    # would take any script's digits, which Slurm does not).
    (re.compile(r"^([0-9]+)$"), ("m",)),
    (re.compile(r"^([0-9]+):([0-9]+)$"), ("m", "s")),
    (re.compile(r"^([0-9]+):([0-9]+):([0-9]+)$"), ("h", "m", "s")),
    (re.compile(r"^([0-9]+)-([0-9]+)$"), ("d", "h")),
    (re.compile(r"^([0-9]+)-([0-9]+):([0-9]+)$"), ("d", "h", "m")),
    (re.compile(r"^([0-9]+)-([0-9]+):([0-9]+):([0-9]+)$"), ("d", "h", "m", "s")),
]
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
# A field after the first one is below its unit's count in the next one up: `1-99` (a typo
# for 1-09? 19?) is refused, not read as 5 days 3 hours.
_RANGE = {"h": 24, "m": 60, "s": 60}
_WORDS = {"d": "days", "h": "hours", "m": "minutes", "s": "seconds"}
# Slurm reads a time limit into a signed 32-bit count of seconds (`time_str2secs`) and keeps
# it in minutes: anything longer overflows there. At most 24855 days (about 68 years).
MAX_TIME_LIMIT_S = 2**31 - 1
_MAX_DIGITS = 12  # longer fields are over the maximum anyway (and no huge int is parsed)


def parse_time_limit(text: str) -> int | None:
    """Seconds in a Slurm time limit ("90", "1:30:00", "2-12", ...); None for no limit
    (UNLIMITED, infinite, and zero, which sbatch reads as "no time limit").

    Raises ConfigError with a one-line message for anything `sbatch --time` would reject or
    read wrongly: another form, a field after the first out of its range (`1-99`, `1:75:00`),
    a limit longer than Slurm's 32-bit seconds hold (`MAX_TIME_LIMIT_S`).
    """
    value = text.strip()
    if value.upper() in UNLIMITED_WORDS:
        return None
    for pattern, names in _FORMS:
        match = pattern.match(value)
        if match:
            fields = list(zip(match.groups(), names, strict=True))
            if any(len(v.lstrip("0")) > _MAX_DIGITS for v, _ in fields):
                raise _too_long(text)
            for v, n in fields[1:]:
                if int(v) >= _RANGE[n]:
                    raise ConfigError(
                        f"time limit {text!r}: {int(v)} {_WORDS[n]} is out of range "
                        f"(0-{_RANGE[n] - 1} after {_WORDS[fields[0][1]]})",
                        hint="D-HH:MM:SS, e.g. 1-12:00:00 for a day and a half",
                    )
            seconds = sum(int(v) * _SECONDS[n] for v, n in fields)
            if seconds > MAX_TIME_LIMIT_S:
                raise _too_long(text)
            return seconds or None
    raise ConfigError(
        f"malformed time limit {text!r}",
        hint="use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED",
    )


def _too_long(text: str) -> ConfigError:
    shown = text if len(text) <= 40 else text[:37] + "..."
    return ConfigError(
        f"time limit {shown!r} is longer than Slurm takes (at most "
        f"{MAX_TIME_LIMIT_S // 86400} days)",
        hint="or UNLIMITED for no limit",
    )


def format_time_limit(seconds: int | None) -> str:
    """The inverse of parse_time_limit, rounded up to whole minutes for sbatch."""
    if seconds is None:
        return "UNLIMITED"
    minutes = -(-seconds // 60)
    days, rest = divmod(minutes, 1440)
    hours, mins = divmod(rest, 60)
    return f"{days}-{hours:02d}:{mins:02d}:00" if days else f"{hours:02d}:{mins:02d}:00"


def format_limit_exact(seconds: int) -> str:
    """`seconds` as Slurm's D-HH:MM:SS to the second, each field in range (what
    `parse_time_limit` reads back as the same number of seconds)."""
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    return f"{days}-{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"


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

"""Pure parsers for the Slurm CLI's answers (squeue, sacct, scontrol, sinfo, sbatch).

They take text and return ftslurm types, so they are tested on recorded output. Times are
read as epoch seconds: the backend runs every command with SLURM_TIME_FORMAT=%s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import hostlist

from ftslurm.core.timefmt import parse_time_limit
from ftslurm.core.types import ClusterFacts, JobInfo, JobState, NodeInfo, NodeState
from ftslurm.errors import ConfigError, SchedulerRejected

SEP = "\x1f"  # ASCII unit separator: cannot appear in job names or comments

# squeue -O fields, in order. Name and Comment are free text: the separator protects them.
SQUEUE_FIELDS = (
    "JobID",
    "State",
    "RestartCnt",
    "exit_code",
    "NodeList",
    "Reason",
    "SubmitTime",
    "StartTime",
    "EndTime",
    "TimeLimit",
    "Name",
    "Comment",
)
SQUEUE_FORMAT = ",".join(f"{f}:{SEP}" for f in SQUEUE_FIELDS)

SACCT_FIELDS = (
    "JobIDRaw",
    "State",
    "ExitCode",
    "NodeList",
    "Submit",
    "Start",
    "End",
    "TimelimitRaw",
    "Reason",
    "JobName",
)
SACCT_FORMAT = ",".join(SACCT_FIELDS)
# For finding a job by its comment in accounting (stored with AccountingStoreFlags=job_comment):
# two free-text fields, so the unit separator delimits them (sacct -P --delimiter=SEP).
SACCT_FIND_FIELDS = (*SACCT_FIELDS, "Comment")
SACCT_FIND_FORMAT = ",".join(SACCT_FIND_FIELDS)

_NULLS = frozenset({"", "(null)", "none", "n/a", "unknown", "none assigned"})


def _text(value: str) -> str | None:
    value = value.strip()
    return None if value.lower() in _NULLS else value


def _epoch(value: str) -> float | None:
    value = value.strip()
    if value.isdigit() and int(value) > 0:
        return float(value)
    return None


def expand_nodes(value: str) -> tuple[str, ...]:
    """`n[1-3],m7` -> ("n1", "n2", "n3", "m7"); empty for "(null)", "None assigned", ""."""
    text = _text(value)
    if text is None:
        return ()
    try:
        return tuple(hostlist.expand_hostlist(text))
    except hostlist.BadHostlist:
        return (text,)


def compress_nodes(nodes: Iterable[str]) -> str:
    return hostlist.collect_hostlist(list(nodes))


def decode_wait_status(raw: str) -> tuple[int | None, int | None]:
    """squeue's exit_code is a wait(2) status: 768 -> exit 3, 9 -> killed by signal 9."""
    raw = raw.strip()
    if not raw.lstrip("-").isdigit():
        return None, None
    status = int(raw)
    if status < 0:
        return None, None
    sig = status & 0x7F
    return (status >> 8) & 0xFF, sig or None


def decode_exit_pair(raw: str) -> tuple[int | None, int | None]:
    """sacct / scontrol `ExitCode` is "exit:signal", e.g. "3:0" or "0:9"."""
    code, _, sig = raw.strip().partition(":")
    if not code.isdigit():
        return None, None
    return int(code), (int(sig) if sig.isdigit() and int(sig) else None)


def decode_squeue_exit(raw: str) -> tuple[int | None, int | None]:
    """squeue's `exit_code`: Slurm 22.05 prints the wait(2) status ("768"), 24.11 the
    "exit:signal" pair ("3:0") as sacct and scontrol do; both are read."""
    return decode_exit_pair(raw) if ":" in raw else decode_wait_status(raw)


def _time_limit(value: str) -> int | None:
    text = value.strip()
    if text.isdigit():  # sacct TimelimitRaw is minutes
        return int(text) * 60
    try:
        return parse_time_limit(text)
    except ConfigError:
        return None


def parse_squeue(text: str, observed_at: float) -> dict[str, JobInfo]:
    """Parse `squeue -h -O SQUEUE_FORMAT` output."""
    jobs: dict[str, JobInfo] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = line.split(SEP)
        if len(cells) < len(SQUEUE_FIELDS):
            raise SchedulerRejected(f"unexpected squeue line: {line[:120]!r}")
        row = dict(zip(SQUEUE_FIELDS, cells, strict=False))
        exit_code, sig = decode_squeue_exit(row["exit_code"])
        state = JobState.from_slurm(row["State"])
        reason = _text(row["Reason"])
        jobs[row["JobID"].strip()] = JobInfo(
            job_id=row["JobID"].strip(),
            state=state,
            observed_at=observed_at,
            raw_state=row["State"].strip(),
            exit_code=exit_code,
            signal=sig,
            nodes=expand_nodes(row["NodeList"]),
            submit_time=_epoch(row["SubmitTime"]),
            start_time=_epoch(row["StartTime"]) if state is not JobState.PENDING else None,
            end_time=_epoch(row["EndTime"]) if state.is_terminal else None,
            time_limit_s=_time_limit(row["TimeLimit"]),
            restart_count=int(row["RestartCnt"]) if row["RestartCnt"].strip().isdigit() else 0,
            reason=reason,
            name=_text(row["Name"]),
            comment=_text(row["Comment"]),
        )
    return jobs


def parse_sacct(
    text: str, observed_at: float, fields: tuple[str, ...] = SACCT_FIELDS, sep: str = "|"
) -> dict[str, JobInfo]:
    """Parse `sacct -X -D -P -n -o SACCT_FORMAT` output (or, with `fields` and `sep`,
    `sacct ... --delimiter=SEP -o SACCT_FIND_FORMAT`).

    With -D each run of a requeued job is its own row (22.05 has no Restarts field): the
    last row is the current run and the rows before it count the restarts.
    """
    rows: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = line.split(sep, len(fields) - 1)
        if len(cells) < len(fields):
            raise SchedulerRejected(f"unexpected sacct line: {line[:120]!r}")
        row = dict(zip(fields, cells, strict=True))
        rows.setdefault(row["JobIDRaw"].strip(), []).append(row)
    jobs = {}
    for job_id, runs in rows.items():
        row = runs[-1]
        exit_code, sig = decode_exit_pair(row["ExitCode"])
        state = JobState.from_slurm(row["State"])
        jobs[job_id] = JobInfo(
            job_id=job_id,
            state=state,
            observed_at=observed_at,
            raw_state=row["State"],
            exit_code=exit_code,
            signal=sig,
            nodes=expand_nodes(row["NodeList"]),
            submit_time=_epoch(row["Submit"]),
            start_time=_epoch(row["Start"]),
            end_time=_epoch(row["End"]),
            time_limit_s=_time_limit(row["TimelimitRaw"]),
            restart_count=len(runs) - 1,
            reason=_text(row["Reason"]),
            name=_text(row["JobName"]),
            comment=_text(row.get("Comment", "")),
            from_accounting=True,
        )
    return jobs


_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:.]*)=")


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One `scontrol show ... -o` line -> {key: value}; values may contain spaces."""
    matches = list(_KEY.finditer(line))
    record = {}
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        record[match.group(1)] = line[match.end() : end].strip()
    return record


def parse_sinfo_nodes(text: str) -> list[NodeInfo]:
    """Parse `sinfo -h -N -o '%N|%t|%E'` (a node in several partitions appears once).

    A node that stopped answering keeps its state with a `*` suffix (`alloc*`) until
    SlurmdTimeout passes (`NodeInfo.responding`); sinfo does not say since when."""
    nodes: dict[str, NodeInfo] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, raw_state, reason = (line.split("|", 2) + ["", ""])[:3]
        nodes.setdefault(
            name,
            NodeInfo(
                name=name,
                state=NodeState.from_slurm(raw_state),
                raw_state=raw_state,
                reason=_text(reason),
            ),
        )
    return list(nodes.values())


def parse_config(text: str) -> ClusterFacts:
    """Parse `scontrol show config` ("Key = value" lines)."""
    conf = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            conf[key.strip()] = value.strip()

    def seconds(key: str, default: int) -> int:
        match = re.match(r"(\d+)", conf.get(key, ""))
        return int(match.group(1)) if match else default

    return ClusterFacts(
        min_job_age_s=seconds("MinJobAge", 300),
        accounting=conf.get("AccountingStorageType", "accounting_storage/none")
        != "accounting_storage/none",
        kill_wait_s=seconds("KillWait", 30),
        job_requeue=conf.get("JobRequeue", "1") != "0",
        version=conf.get("SLURM_VERSION", ""),
        cluster_name=conf.get("ClusterName", ""),
        slurmd_timeout_s=seconds("SlurmdTimeout", 300),
    )


def parse_sbatch_job_id(text: str) -> str:
    """`sbatch --parsable` prints "JOBID" or "JOBID;CLUSTER"."""
    first = text.strip().splitlines()[-1] if text.strip() else ""
    job_id = first.split(";", 1)[0].strip()
    if not job_id.isdigit():
        raise SchedulerRejected(f"could not read a job id from sbatch's answer {text.strip()!r}")
    return job_id


# scontrol acting on a list of jobs (requeue, release, update jobid=1,2,3) exits 1 when any
# job refused, and names each refused job on a line of its own: "<message> for job <id>".
# `release` adds one line "slurm_suspend error: <message>" repeating the last message.
_REFUSED = re.compile(r"^(?P<message>.+) for job (?P<job>\S+)$")
_SUMMARY = re.compile(r"^[\w ]*error: (?P<message>.+)$")


def parse_refusals(text: str, job_ids: Iterable[str]) -> dict[str, str] | None:
    """The refused jobs of a failed list command -> the line naming each (pure).

    None when the output cannot be attributed to jobs: a line that names no job of the
    list and does not repeat the message of one that does (another message, a malformed
    list: "Invalid job id specified for job 1,abc"), or no refusal named at all."""
    asked = {str(j) for j in job_ids}
    refused: dict[str, str] = {}
    messages: set[str] = set()
    others: list[str] = []
    for line in (ln.strip() for ln in text.splitlines()):
        if not line:
            continue
        m = _REFUSED.match(line)
        if m and m["job"] in asked:
            refused[m["job"]] = line
            messages.add(m["message"])
        else:
            others.append(line)
    if not refused:
        return None
    for line in others:
        m = _SUMMARY.match(line)
        if m is None or m["message"] not in messages:
            return None
    return refused

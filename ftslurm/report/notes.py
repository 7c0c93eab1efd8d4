"""The prose of the run commands (pure): times and ages in words, the notes on lost nodes
and their recovery, the notes a reason says once under a table, and which columns of a
table fit a terminal. Values in, words out: no clock, no file, no terminal (`ftslurm.cli`
reads the state and prints)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ftslurm.core.contract.reports import (
    LiveRecovery,
    NodeRole,
    Outcome,
    ResultVerdict,
    RoundRecord,
    ValidationReport,
)
from ftslurm.core.recovery import Recovery
from ftslurm.core.types import JobState, NodeInfo, NodeState
from ftslurm.daemon.records import Attempt


def fmt_time(t: float | None, now: float) -> str:
    """HH:MM:SS today; with the date on any other day (an expiry tomorrow must say so)."""
    if not t:
        return "-"
    when = datetime.fromtimestamp(t)
    today = datetime.fromtimestamp(now).date()
    return when.strftime("%H:%M:%S" if when.date() == today else "%Y-%m-%d %H:%M:%S")


def fmt_age(seconds: float) -> str:
    """An age in words: seconds, minutes under two hours, else hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# ---------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Col:
    """A table column. `keep` ranks what stays when the terminal is narrow (higher stays
    longer; None: never dropped, never cut: run ids, node names). `wraps`: free text that
    may fold over several lines, so it does not need its full width."""

    header: str
    keep: int | None
    wraps: bool = False


_WRAPPED_MIN = 16  # the width a wrapping column is granted when deciding what fits
_CELL_EXTRA = 3  # a cell's padding and border


def fit_columns(cols: Sequence[Col], widths: Sequence[Sequence[int]], width: int) -> list[int]:
    """Which columns (indices, in order) fit `width`: drop the lowest `keep` first.

    `widths` are the rows' cells as wide as they show (their text without markup)."""
    natural = []
    for i, col in enumerate(cols):
        need = max([len(col.header), *(row[i] for row in widths)])
        natural.append(min(need, _WRAPPED_MIN) if col.wraps else need)
    shown = list(range(len(cols)))
    droppable = sorted(
        (i for i, c in enumerate(cols) if c.keep is not None), key=lambda i: cols[i].keep
    )
    while sum(natural[i] + _CELL_EXTRA for i in shown) + 1 > width and droppable:
        shown.remove(droppable.pop(0))
    return shown


# A note `policy.decide` adds to the reason of every ending of a run whose ranks wrote no
# heartbeats: said once under a table, not on every row.
_SAID_ONCE = ("the ranks wrote no heartbeats",)


def split_reason(reason: str | None) -> tuple[str, list[str]]:
    """A reason without the notes said once under a table, and those notes."""
    parts = (reason or "").split("; ")
    once = [p for p in parts if p.startswith(_SAID_ONCE)]
    return "; ".join(p for p in parts if p not in once), once


# ---------------------------------------------------------------------------- lost nodes
def lost_node_notes(
    nodes: Sequence[str], infos: Sequence[NodeInfo], slurmd_timeout_s: int, now: float
) -> list[str]:
    """What to say about an allocation's nodes that stopped answering.

    Until SlurmdTimeout has passed the scheduler still counts such a node as up and the job
    as running, so nothing else shows that anything happened."""
    by_name = {i.name: i for i in infos}
    notes = []
    for name in nodes:
        info = by_name.get(name)
        if info is None or info.responding:
            continue
        if info.state in (NodeState.DOWN, NodeState.FAIL):
            notes.append(
                f"{name} is down ({info.reason or 'not responding'}); the scheduler "
                "ends the job on it"
            )
        elif info.not_responding_since is not None:
            since = info.not_responding_since
            notes.append(
                f"{name} not responding since {fmt_time(since, now)}; the scheduler "
                f"declares it down at about {fmt_time(since + slurmd_timeout_s, now)} "
                f"(SlurmdTimeout {slurmd_timeout_s} s)"
            )
        else:
            notes.append(
                f"{name} not responding; the scheduler declares it down once it has "
                f"been silent for SlurmdTimeout ({slurmd_timeout_s} s)"
            )
    return notes


_SPARE_KIND = {NodeRole.SPARE.value: "idle", NodeRole.WARM_SPARE.value: "warm"}


def spare_lost(d: Mapping[str, Any]) -> str | None:
    """A `node_lost` event's words when the node lost was a spare still waiting (idle, or
    its ranks warm): nothing restarted, the spares left ("warm spare lost: nothing
    restarted, 1 spare left"); None for a node that trained (or an older record)."""
    kind = _SPARE_KIND.get(str(d.get("role")))
    if kind is None or d.get("recovery") != Recovery.SPARE:  # (a new job: said so)
        return None
    n = d.get("spares_remaining")
    if not isinstance(n, int):
        left = ""
    elif n == 0:
        left = ", no spare left"
    else:
        left = f", {n} spare{'s' if n > 1 else ''} left"
    return f"{kind} spare lost: nothing restarted{left}"


def recovery_notes(
    attempts: Sequence[Attempt],
    events: Sequence[Any],
    rounds: Mapping[int, Sequence[RoundRecord]],
    now: float,
) -> list[str]:
    """What to say about the nodes lost in a run's latest two attempts and the recovery
    under way: "n2 lost 21 s ago (peer report) → new job 45 queued", "→ spare:
    ranks restarted 4 s later", or for a spare still waiting "→ idle spare lost: nothing
    restarted, 1 spare left". `events` are the run's `node_lost` (and other) events,
    `rounds` an attempt's in-job round records."""
    if not attempts:
        return []
    by_no = {a.attempt: a for a in attempts}
    latest = attempts[-1].attempt
    notes = []
    for e in events:
        d = e.data
        k = d.get("attempt")
        if e.kind != "node_lost" or not isinstance(k, int) or k < latest - 1:
            continue
        at = d.get("time") if isinstance(d.get("time"), (int, float)) else e.time
        source = {"slurm": "Slurm's verdict", "daemon": "the daemon's lease watch"}.get(
            str(d.get("source")), "peer report"
        )
        head = f"{d.get('node') or 'a node'} lost {fmt_age(max(0.0, now - at))} ago ({source})"
        if (waiting := spare_lost(d)) is not None:
            tail = waiting
        elif d.get("recovery") == Recovery.SPARE:
            starts = [s for r in rounds.get(k, ()) if (s := r.started_at) is not None and s >= at]
            tail = (
                f"spare: ranks restarted {fmt_age(min(starts) - at)} later"
                if starts
                else "spare: ranks restarting"
            )
        else:
            nxt = next((a for n, a in sorted(by_no.items()) if n > k), None)
            if nxt is None:
                tail = "ending the job"
            else:
                what = "new job" if nxt.job_id != by_no[k].job_id else "job"
                job = f"{what} {nxt.job_id}" if nxt.job_id else f"{what} being submitted"
                state = str(nxt.state)
                if state == JobState.PENDING.value:
                    tail = f"{job} queued"
                elif state == JobState.RUNNING.value and nxt.start is not None:
                    tail = f"{job} running {fmt_age(max(0.0, nxt.start - at))} later"
                elif nxt.job_id:
                    tail = f"{job} {state}"
                else:
                    tail = job
        notes.append(f"{head} → {tail}")
    return notes


_DETECTED = {"error": "a collective failed", "restart": "a rank came back"}


def distinct_live(records: Sequence[LiveRecovery]) -> list[LiveRecovery]:
    """The live recoveries with a time, oldest first; a fallback once per round (each rank
    that gave up records it)."""
    done = sorted((r for r in records if r.failed_at is not None), key=lambda r: r.failed_at)
    seen: set[tuple[int | None, str]] = set()
    return [
        r
        for r in done
        if r.given_up is None
        or ((r.round, r.given_up) not in seen and not seen.add((r.round, r.given_up)))
    ]


def live_note(r: LiveRecovery, ago: str | None = None) -> str:
    """One live recovery in words ("live recovery 12 s ago: rank 2: Connection closed (a
    collective failed) → training again 2.1 s later, step 25 run again, state from rank 0
    to 1"); `ago`: how long ago, left out when None."""
    when = f" {ago} ago" if ago else ""
    if r.given_up is not None:
        if r.node_rank is not None:  # a launcher's fallback
            said = f"node rank {r.node_rank}'s launcher: "
        else:
            said = f"rank {r.rank}: " if r.rank is not None else ""
        detail = f" ({r.why})" if r.why else ""
        if r.recovery == Recovery.NEW_JOB.value:
            then = "the run goes on in a new job"
        else:
            then = "every rank restarted (memory tier or disk)"
        return f"live recovery given up{when}: {said}{r.given_up}{detail} → {then}"
    how = _DETECTED.get(r.detected_by or "", "")
    head = f"live recovery{when}: {r.why or 'a fault'}" + (f" ({how})" if how else "")
    if r.first_commit_at is not None and r.failed_at is not None:
        tail = f"training again {fmt_age(r.first_commit_at - r.failed_at)} later"
    else:
        tail = "recovering"
    if r.step is not None:
        tail += f", step {r.step} run again"
    if len(r.senders) > 1:  # a state sharded over replicas: each part from its holder
        tail += f", state from ranks {', '.join(map(str, r.senders))}"
        tail += f" to {', '.join(map(str, r.receivers))}"
    elif r.state_from is not None:
        tail += f", state from rank {r.state_from} to {', '.join(map(str, r.receivers))}"
    if r.took_over is not None:
        tail += f" (a warm spare's, in node rank {r.took_over}'s place)"
    if r.standby is not None:
        tail += f" (rank {r.standby}: a warm standby took the crashed process's place)"
    return f"{head} → {tail}"


def moved_to_a_new_job(records: Sequence[LiveRecovery]) -> list[LiveRecovery]:
    """The launchers' fallbacks among an attempt's live records that moved the run to a
    new job (`RunDir.live_fallback`)."""
    return [r for r in records if r.recovery == Recovery.NEW_JOB.value]


def live_notes(records: Sequence[LiveRecovery], now: float, last: int = 3) -> list[str]:
    """The latest `last` live recoveries of an attempt, oldest first (`live_note`)."""
    return [
        live_note(r, fmt_age(max(0.0, now - (r.failed_at or now))))
        for r in distinct_live(records)[-last:]
    ]


# ---------------------------------------------------------------------- result validation
def validation_text(d: Mapping[str, Any]) -> str:
    """A result-validation event (`validation`, recorded by the daemon's step) in words:
    exit 16 with the nodes flagged and the disambiguation run on other nodes (or why there
    is none), or exit 17's verdict with the nodes unflagged."""
    k = d.get("attempt")
    nodes = ", ".join(d.get("flagged") or d.get("unflagged") or []) or "none"
    if d.get("exit_code") == 17:
        return (
            f"attempt {k} exited 17: the result reproduced on different hardware, the "
            f"model's fault, not the machine's; nodes unflagged: {nodes}"
        )
    if d.get("verdict") == "flaky":
        return f"attempt {k} ended: nodes flagged (result validation): {d.get('reason')}"
    if d.get("verdict") == "disambiguate":
        return (
            f"attempt {k} exited 16 (a result it could not trust): nodes flagged "
            f"(result validation): {nodes}; disambiguation run on other nodes"
        )
    return f"attempt {k} exited 16: nodes flagged (result validation): {nodes}; {d.get('reason')}"


# The rank agent's verdicts on a result it re-ran in place (`ftslurm.agent.validation_rules`).
RESULT_VERDICT = {
    ResultVerdict.TRANSIENT.value: "the re-run differed: a transient fault of node {node} "
    "(recorded); training went on",
    ResultVerdict.PERSISTENT.value: "reproduced on this hardware: last good state "
    "checkpointed, exit 16",
    ResultVerdict.MODEL.value: "reproduced on other hardware: the model's fault, not the "
    "machine's: exit 17",
    ResultVerdict.CORRECT.value: "reproduced on other hardware: a correct result (the "
    "model's own spike); training went on",
    ResultVerdict.COUNTED.value: "counted (report_stats); training went on",
    ResultVerdict.OK.value: "the re-run differed: non-deterministic",
}


def result_checks(attempt: int, reports: Sequence[ValidationReport]) -> list[dict[str, Any]]:
    """The rank agents' validation events of an attempt (`RunDir.validation`), oldest first,
    each with its words (`text`)."""
    found = []
    for r in reports:
        for e in r.events:
            verdict = RESULT_VERDICT.get(e.verdict or "", e.verdict or "?")
            again = f" ({e.reruns} re-runs)" if e.reruns > 1 else ""
            found.append(
                {
                    "attempt": attempt,
                    "rank": r.rank,
                    "node": r.node,
                    **e.to_json(),
                    "text": f"attempt {attempt}, step {e.step}, rank {r.rank} on {r.node}: "
                    f"{e.kind} result ({e.value}) re-run in place{again}: {e.rerun}: "
                    + verdict.format(node=r.node),
                }
            )
    return sorted(found, key=lambda d: (d.get("time") or 0.0, d["rank"] or 0))


def result_counts(attempt: int, reports: Sequence[ValidationReport]) -> dict[str, Any] | None:
    """An attempt's validation counts over its ranks (every rank validates every step and
    re-runs with the others: the largest count; non-determinism: the re-runs that differed,
    summed over the ranks), with their words; None when its ranks validated nothing."""
    if not reports:
        return None
    checks = max(r.checks for r in reports)
    reruns = max(r.reruns for r in reports)
    differed = sum(r.differed for r in reports)
    modes = sorted({r.mode for r in reports if r.mode})
    return {
        "attempt": attempt,
        "mode": "/".join(modes) or None,
        "checks": checks,
        "reruns": reruns,
        "differed": differed,
        "text": f"attempt {attempt}: {checks} results validated ({'/'.join(modes) or '?'}), "
        f"{reruns} steps re-run in place, {differed} re-runs differed",
    }


# ---------------------------------------------------------------------- health checks
HEALTH_EVENTS = ("node_unhealthy", "node_benched")


def health_text(kind: str, d: Mapping[str, Any]) -> str | None:
    """A failed pre-flight health check (`node_unhealthy`, or `node_benched` of a node that
    stepped out for it: recorded by the daemon's step) in words; None for another event."""
    node, k = d.get("node") or "a node", d.get("attempt")
    if kind == "node_unhealthy":
        return (
            f"{node} failed its health check ({d.get('check')}: {d.get('detail')}) before "
            f"attempt {k} trained: flagged, the run goes on in a new job without it"
        )
    if kind == "node_benched" and d.get("why") == Outcome.UNHEALTHY.value:
        said = str(d.get("reason") or "").removeprefix("health check failed: ")
        return (
            f"{node} failed its health check ({said}) before attempt {k} trained: flagged, "
            "a spare takes its place in the same job"
        )
    return None

"""The Slurm CLI parsers on output recorded from real Slurm clusters (22.05 and 24.11).

Each release's files were recorded by `tests/record_slurm_outputs.py` (or by hand, for the
first 22.05 ones) with the backend's own flags; `jobs_<version>.json` says which job id plays
which part, so every test asks the same questions of every release.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftslurm.backends.slurm_cli import parse
from ftslurm.core.types import JobState, NodeState
from ftslurm.errors import SchedulerRejected

DATA = Path(__file__).parent / "data"
NOW = 1_800_000_000.0
# (MinJobAge, full version) of each recording's cluster.
CONFIG = {"22.05": (300, "22.05.8"), "24.11": (60, "24.11.5")}
RELEASES = sorted(p.stem.removeprefix("jobs_") for p in DATA.glob("jobs_*.json"))


class Recording:
    """One release's recorded outputs and the ids of its jobs by part."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.ids: dict[str, str] = json.loads((DATA / f"jobs_{version}.json").read_text())

    def text(self, name: str) -> str:
        return (DATA / f"{name}_{self.version}.txt").read_text()

    def __getitem__(self, role: str) -> str:
        return self.ids[role]


@pytest.fixture(params=RELEASES)
def rec(request) -> Recording:
    return Recording(request.param)


def test_every_release_is_recorded():
    assert RELEASES == sorted(CONFIG)


def test_squeue_rows_become_jobinfo_with_decoded_exit_status(rec):
    jobs = parse.parse_squeue(rec.text("squeue"), NOW)
    assert jobs[rec["failed"]].state is JobState.FAILED
    assert (jobs[rec["failed"]].exit_code, jobs[rec["failed"]].signal) == (3, None)
    assert jobs[rec["killed"]].state is JobState.FAILED and jobs[rec["killed"]].signal == 9
    two = jobs[rec["two_node"]]
    assert two.state is JobState.COMPLETED and len(set(two.nodes)) == 2
    live = jobs[rec["live"]]
    assert live.state is JobState.RUNNING and live.name == "live run"
    assert live.comment == "ftslurm:run=abc:attempt=1"
    assert live.time_limit_s == 600 and live.end_time is None and live.start_time
    held = jobs[rec["held"]]
    assert held.state is JobState.PENDING and held.nodes == () and held.start_time is None
    assert held.reason == "JobHeldUser"
    assert jobs[rec["timeout"]].state is JobState.TIMEOUT
    assert jobs[rec["timeout"]].time_limit_s == 60
    assert all(j.observed_at == NOW and not j.from_accounting for j in jobs.values())


def test_squeue_shows_restart_count_after_requeue(rec):
    jobs = parse.parse_squeue(rec.text("squeue"), NOW)
    assert jobs[rec["requeued"]].restart_count == 1
    assert jobs[rec["node_fail"]].restart_count == 1
    assert jobs[rec["two_node"]].restart_count == 0


def test_sacct_duplicates_count_restarts_and_last_row_is_current(rec):
    jobs = parse.parse_sacct(rec.text("sacct"), NOW)
    node_fail = jobs[rec["node_fail"]]
    assert node_fail.restart_count == 1 and node_fail.state is JobState.CANCELLED
    requeued = jobs[rec["requeued"]]
    assert requeued.state is JobState.CANCELLED and requeued.raw_state == "CANCELLED by 0"
    assert (jobs[rec["failed"]].exit_code, jobs[rec["killed"]].signal) == (3, 9)
    assert jobs[rec["timeout"]].state is JobState.TIMEOUT
    assert jobs[rec["timeout"]].time_limit_s == 60
    assert jobs[rec["held"]].start_time is None and jobs[rec["held"]].end_time is None


def test_sacct_find_format_keeps_free_text_and_reads_the_comment(rec):
    """Recorded with --delimiter=<unit separator>: a '|' in a job name is just text."""
    jobs = parse.parse_sacct(rec.text("sacct_find"), NOW, parse.SACCT_FIND_FIELDS, parse.SEP)
    failed, completed = jobs[rec["find_failed"]], jobs[rec["find_completed"]]
    assert (failed.name, failed.comment, failed.exit_code) == ("odd|name", "ftslurm:rec1:0", 3)
    assert (completed.state, completed.comment, completed.from_accounting) == (
        JobState.COMPLETED,
        "ftslurm:rec2:1",
        True,
    )
    assert parse.parse_sacct(rec.text("sacct"), NOW)[rec["requeued"]].comment is None


def test_scontrol_records_keep_values_with_spaces(rec):
    line = "JobId=5 JobName=a b c Reason=Not responding ExitCode=0:9"
    assert parse.parse_scontrol_record(line) == {
        "JobId": "5",
        "JobName": "a b c",
        "Reason": "Not responding",
        "ExitCode": "0:9",
    }
    # recorded `scontrol show job -o` lines, as `describe` reads them
    jobs = {
        r["JobId"]: r
        for r in map(parse.parse_scontrol_record, rec.text("scontrol_show_job").splitlines())
        if "JobId" in r
    }
    live = jobs[rec["live"]]
    assert live["JobState"] == "RUNNING" and len(set(parse.expand_nodes(live["NodeList"]))) == 2
    assert live["BatchHost"] in parse.expand_nodes(live["NodeList"])
    assert jobs[rec["node_fail"]]["Restarts"] == "1"
    assert parse.decode_exit_pair(jobs[rec["killed"]]["ExitCode"])[1] == 9
    squeue = parse.parse_squeue(rec.text("squeue"), NOW)
    for job_id, r in jobs.items():  # the two sources agree on what both show
        assert (
            JobState.from_slurm(r["JobState"]),
            int(r["Restarts"]),
            parse.expand_nodes(r["NodeList"]),
        ) == (squeue[job_id].state, squeue[job_id].restart_count, squeue[job_id].nodes)


def test_sinfo_nodes_and_states(rec):
    nodes = parse.parse_sinfo_nodes(rec.text("sinfo"))
    assert [n.name for n in nodes] == ["n1", "n2", "n3", "n4"]
    live = parse.parse_squeue(rec.text("squeue"), NOW)[rec["live"]]
    busy = {n.name for n in nodes if n.state in (NodeState.MIXED, NodeState.ALLOCATED)}
    assert set(live.nodes) <= busy and all(n.reason is None for n in nodes)
    down = parse.parse_sinfo_nodes("n2|down*|Not responding\nn2|down*|Not responding\n")
    assert len(down) == 1 and down[0].state is NodeState.DOWN and not down[0].responding
    assert down[0].reason == "Not responding"


def test_config_facts(rec):
    facts = parse.parse_config(rec.text("scontrol_show_config"))
    min_job_age, version = CONFIG[rec.version]
    assert (facts.min_job_age_s, facts.accounting, facts.kill_wait_s) == (min_job_age, True, 30)
    assert facts.version == version and facts.job_requeue
    no_accounting = parse.parse_config("AccountingStorageType = accounting_storage/none\n")
    assert no_accounting.accounting is False


@pytest.mark.parametrize(
    "text,expected",
    [
        ("(null)", ()),
        ("None assigned", ()),
        ("", ()),
        ("n1", ("n1",)),
        ("n[1-3],gpu[07-08]", ("n1", "n2", "n3", "gpu07", "gpu08")),
    ],
)
def test_expand_nodes_uses_hostlist_syntax(text, expected):
    assert parse.expand_nodes(text) == expected


def test_wait_status_and_exit_pairs():
    # squeue's exit_code: a wait status on 22.05, an "exit:signal" pair on 24.11
    assert parse.decode_squeue_exit("768") == parse.decode_squeue_exit("3:0") == (3, None)
    assert parse.decode_squeue_exit("9") == parse.decode_squeue_exit("0:9") == (0, 9)
    assert parse.decode_wait_status("768") == (3, None)
    assert parse.decode_wait_status("9") == (0, 9)
    assert parse.decode_wait_status("garbage") == (None, None)
    assert parse.decode_exit_pair("0:15") == (0, 15) and parse.decode_exit_pair("2:0") == (2, None)


def test_sbatch_job_id():
    assert parse.parse_sbatch_job_id("123\n") == "123"
    assert parse.parse_sbatch_job_id("124;cluster\n") == "124"
    with pytest.raises(SchedulerRejected):
        parse.parse_sbatch_job_id("sbatch: error: something\n")


def test_truncated_squeue_line_is_an_error_not_a_wrong_state():
    with pytest.raises(SchedulerRejected):
        parse.parse_squeue("12\x1fRUNNING\x1f", NOW)


def test_runner_stops_retrying_at_once_when_aborted():
    """A daemon asked to stop during a controller outage does not sit out the retry budget."""
    import sys
    import threading
    import time

    from ftslurm.backends.slurm_cli import CommandRunner
    from ftslurm.errors import SchedulerUnavailable

    abort = threading.Event()
    runner = CommandRunner(abort=abort, max_wait_s=0.2)
    failing = [
        sys.executable,
        "-c",
        "import sys; sys.stderr.write('sbatch: error: Unable to "
        "contact slurm controller (connect failure)\\n'); sys.exit(1)",
    ]
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            runner.run(failing, budget_s=600, idempotent=False)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    started = time.monotonic()
    thread.start()
    deadline = time.monotonic() + 60
    while runner.commands < 2 and time.monotonic() < deadline:  # it is retrying
        time.sleep(0.01)
    assert runner.commands >= 2
    abort.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert isinstance(outcome[0], SchedulerUnavailable)
    assert time.monotonic() - started < 60  # nowhere near the 600 s budget

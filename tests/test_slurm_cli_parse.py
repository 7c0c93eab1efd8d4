"""The Slurm CLI parsers on output recorded from a real Slurm 22.05 cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftslurm.backends.slurm_cli import parse
from ftslurm.core.types import JobState, NodeState
from ftslurm.errors import SchedulerRejected

DATA = Path(__file__).parent / "data"
NOW = 1_800_000_000.0


def recorded(name: str) -> str:
    return (DATA / name).read_text()


def test_squeue_rows_become_jobinfo_with_decoded_exit_status():
    jobs = parse.parse_squeue(recorded("squeue_22.05.txt"), NOW)
    assert jobs["8"].state is JobState.FAILED
    assert (jobs["8"].exit_code, jobs["8"].signal) == (3, None)
    assert jobs["9"].state is JobState.FAILED and jobs["9"].signal == 9
    assert jobs["7"].state is JobState.COMPLETED and jobs["7"].nodes == ("n1", "n2")
    live = jobs["67"]
    assert live.state is JobState.RUNNING and live.name == "live run"
    assert live.comment == "ftslurm:run=abc:attempt=1"
    assert live.time_limit_s == 600 and live.end_time is None and live.start_time
    held = jobs["68"]
    assert held.state is JobState.PENDING and held.nodes == () and held.start_time is None
    assert held.reason == "JobHeldUser"
    assert jobs["66"].state is JobState.TIMEOUT and jobs["66"].time_limit_s == 60
    assert all(j.observed_at == NOW and not j.from_accounting for j in jobs.values())


def test_squeue_shows_restart_count_after_requeue():
    jobs = parse.parse_squeue(recorded("squeue_22.05.txt"), NOW)
    assert jobs["63"].restart_count == 1 and jobs["65"].restart_count == 1
    assert jobs["7"].restart_count == 0


def test_sacct_duplicates_count_restarts_and_last_row_is_current():
    jobs = parse.parse_sacct(recorded("sacct_22.05.txt"), NOW)
    assert jobs["65"].restart_count == 1 and jobs["65"].state is JobState.CANCELLED
    assert jobs["62"].state is JobState.CANCELLED and jobs["62"].raw_state == "CANCELLED by 0"
    assert (jobs["8"].exit_code, jobs["9"].signal) == (3, 9)
    assert jobs["66"].state is JobState.TIMEOUT and jobs["66"].time_limit_s == 60
    assert jobs["68"].start_time is None and jobs["68"].end_time is None


def test_sacct_find_format_keeps_free_text_and_reads_the_comment():
    """Recorded with --delimiter=<unit separator>: a '|' in a job name is just text."""
    jobs = parse.parse_sacct(recorded("sacct_find_22.05.txt"), NOW, parse.SACCT_FIND_FIELDS,
                             parse.SEP)  # fmt: skip
    assert (jobs["1"].name, jobs["1"].comment, jobs["1"].exit_code) == (
        "odd|name", "ftslurm:rec1:0", 3)
    assert (jobs["2"].state, jobs["2"].comment, jobs["2"].from_accounting) == (
        JobState.COMPLETED, "ftslurm:rec2:1", True)
    assert parse.parse_sacct(recorded("sacct_22.05.txt"), NOW)["65"].comment is None


def test_scontrol_records_keep_values_with_spaces():
    rec = parse.parse_scontrol_record("JobId=5 JobName=a b c Reason=Not responding ExitCode=0:9")
    assert rec == {"JobId": "5", "JobName": "a b c", "Reason": "Not responding", "ExitCode": "0:9"}
    jobs = parse.parse_scontrol_jobs(recorded("scontrol_show_job_22.05.txt"), NOW)
    assert jobs["67"].state is JobState.RUNNING and jobs["67"].nodes == ("n1", "n2")
    assert jobs["65"].restart_count == 1 and jobs["9"].signal == 9
    squeue = parse.parse_squeue(recorded("squeue_22.05.txt"), NOW)
    for job_id, info in jobs.items():  # the two sources agree on what both show
        assert (info.state, info.restart_count, info.nodes) == (
            squeue[job_id].state, squeue[job_id].restart_count, squeue[job_id].nodes)


def test_sinfo_nodes_and_states():
    nodes = parse.parse_sinfo_nodes(recorded("sinfo_22.05.txt"))
    assert [n.name for n in nodes] == ["n1", "n2", "n3", "n4"]
    assert nodes[0].state is NodeState.MIXED and nodes[0].reason is None
    down = parse.parse_sinfo_nodes("n2|down*|Not responding\nn2|down*|Not responding\n")
    assert len(down) == 1 and down[0].state is NodeState.DOWN and not down[0].responding
    assert down[0].reason == "Not responding"


def test_config_facts():
    facts = parse.parse_config(recorded("scontrol_show_config_22.05.txt"))
    assert (facts.min_job_age_s, facts.accounting, facts.kill_wait_s) == (300, True, 30)
    assert facts.version == "22.05.8" and facts.job_requeue
    no_accounting = parse.parse_config("AccountingStorageType = accounting_storage/none\n")
    assert no_accounting.accounting is False


@pytest.mark.parametrize("text,expected", [
    ("(null)", ()), ("None assigned", ()), ("", ()), ("n1", ("n1",)),
    ("n[1-3],gpu[07-08]", ("n1", "n2", "n3", "gpu07", "gpu08")),
])  # fmt: skip
def test_expand_nodes_uses_hostlist_syntax(text, expected):
    assert parse.expand_nodes(text) == expected


def test_wait_status_and_exit_pairs():
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
    failing = [sys.executable, "-c", "import sys; sys.stderr.write('sbatch: error: Unable to "
               "contact slurm controller (connect failure)\\n'); sys.exit(1)"]  # fmt: skip
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

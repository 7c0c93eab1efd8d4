"""Pure core: state mapping, time limits, error classification, sbatch flags."""

from __future__ import annotations

import pytest

from ftslurm.backends.slurm_cli import classify
from ftslurm.core.sbatch import sbatch_args
from ftslurm.core.timefmt import format_time_limit, parse_time_limit
from ftslurm.core.types import JobOptions, JobState, NodeState
from ftslurm.errors import (
    ConfigError,
    InvalidJobId,
    InvalidPartition,
    JobStateConflict,
    OperatorNeeded,
    SchedulerRejected,
    SchedulerUnavailable,
    TransientError,
)


@pytest.mark.parametrize(
    "raw,state",
    [
        ("RUNNING", JobState.RUNNING),
        ("CANCELLED by 0", JobState.CANCELLED),
        ("CANCELLED+", JobState.CANCELLED),
        ("NODE_FAIL", JobState.NODE_FAIL),
        ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY),
        ("OOM", JobState.OUT_OF_MEMORY),
        ("REQUEUE_HOLD", JobState.REQUEUED),
        ("SPECIAL_EXIT", JobState.REQUEUED),
        ("CONFIGURING", JobState.RUNNING),
        ("STAGE_OUT", JobState.COMPLETING),
        ("something new", JobState.UNKNOWN),
        ("", JobState.UNKNOWN),
    ],
)
def test_slurm_states_map_onto_ours(raw, state):
    assert JobState.from_slurm(raw) is state


def test_unknown_is_never_terminal_and_every_state_is_classified():
    assert not JobState.UNKNOWN.is_terminal and not JobState.UNKNOWN.is_active
    for state in JobState:
        assert not (state.is_terminal and state.is_active), state
    assert {s for s in JobState if not s.is_terminal and not s.is_active} == {JobState.UNKNOWN}


def test_node_states():
    assert NodeState.from_slurm("down*") is NodeState.DOWN
    assert NodeState.from_slurm("drng") is NodeState.DRAINING
    assert NodeState.from_slurm("mix") is NodeState.MIXED and NodeState.MIXED.usable
    assert not NodeState.DRAINED.usable


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("1", 60),
        ("90", 5400),
        ("1:30", 90),
        ("2:00:00", 7200),
        ("1-0", 86400),
        ("1-2:30", 95400),
        ("0-00:00:45", 45),
        ("UNLIMITED", None),
        ("infinite", None),
        ("0", None),
        ("0:00:00", None),  # sbatch reads a zero limit as "no limit"
    ],
)
def test_time_limits(text, seconds):
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", ["", "1h", "90 minutes", "1:2:3:4", "-5", "1-", "x", "1:99:99x"])
def test_malformed_time_limits_are_one_line_config_errors(text):
    with pytest.raises(ConfigError) as err:
        parse_time_limit(text)
    assert "\n" not in err.value.user_message()


def test_format_time_limit_rounds_up_to_minutes():
    assert format_time_limit(60) == "00:01:00"
    assert format_time_limit(61) == "00:02:00"
    assert format_time_limit(86400 + 3600) == "1-01:00:00"
    assert format_time_limit(None) == "UNLIMITED"


@pytest.mark.parametrize(
    "stderr,kind",
    [
        (
            "squeue: error: slurm_load_jobs error: "
            "Unable to contact slurm controller (connect failure)",
            SchedulerUnavailable,
        ),
        (
            "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation",
            SchedulerUnavailable,
        ),
        ("sacct: error: RPC rate limit exceeded", SchedulerUnavailable),
        ("scontrol: error: Invalid job id specified", InvalidJobId),
        ("sbatch: error: invalid partition specified: nope", InvalidPartition),
        ("sbatch: error: Invalid --time specification", ConfigError),
        ("scontrol: error: Job is no longer pending execution for job 12", JobStateConflict),
        (
            "scancel: error: Kill job error on job id 5: Job/step already completing or completed",
            JobStateConflict,
        ),
        ("sbatch: error: something nobody expected", SchedulerRejected),
        # Refusals an ordinary user meets (Slurm 22.05, the local cluster, as a user):
        ("scancel: error: Kill job error on job id 8: Access/permission denied", OperatorNeeded),
        ("scontrol: Invalid user id for job 8", OperatorNeeded),
        ("squeue: slurm_load_jobs error: Protocol authentication error", OperatorNeeded),
        (
            "sbatch: error: Batch job submission failed: Invalid account or account/partition "
            "combination specified",
            OperatorNeeded,
        ),
    ],
)
def test_classify_failed_commands(stderr, kind):
    err = classify(["/usr/bin/" + stderr.split(":")[0]], 1, "noise\n" + stderr + "\n")
    assert type(err) is kind
    assert err.message.startswith(stderr.split(":")[0] + ":") and "\n" not in err.message
    assert isinstance(err, TransientError) == (kind is SchedulerUnavailable)
    if kind is OperatorNeeded:  # one line that says who can help
        assert "operator" in err.user_message() and "\n" not in err.user_message()


def test_sbatch_args_golden():
    opts = JobOptions(
        name="train",
        nodes=2,
        ntasks_per_node=4,
        gpus_per_node=8,
        time_limit="1-2",
        partition="gpu",
        account="proj",
        exclude=("n3", "n1"),
        comment="ftslurm:run=x:attempt=2",
        signal="B:USR1@300",
        requeue=False,
        hold=True,
        no_kill=True,
        extra={"qos": "high", "exclusive": None},
    )
    assert sbatch_args(opts) == [
        "--job-name=train",
        "--nodes=2",
        "--ntasks-per-node=4",
        "--gpus-per-node=8",
        "--time=1-02:00:00",
        "--partition=gpu",
        "--account=proj",
        "--exclude=n3,n1",
        "--comment=ftslurm:run=x:attempt=2",
        "--signal=B:USR1@300",
        "--no-requeue",
        "--hold",
        "--no-kill",
        "--exclusive",
        "--qos=high",
    ]
    assert sbatch_args(JobOptions()) == []


@pytest.mark.parametrize("seconds", [1, 59, 60, 3000, 3599, 86399, 86400, 90061, 72000 * 30])
def test_an_exact_limit_reads_back_to_the_second(seconds):
    from ftslurm.core.timefmt import format_limit_exact

    assert parse_time_limit(format_limit_exact(seconds)) == seconds

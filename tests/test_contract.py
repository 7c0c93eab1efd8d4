"""The compute/daemon contract (ftslurm.core.contract): paths, exit codes, the job's
environment, the signal parser and the port rule, and that both sides use the same ones."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftslurm.agent import launch, rank
from ftslurm.agent.task import torch_env
from ftslurm.core.contract import (
    Disambiguation,
    EnvName,
    ExitCode,
    HeartbeatDir,
    JobEnv,
    RunDir,
    parse_signal,
    rendezvous_port,
    signal_name,
)
from ftslurm.daemon.policy import FtSettings
from ftslurm.daemon.submission import build_attempt
from ftslurm.errors import ConfigError

from .conftest import job_spec, script_exports

REPO = Path(__file__).resolve().parents[1]


def test_run_dir_names_the_documented_files() -> None:
    run = RunDir("/runs/r1")
    assert run.progress == Path("/runs/r1/progress.json")
    assert run.finished == Path("/runs/r1/FINISHED")
    assert run.logs == Path("/runs/r1/logs")
    assert run.job_output == "/runs/r1/logs/job-%j.out"
    assert run.checkpoints == Path("/runs/r1/checkpoints")
    assert run.rank_report(3, 5) == Path("/runs/r1/attempts/3/rank-5.json")
    assert run.node_report("3", 1) == Path("/runs/r1/attempts/3/node-1.json")
    assert run.stop_record(0, 2) == Path("/runs/r1/attempts/0/stopping-rank-2.json")
    assert run.hung_node(4, 0) == Path("/runs/r1/attempts/4/hung-node-0.json")
    assert run.fired(7) == Path("/runs/r1/attempts/fired-rank-7.json")
    assert run.straggler_nodes == Path("/runs/r1/attempts/straggler-nodes.json")
    assert run.straggler_rank(1) == Path("/runs/r1/stragglers/rank-1.json")
    assert run.straggler_state == Path("/runs/r1/stragglers/state.json")
    assert run.straggler_report == Path("/runs/r1/stragglers/report.json")
    hb = HeartbeatDir.for_launcher("/tmp", "77", 1, 4242)
    assert hb.root == Path("/tmp/ftslurm-hb-77-1-4242")
    assert hb.record(0) == hb.root / "rank-0.hb" and hb.ready(0) == hb.root / "ready-0"
    assert hb.sections == hb.root / "sections.json"


def test_exit_codes_have_their_documented_numbers() -> None:
    assert {c.name: int(c) for c in ExitCode} == {
        "FINISHED": 0,
        "FAILED": 1,
        "RESUME_ELSEWHERE": 16,
        "FAILED_VALIDATION": 17,
        "RESTARTS_EXHAUSTED": 74,
        "CONTINUE": 75,
        "REJOIN": 76,
        "DO_NOT_RETRY": 93,
        "CANNOT_EXECUTE": 126,
        "NOT_FOUND": 127,
    }


def test_the_policy_refuses_the_reserved_exit_codes_as_user_errors() -> None:
    for code in (0, 16, 17, 74, 75, 76, 93):
        with pytest.raises(ValueError, match="own meaning"):
            FtSettings(user_error_exit_codes=(code,))
    assert FtSettings(user_error_exit_codes=(3,)).user_error_exit_codes == (3,)


def test_job_env_round_trip_and_defaults() -> None:
    env = JobEnv(
        run_id="r1",
        run_dir="/runs/r1",
        checkpoint_dir="/ck",
        attempt_base=2,
        checkpoint_signal="SIGUSR1",
        straggler_interval_s=30,
        straggler_threshold=0.5,
        straggler_windows=4,
        straggler_reference="median",
        inject="crash@10:0",
        in_job_restarts=3,
        section_timeouts={"step": None, "setup": 60.0},
        grace_s=45,
    )
    rendered = env.render()
    assert set(rendered) <= {n.value for n in EnvName}
    assert rendered["FTSLURM_CHECKPOINT_SIGNAL"] == "USR1"
    assert JobEnv.from_environ({**rendered, "PATH": "/bin"}) == env
    # Nothing set: the defaults, and an empty variable counts as unset.
    plain = JobEnv.from_environ({"FTSLURM_RUN_DIR": "", "FTSLURM_GRACE_S": ""})
    assert (
        plain.run,
        plain.attempt,
        plain.checkpoint_signal,
        plain.grace_s,
        plain.straggler_interval_s,
        plain.in_job_restarts,
        plain.checkpoint_folder,
    ) == (None, None, "USR2", 120.0, 60.0, 0, "checkpoints")
    assert plain.render() == {}
    assert JobEnv.from_environ({"FTSLURM_ATTEMPT_BASE": "2"}).current_attempt(3) == 5
    assert JobEnv.from_environ({"FTSLURM_ATTEMPT": "4"}).current_attempt(3) == 4


@pytest.mark.parametrize(
    "key,value",
    [
        ("FTSLURM_GRACE_S", "soon"),
        ("FTSLURM_ATTEMPT", "-1"),
        ("FTSLURM_STRAGGLER_WINDOWS", "0"),
        ("FTSLURM_STRAGGLER_REFERENCE", "worst"),
        ("FTSLURM_CHECKPOINT_SIGNAL", "KILL"),
        ("FTSLURM_SECTION_TIMEOUTS", "{not json"),
        ("FTSLURM_SECTION_TIMEOUTS", "[1]"),
        ("FTSLURM_DISAMBIGUATE", "{not json"),
        ("FTSLURM_DISAMBIGUATE", '{"attempt": -1}'),
        ("FTSLURM_DISAMBIGUATE", '{"nodes": ["n1"]}'),
    ],
)
def test_a_bad_job_variable_is_a_one_line_error_naming_it(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        JobEnv.from_environ({key: value})
    assert "\n" not in err.value.message and err.value.message.startswith(f"{key}=")


def test_what_the_daemon_renders_the_job_parses_back() -> None:
    spec = job_spec(ntasks_per_node=2, run_dir="/runs/r 1", inject=["hang@5:0"])
    settings = FtSettings(
        checkpoint_signal="10",
        num_in_job_restarts=2,
        grace_s=30,
        straggler_windows=5,
        out_of_section_timeout=None,
    ).model_dump(mode="json")
    script, _ = build_attempt("r1", spec, settings, 3, ())
    job = JobEnv.from_environ(script_exports(script))
    assert (job.run_id, job.run_dir, job.checkpoint_dir, job.attempt_base) == (
        "r1",
        "/runs/r 1",
        "/ck",
        3,
    )
    assert (job.checkpoint_signal, job.in_job_restarts, job.grace_s, job.straggler_windows) == (
        "USR1",
        2,
        30.0,
        5,
    )
    assert job.section_timeouts is not None and job.section_timeouts["out_of_section"] is None
    assert job.inject == "hang@5:0"
    assert "export FTSLURM_ATTEMPT=$((FTSLURM_ATTEMPT_BASE + ${SLURM_RESTART_COUNT:-0}))" in script
    # Without the launcher its settings do not travel; the rest does, with the defaults.
    script, _ = build_attempt("r1", spec, {"use_launcher": False}, 0, ())
    plain = script_exports(script)
    assert "FTSLURM_IN_JOB_RESTARTS" not in plain and "FTSLURM_GRACE_S" not in plain
    assert JobEnv.from_environ(plain).straggler_interval_s == JobEnv().straggler_interval_s


def test_a_disambiguation_run_carries_its_context_to_the_rank_agent() -> None:
    """After exit 16 the daemon submits the next attempt with FTSLURM_DISAMBIGUATE (issue
    30): the batch script exports it, and the rank agent's `disambiguation()` reads it
    back; an ordinary attempt has none."""
    spec = job_spec(run_dir="/runs/r1")
    context = Disambiguation(attempt=2, nodes=("n1", "n2"), step=40)
    script, _ = build_attempt("r1", spec, {}, 3, ("n1", "n2"), (), context)
    exported = script_exports(script)
    assert EnvName.DISAMBIGUATE.value in exported
    assert JobEnv.from_environ(exported).disambiguate == context
    assert rank.disambiguation(exported) == context
    script, _ = build_attempt("r1", spec, {}, 3, ())
    assert EnvName.DISAMBIGUATE.value not in script_exports(script)
    assert rank.disambiguation(script_exports(script)) is None
    assert rank.disambiguation({}) is None


def test_a_new_job_of_a_run_leaves_out_the_injections_that_fired() -> None:
    """Each injection fires once per run (issue 25): the fault the scheduler carries out and
    the crash the ranks carried out in an earlier job are not in a fresh job's script or
    options; the straggler stays (its node stays slow)."""
    spec = job_spec(time_limit="10", inject=["node_fail@10", "crash@5:1", "straggler@2:0*3"])
    script, options = build_attempt("r1", spec, {}, 0, ())
    assert options.inject == ("node_fail@10",)
    assert JobEnv.from_environ(script_exports(script)).inject == "crash@5:1,straggler@2:0*3"
    script, options = build_attempt("r1", spec, {}, 1, (), ["node_fail@10", "crash@5:1"])
    assert options.inject == ()
    assert JobEnv.from_environ(script_exports(script)).inject == "straggler@2:0*3"


@pytest.mark.parametrize(
    "text,expected",
    [
        ("USR2", signal.SIGUSR2),
        ("usr1", signal.SIGUSR1),
        ("SIGTERM", signal.SIGTERM),
        (" sigint ", signal.SIGINT),
        (str(int(signal.SIGUSR1)), signal.SIGUSR1),
        (15, signal.SIGTERM),
    ],
)
def test_signal_names_numbers_and_the_sig_prefix(text: str | int, expected: int) -> None:
    assert parse_signal(text) == expected
    assert signal_name(text) == expected.name.removeprefix("SIG")


@pytest.mark.parametrize(
    "text", ["KILL", "SIGSTOP", "9", str(int(signal.SIGSTOP)), "USR3", "", "999"]
)
def test_uncatchable_or_unknown_signals_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="not a signal a job can catch"):
        parse_signal(text)
    with pytest.raises(ValueError, match="not a signal a job can catch"):
        FtSettings(checkpoint_signal=text)


def test_the_launchers_and_the_ranks_agree_on_the_port(monkeypatch: pytest.MonkeyPatch) -> None:
    for job, restarts in (("123456", 0), ("123456", 2), ("7", 1)):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))
        monkeypatch.setenv("MASTER_ADDR", "n1")
        endpoint = launch._endpoint(launch.parse_args(["--", "true"]))
        master = torch_env(
            {"SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": str(restarts), "SLURM_NTASKS": "2"}
        )
        assert endpoint == f"n1:{master['MASTER_PORT']}"
        assert int(master["MASTER_PORT"]) == rendezvous_port(job, restarts)
    ports = {rendezvous_port("123456", n) for n in range(10)}
    assert len(ports) == 10 and all(20000 <= p <= 59999 for p in ports)


def test_a_rank_alone_gets_a_free_port_not_the_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # another process listens on the port the job id gives (or it is taken already)
        held.bind(("", rendezvous_port("4242", 0)))
        held.listen()
    except OSError:
        pass
    try:
        port = int(torch_env({"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1"})["MASTER_PORT"])
        assert port != rendezvous_port("4242", 0)
        with socket.socket() as sock:
            sock.bind(("", port))  # free
    finally:
        held.close()
    assert torch_env({"SLURM_JOB_ID": "4242", "MASTER_PORT": "1234"})["MASTER_PORT"] == "1234"


def test_a_rendezvous_record_is_taken_only_for_its_own_job_step_and_restart() -> None:
    from ftslurm.core.contract import published_rendezvous, rendezvous_record

    record = rendezvous_record(
        host="n1",
        port=41234,
        rdzv_id="ftslurm-r-0-0-ab",
        job_id="7",
        step_id="0",
        restart_count=0,
        pid=1,
        time=0.0,
    )
    assert published_rendezvous(record, job_id="7", step_id="0", restart_count=0) == (
        "n1",
        41234,
        "ftslurm-r-0-0-ab",
    )
    for other in ({"job_id": "8"}, {"step_id": "1"}, {"restart_count": 1}):
        mine = {"job_id": "7", "step_id": "0", "restart_count": 0, **other}
        assert published_rendezvous(record, **mine) is None  # type: ignore[arg-type]
    for torn in (
        None,
        [],
        {**record, "port": 0},
        {**record, "port": "41234"},
        {**record, "host": ""},
    ):
        assert published_rendezvous(torn, job_id="7", step_id="0", restart_count=0) is None
    assert RunDir("/runs/r1").rendezvous(2, 1) == Path("/runs/r1/attempts/2/rendezvous-1.json")
    assert RunDir("/runs/r1").launcher_failed(2, 3) == Path(
        "/runs/r1/attempts/2/recovery/launcher-failed-3.json"
    )


def test_the_task_wrapper_refuses_a_bad_variable_in_one_line(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "FTSLURM_RUN_DIR": str(tmp_path),
        "FTSLURM_CHECKPOINT_SIGNAL": "KILL",
    }
    done = subprocess.run(
        [sys.executable, "-m", "ftslurm.agent.task", "--", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "ftslurm: FTSLURM_CHECKPOINT_SIGNAL='KILL': not a signal a job can catch: 'KILL'"
    ]
    assert not (tmp_path / "attempts").exists()  # the command never ran


def test_the_launcher_refuses_a_bad_variable_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FTSLURM_IN_JOB_RESTARTS", "many")
    with pytest.raises(SystemExit) as exit_:
        launch.parse_args(["--", "true"])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith(
            "error: FTSLURM_IN_JOB_RESTARTS='many': Input should be a valid integer, unable to "
            "parse string as an integer"
        )
    )


def test_a_heartbeat_folders_name_gives_its_launchers_pid():
    name = HeartbeatDir.for_launcher("/tmp", "77_3", 1, 4242).root.name + "-k2_x9q"
    assert HeartbeatDir.launcher_pid(name) == 4242
    for other in ("ftslurm-hb-77-1-x-abc", "ftslurm-hb-77", "tmpabc", "ftslurm-hb-"):
        assert HeartbeatDir.launcher_pid(other) is None, other

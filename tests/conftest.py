"""Shared fixtures: the real local Slurm cluster, a backend bound to it, job cleanup.

The cluster is started once per session (or reused when `make slurm-up` already started
it) and stopped at the end only if this session started it. Under CI (CI=true) a cluster
that cannot start is a failure, never a skip.

At the end of the session a check fails the run if a daemon, mock controller, launcher or
other ftslurm process a test started is still alive (`left_behind`): it names the test's
folder, and stops them.

A second cluster runs Slurm 24.11 (`python -m ftslurm.localcluster --version 24.11 up`).
The conformance scenarios and the CLI backend's live tests run against it too when it is
asked for (FTSLURM_SLURM_VERSIONS=22.05,24.11, as `make test` does) or already up: their
cluster parameter is `slurm` (22.05) or `slurm-24.11` (`CLUSTER_PARAMS`, `use_cluster`),
and the summary counts the tests against each release apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shlex
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis.configuration import set_hypothesis_home_dir

from ftslurm.backends.slurm_cli import CommandRunner, SlurmCliBackend
from ftslurm.core.types import JobInfo, JobState
from ftslurm.errors import InvalidJobId
from ftslurm.localcluster import ClusterError, LocalCluster

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# `make test` runs the main suite as an unprivileged user (root is Slurm's super user and
# skips the permission checks a real user meets); only fault controls act as root (sudo).
RUN_AS = pwd.getpwuid(os.geteuid()).pw_name
UNPRIVILEGED = os.geteuid() != 0
if not os.access(Path.cwd(), os.W_OK):
    # A checkout the user may read, not write: Hypothesis keeps its examples elsewhere.
    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / f"ftslurm-hypothesis-{os.geteuid()}")
SUMMARY_FILE = os.environ.get("FTSLURM_TEST_SUMMARY")  # where .ci/run reads the counts
SECOND_RELEASE = "24.11"
SECOND_ID = f"slurm-{SECOND_RELEASE}"  # the test id part, e.g. test_x[slurm-24.11]


def _second_release_wanted() -> bool:
    """Asked for by FTSLURM_SLURM_VERSIONS, or (when that is unset) already running: its
    slurmctld's pid file names a live slurmctld. Decided at collection, without a command."""
    asked = os.environ.get("FTSLURM_SLURM_VERSIONS")
    if asked is not None:
        return SECOND_RELEASE in [v.strip() for v in asked.split(",")]
    try:
        daemons = LocalCluster(version=SECOND_RELEASE).daemons()
    except ClusterError:  # e.g. an unusable cache folder: then it is not running either
        return False
    return any(d.alive for d in daemons if d.name == "slurmctld")


SECOND_WANTED = _second_release_wanted()
# The Slurm side of a test that runs on every release: 22.05 always, 24.11 when wanted.
CLUSTER_PARAMS = [pytest.param("slurm", marks=pytest.mark.slurm)] + (
    [pytest.param(SECOND_ID, marks=[pytest.mark.slurm, pytest.mark.slurm_2411])]
    if SECOND_WANTED
    else []
)


# `make test` runs the tests without a cluster in four pytests: most in the foreground;
# these slow end-to-end scenarios (they wait on the clock) in the lane of the 22.05 tests,
# after them, so that the two lanes end at about the same time; those in LANE3, which
# mostly sleep (a wall limit, a peer or start timeout, the daemon's back-off: next to no
# CPU), after the 24.11 tests, whose pytest runs beside the other two; and the few in LAST,
# whose timing suffers most under load (a preemption timed against a slow start, the
# live-recovery benchmark's figures), after the foreground's. They get the marker `lane2`,
# `lane3` or `last` here, by file and test function (every parameter of it); the markers
# only split `make test`: `pytest -m "not slurm"` still runs them. The names are checked to
# exist (tests/test_lanes.py).
LAST = {
    "test_benchmarks_smoke.py": ("test_live_recovery_benchmark_runs",),
    "test_lightning_integration.py": (
        "test_the_lightning_example_survives_a_preemption_and_a_lost_node_on_the_mock",
    ),
}
LANE3 = {
    "test_daemon_mock.py": (
        "test_a_rank_hung_at_the_wall_limit_is_a_hang_not_a_checkpointed_ending",
    ),
    "test_lost_node_mock.py": (
        "test_a_one_node_jobs_lost_node_is_acted_on_within_the_peer_timeout",
    ),
    "test_rendezvous_mock.py": (
        "test_a_launcher_whose_python_never_starts_ends_the_attempt_after_the_start_timeout",
    ),
    "test_wait_mock.py": (
        "test_wait_returns_within_seconds_of_the_end_though_the_daemon_backed_off",
    ),
}
LANE2 = {
    "test_goodput_bench.py": (
        "test_script_smoke_json_plot_and_determinism",
        "test_calibration_reproduces_kokolis_for_plain_requeue",
    ),
    "test_lightning_integration.py": (
        "test_two_ranks_on_one_node_checkpoint_on_the_signal_and_continue_on_the_mock",
    ),
    "test_live.py": (
        "test_a_replica_that_does_not_answer_in_time_falls_back_to_restarting_every_rank",
        "test_on_the_mock_a_warm_spare_lost_while_waiting_then_a_node_goes_on_in_a_new_job",
        "test_on_the_mock_the_batch_host_lost_with_live_recovery_goes_on_in_a_new_job",
        "test_on_the_mock_a_straggler_steps_out_to_a_warm_spare",
        "test_on_the_mock_a_crashed_rank_on_the_second_node_is_restarted_alone",
    ),
    "test_peers.py": (
        "test_no_node_is_reported_lost_with_every_cpu_saturated_for_six_peer_timeouts",
    ),
    "test_spares.py": ("test_on_the_mock_a_spare_replaces_a_failed_node_in_the_same_job",),
    "test_spares_bench.py": (
        "test_of_two_non_batch_nodes_judging_a_hang_the_one_whose_rank_is_stopped_steps_out",
        "test_on_the_mock_a_hung_node_is_replaced_by_the_spare_in_the_same_job",
    ),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)
        elif getattr(item, "originalname", None) in LANE2.get(item.path.name, ()):
            item.add_marker(pytest.mark.lane2)
        elif getattr(item, "originalname", None) in LANE3.get(item.path.name, ()):
            item.add_marker(pytest.mark.lane3)
        elif getattr(item, "originalname", None) in LAST.get(item.path.name, ()):
            item.add_marker(pytest.mark.last)


LOG_SUFFIXES = (".log", ".out", ".err")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that ran jobs leaves their logs in its report: the tail of every log
    under its tmp_path (launcher, job and daemon output) and, when it used a local cluster,
    the tail of the Slurm daemons' logs: for a failure seen only in CI."""
    report = yield
    if not report.failed:
        return report

    def add_tail(title: str, path: Path) -> None:
        with contextlib.suppress(OSError):
            tail = path.read_text(errors="replace").splitlines()[-40:]
            report.sections.append((title, "\n".join(tail)))

    funcargs = getattr(item, "funcargs", {})
    tmp = funcargs.get("tmp_path")
    if isinstance(tmp, Path) and tmp.is_dir():
        logs = sorted(p for p in tmp.rglob("*") if p.suffix in LOG_SUFFIXES and p.is_file())
        for path in logs[:20]:
            add_tail(f"log {path.relative_to(tmp)}", path)
    clusters = {id(v): v for v in funcargs.values() if isinstance(v, LocalCluster)}
    for cluster in clusters.values():
        for path in sorted(cluster.layout.log_dir.glob("slurm*.log")):
            add_tail(f"Slurm {cluster.version} {path.name}", path)
    return report


class Measurements:
    """Numbers tests measure on the real cluster, printed at the end of the run."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def record(self, name: str, value: float) -> None:
        self.values[name] = value
        print(f"[measure] {name} = {value:.2f}")


_MEASUREMENTS = Measurements()


@pytest.fixture(scope="session")
def measurements() -> Measurements:
    return _MEASUREMENTS


def _session_cluster(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """Start `cluster` unless it is up; stop it afterwards only if it was started here."""
    started_here = False
    try:
        if not cluster.is_up():
            cluster.up(timeout=180)
            started_here = True
        else:
            cluster.wait_nodes_idle(timeout=120)
    except (ClusterError, OSError) as exc:
        what = f"the local Slurm {cluster.version} cluster"
        if IN_CI:
            pytest.fail(f"{what} did not start under CI: {exc}", pytrace=False)
        pytest.skip(f"no {what}: {exc}")
    yield cluster
    if started_here and not os.environ.get("FTSLURM_KEEP_CLUSTER"):
        cluster.down()


@pytest.fixture(scope="session")
def slurm_cluster_2205() -> Iterator[LocalCluster]:
    """The host's Slurm (22.05); SLURM_CONF points at it for the whole session."""
    gen = _session_cluster(LocalCluster())
    cluster = next(gen)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.layout.slurm_conf)
    yield cluster
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    next(gen, None)


@pytest.fixture(scope="session")
def slurm_cluster_2411() -> Iterator[LocalCluster]:
    """The Slurm 24.11 cluster (chroot); tests select it with `use_cluster`."""
    yield from _session_cluster(LocalCluster(version=SECOND_RELEASE))


@pytest.fixture(scope="session")
def slurm_cluster(slurm_cluster_2205: LocalCluster) -> LocalCluster:
    """The cluster most tests use: the host's 22.05 (jobs there can run this project's
    Python; the 24.11 chroot has no Python, so only CLI-level suites run on both)."""
    return slurm_cluster_2205


def use_cluster(
    request: pytest.FixtureRequest, param: str, monkeypatch: pytest.MonkeyPatch
) -> LocalCluster:
    """The cluster of a `CLUSTER_PARAMS` value; for 24.11 its SLURM_CONF and wrapper folder
    are this test's environment (put back afterwards), so every client call reaches it."""
    if param != SECOND_ID:
        return request.getfixturevalue("slurm_cluster_2205")
    cluster = request.getfixturevalue("slurm_cluster_2411")
    env = cluster.env()
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    monkeypatch.setenv("PATH", env["PATH"])
    return cluster


@pytest.fixture
def backend(slurm_cluster: LocalCluster, tmp_path, monkeypatch) -> SlurmCliBackend:
    monkeypatch.chdir(tmp_path)  # jobs' default output files land in the test's folder
    return SlurmCliBackend(CommandRunner(timeout_s=30))


@pytest.fixture
def jobs(backend: SlurmCliBackend) -> Iterator[list[str]]:
    """Collects job ids a test submits; cancels them all afterwards (runs in tmp_path)."""
    ids: list[str] = []
    yield ids
    for job_id in ids:
        with contextlib.suppress(InvalidJobId):  # aged out of the controller: nothing to do
            backend.cancel(job_id)


@contextlib.contextmanager
def nodes_kept_healthy(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """Every node of `cluster` is idle before, and back up and idle after."""
    cluster.wait_nodes_idle(timeout=120)
    yield cluster
    states = cluster.node_states()
    for node in cluster.layout.node_names:
        if states.get(node, "").startswith(("down", "drain", "fail")) or not any(
            d.alive for d in cluster.daemons() if d.name == f"slurmd-{node}"
        ):
            cluster.revive_node(node)
    cluster.wait_nodes_idle(timeout=120)


@pytest.fixture
def healthy_nodes(slurm_cluster: LocalCluster) -> Iterator[LocalCluster]:
    """For tests that break nodes: every node is back up and idle afterwards."""
    with nodes_kept_healthy(slurm_cluster) as cluster:
        yield cluster


def wait_job(
    backend: SlurmCliBackend,
    job_id: str,
    cond: Callable[[JobInfo], bool],
    timeout: float,
    what: str = "condition",
    interval: float = 0.5,
) -> JobInfo:
    """Poll `backend.query` until `cond(info)` holds; fail with the last observation."""
    deadline = time.monotonic() + timeout
    info = None
    while time.monotonic() < deadline:
        info = backend.query([job_id])[job_id]
        if cond(info):
            return info
        time.sleep(interval)
    pytest.fail(f"job {job_id}: {what} not reached within {timeout:.0f}s; last seen {info}")


def in_state(*states: JobState) -> Callable[[JobInfo], bool]:
    return lambda info: info.state in states


def proc_state(pid: int) -> str:
    """A process's state letter (R, S, T, Z, ...) from /proc; "?" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "?"


def wait_for(
    condition: Callable[[], Any],
    timeout: float = 15.0,
    what: str = "condition",
    interval: float = 0.02,
) -> Any:
    """Poll `condition` every `interval` seconds until it returns something true; fail after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def wait_file(path: Path, cond: Callable[[str], bool], timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if cond(text):
            return text
        time.sleep(0.2)
    pytest.fail(f"{what} not seen in {path} within {timeout:.0f}s; content: {text!r}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    def count(outcome: str, second: bool) -> int:
        return sum(
            1
            for r in terminalreporter.stats.get(outcome, [])
            if "slurm" in r.keywords and ("slurm_2411" in r.keywords) == second
        )

    counts = {
        f"{prefix}_{outcome}": count(outcome, second)
        for prefix, second in (("slurm", False), ("slurm_2411", True))
        for outcome in ("passed", "failed", "skipped")
    }
    terminalreporter.write_sep("=", "real Slurm clusters")
    terminalreporter.write_line(
        f"tests against the real Slurm cluster 22.05: {counts['slurm_passed']} passed, "
        f"{counts['slurm_failed']} failed, {counts['slurm_skipped']} skipped"
    )
    terminalreporter.write_line(
        f"tests against the real Slurm cluster {SECOND_RELEASE}: "
        f"{counts['slurm_2411_passed']} passed, {counts['slurm_2411_failed']} failed, "
        f"{counts['slurm_2411_skipped']} skipped"
        + ("" if SECOND_WANTED else " (not asked for: FTSLURM_SLURM_VERSIONS)")
    )
    ran = sum(len(terminalreporter.stats.get(o, [])) for o in ("passed", "failed"))
    terminalreporter.write_line(
        f"run as {RUN_AS} ({'unprivileged' if UNPRIVILEGED else 'root'}): {ran} tests, "
        f"{counts['slurm_passed'] + counts['slurm_2411_passed']} of them passed on a real "
        "cluster"
    )
    for name, value in sorted(_MEASUREMENTS.values.items()):
        terminalreporter.write_line(f"  {name}: {value:.2f}")
    _report_left_behind(terminalreporter)
    if SUMMARY_FILE:
        Path(SUMMARY_FILE).write_text(
            json.dumps(
                {
                    **counts,
                    "slurm_2411_wanted": SECOND_WANTED,
                    "measurements": _MEASUREMENTS.values,
                    "user": RUN_AS,
                    "unprivileged": UNPRIVILEGED,
                    "passed": len(terminalreporter.stats.get("passed", [])),
                }
            )
        )


# ------------------------------------------------------------------- left-behind processes
# Every test that starts a daemon, mock controller or launcher stops it, also when it fails.
# A process of ftslurm (its command line names it: `ftslurm daemon run`, the mock
# controller, a mock job, a launcher, a task wrapper) is the session's when its command
# line, its state folders (FTSLURM_HOME, FTSLURM_MOCK_HOME, FTSLURM_RUN_DIR) or its working
# directory lie under this session's base temporary folder, whose first component is the
# folder of the test that started it. Those still alive at the end (after a grace for the
# ones a last teardown is ending) fail the run and are stopped, SIGTERM then SIGKILL.
LEAK_GRACE_S = float(os.environ.get("FTSLURM_TEST_LEAK_GRACE_S", "10"))
_STATE_VARS = ("FTSLURM_HOME", "FTSLURM_MOCK_HOME", "FTSLURM_RUN_DIR")
_KINDS = (
    ("ftslurm daemon run", "daemon"),
    ("ftslurm.backends.mock.controller", "mock controller"),
    ("ftslurm.agent.launch", "launcher"),
    ("ftslurm.backends.mock.jobwrap", "mock job"),
    ("ftslurm.backends.mock.srun", "mock srun"),
    ("ftslurm.agent.task", "task wrapper"),
)
_LEFT: list[str] = []  # what the check found, for the summary


def _test_folder(text: str, base: str) -> str | None:
    """The first component under `base` of a path in `text` (an argument may hold a path
    inside a longer string), or None."""
    at = text.find(base + os.sep)
    if at < 0:
        return None
    words = text[at + len(base) + 1 :].split(os.sep, 1)[0].split()
    return words[0] if words else None


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (children, their children, ...)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, todo = [pid], [pid]
    while todo:
        up = todo.pop()
        below = [p for p, pp in parent.items() if pp == up]
        found += below
        todo += below
    return found


def left_behind(base: Path) -> list[tuple[int, str, str]]:
    """The live ftslurm processes of the session whose base temporary folder is `base`:
    (pid, what it is, the test's folder), this process and its ancestors left out."""
    found = []
    mine, root = _ancestors(), str(base)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            args = [
                a.decode(errors="replace")
                for a in (entry / "cmdline").read_bytes().split(b"\0")
                if a
            ]
        except OSError:
            continue
        line = " ".join(args)
        if "ftslurm" not in line:  # (a zombie's command line is empty: not alive)
            continue
        places = list(args)
        with contextlib.suppress(OSError):
            for item in (entry / "environ").read_bytes().split(b"\0"):
                key, _, value = item.decode(errors="replace").partition("=")
                if key in _STATE_VARS:
                    places.append(value)
        with contextlib.suppress(OSError):
            places.append(os.readlink(entry / "cwd"))
        folder = next((f for f in (_test_folder(p, root) for p in places) if f), None)
        if folder is not None:
            what = next((kind for marker, kind in _KINDS if marker in line), "ftslurm process")
            found.append((int(entry.name), what, folder))
    return found


def _stop(pids: list[int], timeout: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(
            Path(f"/proc/{p}/cmdline").exists() and Path(f"/proc/{p}/cmdline").read_bytes()
            for p in pids
        ):
            time.sleep(0.1)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Fail the run when a test left an ftslurm process alive (see `left_behind`)."""
    if hasattr(session.config, "workerinput") or not Path("/proc").is_dir():
        return  # an xdist worker: the controller looks under the base of all of them
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None:
        return
    base = factory.getbasetemp().resolve()
    deadline = time.monotonic() + LEAK_GRACE_S
    left = left_behind(base)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = left_behind(base)
    if not left:
        return
    _stop([pid for pid, _, _ in left])
    _LEFT.extend(
        f"{what} pid {pid}, of the test folder {base / folder}" for pid, what, folder in left
    )
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _report_left_behind(terminalreporter) -> None:
    if not _LEFT:
        return
    terminalreporter.write_sep("=", "processes left behind by tests (now stopped)", red=True)
    for line in _LEFT:
        terminalreporter.write_line(line)
    terminalreporter.write_line(
        "FAILED: every test that starts a daemon, mock controller or "
        "launcher must stop it, also when it fails"
    )


def job_spec(
    *, inject: tuple[str, ...] | list[str] = (), run_dir: str = "/runs/r1", **options: Any
) -> dict[str, Any]:
    """A run's stored job spec (what `build_attempt` renders), `options` over typical ones."""
    return {
        "options": {
            "name": None,
            "nodes": 2,
            "ntasks_per_node": 1,
            "cpus_per_task": 1,
            "gpus_per_node": None,
            "time_limit": "1:00:00",
            "partition": None,
            "account": None,
            "exclude": [],
            "extra": {},
            **options,
        },
        "run_dir": run_dir,
        "checkpoint_dir": "/ck",
        "workdir": "/w",
        "setup": [],
        "env": {},
        "inject": list(inject),
        "python": "/usr/bin/python3",
        "command": ["train.py"],
    }


def script_exports(script: str) -> dict[str, str]:
    """The FTSLURM_* variables a batch script exports (the computed ones left out)."""
    out = {}
    for line in script.splitlines():
        if line.startswith("export FTSLURM_") and "$((" not in line:
            key, _, value = line.removeprefix("export ").partition("=")
            out[key] = shlex.split(value)[0] if value else ""
    return out

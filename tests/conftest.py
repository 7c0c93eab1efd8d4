"""Shared fixtures: the real local Slurm cluster, a backend bound to it, job cleanup.

The cluster is started once per session (or reused when `make slurm-up` already started
it) and stopped at the end only if this session started it. Under CI (CI=true) a cluster
that cannot start is a failure, never a skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ftslurm.backends.slurm_cli import CommandRunner, SlurmCliBackend
from ftslurm.core.types import JobInfo, JobState
from ftslurm.errors import InvalidJobId
from ftslurm.localcluster import ClusterError, LocalCluster

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SUMMARY_FILE = os.environ.get("FTSLURM_TEST_SUMMARY")  # where .ci/run reads the counts


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)


LOG_SUFFIXES = (".log", ".out", ".err")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that ran jobs leaves their logs in its report: the tail of every log
    under its tmp_path (launcher, job and daemon output), for a failure seen only in CI."""
    report = yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and isinstance(tmp, Path) and tmp.is_dir():
        logs = sorted(p for p in tmp.rglob("*") if p.suffix in LOG_SUFFIXES and p.is_file())
        for path in logs[:20]:
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-40:]
                report.sections.append((f"log {path.relative_to(tmp)}", "\n".join(tail)))
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


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[LocalCluster]:
    cluster = LocalCluster()
    started_here = False
    try:
        if not cluster.is_up():
            cluster.up(timeout=180)
            started_here = True
        else:
            cluster.wait_nodes_idle(timeout=120)
    except (ClusterError, OSError) as exc:
        if IN_CI:
            pytest.fail(f"the local Slurm cluster did not start under CI: {exc}", pytrace=False)
        pytest.skip(f"no local Slurm cluster: {exc}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.layout.slurm_conf)
    yield cluster
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    if started_here and not os.environ.get("FTSLURM_KEEP_CLUSTER"):
        cluster.down()


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


@pytest.fixture
def healthy_nodes(slurm_cluster: LocalCluster) -> Iterator[LocalCluster]:
    """For tests that break nodes: every node is back up and idle afterwards."""
    slurm_cluster.wait_nodes_idle(timeout=120)
    yield slurm_cluster
    states = slurm_cluster.node_states()
    for node in slurm_cluster.layout.node_names:
        if states.get(node, "").startswith(("down", "drain", "fail")) or \
                not any(d.alive for d in slurm_cluster.daemons() if d.name == f"slurmd-{node}"):
            slurm_cluster.revive_node(node)
    slurm_cluster.wait_nodes_idle(timeout=120)


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


def wait_for(condition: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Poll `condition` until it returns something true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
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
    passed = [r for r in terminalreporter.stats.get("passed", []) if "slurm" in r.keywords]
    failed = [r for r in terminalreporter.stats.get("failed", []) if "slurm" in r.keywords]
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "slurm" in r.keywords]
    terminalreporter.write_sep("=", "real Slurm cluster")
    terminalreporter.write_line(
        f"tests against the real Slurm cluster: {len(passed)} passed, {len(failed)} failed, "
        f"{len(skipped)} skipped"
    )
    for name, value in sorted(_MEASUREMENTS.values.items()):
        terminalreporter.write_line(f"  {name}: {value:.2f}")
    if SUMMARY_FILE:
        Path(SUMMARY_FILE).write_text(json.dumps({
            "slurm_passed": len(passed), "slurm_failed": len(failed),
            "slurm_skipped": len(skipped), "measurements": _MEASUREMENTS.values,
        }))  # fmt: skip

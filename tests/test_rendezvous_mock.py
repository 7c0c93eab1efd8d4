"""The rendezvous on the mock scheduler, end to end (daemon, mock jobs, launchers): runs of
two mock clusters on one machine at once, a run whose job's derived port another process
holds (with the launcher and without), and a launcher that fails at the rendezvous (the
attempt ends at once, its error in the reason)."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftslurm.core.contract import RunDir, rendezvous_port
from ftslurm.daemon.store import Store

from .daemon_scenarios import Cli

TRAIN = r"""
import time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
for _ in range(10):
    t = torch.ones(1); dist.all_reduce(t); time.sleep(0.05)
assert t.item() == dist.get_world_size()
print(f"rank {dist.get_rank()} done", flush=True)
dist.destroy_process_group()
"""


def ended_event(home: Path, run_id: str, attempt: int) -> Any:
    """The daemon's "ended" event of one attempt of a run (exactly one)."""
    store = Store(home)
    try:
        (ending,) = [
            e for e in store.events(run_id) if e.kind == "ended" and e.data["attempt"] == attempt
        ]
    finally:
        store.close()
    return ending


def ended(s: dict) -> bool:
    return s["state"] in ("COMPLETED", "FAILED", "CANCELLED")


def mock_cli(tmp_path: Path, name: str, **config: object) -> Iterator[Cli]:
    """A state directory and a mock cluster of its own (KillWait 5 s); both stopped after."""
    c = Cli(
        tmp_path / name / "home",
        env={"FTSLURM_MOCK_HOME": str(tmp_path / name / "mock")},
        cwd=tmp_path,
    )
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"kill_wait_s": 5, **config}))
    c("mock", "up", "--config", str(path))
    try:
        yield c
    finally:
        c.stop_daemon()
        c("mock", "destroy", check=False)


@pytest.fixture
def first(tmp_path) -> Iterator[Cli]:
    yield from mock_cli(tmp_path, "a")


@pytest.fixture
def second(tmp_path) -> Iterator[Cli]:
    yield from mock_cli(tmp_path, "b")


@pytest.fixture
def train(tmp_path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


def test_two_mock_clusters_on_one_machine_run_two_node_jobs_at_once(first, second, train):
    runs = [
        (c, c.submit("--dry-run", "--retries", "0", "-N", "2", "-t", "5", str(train)))
        for c in (first, second)
    ]
    for c, out in runs:
        s = c.wait_for(out["run_id"], ended, 240, "the run to end")
        assert s["state"] == "COMPLETED", s
    jobs = [c.summary(out["run_id"])["attempts"][0]["job_id"] for c, out in runs]
    assert jobs[0] != jobs[1]  # each mock cluster numbers its jobs from an id of its own


def test_a_run_completes_while_another_process_listens_on_its_jobs_port(tmp_path, train):
    for c in mock_cli(tmp_path, "fixed", first_job_id=777000):
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:  # the port the job id gives (or it is taken already, which is the same)
            held.bind(("", rendezvous_port("777000", 0)))
            held.listen()
        except OSError:
            pass
        try:
            out = c.submit("--dry-run", "--retries", "0", "-N", "2", "-t", "5", str(train))
            s = c.wait_for(out["run_id"], ended, 240, "the run to end")
        finally:
            held.close()
        assert s["state"] == "COMPLETED", s
        assert s["attempts"][0]["job_id"] == "777000", s


def test_ranks_without_the_launcher_complete_while_another_process_listens_on_its_jobs_port(
    tmp_path, train
):
    recipe = tmp_path / "plain_ranks.py"
    recipe.write_text(f"""import ftslurm
recipe = ftslurm.Recipe(nodes=2, time="5", command=[{sys.executable!r}, {str(train)!r}],
    use_launcher=False)
""")
    for c in mock_cli(tmp_path, "plain", first_job_id=778000):
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:  # the port the job id gives (or it is taken already, which is the same)
            held.bind(("", rendezvous_port("778000", 0)))
            held.listen()
        except OSError:
            pass
        try:
            out = c.submit("--dry-run", "--retries", "0", str(recipe))
            s = c.wait_for(out["run_id"], ended, 240, "the run to end")
        finally:
            held.close()
        assert s["state"] == "COMPLETED", s
        assert s["attempts"][0]["job_id"] == "778000", s
        # rank 0's wrapper bound a port and published it; the other rank took it from there
        record = json.loads(RunDir(s["run_dir"]).rendezvous(0, 0).read_text())
        assert record["port"] != rendezvous_port("778000", 0), record
        assert record["job_id"] == "778000" and "-task-" in record["id"], record


def test_each_node_of_a_job_without_the_launcher_leaves_a_node_report(first, tmp_path):
    """Without the launcher, each node's first task writes the node's report (what a
    launcher writes, `RunDir.node_report`) from its node's rank reports: two nodes of two
    tasks, the second task of each ending later than the first, which waits for it."""
    recipe = tmp_path / "plain_nodes.py"
    late = "import os, time; time.sleep(0.5 * int(os.environ['SLURM_LOCALID']))"
    recipe.write_text(f"""import ftslurm
recipe = ftslurm.Recipe(nodes=2, ntasks_per_node=2, time="5",
    command=[{sys.executable!r}, "-c", {late!r}], use_launcher=False)
""")
    out = first.submit("--dry-run", "--retries", "0", str(recipe))
    s = first.wait_for(out["run_id"], ended, 240, "the run to end")
    assert s["state"] == "COMPLETED", s
    run = RunDir(s["run_dir"])
    ranks = {
        r["rank"]: r
        for r in map(json.loads, map(Path.read_text, run.attempt(0).glob("rank-*.json")))
    }
    assert sorted(ranks) == [0, 1, 2, 3], ranks
    for node_rank in (0, 1):
        report = json.loads(run.node_report(0, node_rank).read_text())
        assert report["node_rank"] == node_rank and report["attempt"] == 0, report
        assert report["job_id"] == s["attempts"][0]["job_id"], report
        assert report["node"] == ranks[2 * node_rank]["node"], (report, ranks)
        assert report["outcome"] == "finished" and report["exit_code"] == 0, report
        # written once the node's later task had reported too
        assert report["ended_at"] >= ranks[2 * node_rank + 1]["ended_at"], (report, ranks)


def test_a_launcher_failing_at_the_rendezvous_ends_the_attempt_at_once(first, tmp_path, train):
    recipe = tmp_path / "failing_recipe.py"
    # In attempt 0 a folder takes the place of the rendezvous record: node 0's launcher
    # cannot publish the port it bound and fails; the retry runs as usual.
    recipe.write_text(f"""import ftslurm
recipe = ftslurm.Recipe(nodes=2, time="5", command=[{sys.executable!r}, {str(train)!r}],
    setup=['[ "$FTSLURM_ATTEMPT" != 0 ] || mkdir -p '
           '"$FTSLURM_RUN_DIR/attempts/0/rendezvous-${{SLURM_RESTART_COUNT:-0}}.json"'])
""")
    out = first.submit("--dry-run", "--retries", "1", str(recipe))
    s = first.wait_for(
        out["run_id"],
        lambda s: s["attempts"][0]["state"] not in ("PENDING", "SUBMITTING", "RUNNING"),
        120,
        "attempt 0 to end",
    )
    failed = s["attempts"][0]
    assert failed["state"] == "FAILED" and failed["cause"] == "crash", s
    assert "a launcher failed before its ranks started" in failed["reason"], failed
    assert "node rank 0, in the rendezvous" in failed["reason"], failed
    assert "IsADirectoryError" in failed["reason"], failed
    # The daemon ended the attempt within seconds of the failure's record (its 1 s look at
    # the recovery folder), not when the other launcher's rendezvous (300 s), srun --wait
    # (180 s) or the daemon's next cycle (backed off up to 60 s) would have.
    record = json.loads(RunDir(s["run_dir"]).launcher_failed(0, 0).read_text())
    ending = ended_event(first.home, out["run_id"], 0)
    assert ending.time - record["time"] < 20, (ending, record)
    s = first.wait_for(out["run_id"], ended, 240, "the run to end")
    assert s["state"] == "COMPLETED" and len(s["attempts"]) == 2, s


def test_a_launcher_whose_python_never_starts_ends_the_attempt_after_the_start_timeout(
    first, tmp_path, train
):
    """In attempt 0 the Python of node rank 0's launcher dies before it runs a line of
    ftslurm (a `sitecustomize` the setup lines put on its path exits at once): no lease, no
    report, nothing written. The other node's launcher waits at the rendezvous, and srun's
    --wait (grace + 60 s = 180 s) or that rendezvous's timeout (300 s) were the old bounds.
    The daemon ends the attempt once `launcher_start_timeout_s` (30 s here: the retry's
    launchers import torch on a loaded machine within it) passed after the batch script
    started the step, saying the launcher never started on that node; the retry completes."""
    dies = tmp_path / "dies"
    dies.mkdir()
    (dies / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('SLURM_STEP_ID') is not None "
        "and os.environ.get('SLURM_NODEID') == '0':\n"
        "    os._exit(1)\n"
    )
    recipe = tmp_path / "never_starts.py"
    line = f'[ "$FTSLURM_ATTEMPT" != 0 ] || export PYTHONPATH="{dies}${{PYTHONPATH:+:$PYTHONPATH}}"'
    recipe.write_text(f"""import ftslurm
recipe = ftslurm.Recipe(nodes=2, time="5", command=[{sys.executable!r}, {str(train)!r}],
    launcher_start_timeout_s=30, setup=[{line!r}])
""")
    out = first.submit("--dry-run", "--retries", "1", str(recipe))
    s = first.wait_for(
        out["run_id"],
        lambda s: s["attempts"][0]["state"] not in ("PENDING", "SUBMITTING", "RUNNING"),
        170,  # under srun's --wait (180 s), the old bound
        "attempt 0 to end",
    )
    failed = s["attempts"][0]
    assert failed["state"] == "FAILED", s
    assert "the launcher never started on node" in failed["reason"], failed
    assert "(node rank 0): no sign of it 30 s after the job's step started" in failed["reason"]
    run = RunDir(s["run_dir"])
    assert not run.peer_lease(0, 0).exists() and not run.node_report(0, 0).exists()
    assert run.launched(0).exists()
    ending = ended_event(first.home, out["run_id"], 0)
    assert ending.data["launcher_failed"]["phase"] == "start", ending
    # ended a few seconds after the start timeout, far under the old bounds (180 s, 300 s)
    assert ending.time - failed["start"] < 100, (ending, failed)
    s = first.wait_for(out["run_id"], ended, 240, "the run to end")
    assert s["state"] == "COMPLETED" and len(s["attempts"]) == 2, s

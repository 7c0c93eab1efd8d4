"""submitit's executor plugin (`ftslurm.integrations.submitit`): `submitit.AutoExecutor(
folder, cluster="ftslurm")` submits through the daemon, on the mock scheduler (dry run) and
on the real local cluster, and submitit's Job API behaves as in submitit.

submitit finds plugins through the `submitit` entry points of installed distributions.
The `plugin` fixture uses the real mechanism whichever way ftslurm is installed: when the
installed ftslurm has no entry points yet (an editable install made before the plugin),
it installs the ones pyproject.toml declares as a distribution's metadata on sys.path,
which submitit's discovery (importlib.metadata) then reads as it would an installed one.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import cloudpickle
import pytest
import submitit
from submitit.core import plugins, utils

from ftslurm.core.contract import EnvName
from ftslurm.daemon.records import Run, RunState
from ftslurm.daemon.store import Store
from ftslurm.integrations import submitit as plugin_module
from ftslurm.integrations.submitit import FtslurmExecutor, FtslurmJob, submitit_state
from ftslurm.paths import HOME_ENV

from . import submitit_callables as callables
from .daemon_scenarios import Cli, daemon_cli, daemon_cli_on_a_mock, ended

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

ROOT = Path(__file__).resolve().parent.parent


def declared_entry_points() -> dict[str, str]:
    """The `[project.entry-points.submitit]` table of pyproject.toml (read as lines: no
    TOML parser on Python 3.10)."""
    found: dict[str, str] = {}
    inside = False
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            inside = stripped == "[project.entry-points.submitit]"
        elif inside and "=" in stripped and not stripped.startswith("#"):
            key, value = (part.strip() for part in stripped.split("=", 1))
            found[key] = value.strip('"')
    return found


def _clear_submitit_caches() -> None:
    plugins._get_plugins.cache_clear()
    plugins.get_executors.cache_clear()
    plugins.get_job_environments.cache_clear()


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> Iterator[None]:
    """submitit knows the plugin through entry points (installed, or pyproject's)."""
    _clear_submitit_caches()
    site = None
    if "ftslurm" not in plugins.get_executors():
        site = tmp_path_factory.mktemp("site")
        info = site / "ftslurm_entry_points-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: ftslurm-entry-points\nVersion: 0\n"
        )
        lines = "".join(f"{k} = {v}\n" for k, v in declared_entry_points().items())
        (info / "entry_points.txt").write_text(f"[submitit]\n{lines}")
        sys.path.append(str(site))
        importlib.invalidate_caches()
        _clear_submitit_caches()
    yield
    if site is not None:
        sys.path.remove(str(site))
        importlib.invalidate_caches()
    _clear_submitit_caches()


# ---------------------------------------------------------------------- no cluster
def test_pyproject_declares_the_executor_and_the_job_environment():
    assert declared_entry_points() == {
        "executor": "ftslurm.integrations.submitit:FtslurmExecutor",
        "job_environment": "ftslurm.integrations.submitit:FtslurmJobEnvironment",
    }


def test_auto_executor_finds_the_plugin_and_translates_submitits_parameters(plugin, tmp_path):
    assert plugins.get_executors()["ftslurm"] is FtslurmExecutor
    import ftslurm

    assert ftslurm.SubmititExecutor is FtslurmExecutor
    executor = submitit.AutoExecutor(tmp_path / "%j", cluster="ftslurm", ftslurm_dry_run=True)
    assert isinstance(executor._executor, FtslurmExecutor)
    executor.update_parameters(
        timeout_min=90,
        mem_gb=2,
        nodes=2,
        tasks_per_node=2,
        cpus_per_task=3,
        name="train",
        slurm_partition="ignored: another cluster's",
        ftslurm_retries=3,
        ftslurm_preempt_time=120,
        ftslurm_partition="gpu",
        ftslurm_additional_parameters={"qos": "high"},
    )
    assert executor._executor.recipe() == {
        "name": "train",
        "nodes": 2,
        "ntasks_per_node": 2,
        "cpus_per_task": 3,
        "time": "90",
        "partition": "gpu",
        "num_job_retries_on_failure": 3,
        "preempt_time": 120,
        "sbatch_extra": {"qos": "high", "mem": "2048M"},
    }
    assert executor._executor._num_tasks() == 4
    command = executor._executor._make_submission_command(Path("r.py"))
    assert command[1:] == ["-m", "ftslurm", "submit", "--json", "--dry-run", "r.py"]
    # submitit's own check of the names, and ftslurm's of the values: one line each
    with pytest.raises(NameError, match="Unknown argument 'bogus' for executor 'ftslurm'"):
        executor.update_parameters(ftslurm_bogus=1)
    with pytest.raises(ValueError) as refused:
        executor.update_parameters(ftslurm_preempt_time=6000)
    assert "\n" not in str(refused.value) and "preempt" in str(refused.value)
    assert executor._executor.recipe()["preempt_time"] == 120  # refused whole
    with pytest.raises(ValueError, match="unknown injection kind"):
        FtslurmExecutor(tmp_path, inject=["fire@10"])


def test_the_job_environment_inside_an_ftslurm_job(plugin, tmp_path, monkeypatch):
    """`submitit.JobEnvironment()` in a rank: the run id, the launcher's ranks and nodes."""
    for name, value in {
        "SUBMITIT_EXECUTOR": "ftslurm",
        "SUBMITIT_FOLDER": str(tmp_path / "%j"),
        EnvName.RUN_ID.value: "abc123",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "SLURM_JOB_NODELIST": "n[1-2]",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("_TEST_CLUSTER_", raising=False)
    env = submitit.JobEnvironment()
    assert isinstance(env, plugin_module.FtslurmJobEnvironment)
    assert (env.job_id, env.global_rank, env.local_rank) == ("abc123", 3, 1)
    assert (env.num_tasks, env.num_nodes, env.node) == (4, 2, 1)
    assert list(env.hostnames) == ["n1", "n2"]
    assert env.paths.result_pickle == tmp_path / "abc123" / "abc123_3_result.pkl"


@pytest.mark.parametrize(
    ("run", "attempt", "shown"),
    [
        ("PENDING", None, "PENDING"),
        ("PENDING", "SUBMITTING", "PENDING"),
        ("PENDING", "RUNNING", "RUNNING"),
        ("RUNNING", "RUNNING", "RUNNING"),
        ("RUNNING", "COMPLETED", "PENDING"),  # between two attempts
        ("RUNNING", "REQUEUING", "PENDING"),
        ("COMPLETED", "COMPLETED", "COMPLETED"),
        ("FAILED", "NODE_FAIL", "FAILED"),
        ("CANCELLED", "RUNNING", "CANCELLED"),
    ],
)
def test_submitit_sees_the_runs_state(run, attempt, shown):
    assert submitit_state(run, attempt) == shown


def test_an_error_the_daemon_retries_is_not_the_end_of_the_job(tmp_path, monkeypatch):
    """An attempt's stored error leaves the job running while the run goes on; once the run
    ended FAILED the error is the job's exception; a stored success ends the job at once."""
    home = tmp_path / "home"
    monkeypatch.setenv(HOME_ENV, str(home))
    ids = [uuid.uuid4().hex[:10] for _ in range(2)]  # the watcher is shared by all jobs
    with Store(home) as store:
        for run_id, state in zip(ids, (RunState.RUNNING, RunState.FAILED), strict=True):
            store.add_run(Run(run_id, run_id, state, 1.0, spec={}, settings={}))
    folder = tmp_path / "jobs"
    going, ended = (FtslurmJob(folder, run_id) for run_id in ids)
    for job in (going, ended):
        job.paths.folder.mkdir(parents=True, exist_ok=True)
        utils.cloudpickle_dump(("error", "Traceback: boom"), job.paths.result_pickle)
    assert not going.done(force_check=True) and going.state == "PENDING"  # no attempt runs
    assert ended.done(force_check=True) and ended.state == "FAILED"
    exc = ended.exception()
    assert isinstance(exc, utils.FailedJobError) and "boom" in str(exc)
    utils.cloudpickle_dump(("success", 42), going.paths.result_pickle)  # a retry succeeded
    assert going.done() and going.result() == 42


# ---------------------------------------------------------------------- mock scheduler
@pytest.fixture
def mock_cli(tmp_path, monkeypatch) -> Iterator[Cli]:
    """A mock cluster noticing failed nodes in 2 s, the state directory the executor's
    `ftslurm submit` and the Job's reads use; afterwards runs cancelled, daemon stopped."""
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv("FTSLURM_MOCK_HOME", str(tmp_path / "mock"))
    monkeypatch.chdir(tmp_path)
    yield from daemon_cli_on_a_mock(tmp_path)


@pytest.fixture
def by_value() -> Iterator[None]:
    """The callables travel in the pickle: the jobs need not import the tests."""
    cloudpickle.register_pickle_by_value(callables)
    yield
    cloudpickle.unregister_pickle_by_value(callables)


def wait_until(pred: Callable[[], bool], timeout: float, what: str, job=None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            extra = callables.describe(job) if job is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{extra}")
        time.sleep(0.5)


@pytest.mark.slow
def test_cancel_ends_the_run_cancelled_on_the_mock(plugin, mock_cli, by_value, tmp_path):
    executor = FtslurmExecutor(tmp_path / "jobs", dry_run=True, timeout_min=10)
    job = executor.submit(callables.Counter(), 10**6, 0.1)
    wait_until(lambda: job.state == "RUNNING", 120, "the job to run", job)
    started = f"job {job.job_id} rank 0/1 starting at step 0"
    wait_until(lambda: started in (job.stdout() or ""), 120, "the call to start", job)
    job.cancel()
    wait_until(lambda: job.done(force_check=True), 90, "the run to end", job)
    assert job.state == "CANCELLED", callables.describe(job)
    assert mock_cli.status(job.job_id)["state"] == "CANCELLED"


# ---------------------------------------------------------------------- real cluster
@pytest.fixture
def slurm_cli(healthy_nodes, tmp_path, monkeypatch) -> Iterator[Cli]:
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    yield from daemon_cli(tmp_path)


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_checkpointable_survives_a_wall_limit_and_a_node_failure_on_slurm(
    plugin, slurm_cli, healthy_nodes, by_value, tmp_path
):
    """A one-minute wall limit: the checkpoint signal 30 s before it stores a continuation;
    the attempt that resumed it loses its node (slurmd killed); a later attempt on another
    node resumes and the job returns the value of an uninterrupted run."""
    steps = 600  # 60 s of steps: beyond the first attempt's 30 s and the second's
    executor = submitit.AutoExecutor(tmp_path / "jobs" / "%j", cluster="ftslurm")
    executor.update_parameters(timeout_min=1, ftslurm_preempt_time=30, ftslurm_retries=1)
    job = executor.submit(callables.Counter(), steps, 0.1)

    def resumed() -> bool:
        s = slurm_cli.summary(job.job_id)
        return (
            len(s["attempts"]) == 2
            and s["attempts"][1]["state"] == "RUNNING"
            and (job.stdout() or "").count("starting at step") >= 2
        )

    wait_until(resumed, 180, "the continuation to run", job)
    s = slurm_cli.summary(job.job_id)
    assert s["attempts"][0]["cause"] == "checkpointed", s
    victim = s["attempts"][1]["nodes"][0]
    healthy_nodes.fail_node(victim)
    wait_until(job.done, 400, "the job to end", job)
    assert job.result() == callables.expected(steps), callables.describe(job)
    wait_until(lambda: job.state == "COMPLETED", 60, "the run to be COMPLETED", job)
    s = slurm_cli.summary(job.job_id)
    causes = [a["cause"] for a in s["attempts"]]
    assert causes[:2] == ["checkpointed", "node_fail"] and causes[-1] == "finished", s
    assert victim in s["excluded_nodes"], s
    assert all(victim not in a["nodes"] for a in s["attempts"][2:]), s
    log = job.stdout() or ""
    starts = [line for line in log.splitlines() if f"job {job.job_id} rank 0/1 starting" in line]
    assert len(starts) >= 3, log  # submitit.JobEnvironment() knew the run in every attempt
    assert starts[0].endswith("at step 0") and not starts[1].endswith("at step 0"), starts


def _example_digest(steps: int, out: Path) -> str:
    """examples/submitit_recipe.py's Trainer, called here to the end: the uninterrupted run."""
    spec = importlib.util.spec_from_file_location(
        "submitit_recipe", EXAMPLES / "submitit_recipe.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Trainer()(steps, output_dir=str(out))


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_the_executor_example_survives_a_preemption_and_a_lost_node(plugin, mock_cli, tmp_path):
    """examples/submitit_executor.py, as a user runs it, on the mock: a preemption (an
    injected 30 s wall limit, the signal at 20 s) and a lost node in the continuation; the
    result is the digest of an uninterrupted run."""
    steps = 500
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "submitit_executor.py"), "--dry-run"]
        + ["--folder", str(tmp_path / "jobs" / "%j"), "--steps", str(steps)]
        + ["--step-time", "0.1", "--timeout-min", "5", "--preempt-time", "10"]
        + ["--inject", "timeout@30", "--inject", "node_fail@28"],
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run_id = proc.stdout.split("submitted run ")[1].split()[0]
    # the result is stored before the daemon reads the attempt's end
    s = mock_cli.wait_for(run_id, ended, 60, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert [a["cause"] for a in s["attempts"]] == ["checkpointed", "node_fail", "finished"], s
    result = proc.stdout.split("result ")[1].split()[0]
    assert result == _example_digest(steps, tmp_path / "reference")  # bit-identical

"""The pre-flight health check (issue 30, item 0): each check's pass/fail rule (a table),
the `unhealthy` injection's aim, the shell's bounds (a hung probe, a site command that
never exits, an unwritable folder), its settings, and the daemon's step and policy for a
node's report (a table)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ftslurm.agent import health as hc
from ftslurm.agent import health_rules as rules
from ftslurm.agent.health_rules import Check, GpuProbe
from ftslurm.core.contract import EnvName, HealthConfig, JobEnv, RunDir
from ftslurm.core.inject import parse_injections
from ftslurm.core.settings import Cause, FtSettings
from ftslurm.core.types import JobState
from ftslurm.daemon import policy
from ftslurm.daemon import step as core
from ftslurm.daemon.records import AttemptState
from ftslurm.errors import ConfigError
from ftslurm.recipe import Recipe

from .test_step import NOW, attempt, info, known, of, run

MB = 1024 * 1024


# ------------------------------------------------------------------ each check's rule
@pytest.mark.parametrize(
    "result, ok",
    [
        (rules.write_speed("/c", MB, 0.01, None, 1.0), True),  # 100 MB/s
        (rules.write_speed("/c", MB, 2.0, None, 1.0), False),  # 0.5 MB/s: a sick mount
        (rules.write_speed("/c", MB, 0.5, None, 0.0), True),  # floor 0: reachable is enough
        (rules.write_speed("/c", MB, None, "Read-only file system", 1.0), False),
        (rules.free_memory(512 * MB, 256), True),
        (rules.free_memory(100 * MB, 256), False),
        (rules.free_memory(None, 256), True),  # not known: skipped
        (rules.free_disk("/c", 10 * 1024 * MB, 256), True),
        (rules.free_disk("/c", 12 * MB, 256), False),
        (rules.gpus(0, None, 256), True),  # a CPU job: skipped
        (rules.gpus(2, GpuProbe(2, True, (40_000.0, 39_000.0)), 256), True),
        (rules.gpus(2, GpuProbe(1, True, (40_000.0,)), 256), False),  # one missing
        (rules.gpus(1, GpuProbe(1, False, (40_000.0,)), 256), False),  # wrong result
        (rules.gpus(1, GpuProbe(1, True, (100.0,)), 256), False),  # memory held by another
        (rules.gpus(1, GpuProbe(0, error="CUDA error: unknown error"), 256), False),
        (rules.bandwidth(1000.0, [1100.0, 900.0, 1050.0], 0.1), True),
        (rules.bandwidth(50.0, [1100.0, 900.0, 1050.0], 0.1), False),  # a 20th of the median
        (rules.bandwidth(50.0, [1100.0], 0.1), True),  # two rates: no median, inconclusive
        (rules.bandwidth(None, [1000.0, 1000.0, 1000.0], 0.1), True),  # not measured
        (rules.site("check", 0, False, ""), True),
        (rules.site("check", 1, False, "ECC errors\n"), False),
        (rules.site("check", None, True, ""), False),  # no exit within the bound
    ],
)
def test_each_checks_rule(result, ok):
    assert result.ok is ok, result
    if not ok:
        assert result.detail and not result.skipped


def test_a_failure_says_what_it_measured_against_which_floor():
    r = rules.free_disk("/ckpt", 12 * MB, 256)
    assert (r.check, r.value, r.floor) == (Check.DISK, 12.0, 256)
    assert r.detail == "/ckpt: 12 MB free, below 256 MB"
    slow = rules.bandwidth(50.0, [1100.0, 900.0, 1050.0], 0.1)
    assert slow.check is Check.NETWORK and slow.floor == pytest.approx(0.1 * 975.0)


def test_the_verdict_is_the_first_check_that_failed():
    ok, bad_disk, bad_site = (
        rules.free_memory(512 * MB, 256),
        rules.free_disk("/c", MB, 256),
        rules.site("x", 2, False, ""),
    )
    assert rules.verdict([ok]) is None
    assert rules.verdict([ok, bad_disk, bad_site]) is bad_disk


@pytest.mark.parametrize(
    "specs, node, node_rank, elapsed, fired, hits",
    [
        (["unhealthy@0:n2"], "n2", 1, 0.0, [], True),
        (["unhealthy@0:n2"], "n3", 1, 0.0, [], False),  # another node
        (["unhealthy@0:1"], "n7", 1, 0.0, [], True),  # by index into the allocation
        (["unhealthy@0"], "n9", 3, 0.0, [], True),  # no target: the last node of 4
        (["unhealthy@0"], "n1", 0, 0.0, [], False),
        (["unhealthy@60:n2"], "n2", 1, 10.0, [], False),  # not due yet
        (["unhealthy@60:n2"], "n2", 1, 61.0, [], True),
        (["unhealthy@0:n2"], "n2", 1, 0.0, ["unhealthy@0:n2"], False),  # fired once already
        (["crash@0:1"], "n2", 1, 0.0, [], False),  # another kind
    ],
)
def test_the_injection_aims_at_its_node_once(specs, node, node_rank, elapsed, fired, hits):
    found = rules.injected(
        parse_injections(specs),
        node=node,
        node_rank=node_rank,
        nnodes=4,
        elapsed_s=elapsed,
        fired=fired,
    )
    assert (found is not None) is hits


@pytest.mark.parametrize(
    "environ, asked",
    [
        ({}, 0),
        ({"SLURM_GPUS_ON_NODE": "4"}, 4),
        ({"SLURM_JOB_GPUS": "0,1"}, 2),
        ({"SLURM_GPUS_ON_NODE": "", "SLURM_STEP_GPUS": "3"}, 1),
    ],
)
def test_the_gpus_a_job_asked_for(environ, asked):
    assert rules.gpus_asked(environ) == asked


def test_node_dirs_name_the_node():
    assert rules.node_dirs(["/scratch/{node}/stage", "/plain"], "n3") == [
        "/scratch/n3/stage",
        "/plain",
    ]


# ------------------------------------------------------------------------ the shell
def _check(
    tmp_path: Path,
    environ: dict | None = None,
    folder: Path | None = None,
    where: dict | None = None,
    **config,
) -> hc.Health:
    """One node's checks of a 1-node job; `folder`: its checkpoint directory (default
    `tmp_path / "ckpt"`); `where`: other arguments of `run_checks` (another node of a
    larger job, its run directory)."""
    args = dict(node="n1", node_rank=0, nnodes=1, job="1", attempt=0, run=None)
    return hc.run_checks(
        HealthConfig(**config),
        checkpoint_dir=str(folder if folder is not None else tmp_path / "ckpt"),
        environ=environ or {},
        **{**args, **(where or {})},
    )


def test_a_healthy_machine_passes_with_the_defaults_within_the_bound(tmp_path):
    health = _check(tmp_path)
    assert health.failure is None, hc.said(health)
    assert [r.check for r in health.results if not r.skipped] == [
        Check.CHECKPOINT_DIR,
        Check.MEMORY,
        Check.DISK,
    ]
    assert health.seconds < HealthConfig().timeout_s
    # probed in the nearest folder that exists (its mode is not the check's to set), the
    # probe file removed
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.iterdir())


def test_a_checkpoint_directory_that_cannot_be_made_fails_the_node(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")  # unwritable for root too
    health = _check(tmp_path, folder=blocker / "ckpt")
    assert health.failure is not None and health.failure.check is Check.CHECKPOINT_DIR
    assert str(blocker / "ckpt") in health.failure.detail


def test_a_launcher_started_by_hand_does_not_probe_a_guessed_checkpoint_folder(
    tmp_path, monkeypatch
):
    """Without the daemon's FTSLURM_CHECKPOINT_DIR the ranks' folder is unknown (a recipe may
    name its own): the launcher writes nowhere and says why, and the working directory's
    `checkpoints` (here a file, unwritable for root too) fails nothing."""
    (tmp_path / "checkpoints").write_text("not a folder")
    monkeypatch.chdir(tmp_path)
    args = dict(node="n1", node_rank=0, nnodes=1, job="1", attempt=0, run=None, environ={})
    health = hc.run_checks(HealthConfig(), checkpoint_dir=None, **args)
    assert health.failure is None, hc.said(health)
    (first,) = [r for r in health.results if r.check is Check.CHECKPOINT_DIR]
    assert first.skipped and "FTSLURM_CHECKPOINT_DIR" in first.detail
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_a_node_local_folder_named_by_the_node_is_checked_too(tmp_path):
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "n1").write_text("a file where the folder should be")
    health = _check(tmp_path, dirs=(str(tmp_path / "scratch" / "{node}" / "stage"),))
    assert health.failure is not None and health.failure.check is Check.CHECKPOINT_DIR
    assert "scratch/n1/stage" in health.failure.detail


def test_a_hung_probe_fails_after_the_bound_not_never():
    started = time.monotonic()
    value, done = hc.bounded(lambda: time.sleep(30), 0.3)
    assert (value, done) == (None, False) and time.monotonic() - started < 5


def test_a_site_command_that_never_exits_is_killed_at_the_bound(tmp_path):
    marker = tmp_path / "still-running"
    started = time.monotonic()
    health = _check(tmp_path, timeout_s=1.0, command=f"sleep 30; touch {marker}")
    assert time.monotonic() - started < 10
    assert health.failure is not None and health.failure.check is Check.SITE
    assert "did not finish within the bound" in health.failure.detail
    assert not marker.exists()


def test_a_site_command_that_fails_says_its_last_line(tmp_path):
    health = _check(tmp_path, command="echo checking; echo 'GPU 3: ECC errors'; exit 7")
    assert health.failure is not None and health.failure.check is Check.SITE
    assert health.failure.detail.endswith("exited 7: GPU 3: ECC errors")


def test_the_injection_fails_the_first_check_and_is_recorded_once(tmp_path):
    rd = RunDir(tmp_path / "run")
    kw = dict(
        checkpoint_dir=str(tmp_path / "ckpt"),
        node="n2",
        node_rank=1,
        nnodes=2,
        job="1",
        attempt=0,
        run=rd,
        injections=parse_injections(["unhealthy@0:n2"]),
        environ={},
    )
    first = hc.run_checks(HealthConfig(), **kw)
    assert first.failure is not None and first.failure.check is Check.CHECKPOINT_DIR
    assert first.failure.detail == "injected (unhealthy@0:n2)"
    again = hc.run_checks(HealthConfig(), **kw)  # a requeued job: it fired already
    assert again.failure is None, hc.said(again)


def test_the_network_probe_compares_each_node_with_the_median(tmp_path):
    """Five launchers of one job on this machine: node rank 0 answers, 1..4 measure and
    compare; none is slow, so all pass, each having measured (not inconclusive)."""
    import threading

    rd = RunDir(tmp_path / "run")
    rd.attempt(0).mkdir(parents=True)
    hc.serve_probes(rd, 0, "9", "127.0.0.1", lifetime=20)
    found: dict[int, object] = {}

    def node(r: int) -> None:
        found[r] = hc.network(rd, 0, "9", f"n{r}", r, 5, 0.1, time.monotonic() + 10)

    threads = [threading.Thread(target=node, args=(r,)) for r in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(found) == [1, 2, 3, 4]
    assert all(r.ok and not r.skipped for r in found.values()), found


@pytest.mark.parametrize("probe", [True, False])
def test_a_node_of_a_large_job_runs_the_network_probe_unless_between_rounds(tmp_path, probe):
    """Through `run_checks`, as the launcher calls it: node rank 1 of a 5-node job probes
    node rank 0 (which serves); between in-job rounds (`probe_network` False) it does not."""
    rd = RunDir(tmp_path / "run")
    rd.attempt(0).mkdir(parents=True)
    hc.serve_probes(rd, 0, "9", "127.0.0.1", lifetime=20)
    where = dict(node="n2", node_rank=1, nnodes=5, job="9", run=rd, probe_network=probe)
    health = _check(tmp_path, where=where)
    assert health.failure is None, health
    assert (Check.NETWORK in [r.check for r in health.results]) is probe, health


def test_a_missing_rank_0_makes_the_network_probe_inconclusive_within_the_bound(tmp_path):
    rd = RunDir(tmp_path / "run")
    started = time.monotonic()
    result = hc.network(rd, 0, "9", "n1", 1, 5, 0.1, time.monotonic() + 0.5)
    assert result.ok and result.skipped and time.monotonic() - started < 3


# --------------------------------------------------------------------- settings
def test_the_settings_reach_the_job_only_when_they_differ_from_the_defaults():
    from ftslurm.daemon.submission import build_attempt, make_spec

    def script(**settings) -> str:
        recipe = Recipe(command=["python", "t.py"], nodes=2, **settings)
        spec = make_spec(recipe, run_dir=Path("/runs/r1"), backend="slurm", workdir="/w")
        return build_attempt("r1", spec, recipe.settings().model_dump(mode="json"), 0, ())[0]

    assert EnvName.HEALTH.value not in script()
    line = next(
        x
        for x in script(health_command="/site/check", health_dirs=("/l/{node}",)).splitlines()
        if x.startswith(f"export {EnvName.HEALTH.value}=")
    )
    value = line.split("=", 1)[1].strip("'")
    job = JobEnv.from_environ({EnvName.HEALTH.value: value})
    assert job.health.command == "/site/check" and job.health.dirs == ("/l/{node}",)
    off = JobEnv.from_environ(
        {EnvName.HEALTH.value: script(health_check=False).split(f"{EnvName.HEALTH.value}=")[1]
         .splitlines()[0].strip("'")}
    )  # fmt: skip
    assert off.health.enabled is False


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"health_timeout_s": 0}, "health_timeout_s"),
        ({"health_min_bandwidth_ratio": 2}, "health_min_bandwidth_ratio"),
        ({"health_command": "a\nb"}, "one non-empty line"),
        ({"health_dirs": ("",)}, "not a folder"),
    ],
)
def test_a_bad_health_setting_is_refused(settings, words):
    with pytest.raises(ValueError, match=words):
        FtSettings(**settings)


def test_a_bad_health_value_in_the_jobs_environment_is_one_line():
    with pytest.raises(ConfigError) as caught:
        JobEnv.from_environ({EnvName.HEALTH.value: '{"timeout_s": -1}'})
    assert "\n" not in str(caught.value) and EnvName.HEALTH.value in str(caught.value)


# -------------------------------------------------------------- the daemon's policy
def unhealthy(node: str = "n2", rank: int = 1, benched: bool = False, **kw) -> dict:
    return {
        "node": node,
        "node_rank": rank,
        "job_id": "7",
        "attempt": 0,
        "check": "disk",
        "detail": "/ckpt: 12 MB free, below 256 MB",
        "benched": benched,
        "time": NOW - 1,
        **kw,
    }


@pytest.mark.parametrize(
    "settings, spent, kept_out, verdict, retries",
    [
        ({}, {}, True, policy.Verdict.CONTINUE, 0),  # free: the node is kept out
        ({"exclude_failed_nodes": False}, {}, True, policy.Verdict.RETRY, 1),
        ({}, {}, False, policy.Verdict.RETRY, 1),  # failed again although flagged
        ({"cause_budgets": {"unhealthy": 2}}, {"unhealthy": 2}, True, policy.Verdict.RETRY, 1),
        ({"num_job_retries_on_failure": 0, "exclude_failed_nodes": False}, {}, True,
         policy.Verdict.FAIL, 0),
    ],
)  # fmt: skip
def test_the_policy_for_a_failed_health_check(settings, spent, kept_out, verdict, retries):
    ending = policy.Ending(state=JobState.NODE_FAIL, elsewhere=kept_out)
    d = policy.decide(
        Cause.UNHEALTHY, ending, policy.Budget(cause_counts=dict(spent)), FtSettings(**settings)
    )
    assert d.verdict is verdict and d.budget.job_retries_used == retries, d


@pytest.mark.parametrize(
    "report, spares, flags, cause, free",
    [
        (unhealthy(), 0, (), "unhealthy", True),  # the run moves, no retry spent
        (unhealthy(node="n1", rank=0), 1, (), "unhealthy", True),  # the batch host: no spare
        (unhealthy(), 0, ("n2",), "unhealthy", False),  # flagged already: not kept out
    ],
)
def test_a_failed_health_check_ends_the_attempt_and_flags_the_node(
    report, spares, flags, cause, free
):
    from ftslurm.daemon.records import NodeFlag

    flagged = tuple(NodeFlag(n, "old", NOW - 10, NOW + 3600) for n in flags)
    out = core.step(
        attempt(),
        info(JobState.RUNNING),
        run(settings={"spare_nodes": spares, "num_job_retries_on_failure": 2}),
        known(files=core.RunFiles(unhealthy=(report,)), flags=flagged),
        NOW,
    )
    words = f"health check failed: disk: {report['detail']}"
    assert [f.reason for f in of(out, core.FlagNode)] == ([] if flags else [words])
    (event,) = [e for e in of(out, core.Event) if e.kind == "node_unhealthy"]
    assert event.data["check"] == "disk" and event.data["recovery"] == "new_job"
    (ended,) = of(out, core.Record)
    assert ended.attempt.state is AttemptState.NODE_FAIL and ended.attempt.cause == cause
    assert f"{report['node']} failed its health check (disk: " in ended.attempt.reason
    (upd,) = of(out, core.UpdateRun)
    assert upd.run.job_retries_used == (0 if free else 1)
    assert upd.run.cause_counts == {"unhealthy": 1}
    assert of(out, core.NewAttempt)


def test_with_a_spare_the_unhealthy_node_is_benched_flagged_with_its_check_and_the_job_runs_on():
    bench = {
        "node_rank": 1,
        "node": "n2",
        "why": "unhealthy",
        "reason": "health check failed: disk: low",
        "attempt": 0,
    }
    out = core.step(
        attempt(),
        info(JobState.RUNNING),
        run(settings={"spare_nodes": 1}),
        known(files=core.RunFiles(benched=(bench,), unhealthy=(unhealthy(benched=True),))),
        NOW,
    )
    assert [type(i).__name__ for i in out] == ["FlagNode", "Event", "Record", "Changed"]
    assert out[0].reason == "health check failed: disk: /ckpt: 12 MB free, below 256 MB"
    assert out[1].kind == "node_benched" and out[1].data["recovery"] == "spare"


def test_an_injected_failure_counts_as_fired_for_the_next_job():
    r = run(spec={**run().spec, "inject": ["unhealthy@0:n2"]})
    report = unhealthy(injected="unhealthy@0:n2")
    out = core.step(
        attempt(), info(JobState.RUNNING), r, known(files=core.RunFiles(unhealthy=(report,))), NOW
    )
    (upd,) = of(out, core.UpdateRun)
    assert upd.run.injected == ["unhealthy@0:n2"]


def test_an_ended_job_with_an_unhealthy_report_is_not_a_crash():
    """The daemon saw the report only once the job had ended (it was down): the cause is
    still the health check, the node flagged, the next job a fresh one."""
    a = replace(attempt(), nodes=["n1", "n2"])
    out = core.step(
        a,
        info(JobState.FAILED, exit_code=1),
        run(settings={"num_job_retries_on_failure": 2}),
        known(files=core.RunFiles(unhealthy=(unhealthy(),), launchers_read=True)),
        NOW,
    )
    (ended,) = [i for i in of(out, core.Record) if i.attempt.attempt == 0]
    assert ended.attempt.cause == "unhealthy"
    assert [f.node for f in of(out, core.FlagNode)] == ["n2"]
    (upd,) = of(out, core.UpdateRun)
    assert upd.run.job_retries_used == 0


def test_the_health_floors_a_user_gets_do_not_fail_this_machine():
    """The defaults are meant for any healthy machine: this one, under the test suite's
    load, passes them."""
    s = FtSettings()
    assert s.health_check and s.health_timeout_s <= 10
    free = hc.available_memory()
    assert free is None or free / MB > s.health_min_free_memory_mb
    assert (hc.free_disk(os.getcwd()) or 0) / MB > s.health_min_free_disk_mb


def test_a_job_that_asked_for_a_gpu_fails_on_a_node_without_one(tmp_path, monkeypatch):
    """The GPU probe (a process of its own that imports torch): this machine has no GPU, so
    a job that asked for one finds none usable here. Its allowance raised: under the test
    suite's load torch's import alone may take long, which the check would call
    inconclusive."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(hc, "GPU_PROBE_S", 300.0)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    health = _check(tmp_path, {"SLURM_GPUS_ON_NODE": "1"}, folder=tmp_path)
    assert health.failure is not None and health.failure.check is Check.GPU
    assert health.failure.detail == "0 GPU(s) usable, the job asked for 1"


def test_a_gpu_probe_that_does_not_finish_in_time_is_inconclusive_and_passes(tmp_path, monkeypatch):
    monkeypatch.setattr(hc, "GPU_PROBE_S", 0.0)
    monkeypatch.setattr(hc, "GPU_PROBE", "import time; time.sleep(60)")
    started = time.monotonic()
    health = _check(tmp_path, {"SLURM_GPUS_ON_NODE": "1"}, timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert health.failure is None, hc.said(health)
    (gpu,) = [r for r in health.results if r.check is Check.GPU]
    assert gpu.skipped and "inconclusive" in gpu.detail

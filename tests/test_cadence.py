"""The tuned checkpoint interval (`ftslurm.core.cadence`): the formulas against worked values,
the daemon's decision to write it, and the rank agent that reads it and makes every rank
checkpoint at one step."""

from __future__ import annotations

import json
import math
import random
import re
import signal
from pathlib import Path

import pytest

from ftslurm.agent.rank import CADENCE_REFRESH_S, RankAgent
from ftslurm.core.cadence import (
    DAY_S,
    Cadence,
    FailureHistory,
    cadence,
    daly,
    live_coverage,
    node_failure_rate,
    young,
)
from ftslurm.core.contract import EnvName, RunDir
from ftslurm.core.contract.reports import Progress
from ftslurm.core.recovery import Recovery, recovery
from ftslurm.core.settings import FtSettings
from ftslurm.core.timefmt import format_duration
from ftslurm.daemon import step as core
from ftslurm.fsutil import write_json_atomic
from ftslurm.runfiles import read_report

from .daemon_scenarios import ended, example_recipe, on_a_fresh_mock, reference_digest
from .test_launch import finish, start
from .test_step import NOW, attempt, info, known, of, run

HOUR = 3600.0


# ------------------------------------------------------------------------- the formulas
def test_young_and_daly_worked_values():
    # w = 60 s, M = 1 day: Young sqrt(2 * 60 * 86400) = 3219.94 s; Daly refines it to
    # 3219.94 * (1 + sqrt(60 / 172800) / 3 + (60 / 172800) / 9) - 60 = 3180.07 s
    assert young(60, DAY_S) == pytest.approx(3219.938, abs=1e-3)
    assert daly(60, DAY_S) == pytest.approx(3180.07, abs=0.01)
    # w = 300 s, M = 4 h (the regime of a large job): 2939.39 -> 2939.39 * (1 + 0.03402
    # + 0.00116) - 300 = 2742.8 s
    assert young(300, 4 * HOUR) == pytest.approx(2939.388, abs=1e-3)
    assert daly(300, 4 * HOUR) == pytest.approx(
        2939.388 * (1 + math.sqrt(300 / 28800) / 3 + 300 / 28800 / 9) - 300
    )
    assert daly(300, 4 * HOUR) == pytest.approx(2742.8, abs=0.1)
    # a save longer than twice the MTBF: checkpoint every M
    assert daly(5000, 2000) == 2000
    for bad in ((0, DAY_S), (60, 0), (-1, DAY_S), (math.inf, DAY_S)):
        with pytest.raises(ValueError):
            daly(*bad)


def test_the_failure_rate_is_the_prior_until_the_history_outweighs_it():
    assert node_failure_rate(FailureHistory(), 5.0, 1000) == pytest.approx(0.005)
    # 50 failures in 1000 node-days (10x the prior) weigh as much as the prior
    assert node_failure_rate(FailureHistory(50, 1000), 5.0, 1000) == pytest.approx(0.0275)
    # a long history speaks for itself
    assert node_failure_rate(FailureHistory(5000, 100_000), 5.0, 1000) == pytest.approx(
        (5 + 5000) / 101_000
    )


def tuned(**kw):  # type: ignore[no-untyped-def]
    args = dict(
        nodes=16,
        save_s=None,
        save_prior_s=60.0,
        write_s=None,
        history=FailureHistory(),
        prior_per_1000=5.0,
        prior_node_days=1000.0,
    )
    return cadence("auto", **{**args, **kw})


def test_the_interval_follows_the_failure_rate_the_save_and_the_background_write():
    base = tuned()
    # 16 nodes at 5 per 1000 node-days: M = 86400 / 0.08 = 1.08e6 s
    assert base.mtbf_s == pytest.approx(1.08e6) and not base.save_measured
    assert base.interval_s == pytest.approx(daly(60, 1.08e6), abs=1e-3)
    more_failures = tuned(history=FailureHistory(200, 1000))
    assert more_failures.interval_s < base.interval_s / 3  # 21x the rate: sqrt(21) ~ 4.6x
    assert tuned(nodes=2048).interval_s < base.interval_s / 10  # sqrt(128) ~ 11x
    slower = tuned(save_s=240.0)
    assert slower.save_measured and slower.interval_s == pytest.approx(daly(240, 1.08e6), abs=1e-3)
    assert slower.interval_s > 1.9 * base.interval_s  # sqrt(4) = 2x, less a little
    # never shorter than the previous checkpoint's background write
    assert tuned(save_s=1.0, history=FailureHistory(10_000, 10)).interval_s < 900
    assert tuned(save_s=1.0, history=FailureHistory(10_000, 10), write_s=900.0).interval_s == 900.0


def test_a_pinned_or_switched_off_interval_is_taken_as_it_is():
    assert (
        cadence(
            600.0,
            nodes=4,
            save_s=3.0,
            save_prior_s=60,
            write_s=None,
            history=FailureHistory(),
            prior_per_1000=5,
            prior_node_days=1000,
        ).interval_s
        == 600.0
    )
    off = cadence(
        "off",
        nodes=4,
        save_s=3.0,
        save_prior_s=60,
        write_s=None,
        history=FailureHistory(),
        prior_per_1000=5,
        prior_node_days=1000,
    )
    assert (off.interval_s, off.how) == (None, "off")


def test_only_a_material_change_is_written_again():
    base = tuned()
    assert base.differs(None) and not base.differs(base)
    assert not tuned(history=FailureHistory(0, 50)).differs(base)  # 5% longer M: 2.5%
    assert tuned(history=FailureHistory(3, 10)).differs(base)
    assert tuned(save_s=60.0).differs(base)  # measured now, same value: its source moved
    assert Cadence.from_json(json.loads(json.dumps(base.to_json()))) == base
    for junk in (None, [], {"interval_s": -5, "how": "tuned"}, {"how": "tuned"}, "x"):
        assert Cadence.from_json(junk) is None


def test_a_memory_tier_gets_its_own_short_interval_and_the_disk_a_longer_one():
    """w = 60 s on disk, 2 s in memory, c = 0.5: memory at Daly(2, M); disk at Daly(60, 2M)
    (only half of the failures reach it), never shorter than memory nor the write."""
    two = tuned(save_s=60.0, memory_save_s=2.0)
    m = 1.08e6
    assert two.interval_s == pytest.approx(daly(2, m), abs=1e-3)
    assert two.disk_interval_s == pytest.approx(daly(60, 2 * m), abs=1e-3)
    assert two.tier_interval("memory") == two.interval_s < tuned(save_s=60.0).interval_s
    assert two.tier_interval("disk") > tuned(save_s=60.0).interval_s  # sqrt(2) x, about
    # the share memory serves moves only the disk's interval
    more = tuned(save_s=60.0, memory_save_s=2.0, memory_coverage=0.9)
    assert more.interval_s == two.interval_s
    assert more.disk_interval_s == pytest.approx(daly(60, 10 * m), abs=1e-3)
    # floors: the background write, and the memory interval itself
    assert tuned(save_s=60.0, memory_save_s=2.0, write_s=1e6).disk_interval_s == 1e6
    slow_memory = tuned(save_s=1.0, memory_save_s=50.0, memory_coverage=0.0)
    assert slow_memory.disk_interval_s == slow_memory.interval_s
    # one tier: the disk's interval is the one interval
    assert tuned().tier_interval("disk") == tuned().interval_s and tuned().disk_interval_s is None
    assert "to memory every" in two.describe() and "to disk every" in two.describe()
    # a change of the disk interval alone is written again; JSON keeps both
    assert more.differs(two) and two.differs(tuned(save_s=60.0))
    assert Cadence.from_json(json.loads(json.dumps(two.to_json()))) == two
    assert Cadence.from_json({**two.to_json(), "disk_interval_s": 0}) is None
    with pytest.raises(ValueError):
        tuned(memory_save_s=1.0, memory_coverage=1.0)


@pytest.mark.parametrize(
    "nodes, spares, share",
    [
        (1, 4, 0.0),  # the one node is the batch host
        (8, 0, 0.0),  # no spare: every loss ends the job
        (2, 1, 0.5 / 1.5),  # S = 1 * (1 - 1/2)
        (8, 1, 0.875 / 1.875),  # S = 7 * (1 - 7/8)
        (16, 2, (15 * 31 / 256) / (1 + 15 * 31 / 256)),  # S = 15 * (1 - (15/16)^2)
        (2048, 8, 0.8887),  # S = 2047 * (1 - (2047/2048)^8) = 7.986
        (2048, 16, 0.9410),
    ],
)
def test_the_share_of_node_failures_live_recovery_serves(nodes, spares, share):
    assert live_coverage(nodes, spares) == pytest.approx(share, abs=1e-4)
    # never more than the spares allow (K served per ending) nor than the batch host allows
    assert live_coverage(nodes, spares) <= min(spares / (spares + 1), 1 - 1 / nodes) + 1e-12


def test_the_live_share_grows_with_the_spares_up_to_all_but_the_batch_host():
    shares = [live_coverage(64, k) for k in range(0, 40)]
    assert shares == sorted(shares) and shares[0] == 0.0
    assert live_coverage(64, 10_000) == pytest.approx(1 - 1 / 64)
    for bad in ((0, 1), (4, -1)):
        with pytest.raises(ValueError):
            live_coverage(*bad)


@pytest.mark.parametrize("nodes, spares", [(4, 1), (8, 2), (16, 3)])
def test_the_live_share_is_what_the_recovery_rule_serves_over_many_losses(nodes, spares):
    """Losses on random training nodes, each judged by `ftslurm.core.recovery` (the rule the
    launchers and the daemon follow): the share served inside the allocation matches the
    formula. A spare that takes a place trains from then on; a new job has its spares again."""
    rng = random.Random(nodes * 100 + spares)
    served = losses = 0
    while losses < 40_000:
        training, idle, lost = list(range(nodes)), list(range(nodes, nodes + spares)), set()
        while True:
            node = rng.choice(training)
            lost.add(node)
            losses += 1
            if recovery(lost, spares) is Recovery.NEW_JOB:
                break  # a checkpoint; the next job starts with fresh spares
            served += 1
            training[training.index(node)] = idle.pop()
    assert served / losses == pytest.approx(live_coverage(nodes, spares), abs=0.01)


def test_live_recovery_spaces_the_disk_for_the_failures_it_cannot_serve():
    """One tier: the interval is Daly's for M / (1 - c_live). With a memory tier: the disk's
    for M / (1 - max(c_mem, c_live)), the memory's unchanged. Off (None): today's result."""
    m = 1.08e6
    base = tuned(save_s=60.0)
    assert tuned(save_s=60.0, live_coverage=None) == base and base.live_coverage is None
    live = tuned(save_s=60.0, live_coverage=0.75)
    assert live.interval_s == pytest.approx(daly(60, 4 * m), abs=1e-3)
    assert live.interval_s > 1.9 * base.interval_s  # sqrt(4) = 2x, less a little
    assert live.mtbf_s == base.mtbf_s and live.live_coverage == 0.75  # M is the job's
    assert "live recovery serves ~75% of node failures" in live.describe()
    assert "live recovery" not in base.describe()
    assert base.describe() == (
        "checkpoint every 3h09m04s (tuned: save 1m00s (measured), job MTBF 12d12h00m on 16"
        " nodes at 5 node failures per 1000 node-days; 0 seen in 0.0 node-days)"
    )
    assert live.describe() == base.describe().replace(
        "3h09m04s (tuned: save 1m00s (measured),",
        f"{format_duration(live.interval_s)} (tuned: save 1m00s (measured); live recovery"
        " serves ~75% of node failures,",
    )
    # no share served (one node, no spare): the same interval, but the file says why
    none = tuned(save_s=60.0, live_coverage=0.0)
    assert none.interval_s == base.interval_s and none.differs(base) and base.differs(none)
    # the floor still holds
    assert tuned(save_s=60.0, live_coverage=0.75, write_s=1e6).interval_s == 1e6
    # two tiers: the larger share reaches the disk's M; memory's follows the failures live
    # recovery leaves too (those a memory restore served before are served live now)
    two = tuned(save_s=60.0, memory_save_s=2.0)
    both = tuned(save_s=60.0, memory_save_s=2.0, live_coverage=0.75)
    assert two.interval_s == pytest.approx(daly(2, m), abs=1e-3)
    assert both.interval_s == pytest.approx(daly(2, 4 * m), abs=1e-3)
    assert both.disk_interval_s == pytest.approx(daly(60, 4 * m), abs=1e-3)
    assert two.disk_interval_s == pytest.approx(daly(60, 2 * m), abs=1e-3)  # c_mem = 0.5
    less = tuned(save_s=60.0, memory_save_s=2.0, live_coverage=0.3)
    assert less.disk_interval_s == two.disk_interval_s  # memory serves those already
    assert "memory serves 50% of failures, a prior; live recovery serves ~75%" in (both.describe())
    # pinned and off take no notice
    for setting in (600.0, "off"):
        fixed = cadence(
            setting,
            nodes=16,
            save_s=None,
            save_prior_s=60,
            write_s=None,
            history=FailureHistory(),
            prior_per_1000=5,
            prior_node_days=1000,
            live_coverage=0.75,
        )
        assert fixed.live_coverage is None and fixed.interval_s in (600.0, None)
        assert "live recovery" not in fixed.describe()
    # JSON keeps it; a file of an older version has none
    assert Cadence.from_json(json.loads(json.dumps(both.to_json()))) == both
    old = {k: v for k, v in live.to_json().items() if k != "live_coverage"}
    assert Cadence.from_json(old).live_coverage is None  # type: ignore[union-attr]
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError):
            tuned(live_coverage=bad)


# ------------------------------------------------------------------ the daemon's decision
def cadence_run(**settings):  # type: ignore[no-untyped-def]
    return run(settings={"checkpoint_interval": "auto", **settings})


def test_the_daemon_writes_the_tuned_interval_for_a_running_attempt():
    observed = info(core.JobState.RUNNING, start_time=NOW - 10)
    out = core.step(attempt(start=NOW - 10), observed, cadence_run(), known(), NOW)
    (write,) = of(out, core.WriteCadence)
    assert write.cadence.how == "tuned" and write.cadence.nodes == 2
    assert write.cadence.interval_s == pytest.approx(daly(60, DAY_S / 0.01), abs=1e-3)
    # what the folder holds already: nothing to write
    same = known(files=core.RunFiles(cadence=write.cadence))
    assert not of(
        core.step(attempt(start=NOW - 10), observed, cadence_run(), same, NOW), core.WriteCadence
    )
    # a measured save and a history of failures move it
    moved = known(
        files=core.RunFiles(cadence=write.cadence, progress={"checkpoint_save_s": 4.0}),
        history=FailureHistory(30, 100.0),
    )
    (again,) = of(
        core.step(attempt(start=NOW - 10), observed, cadence_run(), moved, NOW), core.WriteCadence
    )
    assert again.cadence.save_measured and again.cadence.failures == 30
    # 15x cheaper saves, 6.4x the failure rate: sqrt(96) ~ 9.8x more often
    assert again.cadence.interval_s < write.cadence.interval_s / 9


def test_a_run_that_reports_memory_saves_gets_a_memory_and_a_disk_interval():
    observed = info(core.JobState.RUNNING, start_time=NOW - 10)
    files = core.RunFiles(progress={"checkpoint_save_s": 30.0, "memory_save_s": 0.5})
    (write,) = of(
        core.step(
            attempt(start=NOW - 10),
            observed,
            cadence_run(memory_tier_coverage=0.75),
            known(files=files),
            NOW,
        ),
        core.WriteCadence,
    )
    m = DAY_S / 0.01
    assert write.cadence.interval_s == pytest.approx(daly(0.5, m), abs=1e-3)
    assert write.cadence.disk_interval_s == pytest.approx(daly(30, 4 * m), abs=1e-3)
    assert write.cadence.memory_coverage == 0.75
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError):
            FtSettings(memory_tier_coverage=bad)


def test_the_interval_is_never_shorter_than_the_runs_longest_background_write():
    observed = info(core.JobState.RUNNING, start_time=NOW - 10)
    files = core.RunFiles(
        progress={
            "checkpoint_save_s": 0.5,
            "checkpoint_write_s": 40.0,
            "max_checkpoint_write_s": 900.0,
        }
    )
    (write,) = of(
        core.step(
            attempt(start=NOW - 10),
            observed,
            cadence_run(),
            known(files=files, history=FailureHistory(500, 10)),
            NOW,
        ),
        core.WriteCadence,
    )
    assert write.cadence.interval_s == 900.0 and write.cadence.write_s == 900.0
    assert "the background write's floor" in write.cadence.describe()


def test_spares_do_not_count_in_the_jobs_failure_rate_and_off_clears_a_written_interval():
    r = cadence_run(spare_nodes=1)
    r.spec["options"]["nodes"] = 3
    observed = info(core.JobState.RUNNING, start_time=NOW - 10)
    (write,) = of(core.step(attempt(start=NOW - 10), observed, r, known(), NOW), core.WriteCadence)
    assert write.cadence.nodes == 2
    written = known(files=core.RunFiles(cadence=write.cadence))
    (off,) = of(
        core.step(
            attempt(start=NOW - 10),
            observed,
            run(settings={"checkpoint_interval": "off"}),
            written,
            NOW,
        ),
        core.WriteCadence,
    )
    assert off.cadence.interval_s is None
    assert not of(
        core.step(
            attempt(start=NOW - 10),
            observed,
            run(settings={"checkpoint_interval": "off"}),
            known(),
            NOW,
        ),
        core.WriteCadence,
    )


def live_run(nodes: int, spares: int, **settings):  # type: ignore[no-untyped-def]
    r = cadence_run(spare_nodes=spares, **{"live_recovery": True, **settings})
    r.spec["options"]["nodes"] = nodes + spares
    return r


def test_a_run_that_recovers_live_gets_a_disk_interval_for_what_its_spares_cannot_serve():
    """16 training nodes and 2 spares at the prior rate: M = 1.08e6 s. A run whose rank 0
    formed a live group says so in progress.json; its interval is Daly's for M / (1 - c),
    c = live_coverage(16, 2) = 0.645; a run that does not keeps today's Daly(w, M)."""
    observed = info(core.JobState.RUNNING, start_time=NOW - 10)
    m = 1.08e6
    c = live_coverage(16, 2)

    def write(files: core.RunFiles, r=None):  # type: ignore[no-untyped-def]
        out = core.step(
            attempt(start=NOW - 10), observed, r or live_run(16, 2), known(files=files), NOW
        )
        return of(out, core.WriteCadence)

    (today,) = write(core.RunFiles(progress={"step": 5}))
    assert today.cadence.live_coverage is None and today.cadence.nodes == 16
    assert today.cadence.interval_s == pytest.approx(daly(60, m), abs=1e-3)
    (live,) = write(core.RunFiles(progress={"step": 5, "live_recovery": True}))
    assert live.cadence.live_coverage == pytest.approx(c, abs=1e-4)
    assert live.cadence.interval_s == pytest.approx(daly(60, m / (1 - c)), abs=0.1)
    assert live.cadence.interval_s > 1.6 * today.cadence.interval_s  # sqrt(2.8) = 1.7x
    assert "live recovery serves ~64% of node failures" in live.cadence.describe()
    # today's interval written, then the run reports live recovery: written again, and the
    # other way round; the same one written already: nothing
    assert write(core.RunFiles(progress={"live_recovery": True}, cadence=today.cadence))
    assert write(core.RunFiles(progress={"step": 5}, cadence=live.cadence))
    assert not write(core.RunFiles(progress={"live_recovery": True}, cadence=live.cadence))
    # with a memory tier (c_mem 0.5 < c): both tiers follow live recovery's share
    files = core.RunFiles(
        progress={"checkpoint_save_s": 30.0, "memory_save_s": 0.5, "live_recovery": True}
    )
    (two,) = write(files)
    assert two.cadence.interval_s == pytest.approx(daly(0.5, m / (1 - c)), abs=0.1)
    assert two.cadence.disk_interval_s == pytest.approx(daly(30, m / (1 - c)), abs=0.1)
    # without spares a node loss always ends the job: no share served, today's interval
    (spareless,) = write(core.RunFiles(progress={"live_recovery": True}), live_run(16, 0))
    assert spareless.cadence.live_coverage == 0.0
    assert spareless.cadence.interval_s == pytest.approx(daly(60, m), abs=1e-3)
    # without the live_recovery setting the spares do not wait warm: a lost node restarts
    # every rank from a checkpoint, today's interval
    cold_run = live_run(16, 2, live_recovery=False)
    (cold,) = write(core.RunFiles(progress={"step": 5, "live_recovery": True}), cold_run)
    assert cold.cadence.live_coverage is None
    assert cold.cadence.interval_s == pytest.approx(daly(60, m), abs=1e-3)


def test_a_tuned_interval_needs_the_history_a_pinned_one_does_not():
    observed = info(core.JobState.RUNNING, start_time=NOW - 10)
    assert core.step(
        attempt(start=NOW - 10), observed, cadence_run(), known(history=None), NOW
    ) == [core.Need(frozenset({"history"}))]
    (pinned,) = of(
        core.step(
            attempt(start=NOW - 10),
            observed,
            run(settings={"checkpoint_interval": 900}),
            known(history=None),
            NOW,
        ),
        core.WriteCadence,
    )
    assert (pinned.cadence.how, pinned.cadence.interval_s) == ("pinned", 900.0)


def test_the_history_is_counted_per_cluster_up_to_now_for_a_running_attempt(tmp_path):
    """node_lost events and node-days by cluster: a mock's injected failures do not make
    the real cluster look worse."""
    from ftslurm.daemon.records import Attempt, Run, RunState
    from ftslurm.daemon.store import Store
    from ftslurm.daemon.submission import backend_key

    with Store(tmp_path / "home") as store, store.transaction():
        for rid, spec in (
            ("real", {"backend": "slurm"}),
            ("dry", {"backend": "mock", "mock_home": "/m"}),
        ):
            store.add_run(
                Run(
                    run_id=rid,
                    name=rid,
                    state=RunState.RUNNING,
                    created_at=0.0,
                    spec=spec,
                    settings={},
                )
            )
        # 2 nodes for a day, then 4 nodes still running since half a day before `now`
        store.add_attempt(
            Attempt("real", 0, "NODE_FAIL", tag="t0", nodes=["a", "b"], start=0.0, end=DAY_S)
        )
        store.add_attempt(
            Attempt("real", 1, "RUNNING", tag="t1", nodes=["c", "d", "e", "f"], start=DAY_S)
        )
        store.add_attempt(Attempt("dry", 0, "RUNNING", tag="t2", nodes=["n1"], start=DAY_S))
        store.append_event("real", "node_lost", {"node": "b", "source": "slurm"}, DAY_S)
        for _ in range(3):
            store.append_event("dry", "node_lost", {"node": "n1", "source": "peer"}, DAY_S)
        store.append_event("real", "node_benched", {"node": "c"}, DAY_S)  # not a failure
    with Store(tmp_path / "home") as store:
        got = store.failure_history(1.5 * DAY_S, backend_key)
    assert got == {"slurm": FailureHistory(1, 2.0 + 2.0), "mock:/m": FailureHistory(3, 0.5)}


def test_settings_refuse_a_meaningless_interval():
    for bad in (0, -60, "sometimes"):
        with pytest.raises(ValueError):
            FtSettings(checkpoint_interval=bad)
    assert FtSettings(checkpoint_interval="off").checkpoint_interval == "off"


# ---------------------------------------------------------------------- the rank agent
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def agent_in():  # type: ignore[no-untyped-def]
    """A rank agent of run folder `tmp_path` on a virtual clock; the signal handlers it
    installs in this process are put back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}

    def make(tmp_path: Path) -> tuple[RankAgent, Clock]:
        clock = Clock()
        return RankAgent({"FTSLURM_RUN_DIR": str(tmp_path)}, clock=clock), clock

    yield make
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def write_interval(tmp_path: Path, seconds: float | None) -> None:
    how = "off" if seconds is None else "pinned"
    write_json_atomic(RunDir(tmp_path).cadence, Cadence(seconds, how).to_json())


def test_the_agent_reads_a_new_interval_within_its_refresh_period(tmp_path, agent_in):
    agent, clock = agent_in(tmp_path)
    assert agent.checkpoint_interval is None  # no file yet
    write_interval(tmp_path, 600.0)
    clock.t += CADENCE_REFRESH_S - 0.1
    assert agent.checkpoint_interval is None  # looked at again only after the period
    clock.t += 0.1
    assert agent.checkpoint_interval == 600.0
    write_interval(tmp_path, 120.0)
    clock.t += CADENCE_REFRESH_S
    assert agent.checkpoint_interval == 120.0
    (tmp_path / "checkpoint-cadence.json").write_text("{torn")
    clock.t += CADENCE_REFRESH_S
    assert agent.checkpoint_interval == 120.0  # a torn file: the last one stays in force


def test_a_periodic_checkpoint_is_due_after_the_interval_and_is_not_a_stop(tmp_path, agent_in):
    write_interval(tmp_path, 300.0)
    agent, clock = agent_in(tmp_path)
    agent.heartbeat(1)
    assert not agent.should_checkpoint()
    clock.t += 299.0
    agent.heartbeat(2)
    assert not agent.should_checkpoint()
    clock.t += 1.0
    agent.heartbeat(3)
    assert agent.should_checkpoint() and agent.should_checkpoint()  # one answer per step
    assert not agent.should_stop()
    clock.t += 30.0  # the save took 30 s: the next one counts from its end
    agent.checkpoint_saved(3, 30.0)
    clock.t += 299.0
    agent.heartbeat(4)
    assert not agent.should_checkpoint()
    agent._on_signal(0, None)  # the checkpoint signal: a checkpoint and a stop
    agent.heartbeat(5)
    assert agent.should_checkpoint() and agent.should_stop()


PERIODIC = r"""
import os, sys, time
import torch, torch.distributed as dist
from ftslurm.agent import rank as fta
dist.init_process_group("gloo")
agent = fta.init()
rank = dist.get_rank()
for step in range(1, int(sys.argv[1]) + 1):
    with agent.section("step"):
        t = torch.ones(1); dist.all_reduce(t); time.sleep(float(sys.argv[2]))
    agent.heartbeat(step)
    if rank == 1 and step == 5:
        time.sleep(1.5)  # rank 1's clock runs ahead: it alone finds the interval passed
    if agent.should_checkpoint():
        print(f"rank {rank} saved at {step}", flush=True)
        agent.checkpoint_saved(step, 0.01)
        assert not agent.should_stop()
agent.finished(step)
agent.exit(0)
"""


def test_with_a_memory_tier_periodic_checkpoints_go_to_memory_and_every_disk_interval_to_disk(
    tmp_path, agent_in
):
    """Memory every 10 s, disk every 25 s: the tier of each periodic checkpoint follows
    the two clocks; a stop always goes to disk; a disk save restarts both clocks."""
    two = Cadence(
        10.0, "tuned", save_s=5.0, disk_interval_s=25.0, memory_save_s=0.5, memory_coverage=0.5
    )
    write_json_atomic(RunDir(tmp_path).cadence, two.to_json())
    agent, clock = agent_in(tmp_path)
    assert (agent.checkpoint_interval, agent.disk_checkpoint_interval) == (10.0, 25.0)
    tiers = []
    for step in range(1, 60):
        clock.t += 1.0
        agent.heartbeat(step)
        if agent.should_checkpoint():
            tiers.append((step, agent.checkpoint_tier))
            assert not agent.should_stop()
    assert tiers == [
        (10, "memory"),
        (20, "memory"),
        (25, "disk"),
        (35, "memory"),
        (45, "memory"),
        (50, "disk"),
    ], tiers
    agent.checkpoint_saved(60, 0.5, tier="memory")  # a memory save leaves the disk clock
    clock.t += 10.0
    agent.heartbeat(61)
    assert agent.should_checkpoint() and agent.checkpoint_tier == "memory"  # 19 s since 50
    clock.t += 4.0
    agent.heartbeat(62)
    assert not agent.should_checkpoint()  # 4 s since the last memory checkpoint, 23 since 50
    clock.t += 2.0
    agent.heartbeat(63)
    assert agent.should_checkpoint() and agent.checkpoint_tier == "disk"  # 25 s since 50
    agent._requested = True  # the checkpoint signal (its handler only sets this flag)
    agent.heartbeat(64)
    assert agent.should_checkpoint() and agent.checkpoint_tier == "disk" and agent.stopping
    with pytest.raises(ValueError):
        agent.checkpoint_saved(64, 1.0, tier="tape")


def test_every_rank_takes_a_periodic_checkpoint_at_the_same_step(tmp_path):
    """Two ranks under the launcher, an interval of 1 s: each checkpoint is taken by both
    ranks at one step, though their clocks disagree on when it fell due."""
    (tmp_path / "run").mkdir()
    write_interval(tmp_path / "run", 1.0)
    proc = start(tmp_path, steps=40, step_s=0.1, script=PERIODIC)
    code, out = finish(proc)
    assert code == 0, out
    saved = {r: [int(s) for s in re.findall(rf"rank {r} saved at (\d+)", out)] for r in (0, 1)}
    assert saved[0] == saved[1] and len(saved[0]) >= 2, out
    assert 5 in saved[0], out  # rank 1 alone was due after its pause: both saved


def test_rank_0_of_a_live_group_tells_the_daemon_that_the_run_recovers_live(tmp_path):
    """progress.live_recovery: rank 0 of a job with a run directory writes it, any other
    rank or a process outside a run does not; `LiveGroup.attach` calls it once its group
    formed over a coordinator store and holds a replicated state, a plain group (no
    store) does not (a sharded state: tests/test_live.py)."""
    import datetime

    import torch.distributed as dist

    from ftslurm.agent import live, progress

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    job = {EnvName.RUN_DIR.value: str(run.root), EnvName.ATTEMPT.value: "2"}
    progress.live_recovery({**job, "RANK": "1"})
    progress.live_recovery({"RANK": "0"})
    assert not run.progress.exists()
    progress.live_recovery({**job, "RANK": "0"})
    told = read_report(run.progress, Progress)
    assert told is not None and told.live_recovery is True and told.attempt == 2
    assert not told.finished

    plain_dir = RunDir(tmp_path / "plain")
    plain_dir.root.mkdir()
    env = {EnvName.RUN_DIR.value: str(plain_dir.root), "RANK": "0", "WORLD_SIZE": "1"}
    plain = live.LiveGroup("gloo", environ=env, init_method=f"file://{tmp_path / 'init'}")
    plain.start()
    try:
        assert not plain.enabled and not plain_dir.progress.exists()
    finally:
        dist.destroy_process_group()

    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
    )
    live_dir = RunDir(tmp_path / "live")
    live_dir.root.mkdir()
    env = {
        EnvName.RUN_DIR.value: str(live_dir.root),
        EnvName.LIVE_STORE.value: f"127.0.0.1:{store.port}",
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    group = live.LiveGroup("gloo", environ=env, join_timeout_s=30)
    group.start()
    try:
        assert group.enabled and not live_dir.progress.exists()  # no state attached yet
        group.attach(state=lambda: {}, load=lambda state: None, step=lambda: 0)
        told = read_report(live_dir.progress, Progress)
        assert told is not None and told.live_recovery is True
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------- end to end, on the mock
@pytest.mark.slow
def test_on_the_mock_the_tuned_interval_follows_the_first_measured_save(tmp_path):
    """examples/recipe.py under the daemon on the mock, at a failure rate that makes the
    job's MTBF 43 s: the first interval (the 60 s prior save) is 25 s; once the script's
    own checkpoint at step 20 reports its save time the daemon tunes it to about a second,
    every rank takes periodic checkpoints at one step and trains on, and the run ends in
    its first job bit-identical to an uninterrupted one; status and report show the
    interval and what it came from. The recipe keeps a memory tier: once its saves are
    told, the disk gets a longer interval (memory serving 99% of failures here), and some
    periodic checkpoints stay in memory."""
    steps = 150
    expected = reference_digest(tmp_path, steps)
    with on_a_fresh_mock(tmp_path) as cli:
        recipe = example_recipe(
            tmp_path, "tuned", ", failure_rate_prior=1e6, memory_tier_coverage=0.99"
        )
        out = cli.submit(
            "--dry-run",
            "-N",
            "2",
            str(recipe),
            "--",
            "--steps",
            str(steps),
            "--step-time",
            "0.05",
            "--ckpt-every",
            "20",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
        )
        s = cli.wait_for(out["run_id"], ended, 120, "the end of the run")
        assert s["state"] == "COMPLETED" and len(s["attempts"]) == 1, s
        final = json.loads((tmp_path / "ckpt" / "final.json").read_text())
        assert final["digest"] == expected
        logs = "".join(p.read_text() for p in (Path(s["run_dir"]) / "logs").glob("*.out"))
        periodic = [int(x) for x in re.findall(r"periodic checkpoint at step (\d+)", logs)]
        assert len(periodic) >= 2 and any(x % 20 for x in periodic), logs[-3000:]
        # the recipe keeps a memory tier: once its saves are told, two intervals
        assert re.search(r"periodic checkpoint at step \d+ to memory", logs), logs[-3000:]
        status = cli("status", out["run_id"]).stdout
        assert re.search(
            r"checkpoints: checkpoint to memory every [\d.]+s \(save [\d.]+s "
            r"measured\), to disk every [\d.]+s \(tuned: save [\d.]+s "
            r"\(measured\)",
            status,
        ), status
        rep = json.loads(cli("report", out["run_id"], "--json").stdout)
        assert rep["checkpoint_cadence"]["save_measured"] is True
        assert rep["checkpoint_cadence"]["interval_s"] < 5
        assert (
            rep["checkpoint_cadence"]["disk_interval_s"] >= rep["checkpoint_cadence"]["interval_s"]
        )
        cadences = [e for e in rep["timeline"] if e["kind"] == "cadence"]
        assert len(cadences) >= 2 and "prior, until one is measured" in cadences[0]["text"]

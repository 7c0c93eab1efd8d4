"""The goodput benchmark (benchmarks/goodput.py): its ideal bound against the published
worked cases, its traces, each policy's reaction to single faults on the virtual clock, and
a smoke run of the script. No timing is asserted."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "goodput.py"
DAY = 86400.0


def _load():
    spec = importlib.util.spec_from_file_location("goodput_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gp = _load()
POLICY = {p.key: p for p in gp.POLICIES}


# ------------------------------------------------------------------- the bound
def per_s(nodes: int, per_node_day: float) -> float:
    return nodes * per_node_day / DAY


@pytest.mark.parametrize(
    ("nodes", "interval_min", "queue_min", "expected"),
    [
        (2048, 60, 0, 0.68),  # 16k GPUs on RSC-1, u0 = 5 min, w = 0
        (2048, 5, 0, 0.93),
        (1000, 30, 1, 0.906),  # 8k GPUs, q = 1 min
        (12500, 7, 0, 0.52),  # 100k GPUs: 7 min for about 0.5
    ],
)
def test_kokolis_formula_reproduces_the_worked_cases(nodes, interval_min, queue_min, expected):
    ettr = gp.kokolis_ettr(per_s(nodes, 6.5e-3), 300, interval_min * 60, 0.0, queue_min * 60)
    assert ettr == pytest.approx(expected, abs=0.005)


@pytest.mark.parametrize(
    ("write_s", "restart_s", "interval_min", "expected"),
    [
        (10, 600, 8, 0.91),
        (60, 600, 19, 0.85),
        (300, 600, 43, 0.74),
        (10, 120, 8, 0.95),
    ],
)
def test_bound_at_the_young_daly_interval_llama3_rate(write_s, restart_s, interval_min, expected):
    b = gp.ideal_bound(2048, 3.79e-3, restart_s, write_s)
    assert b["interval_s"] / 60 == pytest.approx(interval_min, abs=0.6)
    assert b["ettr"] == pytest.approx(expected, abs=0.005)
    assert b["mttf_h"] == pytest.approx(24 / (2048 * 3.79e-3))


def test_young_daly_interval_worked_case_and_edges():
    # 1024 GPUs at the RSC-1 rate, 30 s writes: 42 min (the core's Young, in the bound)
    assert gp.ideal_bound(128, 6.5e-3, 300, 30)["interval_s"] / 60 == pytest.approx(42, abs=0.6)
    assert gp.ideal_bound(128, 6.5e-3, 300, 0)["interval_s"] == 0
    b = gp.ideal_bound(64, 0.0, 300, 60)
    assert b["ettr"] == 1.0 and b["interval_s"] == math.inf


def test_the_bound_is_the_best_ettr_over_intervals():
    lam = per_s(2048, 3.79e-3)
    best = gp.ideal_bound(2048, 3.79e-3, 300, 60)["ettr"]
    for minutes in (5, 10, 20, 40, 60, 120):
        assert gp.kokolis_ettr(lam, 300, minutes * 60, 60) <= best + 1e-3


# ------------------------------------------------------------------- the trace
def test_traces_are_deterministic_per_seed_and_follow_the_rates():
    a, b = gp.draw_trace(7, 2048, 30), gp.draw_trace(7, 2048, 30.0)
    assert a == b
    assert gp.draw_trace(8, 2048, 30).faults != a.faults
    assert len(a.pool) == 2048 + round(2048 * gp.SPARE_FRACTION)
    assert len(a.lemons) == round(len(a.pool) * gp.LEMON_FRACTION)
    assert [f.at for f in a.faults] == sorted(f.at for f in a.faults)
    assert all(0 <= f.at < 30 * DAY and f.node in a.pool for f in a.faults)
    assert all(f.node in a.lemons for f in a.faults if f.lemon)
    everything = len([f for f in a.faults if f.kind in ("node", "crash", "hang")])
    expected = gp.FAILURES_PER_NODE_DAY * len(a.pool) * 30
    assert 0.75 * expected < everything < 1.25 * expected  # the fleet average (Llama 3)
    ordinary = gp.HEALTHY_NODE_FAILURES_PER_NODE_DAY + gp.FAILURES_PER_NODE_DAY * (
        gp.SHARE_CRASH + gp.SHARE_HANG
    )
    assert a.ordinary_failures_per_node_day() == pytest.approx(ordinary, rel=0.3)
    assert (
        gp.LEMON_NODE_FAILURES_PER_NODE_DAY / gp.HEALTHY_NODE_FAILURES_PER_NODE_DAY
        == pytest.approx(206, abs=1)
    )


# --------------------------------------------------- single faults, each policy
def trace(*faults, days: float = 0.5, human: float = 1800.0):
    pool = tuple(f"n{i}" for i in range(1, 7))
    return gp.Trace(4, days, pool, frozenset(), tuple(faults), (human,) * 8)


def run(key: str, tr, setup=None):
    setup = setup or gp.JobSetup()
    camp = gp.Campaign(tr, {p.key: p for p in gp.policies(setup)}[key], setup)
    result = camp.run()
    total = result.productive_s + sum(result.lost_s.values())
    assert total == pytest.approx(result.wall_s)
    return camp, result


def test_without_faults_only_startup_and_checkpoints_cost():
    for key in POLICY:
        _, r = run(key, trace())
        assert r.lost_s["startup"] == pytest.approx(gp.RESTART_COST_S)
        others = {k: v for k, v in r.lost_s.items() if k not in ("startup", "checkpoint")}
        assert all(v == 0 for v in others.values()), (key, others)


def test_a_hang_waits_for_each_policys_timeout():
    tr = trace(gp.Fault(3600.0, "hang", "n1"))
    hung = {key: run(key, tr)[1].lost_s for key in POLICY}
    assert hung["plain"]["hung"] == pytest.approx(gp.NCCL_WATCHDOG_S)
    assert hung["plain"]["requeue"] == pytest.approx(gp.REQUEUE_DELAY_S + 1)
    assert hung["submitit"]["human"] == pytest.approx(1800)
    assert hung["nemo"]["hung"] == pytest.approx(305)  # heartbeat 300 s + 5 s check
    assert hung["nemo"]["requeue"] == 0  # restarted in the job
    assert hung["ftslurm"]["hung"] == pytest.approx(30.5)  # 3 x 10 s step + 0.5 s
    assert hung["ftslurm"]["requeue"] == 0


def test_a_hang_during_startup_meets_the_initial_timeouts():
    tr = trace(gp.Fault(100.0, "hang", "n2"))
    assert run("nemo", tr)[1].lost_s["hung"] == pytest.approx(1805)
    assert run("ftslurm", tr)[1].lost_s["hung"] == pytest.approx(600.5)


SLURM_DETECTS = [k for k, p in POLICY.items() if not p.peer_detect]


def test_a_node_failure_is_detected_by_slurm_then_requeued():
    tr = trace(gp.Fault(3600.0, "node", "n1"))
    # 300 s start-up, then one checkpoint cycle of 1800 + 60 s: 1440 s unsaved at 3600 s
    for key in SLURM_DETECTS:
        _, r = run(key, tr)
        assert r.lost_s["lost_work"] == pytest.approx(1440), key
        assert r.lost_s["detection"] == pytest.approx(gp.SLURMD_TIMEOUT_S), key
    assert run("plain", tr)[1].lost_s["requeue"] == pytest.approx(121)
    assert run("nemo", tr)[1].lost_s["requeue"] == pytest.approx(121)
    # the daemon's next look (on its own 60 s grid) requeues it and starts it at once
    assert 0 < run("ftslurm_slurm", tr)[1].lost_s["requeue"] <= gp.DAEMON_POLL_S + 1
    # submitit's job has no --no-requeue: Slurm's JobRequeue=1 requeues the NODE_FAIL
    sub = run("submitit", tr)[1]
    assert sub.lost_s["requeue"] == pytest.approx(121) and sub.lost_s["human"] == 0


def test_the_launchers_report_a_dead_node_and_the_daemon_moves_the_run_at_once():
    tr = trace(gp.Fault(3600.0, "node", "n2"))
    camp, r = run("ftslurm", tr)
    assert r.counts["peer_reports"] == 1 and r.counts["cause_node_fail"] == 1
    # reported PEER_DETECT_S after the death; the daemon's next look ends the job and
    # submits a new one without the node, long before SlurmdTimeout
    assert gp.PEER_DETECT_S <= r.lost_s["detection"] < gp.PEER_DETECT_S + gp.DAEMON_POLL_S + 1
    assert r.lost_s["detection"] < gp.SLURMD_TIMEOUT_S
    assert r.lost_s["lost_work"] == pytest.approx(1440)
    assert "n2" not in camp.alloc and r.counts["allocations"] == 2
    assert r.ettr > run("ftslurm_slurm", tr)[1].ettr


def test_a_hot_spare_takes_over_inside_the_allocation():
    tr = trace(gp.Fault(3600.0, "node", "n2"))
    camp, r = run("ftslurm_spares", tr)
    spares = POLICY["ftslurm_spares"].settings.spare_nodes
    assert len(camp.alloc) == 4 + spares and len(camp.active) == 4
    assert "n2" in camp.alloc and "n2" not in camp.active  # swapped out, same allocation
    assert r.counts["spare_swaps"] == 1 and r.counts["allocations"] == 1
    assert r.lost_s["requeue"] == 0 and r.lost_s["detection"] == pytest.approx(gp.PEER_DETECT_S)
    assert r.lost_s["startup"] == pytest.approx(2 * gp.RESTART_COST_S)  # the restart's u0
    assert r.spare_node_s == pytest.approx(spares * tr.horizon_s)  # idle all along
    assert r.ettr > run("ftslurm", tr)[1].ettr


def test_a_spare_is_no_help_when_the_batch_host_or_an_idle_spare_dies():
    host = trace(gp.Fault(3600.0, "node", "n1"))  # node rank 0: the batch script's host
    _, r = run("ftslurm_spares", host)
    assert r.counts.get("spare_swaps", 0) == 0 and r.counts["allocations"] == 2
    idle = trace(gp.Fault(3600.0, "node", "n5"))  # the spare itself: training goes on
    camp, r = run("ftslurm_spares", idle)
    assert r.counts.get("spare_swaps", 0) == 0 and r.counts["allocations"] == 1
    assert r.lost_s["lost_work"] == 0 and r.counts["peer_reports"] == 1


def test_with_a_spare_a_persistent_straggler_steps_out_inside_the_allocation():
    tr = trace(gp.Fault(3600.0, "straggler", "n2", duration_s=6 * 3600.0, slowdown=1.5))
    camp, r = run("ftslurm_spares", tr)
    assert r.counts["straggler_swaps"] == 1 and r.counts["allocations"] == 1
    assert "n2" in camp.alloc and "n2" not in camp.active  # a spare took its place
    assert r.counts.get("straggler_moves", 0) == 0 and r.lost_s["requeue"] == 0
    assert r.lost_s["stragglers"] < 300  # about 4 report windows at 2/3 speed
    moved = run("ftslurm", tr)[1]  # without a spare the job is moved by a held requeue
    assert moved.counts["straggler_moves"] == 1


def test_a_crash_restarts_in_the_job_with_a_launcher():
    tr = trace(gp.Fault(3600.0, "crash", "n3"))
    plain = run("plain", tr)[1]
    assert plain.lost_s["requeue"] == pytest.approx(121) and plain.counts["requeues"] == 1
    for key in ("nemo", "ftslurm"):
        _, r = run(key, tr)
        assert r.counts["in_job_restarts"] == 1 and r.counts["allocations"] == 1
        assert r.lost_s["requeue"] == 0 and r.lost_s["detection"] < 1


def test_wall_limit_continuations_lose_no_work_with_a_checkpoint_signal():
    tr = trace(days=1.5)
    lost = {key: run(key, tr)[1] for key in POLICY}
    assert lost["plain"].lost_s["lost_work"] > 0  # SIGTERM at the limit, no save
    for key in ("submitit", "nemo", "ftslurm"):
        assert lost[key].lost_s["lost_work"] == 0, key
        assert lost[key].counts["wall_limits"] == 1
    assert lost["ftslurm"].lost_s["requeue"] < lost["nemo"].lost_s["requeue"]


def test_ftslurm_keeps_a_failed_node_out_where_plain_requeue_takes_it_back():
    # n1 dies at 1 h and is repaired at 5 h; maintenance preempts the job at 6 h
    tr = trace(gp.Fault(3600.0, "node", "n1"), gp.Fault(6 * 3600.0, "maintenance", "n2"))
    plain, _ = run("plain", tr)
    assert "n1" in plain.alloc
    ft, r = run("ftslurm", tr)
    assert "n1" not in ft.alloc and "n2" not in ft.alloc
    assert r.lost_s["lost_work"] < run("plain", tr)[1].lost_s["lost_work"]  # saved on SIGTERM


def test_a_persistent_straggler_slows_others_and_ftslurm_moves_off_it():
    tr = trace(gp.Fault(3600.0, "straggler", "n2", duration_s=6 * 3600.0, slowdown=1.5))
    plain = run("plain", tr)[1]
    assert plain.lost_s["stragglers"] == pytest.approx(6 * 3600 * (1 - 1 / 1.5))
    ft, r = run("ftslurm", tr)
    assert r.counts["straggler_moves"] == 1 and "n2" not in ft.alloc
    assert r.lost_s["stragglers"] < 300  # about 4 report windows at 2/3 speed
    assert r.ettr > plain.ettr
    mild = trace(gp.Fault(3600.0, "straggler", "n2", duration_s=6 * 3600.0, slowdown=1.2))
    assert run("ftslurm", mild)[1].counts.get("straggler_moves", 0) == 0  # score 0.83 > 0.75


def test_the_core_decides_and_acts_the_script_calls_no_scheduler_action():
    """Every submission, requeue, exclusion, release, start and signal comes from the
    daemon's core (`Reconciler` -> `step`), through the scheduler protocol."""
    tree = ast.parse(SCRIPT.read_text())
    called = {
        n.func.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    actions = {
        "submit",
        "requeue",
        "release",
        "start_now",
        "update_excluded_nodes",
        "cancel",
        "signal",
        "send_signal",
        "requeue_many",
        "release_many",
        "start_now_many",
        "update_excluded_nodes_many",
    }
    assert not called & actions
    assert issubclass(gp.ToolShell, gp.Reconciler)
    camp = gp.Campaign(trace(gp.Fault(3600.0, "node", "n1")), POLICY["ftslurm"])
    camp.run()
    assert camp.r.counts["cause_node_fail"] == 1  # the daemon's own classification


# ---------------------------------------------------------------- the script
def bench(tmp_path: Path, *args: str) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--sizes",
            "16,32",
            "--days",
            "0.25",
            "--seed",
            "3",
            "--json",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,  # eleven policies, on a shared machine
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_script_smoke_json_plot_and_determinism(tmp_path):
    png = tmp_path / "out.png"
    out = bench(tmp_path, "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out["sizes"] == [16, 32] and out["days"] == 0.25 and out["seed"] == 3
    assert out["queue_waits_s"] == [0, 600]
    assert set(out["policies"]) == {
        "plain",
        "submitit",
        "nemo",
        "ftslurm_slurm",
        "ftslurm",
        "ftslurm_spares",
        "ftslurm_async",
        "ftslurm_memory",
        "ftslurm_all",
        "ftslurm_live",
        "ftslurm_live_sharded",
    }
    assert set(out["results"]) == {"16", "32"}
    for entry in out["results"].values():
        assert entry["trace"]["pool_nodes"] > entry["trace"]["nodes"]
        assert [r["queue_wait_s"] for r in entry["runs"]] == [0, 600]
        for one in entry["runs"]:
            bound = one["bounds"]["today"]
            # which bound is lower depends on the trace (a short one may hold no lemon
            # failure): test_strict_bound_is_below_todays_with_the_published_rates
            assert 0 < one["bounds"]["strict"]["ettr"] <= 1 and 0 < bound["ettr"] <= 1
            assert set(one["policies"]) == set(out["policies"])
            for p in one["policies"].values():
                assert set(p["lost_s"]) == set(out["causes"])
                assert p["wall_s"] == pytest.approx(0.25 * DAY)
                total = p["productive_s"] + sum(p["lost_s"].values())
                assert total == pytest.approx(p["wall_s"], rel=1e-6)
                assert p["ettr"] == pytest.approx(p["productive_s"] / p["wall_s"])
                assert 0 < p["ratio_to_bound"] <= 1
                fast = "async" if p["intervals"] is not None else "today"  # tuned: async w
                assert p["ratio_to_bound"] == pytest.approx(p["ettr"] / one["bounds"][fast]["ettr"])
    again = bench(tmp_path, "--plot", "")

    def strip(o: dict) -> tuple[dict, dict]:
        """The output without timings; the tuned policies' ETTR apart. The daemon reads a
        file changed within the last second of wall time again (reconcile `_RACY_NS`), so
        when it takes up the failure history, and the tuned interval it writes, can move a
        little from one run to the next; so can which of two close tuned policies the
        checks name as the highest (seen under load: ftslurm_all, then ftslurm_async)."""
        o = json.loads(json.dumps(o))
        o.pop("elapsed_s")
        tuned = {}
        for size, entry in o["results"].items():
            for one in entry["runs"]:
                for key, p in one["policies"].items():
                    p.pop("sim_s")
                    if p["intervals"] is not None:
                        tuned[size, one["queue_wait_s"], key] = p["ettr"]
                        one["policies"][key] = {"label": p["label"]}
        names = {key for _, _, key in tuned}
        o["checks"] = [
            re.sub(
                r"highest ETTR (\w+);",
                lambda m: "highest ETTR a tuned policy;" if m[1] in names else m[0],
                line,
            )
            for line in o["checks"]
        ]
        return o, tuned

    (exact, tuned), (exact_again, tuned_again) = strip(out), strip(again)
    assert exact_again == exact
    assert tuned_again == pytest.approx(tuned, abs=0.003)


def test_markdown_table_has_both_bounds_and_both_queue_waits(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "32", "--days", "1", "--markdown", "--plot", ""],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "today's bound" in lines[0] and "strict bound" in lines[0]
    assert [line.split("|")[2].strip() for line in lines[2:4]] == ["0 min", "10 min"]
    spares = [line for line in lines[4:] if line.strip()]  # their cost beside their gain
    assert len(spares) == 2 and all(
        "idle node-hours" in line and "gained" in line for line in spares
    )


# ------------------------------------------------------------ the calibration
def test_renewal_model_is_what_the_first_order_formula_expands():
    lam = per_s(2048, 6.5e-3)
    assert gp.renewal_ettr(lam, 300, 3600) == pytest.approx(0.714, abs=0.001)
    assert gp.renewal_ettr(lam, 300, 300) == pytest.approx(0.933, abs=0.001)
    small = per_s(16, 6.5e-3)
    assert gp.renewal_ettr(small, 300, 1800) == pytest.approx(
        gp.kokolis_ettr(small, 300, 1800), abs=1e-4
    )
    assert gp.renewal_ettr(0.0, 300, 1800) == 1.0


@pytest.mark.slow
def test_calibration_reproduces_kokolis_for_plain_requeue(capsys):
    assert gp.main(["--calibrate", "--days", "30", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["calibration"]
    assert [r["interval_s"] for r in rows] == [3600, 300]
    for r in rows:
        assert abs(r["simulated"] - r["paper"]) <= gp.CALIBRATION_TOLERANCE, r
        assert r["simulated"] == pytest.approx(r["renewal"], abs=0.02)
        assert r["failures_hit"] > 300  # 13.3 a day over 30 days
    gp.print_calibration(rows, 1, 30)
    printed = capsys.readouterr().out
    assert "0.70" in printed and "0.93" in printed


def test_calibration_fails_when_the_simulator_is_off(monkeypatch, capsys):
    monkeypatch.setattr(gp, "CALIBRATION_CASES", ((3600.0, 0.80),))
    assert gp.main(["--calibrate", "--days", "3"]) == 1
    assert "OFF" in capsys.readouterr().out


# ------------------------------------------------------------------ the bounds
def test_strict_bound_is_below_todays_with_the_published_rates():
    for size in (128, 2048):
        tr = gp.draw_trace(1, size, 30)
        b = gp.bounds(tr, gp.JobSetup())
        assert b["strict"]["ettr"] <= b["today"]["ettr"]
        assert b["strict"]["restart_s"] == 0 and b["today"]["restart_s"] == gp.RESTART_COST_S
        assert b["strict"]["failures_per_day"] > b["today"]["failures_per_day"]
        queued = gp.bounds(tr, gp.JobSetup(queue_wait_s=600))
        assert queued["today"]["ettr"] < b["today"]["ettr"]
        assert queued["strict"]["ettr"] < b["strict"]["ettr"]


# ------------------------------------------- each knob moves ETTR the right way
def test_queue_wait_delays_every_requeue_even_a_start_now():
    tr = trace(gp.Fault(3600.0, "node", "n1"))
    waited = gp.JobSetup(queue_wait_s=600)
    for key in ("plain", "nemo", "ftslurm", "submitit"):
        base, slow = run(key, tr)[1], run(key, tr, waited)[1]
        assert slow.lost_s["requeue"] == pytest.approx(600), key  # q covers the 121 s delay
        assert slow.ettr < base.ettr, key
    crash = trace(gp.Fault(3600.0, "crash", "n1"))  # submitit: a person resubmits, then q
    sub = run("submitit", crash, waited)[1]
    assert sub.lost_s["human"] == pytest.approx(1800)
    assert sub.lost_s["requeue"] == pytest.approx(600)


def test_checkpoint_write_restart_and_interval_move_ettr():
    quiet = trace()
    base = run("plain", quiet)[1].ettr
    assert run("plain", quiet, gp.JobSetup(checkpoint_cost_s=120))[1].ettr < base
    assert run("plain", quiet, gp.JobSetup(restart_cost_s=900))[1].ettr < base
    assert run("plain", quiet, gp.JobSetup(checkpoint_interval_s=3600))[1].ettr > base
    hit = trace(gp.Fault(3 * 3600.0, "node", "n1"))
    often = run("plain", hit, gp.JobSetup(checkpoint_interval_s=600))[1]
    rarely = run("plain", hit, gp.JobSetup(checkpoint_interval_s=7200))[1]
    assert often.lost_s["lost_work"] < rarely.lost_s["lost_work"]


def sim(fm, size=64, days=5.0, key="plain"):
    return gp.Campaign(gp.draw_trace(2, size, days, fm), POLICY[key]).run()


def test_failure_rate_straggler_rate_and_lemon_share_move_ettr():
    base = sim(gp.FailureModel())
    assert sim(gp.FailureModel(failures_per_node_day=4 * gp.FAILURES_PER_NODE_DAY)).ettr < base.ettr
    slow = sim(gp.FailureModel(straggler_episodes_per_node_day=0.05))
    assert slow.lost_s["stragglers"] > base.lost_s["stragglers"] and slow.ettr < base.ettr
    more = gp.FailureModel(lemon_share=0.95)
    default = gp.FailureModel()
    assert more.healthy_node_failures_per_node_day < default.healthy_node_failures_per_node_day
    tr, tr_more = gp.draw_trace(1, 1024, 30), gp.draw_trace(1, 1024, 30, more)
    assert (
        gp.bounds(tr_more, gp.JobSetup())["today"]["ettr"]
        > gp.bounds(tr, gp.JobSetup())["today"]["ettr"]
    )
    assert gp.FailureModel(lemon_fraction=0.0).lemon_node_failures_per_node_day == 0


def test_command_line_knobs_reach_the_simulation_and_bad_ones_are_refused(capsys):
    args = gp.parse_args(
        [
            "--failure-rate",
            "6.5",
            "--checkpoint-write",
            "0",
            "--restart",
            "60",
            "--interval",
            "300",
            "--queue-wait",
            "0,600,1200",
            "--lemon-share",
            "0.5",
            "--straggler-rate",
            "0",
        ]
    )
    assert args.failure_rate == 6.5 and args.queue_wait == (0, 600, 1200)
    assert gp.parse_args(["--policies", "plain,ftslurm_all", "--snapshot", "3"]).policies == (
        "plain",
        "ftslurm_all",
    )
    for bad in (
        ["--lemon-share", "2"],
        ["--interval", "0"],
        ["--queue-wait", "-5"],
        ["--restart", "-1"],
        ["--queue-wait", "soon"],
        ["--policies", "nope"],
        ["--snapshot", "0"],
        ["--memory-save", "-1"],
        ["--memory-restart", "x"],
    ):
        with pytest.raises(SystemExit) as e:
            gp.parse_args(bad)
        assert e.value.code == 2
    assert "error" in capsys.readouterr().err


# ------------------------------------------------------ baselines, fairly
def test_nemo_default_budget_would_stop_after_two_failed_attempts_in_a_row():
    crashes = [gp.Fault(t, "crash", "n1") for t in (1000, 1500, 2000, 2500)]
    again = [gp.Fault(t, "crash", "n2") for t in (4000, 4500, 5000, 5500)]
    camp, r = run("nemo", trace(*crashes, *again))
    assert r.counts["over_default_budget"] == 1  # NeMo-Run would have stopped here
    assert r.counts["allocations"] == 3  # the simulated budget is unlimited: it goes on
    assert "over_default_budget" not in run("plain", trace(*crashes, *again))[1].counts
    one = run("nemo", trace(*crashes))[1]  # one failed attempt: within the default
    assert "over_default_budget" not in one.counts
    # an attempt killed by a node failure keeps its "X" in the results file: failed too
    nodes = trace(gp.Fault(3600.0, "node", "n1"), gp.Fault(3 * 3600.0, "node", "n2"))
    assert run("nemo", nodes)[1].counts["over_default_budget"] == 1
    # a clean checkpointed continuation between the two resets the count
    apart = trace(gp.Fault(3600.0, "node", "n1"), gp.Fault(30 * 3600.0, "node", "n2"), days=1.5)
    r = run("nemo", apart)[1]
    assert r.counts["hit_node_failure"] == 2 and r.counts["wall_limits"] == 1
    assert "over_default_budget" not in r.counts


def test_virtual_cluster_queue_wait_holds_a_requeued_job_against_start_now():
    from ftslurm.backends.mock import model
    from ftslurm.backends.mock.model import MockConfig, MockNodeSpec
    from ftslurm.backends.mock.virtual import JobModel, VirtualCluster
    from ftslurm.core.types import JobOptions, JobState

    cfg = MockConfig(nodes=[MockNodeSpec(name="a", cpus=1)], requeue_delay_s=0)
    c = VirtualCluster(cfg, queue_wait_s=500)
    jid = c.submit(JobOptions(nodes=1), JobModel(1e6, 1000, 0))
    c.run(10)
    assert c.st.jobs[jid].state is JobState.RUNNING  # the first submission does not wait
    c.at(100, lambda: c.act(model.requeue(c.st, jid, False, c.now)))
    c.run(200)
    job = c.st.jobs[jid]
    assert job.state is JobState.PENDING
    model.start_now(c.st, jid, c.now)  # asks to start at once: the nodes are still busy
    c.run(job.submit_time + 499)
    assert job.state is JobState.PENDING
    c.run(job.submit_time + 501)
    assert job.state is JobState.RUNNING


# ------------------------------------- the tuned cadence, async saves, the memory tier
def test_the_tuned_interval_is_the_daemons_and_follows_the_failure_history(tmp_path):
    """The campaign reads the interval the daemon wrote (checkpoint-cadence.json) at every
    start; node failures the daemon records (node_lost) shorten it."""
    from ftslurm.core.cadence import Cadence
    from ftslurm.core.contract import RunDir
    from ftslurm.core.contract.reports import Progress
    from ftslurm.fsutil import read_json
    from ftslurm.runfiles import read_report

    two = trace(gp.Fault(3600.0, "node", "n2"), gp.Fault(3 * 3600.0, "node", "n3"), days=1.0)
    camp = gp.Campaign(two, POLICY["ftslurm_async"], workdir=tmp_path)
    r = camp.run()
    written = Cadence.from_json(read_json(tmp_path / "run" / "checkpoint-cadence.json"))
    progress = read_report(RunDir(tmp_path / "run").progress, Progress)  # as the agent's
    assert progress is not None and progress.model_extra == {} and progress.checkpoint_step
    assert written is not None and written.how == "tuned" and written.failures == 2
    assert written.save_s == gp.ASYNC_SNAPSHOT_S and written.write_s == gp.CHECKPOINT_COST_S
    assert r.intervals[0][2] == gp.CHECKPOINT_INTERVAL_S  # before the daemon wrote one
    assert r.intervals[-1][2] == pytest.approx(written.interval_s)
    tuned = [disk for _, _, disk in r.intervals[1:]]
    assert tuned[0] > tuned[-1]  # two failures seen: a higher rate, a shorter interval
    fixed = gp.Campaign(two, POLICY["ftslurm"]).run()
    assert fixed.intervals == []  # a fixed cadence reads nothing


def test_an_asynchronous_save_blocks_only_for_its_snapshot():
    quiet = trace()
    sync, fast = run("ftslurm", quiet)[1], run("ftslurm_async", quiet)[1]
    assert fast.lost_s["checkpoint"] == pytest.approx(
        sync.lost_s["checkpoint"] * gp.ASYNC_SNAPSHOT_S / gp.CHECKPOINT_COST_S
    )
    assert fast.ettr > sync.ettr


def test_an_in_job_restart_restores_from_memory_a_new_allocation_from_disk():
    # a crash at 3 h (in-job restart: the tuned intervals are read, memory every ~2 h, disk
    # every ~8 h), a crash 500 s after the next memory save, then a node failure: the new
    # allocation resumes from the disk checkpoint, older than what memory held
    second = 3 * 3600.0 + 0.5 + gp.MEMORY_RESTART_COST_S + 7196.0 + gp.MEMORY_SAVE_S + 500
    faults = (
        gp.Fault(3 * 3600.0, "crash", "n3"),
        gp.Fault(second, "crash", "n3"),
        gp.Fault(second + 1000, "node", "n2"),
    )
    _, r = run("ftslurm_memory", trace(*faults))
    assert r.counts["in_job_restarts"] == 2 and r.counts["allocations"] == 2
    assert r.lost_s["startup"] == pytest.approx(
        2 * gp.RESTART_COST_S + 2 * gp.MEMORY_RESTART_COST_S
    )
    assert r.intervals[1][1] == pytest.approx(7196, abs=1)  # the memory interval read
    lost = r.lost_s["lost_work"]
    assert lost > 7196 + 500  # what only memory held went with the allocation
    _, disk_only = run("ftslurm", trace(*faults))
    assert disk_only.lost_s["startup"] == pytest.approx(4 * gp.RESTART_COST_S)


def test_each_mechanism_moves_ettr_the_expected_way():
    crash = trace(gp.Fault(3 * 3600.0, "crash", "n3"))
    node = trace(gp.Fault(3 * 3600.0, "node", "n2"))
    e = {
        (name, key): run(key, tr)[1].ettr
        for name, tr in (("crash", crash), ("node", node))
        for key in (
            "ftslurm_slurm",
            "ftslurm",
            "ftslurm_spares",
            "ftslurm_async",
            "ftslurm_memory",
            "ftslurm_all",
        )
    }
    assert e["node", "ftslurm"] > e["node", "ftslurm_slurm"]  # peer detection
    assert e["node", "ftslurm_spares"] > e["node", "ftslurm"]  # a spare in the allocation
    for name in ("crash", "node"):
        assert e[name, "ftslurm_async"] > e[name, "ftslurm"]  # short blocking saves
        assert e[name, "ftslurm_memory"] > e[name, "ftslurm"]  # restore from memory
        assert e[name, "ftslurm_all"] >= max(
            e[name, k] for k in ("ftslurm", "ftslurm_spares", "ftslurm_async", "ftslurm_memory")
        )


# ------------------------------------------------------------------- live recovery
def test_live_recovery_is_everything_with_live_ranks_and_a_longer_disk_interval():
    live, everything = POLICY["ftslurm_live"], POLICY["ftslurm_all"]
    assert live.label == "ftslurm, live recovery" and live.live and not everything.live
    assert (live.tuned, live.async_save, live.memory_tier, live.peer_detect) == (
        True,
        True,
        True,
        True,
    )
    big = {p.key: p for p in gp.policies(gp.JobSetup(), 2048)}
    assert big["ftslurm_live"].settings.spare_nodes == big["ftslurm_all"].settings.spare_nodes
    # the product's cadence for a run that recovers live: the `live_recovery` setting (the
    # job reports `live_recovery` in progress.json), nothing set by hand
    settings = big["ftslurm_live"].settings
    assert settings.live_recovery and not big["ftslurm_all"].settings.live_recovery
    assert settings.memory_tier_coverage == big["ftslurm_all"].settings.memory_tier_coverage
    # the per-fault costs add up from their parts
    assert gp.LIVE_RANK_RECOVERY_S == pytest.approx(
        gp.LIVE_RANK_RESTART_S + gp.LIVE_RANK_SETUP_S + gp.LIVE_REFORM_S + gp.LIVE_RANK_TRANSFER_S
    )
    # a warm spare's ranks are started and set up ahead of time: not charged
    assert gp.LIVE_SPARE_RECOVERY_S == pytest.approx(gp.LIVE_REFORM_S + gp.LIVE_NODE_TRANSFER_S)
    assert gp.LIVE_NODE_TRANSFER_S == pytest.approx(405e9 * 16 / 16 / 25e9)
    # the measured crash (3.21 s on CPU) less what is charged apart: the launcher's
    # detection and the measurement's own 0.1 s step; the commit as measured, 0.33 ms
    assert gp.LIVE_RANK_RESTART_S + gp.FTSLURM_MONITOR_S + gp.LIVE_BENCH_STEP_S == (
        pytest.approx(3.21)
    )
    assert gp.LIVE_COMMIT_SHARE == pytest.approx(0.33e-3 / gp.STEP_S)


def _commit(seconds: float) -> float:
    """`seconds` of compute as the live policy reports it (the commit's share taken)."""
    return seconds / (1 + gp.LIVE_COMMIT_SHARE)


def test_without_faults_live_recovery_costs_its_commit_per_step():
    quiet = trace()
    live, everything = run("ftslurm_live", quiet)[1], run("ftslurm_all", quiet)[1]
    assert live.productive_s == pytest.approx(_commit(everything.productive_s))
    assert live.lost_s["checkpoint"] - everything.lost_s["checkpoint"] == pytest.approx(
        everything.productive_s - _commit(everything.productive_s)
    )
    assert live.counts.get("live_recoveries", 0) == 0


@pytest.mark.parametrize(
    ("kind", "node", "seen", "recovery"),
    [
        ("crash", "n3", ("detection", 0.5), gp.LIVE_RANK_RECOVERY_S),
        ("hang", "n3", ("hung", 30.5), gp.LIVE_SPARE_RECOVERY_S),
        ("node", "n2", ("detection", gp.PEER_DETECT_S), gp.LIVE_SPARE_RECOVERY_S),
    ],
)
def test_a_live_recovery_costs_one_step_not_a_restart(kind, node, seen, recovery):
    """The healthy ranks keep their processes: no in-job restart from a checkpoint, no new
    allocation; the job stands still for the detection and the recovery, then redoes one
    step."""
    tr = trace(gp.Fault(3600.0, kind, node))
    camp, r = run("ftslurm_live", tr)
    assert r.counts["live_recoveries"] == 1 and r.counts["allocations"] == 1
    assert r.counts.get("in_job_restarts", 0) == 0
    assert r.lost_s[seen[0]] == pytest.approx(seen[1])
    assert r.lost_s["startup"] == pytest.approx(gp.RESTART_COST_S + recovery)
    assert r.lost_s["lost_work"] == pytest.approx(_commit(gp.LIVE_REDONE_S))
    assert r.lost_s["requeue"] == 0
    if kind in ("node", "hang"):  # a warm spare took the node's place, in the same allocation
        assert r.counts["spare_swaps"] == 1
        assert node in camp.alloc and node not in camp.active
    if kind == "node":
        assert r.counts["peer_reports"] == 1
    _, everything = run("ftslurm_all", tr)
    assert r.ettr > everything.ettr


def test_live_recovery_loses_less_to_restarts_and_lost_work_than_everything():
    """The same trace, faults of every kind it covers: it loses less wall time to
    start-ups, lost work, detection and hangs than "ftslurm, everything"."""
    tr = trace(
        gp.Fault(2 * 3600.0, "crash", "n3"),
        gp.Fault(4 * 3600.0, "hang", "n4"),  # steps out: the one spare takes its place
        gp.Fault(6 * 3600.0, "crash", "n2"),
        gp.Fault(8 * 3600.0, "crash", "n1"),  # a rank of the batch host: its launcher lives
        days=0.75,
    )
    _, live = run("ftslurm_live", tr)
    _, everything = run("ftslurm_all", tr)
    assert live.counts["live_recoveries"] == 4 and live.counts["hang_step_outs"] == 1
    # without live recovery the fourth uses up the 3 in-job restarts: a new allocation
    assert everything.counts["in_job_restarts"] == 3 and everything.counts["allocations"] == 2

    def restarts(r):
        return sum(r.lost_s[k] for k in ("startup", "lost_work", "detection", "hung"))

    assert restarts(live) < restarts(everything) / 2
    assert live.ettr > everything.ettr


def test_live_recovery_leaves_the_batch_host_a_start_up_and_spare_shortage_to_the_old_path():
    host = trace(gp.Fault(3600.0, "node", "n1"))  # node rank 0 hosts the coordinator store
    _, r = run("ftslurm_live", host)
    assert r.counts.get("live_recoveries", 0) == 0 and r.counts["allocations"] == 2
    early = trace(gp.Fault(100.0, "crash", "n3"))  # during the start-up: as before
    _, r = run("ftslurm_live", early)
    assert r.counts.get("live_recoveries", 0) == 0 and r.counts["in_job_restarts"] == 1
    # two nodes lost with one spare: the first live, the second ends the allocation
    two = trace(gp.Fault(3600.0, "node", "n2"), gp.Fault(7200.0, "node", "n3"))
    _, r = run("ftslurm_live", two)
    assert r.counts["live_recoveries"] == 1 and r.counts["allocations"] == 2


def test_with_live_recovery_a_hung_node_steps_out_for_a_warm_spare_or_every_rank_restarts():
    """`launch_core.on_hang` under live recovery: (i) a spare left and not the batch host:
    once the hang timeout fires the hung node steps out (its bench record, why "hang") and a
    warm spare takes its ranks over, live, using no in-job restart; (ii) the batch host's
    rank (it may not step out) or no spare left: the node waits BENCH_WAIT_S for a peer to
    step out, then every rank restarts from the memory tier (today's path)."""
    camp, r = run("ftslurm_live", trace(gp.Fault(3600.0, "hang", "n3")))
    assert r.counts["live_hang"] == 1 and r.counts["hang_step_outs"] == 1
    assert r.counts.get("in_job_restarts", 0) == 0 and camp.restarts_left == 3
    assert "n3" not in camp.active and r.counts["spare_swaps"] == 1
    assert r.lost_s["hung"] == pytest.approx(30.5)
    assert r.lost_s["startup"] == pytest.approx(gp.RESTART_COST_S + gp.LIVE_SPARE_RECOVERY_S)
    assert r.lost_s["lost_work"] == pytest.approx(_commit(gp.STEP_S))
    for tr in (
        trace(gp.Fault(3600.0, "hang", "n1")),  # the batch host
        trace(gp.Fault(1800.0, "node", "n2"), gp.Fault(3600.0, "hang", "n3")),  # spare used
    ):
        camp, r = run("ftslurm_live", tr)
        assert r.counts.get("live_hang", 0) == 0 and r.counts.get("hang_step_outs", 0) == 0
        assert r.counts["in_job_restarts"] == 1 and r.counts["allocations"] == 1
        # its look at the rank, the other nodes' claims of the hang, the wait for a peer
        waited = gp.FROZEN_LOOK_S + gp.HANG_CLAIM_WAIT_S + gp.BENCH_WAIT_S
        assert r.lost_s["hung"] == pytest.approx(30.5 + waited)
        _, everything = run("ftslurm_all", tr)
        # the restart from memory costs as in "ftslurm, everything" (where the lost node
        # before it cost a restart from memory too, not a live take-over)
        assert r.lost_s["startup"] - everything.lost_s["startup"] == pytest.approx(
            gp.LIVE_SPARE_RECOVERY_S - gp.MEMORY_RESTART_COST_S if len(tr.faults) == 2 else 0
        )
    assert gp.BENCH_WAIT_S == 5.0


def test_with_a_sharded_state_a_fault_that_loses_a_part_restarts_every_rank_from_memory():
    """`group.attach(replicated=False)`: no replica holds a lost rank's or node's part, so
    once the round formed every rank gives up (SHARDED) and the launcher restarts every
    rank from the memory tier, as "ftslurm, everything" does, after the live attempt."""
    assert POLICY["ftslurm_live_sharded"].sharded and not POLICY["ftslurm_live"].sharded
    for kind, node, seen, attempt in (
        ("crash", "n3", ("detection", 0.5), gp.LIVE_SHARDED_RANK_S),
        ("hang", "n3", ("hung", 30.5), gp.LIVE_SHARDED_SPARE_S),
        ("node", "n2", ("detection", gp.PEER_DETECT_S), gp.LIVE_SHARDED_SPARE_S),
    ):
        tr = trace(gp.Fault(3600.0, kind, node))
        camp, r = run("ftslurm_live_sharded", tr)
        _, live = run("ftslurm_live", tr)
        _, everything = run("ftslurm_all", tr)
        assert r.counts.get("live_recoveries", 0) == 0, kind
        assert r.counts[f"live_given_up_{kind}"] == 1 and r.counts["in_job_restarts"] == 1
        assert r.counts["allocations"] == 1 and r.lost_s["requeue"] == 0
        assert r.lost_s[seen[0]] == pytest.approx(seen[1])
        # the live attempt, then the restart from memory (its start-up and the work since
        # the newest memory checkpoint, as "ftslurm, everything" loses them)
        restart = gp.RESTART_COST_S + gp.MEMORY_RESTART_COST_S
        assert r.lost_s["startup"] == pytest.approx(restart + attempt), kind
        assert r.lost_s["lost_work"] > gp.STEP_S
        assert r.ettr < live.ettr, kind
    # a crash's rank restarted alone used one in-job restart, the restart of every rank one more
    assert camp.restarts_left == 3  # the last case: a node, a spare's take-over uses none
    camp, r = run("ftslurm_live_sharded", trace(gp.Fault(3600.0, "crash", "n3")))
    assert camp.restarts_left == 1


def test_a_rank_restarted_alone_uses_one_of_the_allocations_in_job_restarts():
    """As the launcher's restart alone does: with the 3 in-job restarts spent, the fourth
    crash of the allocation ends it as before, and the run goes on in a new one."""
    crashes = [gp.Fault(h * 3600.0, "crash", "n3") for h in (2, 3, 4, 5)]
    _, r = run("ftslurm_live", trace(*crashes))
    assert gp.FTSLURM.num_in_job_restarts == 3
    assert r.counts["live_recoveries"] == 3 and r.counts["live_crash"] == 3
    assert r.counts["allocations"] == 2


def test_with_live_recovery_a_persistent_straggler_steps_out_for_a_warm_spare():
    tr = trace(gp.Fault(3600.0, "straggler", "n2", duration_s=6 * 3600.0, slowdown=1.5))
    camp, r = run("ftslurm_live", tr)
    assert r.counts["straggler_swaps"] == 1 and r.counts["live_recoveries"] == 1
    assert r.counts["allocations"] == 1 and r.counts.get("in_job_restarts", 0) == 0
    assert "n2" in camp.alloc and "n2" not in camp.active
    assert r.lost_s["startup"] == pytest.approx(gp.RESTART_COST_S + gp.LIVE_SPARE_RECOVERY_S)
    # about 4 report windows, then 3 steps, at 2/3 speed
    assert r.lost_s["stragglers"] < 300 + gp.LIVE_STEP_OUT_STEPS * gp.STEP_S
    _, spares = run("ftslurm_all", tr)
    assert r.lost_s["startup"] < spares.lost_s["startup"]


def test_with_live_recovery_a_mild_straggler_steps_out_too_by_default():
    """A node 1.2x slower scores 0.83: above today's threshold 0.75, below the live one 0.9
    (`ftslurm.core.settings.straggler_threshold`). The live policy sets no threshold: the
    daemon renders the rule's into the job, and the simulated launcher scores with what the
    job was given."""
    assert gp.FTSLURM.straggler_threshold is None  # the benchmark sets none
    mild = trace(gp.Fault(3600.0, "straggler", "n2", duration_s=6 * 3600.0, slowdown=1.2))
    camp, r = run("ftslurm_live", mild)
    assert camp._job_env().straggler_threshold == 0.9
    assert r.counts["straggler_swaps"] == 1 and r.counts["live_straggler"] == 1
    assert "n2" not in camp.active and r.counts["allocations"] == 1
    assert r.lost_s["stragglers"] < 300 + gp.LIVE_STEP_OUT_STEPS * gp.STEP_S
    # with cold spares (no live recovery) acting costs a restart of every rank: 0.75 holds
    spares, r = run("ftslurm_all", mild)
    assert spares._job_env().straggler_threshold == 0.75
    assert r.counts.get("straggler_swaps", 0) == 0 and "n2" in spares.active
    assert r.lost_s["stragglers"] == pytest.approx(6 * 3600 * (1 - 1 / 1.2))


@pytest.mark.parametrize(("slowdown", "moved"), [(1.2, 0), (1.5, 1)])
def test_with_no_spare_left_only_a_severe_straggler_moves_the_job(slowdown, moved):
    """The live threshold flags a node 1.2x slower (score 0.83); with the one spare taken by
    a lost node it cannot step out, and moving the whole job needs a score below 0.75
    (`ftslurm.core.settings.straggler_move_threshold`): flagged, not moved. A node 1.5x
    slower (0.67) still moves it."""
    faults = (
        gp.Fault(1800.0, "node", "n3"),
        gp.Fault(3600.0, "straggler", "n2", duration_s=6 * 3600.0, slowdown=slowdown),
    )
    pool = tuple(f"n{i}" for i in range(1, 9))  # room to place the job without n2 and n3
    _, r = run("ftslurm_live", gp.Trace(4, 0.5, pool, frozenset(), faults, (1800.0,) * 8))
    assert r.counts["live_node"] == 1 and r.counts.get("straggler_swaps", 0) == 0
    assert r.counts["stragglers_flagged"] == 1
    assert r.counts.get("straggler_moves", 0) == moved


def test_the_health_check_catches_a_lemon_before_its_failure_costs_work():
    """A lemon (n2) in the first allocation fails at 3 h. Without the check its failure
    costs the work since the last checkpoint; caught at the start (health_catch 1), it
    leaves 5 s in, before any rank trained, is kept out, and the run loses less work; with
    0 nothing changes. The same trace for each."""
    pool = tuple(f"n{i}" for i in range(1, 7))
    lemon = gp.Fault(3 * 3600.0, "node", "n2", lemon=True)
    tr = gp.Trace(4, 0.5, pool, frozenset({"n2"}), (lemon,), (1800.0,) * 8)
    base = POLICY["ftslurm"]
    without = gp.Campaign(tr, base)
    r0 = without.run()
    caught = gp.Campaign(tr, replace(base, health_catch=1.0))
    r1 = caught.run()
    assert r0.counts.get("health_caught", 0) == 0 and r0.counts["hit_lemon"] == 1
    assert r1.counts["health_caught"] == 1 and "n2" not in caught.alloc
    assert r1.lost_s["lost_work"] < r0.lost_s["lost_work"] and r1.ettr > r0.ettr

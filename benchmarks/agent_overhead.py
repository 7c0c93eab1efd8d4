"""Rank agent overhead: what each per-step call of the rank agent costs the training process.

Target: a section or a heartbeat costs the rank a few microseconds per step.

Every call is timed on its own (`time.perf_counter_ns` before and after, the statement inlined
in a generated loop as `timeit` does, so no extra function call is measured), `--calls` times
after a warm-up. The cost of the two clock reads (an empty statement timed the same way) is
subtracted. Reported per call: median, 99th percentile and mean in nanoseconds (the mean
includes the rare slow calls, e.g. the once-a-second progress write; the JSON also has the
maximum, which on a busy machine is mostly the OS scheduler). The garbage collector stays on,
as in a training loop. Each call is compared with a baseline measured in
the same run, so the ratios carry across machines: `with nullcontext(): pass` for context
managers, a call of an empty Python method for plain calls.

Two environments:
  launcher  as the launcher starts a rank: FTSLURM_HEARTBEAT_DIR (the shared-memory heartbeat
            record is written), FTSLURM_RUN_DIR (progress and straggler step times are kept),
            FTSLURM_CHECKPOINT_DIR, RANK=0, LOCAL_RANK=0 (all in a temporary folder);
  bare      none of these set: the agent only keeps its own bookkeeping.
The calls: `RankAgent.section(name)` (a "step" section, and a "step" with a nested "compute"
section), `heartbeat(step)`, `heartbeat()`, `should_checkpoint()` without a process group;
underneath, `HeartbeatWriter.beat`/`open_section`+`close_section`, `progress.report_step`,
and `StepTimer.record`, `StepTimer.step()`, `StepTimer.maybe_publish` (before it is due).

The writes that happen rarely are timed separately (`--rare-calls` each, launcher
environment): the progress file write that `report_step` makes at most once a second (the
same write `checkpoint_saved` makes every time) and the straggler window that
`maybe_publish` writes once per report interval (60 s by default).

The price of agreement: with torch.distributed initialised (gloo, world size 1, a FileStore
in the temporary folder), `should_checkpoint()` is one MAX all-reduce the first time in a
step and a cached answer after that; both are timed (`--collective-calls`), next to a bare
`dist.all_reduce` of a one-element tensor (the same one each time, and a new one each
time, as `should_checkpoint` makes).

Result validation (`agent.validate(loss)`, `ftslurm.agent.validation`), in the same process
group: what it adds to each step, against the same loop without it measured in the same
run (target: under 1% of a 100 ms step on CPU). Timed on their own: `capture_rng()` (what
`Training` captures before each step for a re-run in place) and `validate(loss, step)`
(the loss read, the checks, one MAX all-reduce); and a training loop (a small MLP, forward,
backward, SGD step) run `--validation-steps` times with and without them, in alternating
blocks so that both see the same machine; the difference of the two loops' median steps is
the cost per step (noisier than the direct sum: the step itself varies).

    python benchmarks/agent_overhead.py [--calls 100000] [--rare-calls 30]
                                        [--collective-calls 2000] [--no-collective]
                                        [--validation-steps 2000] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from ftslurm.agent import progress
from ftslurm.agent.heartbeat import HeartbeatWriter, read_beat
from ftslurm.agent.rank import RankAgent
from ftslurm.agent.straggler import StepTimer
from ftslurm.core.contract import RunDir
from ftslurm.core.contract.reports import Progress
from ftslurm.runfiles import read_report

ENV_KEYS = (
    "FTSLURM_HEARTBEAT_DIR",
    "FTSLURM_RUN_DIR",
    "FTSLURM_CHECKPOINT_DIR",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "FTSLURM_ATTEMPT",
)

_TEMPLATE = """
def _timed(_n, _clock, _out, {names}):
    for i in range(_n):
{pre}
        _t0 = _clock()
{stmt}
        _out[i] = _clock() - _t0
"""


class Baseline:
    """The baseline of a plain call: an empty method, called as `agent.heartbeat(i)` is."""

    def call(self, step: int | None = None) -> None:
        pass


def _indent(code: str) -> str:
    return "\n".join("        " + line for line in code.strip().splitlines())


def default_warmup(calls: int) -> int:
    """Untimed calls before the timed ones: a tenth, at least 1, at most 1000."""
    return min(1000, max(1, calls // 10))


def sample(
    stmt: str, calls: int, pre: str = "pass", warmup: int | None = None, **names: Any
) -> list[int]:
    """Nanoseconds of each of `calls` runs of `stmt` (after `warmup` untimed-for-the-result
    runs); `pre` runs before each, outside the timed part; `i` counts 0, 1, ... in each pass."""
    names = names or {"_unused": None}
    source = _TEMPLATE.format(names=", ".join(names), pre=_indent(pre), stmt=_indent(stmt))
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<timed: {stmt.strip()}>", "exec"), namespace)
    timed = namespace["_timed"]
    warm = default_warmup(calls) if warmup is None else warmup
    if warm:
        timed(warm, time.perf_counter_ns, [0] * warm, **names)
    out = [0] * calls
    timed(calls, time.perf_counter_ns, out, **names)
    return out


def summary(samples: list[int], overhead_ns: float) -> dict[str, Any]:
    """Median, p99, max and mean per call, less the cost of the clock reads."""
    s = sorted(samples)
    n = len(s)

    def net(x: float) -> float:
        return max(0.0, x - overhead_ns)

    return {
        "calls": n,
        "median_ns": net(s[n // 2]),
        "p99_ns": net(s[min(n - 1, int(n * 0.99))]),
        "max_ns": net(s[-1]),
        "mean_ns": net(sum(s) / n),
    }


@contextlib.contextmanager
def environment(values: dict[str, str] | None) -> Iterator[None]:
    """Set the launcher's variables (or remove them: None) for the block."""
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    for k in ENV_KEYS:
        os.environ.pop(k, None)
    os.environ.update(values or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------------- measurements
def measure_mode(
    mode: str, root: Path, calls: int, overhead: float, baselines: dict[str, float]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The per-step calls in one environment; returns rows and the checks (what the calls
    left behind, so that a reader can tell they all happened)."""
    launcher = mode == "launcher"
    env = None
    if launcher:
        env = {
            "FTSLURM_HEARTBEAT_DIR": str(root / "hb"),
            "FTSLURM_RUN_DIR": str(root / "run"),
            "FTSLURM_CHECKPOINT_DIR": str(root / "ckpt"),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "FTSLURM_ATTEMPT": "0",
        }
    rows: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}

    def add(call: str, stmt: str, baseline: str, pre: str = "pass", **names: Any) -> None:
        row = {
            "mode": mode,
            "call": call,
            "baseline": baseline,
            **summary(sample(stmt, calls, pre, **names), overhead),
        }
        # a baseline below the timer's resolution (its median less the timer's own cost
        # came out 0 under load) counts as 1 ns: the ratio is then a lower bound
        row["ratio"] = row["median_ns"] / max(baselines[baseline], 1.0)
        rows.append(row)

    with environment(env):
        agent = RankAgent()
        add(
            'RankAgent.section("step")',
            'with agent.section("step"):\n    pass',
            "nullcontext",
            agent=agent,
        )
        add("RankAgent.heartbeat(step)", "agent.heartbeat(i)", "call", agent=agent)
        checks["agent_step"] = agent.step
        if launcher:
            beat = read_beat(root / "hb", 0)
            checks["heartbeat_step_in_shared_memory"] = beat.step if beat else None
        add("RankAgent.heartbeat()", "agent.heartbeat()", "call", agent=agent)
        add(
            "RankAgent.should_checkpoint(), no process group",
            "agent.should_checkpoint()",
            "call",
            pre="agent.heartbeat(i)",
            agent=agent,
        )
        add(
            'section("step") ⊃ section("compute"), per step',
            'with agent.section("step"):\n    with agent.section("compute"):\n        pass',
            "nullcontext",
            agent=agent,
        )
        agent.close()
        if launcher:
            writer = HeartbeatWriter(root / "hb-writer", 0)
            add("HeartbeatWriter.beat(step)", "writer.beat(i)", "call", writer=writer)
            add(
                "HeartbeatWriter.open_section + close_section",
                'writer.open_section("step")\nwriter.close_section()',
                "call",
                writer=writer,
            )
            writer.close()
        add(
            "progress.report_step(step)", "report_step(i)", "call", report_step=progress.report_step
        )
        timer = StepTimer(60.0, rank=0, node="bench", run_dir=root / "timer" if launcher else None)
        add("StepTimer.record(seconds)", "timer.record(0.01)", "call", timer=timer)
        window = timer.window()
        checks["step_timer_samples"] = window.samples if window else 0
        add("StepTimer.step()", "with timer.step():\n    pass", "nullcontext", timer=timer)
        add("StepTimer.maybe_publish(), not due", "timer.maybe_publish()", "call", timer=timer)
    return rows, checks


def measure_rare(root: Path, calls: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The writes made once a second or once per interval, each timed `calls` times."""
    env = {"FTSLURM_RUN_DIR": str(root / "rare"), "RANK": "0", "FTSLURM_ATTEMPT": "0"}
    rows = []
    with environment(env):
        s = sample(
            "checkpoint_saved(i, 1.5)", calls, warmup=1, checkpoint_saved=progress.checkpoint_saved
        )
        rows.append(
            {
                "call": "progress.json write",
                "when": "report_step: at most once a second; checkpoint_saved: every call",
                **summary(s, 0),
            }
        )
        timer = StepTimer(1e-9, rank=0, node="bench", run_dir=root / "rare")
        s = sample("timer.maybe_publish()", calls, pre="timer.record(0.01)", warmup=1, timer=timer)
        rows.append(
            {
                "call": "StepTimer.maybe_publish(), due",
                "when": "once per report interval (60 s by default)",
                **summary(s, 0),
            }
        )
    saved = read_report(RunDir(root / "rare").progress, Progress)
    checks = {
        "progress_file_step": saved.step if saved is not None else None,
        "windows_published": timer.window_index,
    }
    return rows, checks


def measure_collective(root: Path, calls: int, overhead: float) -> dict[str, Any]:
    """should_checkpoint() with a gloo process group of one rank: the all-reduce, and the
    answer cached within the step; a bare all-reduce of the same tensor for comparison."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return {"skipped": "torch is not installed"}
    if not dist.is_available():
        return {"skipped": "torch.distributed is not available"}
    store = dist.FileStore(str(root / "gloo-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with environment(None):
            agent = RankAgent()
        tensor = torch.zeros(1, dtype=torch.int32)
        rows = {
            "all_reduce": summary(
                sample(
                    "all_reduce(tensor, op=MAX)",
                    calls,
                    all_reduce=dist.all_reduce,
                    tensor=tensor,
                    MAX=dist.ReduceOp.MAX,
                ),
                overhead,
            ),
            "all_reduce_new_tensor": summary(
                sample(
                    "all_reduce(tensor([0], dtype=int32), op=MAX)",
                    calls,
                    all_reduce=dist.all_reduce,
                    tensor=torch.tensor,
                    int32=torch.int32,
                    MAX=dist.ReduceOp.MAX,
                ),
                overhead,
            ),
            "should_checkpoint_first_in_step": summary(
                sample("agent.should_checkpoint()", calls, pre="agent.heartbeat(i)", agent=agent),
                overhead,
            ),
            "should_checkpoint_cached": summary(
                sample(
                    "agent.should_checkpoint()",
                    calls,
                    pre="agent.heartbeat(i)\nagent.should_checkpoint()",
                    agent=agent,
                ),
                overhead,
            ),
        }
        agent.close()
    finally:
        dist.destroy_process_group()
    first, cached = rows["should_checkpoint_first_in_step"], rows["should_checkpoint_cached"]
    return {
        "backend": "gloo",
        "world_size": 1,
        "torch": torch.__version__,
        **rows,
        "agreement_price_ns": first["median_ns"] - cached["median_ns"],
        "first_vs_all_reduce": first["median_ns"] / rows["all_reduce"]["median_ns"]
        if rows["all_reduce"]["median_ns"] > 0
        else None,
    }


STEP_BUDGET_NS = 100e6  # the 100 ms step the target is stated for
VALIDATION_BLOCK = 100  # steps per block of the alternating loops


def measure_validation(root: Path, calls: int, steps: int, overhead: float) -> dict[str, Any]:
    """Result validation's cost per step (the module doc), gloo with one rank."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return {"skipped": "torch is not installed"}
    from ftslurm.agent.validation import capture_rng

    store = dist.FileStore(str(root / "validation-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with environment(None):
            agent = RankAgent()
        validator = agent.validation()
        loss = torch.tensor(0.5)
        direct = {
            "capture_rng": summary(
                sample("capture_rng()", calls, capture_rng=capture_rng), overhead
            ),
            "validate": summary(
                sample("validator.validate(loss, i)", calls, validator=validator, loss=loss),
                overhead,
            ),
        }
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )
        optim = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = torch.randn(32, 64), torch.randn(32, 1)
        mse = torch.nn.functional.mse_loss

        def step(i: int, validated: bool) -> None:
            if validated:
                capture_rng()
            optim.zero_grad()
            out = mse(model(x), y)
            out.backward()
            if validated:
                validator.validate(out, i)
            optim.step()

        times: dict[bool, list[int]] = {False: [], True: []}
        clock = time.perf_counter_ns
        for i in range(VALIDATION_BLOCK):  # warm-up
            step(i, True)
            step(i, False)
        for block in range(max(1, steps // VALIDATION_BLOCK)):
            for validated in (block % 2 == 0, block % 2 == 1):
                for i in range(VALIDATION_BLOCK):
                    t0 = clock()
                    step(i, validated)
                    times[validated].append(clock() - t0)
        agent.close()
        checks = validator.checks
    finally:
        dist.destroy_process_group()
    plain, validated = summary(times[False], 0), summary(times[True], 0)
    per_step = direct["capture_rng"]["median_ns"] + direct["validate"]["median_ns"]
    loop = validated["median_ns"] - plain["median_ns"]
    return {
        "backend": "gloo",
        "world_size": 1,
        **direct,
        "loop_plain": plain,
        "loop_validated": validated,
        "loop_steps": len(times[False]),
        "per_step_ns": per_step,
        "loop_difference_ns": loop,
        "share_of_100ms_step": per_step / STEP_BUDGET_NS,
        "loop_share_of_100ms_step": loop / STEP_BUDGET_NS,
        "target_met": per_step < 0.01 * STEP_BUDGET_NS,
        "validated_results": checks,
    }


def run(
    calls: int,
    rare_calls: int,
    collective_calls: int,
    collective: bool,
    validation_steps: int = 2000,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ftslurm-agent-bench-") as tmp:
        root = Path(tmp)
        overhead = summary(sample("pass", calls), 0)["median_ns"]
        baselines = {
            "nullcontext": summary(
                sample("with nullcontext():\n    pass", calls, nullcontext=nullcontext), overhead
            )["median_ns"],
            "call": summary(sample("base.call(i)", calls, base=Baseline()), overhead)["median_ns"],
        }
        rows, checks = [], {}
        for mode in ("launcher", "bare"):
            mode_rows, mode_checks = measure_mode(mode, root, calls, overhead, baselines)
            rows += mode_rows
            checks[mode] = mode_checks
        rare, checks["rare"] = measure_rare(root, rare_calls)
        result: dict[str, Any] = {
            "calls": calls,
            "warmup_calls": default_warmup(calls),
            "rare_calls": rare_calls,
            "timer_overhead_ns": overhead,
            "baselines": {
                "nullcontext": {
                    "stmt": "with nullcontext(): pass",
                    "median_ns": baselines["nullcontext"],
                },
                "call": {"stmt": "obj.empty_method(step)", "median_ns": baselines["call"]},
            },
            "rows": rows,
            "rare": rare,
            "checks": checks,
        }
        result["collective"] = (
            measure_collective(root, collective_calls, overhead)
            if collective
            else {"skipped": "--no-collective"}
        )
        result["collective_calls"] = collective_calls if collective else 0
        result["validation"] = (
            measure_validation(root, collective_calls, validation_steps, overhead)
            if collective
            else {"skipped": "--no-collective"}
        )
    return result


# ---------------------------------------------------------------------------- output
def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 130))
    b = result["baselines"]
    t = Table(
        title=f"Rank agent, per call ({result['calls']:,} calls each; clock reads "
        f"({result['timer_overhead_ns']:.0f} ns) subtracted)",
        caption=f"baselines: with nullcontext(): pass = {b['nullcontext']['median_ns']:.0f}"
        f" ns; obj.empty_method(step) = {b['call']['median_ns']:.0f} ns",
    )
    for col in ("env", "call", "median ns", "p99 ns", "mean ns", "× baseline"):
        t.add_column(col, justify="left" if col in ("env", "call") else "right")
    for r in result["rows"]:
        ratio = f"{r['ratio']:.1f} ({r['baseline']})" if r["ratio"] is not None else "-"
        t.add_row(
            r["mode"],
            r["call"],
            f"{r['median_ns']:,.0f}",
            f"{r['p99_ns']:,.0f}",
            f"{r['mean_ns']:,.0f}",
            ratio,
        )
    console.print(t)
    t = Table(title=f"Rare writes (launcher environment, {result['rare_calls']} calls each)")
    for col in ("call", "how often", "median µs", "p99 µs", "max µs"):
        t.add_column(col, justify="left" if col in ("call", "how often") else "right")
    for r in result["rare"]:
        t.add_row(
            r["call"],
            r["when"],
            f"{r['median_ns'] / 1e3:,.1f}",
            f"{r['p99_ns'] / 1e3:,.1f}",
            f"{r['max_ns'] / 1e3:,.1f}",
        )
    console.print(t)
    print_validation(console, result["validation"])
    c = result["collective"]
    if "skipped" in c:
        console.print(f"should_checkpoint() with a process group: skipped ({c['skipped']})")
        return
    t = Table(
        title=f"should_checkpoint() with torch.distributed (gloo, world size 1, "
        f"{result['collective_calls']:,} calls each)"
    )
    for col in ("call", "median µs", "p99 µs", "mean µs"):
        t.add_column(col, justify="left" if col == "call" else "right")
    for key, label in (
        ("all_reduce", "dist.all_reduce(1 x int32, MAX), same tensor"),
        ("all_reduce_new_tensor", "dist.all_reduce(1 x int32, MAX), new tensor"),
        ("should_checkpoint_first_in_step", "should_checkpoint(), first in step"),
        ("should_checkpoint_cached", "should_checkpoint(), again in the step"),
    ):
        r = c[key]
        t.add_row(
            label,
            f"{r['median_ns'] / 1e3:,.2f}",
            f"{r['p99_ns'] / 1e3:,.2f}",
            f"{r['mean_ns'] / 1e3:,.2f}",
        )
    console.print(t)
    ratio = c["first_vs_all_reduce"]
    console.print(
        f"price of agreement per step: {c['agreement_price_ns'] / 1e3:,.2f} µs"
        + (f" ({ratio:.2f} × a bare all-reduce)" if ratio else "")
    )


def print_validation(console: Any, v: dict[str, Any]) -> None:
    from rich.table import Table

    if "skipped" in v:
        console.print(f"result validation: skipped ({v['skipped']})")
        return
    t = Table(title="Result validation per step (gloo, world size 1)")
    for col in ("what", "median µs", "p99 µs", "mean µs"):
        t.add_column(col, justify="left" if col == "what" else "right")
    for key, label in (
        ("capture_rng", "capture_rng() (Training, before each step)"),
        ("validate", "validate(loss, step): checks + MAX all-reduce"),
        ("loop_plain", f"a training step without validation ({v['loop_steps']:,} steps)"),
        ("loop_validated", "the same step with capture_rng + validate"),
    ):
        r = v[key]
        t.add_row(
            label,
            f"{r['median_ns'] / 1e3:,.2f}",
            f"{r['p99_ns'] / 1e3:,.2f}",
            f"{r['mean_ns'] / 1e3:,.2f}",
        )
    console.print(t)
    console.print(
        f"validation costs {v['per_step_ns'] / 1e3:,.1f} µs per step "
        f"({100 * v['share_of_100ms_step']:.3f}% of a 100 ms step; the loops differ by "
        f"{v['loop_difference_ns'] / 1e3:,.1f} µs): target under 1%: "
        + ("met" if v["target_met"] else "NOT met")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000, help="timed calls per row")
    parser.add_argument("--rare-calls", type=int, default=30, help="timed calls per rare write")
    parser.add_argument(
        "--collective-calls", type=int, default=2000, help="timed calls per collective row"
    )
    parser.add_argument(
        "--no-collective", action="store_true", help="skip the torch.distributed measurement"
    )
    parser.add_argument(
        "--validation-steps",
        type=int,
        default=2000,
        help="training steps per loop (with and without result validation)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if min(args.calls, args.rare_calls, args.collective_calls, args.validation_steps) < 1:
        parser.error("call counts must be positive")
    result = run(
        args.calls,
        args.rare_calls,
        args.collective_calls,
        not args.no_collective,
        args.validation_steps,
    )
    if args.json:
        print(json.dumps(result))
    else:
        print_tables(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The reconcile loop driven through random histories (hypothesis), against the mock's pure
controller model on a virtual clock: jobs end in every way, nodes die, the scheduler has
outages, the daemon crashes half-way through an action and restarts, users cancel.

Whatever happens, these hold:
- no job is ever submitted twice for one attempt (one tag, at most one `submit`);
- a run that reached a terminal state is never acted on again;
- a run never has two jobs queued or running at once;
- no budget is exceeded (failure retries, per-cause budgets, stalled continuations);
- once the world calms down (nodes back, jobs finishing), every run ends.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from ftslurm.backends.batch import OneJobPerCommand
from ftslurm.backends.mock import model
from ftslurm.core.types import ClusterFacts, JobInfo, JobOptions, NodeInfo, SignalTarget
from ftslurm.daemon.policy import FtSettings
from ftslurm.daemon.reconcile import Reconciler
from ftslurm.daemon.records import new_run_record
from ftslurm.daemon.step import flag_node
from ftslurm.daemon.store import Store
from ftslurm.daemon.submission import make_spec
from ftslurm.errors import FtslurmError, SchedulerUnavailable
from ftslurm.recipe import Recipe

MUTATING = {
    "submit",
    "cancel",
    "requeue",
    "release",
    "update_excluded_nodes",
    "start_now",
    "signal",
}


class DaemonCrash(BaseException):
    """The daemon process dies (not an error it could handle)."""


class ModelBackend(OneJobPerCommand):
    """The scheduler protocol over the mock controller's pure model, with a virtual clock,
    a log of every command, outages and crashes on demand. Processes are imaginary: a job
    runs until the test says how it exits, or until a kill signal reaches it. A batch
    action is one command per job (`OneJobPerCommand`), each logged, each may crash."""

    def __init__(self) -> None:
        self.st = model.MockState.create(
            model.MockConfig(
                min_job_age_s=30, requeue_delay_s=120, kill_wait_s=5, slurmd_timeout_s=10
            )
        )
        self.now = 1_000_000.0
        self.exited: dict[str, model.Exited] = {}
        self.log: list[tuple[float, str, str]] = []  # (time, method, job id or tag)
        self.submitted: Counter[str] = Counter()  # tag -> submissions
        self.outage = 0  # the next `outage` calls fail
        self.crash_after_next_mutation = False

    def _call(self, method: str, key: str) -> None:
        if self.outage:
            self.outage -= 1
            raise SchedulerUnavailable(f"{method}: controller not responding")
        self.log.append((self.now, method, key))

    def _step(self, fn):  # type: ignore[no-untyped-def]
        effects = model.advance(self.st, self.now, self.exited)
        self.exited = {}
        result, more = fn()
        self._carry_out(effects + more + model.advance(self.st, self.now, {}))
        return result

    def _carry_out(self, effects: Sequence[model.Effect]) -> None:
        for e in effects:
            kill = isinstance(e, model.KillJob | model.KillNode) or (
                isinstance(e, model.Signal) and e.sig in (9, 15)
            )
            if kill:  # the imaginary processes obey at once
                self.exited[e.job_id] = (None, 9 if not isinstance(e, model.Signal) else 15)

    def _mutated(self) -> None:
        if self.crash_after_next_mutation:
            self.crash_after_next_mutation = False
            raise DaemonCrash()

    # ------------------------------------------------------------------ protocol
    def submit(self, script: str, options: JobOptions) -> str:
        self._call("submit", options.comment or "")
        job_id = self._step(lambda: (model.submit(self.st, script, options, self.now), []))
        self.submitted[options.comment or ""] += 1
        self._mutated()
        return job_id

    def query(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        self._call("query", ",".join(job_ids))
        return self._step(lambda: (model.query(self.st, list(job_ids), self.now), []))

    def find_jobs(self, comment: str, since: float | None = None) -> list[JobInfo]:
        self._call("find_jobs", comment)
        return self._step(lambda: (model.find_jobs(self.st, comment, since, self.now), []))

    def _act(self, method: str, job_id: str, fn) -> None:  # type: ignore[no-untyped-def]
        self._call(method, job_id)
        self._step(fn)
        self._mutated()

    def cancel(self, job_id: str) -> None:
        self._act("cancel", job_id, lambda: (None, model.cancel(self.st, job_id, self.now)))

    def requeue(self, job_id: str, *, hold: bool = False) -> None:
        self._act("requeue", job_id, lambda: (None, model.requeue(self.st, job_id, hold, self.now)))

    def release(self, job_id: str) -> None:
        self._act("release", job_id, lambda: (model.release(self.st, job_id), []))

    def update_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        self._act(
            "update_excluded_nodes",
            job_id,
            lambda: (model.update_excluded_nodes(self.st, job_id, list(nodes)), []),
        )

    def start_now(self, job_id: str) -> None:
        self._act("start_now", job_id, lambda: (model.start_now(self.st, job_id, self.now), []))

    def signal(self, job_id: str, sig: str, target: SignalTarget = SignalTarget.STEPS) -> None:
        self._act("signal", job_id, lambda: (None, model.send_signal(self.st, job_id, sig, target)))

    def nodes(self) -> list[NodeInfo]:
        self._call("nodes", "")
        return self._step(lambda: (model.node_infos(self.st), []))

    def cluster_facts(self) -> ClusterFacts:
        self._call("cluster_facts", "")
        return model.cluster_facts(self.st)

    # ------------------------------------------------------------------ the world
    def running(self) -> list[str]:
        return sorted(j.job_id for j in self.st.jobs.values() if j.state is model.JobState.RUNNING)

    def active_by_comment_prefix(self, prefix: str) -> list[str]:
        return [
            j.job_id
            for j in self.st.jobs.values()
            if j.comment and j.comment.startswith(prefix) and j.state.is_active
        ]


def running_on_the_model(
    tmp: Path, nodes: int, settings: FtSettings | None = None, cycles: int = 5
) -> tuple[ModelBackend, Store, Reconciler]:
    """Run "r0" (by default 2 retries, no checkpoint signal; 10 minutes) submitted by an
    in-process daemon and seen running on the mock's model, after `cycles` cycles of a
    virtual clock."""
    backend = ModelBackend()
    store = Store(tmp / "home")
    ft = settings or FtSettings(num_job_retries_on_failure=2, preempt_time=0)
    spec = make_spec(
        Recipe(command=["true"], nodes=nodes, time="10:00"),
        run_dir=tmp / "run",
        backend="mock",
        workdir=str(tmp),
        mock_home=tmp / "mock",
    )
    run, first = new_run_record("r0", "r0", spec, ft, backend.now)
    store.add_run(run)
    store.add_attempt(first)
    rec = Reconciler(store, lambda _kind: backend, clock=lambda: backend.now)
    for _ in range(cycles):
        rec.cycle()
        backend.now += 1
    return backend, store, rec


EXITS = [0, 1, 3, 75, 74, 16, 17, 93, 137]
op = st.one_of(
    st.tuples(st.just("cycle"), st.just(0)),
    st.tuples(st.just("wait"), st.sampled_from([1, 5, 30, 130])),
    st.tuples(st.just("exit"), st.sampled_from(EXITS)),
    st.tuples(st.just("exit"), st.sampled_from(EXITS)),  # twice: endings drive the policy
    st.tuples(st.just("wait"), st.sampled_from([1, 5, 30, 130])),
    st.tuples(st.just("node_fail"), st.integers(0, 3)),
    st.tuples(st.just("outage"), st.integers(1, 3)),
    st.tuples(st.just("crash"), st.just(0)),
    st.tuples(st.just("restart"), st.just(0)),
    st.tuples(st.just("cancel"), st.integers(0, 1)),
)


EXAMPLES = int(os.environ.get("FTSLURM_PROPERTY_EXAMPLES", "40"))  # more for a deeper search


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=5, max_size=40),
    retries=st.integers(0, 2),
    node_fail_budget=st.sampled_from([None, 0, 1]),
    nodes=st.integers(1, 2),
)
# found by a random search: the daemon dies right after releasing a requeued job, which then
# runs and fails before the restarted daemon looks (it must still see the attempt through)
@example(
    ops=[
        ("cancel", 0),
        ("wait", 130),
        ("crash", 0),
        ("wait", 130),
        ("crash", 0),
        ("exit", 3),
        ("restart", 0),
        ("wait", 30),
    ],
    retries=2,
    node_fail_budget=None,
    nodes=2,
)
def test_reconcile_histories_keep_the_invariants(ops, retries, node_fail_budget, nodes):
    with tempfile.TemporaryDirectory() as tmp:
        _run_history(Path(tmp), ops, retries, node_fail_budget, nodes)


def _run_history(tmp: Path, ops, retries, node_fail_budget, nodes) -> None:  # noqa: C901
    backend = ModelBackend()
    store = Store(tmp / "home")
    budgets = {} if node_fail_budget is None else {"node_fail": node_fail_budget}
    ft = FtSettings(
        num_job_retries_on_failure=retries,
        cause_budgets=budgets,
        preempt_time=0,
        max_stalled_continuations=2,
    )
    runs = []
    for i in range(2):
        recipe = Recipe(command=["true"], nodes=nodes, time="10:00")
        spec = make_spec(
            recipe,
            run_dir=tmp / f"run{i}",
            backend="mock",
            workdir=str(tmp),
            mock_home=tmp / "mock",
        )
        run, first = new_run_record(f"r{i}", f"r{i}", spec, ft, backend.now)
        store.add_run(run)
        store.add_attempt(first)
        runs.append(run.run_id)

    def daemon() -> Reconciler:
        return Reconciler(store, lambda _kind: backend, clock=lambda: backend.now)

    rec = daemon()
    terminal_at: dict[str, float] = {}

    def cycle() -> None:
        nonlocal rec
        try:
            rec.cycle()
        except DaemonCrash:
            rec = daemon()  # killed half-way; systemd starts it again
        except FtslurmError:
            pass  # what the service does: log it and look again a little later
        for run_id in runs:
            run = store.get_run(run_id)
            assert run is not None
            if run.state.is_terminal:
                terminal_at.setdefault(run_id, backend.now)

    for kind, arg in ops:
        if kind == "cycle":
            cycle()
        elif kind == "wait":
            backend.now += arg
            cycle()
        elif kind == "exit":
            running = backend.running()
            if running:
                code = arg if arg < 128 else None
                backend.exited[running[0]] = (code, 9 if code is None else None)
        elif kind == "node_fail":
            name = sorted(backend.st.nodes)[arg]
            backend._step(lambda n=name: (None, model.fail_node(backend.st, n, backend.now)))
        elif kind == "outage":
            backend.outage = arg
        elif kind == "crash":
            backend.crash_after_next_mutation = True
        elif kind == "restart":
            rec = daemon()
        elif kind == "cancel":
            store.request_cancel(runs[arg], backend.now)
        _check(store, backend, runs, ft)

    # then a calm world (the admins bring the nodes back, the jobs that run finish): every
    # run must end, whatever state the history left it in
    backend.outage, backend.crash_after_next_mutation = 0, False
    for name in backend.st.nodes:
        model.revive_node(backend.st, name)
    for _ in range(200):
        if all(store.get_run(r).state.is_terminal for r in runs):  # type: ignore[union-attr]
            break
        for job_id in backend.running():
            backend.exited[job_id] = (0, None)
        backend.now += 31
        cycle()
        _check(store, backend, runs, ft)
    stuck = {
        r: store.get_run(r).state.value
        for r in runs  # type: ignore[union-attr]
        if not store.get_run(r).state.is_terminal
    }  # type: ignore[union-attr]
    assert not stuck, (
        stuck,
        [(a.run_id, a.attempt, a.state, a.job_id) for r in stuck for a in store.attempts(r)],
    )
    kinds = {e.kind for e in store.events()}
    for kind in ("adopted", "requeued", "submitted", "ended"):
        event(f"{kind}: {kind in kinds}")
    event(f"retries used: {max(store.get_run(r).job_retries_used for r in runs)}")  # type: ignore[union-attr]
    event(f"states: {sorted(store.get_run(r).state.value for r in runs)}")  # type: ignore[union-attr]
    # a terminal run is never acted on again (its own last actions came before)
    for run_id, when in terminal_at.items():
        jobs = {a.job_id for a in store.attempts(run_id) if a.job_id}
        tags = {a.tag for a in store.attempts(run_id)}
        late = [
            (t, m, k)
            for t, m, k in backend.log
            if t > when and m in MUTATING and (k in jobs or k in tags)
        ]
        assert not late, (run_id, late)


def _check(store: Store, backend: ModelBackend, runs: list[str], ft: FtSettings) -> None:
    duplicated = {tag: n for tag, n in backend.submitted.items() if n > 1}
    assert not duplicated, duplicated
    for run_id in runs:
        run = store.get_run(run_id)
        assert run is not None
        assert run.job_retries_used <= ft.num_job_retries_on_failure
        for cause, cap in ft.cause_budgets.items():
            assert run.cause_counts.get(cause.value, 0) <= cap
        assert run.stalled_continuations <= ft.max_stalled_continuations
        active = backend.active_by_comment_prefix(f"ftslurm:{run_id}:")
        assert len(active) <= 1, (run_id, active)


def test_a_node_flagged_again_soon_is_kept_out_longer(tmp_path):
    store = Store(tmp_path / "home")
    rec = Reconciler(store, lambda _kind: ModelBackend(), clock=lambda: 0.0)
    ft = FtSettings()
    day = ft.node_exclusion_ttl_s
    for now, run_id in ((0.0, "r0"), (1.5 * day, "r1")):  # back for half a day, failed again
        rec._write_flag(flag_node("n2", "node_fail", store.node_flags(), now, ft), now, run_id)
    (flag,) = store.node_flags()
    assert (flag.since, flag.expires_at, flag.run_id) == (1.5 * day, 3.5 * day, "r1")

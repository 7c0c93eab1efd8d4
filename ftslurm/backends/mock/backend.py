"""`MockScheduler`: the scheduler protocol over a simulated cluster that runs real processes.

Every call is one transaction on the shared store: observe which jobs' processes ended,
advance the state machine to `now`, apply the call, then carry out the effects (launch a
batch script, signal, kill) through `procs`. A controller process (`controller.py`) makes
the same `tick` calls on its own so time limits, signals and the queue move even when no
client calls. Several processes can use one mock cluster at once: they share its folder.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from ftslurm.backends import batch
from ftslurm.backends.mock import model, procs
from ftslurm.backends.mock.model import MockConfig, MockJob, MockState
from ftslurm.backends.mock.store import MockStore
from ftslurm.backends.slurm_cli.parse import compress_nodes
from ftslurm.core.contract import EnvName
from ftslurm.core.inject import InjectKind, env_value
from ftslurm.core.types import (
    ClusterFacts,
    JobInfo,
    JobOptions,
    JobState,
    NodeInfo,
    SignalTarget,
)
from ftslurm.errors import ConfigError, FtslurmError

T = TypeVar("T")


class MockScheduler(batch.OneJobPerCommand):  # batches: one job per call
    """A faithful small Slurm on this machine (see `model` for what it simulates)."""

    name = "mock"

    def __init__(
        self,
        home: Path | str,
        config: MockConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = MockStore(home)
        self.store.initialise(config)
        self.clock = clock

    # ------------------------------------------------------------------ the core
    def _op(
        self,
        fn: Callable[[MockState, float], tuple[T, list[model.Effect]]],
        read_only: bool = False,
    ) -> T:
        """One operation in one transaction. The state is written back after every
        operation that may change it; a read-only one (a query, a listing) writes only when
        the cluster moved meanwhile (an exit seen, an effect, a counted change)."""
        with self.store.transaction() as st:
            now = self.clock()
            counted = model.changes()
            exited = self._exited(st)
            effects = model.advance(st, now, exited)
            result, more = fn(st, now)
            effects += more
            if model.changes() != counted:  # unchanged, advancing again would change nothing
                effects += model.advance(st, now, {})  # e.g. a new job may start at once
            if not read_only or exited or effects:  # an in-place change is not counted:
                model.mark_changed()  # write, as any operation that may change the state
            self._carry_out(st, effects, now)
            return result

    def tick(self) -> float | None:
        """Advance the cluster to now; return when the next timed event is due."""
        return self._op(lambda st, now: (model.next_event_time(st), []), read_only=True)

    def _exited(self, st: MockState) -> dict[str, model.Exited]:
        exited: dict[str, model.Exited] = {}
        for job in st.jobs.values():
            if job.state not in (JobState.RUNNING, JobState.COMPLETING):
                continue
            job_dir = self.store.job_dir(job.job_id)
            status = procs.exit_status(job_dir)
            if status is not None:
                exited[job.job_id] = status
            elif not procs.batch_alive(job_dir):
                if any(st.nodes[n].dead_since is not None for n in job.nodes):
                    continue  # its host died: the controller learns it after SlurmdTimeout
                exited[job.job_id] = (None, None)
        return exited

    def _carry_out(self, st: MockState, effects: list[model.Effect], now: float) -> None:
        for effect in effects:
            job_dir = self.store.job_dir(effect.job_id)
            match effect:
                case model.Launch(job_id):
                    self._launch(st, st.jobs[job_id])
                case model.Signal(_, sig, SignalTarget.STEPS):
                    procs.signal_steps(job_dir, sig)
                case model.Signal(_, sig, SignalTarget.BATCH):
                    procs.signal_batch(job_dir, sig)
                case model.Signal(_, sig, SignalTarget.ALL):
                    procs.signal_steps(job_dir, sig)
                    procs.signal_batch(job_dir, sig)
                case model.SignalRank(_, rank, sig):
                    if not procs.signal_rank(job_dir, rank, sig):
                        model.rank_not_running(st, effect, now)
                case model.KillJob(_):
                    procs.kill_job(job_dir)
                case model.KillNode(job_id, node):
                    job = st.jobs.get(job_id)
                    batch_host = job.nodes[0] if job and job.nodes else ""
                    procs.kill_node(job_dir, node, batch_host)
                case model.NodeDown(_, node):
                    procs.node_down(job_dir, node)

    def _launch(self, st: MockState, job: MockJob) -> None:
        try:
            script, env = self.store.launch_spec(job)
        except FtslurmError as exc:  # the job fails at once, its output saying why
            script, env = f"#!/bin/bash\necho {shlex.quote(str(exc))} >&2\nexit 1\n", {}
        nodelist = compress_nodes(job.nodes)
        ntasks = len(job.nodes) * job.ntasks_per_node
        env.update(
            {
                "SLURM_JOB_ID": job.job_id,
                "SLURM_JOBID": job.job_id,
                "SLURM_JOB_NAME": job.name,
                "SLURM_JOB_NODELIST": nodelist,
                "SLURM_NODELIST": nodelist,
                "SLURM_NNODES": str(len(job.nodes)),
                "SLURM_JOB_NUM_NODES": str(len(job.nodes)),
                "SLURM_NTASKS": str(ntasks),
                "SLURM_NPROCS": str(ntasks),
                "SLURM_NTASKS_PER_NODE": str(job.ntasks_per_node),
                "SLURM_TASKS_PER_NODE": f"{job.ntasks_per_node}(x{len(job.nodes)})",
                "SLURM_JOB_CPUS_PER_NODE": f"{job.cpus_per_node}(x{len(job.nodes)})",
                "SLURM_JOB_PARTITION": job.partition,
                "SLURM_SUBMIT_DIR": job.workdir,
                "SLURM_SUBMIT_HOST": socket.gethostname(),
                "SLURMD_NODENAME": job.nodes[0],
                "SLURM_NODEID": "0",
                "SLURM_PROCID": "0",
                "SLURM_LOCALID": "0",
                "SLURM_CLUSTER_NAME": st.config.cluster_name,
                "FTSLURM_MOCK_HOME": str(self.store.home),
            }
        )
        if job.comment:
            env["SLURM_JOB_COMMENT"] = job.comment
        # What only the job can do to itself travels to it; the mock does the rest (it
        # kills and stops ranks itself, as a fault from outside would).
        in_job = tuple(
            i.parsed()
            for i in job.injections
            if i.parsed().kind.in_job and i.parsed().kind not in (InjectKind.CRASH, InjectKind.HANG)
        )
        if in_job:
            env[EnvName.INJECT.value] = env_value(in_job)
        if job.restart_count:
            env["SLURM_RESTART_COUNT"] = str(job.restart_count)
        else:
            env.pop("SLURM_RESTART_COUNT", None)
        output = _expand(job.output or "slurm-%j.out", job)
        error = _expand(job.error, job) if job.error else output
        procs.launch_batch(
            self.store.job_dir(job.job_id),
            script,
            env,
            cwd=job.workdir,
            stdout_path=_absolute(output, job.workdir),
            stderr_path=_absolute(error, job.workdir),
            open_mode=job.open_mode if job.restart_count == 0 else "append",
            kill_wait_s=st.config.kill_wait_s,
        )

    # -------------------------------------------------------------- the protocol
    def submit(self, script: str, options: JobOptions) -> str:
        if not script.startswith("#!"):
            raise ConfigError("a batch script must start with a '#!' interpreter line")
        workdir = options.workdir or os.getcwd()
        env = {**os.environ, **options.env}  # sbatch exports the submitter's environment
        opts = dataclasses.replace(options, workdir=workdir, env=env)
        return self._op(lambda st, now: (model.submit(st, script, opts, now), []))

    def query(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        ids = list(dict.fromkeys(str(j) for j in job_ids))
        return self._op(lambda st, now: (model.query(st, ids, now), []), read_only=True)

    def find_jobs(self, comment: str, since: float | None = None) -> list[JobInfo]:
        return self._op(
            lambda st, now: (model.find_jobs(st, comment, since, now), []), read_only=True
        )

    def active_jobs(self) -> list[JobInfo]:
        return self._op(lambda st, now: (model.active_jobs(st, now), []), read_only=True)

    def cancel(self, job_id: str) -> None:
        self._op(lambda st, now: (None, model.cancel(st, str(job_id), now)))

    def requeue(self, job_id: str, *, hold: bool = False) -> None:
        self._op(lambda st, now: (None, model.requeue(st, str(job_id), hold, now)))

    def release(self, job_id: str) -> None:
        self._op(lambda st, now: (model.release(st, str(job_id)), []))

    def update_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        self._op(lambda st, now: (model.update_excluded_nodes(st, str(job_id), list(nodes)), []))

    def start_now(self, job_id: str) -> None:
        self._op(lambda st, now: (model.start_now(st, str(job_id), now), []))

    def signal(self, job_id: str, sig: str, target: SignalTarget = SignalTarget.STEPS) -> None:
        self._op(lambda st, now: (None, model.send_signal(st, str(job_id), sig, target)))

    def nodes(self) -> list[NodeInfo]:
        return self._op(lambda st, now: (model.node_infos(st), []), read_only=True)

    def cluster_facts(self) -> ClusterFacts:
        return self._op(lambda st, now: (model.cluster_facts(st), []), read_only=True)

    # ------------------------------------------------------------ fault controls
    def fail_node(self, node: str) -> None:
        self._check_node(node)
        self._op(lambda st, now: (None, model.fail_node(st, node, now)))

    def preempt(self, job_id: str) -> None:
        """Preempt a running job now (`model.preempt`)."""
        self._op(lambda st, now: (None, model.preempt(st, str(job_id), now)))

    def revive_node(self, node: str) -> None:
        self._check_node(node)
        self._op(lambda st, now: (model.revive_node(st, node), []))

    def _check_node(self, node: str) -> None:
        names = self._op(lambda st, now: (list(st.nodes), []))
        if node not in names:
            raise ConfigError(f"unknown node {node!r}; nodes are {', '.join(names)}")


def _expand(pattern: str, job: MockJob) -> str:
    return pattern.replace("%j", job.job_id).replace("%x", job.name).replace("%%", "%")


def _absolute(path: str, workdir: str) -> str:
    return path if os.path.isabs(path) else os.path.join(workdir, path)

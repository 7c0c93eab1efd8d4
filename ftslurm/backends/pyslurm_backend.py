"""The scheduler protocol over pyslurm (optional).

pyslurm links against libslurm and only builds against the Slurm release it was written
for (pyslurm 25.11.x needs Slurm 25.11.x). ftslurm therefore uses this backend only when a
pyslurm whose major.minor matches the controller's version imports (`pyslurm_status`);
`create_backend("auto")` falls back to the Slurm CLI otherwise.

Said plainly: on the machines ftslurm is tested on (Debian's Slurm 22.05, while PyPI only
offers pyslurm 25.11), no matching pair can be installed, so this backend has **never met
a live controller**. The converters from pyslurm objects to ftslurm's types are unit-tested
with stand-in objects; the live tests skip with the reason `pyslurm_status` gives.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from ftslurm.backends import batch
from ftslurm.backends.slurm_cli.parse import expand_nodes
from ftslurm.backends.slurm_cli.runner import classify
from ftslurm.core.timefmt import parse_time_limit
from ftslurm.core.types import (
    ClusterFacts,
    JobInfo,
    JobOptions,
    JobState,
    NodeInfo,
    NodeState,
    SignalTarget,
)
from ftslurm.errors import (
    BackendUnavailable,
    ConfigError,
    FtslurmError,
    JobStateConflict,
    SchedulerUnavailable,
)

T = TypeVar("T")


def load_pyslurm() -> Any:
    try:
        import pyslurm  # type: ignore[import-not-found]
    except ImportError as exc:
        raise BackendUnavailable(f"pyslurm is not installed ({exc})") from None
    return pyslurm


def pyslurm_status(controller_version: str | None) -> tuple[bool, str]:
    """Whether a pyslurm matching the controller's Slurm version imports, and why not."""
    try:
        pyslurm = load_pyslurm()
    except BackendUnavailable as exc:
        return False, exc.message
    version = str(getattr(pyslurm, "__version__", ""))
    if not controller_version:
        return False, f"pyslurm {version} imports but the controller's version is unknown"
    if version.split(".")[:2] != controller_version.split(".")[:2]:
        return False, f"pyslurm {version} does not match Slurm {controller_version}"
    return True, f"pyslurm {version} matches Slurm {controller_version}"


# ------------------------------------------------------------------ pure converters


def _epoch(value: Any) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def job_info_from_pyslurm(job: Any, observed_at: float) -> JobInfo:
    """A pyslurm.Job (or pyslurm.db.Job) as ftslurm's JobInfo."""
    raw_state = str(getattr(job, "state", "") or "")
    state = JobState.from_slurm(raw_state)
    limit_min = getattr(job, "time_limit", None)
    return JobInfo(
        job_id=str(job.id),
        state=state,
        observed_at=observed_at,
        raw_state=raw_state,
        exit_code=getattr(job, "exit_code", None),
        signal=getattr(job, "exit_code_signal", None) or None,
        nodes=expand_nodes(str(getattr(job, "allocated_nodes", None) or "")),
        submit_time=_epoch(getattr(job, "submit_time", None)),
        start_time=None if state is JobState.PENDING else _epoch(getattr(job, "start_time", None)),
        end_time=_epoch(getattr(job, "end_time", None)) if state.is_terminal else None,
        time_limit_s=int(limit_min) * 60 if isinstance(limit_min, int | float) else None,
        restart_count=int(getattr(job, "requeue_count", 0) or 0),
        reason=(getattr(job, "state_reason", None) or None),
        name=getattr(job, "name", None) or None,
        comment=getattr(job, "comment", None) or None,
    )


def node_info_from_pyslurm(node: Any) -> NodeInfo:
    raw = str(getattr(node, "state", "") or "")
    state = NodeState.from_slurm(raw.split("+")[0])
    reason = getattr(node, "reason", None) or None
    return NodeInfo(name=str(node.name), state=state, raw_state=raw.lower(), reason=reason)


def facts_from_pyslurm(config: Any, version: str) -> ClusterFacts:
    storage = str(getattr(config, "accounting_storage_type", "") or "accounting_storage/none")
    return ClusterFacts(
        min_job_age_s=int(getattr(config, "min_job_age", 300) or 300),
        accounting=storage != "accounting_storage/none",
        kill_wait_s=int(getattr(config, "kill_wait", 30) or 30),
        job_requeue=bool(getattr(config, "job_requeue", True)),
        version=version,
        cluster_name=str(getattr(config, "cluster_name", "") or ""),
        slurmd_timeout_s=int(getattr(config, "slurmd_timeout", 300) or 300),
    )


def submit_description_kwargs(script: str, options: JobOptions) -> dict[str, Any]:
    """Keyword arguments for pyslurm.JobSubmitDescription from generic job options."""
    kwargs: dict[str, Any] = {"script": script}
    mapping = {
        "name": options.name,
        "nodes": options.nodes,
        "ntasks_per_node": options.ntasks_per_node,
        "cpus_per_task": options.cpus_per_task,
        "partition": options.partition,
        "account": options.account,
        "comment": options.comment,
        "standard_output": options.output,
        "standard_error": options.error,
        "working_directory": options.workdir,
        "signal": options.signal,
    }
    kwargs.update({k: v for k, v in mapping.items() if v is not None})
    if options.time_limit is not None:
        seconds = parse_time_limit(options.time_limit)
        kwargs["time_limit"] = "UNLIMITED" if seconds is None else -(-seconds // 60)
    if options.gpus_per_node is not None:
        kwargs["gpus_per_node"] = options.gpus_per_node
    if options.exclude:
        kwargs["excluded_nodes"] = list(options.exclude)
    if options.requeue is not None:
        kwargs["is_requeueable"] = options.requeue
    if options.hold:
        kwargs["priority"] = 0
    if options.env:
        kwargs["environment"] = dict(options.env)
    if options.extra:
        raise ConfigError("the pyslurm backend takes no raw sbatch flags; use the slurm backend")
    return kwargs


def _translate(exc: Exception) -> FtslurmError:
    """pyslurm.RPCError -> ftslurm's typed error (same rules as for the CLI's stderr)."""
    return classify(["pyslurm"], 1, str(exc))


# -------------------------------------------------------------------------- backend


class PyslurmBackend(batch.OneJobPerCommand):  # one job per call: batches are one call per job
    name = "pyslurm"

    def __init__(
        self,
        *,
        query_budget_s: float = 10.0,
        action_budget_s: float = 120.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.pyslurm = load_pyslurm()
        self.query_budget_s = query_budget_s
        self.action_budget_s = action_budget_s
        self.clock = clock
        self._facts: ClusterFacts | None = None

    def _call(self, fn: Callable[[], T], budget_s: float) -> T:
        def once() -> T:
            try:
                return fn()
            except FtslurmError:
                raise
            except Exception as exc:  # pyslurm raises RPCError (and ValueError on bad input)
                raise _translate(exc) from None

        retrying = Retrying(
            retry=retry_if_exception_type(SchedulerUnavailable),
            stop=stop_after_delay(budget_s),
            reraise=True,
            wait=wait_exponential(multiplier=0.5, max=5) + wait_random(0, 0.5),
        )
        return retrying(once)

    def submit(self, script: str, options: JobOptions) -> str:
        if not script.startswith("#!"):
            raise ConfigError("a batch script must start with a '#!' interpreter line")
        kwargs = submit_description_kwargs(script, options)
        desc = self.pyslurm.JobSubmitDescription(**kwargs)
        return str(self._call(desc.submit, self.action_budget_s))

    def query(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        ids = list(dict.fromkeys(str(j) for j in job_ids))
        now = self.clock()
        try:
            jobs = self._call(self.pyslurm.Jobs.load, self.query_budget_s)
        except SchedulerUnavailable as exc:
            return {j: JobInfo.unknown(j, now, exc.message) for j in ids}
        found = {str(job.id): job_info_from_pyslurm(job, now) for job in jobs.values()}
        missing = [j for j in ids if j not in found]
        if missing and self.cluster_facts().accounting:
            db = self.pyslurm.db
            flt = db.JobFilter(ids=[int(j) for j in missing])
            try:
                for job in self._call(lambda: db.Jobs.load(flt), self.query_budget_s).values():
                    found[str(job.id)] = job_info_from_pyslurm(job, now)
            except SchedulerUnavailable:
                pass
        why = "unknown to the controller and accounting"
        return {j: found.get(j) or JobInfo.unknown(j, now, why) for j in ids}

    def find_jobs(self, comment: str, since: float | None = None) -> list[JobInfo]:
        now = self.clock()
        jobs = self._call(self.pyslurm.Jobs.load, self.query_budget_s)
        infos = (job_info_from_pyslurm(job, now) for job in jobs.values())
        live = [info for info in infos if info.comment == comment]
        if live or since is None or not self.cluster_facts().accounting:
            return live
        db = self.pyslurm.db
        flt = db.JobFilter(start_time=int(max(0.0, since - 60)))
        ended = self._call(lambda: db.Jobs.load(flt), self.query_budget_s)
        infos = (job_info_from_pyslurm(job, now) for job in ended.values())
        return [info for info in infos if info.comment == comment]

    def active_jobs(self) -> list[JobInfo]:
        now = self.clock()
        jobs = self._call(self.pyslurm.Jobs.load, self.query_budget_s)
        mine = (job for job in jobs.values() if getattr(job, "user_id", None) == os.getuid())
        infos = (job_info_from_pyslurm(job, now) for job in mine)
        return [info for info in infos if not info.state.is_terminal]

    def _job(self, job_id: str) -> Any:
        return self.pyslurm.Job(int(job_id))

    def cancel(self, job_id: str) -> None:
        try:
            self._call(self._job(job_id).cancel, self.action_budget_s)
        except JobStateConflict:
            pass

    def requeue(self, job_id: str, *, hold: bool = False) -> None:
        self._call(lambda: self._job(job_id).requeue(hold=hold), self.action_budget_s)

    def release(self, job_id: str) -> None:
        self._call(self._job(job_id).release, self.action_budget_s)

    def _modify(self, job_id: str, **changes: Any) -> None:
        desc = self.pyslurm.JobSubmitDescription(**changes)
        self._call(lambda: self._job(job_id).modify(desc), self.action_budget_s)

    def update_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        self._modify(job_id, excluded_nodes=list(nodes))

    def start_now(self, job_id: str) -> None:
        self._modify(job_id, begin_time="now")

    def signal(self, job_id: str, sig: str, target: SignalTarget = SignalTarget.STEPS) -> None:
        steps = {
            SignalTarget.STEPS: "children",
            SignalTarget.BATCH: "batch",
            SignalTarget.ALL: "all",
        }[SignalTarget(target)]
        name = sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()
        job = self._job(job_id)
        self._call(lambda: job.send_signal(name, steps=steps), self.action_budget_s)

    def nodes(self) -> list[NodeInfo]:
        nodes = self._call(self.pyslurm.Nodes.load, self.action_budget_s)
        return [node_info_from_pyslurm(n) for n in nodes.values()]

    def cluster_facts(self) -> ClusterFacts:
        if self._facts is None:
            config = self._call(self.pyslurm.slurmctld.Config.load, self.action_budget_s)
            version = str(getattr(self.pyslurm, "__version__", ""))
            self._facts = facts_from_pyslurm(config, version)
        return self._facts

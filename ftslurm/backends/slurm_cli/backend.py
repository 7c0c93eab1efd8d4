"""The Slurm CLI backend: sbatch, squeue, sacct, scontrol, scancel and sinfo as subprocesses."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ftslurm.backends import batch
from ftslurm.backends.slurm_cli import parse
from ftslurm.backends.slurm_cli.runner import CommandRunner, classify
from ftslurm.core.contract import EnvName
from ftslurm.core.inject import env_value, parse_injections
from ftslurm.core.sbatch import sbatch_args
from ftslurm.core.types import ClusterFacts, JobInfo, JobOptions, NodeInfo, SignalTarget
from ftslurm.errors import (
    ConfigError,
    FtslurmError,
    InvalidJobId,
    JobStateConflict,
    SchedulerUnavailable,
)


class SlurmCliBackend:
    """Talks to Slurm through its command-line clients.

    `query` runs one `squeue` for all ids; only ids squeue no longer knows (finished longer
    than MinJobAge ago) cost a second command, one `sacct` for all of them. The sacct list is
    short (the daemon polls well within MinJobAge), so it is never split.
    """

    name = "slurm"

    def __init__(
        self,
        runner: CommandRunner | None = None,
        *,
        query_budget_s: float = 10.0,
        action_budget_s: float = 120.0,
        max_jobs_arg_chars: int = 100_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.runner = runner or CommandRunner()
        self.query_budget_s = query_budget_s
        self.action_budget_s = action_budget_s
        # Linux caps one argument at 128 KiB: past this, ask for all of the user's jobs
        # (`--me`) and keep the ones asked for. Still one command.
        self.max_jobs_arg_chars = max_jobs_arg_chars
        self.clock = clock
        self._facts: ClusterFacts | None = None

    # ----------------------------------------------------------------- jobs
    def submit(self, script: str, options: JobOptions) -> str:
        if not script.startswith("#!"):
            raise ConfigError("a batch script must start with a '#!' interpreter line")
        env = dict(options.env)
        injections = parse_injections(options.inject)
        cluster_side = [i.kind.value for i in injections if not i.kind.in_job]
        if cluster_side:
            raise ConfigError(
                f"{', '.join(cluster_side)} can only be injected on the mock scheduler",
                hint="on a real cluster: crash, hang and straggler; or use --dry-run",
            )
        if injections:
            env[EnvName.INJECT.value] = env_value(injections)
        out = self.runner.run(
            ["sbatch", "--parsable", *sbatch_args(options)],
            stdin=script,
            extra_env=env,
            budget_s=self.action_budget_s,
            idempotent=False,
        )
        return parse.parse_sbatch_job_id(out)

    def query(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        ids = list(dict.fromkeys(str(j) for j in job_ids))
        if not ids:
            return {}
        now = self.clock()
        joined = ",".join(ids)
        which = f"--jobs={joined}" if len(joined) <= self.max_jobs_arg_chars else "--me"
        try:
            out = self.runner.run(
                ["squeue", "-h", "--states=all", which, "-O", parse.SQUEUE_FORMAT],
                budget_s=self.query_budget_s,
            )
        except InvalidJobId:
            out = ""  # none of the ids is in the controller's memory any more
        except SchedulerUnavailable as exc:
            return {j: JobInfo.unknown(j, now, exc.message) for j in ids}
        found = parse.parse_squeue(out, now)
        result = {j: found[j] for j in ids if j in found}
        missing = [j for j in ids if j not in found]
        if missing:
            result.update(self._query_ended(missing, now))
        return {j: result[j] for j in ids}

    def find_jobs(self, comment: str, since: float | None = None) -> list[JobInfo]:
        out = self.runner.run(
            ["squeue", "-h", "--states=all", "--me", "-O", parse.SQUEUE_FORMAT],
            budget_s=self.query_budget_s,
        )
        found = parse.parse_squeue(out, self.clock())
        live = [job for job in found.values() if job.comment == comment]
        if live or since is None or not self.cluster_facts().accounting:
            return live
        # Ended and purged after MinJobAge: accounting still has it. A failure here raises,
        # so the caller retries rather than submitting a duplicate.
        start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(max(0.0, since - 60)))
        out = self.runner.run(
            [
                "sacct",
                "-X",
                "-D",
                "-P",
                "-n",
                f"--delimiter={parse.SEP}",
                f"--starttime={start}",
                "-o",
                parse.SACCT_FIND_FORMAT,
            ],
            budget_s=self.query_budget_s,
        )
        ended = parse.parse_sacct(out, self.clock(), parse.SACCT_FIND_FIELDS, parse.SEP)
        return [job for job in ended.values() if job.comment == comment]

    def active_jobs(self) -> list[JobInfo]:
        out = self.runner.run(
            ["squeue", "-h", "--me", "-O", parse.SQUEUE_FORMAT], budget_s=self.query_budget_s
        )
        jobs = parse.parse_squeue(out, self.clock()).values()
        return [job for job in jobs if not job.state.is_terminal]

    def _query_ended(self, ids: list[str], now: float) -> dict[str, JobInfo]:
        """Jobs the controller has forgotten: ask accounting, or admit we cannot know."""
        try:
            accounting = self.cluster_facts().accounting
        except SchedulerUnavailable as exc:
            return {j: JobInfo.unknown(j, now, exc.message) for j in ids}
        if not accounting:
            why = "not in the controller's memory and accounting is off"
            return {j: JobInfo.unknown(j, now, why) for j in ids}
        try:
            out = self.runner.run(
                [
                    "sacct",
                    "-X",
                    "-D",
                    "-P",
                    "-n",
                    f"--jobs={','.join(ids)}",
                    "-o",
                    parse.SACCT_FORMAT,
                ],
                budget_s=self.query_budget_s,
            )
        except SchedulerUnavailable as exc:
            return {j: JobInfo.unknown(j, now, exc.message) for j in ids}
        found = parse.parse_sacct(out, now)
        why = "unknown to both the controller and accounting"
        return {j: found.get(j) or JobInfo.unknown(j, now, why) for j in ids}

    def describe(self, job_id: str) -> dict[str, str]:
        """Every field `scontrol show job` knows about a job still in the controller."""
        out = self._act(["scontrol", "show", "job", "-o", str(job_id)])
        line = next((ln for ln in out.splitlines() if ln.startswith("JobId=")), "")
        if not line:
            raise InvalidJobId(f"job {job_id} is not known to the controller")
        return parse.parse_scontrol_record(line)

    def cancel(self, job_id: str) -> None:
        try:
            self._act(["scancel", str(job_id)])
        except JobStateConflict:
            pass  # already completing or completed: the wish is granted

    def requeue(self, job_id: str, *, hold: bool = False) -> None:
        self._act(["scontrol", "requeuehold" if hold else "requeue", str(job_id)])

    def release(self, job_id: str) -> None:
        self._act(["scontrol", "release", str(job_id)])

    def update_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        value = parse.compress_nodes(nodes) if nodes else ""
        self._act(["scontrol", "update", f"jobid={job_id}", f"ExcNodeList={value}"])

    def start_now(self, job_id: str) -> None:
        self._act(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])

    # -------------------------------------------------- batch actions (one command)
    def requeue_many(
        self, job_ids: Sequence[str], *, hold: bool = False
    ) -> dict[str, FtslurmError]:
        verb = "requeuehold" if hold else "requeue"
        return self._act_many(
            lambda ids: ["scontrol", verb, ids], job_ids, lambda job: self.requeue(job, hold=hold)
        )

    def release_many(self, job_ids: Sequence[str]) -> dict[str, FtslurmError]:
        return self._act_many(lambda ids: ["scontrol", "release", ids], job_ids, self.release)

    def start_now_many(self, job_ids: Sequence[str]) -> dict[str, FtslurmError]:
        return self._act_many(
            lambda ids: ["scontrol", "update", f"jobid={ids}", "StartTime=now"],
            job_ids,
            self.start_now,
        )

    def update_excluded_nodes_many(
        self, job_ids: Sequence[str], nodes: Sequence[str]
    ) -> dict[str, FtslurmError]:
        value = parse.compress_nodes(nodes) if nodes else ""
        return self._act_many(
            lambda ids: ["scontrol", "update", f"jobid={ids}", f"ExcNodeList={value}"],
            job_ids,
            lambda job: self.update_excluded_nodes(job, nodes),
        )

    def _act_many(
        self, argv: Callable[[str], list[str]], job_ids: Sequence[str], one: Callable[[str], None]
    ) -> dict[str, FtslurmError]:
        """One scontrol command for the whole list (`argv(ids joined by commas)`); the jobs
        it refused, each with the error its single-job command raises.

        scontrol acts on every job it can and names each job it refused on a line of its
        own (`parse.parse_refusals`). When its output cannot be attributed to jobs (another
        message, a malformed list), the batch falls back to one command per job, each
        failure then its own. A list longer than `max_jobs_arg_chars` is cut in parts, one
        command each."""
        refused: dict[str, FtslurmError] = {}
        for chunk in self._chunks(batch.unique(job_ids)):
            command = argv(",".join(chunk))
            text = self.runner.run_refusals(command, budget_s=self.action_budget_s)
            if not text:
                continue
            named = parse.parse_refusals(text, chunk)
            if named is None:  # cannot tell which jobs it refused: one command per job
                refused.update(batch.each(one, chunk))
                continue
            refused.update({job: classify(command, 1, line) for job, line in named.items()})
        return refused

    def _chunks(self, ids: list[str]) -> list[list[str]]:
        chunks: list[list[str]] = []
        size = 0
        for job in ids:
            if not chunks or size + len(job) + 1 > self.max_jobs_arg_chars:
                chunks.append([])
                size = 0
            chunks[-1].append(job)
            size += len(job) + 1
        return chunks

    def signal(self, job_id: str, sig: str, target: SignalTarget = SignalTarget.STEPS) -> None:
        flag = {
            SignalTarget.STEPS: [],
            SignalTarget.BATCH: ["--batch"],
            SignalTarget.ALL: ["--full"],
        }[SignalTarget(target)]
        self._act(["scancel", f"--signal={sig.removeprefix('SIG')}", *flag, str(job_id)])

    # ---------------------------------------------------------------- cluster
    def nodes(self) -> list[NodeInfo]:
        out = self._act(["sinfo", "-h", "-N", "-o", "%N|%t|%E"])
        return parse.parse_sinfo_nodes(out)

    def cluster_facts(self) -> ClusterFacts:
        if self._facts is None:
            self._facts = parse.parse_config(self._act(["scontrol", "show", "config"]))
        return self._facts

    def _act(self, argv: list[str]) -> str:
        return self.runner.run(argv, budget_s=self.action_budget_s)

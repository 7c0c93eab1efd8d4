"""submitit's executor plugin: `submitit.AutoExecutor(folder, cluster="ftslurm")`.

    import submitit

    executor = submitit.AutoExecutor("logs/%j", cluster="ftslurm")
    executor.update_parameters(timeout_min=60, tasks_per_node=2, ftslurm_retries=3)
    job = executor.submit(Trainer(), steps=1000)  # a submitit Checkpointable, as it is
    print(job.state, job.result())

`ftslurm.SubmititExecutor(folder)` is the same executor without AutoExecutor (parameters
then without the `ftslurm_` prefix). submitit finds the plugin through the entry points
ftslurm declares (group `submitit`: `executor` and `job_environment`, submitit's
docs/plugins.md); `register()` does the same by hand in a process that runs an install
without them. The four parts, each built on submitit's own class:

* `FtslurmExecutor` (submitit's `PicklingExecutor`): pickles the call as submitit does
  (`<folder>/<id>_submitted.pkl`), writes a recipe for it (`<folder>/<id>_submission.py`:
  an `ftslurm.Recipe` made of the executor's parameters) and records it as an ftslurm run
  with `python -m ftslurm submit --json` (with `dry_run`: on the mock scheduler). From
  then on the daemon owns the run: retries within budgets, failed nodes excluded, the
  checkpoint signal before the wall limit, continuations. The job id submitit knows is the
  run id, which stays the same over the run's Slurm jobs (`job.get_info()["JobID"]` is
  the current Slurm job). One run per submitted call: `map_array` and `executor.batch()`
  submit one run each, not a Slurm job array.
* `FtslurmJob`: `result()`, `results()`, `exception()` read submitit's result pickles;
  `done()` is true once a rank stored a success, or the run ended (an error stored by an
  attempt that the daemon then retries is not the end); `state` is the run's (below);
  `cancel()` is `ftslurm cancel`; `stdout()`/`stderr()` the run's job logs (both streams).
* `FtslurmInfoWatcher`: the state of every registered run in one read of ftslurm's state
  database (no scheduler query: the daemon observes the jobs). `state` is PENDING until an
  attempt runs, RUNNING while one does, PENDING between attempts, and the run's end:
  COMPLETED, FAILED or CANCELLED.
* `FtslurmJobEnvironment`: `submitit.JobEnvironment()` inside the job: job id (the run id),
  global and local rank, number of tasks and nodes from the launcher's environment.
  `_requeue` does nothing: the daemon requeues.

Inside the job every rank runs `run_job`: it loads the submitted pickle and calls it through
`ftslurm.agent.submitit_compat.run`, which gives it submitit's checkpoint semantics under
ftslurm (`checkpoint()` on the checkpoint signal on global rank 0, the continuation stored
atomically and resumed by the next attempt, exit 0 "continue me"; read that module), and
stores the outcome as submitit does: `("success", result)` or `("error", traceback)` in
`<folder>/<id>_<rank>_result.pkl`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hostlist
from submitit.core import logger, utils
from submitit.core.core import InfoWatcher, Job, PicklingExecutor, R
from submitit.core.job_environment import JobEnvironment

from ftslurm.core.contract import EnvName, RunDir
from ftslurm.errors import ConfigError
from ftslurm.paths import HOME_ENV, state_dir

# submitit's own environment variables: where the job's files are, which executor ran it
SUBMITIT_FOLDER = "SUBMITIT_FOLDER"
SUBMITIT_EXECUTOR = "SUBMITIT_EXECUTOR"
# How long a job waits for its pickle (the executor moves it in place once `submit` named
# the run), as submitit's own jobs do.
SUBMISSION_WAIT_S = 60.0
# Run states the watcher reports as they are; every other state is an incomplete one.
_ENDED = ("COMPLETED", "FAILED", "CANCELLED")
# submitit's name of a job whose process runs, among the attempt states
_RUNNING = ("RUNNING", "COMPLETING")

RECIPE_TEXT = '''"""An ftslurm recipe written by submitit's ftslurm executor: one submitted call."""

import json

import ftslurm

recipe = ftslurm.Recipe(**json.loads({recipe!r}))

if __name__ == "__main__":
    from ftslurm.integrations.submitit import run_job

    run_job({folder!r})
'''


def submitit_state(run_state: str, attempt_state: str | None) -> str:
    """The state submitit shows (`job.state`) of a run in `run_state` whose latest attempt
    is in `attempt_state` (pure)."""
    if run_state in _ENDED:
        return run_state
    if attempt_state in _RUNNING:
        return str(attempt_state)
    return "PENDING"  # not started yet, or between two attempts


# --------------------------------------------------------------------------- watcher
class FtslurmInfoWatcher(InfoWatcher):
    """The states of submitted runs, from ftslurm's state database (see the module)."""

    def __init__(self, delay_s: int = 5) -> None:
        super().__init__(delay_s)  # a local read, not a scheduler query: can be frequent
        self._homes: dict[str, Path] = {}

    def register_job(self, job_id: str) -> None:
        super().register_job(job_id)
        # the state directory of this process when the job was submitted (or loaded)
        self._homes.setdefault(job_id, state_dir())

    def home(self, job_id: str) -> Path:
        return self._homes.get(job_id) or state_dir()

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        return self.get_info(job_id, mode=mode).get("State") or "UNKNOWN"

    def update(self) -> None:
        todo = sorted(self._registered - self._finished)
        self._num_calls += 1
        by_home: dict[Path, list[str]] = {}
        for job_id in todo:
            by_home.setdefault(self.home(job_id), []).append(job_id)
        for home, run_ids in by_home.items():
            try:
                self._info_dict.update(read_runs(home, run_ids))
            except Exception as exc:  # noqa: BLE001 - as submitit's watcher: warn, go on
                logger.get_logger().warning(
                    f"Call #{self.num_calls} - reading ftslurm's state in {home} failed "
                    f"({type(exc).__name__}: {exc}); status may be inaccurate."
                )
        self._last_status_check = time.time()
        for job_id in todo:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)


def read_runs(home: Path, run_ids: Sequence[str]) -> dict[str, dict[str, str]]:
    """submitit's info of each run that the state directory `home` knows: State (above),
    RunState, JobID (the current Slurm job), Attempt, Reason, RunDir."""
    from ftslurm.daemon.store import DB_NAME, Store  # the login side only

    out: dict[str, dict[str, str]] = {}
    if not (Path(home) / DB_NAME).exists():
        return out  # nothing recorded there (not created by reading)
    with Store(home, check_runs=False) as store:
        latest = store.latest_attempts(run_ids)
        for run_id in run_ids:
            run = store.get_run(run_id)
            if run is None:
                continue
            attempt = latest.get(run_id)
            attempt_state = None if attempt is None else str(attempt.state)
            out[run_id] = {
                "State": submitit_state(run.state.value, attempt_state),
                "RunState": run.state.value,
                "JobID": (attempt.job_id if attempt is not None else None) or "",
                "Attempt": "" if attempt is None else str(attempt.attempt),
                "Reason": run.reason or "",
                "RunDir": str(run.spec.get("run_dir") or ""),
            }
    return out


# --------------------------------------------------------------------------- job
class FtslurmJob(Job[R]):
    """A submitted call: an ftslurm run (see the module)."""

    watcher = FtslurmInfoWatcher()

    def _ftslurm(self, *args: str, check: bool) -> int:
        env = dict(os.environ, **{HOME_ENV: str(self.watcher.home(self.job_id))})
        run = subprocess.check_call if check else subprocess.call
        return run(
            [sys.executable, "-m", "ftslurm", *args],
            env=env,
            stdout=subprocess.DEVNULL,
        )

    def cancel(self, check: bool = True) -> None:
        """Cancel the run (`ftslurm cancel`): its current job is cancelled, nothing is
        retried, and the run ends CANCELLED."""
        self._ftslurm("cancel", self.job_id, check=check)

    def _stored_success(self) -> bool:
        """Whether this task's result pickle holds a success (read again only when the
        file changed: an attempt's error may be replaced by a later attempt's success)."""
        path = self.paths.result_pickle
        try:
            st = path.stat()
        except OSError:
            return False
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        seen = getattr(self, "_outcome_seen", None)
        if seen is None or seen[0] != stamp:
            try:
                outcome = utils.pickle_load(path)[0]
            except Exception:  # noqa: BLE001 - being replaced right now: look again later
                return False
            seen = self._outcome_seen = (stamp, outcome)
        return seen[1] == "success"

    def done(self, force_check: bool = False) -> bool:
        """Whether the call is over: a success stored, or the run ended (an error stored
        by an attempt the daemon retries is not the end)."""
        if self._sub_jobs:
            return all(sub_job.done(force_check) for sub_job in self._sub_jobs)
        if self._stored_success():
            return True
        return self.watcher.is_done(self.job_id, mode="force" if force_check else "standard")

    def _get_logs_string(self, name: str) -> str | None:
        """The run's job logs, every attempt's in order (ftslurm's jobs write stdout and
        stderr to one file: `stdout()` and `stderr()` both return it)."""
        if name not in ("stdout", "stderr"):
            raise ValueError(f"Unknown \"{name}\", available are ['stdout', 'stderr']")
        run_dir = self.watcher.get_info(self.job_id, mode="standard").get("RunDir")
        if not run_dir:
            return None
        pattern = Path(RunDir(Path(run_dir)).job_output)
        logs = sorted(
            pattern.parent.glob(pattern.name.replace("%j", "*")), key=lambda p: p.stat().st_mtime
        )
        if not logs:
            return None
        return "".join(p.read_text(errors="replace") for p in logs)


# --------------------------------------------------------------------------- executor
# submitit's generic parameters (AutoExecutor's) this executor takes besides the recipe's
_GENERIC = {"timeout_min", "mem_gb", "tasks_per_node", "stderr_to_stdout"}
# this executor's own: where the run goes, and the names a submitit user may look for
_OWN = {"dry_run", "inject", "retries", "additional_parameters"}


def _recipe_fields() -> set[str]:
    from ftslurm.recipe import Recipe

    return set(Recipe.model_fields) - {"command"}


def recipe_data(parameters: dict[str, Any]) -> dict[str, Any]:
    """The recipe (`ftslurm.Recipe`, as JSON) of the executor's parameters; ValueError (one
    line) when ftslurm refuses them. submitit's names: `timeout_min` is the time limit in
    minutes, `mem_gb` sbatch's --mem, `tasks_per_node` the ranks per node,
    `additional_parameters` more sbatch flags, `retries` the failure budget; the job name
    is "submitit" unless given, as submitit's."""
    from ftslurm.core.inject import parse_injections
    from ftslurm.recipe import Recipe

    fields = set(Recipe.model_fields)
    data = {k: v for k, v in parameters.items() if k in fields and v is not None}
    if parameters.get("timeout_min") is not None and "time" not in data:
        data["time"] = str(math.ceil(parameters["timeout_min"]))  # Slurm's minutes
    if parameters.get("tasks_per_node") is not None and "ntasks_per_node" not in data:
        data["ntasks_per_node"] = parameters["tasks_per_node"]
    if parameters.get("retries") is not None and "num_job_retries_on_failure" not in data:
        data["num_job_retries_on_failure"] = parameters["retries"]
    extra = dict(data.get("sbatch_extra") or {})
    for key, value in (parameters.get("additional_parameters") or {}).items():
        extra[str(key).replace("_", "-")] = None if value is True else str(value)
    if parameters.get("mem_gb") is not None:
        extra.setdefault("mem", f"{math.ceil(float(parameters['mem_gb']) * 1024)}M")
    if extra:
        data["sbatch_extra"] = extra
    data.setdefault("name", "submitit")
    try:
        parse_injections(_injections(parameters))
        recipe = Recipe(**data)
    except ConfigError as exc:
        raise ValueError(f"ftslurm executor: {exc.user_message()}") from None
    except Exception as exc:  # pydantic's ValidationError: its first complaint
        errors = getattr(exc, "errors", None)
        first = errors()[0] if callable(errors) else {"loc": (), "msg": str(exc)}
        where = ".".join(str(p) for p in first["loc"]) or "parameters"
        raise ValueError(f"ftslurm executor: {where}: {first['msg']}") from None
    return recipe.model_dump(mode="json", exclude_unset=True)


def _injections(parameters: dict[str, Any]) -> tuple[str, ...]:
    inject = parameters.get("inject") or ()
    return (inject,) if isinstance(inject, str) else tuple(inject)


class FtslurmExecutor(PicklingExecutor):
    """submitit's executor for ftslurm (see the module).

    Parameters: those of `ftslurm.Recipe` (nodes, ntasks_per_node, gpus_per_node,
    cpus_per_task, time, partition, account, exclude, checkpoint_dir, setup, env,
    sbatch_extra, and every fault-tolerance setting: num_job_retries_on_failure,
    preempt_time, num_in_job_restarts, spare_nodes, ...), submitit's generic ones
    (timeout_min, mem_gb, tasks_per_node, name, stderr_to_stdout: ftslurm's jobs write both
    streams to one file), `retries` (= num_job_retries_on_failure),
    `additional_parameters` (sbatch flags), `inject` (fault injections, with `dry_run`) and
    `dry_run` (submit to the mock scheduler: `ftslurm submit --dry-run`).
    """

    job_class = FtslurmJob

    def __init__(
        self,
        folder: str | Path,
        max_num_timeout: int = 3,
        max_pickle_size_gb: float = 1.0,
        python: str | None = None,
        **parameters: Any,
    ) -> None:
        super().__init__(folder, max_num_timeout, max_pickle_size_gb)
        self.python = python or sys.executable
        if parameters:
            self.update_parameters(**parameters)

    @classmethod
    def affinity(cls) -> int:
        return 0  # available, used when asked for (cluster="ftslurm"), never guessed

    @classmethod
    def _equivalence_dict(cls) -> Any:
        return {
            "name": "name",
            "timeout_min": "timeout_min",
            "mem_gb": "mem_gb",
            "nodes": "nodes",
            "cpus_per_task": "cpus_per_task",
            "gpus_per_node": "gpus_per_node",
            "tasks_per_node": "ntasks_per_node",
        }

    @classmethod
    def _valid_parameters(cls) -> set[str]:
        return _recipe_fields() | _GENERIC | _OWN

    def _internal_update_parameters(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - self._valid_parameters())
        if unknown:
            raise ValueError(
                f"ftslurm executor: unknown parameter(s) {', '.join(unknown)}; valid: "
                f"{', '.join(sorted(self._valid_parameters()))}"
            )
        recipe_data({**self.parameters, **kwargs})  # refused whole, before anything changes
        self.parameters.update(kwargs)  # the same dict AutoExecutor holds

    def recipe(self) -> dict[str, Any]:
        """The recipe (as JSON) each submitted call runs with."""
        return recipe_data(self.parameters)

    def _num_tasks(self) -> int:
        from ftslurm.recipe import Recipe

        recipe = Recipe(**self.recipe())
        return recipe.nodes * recipe.ranks_per_node()  # the training's (spares aside)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return RECIPE_TEXT.format(recipe=json.dumps(self.recipe()), folder=str(self.folder))

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        command = [self.python, "-m", "ftslurm", "submit", "--json"]
        if self.parameters.get("dry_run"):
            command.append("--dry-run")
        for spec in _injections(self.parameters):
            command += ["--inject", spec]
        return [*command, str(submission_file_path)]

    @staticmethod
    def _get_job_id_from_submission_command(string: bytes | str) -> str:
        text = string.decode() if isinstance(string, bytes) else string
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            return str(json.loads(lines[-1])["run_id"])
        except (IndexError, ValueError, KeyError, TypeError):
            raise utils.FailedSubmissionError(
                f"ftslurm submit printed no run id: {text.strip()!r}"
            ) from None

    def _submit_command(self, command: str) -> FtslurmJob[Any]:
        """Record the run (`ftslurm submit`); its recipe is a Python file, so the name
        ends in .py where submitit's batch file is a .sh."""
        uid = uuid.uuid4().hex
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        recipe_path = folder / f".submission_file_{uid}.py"
        recipe_path.write_text(self._make_submission_file_text(command, uid))
        try:
            output = utils.CommandFunction(
                self._make_submission_command(recipe_path), verbose=False
            )()
        except utils.FailedJobError as exc:
            recipe_path.unlink(missing_ok=True)
            lines = [line for line in str(exc).splitlines() if line.strip()]
            raise utils.FailedSubmissionError(
                lines[-1] if lines else "ftslurm submit failed"
            ) from None
        run_id = self._get_job_id_from_submission_command(output)
        job: FtslurmJob[Any] = self.job_class(
            folder=self.folder, job_id=run_id, tasks=list(range(self._num_tasks()))
        )
        job.paths.folder.mkdir(parents=True, exist_ok=True)
        # the run runs its own copy of the recipe (`submit`'s code snapshot): kept for reading
        recipe_path.rename(job.paths.folder / f"{run_id}_submission.py")
        return job


# --------------------------------------------------------------------------- job side
class FtslurmJobEnvironment(JobEnvironment):
    """`submitit.JobEnvironment()` inside an ftslurm job run by this executor."""

    _env = {
        "job_id": EnvName.RUN_ID.value,
        "num_tasks": "WORLD_SIZE",  # the launcher gives every rank torch's environment
        "num_nodes": "GROUP_WORLD_SIZE",
        "node": "GROUP_RANK",
        "global_rank": "RANK",
        "local_rank": "LOCAL_RANK",
    }

    @property
    def hostnames(self) -> Sequence[str]:
        nodes = os.environ.get("SLURM_JOB_NODELIST", "")
        return hostlist.expand_hostlist(nodes) if nodes else [self.hostname]

    def _handle_signals(self, paths: utils.JobPaths, submission: utils.DelayedSubmission) -> None:
        """Nothing: `run_job` calls the submission through `ftslurm.agent.submitit_compat`,
        whose handlers store the continuation for the daemon."""

    def _requeue(self, countdown: int) -> None:
        """Nothing: the daemon submits the continuation."""


def register() -> None:
    """Make the plugin known to submitit in this process, as its entry points do for an
    installed ftslurm (needed only where they are missing: an install from before the
    plugin, say). Touches submitit's plugin cache."""
    from submitit.core import plugins

    executors, environments = plugins._get_plugins()
    if not any(e is FtslurmExecutor for e in executors):
        executors.append(FtslurmExecutor)
    if not any(isinstance(e, FtslurmJobEnvironment) for e in environments):
        environments.append(FtslurmJobEnvironment())
    plugins.get_executors.cache_clear()
    plugins.get_job_environments.cache_clear()


def _await(path: Path, wait_s: float = SUBMISSION_WAIT_S) -> utils.DelayedSubmission:
    """The submitted pickle, once the executor moved it in place."""
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() >= deadline:
            raise RuntimeError(f"no submitted call in {path} after {wait_s:g}s")
        time.sleep(0.2)
    return utils.DelayedSubmission.load(path)


def _store(path: Path, outcome: tuple[str, Any]) -> None:
    with utils.temporary_save_path(path) as tmp:  # written aside, then renamed
        utils.cloudpickle_dump(outcome, tmp)


def run_job(folder: str) -> Any:
    """A rank of a submitted call (the recipe's main): call it with submitit's checkpoint
    semantics under ftslurm and store its outcome where submitit's Job reads it."""
    os.environ[SUBMITIT_FOLDER] = folder
    os.environ[SUBMITIT_EXECUTOR] = FtslurmExecutor.name()
    try:
        register()  # `submitit.JobEnvironment()` in the callable finds this environment
    except Exception:  # noqa: BLE001 - submitit's internals changed: the entry points remain
        pass
    env = FtslurmJobEnvironment()
    paths = env.paths
    delayed = _await(paths.submitted_pickle)
    from ftslurm.agent import submitit_compat  # the compute side only

    try:
        result = submitit_compat.run(delayed.function, *delayed.args, **delayed.kwargs)
    except Exception:
        _store(paths.result_pickle, ("error", traceback.format_exc()))
        raise
    _store(paths.result_pickle, ("success", result))
    return result

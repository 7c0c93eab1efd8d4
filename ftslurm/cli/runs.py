"""The run commands: submit, status, wait, cancel, logs, nodes, daemon, watch.

All of them read and write the state directory (`FTSLURM_HOME`, default the platform's
user state dir); the daemon owns the runs once submitted.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import hostlist
import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ftslurm.backends import MOCK_HOME_ENV, create_backend, mock_home, state_dir
from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.backends.slurm_cli.parse import compress_nodes
from ftslurm.core.cadence import Cadence
from ftslurm.core.contract import ROUND_RECORDS, SCRATCH_ENVS, EnvName, RunDir
from ftslurm.core.inject import Injection, InjectKind, parse_duration, parse_injections
from ftslurm.core.leases import DAEMON_LEASE_TIMEOUT_S
from ftslurm.core.settings import FtSettings
from ftslurm.core.timefmt import parse_time_limit
from ftslurm.core.types import JobInfo, JobState, NodeInfo, NodeState
from ftslurm.core.validate import OWNED_SBATCH_FLAGS, bad_char, check_line
from ftslurm.daemon import as_job, service, user_requests
from ftslurm.daemon.reconcile import new_run_record
from ftslurm.daemon.records import NEVER_SUBMITTED, Attempt, Run, RunState, parse_tag
from ftslurm.daemon.store import (
    RUNS_DIR,
    Request,
    Store,
    mark_backend,
    marked_backends,
    mirror_run,
)
from ftslurm.daemon.submission import backend_key, build_attempt, make_spec
from ftslurm.errors import (
    ConfigError,
    FtslurmError,
    InvalidJobId,
    JobStateConflict,
    SchedulerRejected,
    SchedulerUnavailable,
)
from ftslurm.fsutil import private_dir, read_json
from ftslurm.recipe import load_recipe, no_limit_warning, sbatch_flags

console = Console()
err = Console(stderr=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _store() -> Store:
    return Store(state_dir())


def _run_or_fail(store: Store, ref: str) -> Run:
    """The run that `ref` names: its id, a unique prefix of its id (as `git` takes a commit),
    or its `--name` when no other run has it, or when exactly one of the runs that have it
    is active (`submit` refuses a `--name` an active run has). An exact id always wins."""
    if not ref:
        raise ConfigError("no run given: name it by its id, a prefix of its id, or its name")
    runs = store.find_runs(ref)
    if len(runs) == 1 and runs[0].run_id == ref:
        return runs[0]
    ids = {r.run_id for r in runs}
    named = [r for r in store.list_runs() if r.name == ref and r.run_id not in ids]
    active = [r for r in named if not r.state.is_terminal]
    if not runs and len(named) > 1 and len(active) == 1:
        return active[0]  # a name reused after its run ended names the active run
    runs += named
    if not runs:
        raise ConfigError(f"no run {ref!r} in {store.path.parent} (give a run id, a prefix "
                          "of one, or a run's name; `ftslurm status` lists them)")  # fmt: skip
    if len(runs) > 1:
        shown = ", ".join(f"{r.run_id} ({r.name})" for r in runs[:5])
        more = f" and {len(runs) - 5} more" if len(runs) > 5 else ""
        raise ConfigError(f"{ref!r} is ambiguous: it names {shown}{more}")
    return runs[0]


def _resolve_run_arg(value: str | None) -> str | None:
    """The one place a RUN argument is resolved: every command gets the full run id."""
    if value is None:
        return None
    with _store() as store:
        return _run_or_fail(store, value).run_id


_RUN_HELP = "A run id, a unique prefix of one, or a run's name (when no other run has it)."
RunArg = Annotated[str, typer.Argument(metavar="RUN", help=_RUN_HELP, show_default=False,
                                       callback=_resolve_run_arg)]  # fmt: skip


# ---------------------------------------------------------------------------- submit
def _default(setting: str, unit: str = "") -> str:
    """The default of a fault-tolerance setting, for a help text (FtSettings holds it)."""
    value = FtSettings.model_fields[setting].default
    return f"(default: the recipe's {setting}, else {value}{unit})"


_SBATCH = "Passed to sbatch as is"
_RECIPE = "(default: the recipe's, else Slurm's)"
_Text = str | None


def _opt(*names: str, help: str, hidden: bool = False) -> Any:
    return typer.Option(*names, help=help, hidden=hidden, show_default=False)


# The panels of `submit --help`, by option (the rest, --json and --help: Options).
SUBMIT_PANELS = {
    "Retries and recovery": ("--retries", "--in-job-restarts", "--spare-nodes"),
    "Checkpoints": ("--preempt-time", "--checkpoint-dir"),
    "The job (sbatch's flags)": (
        "--nodes", "--ntasks-per-node", "--ntasks", "--gpus-per-node", "--cpus-per-task",
        "--time", "--partition", "--account", "--exclude", "--job-name", "--mem",
        "--mem-per-cpu", "--gres", "--gpus", "--constraint", "--qos", "--dependency",
        "--mail-type", "--mail-user", "--nodelist", "--exclusive", "--reservation", "--wckey",
        "--sbatch-arg"),
    "Rehearsal and dry run": ("--dry-run", "--inject", "--print-script"),
}  # fmt: skip


def put_in_panels(command: Any, panels: dict[str, tuple[str, ...]]) -> None:
    """Set the `--help` panel of each option of the click `command` named in `panels`."""
    panel_of = {name: panel for panel, names in panels.items() for name in names}
    for param in command.params:
        panel = next((panel_of[n] for n in getattr(param, "opts", ()) if n in panel_of), None)
        if panel is not None:
            param.rich_help_panel = panel


def submit(
    recipe: Annotated[Path, typer.Argument(help="A training script or a recipe file.")],
    args: Annotated[list[str] | None, typer.Argument(help="Arguments after `--`.")] = None,
    retries: Annotated[int | None, _opt("--retries", help="Job resubmissions after a failure "
                       f"(num_job_retries_on_failure). {_default('num_job_retries_on_failure')}"
                       )] = None,
    in_job_restarts: Annotated[int | None, _opt("--in-job-restarts",
                               help="Rank restarts inside one job, per attempt. "
                               f"{_default('num_in_job_restarts')}")] = None,
    spare_nodes: Annotated[int | None, _opt("--spare-nodes", help="Idle nodes to ask for "
                           "beside --nodes (N+K nodes, --no-kill): a lost node is replaced by "
                           "one inside the same job, from the last checkpoint. "
                           f"{_default('spare_nodes')}")] = None,
    preempt_time: Annotated[_Text, _opt("--preempt-time", help="How long before the time "
                            "limit to ask for a checkpoint: 90, 90s, 5m, 1h (plain numbers are "
                            f"seconds; 0: never). {_default('preempt_time', ' s')}")] = None,
    nodes: Annotated[int | None, _opt("-N", "--nodes", help="Nodes. (default: the recipe's, "
                     "else 1)")] = None,
    ntasks_per_node: Annotated[int | None, _opt("--ntasks-per-node", help="Ranks per node. "
                               "(default: the recipe's, else --gpus-per-node, else --ntasks / "
                               "--nodes, else 1)")] = None,
    ntasks: Annotated[int | None, _opt("-n", "--ntasks", help="Ranks in all: a multiple of "
                      f"--nodes (ftslurm starts as many on each node). {_RECIPE}")] = None,
    gpus_per_node: Annotated[int | None, _opt("--gpus-per-node", help="GPUs per node; also "
                             f"the ranks per node unless --ntasks-per-node is given. {_RECIPE}"
                             )] = None,
    cpus_per_task: Annotated[int | None, _opt("-c", "--cpus-per-task",
                             help=f"CPUs per rank. {_RECIPE}")] = None,
    time_limit: Annotated[_Text, _opt("-t", "--time", help="Wall time limit of each attempt, "
                          "in sbatch's forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
                          "D-HH:MM:SS; UNLIMITED, infinite or 0 for no limit. "
                          "(default: the recipe's, else the partition's)")] = None,
    partition: Annotated[_Text, _opt("-p", "--partition", help=f"Partition. {_RECIPE}")] = None,
    account: Annotated[_Text, _opt("-A", "--account", help=f"Account. {_RECIPE}")] = None,
    exclude: Annotated[_Text, _opt("-x", "--exclude", help="Nodes never to use, "
                       "comma-separated (ftslurm adds the nodes it flags). (default: none)")
                       ] = None,
    name: Annotated[_Text, _opt("-J", "--job-name", "--name", help="The run's name (and its "
                    "jobs'): commands take it for the run id; refused while an active run "
                    "has it. (default: the recipe's, else the recipe file's name)")] = None,
    mem: Annotated[_Text, _opt("--mem", help=f"Memory per node, e.g. 64G (unit: M if none). "
                   f"{_SBATCH}. {_RECIPE}")] = None,
    mem_per_cpu: Annotated[_Text, _opt("--mem-per-cpu", help="Memory per CPU, e.g. 4G (unit: "
                           f"M if none). {_SBATCH}. {_RECIPE}")] = None,
    gres: Annotated[_Text, _opt("--gres", help=f"Generic resources per node, e.g. gpu:8. "
                    f"{_SBATCH}. {_RECIPE}")] = None,
    gpus: Annotated[_Text, _opt("-G", "--gpus", help=f"GPUs in all, e.g. 16 or a100:16. "
                    f"{_SBATCH}. {_RECIPE}")] = None,
    constraint: Annotated[_Text, _opt("-C", "--constraint", help="Node features, e.g. "
                          f"'a100&ib'. {_SBATCH}. {_RECIPE}")] = None,
    qos: Annotated[_Text, _opt("-q", "--qos", help=f"Quality of service. {_SBATCH}. {_RECIPE}")
                   ] = None,
    dependency: Annotated[_Text, _opt("-d", "--dependency", help="Start after other jobs, e.g. "
                          f"afterok:123 (first attempt and retries alike). {_SBATCH}. "
                          f"{_RECIPE}")] = None,
    mail_type: Annotated[_Text, _opt("--mail-type", help=f"e.g. END,FAIL. {_SBATCH}. "
                         f"{_RECIPE}")] = None,
    mail_user: Annotated[_Text, _opt("--mail-user", help=f"Mail address. {_SBATCH}. {_RECIPE}")
                         ] = None,
    nodelist: Annotated[_Text, _opt("-w", "--nodelist", help="Nodes to run on, "
                        f"comma-separated. {_SBATCH}. {_RECIPE}")] = None,
    exclusive: Annotated[bool, _opt("--exclusive", help="Whole nodes, shared with no other "
                         "job. (default: off, or the recipe's)")] = False,
    reservation: Annotated[_Text, _opt("--reservation", help=f"Reservation. {_SBATCH}. "
                           f"{_RECIPE}")] = None,
    wckey: Annotated[_Text, _opt("--wckey", help=f"Workload characterization key. {_SBATCH}. "
                     f"{_RECIPE}")] = None,
    sbatch_arg: Annotated[list[str] | None, _opt("--sbatch-arg", help="Any other sbatch flag, "
                          "e.g. --sbatch-arg=--begin=now+1hour; repeatable. Flags ftslurm sets "
                          "itself are refused. (default: none)")] = None,
    output: Annotated[_Text, _opt("-o", "--output", "-e", "--error", hidden=True,
                      help="Refused: ftslurm owns the job's output file.")] = None,
    array: Annotated[_Text, _opt("-a", "--array", hidden=True,
                     help="Refused: one run is one job per attempt.")] = None,
    checkpoint_dir: Annotated[_Text, _opt("--checkpoint-dir", help="Where the run keeps its "
                              f"checkpoints ({EnvName.CHECKPOINT_DIR.value}), relative to the "
                              "current folder. (default: the recipe's, else "
                              f"${SCRATCH_ENVS[0]} or ${SCRATCH_ENVS[1]}/ftslurm/RUN/checkpoints, "
                              "else RUN_DIR/checkpoints)")
                              ] = None,
    dry_run: Annotated[bool, _opt("--dry-run", help="Run against the mock scheduler (laptop "
                       "rehearsal). (default: off)")] = False,
    inject: Annotated[list[str] | None, _opt("--inject", help="KIND@TIME[:TARGET], TIME in "
                      "seconds or 90s, 5m, 2h; repeatable (docs/fault-injection.md). "
                      "(default: none)")] = None,
    print_script: Annotated[bool, _opt("--print-script", help="Print the sbatch script of the "
                            "first attempt; submit nothing. (default: off)")] = False,
    snapshot_code: Annotated[bool, _opt("--snapshot-code/--no-snapshot-code", help="Copy the "
                             "recipe file into the run folder at submit, so every attempt "
                             "runs what was submitted; --no-snapshot-code runs the file as it "
                             "is at each attempt (to pick up fixes on purpose). Only the recipe "
                             "file is copied, not its folder. (default: on)")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Submit a training run; the daemon then owns it until it ends."""
    if output is not None:
        raise ConfigError(f"-o/-e: {OWNED_SBATCH_FLAGS['output']}")
    if array is not None:
        raise ConfigError(f"--array: {OWNED_SBATCH_FLAGS['array']}")
    preempt_s = None
    if preempt_time is not None:
        try:
            preempt_s = math.ceil(parse_duration(preempt_time))
        except ConfigError as exc:
            raise ConfigError(f"--preempt-time: {exc.user_message()}") from None
    loaded = load_recipe(recipe, list(args or ()))
    if not snapshot_code and recipe.suffix != ".py" and not os.access(recipe, os.X_OK):
        raise ConfigError(f"recipe {recipe} is not executable and not a Python file (.py): "
                          f"`chmod +x {recipe}`, or keep --snapshot-code (the copy is made "
                          "executable)")  # fmt: skip
    # Each --sbatch-arg is one word of sbatch's command line: `--k=v`, `--k`, `-kv`, or
    # a flag and its value in two (`--sbatch-arg=-q --sbatch-arg=high`).
    from_args = sbatch_flags(list(sbatch_arg or ()), "--sbatch-arg")
    flags = {"mem": mem, "mem-per-cpu": mem_per_cpu, "gres": gres, "gpus": gpus,
             "constraint": constraint, "qos": qos, "dependency": dependency,
             "mail-type": mail_type, "mail-user": mail_user, "nodelist": nodelist,
             "ntasks": None if ntasks is None else str(ntasks), "reservation": reservation,
             "wckey": wckey}  # fmt: skip
    sbatch_extra = {**loaded.sbatch_extra, **from_args.pop("sbatch_extra", {}),
                    **{k: v for k, v in flags.items() if v is not None},
                    **({"exclusive": None} if exclusive else {})}  # fmt: skip
    loaded = loaded.with_overrides(**{**from_args, **{k: v for k, v in dict(
        num_job_retries_on_failure=retries, num_in_job_restarts=in_job_restarts,
        spare_nodes=spare_nodes, preempt_time=preempt_s, nodes=nodes,
        ntasks_per_node=ntasks_per_node,
        gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task, time=time_limit,
        partition=partition, account=account,
        exclude=tuple(n for n in exclude.split(",") if n) if exclude is not None else None,
        name=name, checkpoint_dir=checkpoint_dir, sbatch_extra=sbatch_extra,
    ).items() if v is not None}})  # fmt: skip
    # Printed once everything is validated (an error then stays the only line).
    warning = no_limit_warning(loaded.time) if loaded.time_limit_s() is None else None
    injections = parse_injections(tuple(inject or ()))
    backend_kind = "mock" if dry_run else "slurm"
    cluster_side = [i.kind.value for i in injections if not i.kind.in_job]
    if cluster_side and not dry_run:
        raise ConfigError(f"{', '.join(cluster_side)} can only be injected with --dry-run "
                          "(the mock scheduler)")  # fmt: skip
    home = state_dir()
    run_id = uuid.uuid4().hex[:10]
    run_dir = home / RUNS_DIR / run_id
    settings = loaded.settings()
    spec = make_spec(loaded, run_dir=run_dir, backend=backend_kind, workdir=str(Path.cwd()),
                     inject=tuple(i.spec() for i in injections),
                     mock_home=mock_home() if dry_run else None, environ=os.environ)  # fmt: skip
    snapshot = RunDir(run_dir).root / CODE_DIR / recipe.name if snapshot_code else None
    if snapshot is not None:
        spec = snapshot_spec(spec, recipe.resolve(), snapshot)
    home_warning = _checkpoints_at_home(spec)
    script, _ = build_attempt(run_id, spec, settings.model_dump(mode="json"), 0, ())
    warn = warning and settings.preempt_time
    if print_script:
        if warn:
            typer.echo(f"Warning: {warning}", err=True)
        if home_warning:
            typer.echo(f"Warning: {home_warning}", err=True)
        typer.echo(script, nl=False)
        return
    store = Store(home)
    store.check_integrity()  # a damaged database is refused before anything is submitted
    run_name = loaded.name or recipe.name
    name_warning = _name_in_use(store, run_name, chosen=name is not None)
    if warn:  # after every check, so that an error stays the only line
        typer.echo(f"Warning: {warning}", err=True)
    if home_warning:
        typer.echo(f"Warning: {home_warning}", err=True)
    if name_warning:
        typer.echo(f"Warning: {name_warning}", err=True)
    _SUBMITTING.update(home=home, run_id=run_id)  # an interrupt from here on says more
    private_dir(run_dir)
    RunDir(run_dir).logs.mkdir(exist_ok=True)
    if spec.get("code_snapshot"):
        take_snapshot(recipe, snapshot)  # type: ignore[arg-type]
    run, attempt = new_run_record(run_id, run_name, spec, settings, time.time())
    with store.transaction():  # the run and its submission intent: the daemon submits it
        _name_in_use(store, run_name, chosen=name is not None)  # again, with the write lock
        store.add_run(run)
        store.add_attempt(attempt)
        store.append_event(run_id, "created", {"recipe": str(recipe)}, time.time())
    # Beside the database: the run (rebuilt from it if the database loses it) and where its
    # jobs live (looked at for jobs without a run).
    mirror_run(run)
    mark_backend(home, backend_key(spec))
    if dry_run:
        _warn_injections(injections, create_backend(backend_kind, spec["mock_home"]))
    _pause_for_tests()
    job_id, note = _await_submission(store, home, run_id)
    where, facts = "", {}
    if dry_run:  # which mock, and how long a failed node goes unnoticed there
        where, facts = _mock_words(create_backend(backend_kind, spec["mock_home"]),
                                   spec["mock_home"])  # fmt: skip
    if as_json:
        typer.echo(json.dumps({"run_id": run_id, "job_id": job_id, **facts}))
    elif job_id:
        typer.echo(f"run {run_id} submitted as job {job_id}{where}; "
                   f"see `ftslurm status {run_id}`")  # fmt: skip
    else:
        typer.echo(f"run {run_id} recorded{where}; {note}; see `ftslurm status {run_id}`")


# The folder of a run's snapshot of its recipe file (`submit --snapshot-code`).
CODE_DIR = "code"


def snapshot_spec(spec: dict[str, Any], original: Path, snapshot: Path) -> dict[str, Any]:
    """The spec whose attempts run `snapshot` in place of the recipe file `original`: every
    first word of the command that is the file becomes the copy (later ones are the
    script's own arguments, left as given) (pure). For a Python file, the
    original's folder goes on PYTHONPATH (after the copy's own folder, which `python FILE`
    puts first), so that modules beside the recipe import as they did; the working
    directory stays the submit directory."""
    command = list(spec["command"])
    if str(original) not in command:
        return {**spec, "code_snapshot": None}  # the command does not run the recipe file
    command[command.index(str(original))] = str(snapshot)
    setup = list(spec["setup"])
    if original.suffix == ".py":
        folder = shlex.quote(str(original.parent))
        setup.insert(0, f'export PYTHONPATH={folder}"${{PYTHONPATH:+:$PYTHONPATH}}"')
    return {**spec, "command": command, "setup": setup,
            "code_snapshot": {"path": str(snapshot), "from": str(original)}}  # fmt: skip


def take_snapshot(recipe: Path, snapshot: Path) -> None:
    """Copy the recipe file to `snapshot` (owner only, executable: a script runs without
    its own execute bit, as sbatch runs its copy); a one-line error when it cannot."""
    try:
        private_dir(snapshot.parent)
        tmp = snapshot.with_name(f".{snapshot.name}.tmp")
        shutil.copyfile(recipe, tmp)
        os.chmod(tmp, 0o700)
        os.replace(tmp, snapshot)
    except OSError as exc:
        raise ConfigError(f"cannot copy recipe {recipe} into the run folder: "
                          f"{exc.strerror or exc}") from None  # fmt: skip


# The run `submit` is recording (its state folder and id), for `interrupted_submit`.
_SUBMITTING: dict[str, Any] = {}


def forget_submit() -> None:
    _SUBMITTING.clear()


def interrupted_submit() -> str | None:
    """What a Ctrl-C during `submit` left, in one line, once `submit` began recording a
    run: recorded (the daemon submits it: the interrupt stopped only the wait), or not
    recorded (nothing was submitted); None when no run was being recorded."""
    home, run_id = _SUBMITTING.get("home"), _SUBMITTING.get("run_id")
    _SUBMITTING.clear()
    if home is None or run_id is None:
        return None
    try:
        with Store(home) as store:
            recorded = store.get_run(run_id) is not None
        serving = service.serving(home) is not None
    except Exception:  # noqa: BLE001 - an interrupt is no time for a second error
        return None
    if not recorded:
        return "interrupted before the run was recorded: nothing was recorded or submitted"
    later = ("the daemon will submit it" if serving
             else "a daemon will submit it once one runs (`ftslurm daemon start`)")
    return (f"interrupted: run {run_id} is recorded and {later}; the interrupt stopped only "
            f"the wait (`ftslurm status {run_id}`, `ftslurm cancel {run_id}`)")


def _name_in_use(store: Store, name: str, chosen: bool) -> str | None:
    """A name an active run has: refused when the user chose it (`--name`: a second run
    under it could not be named by it), else (the recipe's name or its file's) one line to
    warn with; None when no active run has it."""
    holders = [r for r in store.list_runs(active_only=True) if r.name == name]
    if not holders:
        return None
    held = ", ".join(f"{r.run_id} ({r.state.value})" for r in holders)
    if chosen:
        raise ConfigError(f"--name {name!r}: active run {held} has that name; give another "
                          "--name, or cancel that run first")  # fmt: skip
    return (f"active run {held} is also named {name!r}; name this one with --name to refer "
            "to it by name, or use its run id")  # fmt: skip


def _checkpoints_at_home(spec: dict[str, Any]) -> str | None:
    """One line when the checkpoints would go, by default, under the user's home directory
    (usually quota'd and small: never silently for large state)."""
    if spec.get("checkpoint_dir_from") != "the state directory":
        return None
    where = Path(spec["checkpoint_dir"])
    try:
        where.relative_to(Path.home())
    except ValueError:
        return None
    return (f"checkpoints go to {where}, under your home directory; give --checkpoint-dir "
            f"or set {' or '.join(f'${n}' for n in SCRATCH_ENVS)} to a scratch space")


# How long `submit` waits for the daemon to submit the run, and `cancel` for a submission
# under way to be recorded (seconds).
SUBMIT_WAIT_S = 60.0
# Test hook: `submit` stops itself (SIGSTOP) right after recording the run when this is set,
# so a test can hold it at the worst moment.
PAUSE_ENV = "FTSLURM_TEST_PAUSE_AFTER_RECORD"


def _pause_for_tests() -> None:
    if os.environ.get(PAUSE_ENV):
        os.kill(os.getpid(), signal.SIGSTOP)


def _await_daemon(home: Path, later: str, wait_s: float,
                  check: Callable[[], tuple[bool, Any, str]]) -> tuple[Any, str]:
    """Start or wake the daemon, then poll `check` (done?, value, note) until it is done,
    `wait_s` has passed or the daemon is gone. Returns the value and the note, or None and
    `later` with what holds it up."""
    try:
        service.start(home)
        service.wake(home)
    except FtslurmError as exc:
        return None, f"{later}, once it runs ({exc.user_message()})"
    deadline = time.monotonic() + wait_s
    while True:
        done, value, note = check()
        if done:
            return value, note
        if time.monotonic() >= deadline:
            return None, f"{later} (it did not within {wait_s:g}s)"
        if service.serving(home) is None:
            return None, f"{later}, once it runs (`ftslurm daemon start`)"
        time.sleep(0.05)


def _await_submission(store: Store, home: Path, run_id: str) -> tuple[str | None, str]:
    """Start or wake the daemon (the only party that submits) and wait, bounded, until it
    recorded the job id or ended the run. Returns the job id, or None and what happens
    next; `SchedulerRejected` when the scheduler refused the job."""
    later = "the daemon will submit it"

    def submitted() -> tuple[bool, str | None, str]:
        run = store.get_run(run_id)
        latest = store.latest_attempt(run_id)
        if latest is not None and latest.job_id:
            return True, latest.job_id, ""
        if run is not None and run.state.is_terminal:
            if latest is not None and latest.state == NEVER_SUBMITTED:
                raise SchedulerRejected(f"the scheduler refused the job: {latest.reason}")
            return True, None, f"it ended {run.state.value}: {run.reason}"
        deferred = [e for e in store.events(run_id) if e.kind == "submit_deferred"]
        if deferred:
            return True, None, (f"{later} when the scheduler answers "
                                f"({deferred[-1].data.get('message')})")  # fmt: skip
        return False, None, ""

    return _await_daemon(home, later, SUBMIT_WAIT_S, submitted)


# ---------------------------------------------------------------------------- status
# How an attempt that left a checkpoint to be continued from reads in `status`: its job
# exited 75 ("continue me"), which Slurm counts as FAILED, or 0 (a submitit-style exit).
CONTINUED = "CONTINUED"


def continued(attempt: Attempt, verdicts: dict[int, str]) -> bool:
    """Whether the attempt ended as a continuation: it checkpointed and the daemon went on
    from it (not a continuation failed for making no checkpoint progress)."""
    return attempt.cause == "checkpointed" and verdicts.get(attempt.attempt) != "fail"


def run_summary(store: Store, run: Run) -> dict[str, Any]:
    attempts = store.attempts(run.run_id)
    verdicts = {e.data["attempt"]: str(e.data.get("verdict")) for e in store.events(run.run_id)
                if e.kind == "ended" and isinstance(e.data.get("attempt"), int)}  # fmt: skip
    return {
        "run_id": run.run_id, "name": run.name, "state": run.state.value,
        "created_at": run.created_at,
        "attempts": [{
            "attempt": a.attempt, "job_id": a.job_id, "state": a.state,
            "exit_code": a.exit_code, "nodes": a.nodes, "start": a.start, "end": a.end,
            "reason": a.reason, "cause": a.cause, "in_job_restarts": a.in_job_restarts,
            "continuation": continued(a, verdicts),
        } for a in attempts],
        "job_retries_used": run.job_retries_used,
        "job_retries_max": run.settings.get("num_job_retries_on_failure"),
        "in_job_restarts_total": sum(a.in_job_restarts for a in attempts),
        "continuations": run.continuations,
        "excluded_nodes": sorted(f.node for f in store.node_flags(time.time())),
        "last_checkpoint_step": checkpoint_step(run),
        "reason": run.reason, "backend": run.spec.get("backend"),
        "run_dir": run.spec.get("run_dir"),
        "checkpoint_dir": run.spec.get("checkpoint_dir"),
        "checkpoint_dir_from": run.spec.get("checkpoint_dir_from"),
        "checkpoint_cadence": cadence.data if (cadence := store.latest_event(
            run.run_id, "cadence")) else None,  # the interval last written (core.cadence)
    }  # fmt: skip


def _progress(run: Run) -> dict[str, Any]:
    """The run's progress.json (what its script told: steps, checkpoints), or {}."""
    run_dir = run.spec.get("run_dir")
    found = read_json(RunDir(run_dir).progress) if run_dir else None
    return found if isinstance(found, dict) else {}


def checkpoint_step(run: Run, progress: dict[str, Any] | None = None) -> int | None:
    """The step of the run's newest checkpoint: what its script told in progress.json (at
    every save, so also while an attempt runs), else what the daemon recorded (at an
    attempt's end)."""
    told = (_progress(run) if progress is None else progress).get("checkpoint_step")
    if isinstance(told, int) and not isinstance(told, bool):
        return told
    return run.last_checkpoint_step


def _fmt_time(t: float | None, now: float | None = None) -> str:
    """HH:MM:SS today; with the date on any other day (an expiry tomorrow must say so)."""
    if not t:
        return "-"
    when = datetime.fromtimestamp(t)
    today = datetime.fromtimestamp(time.time() if now is None else now).date()
    return when.strftime("%H:%M:%S" if when.date() == today else "%Y-%m-%d %H:%M:%S")


def _fmt_nodes(nodes: Sequence[str]) -> str:
    """A node list as Slurm writes it (`n[1-2],m7`), or "-"."""
    return compress_nodes(nodes) if nodes else "-"


_STYLE = {"COMPLETED": "green", "FAILED": "red", "CANCELLED": "yellow", "RUNNING": "cyan"}


@dataclass(frozen=True)
class Col:
    """A table column. `keep` ranks what stays when the terminal is narrow (higher stays
    longer; None: never dropped, never cut: run ids, node names). `wraps`: free text that
    may fold over several lines, so it does not need its full width."""

    header: str
    keep: int | None
    wraps: bool = False


_WRAPPED_MIN = 16  # the width a wrapping column is granted when deciding what fits
_CELL_EXTRA = 3  # a cell's padding and border


def fit_columns(cols: Sequence[Col], rows: Sequence[Sequence[str]], width: int) -> list[int]:
    """Which columns (indices, in order) fit `width`: drop the lowest `keep` first.

    Pure: widths are measured on the cells' text (rich markup ignored)."""
    natural = []
    for i, col in enumerate(cols):
        cells = [Text.from_markup(row[i]).cell_len for row in rows]
        need = max([len(col.header), *cells])
        natural.append(min(need, _WRAPPED_MIN) if col.wraps else need)
    shown = list(range(len(cols)))
    droppable = sorted((i for i, c in enumerate(cols) if c.keep is not None),
                       key=lambda i: cols[i].keep)  # fmt: skip
    while sum(natural[i] + _CELL_EXTRA for i in shown) + 1 > width and droppable:
        shown.remove(droppable.pop(0))
    return shown


def fitted_table(cols: Sequence[Col], rows: Sequence[Sequence[str]], width: int,
                 title: str | None = None) -> Table:  # fmt: skip
    """A table for a terminal `width` columns wide: the columns that fit (`fit_columns`);
    ids never cut, never wrapped; other cells fold (wrap) rather than end in an ellipsis."""
    shown = fit_columns(cols, rows, width)
    table = Table(title=title)
    for i in shown:
        col = cols[i]
        if col.keep is None:
            longest = max([len(col.header), *(Text.from_markup(r[i]).cell_len for r in rows)])
            table.add_column(col.header, no_wrap=True, min_width=longest)
        else:
            table.add_column(col.header, overflow="fold")
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    return table


_RUN_COLS = (
    Col("run", None), Col("name", 60, wraps=True), Col("state", 90), Col("submitted", 35),
    Col("attempt", 40), Col("job", 70), Col("job state", 20), Col("nodes", 50, wraps=True),
    Col("retries", 30), Col("cont.", 10), Col("ckpt step", 15), Col("reason", 45, wraps=True),
)  # fmt: skip

# A note `policy.decide` adds to the reason of every ending of a run whose ranks wrote no
# heartbeats: said once under a table, not on every row.
_SAID_ONCE = ("the ranks wrote no heartbeats",)


def split_reason(reason: str | None) -> tuple[str, list[str]]:
    """A reason without the notes said once under a table, and those notes (pure)."""
    parts = (reason or "").split("; ")
    once = [p for p in parts if p.startswith(_SAID_ONCE)]
    return "; ".join(p for p in parts if p not in once), once


def _job_state(attempt: dict[str, Any]) -> str:
    """An attempt's state as `status` shows it: a continuation reads as one, not FAILED."""
    return CONTINUED if attempt.get("continuation") else str(attempt.get("state", "-"))


def _run_rows(summaries: list[dict[str, Any]], notes: dict[str, None],
              now: float) -> list[list[str]]:  # fmt: skip
    rows = []
    for s in summaries:
        last = s["attempts"][-1] if s["attempts"] else {}
        style = _STYLE.get(s["state"], "")
        reason, once = split_reason(s["reason"])
        notes.update(dict.fromkeys(once))
        rows.append([
            s["run_id"], escape(s["name"]),
            f"[{style}]{s['state']}[/]" if style else s["state"],
            _fmt_time(s.get("created_at"), now),
            str(last.get("attempt", "-")), str(last.get("job_id") or "-"),
            _job_state(last) if last else "-", _fmt_nodes(last.get("nodes") or []),
            f"{s['job_retries_used']}/{s['job_retries_max']}", str(s["continuations"]),
            str(s["last_checkpoint_step"] if s["last_checkpoint_step"] is not None else "-"),
            escape(reason),
        ])  # fmt: skip
    return rows


def _table(summaries: list[dict[str, Any]], width: int | None = None,
           notes: dict[str, None] | None = None, now: float | None = None) -> Table:  # fmt: skip
    """The runs table; the notes said once are collected into `notes`."""
    rows = _run_rows(summaries, {} if notes is None else notes,
                     time.time() if now is None else now)  # fmt: skip
    return fitted_table(_RUN_COLS, rows, width or console.width, title="ftslurm runs")


def ordered(runs: Sequence[Run]) -> list[Run]:
    """Runs as `status` and `watch` list them: running first, then the other active ones,
    then those that ended; each group in the order they were submitted (pure)."""
    def rank(run: Run) -> int:
        return 0 if run.state is RunState.RUNNING else 1 if not run.state.is_terminal else 2

    return sorted(runs, key=rank)


_ATTEMPT_COLS = (
    Col("attempt", None), Col("job", 80), Col("state", 90), Col("cause", 70), Col("exit", 55),
    Col("nodes", 50, wraps=True), Col("start", 45), Col("end", 60),
    Col("reason", 40, wraps=True),
)  # fmt: skip


def _attempts_table(summary: dict[str, Any], width: int, now: float,
                    notes: dict[str, None] | None = None) -> Table:  # fmt: skip
    rows = []
    for a in summary["attempts"]:
        reason, once = split_reason(a["reason"])
        if notes is not None:
            notes.update(dict.fromkeys(once))
        rows.append([str(a["attempt"]), str(a["job_id"] or "-"), _job_state(a),
                     a["cause"] or "-", str(a["exit_code"] if a["exit_code"] is not None else "-"),
                     _fmt_nodes(a["nodes"]), _fmt_time(a["start"], now), _fmt_time(a["end"], now),
                     escape(reason)])  # fmt: skip
    return fitted_table(_ATTEMPT_COLS, rows, width, title=f"attempts of {summary['run_id']}")


# ---------------------------------------------------------------------------- lost nodes
def lost_node_notes(nodes: Sequence[str], infos: Sequence[NodeInfo], slurmd_timeout_s: int,
                    now: float) -> list[str]:  # fmt: skip
    """What to say about an allocation's nodes that stopped answering (pure).

    Until SlurmdTimeout has passed the scheduler still counts such a node as up and the job
    as running, so nothing else shows that anything happened."""
    by_name = {i.name: i for i in infos}
    notes = []
    for name in nodes:
        info = by_name.get(name)
        if info is None or info.responding:
            continue
        if info.state in (NodeState.DOWN, NodeState.FAIL):
            notes.append(f"{name} is down ({info.reason or 'not responding'}); the scheduler "
                         "ends the job on it")  # fmt: skip
        elif info.not_responding_since is not None:
            since = info.not_responding_since
            notes.append(f"{name} not responding since {_fmt_time(since, now)}; the scheduler "
                         f"declares it down at about {_fmt_time(since + slurmd_timeout_s, now)} "
                         f"(SlurmdTimeout {slurmd_timeout_s} s)")  # fmt: skip
        else:
            notes.append(f"{name} not responding; the scheduler declares it down once it has "
                         f"been silent for SlurmdTimeout ({slurmd_timeout_s} s)")  # fmt: skip
    return notes


_HOLDING = (JobState.RUNNING.value, JobState.COMPLETING.value)


def recovery_notes(attempts: Sequence[Attempt], events: Sequence[Any],
                   rounds: dict[int, Sequence[dict[str, Any]]], now: float) -> list[str]:
    """What to say about the nodes lost in a run's latest two attempts and the recovery
    under way (pure): "n2 lost 21 s ago (peer report) → new job 45 queued", or "→ spare:
    ranks restarted 4 s later". `events` are the run's `node_lost` (and other) events,
    `rounds` an attempt's in-job round records."""
    if not attempts:
        return []
    by_no = {a.attempt: a for a in attempts}
    latest = attempts[-1].attempt
    notes = []
    for e in events:
        d = e.data
        k = d.get("attempt")
        if e.kind != "node_lost" or not isinstance(k, int) or k < latest - 1:
            continue
        at = d.get("time") if isinstance(d.get("time"), (int, float)) else e.time
        source = {"slurm": "Slurm's verdict", "daemon": "the daemon's lease watch"}.get(
            str(d.get("source")), "peer report")
        head = f"{d.get('node') or 'a node'} lost {_fmt_age(max(0.0, now - at))} ago ({source})"
        if d.get("recovery") == "spare":
            starts = [r.get("started_at") for r in rounds.get(k, ())
                      if isinstance(r.get("started_at"), (int, float)) and r["started_at"] >= at]
            tail = (f"spare: ranks restarted {_fmt_age(min(starts) - at)} later" if starts
                    else "spare: ranks restarting")  # fmt: skip
        else:
            nxt = next((a for n, a in sorted(by_no.items()) if n > k), None)
            if nxt is None:
                tail = "ending the job"
            else:
                what = "new job" if nxt.job_id != by_no[k].job_id else "job"
                job = f"{what} {nxt.job_id}" if nxt.job_id else f"{what} being submitted"
                state = str(nxt.state)
                if state == JobState.PENDING.value:
                    tail = f"{job} queued"
                elif state == JobState.RUNNING.value and nxt.start is not None:
                    tail = f"{job} running {_fmt_age(max(0.0, nxt.start - at))} later"
                elif nxt.job_id:
                    tail = f"{job} {state}"
                else:
                    tail = job
        notes.append(f"{head} → {tail}")
    return notes


def _lost_nodes(store: Store, runs: Sequence[Run], now: float) -> list[str]:
    """Notes on the nodes of running attempts that stopped answering: one `nodes()` call per
    backend, and none when no attempt runs."""
    groups: dict[tuple[str, str | None], list[tuple[Run, Attempt]]] = {}
    for run in runs:
        if run.state.is_terminal:
            continue
        attempt = store.latest_attempt(run.run_id)
        if attempt is None or not attempt.nodes or attempt.state not in _HOLDING:
            continue
        key = (run.spec.get("backend") or "slurm", run.spec.get("mock_home"))
        groups.setdefault(key, []).append((run, attempt))
    notes = []
    for (kind, home), items in groups.items():
        try:
            backend = create_backend(kind, home)
            infos = backend.nodes()
            timeout = backend.cluster_facts().slurmd_timeout_s
        except FtslurmError as exc:
            notes.append(f"could not ask the {kind} scheduler about nodes: {exc.message}")
            continue
        for run, attempt in items:
            notes += [f"run {run.run_id}: {note}"
                      for note in lost_node_notes(attempt.nodes, infos, timeout, now)]  # fmt: skip
    return notes


def _recoveries(store: Store, runs: Sequence[Run], now: float) -> list[str]:
    """Notes on the nodes lost under active runs and their recovery (`recovery_notes`)."""
    notes = []
    for run in runs:
        if run.state.is_terminal:
            continue
        attempts = store.attempts(run.run_id)
        events = [e for e in store.events(run.run_id) if e.kind == "node_lost"]
        if not events:
            continue
        rounds: dict[int, Sequence[dict[str, Any]]] = {}
        if run.spec.get("run_dir"):
            folder = RunDir(run.spec["run_dir"])
            for a in attempts[-2:]:
                found = (read_json(p) for p in folder.recovery(a.attempt).glob(ROUND_RECORDS))
                rounds[a.attempt] = [r for r in found if isinstance(r, dict)]
        notes += [f"run {run.run_id}: {n}" for n in recovery_notes(attempts, events, rounds, now)]
    return notes


def uses_checkpoints(summary: dict[str, Any], progress: dict[str, Any]) -> bool:
    """Whether the run saves checkpoints where ftslurm put them: its script told of one, or
    its checkpoint folder holds something (a plain script may never write there)."""
    if isinstance(progress.get("checkpoint_step"), int):
        return True
    folder = summary.get("checkpoint_dir")
    try:
        return bool(folder) and any(Path(folder).iterdir())
    except OSError:
        return False


def uses_cadence(summary: dict[str, Any], progress: dict[str, Any]) -> bool:
    """Whether the run's ranks follow the tuned checkpoint interval: they report their steps
    to ftslurm (the rank agent, whose `should_checkpoint()` reads the interval), and no
    ending said they wrote no heartbeats."""
    silent = any(split_reason(a["reason"])[1] for a in summary["attempts"])
    return isinstance(progress.get("step"), int) and not silent


def status(
    run_id: Annotated[str | None, typer.Argument(
        metavar="RUN", help=f"{_RUN_HELP} Default: every run.", show_default=False,
        callback=_resolve_run_arg)] = None,
    active: Annotated[bool, typer.Option("--active", help="Only the runs that have not "
                      "ended.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Show runs (all, or one) with their attempts, the nodes lost under an active run with
    the recovery under way, and nodes of a running attempt that stopped answering. Running
    runs come first."""
    store = _store()
    runs = [_run_or_fail(store, run_id)] if run_id else ordered(store.list_runs(active))
    warn_orphan_jobs(store, runs)
    warn_no_daemon(store.home, runs)
    summaries = [run_summary(store, r) for r in runs]
    now = time.time()
    recoveries = _recoveries(store, runs, now)
    notes = recoveries + _lost_nodes(store, runs, now)
    if as_json:
        if run_id:
            typer.echo(json.dumps({**summaries[0], "notes": notes}, indent=1))
        else:
            typer.echo(json.dumps(summaries, indent=1))
        return
    if not summaries:
        typer.echo("no active runs" if active else "no runs yet (`ftslurm submit`)")
        return
    said_once: dict[str, None] = {}
    console.print(_table(summaries, notes=said_once, now=now))
    if run_id:
        console.print(_attempts_table(summaries[0], console.width, now, said_once))
        s = summaries[0]
        reason, once = split_reason(s["reason"])
        said_once.update(dict.fromkeys(once))
        console.print(f"{s['state']}" + (f": {reason}" if reason else ""),
                      markup=False, highlight=False, soft_wrap=True)  # fmt: skip
        progress = _progress(runs[0])
        if s["checkpoint_dir"] and uses_checkpoints(s, progress):
            source = f" (from {s['checkpoint_dir_from']})" if s["checkpoint_dir_from"] else ""
            console.print(f"checkpoints in: {s['checkpoint_dir']}{source}", markup=False,
                          highlight=False, soft_wrap=True)  # fmt: skip
        cadence = Cadence.from_json(s["checkpoint_cadence"])
        if cadence is not None and uses_cadence(s, progress):
            console.print(f"checkpoints: {cadence.describe()}", markup=False, highlight=False,
                          soft_wrap=True)  # fmt: skip
    for note in said_once:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    for note in notes:
        said = "lost node" if note in recoveries else "warning"
        console.print(f"{said}: {note}", markup=False, highlight=False, soft_wrap=True)


# The SlurmdTimeout (s) a shorter wait is suggested from (`mock up --slurmd-timeout`).
SHORT_SLURMD_TIMEOUT_S = 20


def _mock_words(backend: SchedulerBackend, home: str | None) -> tuple[str, dict[str, Any]]:
    """What a dry run's line says of its mock cluster (where it is, and the SlurmdTimeout
    after which it declares a failed node down: a mock that `submit` creates has Slurm's
    300 s), and the same for --json."""
    timeout = backend.cluster_facts().slurmd_timeout_s
    where = str(home or mock_home())
    return (f" on the mock cluster in {where} (SlurmdTimeout {timeout} s)",
            {"mock_home": where, "slurmd_timeout_s": timeout})


def _warn_injections(injections: Sequence[Injection], backend: SchedulerBackend) -> None:
    """One line on stderr when a dry run injects a node failure: nothing shows it until the
    mock, like Slurm, declares the node down after its SlurmdTimeout; how to shorten the
    wait only when it is long."""
    fails = [i for i in injections if i.kind is InjectKind.NODE_FAIL]
    if not fails:
        return
    timeout = backend.cluster_facts().slurmd_timeout_s
    shorter = (" (for a shorter wait: `ftslurm mock destroy`, then `ftslurm mock up "
               f"--slurmd-timeout {SHORT_SLURMD_TIMEOUT_S}`)"
               if timeout > SHORT_SLURMD_TIMEOUT_S else "")  # fmt: skip
    err.print(f"{', '.join(i.spec() for i in fails)}: the mock notices a failed node after its "
              f"SlurmdTimeout ({timeout} s), as Slurm does; until then `ftslurm status` shows "
              f"the node as not responding{shorter}", markup=False, highlight=False,
              soft_wrap=True)  # fmt: skip


def tagged_run(comment: str | None) -> str | None:
    """The run id in a job's ftslurm tag (`records.tag`), or None for any other comment."""
    parsed = parse_tag(comment)
    return parsed[0] if parsed else None


def orphan_jobs(jobs: list[JobInfo], known: set[str]) -> dict[str, str]:
    """Job id -> run id of the tagged jobs whose run is not in `known`."""
    found = {job.job_id: tagged_run(job.comment) for job in jobs}
    return {job: run for job, run in found.items() if run is not None and run not in known}


def _cheap_backends(store: Store, runs: list[Run]) -> list[SchedulerBackend]:
    """The backends this state directory has used (its runs', those the daemon recorded
    beside the database, the mock `FTSLURM_MOCK_HOME` names), where asking is cheap: a mock
    cluster that exists; the Slurm CLI where `squeue` exists, one try with a short timeout."""
    from ftslurm.backends.mock import MockScheduler
    from ftslurm.backends.mock.store import DB_FILE
    from ftslurm.backends.slurm_cli import CommandRunner, SlurmCliBackend

    keys = {backend_key(r.spec) for r in runs if "backend" in r.spec}
    keys |= set(marked_backends(store.home))
    if os.environ.get(MOCK_HOME_ENV):
        keys.add(f"mock:{mock_home()}")
    found: list[SchedulerBackend] = []
    for key in sorted(keys):
        kind, _, where = key.partition(":")
        if kind == "mock" and (Path(where or mock_home()) / DB_FILE).exists():
            found.append(MockScheduler(Path(where or mock_home())))
        elif kind == "slurm" and shutil.which("squeue"):
            found.append(SlurmCliBackend(CommandRunner(timeout_s=5.0), query_budget_s=0.0))
    return found


def warn_orphan_jobs(store: Store, runs: list[Run]) -> None:
    """Warn (one line, stderr) about jobs ftslurm tagged for runs this state directory does
    not have: their runs were lost with the database, and nothing manages them."""
    orphans: dict[str, str] = {}
    known = {r.run_id for r in runs}
    for backend in _cheap_backends(store, runs):
        try:
            jobs = backend.active_jobs()
        except FtslurmError:
            continue  # a scheduler that does not answer now is not worth a wait here
        for job, run in orphan_jobs(jobs, known).items():
            if store.get_run(run) is None:
                orphans[job] = run
    if orphans:
        err.print(f"warning: job(s) {', '.join(sorted(orphans))} carry ftslurm tags of "
                  f"run(s) {', '.join(sorted(set(orphans.values())))} that are not in "
                  f"{store.path}: nothing manages them (state lost? see `ftslurm daemon "
                  "recover`, or cancel them)", markup=False, highlight=False,
                  soft_wrap=True)  # fmt: skip


def warn_no_daemon(home: Path, runs: Sequence[Run]) -> None:
    """One line (stderr) when runs have not ended and no daemon serves them: nothing submits
    a PENDING run, watches a RUNNING one or retries it until a daemon runs."""
    waiting = [r for r in runs if not r.state.is_terminal]
    if not waiting:
        return
    try:
        if service.serving(home) or service.queued_daemon_job(home):
            return
    except FtslurmError:
        return  # a scheduler that does not answer now: not known, not worth a wait here
    which = (f"run {waiting[0].run_id}" if len(waiting) == 1
             else f"the {len(waiting)} runs that have not ended")  # fmt: skip
    err.print(f"warning: no daemon serves {home}: nothing submits, watches or retries "
              f"{which} until one runs (`ftslurm daemon start`)", markup=False,
              highlight=False, soft_wrap=True)  # fmt: skip


# ---------------------------------------------------------------------------- wait
def wait(
    run_id: RunArg,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", help="Give up after this many seconds (exit 124). Default: no limit.",
        show_default=False)] = None,
) -> None:
    """Wait for a run to end and print how it ended: exit 0 COMPLETED, 1 FAILED or
    CANCELLED, 124 on timeout."""
    store = _store()
    run = _run_or_fail(store, run_id)
    if not run.state.is_terminal:
        service.start(state_dir())
    deadline = None if timeout is None else time.monotonic() + timeout
    while not run.state.is_terminal:
        if deadline is not None and time.monotonic() >= deadline:
            err.print(f"run {run_id} is still {run.state.value} after {timeout:g}s")
            raise typer.Exit(124)
        time.sleep(0.25)
        run = _run_or_fail(store, run_id)
    # the result on stdout (`wait RUN > result.txt`, `$(ftslurm wait RUN)`); only the
    # timeout above goes to stderr
    typer.echo(f"run {run_id} {run.state.value}" + (f": {run.reason}" if run.reason else ""))
    raise typer.Exit(0 if run.state is RunState.COMPLETED else 1)


# ---------------------------------------------------------------------------- cancel
def cancel(run_id: RunArg) -> None:
    """Cancel a run: its current job is cancelled and nothing is retried."""
    store = _store()
    run = _run_or_fail(store, run_id)
    run_id = run.run_id
    # the flag and the latest attempt in one transaction: the daemon records a new job id
    # and reads the flag in one too, so either this sees the job or the daemon sees the flag
    requested, latest = store.request_cancel(run_id, time.time())
    if not requested:
        ended = store.get_run(run_id) or run
        typer.echo(f"run {run_id} already ended ({ended.state.value})")
        return
    home = state_dir()
    service.start(home)
    service.wake(home)
    deadline = time.monotonic() + SUBMIT_WAIT_S
    while latest is not None and not latest.job_id and time.monotonic() < deadline:
        # a submission may be under way: wait until the daemon recorded its job (and
        # cancelled it) or ended the run, so that no job starts after this replies
        current = store.get_run(run_id)
        if current is None or current.state.is_terminal:
            break
        time.sleep(0.1)
        latest = store.latest_attempt(run_id)
    if latest is not None and latest.job_id:
        try:
            create_backend(run.spec["backend"], run.spec.get("mock_home")).cancel(latest.job_id)
        except (SchedulerUnavailable, JobStateConflict, InvalidJobId):
            pass  # ended already, or the daemon cancels it when the scheduler answers
    typer.echo(f"run {run_id}: cancel requested")


# ---------------------------------------------------------------------------- logs
def _attempt_sections(text: str) -> dict[int, str]:
    """Split a job's output into attempts by the header line the batch script prints."""
    sections: dict[int, list[str]] = {}
    current: int | None = None
    for line in text.splitlines(keepends=True):
        if line.startswith("=== ftslurm run ") and " attempt " in line:
            try:
                current = int(line.split(" attempt ", 1)[1].split(":", 1)[0])
            except ValueError:
                current = None
        if current is not None:
            sections.setdefault(current, []).append(line)
    return {k: "".join(v) for k, v in sections.items()}


def logs(
    run_id: RunArg,
    attempt: Annotated[int | None, typer.Option(
        "--attempt", help="Which attempt (0, 1, ...). Default: the latest.",
        show_default=False)] = None,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Keep printing as the run goes on, each new attempt's output "
        "as it starts; stop when the run ends.")] = False,
) -> None:
    """Print the output of an attempt (the latest by default)."""
    store = _store()
    run = _run_or_fail(store, run_id)
    attempts = store.attempts(run.run_id)
    chosen = attempts[-1] if attempt is None else next(
        (a for a in attempts if a.attempt == attempt), None)  # fmt: skip
    if chosen is None:
        have = f"attempts 0 to {attempts[-1].attempt}" if attempts else "no attempts"
        raise ConfigError(f"run {run.run_id} has no attempt {attempt} (it has {have})")
    if not chosen.job_id and not follow:
        raise ConfigError(f"attempt {chosen.attempt} of run {run.run_id} has no job yet")
    folder = RunDir(run.spec["run_dir"]).logs
    shown: dict[int, int] = {}
    while True:
        ended = run.state.is_terminal  # read before the files: their last lines are printed
        for a in store.attempts(run.run_id) if follow else [chosen]:
            if a.attempt < chosen.attempt or not a.job_id:
                continue
            path = folder / f"job-{a.job_id}.out"
            text = path.read_text(errors="replace") if path.exists() else ""
            section = _attempt_sections(text).get(a.attempt, "")
            sys.stdout.write(section[shown.get(a.attempt, 0):])
            shown[a.attempt] = len(section)
        sys.stdout.flush()
        if not follow or ended:
            return
        time.sleep(0.5)
        run = _run_or_fail(store, run.run_id)


# ---------------------------------------------------------------------------- nodes
nodes_app = typer.Typer(help="The node exclusion list every later attempt gets.",
                        no_args_is_help=False, invoke_without_command=True)  # fmt: skip


@nodes_app.callback()
def nodes_default(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    if ctx.invoked_subcommand is None:
        nodes_list(as_json)


_NODE_COLS = (Col("node", None), Col("reason", 50, wraps=True), Col("since", 60),
              Col("expires", 70), Col("run", 40))  # fmt: skip


@nodes_app.command("list")
def nodes_list(as_json: JsonOpt = False) -> None:
    """Show excluded nodes with their reasons and expiry."""
    store = _store()
    flags = store.node_flags(time.time())
    pending = len(store.pending_requests())
    if pending:
        err.print(f"{pending} node request(s) not applied yet: the daemon applies them on "
                  "its next cycle", markup=False, highlight=False)  # fmt: skip
    if as_json:
        typer.echo(json.dumps([f.__dict__ for f in flags]))
        return
    now = time.time()
    # A reason stored before control characters were refused shows them escaped (\x1b),
    # never as raw terminal sequences.
    rows = [[f.node, escape(f.reason if not bad_char(f.reason) else repr(f.reason)[1:-1]),
             _fmt_time(f.since, now),
             _fmt_time(f.expires_at, now) if f.expires_at else "never", f.run_id or "-"]
            for f in flags]  # fmt: skip
    console.print(fitted_table(_NODE_COLS, rows, console.width, title="excluded nodes"))


_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def node_names(text: str) -> list[str]:
    """Node names from `n1`, `n1,n2` or a hostlist expression (`n[1-3]`), as Slurm writes
    them; blank, whitespace and control characters are refused (pure)."""
    if not text.strip():
        raise ConfigError("a node name cannot be empty")
    if any(c.isspace() or not c.isprintable() for c in text):
        raise ConfigError(f"node name {text!r} contains whitespace or a control character")
    try:
        names = hostlist.expand_hostlist(text)
    except hostlist.BadHostlist:
        raise ConfigError(f"{text!r} is not a node name or hostlist (like n[1-3])") from None
    bad = [n for n in names if not _NODE_NAME.fullmatch(n)]
    if bad or not names:
        raise ConfigError(f"{text!r} is not a node name or hostlist (like n[1-3])")
    return names


@nodes_app.command("add")
def nodes_add(
    node: Annotated[str, typer.Argument(metavar="NODES", show_default=False, help=(
        "A node name, or several as Slurm writes them: n1,n2 or n[1-3]."))],
    reason: Annotated[str, typer.Option("--reason", help="Why, shown in `nodes list`.")
                      ] = "added by hand",
    ttl: Annotated[float | None, typer.Option(
        "--ttl", help="Seconds until the node may be used again. Default: never (until "
        "`nodes remove`).", show_default=False)] = None,
) -> None:
    """Keep nodes out of every later attempt."""
    names = node_names(node)
    check_line("--reason", reason)  # one line of printable text: `nodes list` prints it
    if ttl is not None and ttl <= 0:
        raise ConfigError(f"--ttl must be a positive number of seconds, not {ttl:g}")
    done, note = _ask_daemon(*user_requests.nodes_add(names, reason, ttl))
    if done is None:
        typer.echo(f"{compress_nodes(names)}: exclusion recorded; {note}")
    else:
        typer.echo(f"{compress_nodes(names)} excluded")


@nodes_app.command("remove")
def nodes_remove(node: Annotated[str, typer.Argument(
        metavar="NODES", show_default=False, help="A node name, n1,n2 or n[1-3].")]) -> None:
    """Let nodes be used again."""
    names = node_names(node)
    flagged = {f.node for f in _store().node_flags()}
    missing = [n for n in names if n not in flagged]
    if not missing:
        done, note = _ask_daemon(*user_requests.nodes_remove(names))
        if done is None:
            typer.echo(f"{compress_nodes(names)}: removal recorded; {note}")
            return
        missing = list((done.result or {}).get("missing") or [])  # removed meanwhile
    if missing:
        raise ConfigError(f"{compress_nodes(missing)} not on the exclusion list")
    typer.echo(f"{compress_nodes(names)} no longer excluded")


# How long `nodes add` and `nodes remove` wait for the daemon to apply their request (s).
REQUEST_WAIT_S = 15.0


def _ask_daemon(kind: str, data: dict[str, Any]) -> tuple[Request | None, str]:
    """Record a request for the daemon (the one writer of node flags), start or wake it,
    and wait, bounded, until it applied the request. Returns the applied request, or None
    and what happens next."""
    store = _store()
    request_id = store.add_request(kind, data, time.time())

    def applied() -> tuple[bool, Request | None, str]:
        request = store.get_request(request_id)
        return request is not None and request.applied_at is not None, request, ""

    return _await_daemon(state_dir(), "the daemon applies it on its next cycle",
                         REQUEST_WAIT_S, applied)


# ---------------------------------------------------------------------------- daemon
daemon_app = typer.Typer(help="The daemon that owns the runs.", no_args_is_help=True)


# How long a daemon's lease must stay silent before another daemon takes it over.
LeaseTimeoutOpt = Annotated[float, typer.Option(
    "--lease-timeout", min=1.0, help="Seconds a daemon's lease must stay silent (its daemon "
    "dead or cut off) before another daemon takes it over.")]


@daemon_app.command("start")
def daemon_start() -> None:
    """Start the daemon for this state directory (no-op if it runs)."""
    typer.echo(f"daemon running ({service.start(state_dir(), auto=False).describe()})")


@daemon_app.command("submit")
def daemon_submit(
    time_limit: Annotated[str, typer.Option(
        "--time", "-t", help="The daemon job's time limit (Slurm syntax); it hands over to "
        "a successor job before it.")] = as_job.DEFAULT_TIME,
    partition: Annotated[_Text, _opt("--partition", "-p", help="Partition of the daemon "
                                     "job (default: the cluster's).")] = None,
    account: Annotated[_Text, _opt("--account", "-A", help="Account of the daemon job "
                                   "(default: the user's).")] = None,
    handover: Annotated[int, typer.Option(
        "--handover", min=60, help="Seconds before the time limit at which the daemon job "
        "submits its successor and hands over.")] = as_job.DEFAULT_HANDOVER_S,
    lease_timeout: LeaseTimeoutOpt = DAEMON_LEASE_TIMEOUT_S,
    sbatch_arg: Annotated[list[str] | None, _opt("--sbatch-arg", help="Any other sbatch "
                          "flag for the daemon job, e.g. --sbatch-arg=--qos=long; "
                          "repeatable (default: none).")] = None,
    print_script: Annotated[bool, _opt("--print-script", help="Print the daemon job's "
                            "script and submit nothing.")] = False,
) -> None:
    """Run the daemon as a small Slurm job (one CPU, requeued if its node dies, handing
    over to a successor job before its time limit): no service on a login node needed."""
    limit = parse_time_limit(time_limit)
    if limit is None:
        raise ConfigError("--time: the daemon job needs a time limit")
    if handover >= limit:
        raise ConfigError(f"--handover {handover}s is not shorter than --time {time_limit}")
    given = sbatch_flags(list(sbatch_arg or ()), "--sbatch-arg")
    extra = dict(given.pop("sbatch_extra", {}))
    partition, account = given.pop("partition", partition), given.pop("account", account)
    if "exclude" in given:  # nodes the daemon job must avoid: a plain sbatch flag here
        nodes = given.pop("exclude")
        extra["exclude"] = nodes if isinstance(nodes, str) else ",".join(nodes)
    if given:
        raise ConfigError(f"--sbatch-arg: the daemon job sets {', '.join(sorted(given))} "
                          "itself (one task on one node; --time, --partition, --account, "
                          "--exclude and other sbatch flags are taken)")
    job = as_job.DaemonJob(state_dir(), sys.executable, time_limit, handover, lease_timeout,
                           partition, account, extra)  # fmt: skip
    options = job.options()  # a bad value is one line here, before anything is submitted
    if print_script:
        typer.echo(job.script(), nl=False)
        return
    home = state_dir()
    with Store(home) as store:
        store.check_integrity()
    found = service.serving(home)
    if found is not None and not found.pending:
        raise ConfigError(f"a daemon already serves {home} ({found.describe()})",
                          hint="stop it first, or let it serve")  # fmt: skip
    del options
    job_id = as_job.submit(create_backend("slurm"), job)
    typer.echo(f"daemon job {job_id} submitted; `ftslurm daemon status` shows where it runs")


@daemon_app.command("stop")
def daemon_stop() -> None:
    """Stop the daemon; runs are kept and resumed by the next one."""
    pid = service.stop(state_dir())
    typer.echo("no daemon was running" if pid is None else f"daemon (pid {pid}) stopped")


@daemon_app.command("status")
def daemon_status(as_json: JsonOpt = False) -> None:
    """Whether the daemon runs, and how many runs it owns."""
    home = state_dir()
    found = service.serving(home) or service.queued_daemon_job(home)
    active = len(_store().list_runs(active_only=True))
    if as_json:
        typer.echo(json.dumps({"running": found is not None and not found.pending,
                               "pid": found.pid if found and not found.pending else None,
                               "host": found.host if found and not found.pending else None,
                               "job_id": found.job_id if found else None, "home": str(home),
                               "active_runs": active}))  # fmt: skip
    else:
        state = "not running" if found is None else f"queued ({found.describe()})" \
            if found.pending else f"running ({found.describe()})"  # fmt: skip
        typer.echo(f"daemon {state}; {active} active run(s) in {home}")
    if found is None and active:
        raise typer.Exit(1)


@daemon_app.command("recover")
def daemon_recover() -> None:
    """Restore the state database from its last backup (the daemon must be stopped); the
    damaged files are kept."""
    restored = service.recover(state_dir())
    if restored.taken_at is None:
        typer.echo(f"the state database is sound and keeps its {restored.runs} run(s) "
                   f"({restored.active_runs} active); runs it had lost are rebuilt")
    else:
        age = max(0.0, time.time() - restored.taken_at)
        kept = f"; the replaced files are in {restored.kept_in}" if restored.kept_in else ""
        typer.echo(f"restored {restored.runs} run(s) ({restored.active_runs} active) from the "
                   f"backup of {datetime.fromtimestamp(restored.taken_at):%Y-%m-%d %H:%M:%S} "
                   f"({_fmt_age(age)} old){kept}")  # fmt: skip
    for line in restored.rebuilt:  # runs rebuilt from their folders, jobs nothing manages
        typer.echo(line)


def _fmt_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@daemon_app.command("run")
def daemon_run(
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Log at debug level (default: info).")] = False,
    lease_timeout: LeaseTimeoutOpt = DAEMON_LEASE_TIMEOUT_S,
    job: Annotated[bool, typer.Option("--job", hidden=True,
                   help="Run as a daemon job (`daemon submit`).")] = False,
    successor: Annotated[bool, typer.Option("--successor", hidden=True,
                         help="A daemon job's successor: wait for the lease.")] = False,
) -> None:
    """Run the daemon in the foreground (for a systemd user unit)."""
    service.configure_logging(verbose)
    service.serve(state_dir(), lease_timeout_s=lease_timeout, job=job, successor=successor)


# ---------------------------------------------------------------------------- watch
def watch_view(summaries: list[dict[str, Any]], width: int, height: int,
               now: float) -> RenderableType:  # fmt: skip
    """What `watch` shows in a `width` x `height` terminal: the runs table (running runs
    first, as `ordered` lists them) with as many rows as fit, leaving out the oldest ended
    runs first, and one line saying how many were left out."""
    shown = list(summaries)
    left_out = 0
    measure = Console(width=width, file=io.StringIO(), color_system=None)
    while True:
        said_once: dict[str, None] = {}
        parts: list[RenderableType] = [_table(shown, width, said_once, now)]
        parts += [Text(f"note: {n}", overflow="ellipsis", no_wrap=True) for n in said_once]
        if left_out:
            parts.append(Text(f"{left_out} more run(s) not shown: `ftslurm status` lists "
                              "every run", overflow="ellipsis", no_wrap=True))  # fmt: skip
        view = Group(*parts)
        lines = measure.render_lines(view, measure.options.update(width=width), pad=False)
        if len(lines) <= height or not shown:
            return view
        ended = [i for i, x in enumerate(shown) if RunState(x["state"]).is_terminal]
        shown.pop(ended[0] if ended else -1)
        left_out += 1


def watch(
    interval: Annotated[float, typer.Option(
        "--interval", help="Seconds between refreshes.", min=0.05)] = 1.0,
    until_done: Annotated[bool, typer.Option("--until-done",
                          help="Return when no run is active.")] = False,
) -> None:
    """A live view of every run: running runs first, as many as the terminal holds."""
    store = _store()
    with Live(console=console, refresh_per_second=4) as live:
        while True:
            runs = ordered(store.list_runs())
            width, height = console.size
            live.update(watch_view([run_summary(store, r) for r in runs], width,
                                   max(height - 1, 5), time.time()))  # fmt: skip
            if until_done and not any(not r.state.is_terminal for r in runs):
                return
            time.sleep(interval)


def register(app: typer.Typer) -> None:
    extra = {"allow_extra_args": False}
    app.command(context_settings=extra)(submit)
    app.command()(status)
    app.command()(wait)
    app.command()(cancel)
    app.command()(logs)
    app.command()(watch)
    app.add_typer(nodes_app, name="nodes")
    app.add_typer(daemon_app, name="daemon")

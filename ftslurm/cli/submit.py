"""`ftslurm submit` and `ftslurm cancel`: a run recorded for the daemon to submit, and a
run cancelled by hand.

Both read and write the state directory (`FTSLURM_HOME`, default the platform's user state
dir); the daemon owns a run once it is recorded.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from ftslurm.backends import create_backend, mock_home
from ftslurm.backends.mock.model import MockConfig
from ftslurm.backends.mock.store import DB_FILE as MOCK_DB_FILE
from ftslurm.backends.mock.store import MockStore
from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.cli.common import (
    JsonOpt,
    RunArg,
    _await_daemon,
    _opt,
    _run_or_fail,
    _store,
    _Text,
    err,
)
from ftslurm.core.contract import SCRATCH_ENVS, EnvName, RunDir
from ftslurm.core.inject import Injection, InjectKind, parse_duration, parse_injections
from ftslurm.core.settings import FtSettings
from ftslurm.core.validate import OWNED_SBATCH_FLAGS
from ftslurm.daemon import service
from ftslurm.daemon.records import NEVER_SUBMITTED, new_run_record
from ftslurm.daemon.store import RUNS_DIR, Store, mark_backend, mirror_run
from ftslurm.daemon.submission import backend_key, build_attempt, make_spec
from ftslurm.errors import (
    ConfigError,
    InvalidJobId,
    JobStateConflict,
    SchedulerRejected,
    SchedulerUnavailable,
)
from ftslurm.fsutil import private_dir
from ftslurm.paths import state_dir
from ftslurm.recipe import load_recipe, no_limit_warning, sbatch_flags


def _default(setting: str, unit: str = "") -> str:
    """The default of a fault-tolerance setting, for a help text (FtSettings holds it)."""
    value = FtSettings.model_fields[setting].default
    return f"(default: the recipe's {setting}, else {value}{unit})"


_SBATCH = "Passed to sbatch as is"
_RECIPE = "(default: the recipe's, else Slurm's)"


# The panels of `submit --help`, by option (the rest, --json and --help: Options).
SUBMIT_PANELS = {
    "Retries and recovery": ("--retries", "--in-job-restarts", "--spare-nodes"),
    "Checkpoints": ("--preempt-time", "--checkpoint-dir"),
    "The job (sbatch's flags)": (
        "--nodes",
        "--ntasks-per-node",
        "--ntasks",
        "--gpus-per-node",
        "--cpus-per-task",
        "--time",
        "--partition",
        "--account",
        "--exclude",
        "--job-name",
        "--mem",
        "--mem-per-cpu",
        "--gres",
        "--gpus",
        "--constraint",
        "--qos",
        "--dependency",
        "--mail-type",
        "--mail-user",
        "--nodelist",
        "--exclusive",
        "--reservation",
        "--wckey",
        "--sbatch-arg",
    ),
    "Rehearsal and dry run": ("--dry-run", "--inject", "--print-script"),
}


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
    retries: Annotated[
        int | None,
        _opt(
            "--retries",
            help="Job resubmissions after a failure "
            f"(num_job_retries_on_failure). {_default('num_job_retries_on_failure')}",
        ),
    ] = None,
    in_job_restarts: Annotated[
        int | None,
        _opt(
            "--in-job-restarts",
            help=f"Rank restarts inside one job, per attempt. {_default('num_in_job_restarts')}",
        ),
    ] = None,
    spare_nodes: Annotated[
        int | None,
        _opt(
            "--spare-nodes",
            help="Idle nodes to ask for "
            "beside --nodes (N+K nodes, --no-kill): a lost node is replaced by "
            "one inside the same job, from the last checkpoint. "
            f"{_default('spare_nodes')}",
        ),
    ] = None,
    preempt_time: Annotated[
        _Text,
        _opt(
            "--preempt-time",
            help="How long before the time "
            "limit to ask for a checkpoint: 90, 90s, 5m, 1h (plain numbers are "
            f"seconds; 0: never). {_default('preempt_time', ' s')}",
        ),
    ] = None,
    nodes: Annotated[
        int | None, _opt("-N", "--nodes", help="Nodes. (default: the recipe's, else 1)")
    ] = None,
    ntasks_per_node: Annotated[
        int | None,
        _opt(
            "--ntasks-per-node",
            help="Ranks per node. "
            "(default: the recipe's, else --gpus-per-node, else --ntasks / "
            "--nodes, else 1)",
        ),
    ] = None,
    ntasks: Annotated[
        int | None,
        _opt(
            "-n",
            "--ntasks",
            help="Ranks in all: a multiple of "
            f"--nodes (ftslurm starts as many on each node). {_RECIPE}",
        ),
    ] = None,
    gpus_per_node: Annotated[
        int | None,
        _opt(
            "--gpus-per-node",
            help="GPUs per node; also "
            f"the ranks per node unless --ntasks-per-node is given. {_RECIPE}",
        ),
    ] = None,
    cpus_per_task: Annotated[
        int | None, _opt("-c", "--cpus-per-task", help=f"CPUs per rank. {_RECIPE}")
    ] = None,
    time_limit: Annotated[
        _Text,
        _opt(
            "-t",
            "--time",
            help="Wall time limit of each attempt, "
            "in sbatch's forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
            "D-HH:MM:SS; UNLIMITED, infinite or 0 for no limit. "
            "(default: the recipe's, else the partition's)",
        ),
    ] = None,
    partition: Annotated[_Text, _opt("-p", "--partition", help=f"Partition. {_RECIPE}")] = None,
    account: Annotated[_Text, _opt("-A", "--account", help=f"Account. {_RECIPE}")] = None,
    exclude: Annotated[
        _Text,
        _opt(
            "-x",
            "--exclude",
            help="Nodes never to use, "
            "comma-separated (ftslurm adds the nodes it flags). (default: none)",
        ),
    ] = None,
    name: Annotated[
        _Text,
        _opt(
            "-J",
            "--job-name",
            "--name",
            help="The run's name (and its "
            "jobs'): commands take it for the run id; refused while an active run "
            "has it. (default: the recipe's, else the recipe file's name)",
        ),
    ] = None,
    mem: Annotated[
        _Text,
        _opt("--mem", help=f"Memory per node, e.g. 64G (unit: M if none). {_SBATCH}. {_RECIPE}"),
    ] = None,
    mem_per_cpu: Annotated[
        _Text,
        _opt(
            "--mem-per-cpu", help=f"Memory per CPU, e.g. 4G (unit: M if none). {_SBATCH}. {_RECIPE}"
        ),
    ] = None,
    gres: Annotated[
        _Text, _opt("--gres", help=f"Generic resources per node, e.g. gpu:8. {_SBATCH}. {_RECIPE}")
    ] = None,
    gpus: Annotated[
        _Text, _opt("-G", "--gpus", help=f"GPUs in all, e.g. 16 or a100:16. {_SBATCH}. {_RECIPE}")
    ] = None,
    constraint: Annotated[
        _Text,
        _opt("-C", "--constraint", help=f"Node features, e.g. 'a100&ib'. {_SBATCH}. {_RECIPE}"),
    ] = None,
    qos: Annotated[
        _Text, _opt("-q", "--qos", help=f"Quality of service. {_SBATCH}. {_RECIPE}")
    ] = None,
    dependency: Annotated[
        _Text,
        _opt(
            "-d",
            "--dependency",
            help="Start after other jobs, e.g. "
            f"afterok:123 (first attempt and retries alike). {_SBATCH}. "
            f"{_RECIPE}",
        ),
    ] = None,
    mail_type: Annotated[
        _Text, _opt("--mail-type", help=f"e.g. END,FAIL. {_SBATCH}. {_RECIPE}")
    ] = None,
    mail_user: Annotated[
        _Text, _opt("--mail-user", help=f"Mail address. {_SBATCH}. {_RECIPE}")
    ] = None,
    nodelist: Annotated[
        _Text,
        _opt("-w", "--nodelist", help=f"Nodes to run on, comma-separated. {_SBATCH}. {_RECIPE}"),
    ] = None,
    exclusive: Annotated[
        bool,
        _opt(
            "--exclusive",
            help="Whole nodes, shared with no other job. (default: off, or the recipe's)",
        ),
    ] = False,
    reservation: Annotated[
        _Text, _opt("--reservation", help=f"Reservation. {_SBATCH}. {_RECIPE}")
    ] = None,
    wckey: Annotated[
        _Text, _opt("--wckey", help=f"Workload characterization key. {_SBATCH}. {_RECIPE}")
    ] = None,
    sbatch_arg: Annotated[
        list[str] | None,
        _opt(
            "--sbatch-arg",
            help="Any other sbatch flag, "
            "e.g. --sbatch-arg=--begin=now+1hour; repeatable. Flags ftslurm sets "
            "itself are refused. (default: none)",
        ),
    ] = None,
    output: Annotated[
        _Text,
        _opt(
            "-o",
            "--output",
            "-e",
            "--error",
            hidden=True,
            help="Refused: ftslurm owns the job's output file.",
        ),
    ] = None,
    array: Annotated[
        _Text, _opt("-a", "--array", hidden=True, help="Refused: one run is one job per attempt.")
    ] = None,
    checkpoint_dir: Annotated[
        _Text,
        _opt(
            "--checkpoint-dir",
            help="Where the run keeps its "
            f"checkpoints ({EnvName.CHECKPOINT_DIR.value}), relative to the "
            "current folder. (default: the recipe's, else "
            f"${SCRATCH_ENVS[0]} or ${SCRATCH_ENVS[1]}/ftslurm/RUN/checkpoints, "
            "else RUN_DIR/checkpoints)",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        _opt("--dry-run", help="Run against the mock scheduler (laptop rehearsal). (default: off)"),
    ] = False,
    inject: Annotated[
        list[str] | None,
        _opt(
            "--inject",
            help="KIND@TIME[:TARGET], TIME in "
            "seconds or 90s, 5m, 2h; repeatable (docs/fault-injection.md). "
            "(default: none)",
        ),
    ] = None,
    print_script: Annotated[
        bool,
        _opt(
            "--print-script",
            help="Print the sbatch script of the first attempt; submit nothing. (default: off)",
        ),
    ] = False,
    snapshot_code: Annotated[
        bool,
        _opt(
            "--snapshot-code/--no-snapshot-code",
            help="Copy the "
            "recipe file into the run folder at submit, so every attempt "
            "runs what was submitted; --no-snapshot-code runs the file as it "
            "is at each attempt (to pick up fixes on purpose). Only the recipe "
            "file is copied, not its folder. (default: on)",
        ),
    ] = True,
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
        raise ConfigError(
            f"recipe {recipe} is not executable and not a Python file (.py): "
            f"`chmod +x {recipe}`, or keep --snapshot-code (the copy is made "
            "executable)"
        )
    # Each --sbatch-arg is one word of sbatch's command line: `--k=v`, `--k`, `-kv`, or
    # a flag and its value in two (`--sbatch-arg=-q --sbatch-arg=high`).
    from_args = sbatch_flags(list(sbatch_arg or ()), "--sbatch-arg")
    flags = {
        "mem": mem,
        "mem-per-cpu": mem_per_cpu,
        "gres": gres,
        "gpus": gpus,
        "constraint": constraint,
        "qos": qos,
        "dependency": dependency,
        "mail-type": mail_type,
        "mail-user": mail_user,
        "nodelist": nodelist,
        "ntasks": None if ntasks is None else str(ntasks),
        "reservation": reservation,
        "wckey": wckey,
    }
    sbatch_extra = {
        **loaded.sbatch_extra,
        **from_args.pop("sbatch_extra", {}),
        **{k: v for k, v in flags.items() if v is not None},
        **({"exclusive": None} if exclusive else {}),
    }
    loaded = loaded.with_overrides(
        **{
            **from_args,
            **{
                k: v
                for k, v in dict(
                    num_job_retries_on_failure=retries,
                    num_in_job_restarts=in_job_restarts,
                    spare_nodes=spare_nodes,
                    preempt_time=preempt_s,
                    nodes=nodes,
                    ntasks_per_node=ntasks_per_node,
                    gpus_per_node=gpus_per_node,
                    cpus_per_task=cpus_per_task,
                    time=time_limit,
                    partition=partition,
                    account=account,
                    exclude=tuple(n for n in exclude.split(",") if n)
                    if exclude is not None
                    else None,
                    name=name,
                    checkpoint_dir=checkpoint_dir,
                    sbatch_extra=sbatch_extra,
                ).items()
                if v is not None
            },
        }
    )
    # Printed once everything is validated (an error then stays the only line).
    warning = no_limit_warning(loaded.time) if loaded.time_limit_s() is None else None
    injections = parse_injections(tuple(inject or ()))
    backend_kind = "mock" if dry_run else "slurm"
    cluster_side = [i.kind.value for i in injections if not i.kind.in_job]
    if cluster_side and not dry_run:
        raise ConfigError(
            f"{', '.join(cluster_side)} can only be injected with --dry-run (the mock scheduler)"
        )
    if dry_run:
        _check_injected_nodes(injections, mock_home())
    home = state_dir()
    run_id = uuid.uuid4().hex[:10]
    run_dir = home / RUNS_DIR / run_id
    settings = loaded.settings()
    spec = make_spec(
        loaded,
        run_dir=run_dir,
        backend=backend_kind,
        workdir=str(Path.cwd()),
        inject=tuple(i.spec() for i in injections),
        mock_home=mock_home() if dry_run else None,
        environ=os.environ,
    )
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
        where, facts = _mock_words(
            create_backend(backend_kind, spec["mock_home"]), spec["mock_home"]
        )
    if as_json:
        typer.echo(json.dumps({"run_id": run_id, "job_id": job_id, **facts}))
    elif job_id:
        typer.echo(f"run {run_id} submitted as job {job_id}{where}; see `ftslurm status {run_id}`")
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
    return {
        **spec,
        "command": command,
        "setup": setup,
        "code_snapshot": {"path": str(snapshot), "from": str(original)},
    }


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
        raise ConfigError(
            f"cannot copy recipe {recipe} into the run folder: {exc.strerror or exc}"
        ) from None


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
    later = (
        "the daemon will submit it"
        if serving
        else "a daemon will submit it once one runs (`ftslurm daemon start`)"
    )
    return (
        f"interrupted: run {run_id} is recorded and {later}; the interrupt stopped only "
        f"the wait (`ftslurm status {run_id}`, `ftslurm cancel {run_id}`)"
    )


def _name_in_use(store: Store, name: str, chosen: bool) -> str | None:
    """A name an active run has: refused when the user chose it (`--name`: a second run
    under it could not be named by it), else (the recipe's name or its file's) one line to
    warn with; None when no active run has it."""
    holders = [r for r in store.list_runs(active_only=True) if r.name == name]
    if not holders:
        return None
    held = ", ".join(f"{r.run_id} ({r.state.value})" for r in holders)
    if chosen:
        raise ConfigError(
            f"--name {name!r}: active run {held} has that name; give another "
            "--name, or cancel that run first"
        )
    return (
        f"active run {held} is also named {name!r}; name this one with --name to refer "
        "to it by name, or use its run id"
    )


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
    return (
        f"checkpoints go to {where}, under your home directory; give --checkpoint-dir "
        f"or set {' or '.join(f'${n}' for n in SCRATCH_ENVS)} to a scratch space"
    )


# How long `submit` waits for the daemon to submit the run, and `cancel` for a submission
# under way to be recorded (seconds).
SUBMIT_WAIT_S = 60.0
# Test hook: `submit` stops itself (SIGSTOP) right after recording the run when this is set,
# so a test can hold it at the worst moment.
PAUSE_ENV = "FTSLURM_TEST_PAUSE_AFTER_RECORD"


def _pause_for_tests() -> None:
    if os.environ.get(PAUSE_ENV):
        os.kill(os.getpid(), signal.SIGSTOP)


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
            return (
                True,
                None,
                (f"{later} when the scheduler answers ({deferred[-1].data.get('message')})"),
            )
        return False, None, ""

    return _await_daemon(home, later, SUBMIT_WAIT_S, submitted)


# The SlurmdTimeout (s) a shorter wait is suggested from (`mock up --slurmd-timeout`).
SHORT_SLURMD_TIMEOUT_S = 20


def _mock_words(backend: SchedulerBackend, home: str | None) -> tuple[str, dict[str, Any]]:
    """What a dry run's line says of its mock cluster (where it is, and the SlurmdTimeout
    after which it declares a failed node down: a mock that `submit` creates has Slurm's
    300 s), and the same for --json."""
    timeout = backend.cluster_facts().slurmd_timeout_s
    where = str(home or mock_home())
    return (
        f" on the mock cluster in {where} (SlurmdTimeout {timeout} s)",
        {"mock_home": where, "slurmd_timeout_s": timeout},
    )


def _check_injected_nodes(injections: Sequence[Injection], mock: Path) -> None:
    """Refuse (one line) an injection aimed at a node the mock cluster does not have: its
    nodes, or those a new one gets (`MockConfig`), read without creating anything."""
    named = [i for i in injections if i.node is not None]
    if not named:
        return
    if (mock / MOCK_DB_FILE).exists():
        with MockStore(mock).transaction() as state:
            nodes = list(state.nodes)
    else:
        nodes = [n.name for n in MockConfig().nodes]
    unknown = [i.spec() for i in named if i.node not in nodes]
    if unknown:
        raise ConfigError(
            f"{', '.join(unknown)}: the mock cluster in {mock} has no such node",
            hint=f"its nodes: {', '.join(nodes)}; or give an index, e.g. "
            f"{named[0].kind.value}@{named[0].at_s:g}:0",
        )


def _warn_injections(injections: Sequence[Injection], backend: SchedulerBackend) -> None:
    """One line on stderr when a dry run injects a node failure: nothing shows it until the
    mock, like Slurm, declares the node down after its SlurmdTimeout; how to shorten the
    wait only when it is long."""
    fails = [i for i in injections if i.kind is InjectKind.NODE_FAIL]
    if not fails:
        return
    timeout = backend.cluster_facts().slurmd_timeout_s
    shorter = (
        " (for a shorter wait: `ftslurm mock destroy`, then `ftslurm mock up "
        f"--slurmd-timeout {SHORT_SLURMD_TIMEOUT_S}`)"
        if timeout > SHORT_SLURMD_TIMEOUT_S
        else ""
    )
    err.print(
        f"{', '.join(i.spec() for i in fails)}: the mock notices a failed node after its "
        f"SlurmdTimeout ({timeout} s), as Slurm does; until then `ftslurm status` shows "
        f"the node as not responding{shorter}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


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

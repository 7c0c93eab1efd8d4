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
from typing import Any

import typer

from ftslurm.backends import create_backend, mock_home, split_backend_key
from ftslurm.backends.mock.model import MockConfig
from ftslurm.backends.mock.store import DB_FILE as MOCK_DB_FILE
from ftslurm.backends.mock.store import MockStore
from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.cli import submit_options as opts
from ftslurm.cli.common import (
    JsonOpt,
    RunArg,
    _await_daemon,
    _run_or_fail,
    _store,
    err,
)
from ftslurm.cli.submit_options import SubmitOptions
from ftslurm.core.contract import SCRATCH_ENVS, RunDir
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
from ftslurm.recipe import (
    Recipe,
    code_file,
    load_recipe,
    no_limit_warning,
    sbatch_flags,
)


def submit(
    recipe: opts.RecipeArg,
    args: opts.ArgsArg = None,
    retries: opts.RetriesOpt = None,
    in_job_restarts: opts.InJobRestartsOpt = None,
    spare_nodes: opts.SpareNodesOpt = None,
    live_recovery: opts.LiveRecoveryOpt = False,
    preempt_time: opts.PreemptTimeOpt = None,
    nodes: opts.NodesOpt = None,
    ntasks_per_node: opts.NtasksPerNodeOpt = None,
    ntasks: opts.NtasksOpt = None,
    gpus_per_node: opts.GpusPerNodeOpt = None,
    cpus_per_task: opts.CpusPerTaskOpt = None,
    time_limit: opts.TimeLimitOpt = None,
    partition: opts.PartitionOpt = None,
    account: opts.AccountOpt = None,
    exclude: opts.ExcludeOpt = None,
    name: opts.NameOpt = None,
    mem: opts.MemOpt = None,
    mem_per_cpu: opts.MemPerCpuOpt = None,
    gres: opts.GresOpt = None,
    gpus: opts.GpusOpt = None,
    constraint: opts.ConstraintOpt = None,
    qos: opts.QosOpt = None,
    dependency: opts.DependencyOpt = None,
    mail_type: opts.MailTypeOpt = None,
    mail_user: opts.MailUserOpt = None,
    nodelist: opts.NodelistOpt = None,
    exclusive: opts.ExclusiveOpt = False,
    reservation: opts.ReservationOpt = None,
    wckey: opts.WckeyOpt = None,
    sbatch_arg: opts.SbatchArgOpt = None,
    output: opts.OutputOpt = None,
    array: opts.ArrayOpt = None,
    checkpoint_dir: opts.CheckpointDirOpt = None,
    dry_run: opts.DryRunOpt = False,
    inject: opts.InjectOpt = None,
    print_script: opts.PrintScriptOpt = False,
    snapshot_code: opts.SnapshotCodeOpt = True,
    as_json: JsonOpt = False,
) -> None:
    """Submit a training run; the daemon then owns it until it ends."""
    # (first: the parameters are the only names defined yet)
    _submit(SubmitOptions(**locals()))


def _submit(o: SubmitOptions) -> None:
    """`ftslurm submit`: checked whole before anything is written (an error stays the only
    line), then recorded for the daemon, which submits it."""
    loaded = _recipe_with_options(o)
    # Printed once everything is validated (an error then stays the only line).
    warning = no_limit_warning(loaded.time) if loaded.time_limit_s() is None else None
    injections = parse_injections(tuple(o.inject or ()))
    cluster_side = [i.kind.value for i in injections if not i.kind.in_job]
    if cluster_side and not o.dry_run:
        raise ConfigError(
            f"{', '.join(cluster_side)} can only be injected with --dry-run (the mock scheduler)"
        )
    if o.dry_run:
        _check_injected_nodes(injections, mock_home())
    home = state_dir()
    run_id = uuid.uuid4().hex[:10]
    run_dir = home / RUNS_DIR / run_id
    settings = loaded.settings()
    spec = make_spec(
        loaded,
        run_dir=run_dir,
        backend="mock" if o.dry_run else "slurm",
        workdir=str(Path.cwd()),
        inject=tuple(i.spec() for i in injections),
        mock_home=mock_home() if o.dry_run else None,
        environ=os.environ,
    )
    code = code_file(o.recipe, loaded)  # the recipe file, or torchrun's script
    snapshot = RunDir(run_dir).root / CODE_DIR / code.name if o.snapshot_code else None
    if snapshot is not None:
        spec = snapshot_spec(spec, code.resolve(), snapshot)
    torchrun = loaded.torchrun()
    warnings = [
        w
        for w in (
            warning if settings.preempt_time else None,
            _checkpoints_at_home(spec),
            torchrun.ignored_note() if torchrun else None,
        )
        if w
    ]
    script, _ = build_attempt(run_id, spec, settings.model_dump(mode="json"), 0, ())
    if o.print_script:
        _say_warnings(warnings)
        typer.echo(script, nl=False)
        return
    store = Store(home)
    store.check_integrity()  # a damaged database is refused before anything is submitted
    run_name = loaded.name or code.name
    name_warning = _name_in_use(store, run_name, chosen=o.name is not None)
    _say_warnings([*warnings, *([name_warning] if name_warning else [])])
    _record(o, store, home, run_id, run_name, spec, settings, snapshot)
    if o.dry_run:
        _warn_injections(injections, create_backend("mock", spec["mock_home"]))
    _pause_for_tests()
    _say_submitted(o, spec, run_id, *_await_submission(store, home, run_id))


def _say_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        typer.echo(f"Warning: {warning}", err=True)


def _recipe_with_options(o: SubmitOptions) -> Recipe:
    """The recipe file loaded, with the command line's options over its own values."""
    if o.output is not None:
        raise ConfigError(f"-o/-e: {OWNED_SBATCH_FLAGS['output']}")
    if o.array is not None:
        raise ConfigError(f"--array: {OWNED_SBATCH_FLAGS['array']}")
    preempt_s = None
    if o.preempt_time is not None:
        try:
            preempt_s = math.ceil(parse_duration(o.preempt_time))
        except ConfigError as exc:
            raise ConfigError(f"--preempt-time: {exc.user_message()}") from None
    loaded = load_recipe(o.recipe, list(o.args or ()))
    code = code_file(o.recipe, loaded)  # the recipe file, or torchrun's script
    runs_itself = loaded.job_command()[:1] == [str(code.resolve())]
    if (
        not o.snapshot_code
        and runs_itself
        and code.suffix != ".py"
        and not os.access(code, os.X_OK)
    ):
        raise ConfigError(
            f"recipe {code} is not executable and not a Python file (.py): "
            f"`chmod +x {code}`, or keep --snapshot-code (the copy is made "
            "executable)"
        )
    # Each --sbatch-arg is one word of sbatch's command line: `--k=v`, `--k`, `-kv`, or
    # a flag and its value in two (`--sbatch-arg=-q --sbatch-arg=high`).
    from_args = sbatch_flags(list(o.sbatch_arg or ()), "--sbatch-arg")
    flags = {
        "mem": o.mem,
        "mem-per-cpu": o.mem_per_cpu,
        "gres": o.gres,
        "gpus": o.gpus,
        "constraint": o.constraint,
        "qos": o.qos,
        "dependency": o.dependency,
        "mail-type": o.mail_type,
        "mail-user": o.mail_user,
        "nodelist": o.nodelist,
        "ntasks": None if o.ntasks is None else str(o.ntasks),
        "reservation": o.reservation,
        "wckey": o.wckey,
    }
    sbatch_extra = {
        **loaded.sbatch_extra,
        **from_args.pop("sbatch_extra", {}),
        **{k: v for k, v in flags.items() if v is not None},
        **({"exclusive": None} if o.exclusive else {}),
    }
    given = dict(
        num_job_retries_on_failure=o.retries,
        num_in_job_restarts=o.in_job_restarts,
        spare_nodes=o.spare_nodes,
        live_recovery=True if o.live_recovery else None,  # else the recipe's
        preempt_time=preempt_s,
        nodes=o.nodes,
        ntasks_per_node=o.ntasks_per_node,
        gpus_per_node=o.gpus_per_node,
        cpus_per_task=o.cpus_per_task,
        time=o.time_limit,
        partition=o.partition,
        account=o.account,
        exclude=tuple(n for n in o.exclude.split(",") if n) if o.exclude is not None else None,
        name=o.name,
        checkpoint_dir=o.checkpoint_dir,
        sbatch_extra=sbatch_extra,
    )
    return loaded.with_overrides(
        **{**from_args, **{k: v for k, v in given.items() if v is not None}}
    )


def _record(
    o: SubmitOptions,
    store: Store,
    home: Path,
    run_id: str,
    run_name: str,
    spec: dict[str, Any],
    settings: FtSettings,
    snapshot: Path | None,
) -> None:
    """The run and its submission intent, in one transaction: the daemon submits it."""
    _SUBMITTING.update(home=home, run_id=run_id)  # an interrupt from here on says more
    run_dir = Path(spec["run_dir"])
    private_dir(run_dir)
    RunDir(run_dir).logs.mkdir(exist_ok=True)
    if spec.get("code_snapshot"):
        take_snapshot(Path(spec["code_snapshot"]["from"]), snapshot)  # type: ignore[arg-type]
    run, attempt = new_run_record(run_id, run_name, spec, settings, time.time())
    with store.transaction():
        _name_in_use(store, run_name, chosen=o.name is not None)  # again, with the write lock
        store.add_run(run)
        store.add_attempt(attempt)
        store.append_event(run_id, "created", {"recipe": str(o.recipe)}, time.time())
    # Beside the database: the run (rebuilt from it if the database loses it) and where its
    # jobs live (looked at for jobs without a run).
    mirror_run(run)
    mark_backend(home, backend_key(spec))


def _say_submitted(
    o: SubmitOptions, spec: dict[str, Any], run_id: str, job_id: str | None, note: str
) -> None:
    where, facts = "", {}
    if o.dry_run:  # which mock, and how long a failed node goes unnoticed there
        where, facts = _mock_words(create_backend("mock", spec["mock_home"]), spec["mock_home"])
    if o.as_json:
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
            create_backend(*split_backend_key(backend_key(run.spec))).cancel(latest.job_id)
        except (SchedulerUnavailable, JobStateConflict, InvalidJobId):
            pass  # ended already, or the daemon cancels it when the scheduler answers
    typer.echo(f"run {run_id}: cancel requested")

"""The options of `ftslurm submit`: one annotated type per option (its flags, its help,
its `--help` panel) and `SubmitOptions`, every option's value in one frozen record."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from ftslurm.cli.common import _opt, _Text
from ftslurm.core.contract import SCRATCH_ENVS, EnvName
from ftslurm.core.settings import FtSettings


def _default(setting: str, unit: str = "") -> str:
    """The default of a fault-tolerance setting, for a help text (FtSettings holds it)."""
    value = FtSettings.model_fields[setting].default
    return f"(default: the recipe's {setting}, else {value}{unit})"


_SBATCH = "Passed to sbatch as is"
_RECIPE = "(default: the recipe's, else Slurm's)"


# The panels of `submit --help`, by option (the rest, --json and --help: Options).
SUBMIT_PANELS = {
    "Retries and recovery": ("--retries", "--in-job-restarts", "--spare-nodes", "--live-recovery"),
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


RecipeArg = Annotated[
    Path,
    typer.Argument(
        help="A training script or a recipe file; or `torchrun`, with torchrun's "
        "arguments after `--` (ftslurm's launcher runs the script in its place)."
    ),
]
ArgsArg = Annotated[list[str] | None, typer.Argument(help="Arguments after `--`.")]
RetriesOpt = Annotated[
    int | None,
    _opt(
        "--retries",
        help="Job resubmissions after a failure "
        f"(num_job_retries_on_failure). {_default('num_job_retries_on_failure')}",
    ),
]
InJobRestartsOpt = Annotated[
    int | None,
    _opt(
        "--in-job-restarts",
        help=f"Rank restarts inside one job, per attempt. {_default('num_in_job_restarts')}",
    ),
]
SpareNodesOpt = Annotated[
    int | None,
    _opt(
        "--spare-nodes",
        help="Idle nodes to ask for "
        "beside --nodes (N+K nodes, --no-kill): a lost node is replaced by "
        "one inside the same job, from the last checkpoint. "
        f"{_default('spare_nodes')}",
    ),
]
LiveRecoveryOpt = Annotated[
    bool,
    _opt(
        "--live-recovery",
        help="Keep the spares' ranks started and waiting: a lost or stepped-out node's "
        "ranks are taken over by them while the other ranks keep running (the script "
        "uses ftslurm.agent.live); each node keeps a warm standby process that takes a "
        "crashed rank's place. (default: the recipe's, else off)",
    ),
]
PreemptTimeOpt = Annotated[
    _Text,
    _opt(
        "--preempt-time",
        help="How long before the time "
        "limit to ask for a checkpoint: 90, 90s, 5m, 1h (plain numbers are "
        f"seconds; 0: never). {_default('preempt_time', ' s')}",
    ),
]
NodesOpt = Annotated[
    int | None, _opt("-N", "--nodes", help="Nodes. (default: the recipe's, else 1)")
]
NtasksPerNodeOpt = Annotated[
    int | None,
    _opt(
        "--ntasks-per-node",
        help="Ranks per node. "
        "(default: the recipe's, else --gpus-per-node, else --ntasks / "
        "--nodes, else 1)",
    ),
]
NtasksOpt = Annotated[
    int | None,
    _opt(
        "-n",
        "--ntasks",
        help="Ranks in all: a multiple of "
        f"--nodes (ftslurm starts as many on each node). {_RECIPE}",
    ),
]
GpusPerNodeOpt = Annotated[
    int | None,
    _opt(
        "--gpus-per-node",
        help=f"GPUs per node; also the ranks per node unless --ntasks-per-node is given. {_RECIPE}",
    ),
]
CpusPerTaskOpt = Annotated[
    int | None, _opt("-c", "--cpus-per-task", help=f"CPUs per rank. {_RECIPE}")
]
TimeLimitOpt = Annotated[
    _Text,
    _opt(
        "-t",
        "--time",
        help="Wall time limit of each attempt, "
        "in sbatch's forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
        "D-HH:MM:SS; UNLIMITED, infinite or 0 for no limit. "
        "(default: the recipe's, else the partition's)",
    ),
]
PartitionOpt = Annotated[_Text, _opt("-p", "--partition", help=f"Partition. {_RECIPE}")]
AccountOpt = Annotated[_Text, _opt("-A", "--account", help=f"Account. {_RECIPE}")]
ExcludeOpt = Annotated[
    _Text,
    _opt(
        "-x",
        "--exclude",
        help="Nodes never to use, "
        "comma-separated (ftslurm adds the nodes it flags). (default: none)",
    ),
]
NameOpt = Annotated[
    _Text,
    _opt(
        "-J",
        "--job-name",
        "--name",
        help="The run's name (and its "
        "jobs'): commands take it for the run id; refused while an active run "
        "has it. (default: the recipe's, else the recipe file's name)",
    ),
]
MemOpt = Annotated[
    _Text,
    _opt("--mem", help=f"Memory per node, e.g. 64G (unit: M if none). {_SBATCH}. {_RECIPE}"),
]
MemPerCpuOpt = Annotated[
    _Text,
    _opt("--mem-per-cpu", help=f"Memory per CPU, e.g. 4G (unit: M if none). {_SBATCH}. {_RECIPE}"),
]
GresOpt = Annotated[
    _Text, _opt("--gres", help=f"Generic resources per node, e.g. gpu:8. {_SBATCH}. {_RECIPE}")
]
GpusOpt = Annotated[
    _Text, _opt("-G", "--gpus", help=f"GPUs in all, e.g. 16 or a100:16. {_SBATCH}. {_RECIPE}")
]
ConstraintOpt = Annotated[
    _Text,
    _opt("-C", "--constraint", help=f"Node features, e.g. 'a100&ib'. {_SBATCH}. {_RECIPE}"),
]
QosOpt = Annotated[_Text, _opt("-q", "--qos", help=f"Quality of service. {_SBATCH}. {_RECIPE}")]
DependencyOpt = Annotated[
    _Text,
    _opt(
        "-d",
        "--dependency",
        help="Start after other jobs, e.g. "
        f"afterok:123 (first attempt and retries alike). {_SBATCH}. "
        f"{_RECIPE}",
    ),
]
MailTypeOpt = Annotated[_Text, _opt("--mail-type", help=f"e.g. END,FAIL. {_SBATCH}. {_RECIPE}")]
MailUserOpt = Annotated[_Text, _opt("--mail-user", help=f"Mail address. {_SBATCH}. {_RECIPE}")]
NodelistOpt = Annotated[
    _Text,
    _opt("-w", "--nodelist", help=f"Nodes to run on, comma-separated. {_SBATCH}. {_RECIPE}"),
]
ExclusiveOpt = Annotated[
    bool,
    _opt(
        "--exclusive",
        help="Whole nodes, shared with no other job. (default: off, or the recipe's)",
    ),
]
ReservationOpt = Annotated[_Text, _opt("--reservation", help=f"Reservation. {_SBATCH}. {_RECIPE}")]
WckeyOpt = Annotated[
    _Text, _opt("--wckey", help=f"Workload characterization key. {_SBATCH}. {_RECIPE}")
]
SbatchArgOpt = Annotated[
    list[str] | None,
    _opt(
        "--sbatch-arg",
        help="Any other sbatch flag, "
        "e.g. --sbatch-arg=--begin=now+1hour; repeatable. Flags ftslurm sets "
        "itself are refused. (default: none)",
    ),
]
OutputOpt = Annotated[
    _Text,
    _opt(
        "-o",
        "--output",
        "-e",
        "--error",
        hidden=True,
        help="Refused: ftslurm owns the job's output file.",
    ),
]
ArrayOpt = Annotated[
    _Text, _opt("-a", "--array", hidden=True, help="Refused: one run is one job per attempt.")
]
CheckpointDirOpt = Annotated[
    _Text,
    _opt(
        "--checkpoint-dir",
        help="Where the run keeps its "
        f"checkpoints ({EnvName.CHECKPOINT_DIR.value}), relative to the "
        "current folder. (default: the recipe's, else "
        f"${SCRATCH_ENVS[0]} or ${SCRATCH_ENVS[1]}/ftslurm/RUN/checkpoints, "
        "else RUN_DIR/checkpoints)",
    ),
]
DryRunOpt = Annotated[
    bool,
    _opt("--dry-run", help="Run against the mock scheduler (laptop rehearsal). (default: off)"),
]
InjectOpt = Annotated[
    list[str] | None,
    _opt(
        "--inject",
        help="KIND@TIME[:TARGET], TIME in "
        "seconds or 90s, 5m, 2h; repeatable (docs/fault-injection.md). "
        "(default: none)",
    ),
]
PrintScriptOpt = Annotated[
    bool,
    _opt(
        "--print-script",
        help="Print the sbatch script of the first attempt; submit nothing. (default: off)",
    ),
]
SnapshotCodeOpt = Annotated[
    bool,
    _opt(
        "--snapshot-code/--no-snapshot-code",
        help="Copy the "
        "recipe file into the run folder at submit, so every attempt "
        "runs what was submitted; --no-snapshot-code runs the file as it "
        "is at each attempt (to pick up fixes on purpose). Only the recipe "
        "file is copied, not its folder. (default: on)",
    ),
]


def put_in_panels(command: Any, panels: dict[str, tuple[str, ...]]) -> None:
    """Set the `--help` panel of each option of the click `command` named in `panels`."""
    panel_of = {name: panel for panel, names in panels.items() for name in names}
    for param in command.params:
        panel = next((panel_of[n] for n in getattr(param, "opts", ()) if n in panel_of), None)
        if panel is not None:
            param.rich_help_panel = panel


@dataclass(frozen=True)
class SubmitOptions:
    """What `ftslurm submit` was given, by parameter name."""

    recipe: Path
    args: list[str] | None
    retries: int | None
    in_job_restarts: int | None
    spare_nodes: int | None
    live_recovery: bool
    preempt_time: str | None
    nodes: int | None
    ntasks_per_node: int | None
    ntasks: int | None
    gpus_per_node: int | None
    cpus_per_task: int | None
    time_limit: str | None
    partition: str | None
    account: str | None
    exclude: str | None
    name: str | None
    mem: str | None
    mem_per_cpu: str | None
    gres: str | None
    gpus: str | None
    constraint: str | None
    qos: str | None
    dependency: str | None
    mail_type: str | None
    mail_user: str | None
    nodelist: str | None
    exclusive: bool
    reservation: str | None
    wckey: str | None
    sbatch_arg: list[str] | None
    output: str | None
    array: str | None
    checkpoint_dir: str | None
    dry_run: bool
    inject: list[str] | None
    print_script: bool
    snapshot_code: bool
    as_json: bool

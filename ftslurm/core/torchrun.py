"""A `torchrun ...` command, read as ftslurm's launcher runs it (pure).

A run whose command is `torchrun [OPTIONS] SCRIPT [ARGS]` (or `python -m
torch.distributed.run ...`) is not run through torchrun: ftslurm's launcher takes its
place, with the same shape. torchrun starts its workers in sessions of their own and turns
a signal it handles into "stop the workers", so the checkpoint signal never reaches a
script under it as a request to checkpoint and go on (PyTorch #154849); ftslurm's launcher
is itself a torch elastic agent that gives the ranks torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) and forwards the checkpoint signal to them. So
`--nnodes` becomes the job's nodes, `--nproc-per-node` its ranks per node,
`--max-restarts` its in-job restarts, the script the command each rank runs; the
rendezvous, logging and process options torchrun needs to find its peers are ftslurm's
own inside a job and ignored; the rest is refused in one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from ftslurm.errors import ConfigError


class Mode(Enum):
    """How torchrun runs the script: `python -u SCRIPT` (also `--run-path`), `python -u -m
    MODULE` (`-m`), or the program itself (`--no-python`)."""

    PYTHON = "python"
    MODULE = "module"
    PROGRAM = "program"


# Options whose value ftslurm takes over: the job's shape.
MAPPED = ("--nnodes", "--nproc-per-node", "--max-restarts")
# Options that describe what ftslurm's launcher does its own way inside a job: the
# rendezvous (the launchers meet in the run directory), the workers' start, signals and
# shutdown (the launcher's grace), where the ranks' output goes (the run's log).
IGNORED_WITH_VALUE = frozenset(
    {
        "--rdzv-backend",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--rdzv-conf",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--local-addr",
        "--monitor-interval",
        "--start-method",
        "--role",
        "--event-log-handler",
        "--signals-to-handle",
        "--shutdown-timeout",
        "--log-dir",
        "--redirects",
        "--tee",
        "--local-ranks-filter",
        "--duplicate-stdout-filters",
        "--duplicate-stderr-filters",
        "--logs-specs",
    }
)
IGNORED_FLAGS = frozenset({"--standalone"})
MODE_FLAGS = {"--module": Mode.MODULE, "--no-python": Mode.PROGRAM, "--run-path": Mode.PYTHON}
# Options that change what the script sees in a way ftslurm's launcher does not.
REFUSED = {
    "--numa-binding": "ftslurm's launcher does not bind ranks to NUMA nodes",
    "--virtual-local-rank": "ftslurm's launcher gives each rank its own LOCAL_RANK",
}
SHORT = {"-m": "--module", "-r": "--redirects", "-t": "--tee"}
# --nproc-per-node values that mean one rank per GPU of the node.
PER_GPU = ("gpu", "auto")
# Interpreter options that may stand before `-m torch.distributed.run`.
_PYTHON_FLAGS = frozenset({"-u", "-B", "-O", "-OO", "-E", "-s", "-S", "-I", "-P"})
_PYTHON = re.compile(r"python[0-9.]*\Z")
RUN_MODULE = "torch.distributed.run"
TORCHRUN = "torchrun"  # the program's name


@dataclass(frozen=True)
class Torchrun:
    """What a torchrun command line asks for. `nproc_per_node` is a number or "gpu" (one
    rank per GPU: torchrun's `gpu` and `auto`); None where the option was not given."""

    script: tuple[str, ...]  # the training script (or module, or program) and its arguments
    mode: Mode = Mode.PYTHON
    nnodes: int | None = None
    nproc_per_node: int | str | None = None
    max_restarts: int | None = None
    ignored: tuple[str, ...] = ()  # the options given that ftslurm does its own way
    # The interpreter of `PYTHON -m torch.distributed.run`, which torchrun would start its
    # workers with; None for `torchrun` (the caller's).
    python: str | None = None

    def command(self, python: str) -> list[str]:
        """What each rank runs, as torchrun would start it (`python -u`: unbuffered), with
        the command's own interpreter, else `python`."""
        python = self.python or python
        if self.mode is Mode.PROGRAM:
            return list(self.script)
        if self.mode is Mode.MODULE:
            return [python, "-u", "-m", *self.script]
        return [python, "-u", *self.script]

    def ignored_note(self) -> str | None:
        """One line on the options given that ftslurm's launcher does its own way."""
        if not self.ignored:
            return None
        return (
            f"torchrun {', '.join(self.ignored)}: ignored; ftslurm's launcher runs the "
            "script in torchrun's place, meets the other nodes in the run directory and "
            "writes the ranks' output to the run's log"
        )


def torchrun_args(command: list[str] | tuple[str, ...] | None) -> list[str] | None:
    """torchrun's own arguments when `command` runs torchrun (`torchrun ...`, a path to
    it, or `python [-u ...] -m torch.distributed.run ...`), else None."""
    if not command:
        return None
    first = _program(command)
    if first == TORCHRUN:
        return list(command[1:])
    if not _PYTHON.match(first):
        return None
    i = 1
    while i < len(command) and command[i] in _PYTHON_FLAGS:
        i += 1
    rest = list(command[i:])
    if rest[:2] == ["-m", RUN_MODULE]:
        return rest[2:]
    if rest[:1] == [f"-m{RUN_MODULE}"]:
        return rest[1:]
    return None


def _program(command: list[str] | tuple[str, ...]) -> str:
    return command[0].rsplit("/", 1)[-1]


def parse_torchrun(command: list[str] | tuple[str, ...] | None) -> Torchrun | None:
    """The torchrun command `command` is, or None when it does not run torchrun; a
    one-line ConfigError for an option ftslurm cannot honour or a malformed one."""
    args = torchrun_args(command)
    if args is None:
        return None
    values: dict[str, str] = {}
    ignored: list[str] = []
    mode = Mode.PYTHON
    run_path = False
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":  # the script follows
            i += 1
            break
        if not word.startswith("-") or word == "-":
            break
        name, value = _option(word)
        if name in REFUSED:
            raise ConfigError(f"torchrun {name}: {REFUSED[name]}", hint="drop it from the command")
        if name in IGNORED_FLAGS or name in MODE_FLAGS:
            if value is not None:
                raise ConfigError(f"torchrun {name} takes no value ({word!r})")
            if name in IGNORED_FLAGS:
                ignored.append(name)
            elif name == "--run-path":  # torchrun: takes precedence over --no-python
                run_path = True
            else:
                mode = MODE_FLAGS[name]
            i += 1
            continue
        if name not in MAPPED and name not in IGNORED_WITH_VALUE:
            raise ConfigError(f"torchrun option {word!r} is not one ftslurm knows", hint=_SPELL)
        if value is None:
            if i + 1 >= len(args):
                raise ConfigError(f"torchrun {name} needs a value")
            i, value = i + 1, args[i + 1]
        if name in MAPPED:
            values[name] = value
        else:
            ignored.append(name)
        i += 1
    script = tuple(args[i:])
    if not script:
        raise ConfigError(
            f"torchrun {' '.join(args)}: no training script",
            hint="give it after torchrun's options, e.g. torchrun --nproc-per-node 2 train.py",
        )
    return Torchrun(
        script=script,
        mode=Mode.PYTHON if run_path else mode,
        nnodes=_nnodes(values["--nnodes"]) if "--nnodes" in values else None,
        nproc_per_node=_nproc(values["--nproc-per-node"]) if "--nproc-per-node" in values else None,
        max_restarts=_count("--max-restarts", values["--max-restarts"], 0)
        if "--max-restarts" in values
        else None,
        ignored=tuple(dict.fromkeys(ignored)),
        python=None if _program(command) == TORCHRUN else command[0],  # type: ignore[index]
    )


_SPELL = (
    "spell torchrun's options in full; ftslurm reads --nnodes, --nproc-per-node, "
    "--max-restarts, -m, --no-python, --run-path and ignores the rendezvous, logging and "
    "process options"
)


def _option(word: str) -> tuple[str, str | None]:
    """An option's name in torchrun's dashed spelling, and the value it carries inline
    (`--name=value`, `-r3`), if any."""
    if word.startswith("--"):
        name, eq, value = word[2:].partition("=")
        return "--" + name.replace("_", "-"), value if eq else None
    short = SHORT.get(word[:2])
    if short is None:
        raise ConfigError(
            f"torchrun option {word!r} is not one ftslurm knows",
            hint=_SPELL,
        )
    rest = word[2:].removeprefix("=")
    return short, rest or None


def _count(what: str, text: str, least: int) -> int:
    if not text.isdigit() or int(text) < least:
        above = "0 or more" if least == 0 else f"{least} or more"
        raise ConfigError(f"torchrun {what} {text!r}: give a whole number, {above}")
    return int(text)


def _nnodes(text: str) -> int:
    """`N` or `N:N`; an elastic range (`1:4`) is refused: a job has its nodes."""
    low, colon, high = text.partition(":")
    n = _count("--nnodes", low, 1)
    if colon and _count("--nnodes", high, 1) != n:
        raise ConfigError(
            f"torchrun --nnodes {text}: an elastic range; an ftslurm job runs on a fixed "
            "number of nodes (a lost node is replaced: --retries, --spare-nodes)",
            hint="give one number, e.g. --nnodes " + high,
        )
    return n


def _nproc(text: str) -> int | str:
    if text in PER_GPU:
        return "gpu"
    if text.isdigit():
        return _count("--nproc-per-node", text, 1)
    raise ConfigError(
        f"torchrun --nproc-per-node {text!r}: ftslurm starts a number of ranks per node, "
        "or one per GPU (gpu, auto)",
        hint="give a number, e.g. --nproc-per-node 2",
    )

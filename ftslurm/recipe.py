"""Recipes: what `ftslurm submit RECIPE` runs, with which resources and settings.

A recipe file is either
  (a) a plain training script, run unmodified as `python RECIPE ARGS` on every rank, with
      resources from `#SBATCH` lines in its header (an existing torchrun script works), or
  (b) a Python file that defines `recipe = ftslurm.Recipe(...)` at top level. Its command
      defaults to running the file itself; keep the training under
      `if __name__ == "__main__":`, since the file is imported on the login node to read it.
Command-line options override the recipe's values (`with_overrides`).
"""

from __future__ import annotations

import ast
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from ftslurm.core.settings import FtSettings
from ftslurm.core.timefmt import parse_time_limit
from ftslurm.core.torchrun import TORCHRUN, Mode, Torchrun, parse_torchrun
from ftslurm.core.validate import (
    OWNED_SBATCH_FLAGS,
    SBATCH_SHORT,
    SBATCH_SHORT_NO_VALUE,
    check_command,
    check_env,
    check_line,
    check_sbatch_flag,
)
from ftslurm.errors import ConfigError


class Recipe(FtSettings):
    """Resources, the command and the fault-tolerance settings of a training run."""

    command: list[str] | None = None  # default: python <the recipe file> ARGS
    name: str | None = Field(None, min_length=1)
    nodes: int = Field(1, ge=1)
    # Ranks per node; default: --gpus-per-node when given (one rank per GPU, as torchrun's
    # --nproc-per-node), else --ntasks over the nodes, else 1. See `ranks_per_node`.
    ntasks_per_node: int | None = Field(None, ge=1)
    gpus_per_node: int | None = Field(None, ge=0)
    cpus_per_task: int | None = Field(None, ge=1)
    time: str | None = None  # Slurm syntax: "30", "1:00:00", "1-00:00:00", "UNLIMITED"
    partition: str | None = Field(None, min_length=1)
    account: str | None = Field(None, min_length=1)
    exclude: tuple[str, ...] = ()
    checkpoint_dir: str | None = Field(None, min_length=1)
    setup: tuple[str, ...] = ()  # shell lines run in the batch script before the step
    env: dict[str, str] = Field(default_factory=dict)
    sbatch_extra: dict[str, str | None] = Field(default_factory=dict)  # other sbatch flags

    @model_validator(mode="before")
    @classmethod
    def _torchrun_shape(cls, data: Any) -> Any:
        """A `torchrun ...` command gives the job its shape where the recipe does not:
        `--nnodes` its nodes, a number of `--nproc-per-node` its ranks per node,
        `--max-restarts` its in-job restarts (`ftslurm.core.torchrun`). Where both give
        one, they must agree (`_safe_and_consistent`)."""
        command = data.get("command") if isinstance(data, dict) else None
        if not isinstance(command, list | tuple) or not all(isinstance(w, str) for w in command):
            return data  # no command, or not one: pydantic says so
        torchrun = parse_torchrun(command)
        if torchrun is None:
            return data
        given = {
            "nodes": torchrun.nnodes,
            "ntasks_per_node": torchrun.nproc_per_node
            if isinstance(torchrun.nproc_per_node, int)
            else None,
            "num_in_job_restarts": torchrun.max_restarts,
        }
        return {**{k: v for k, v in given.items() if v is not None}, **data}

    @model_validator(mode="after")
    def _safe_and_consistent(self) -> Recipe:
        """Every value that reaches the batch script, and the settings that would silently
        do nothing; one-line ConfigErrors (pydantic passes them through unchanged)."""
        for what, value in (
            ("--job-name", self.name),
            ("--partition", self.partition),
            ("--account", self.account),
            ("--time", self.time),
            ("--checkpoint-dir", self.checkpoint_dir),
        ):
            check_line(what, value)
        for node in self.exclude:
            check_line("--exclude", node)
        for key, value in self.sbatch_extra.items():
            check_sbatch_flag(key, value)
        check_env(self.env)
        check_command(self.command or ())
        limit = self.time_limit_s()
        if limit is not None and self.preempt_time and self.preempt_time >= limit:
            raise ConfigError(
                f"--preempt-time {self.preempt_time}s is not shorter than the time limit "
                f"{self.time} ({limit}s): the checkpoint signal would be due when the job "
                "starts and be lost",
                hint="shorten --preempt-time or lengthen -t",
            )
        self.ranks_per_node()
        self._check_torchrun()
        if self.spare_nodes and not self.use_launcher:
            raise ConfigError(
                f"--spare-nodes {self.spare_nodes} needs the launcher (use_launcher=True): it "
                "is the launchers that move the training onto a spare",
                hint="drop --spare-nodes or turn use_launcher back on",
            )
        if self.live_recovery and not self.use_launcher:
            raise ConfigError(
                "--live-recovery needs the launcher (use_launcher=True): it is the "
                "launchers that keep the spares' ranks warm and restart a rank alone",
                hint="drop --live-recovery or turn use_launcher back on",
            )
        return self

    def torchrun(self) -> Torchrun | None:
        """The torchrun command this recipe runs, if it runs torchrun."""
        return parse_torchrun(self.command)

    def job_command(self) -> list[str]:
        """What each rank runs: the command, or for a `torchrun ...` command the script as
        torchrun would start it on each of its workers (ftslurm's launcher takes
        torchrun's place)."""
        torchrun = self.torchrun()
        if torchrun is None:
            return list(self.command or [])
        return torchrun.command(sys.executable)

    def _check_torchrun(self) -> None:
        """A torchrun command and the recipe or command line say the same of the job."""
        torchrun = self.torchrun()
        if torchrun is None:
            return
        if torchrun.nnodes is not None and torchrun.nnodes != self.nodes:
            raise ConfigError(
                f"torchrun --nnodes {torchrun.nnodes}, but the job has {self.nodes} "
                "node(s) (--nodes): ftslurm runs torchrun's script on the job's nodes",
                hint="give the same number to both, or drop one",
            )
        per_node = self.ranks_per_node()
        if torchrun.nproc_per_node == "gpu":
            if not self.gpus_per_node:
                raise ConfigError(
                    "torchrun --nproc-per-node gpu/auto: ftslurm starts one rank per GPU "
                    "of the job, and the job asks for none",
                    hint="give --gpus-per-node N, or a number to --nproc-per-node",
                )
            wanted = self.gpus_per_node
        else:
            wanted = torchrun.nproc_per_node
        if wanted is not None and wanted != per_node:
            raise ConfigError(
                f"torchrun starts {wanted} rank(s) per node (--nproc-per-node), but the job "
                f"has {per_node} (--ntasks-per-node, --ntasks or --gpus-per-node)",
                hint="give the same number to both, or drop one",
            )
        if torchrun.max_restarts is not None and torchrun.max_restarts != self.num_in_job_restarts:
            raise ConfigError(
                f"torchrun --max-restarts {torchrun.max_restarts}, but the run has "
                f"{self.num_in_job_restarts} in-job restart(s) (--in-job-restarts)",
                hint="give the same number to both, or drop one",
            )

    def settings(self) -> FtSettings:
        return FtSettings(**{k: getattr(self, k) for k in FtSettings.model_fields})

    def with_overrides(self, **overrides: Any) -> Recipe:
        """A copy with the given (non-None) values replaced, validated again."""
        data = self.model_dump()
        data.update({k: v for k, v in overrides.items() if v is not None})
        return _validated(data, "command-line options")

    def time_limit_s(self) -> int | None:
        return None if self.time is None else parse_time_limit(self.time)

    def ranks_per_node(self) -> int:
        """How many ranks the launcher starts on each node."""
        ntasks_text = self.sbatch_extra.get("ntasks")
        ntasks = None
        if ntasks_text is not None:
            if not str(ntasks_text).isdigit() or int(ntasks_text) < 1:
                raise ConfigError(f"--ntasks {ntasks_text!r} must be a whole number above 0")
            ntasks = int(ntasks_text)
        per_node = self.ntasks_per_node
        if per_node is None and ntasks is not None:
            if ntasks % self.nodes:
                raise ConfigError(
                    f"--ntasks {ntasks} over {self.nodes} nodes: ftslurm starts the same "
                    "number of ranks on every node",
                    hint="give a multiple of --nodes",
                )
            per_node = ntasks // self.nodes
        if per_node is None:
            per_node = self.gpus_per_node or 1
        if ntasks is not None and ntasks != per_node * self.nodes:
            raise ConfigError(
                f"--ntasks {ntasks} is not --nodes {self.nodes} times "
                f"--ntasks-per-node {per_node}: ftslurm starts that many ranks"
            )
        return per_node


def no_limit_warning(time: str | None) -> str:
    """What a run without a finite time limit should know about its checkpoint signal."""
    given = f"-t {time}" if time is not None else "no -t"
    return (
        f"{given}: the job runs under the partition's time limit; the daemon sends the "
        "checkpoint signal only if that limit is finite, and Slurm's own --signal "
        "backstop is not set, so a checkpoint before the limit is not guaranteed"
    )


def _validated(data: dict[str, Any], where: str) -> Recipe:
    try:
        return Recipe(**data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "recipe"
        raise ConfigError(f"{where}: {loc}: {first['msg']}") from None


def defines_recipe(source: str) -> bool:
    """Whether a Python file assigns `recipe = ...` at top level (form b)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return any(
        isinstance(node, ast.Assign | ast.AnnAssign)
        and any(
            isinstance(t, ast.Name) and t.id == "recipe"
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
        for node in tree.body
    )


# The largest recipe file read: a training script or a recipe, never data. Checked before
# reading, so that a wrong path to a huge file is refused at once, not read into memory.
MAX_RECIPE_BYTES = 16 * 1024 * 1024


def _read_source(path: Path) -> str:
    if path.is_dir():
        raise ConfigError(f"recipe {path} is a directory; give a training script or a recipe file")
    if not path.is_file():
        raise ConfigError(f"recipe not found: {path}")
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_RECIPE_BYTES:
                raise _too_big(path, size)
            data = f.read(MAX_RECIPE_BYTES + 1)  # it may have grown since
            if len(data) > MAX_RECIPE_BYTES:
                raise _too_big(path, len(data))
    except OSError as exc:
        raise ConfigError(f"cannot read recipe {path}: {exc.strerror}") from None
    try:
        if b"\0" in data:
            raise UnicodeError("a NUL byte")
        return data.decode("utf-8")
    except UnicodeError:
        raise ConfigError(
            f"recipe {path} is not a text file (binary or not UTF-8); give a "
            "training script or a recipe file"
        ) from None


def _too_big(path: Path, size: int) -> ConfigError:
    return ConfigError(
        f"recipe {path} is {size / 2**20:.1f} MiB: a recipe file is at most "
        f"{MAX_RECIPE_BYTES // 2**20} MiB (a script, not data); give the "
        "training script or the recipe file"
    )


def check_script(path: Path, source: str) -> None:
    """A recipe that is not a Python file is run as a program: it must start with `#!` (a
    script; binaries are refused as not text already), else the job fails with exit 126."""
    if path.suffix != ".py" and not source.startswith("#!"):
        raise ConfigError(
            f"recipe {path} is not a Python file (.py) and not a script (no #! "
            "line): ftslurm runs a .py file with python and anything else as a "
            "program; give the training script"
        )


# `ftslurm submit torchrun -- [TORCHRUN OPTIONS] SCRIPT [ARGS]`: the word `torchrun` in the
# place of the recipe file (when no file has that name) runs the torchrun command that follows.


def is_torchrun(path: str | Path) -> bool:
    """Whether `submit`'s recipe is the word `torchrun` rather than a file."""
    return str(path) == TORCHRUN and not Path(path).exists()


def torchrun_recipe(args: list[str] | tuple[str, ...]) -> Recipe:
    """The recipe of `torchrun ARGS`: its command, with the training script's path made
    absolute (the code snapshot copies that file) and its `#SBATCH` header, if it has one,
    for the resources (torchrun's own options give the job's shape, `Recipe`)."""
    command = [TORCHRUN, *args]
    torchrun = parse_torchrun(command)
    assert torchrun is not None  # the command starts with the word torchrun
    script = Path(torchrun.script[0])
    data: dict[str, Any] = {}
    if torchrun.mode is Mode.PYTHON and not script.is_file():
        raise ConfigError(f"torchrun's training script {script} not found")
    if torchrun.mode is not Mode.MODULE and script.is_file():
        try:
            source = _read_source(script)
        except ConfigError:
            if torchrun.mode is Mode.PYTHON:
                raise
            source = ""  # a program (--no-python) may be a binary: no #SBATCH lines
        data = sbatch_header(source, where=f"{script} #SBATCH lines")
        command[len(command) - len(torchrun.script)] = str(script.resolve())
    data["command"] = command
    return _validated(data, f"torchrun {script}")


def code_file(path: Path, recipe: Recipe) -> Path:
    """The file `submit` snapshots for a run: the recipe file, or for the word `torchrun`
    the training script (a module or a missing file: nothing to copy)."""
    if not is_torchrun(path):
        return path
    torchrun = recipe.torchrun()
    if torchrun is None or torchrun.mode is Mode.MODULE:
        return path
    return Path(torchrun.script[0])


def load_recipe(path: str | Path, args: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe file of either form, or the word `torchrun` and torchrun's arguments;
    the result always has a command."""
    if is_torchrun(path):
        return torchrun_recipe(args)
    path = Path(path)
    source = _read_source(path)
    check_script(path, source)
    if path.suffix == ".py":
        try:
            compile(source, str(path), "exec")
        except SyntaxError as exc:
            raise ConfigError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    default_command = [sys.executable, str(path.resolve()), *args]
    if path.suffix == ".py" and defines_recipe(source):
        try:
            namespace = runpy.run_path(str(path), run_name="ftslurm_recipe")
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc.user_message()}") from None
        except Exception as exc:  # the user's file: report it in one line
            raise ConfigError(
                f"{path}: loading the recipe failed: {type(exc).__name__}: {exc}"
            ) from None
        recipe = namespace.get("recipe")
        if not isinstance(recipe, Recipe):
            raise ConfigError(
                f"{path}: `recipe` must be an ftslurm.Recipe, not {type(recipe).__name__}"
            )
        if recipe.command is None:
            recipe = recipe.model_copy(update={"command": default_command})
        elif args:
            recipe = recipe.model_copy(update={"command": [*recipe.command, *args]})
        return _validated(recipe.model_dump(), str(path))
    data = sbatch_header(source, where=f"{path} #SBATCH lines")
    data["command"] = default_command if path.suffix == ".py" else [str(path.resolve()), *args]
    return _validated(data, f"{path} #SBATCH lines")


# sbatch's long names that map onto recipe fields; every other flag goes to sbatch_extra.
_RECIPE_KEYS = {
    "nodes": "nodes",
    "ntasks-per-node": "ntasks_per_node",
    "gpus-per-node": "gpus_per_node",
    "cpus-per-task": "cpus_per_task",
    "time": "time",
    "partition": "partition",
    "account": "account",
    "job-name": "name",
    "exclude": "exclude",
}
# Long flags that take no value (a following word is not theirs).
_LONG_NO_VALUE = frozenset(
    {
        "hold",
        "requeue",
        "no-requeue",
        "contiguous",
        "overcommit",
        "oversubscribe",
        "exclusive",
        "spread-job",
        "use-min-nodes",
        "wait",
        "parsable",
        "test-only",
        "reboot",
        "no-kill",
        "immediate",
        "quiet",
        "verbose",
        "ignore-pbs",
        "get-user-env",
    }
)


_BLANKS = " \t\n\r\f\v"  # C's isspace()


def sbatch_words(line: str, where: str) -> list[str]:
    """The words of one `#SBATCH` line as sbatch splits them: blanks separate, single or
    double quotes group, a backslash escapes the next character (inside quotes too), and an
    unquoted `#` starts a comment."""
    words: list[str] = []
    i, n = 0, len(line)
    while True:
        while i < n and line[i] in _BLANKS:
            i += 1
        if i >= n:
            return words
        word: list[str] = []
        quote, escaped = "", False
        while i < n and (quote or line[i] not in _BLANKS):
            ch = line[i]
            i += 1
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
                continue
            elif quote:
                if ch == quote:
                    quote = ""
                    continue
            elif ch in "'\"":
                quote = ch
                continue
            elif ch == "#":  # an unquoted, unescaped # : the rest of the line is a comment
                if word:
                    words.append("".join(word))
                return words
            word.append(ch)
        if quote:
            raise ConfigError(f"{where}: unmatched {quote} in {line.strip()!r}")
        words.append("".join(word))


def sbatch_flags(words: list[str], where: str) -> dict[str, Any]:
    """Recipe values from sbatch flags (long or short, `--k=v`, `--k v`, `-kv`, `-k v`)."""
    data: dict[str, Any] = {}
    extra: dict[str, str | None] = {}
    i = 0
    while i < len(words):
        word = words[i]
        value: str | None
        if word.startswith("--") and len(word) > 2:
            name, eq, value = word[2:].partition("=")
            if not eq:
                value = None
                if (
                    name not in _LONG_NO_VALUE
                    and i + 1 < len(words)
                    and not words[i + 1].startswith("-")
                ):
                    i, value = i + 1, words[i + 1]
        elif word.startswith("-") and len(word) >= 2 and word[:2] in SBATCH_SHORT:
            name, value = SBATCH_SHORT[word[:2]], word[2:].removeprefix("=") or None
            if value is None and word[:2] not in SBATCH_SHORT_NO_VALUE:
                if i + 1 >= len(words):
                    raise ConfigError(f"{where}: {word} needs a value")
                i, value = i + 1, words[i + 1]
        else:
            raise ConfigError(f"{where}: {word!r} is not an sbatch option")
        if name in OWNED_SBATCH_FLAGS:
            raise ConfigError(
                f"{where}: --{name} is set by ftslurm itself: {OWNED_SBATCH_FLAGS[name]}"
            )
        key = _RECIPE_KEYS.get(name)
        if key == "exclude":
            data[key] = tuple(n for n in (value or "").split(",") if n)
        elif key:
            data[key] = value
        else:
            check_sbatch_flag(name, value)
            extra[name] = value
        i += 1
    if extra:
        data["sbatch_extra"] = extra
    return data


def sbatch_header(source: str, where: str = "#SBATCH lines") -> dict[str, Any]:
    """Resources from the `#SBATCH` lines at the top of a script (before the first command)."""
    words: list[str] = []
    for line in source.split("\n"):  # sbatch reads lines as split at \n only
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not stripped.startswith("#SBATCH")):
            continue
        if not stripped.startswith("#SBATCH"):
            break  # Slurm stops reading #SBATCH at the first command
        words += sbatch_words(stripped[len("#SBATCH") :], where)
    return sbatch_flags(words, where)

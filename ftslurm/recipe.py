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
import runpy
import shlex
import sys
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from ftslurm.core.timefmt import parse_time_limit
from ftslurm.daemon.policy import FtSettings
from ftslurm.errors import ConfigError


class Recipe(FtSettings):
    """Resources, the command and the fault-tolerance settings of a training run."""

    command: list[str] | None = None  # default: python <the recipe file> ARGS
    name: str | None = None
    nodes: int = Field(1, ge=1)
    ntasks_per_node: int = Field(1, ge=1)
    gpus_per_node: int | None = Field(None, ge=0)
    cpus_per_task: int | None = Field(None, ge=1)
    time: str | None = None  # Slurm syntax: "30", "1:00:00", "1-00:00:00"
    partition: str | None = None
    account: str | None = None
    exclude: tuple[str, ...] = ()
    checkpoint_dir: str | None = None
    setup: tuple[str, ...] = ()  # shell lines run in the batch script before the step
    env: dict[str, str] = Field(default_factory=dict)
    sbatch_extra: dict[str, str | None] = Field(default_factory=dict)  # other #SBATCH flags

    def settings(self) -> FtSettings:
        return FtSettings(**{k: getattr(self, k) for k in FtSettings.model_fields})

    def with_overrides(self, **overrides: Any) -> Recipe:
        """A copy with the given (non-None) values replaced, validated again."""
        data = self.model_dump()
        data.update({k: v for k, v in overrides.items() if v is not None})
        return _validated(data, "command-line options")

    def time_limit_s(self) -> int | None:
        return None if self.time is None else parse_time_limit(self.time)


def _validated(data: dict[str, Any], where: str) -> Recipe:
    try:
        recipe = Recipe(**data)
        if recipe.time is not None:
            parse_time_limit(recipe.time)
        return recipe
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
    return any(isinstance(node, ast.Assign | ast.AnnAssign) and any(
        isinstance(t, ast.Name) and t.id == "recipe"
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
        for node in tree.body)  # fmt: skip


def load_recipe(path: str | Path, args: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe file of either form; the result always has a command."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe not found: {path}")
    source = path.read_text()
    if path.suffix == ".py":
        try:
            compile(source, str(path), "exec")
        except SyntaxError as exc:
            raise ConfigError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    default_command = [sys.executable, str(path.resolve()), *args]
    if path.suffix == ".py" and defines_recipe(source):
        try:
            namespace = runpy.run_path(str(path), run_name="ftslurm_recipe")
        except Exception as exc:  # the user's file: report it in one line
            raise ConfigError(f"{path}: loading the recipe failed: "
                              f"{type(exc).__name__}: {exc}") from None  # fmt: skip
        recipe = namespace.get("recipe")
        if not isinstance(recipe, Recipe):
            raise ConfigError(f"{path}: `recipe` must be an ftslurm.Recipe, "
                              f"not {type(recipe).__name__}")  # fmt: skip
        if recipe.command is None:
            recipe = recipe.model_copy(update={"command": default_command})
        elif args:
            recipe = recipe.model_copy(update={"command": [*recipe.command, *args]})
        return recipe
    data = sbatch_header(source)
    data["command"] = default_command if path.suffix == ".py" else [str(path.resolve()), *args]
    return _validated(data, f"{path} #SBATCH lines")


_SBATCH_FLAGS = {
    "-N": "nodes", "--nodes": "nodes", "--ntasks-per-node": "ntasks_per_node",
    "--gpus-per-node": "gpus_per_node", "-c": "cpus_per_task", "--cpus-per-task": "cpus_per_task",
    "-t": "time", "--time": "time", "-p": "partition", "--partition": "partition",
    "-A": "account", "--account": "account", "-J": "name", "--job-name": "name",
    "-x": "exclude", "--exclude": "exclude",
}  # fmt: skip
# Flags ftslurm sets itself for every attempt: a recipe's own value would break the contract.
_OWNED = {"--output", "-o", "--error", "-e", "--signal", "--requeue", "--no-requeue",
          "--comment", "--open-mode", "--chdir", "-D", "--array", "-a"}  # fmt: skip


def sbatch_header(source: str) -> dict[str, Any]:
    """Resources from the `#SBATCH` lines at the top of a script (before the first command)."""
    data: dict[str, Any] = {}
    extra: dict[str, str | None] = {}
    for line in source.splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not stripped.startswith("#SBATCH")):
            continue
        if not stripped.startswith("#SBATCH"):
            break  # Slurm stops reading #SBATCH at the first command
        words = shlex.split(stripped[len("#SBATCH"):], comments=True)
        i = 0
        while i < len(words):
            flag, eq, value = words[i].partition("=")
            if not eq and not flag.startswith("--") and len(flag) > 2:
                flag, value, eq = flag[:2], flag[2:], "="
            if flag in _SBATCH_FLAGS or (flag.startswith("--") and flag not in _OWNED):
                if not eq and i + 1 < len(words) and not words[i + 1].startswith("-"):
                    i, value = i + 1, words[i + 1]
                elif not eq:
                    value = None
            key = _SBATCH_FLAGS.get(flag)
            if key == "exclude":
                data[key] = tuple(n for n in (value or "").split(",") if n)
            elif key:
                data[key] = value
            elif flag in _OWNED:
                raise ConfigError(f"#SBATCH {flag} is set by ftslurm itself; remove it")
            elif flag.startswith("--"):
                extra[flag[2:]] = value
            else:
                raise ConfigError(f"#SBATCH {flag}: use the long form of this option")
            i += 1
    if extra:
        data["sbatch_extra"] = extra
    return data

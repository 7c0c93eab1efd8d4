"""Rendering sbatch scripts from `sbatch_templates/` (jinja2, strict: a missing value fails).

`render_job_script` is pure: the same inputs give the same script, byte for byte, which a
golden test pins.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

import jinja2

from ftslurm import __version__
from ftslurm.core.sbatch import sbatch_args
from ftslurm.core.types import JobOptions
from ftslurm.core.validate import check_command, check_env
from ftslurm.errors import ConfigError

_PACKAGE_DIR = Path(__file__).resolve().parent
TEMPLATE_DIRS = (
    _PACKAGE_DIR / "_sbatch_templates",  # inside an installed wheel
    _PACKAGE_DIR.parent / "sbatch_templates",  # a source checkout or editable install
)


_SBATCH_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+\Z")


def sbatch_quote(arg: str) -> str:
    """One word on an `#SBATCH` line, as sbatch reads it back: quotes group, and a
    backslash escapes the next character even inside quotes (`recipe.sbatch_words`)."""
    if _SBATCH_SAFE.match(arg):
        return arg
    return "'" + arg.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in TEMPLATE_DIRS if d.is_dir()]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["shell_quote"] = lambda v: shlex.quote(str(v))
    return env


def render_job_script(
    command: Sequence[str],
    options: JobOptions,
    *,
    run_id: str,
    attempt: int,
    env: Mapping[str, str] | None = None,
    setup: Sequence[str] = (),
    srun_args: Sequence[str] = ("--kill-on-bad-exit=1",),
    template: str = "job.sbatch.j2",
) -> str:
    """The batch script that runs `command` once per task over the allocation."""
    if not command:
        raise ConfigError("nothing to run: the command is empty")
    check_command(command)
    check_env(env or {})
    try:
        tmpl = _environment().get_template(template)
    except jinja2.TemplateNotFound:
        raise ConfigError(f"sbatch template {template!r} not found") from None
    return tmpl.render(
        version=__version__,
        run_id=run_id,
        attempt=attempt,
        sbatch_flags=[sbatch_quote(a) for a in sbatch_args(options)],
        env=dict(env or {}),
        setup=list(setup),
        srun_args=list(srun_args),
        command=shlex.join(command),
    )

"""Rendering sbatch scripts from `sbatch_templates/` (jinja2, strict: a missing value fails).

`render_job_script` is pure: the same inputs give the same script, byte for byte, which a
golden test pins.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

import jinja2

from ftslurm import __version__
from ftslurm.backends.slurm_cli.backend import sbatch_args
from ftslurm.core.types import JobOptions
from ftslurm.errors import ConfigError

_PACKAGE_DIR = Path(__file__).resolve().parent
TEMPLATE_DIRS = (
    _PACKAGE_DIR / "_sbatch_templates",  # inside an installed wheel
    _PACKAGE_DIR.parent / "sbatch_templates",  # a source checkout or editable install
)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in TEMPLATE_DIRS if d.is_dir()]),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False,
    )  # fmt: skip
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
    try:
        tmpl = _environment().get_template(template)
    except jinja2.TemplateNotFound:
        raise ConfigError(f"sbatch template {template!r} not found") from None
    return tmpl.render(
        version=__version__, run_id=run_id, attempt=attempt,
        sbatch_flags=[shlex.quote(a) if " " in a else a for a in sbatch_args(options)],
        env=dict(env or {}), setup=list(setup), srun_args=list(srun_args),
        command=shlex.join(command),
    )  # fmt: skip

"""Property: no value can escape its place in the batch script.

For arbitrary text (newlines, quotes, `$()`, backticks, NUL, unicode) in every field that
reaches the script, either a ConfigError refuses it, or the script's `#SBATCH` header holds
exactly the expected lines, each read back by sbatch's word rules as the value given, and
bash hands every environment value and command word back byte for byte.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ftslurm.core.sbatch import sbatch_args
from ftslurm.daemon.submission import build_attempt, make_spec
from ftslurm.errors import ConfigError
from ftslurm.recipe import Recipe, sbatch_words

NASTY = [
    "\n",
    "\r",
    "'",
    '"',
    "$(",
    ")",
    "`",
    "\0",
    "\\",
    "#",
    " ",
    "\t",
    ";",
    "é",
    "\u2028",
    "\x85",
    "$HOME",
    "#SBATCH --qos=evil",
    "\necho pwned\n",
    "'; echo pwned; '",
    "\x1b",
]
PRINTABLE = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=6)
TEXT = st.lists(
    st.one_of(st.text(max_size=6), PRINTABLE, PRINTABLE, st.sampled_from(NASTY)), max_size=6
).map("".join)
# Each field that reaches the script, with how to put a value there.
FIELDS = [
    "name",
    "partition",
    "account",
    "exclude",
    "checkpoint_dir",
    "extra_value",
    "extra_key",
    "env_value",
    "env_key",
    "command",
    "workdir",
    "run_dir",
]


def render(field: str, value: str, tmp: Path) -> tuple[str, dict, list[str]]:
    """The script for `value` in `field`, the environment and the command it should carry."""
    recipe: dict = {
        "command": ["train", "--lr", "0.1"],
        "time": "30",
        "env": {"KEEP": "x"},
        "sbatch_extra": {},
    }
    run_dir, workdir = str(tmp / "run"), str(tmp)
    if field in ("checkpoint_dir", "workdir", "run_dir"):
        value = value.replace("/", "_")  # a path: keep it inside the test's folder
    if field in ("name", "partition", "account", "checkpoint_dir"):
        recipe[field] = value
    elif field == "exclude":
        recipe["exclude"] = (value,)
    elif field == "extra_value":
        recipe["sbatch_extra"] = {"qos": value}
    elif field == "extra_key":
        recipe["sbatch_extra"] = {value: "1"}
    elif field == "env_value":
        recipe["env"] = {"KEEP": value}
    elif field == "env_key":
        recipe["env"] = {value: "x"}
    elif field == "command":
        recipe["command"] = ["train", value]
    elif field == "workdir":
        workdir = str(tmp / value)
    else:
        run_dir = str(tmp / value)
    try:
        made = Recipe(**recipe)
    except ValidationError as exc:  # pydantic's own checks (an empty name, ...)
        raise ConfigError(str(exc.errors()[0]["msg"])) from None
    spec = make_spec(made, run_dir=Path(run_dir), backend="slurm", workdir=workdir)
    script, options = build_attempt("r1", spec, {}, 0, ())
    return script, spec, sbatch_args(options)


def header(script: str) -> list[str]:
    """The lines sbatch reads options from: up to the first line that is not a comment."""
    lines = []
    for line in script.split("\n")[1:]:
        if line.strip() and not line.startswith("#"):
            break
        lines.append(line)
    return [line for line in lines if line.startswith("#SBATCH")]


def check_header(script: str, expected: list[str]) -> None:
    lines = header(script)
    assert len(lines) == len(expected)
    for line, arg in zip(lines, expected, strict=True):
        assert sbatch_words(line[len("#SBATCH") :], "test") == [arg]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(FIELDS), value=TEXT)
def test_a_value_is_refused_or_stays_in_its_place(tmp_path_factory, field, value):
    tmp = tmp_path_factory.getbasetemp() / "p"
    try:
        script, spec, expected = render(field, value, tmp)
    except ConfigError as exc:
        assert "\n" not in exc.user_message()
        return
    check_header(script, expected)
    value = value.replace("/", "_") if field in ("workdir", "run_dir") else value
    wanted = {
        "name": f"--job-name={value}",
        "partition": f"--partition={value}",
        "account": f"--account={value}",
        "exclude": f"--exclude={value}",
        "extra_value": f"--qos={value}",
        "extra_key": f"--{value}=1",
        "workdir": f"--chdir={tmp / value}",
        "run_dir": f"--output={tmp / value}/logs/job-%j.out",
    }
    if field in wanted:
        assert wanted[field] in expected


@pytest.mark.parametrize(
    "field,fragment",
    [
        ("name", "--job-name"),
        ("partition", "--partition"),
        ("account", "--account"),
        ("exclude", "--exclude"),
        ("checkpoint_dir", "--checkpoint-dir"),
        ("extra_value", "--qos"),
        ("extra_key", "not a flag name"),
        ("env_value", "KEEP"),
        ("env_key", "not a shell name"),
        ("command", "command argument"),
        ("workdir", "--chdir"),
        ("run_dir", "--output"),
    ],
)
def test_a_refusal_is_one_line_naming_the_field(tmp_path, field, fragment):
    bad = "a\0b" if field in ("env_value", "command") else "a\necho pwned"
    with pytest.raises(ConfigError) as err:
        render(field, bad, tmp_path)
    assert fragment in err.value.user_message() and "\n" not in err.value.user_message()


def run_script(script: str, tmp: Path) -> tuple[list[str], str]:
    """Run the batch script with a stand-in srun that writes back its words and $KEEP."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(
        '#!/bin/bash\nprintf "%s\\0" "$@" > "$OUT_ARGS"\nprintf "%s" "$KEEP" > "$OUT_ENV"\n'
    )
    srun.chmod(0o755)
    path = tmp / "job.sh"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "1",
        "SLURM_JOB_NODELIST": "n1",
        "OUT_ARGS": str(tmp / "args"),
        "OUT_ENV": str(tmp / "env"),
    }
    done = subprocess.run(["bash", str(path)], env=env, cwd=tmp, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    args = (tmp / "args").read_bytes().decode().split("\0")[:-1]
    return args, (tmp / "env").read_bytes().decode()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["env_value", "command", "checkpoint_dir", "run_dir"]), value=TEXT)
def test_bash_gives_every_value_back_byte_for_byte(tmp_path_factory, field, value):
    tmp = tmp_path_factory.mktemp("bash")
    try:
        script, spec, _ = render(field, value, tmp)
    except ConfigError:
        return
    args, keep = run_script(script, tmp)
    assert args[-len(spec["command"]) :] == spec["command"]
    assert keep == spec["env"]["KEEP"]
    assert Path(spec["checkpoint_dir"]).is_dir() and Path(spec["run_dir"], "logs").is_dir()

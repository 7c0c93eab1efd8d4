"""An ordinary user on the local cluster, and the one privileged door it is given.

Root is Slurm's super user: its requests skip the permission checks every real user meets.
So the test suite runs as an unprivileged account (`make test` creates it), and only the
cluster's fault controls (`fail-node`, `revive-node`, `slurmd-timeout`, ...) act as root.
A caller that is not root reaches them through `OPERATOR_ENV` (default `sudo -n`), running
`python -m ftslurm.localcluster ... COMMAND` as the operator: `render_sudo_rule` is the line
of sudoers that allows exactly that command to that user.

`render_*`/`*_argv` are pure; the rest acts on the machine and needs root.
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from ftslurm.errors import FtslurmError
from ftslurm.localcluster.rootfs import ensure_debian_package, run_checked, sbin_path

log = logging.getLogger(__name__)

OPERATOR_ENV = "FTSLURM_CLUSTER_OPERATOR"  # how a caller who is not root runs fault controls
DEFAULT_OPERATOR = "sudo -n"
SUDOERS_FILE = Path("/etc/sudoers.d/ftslurm-localcluster")
CHROOT_SUDOERS_FILE = Path("/etc/sudoers.d/ftslurm-localcluster-chroot")
_USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,30}")


class UserError(FtslurmError):
    """The test user could not be set up."""


def check_user_name(name: str) -> str:
    if not _USER_NAME.fullmatch(name):
        raise UserError(f"bad user name {name!r}: lower-case letters, digits, '-' and '_'")
    return name


def operator_argv(prefix: str, python: str, version: str, root: Path, *command: str) -> list[str]:
    """argv that runs `python -m ftslurm.localcluster --version V --root R COMMAND...`
    through `prefix` (e.g. `sudo -n`): what a fault control does for a caller not root."""
    return [
        *shlex.split(prefix),
        python,
        "-m",
        "ftslurm.localcluster",
        "--version",
        version,
        "--root",
        str(root),
        *command,
    ]


def operator_prefix() -> str:
    return os.environ.get(OPERATOR_ENV, DEFAULT_OPERATOR)


def render_sudo_rule(user: str, python: str) -> str:
    """The sudoers rule that lets `user` run the local cluster's controls, nothing else."""
    escaped = _escape(python)
    return (
        "# Written by ftslurm's local cluster harness (`python -m ftslurm.localcluster "
        "add-user`):\n"
        f"# {user} may run the local test cluster's fault controls as root, nothing else.\n"
        f"{user} ALL=(root) NOPASSWD: {escaped} -m ftslurm.localcluster *\n"
    )


def render_chroot_rule(user: str, chroot: str, mounts: Path) -> str:
    """The sudoers rule that lets `user` run a chrooted release's clients as itself: enter a
    tree mounted under `mounts` (`rootfs.Sysroot`) with `--userspec`, keeping its
    environment (SETENV: sbatch hands it to the job)."""
    return (
        "# Written by ftslurm's local cluster harness (`python -m ftslurm.localcluster "
        "add-user`):\n"
        f"# {user} may enter the local test clusters' Slurm root filesystems as itself.\n"
        f"{user} ALL=(root) NOPASSWD:SETENV: {_escape(chroot)} --userspec=* "
        f"{_escape(str(mounts))}/* *\n"
    )


def _escape(command: str) -> str:
    return command.replace("\\", "\\\\").replace(",", "\\,").replace(":", "\\:")


def ensure_account(user: str) -> pwd.struct_passwd:
    """The system account `user`, created (home, own group, bash) when missing."""
    check_user_name(user)
    try:
        return pwd.getpwnam(user)
    except KeyError:
        pass
    run_checked(["useradd", "--create-home", "--user-group", "--shell", "/bin/bash", user], 60)
    log.info("created the user %s", user)
    return pwd.getpwnam(user)


def ensure_sudo(rule: str, path: Path = SUDOERS_FILE) -> None:
    """Install sudo when missing (Debian's package) and write `rule` (checked by visudo).
    Raises `rootfs.RootfsError` when a command fails."""
    ensure_debian_package("sudo", "sudo")
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(rule)
    tmp.chmod(0o440)
    visudo = shutil.which("visudo", path=sbin_path())
    if visudo:
        run_checked([visudo, "-c", "-q", "-f", str(tmp)], 60)
    os.replace(tmp, path)


def open_path(user: str, path: Path) -> list[Path]:
    """Let `user` reach `path` (traverse every folder above it): a folder the user cannot
    enter gets the search bit for others (no listing, no writing). Returns what changed."""
    changed = []
    for folder in reversed([path, *path.parents]):
        if not folder.is_dir() or _can_enter(user, folder):
            continue
        mode = folder.stat().st_mode
        folder.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
        changed.append(folder)
    return changed


def runs_as(user: str, argv: list[str]) -> bool:
    proc = subprocess.run(
        ["runuser", "-u", user, "--", *argv],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    return proc.returncode == 0


def _can_enter(user: str, folder: Path) -> bool:
    return runs_as(user, ["test", "-x", str(folder)])


def this_python() -> str:
    """The interpreter (the venv's, not the file it links to: sudo must run the venv)."""
    return sys.executable

"""The ordinary user's door to the local cluster's fault controls: what reaches sudo and a
shell, checked without root and without a cluster."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ftslurm.localcluster.__main__ import main
from ftslurm.localcluster.harness import _pids_in
from ftslurm.localcluster.users import (
    UserError,
    check_user_name,
    operator_argv,
    render_chroot_rule,
    render_sudo_rule,
)


def test_a_fault_control_for_a_user_is_the_cluster_command_run_by_the_operator():
    argv = operator_argv(
        "sudo -n", "/opt/v env/bin/python", "24.11", Path("/tmp/c"), "fail-node", "n2"
    )
    assert argv == [
        "sudo",
        "-n",
        "/opt/v env/bin/python",
        "-m",
        "ftslurm.localcluster",
        "--version",
        "24.11",
        "--root",
        "/tmp/c",
        "fail-node",
        "n2",
    ]
    assert _pids_in("killed 3 processes of n2 (pids 11 12 13)\n") == [11, 12, 13]
    assert _pids_in("killed 0 processes of n2 (pids )\n") == []


@pytest.mark.parametrize("name", ["root;rm", "Bob", "a b", "", "-x", "x" * 40])
def test_bad_user_names_are_refused(name):
    with pytest.raises(UserError, match="bad user name"):
        check_user_name(name)


def test_a_command_missing_its_argument_is_refused_in_one_line(capsys):
    for command in (["add-user"], ["slurmd-timeout", "soon"], ["kill-tasks"]):
        with pytest.raises(SystemExit) as exit_:
            main(command)
        assert exit_.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"error: {command[0]} needs" in last


VISUDO = shutil.which("visudo", path="/usr/sbin:/sbin:/usr/bin")


@pytest.mark.skipif(VISUDO is None, reason="no visudo (sudo is not installed)")
def test_the_sudo_rules_parse_and_escape_what_sudoers_treats_specially(tmp_path):
    rules = tmp_path / "rules"
    rules.write_text(
        render_sudo_rule("ftslurm-test", "/opt/a,b:c/bin/python")
        + render_chroot_rule("ftslurm-test", "/usr/sbin/chroot", Path("/var/cache/x,y/mnt"))
    )
    rules.chmod(0o440)
    proc = subprocess.run([VISUDO, "-c", "-f", str(rules)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = rules.read_text()
    assert "/opt/a\\,b\\:c/bin/python -m ftslurm.localcluster *" in text
    assert "NOPASSWD:SETENV: /usr/sbin/chroot --userspec=* /var/cache/x\\,y/mnt/* *" in text

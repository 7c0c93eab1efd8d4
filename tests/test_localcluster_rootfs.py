"""The second Slurm release's pieces that need no root and no cluster: what reaches a shell
(wrapper scripts, env.sh) and the one-line refusals of bad input."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ftslurm.core.contract import rendezvous_port
from ftslurm.localcluster import ClusterError, LocalCluster
from ftslurm.localcluster.__main__ import main
from ftslurm.localcluster.config import ClusterLayout, render_env_sh, render_slurm_conf
from ftslurm.localcluster.rootfs import (
    RELEASES,
    Rootfs,
    RootfsError,
    checked_path,
    release_for,
    render_client_wrapper,
)


def test_unknown_versions_and_unsafe_paths_are_refused_in_one_line(capsys):
    with pytest.raises(ClusterError, match="unknown Slurm version '23.02'; known: 22.05, 24.11"):
        LocalCluster(version="23.02")
    with pytest.raises(RootfsError, match="must be an absolute path"):
        checked_path(Path("/tmp/a b"), "the cluster folder")
    with pytest.raises(RootfsError, match="must be an absolute path"):
        checked_path(Path("/tmp/$(reboot)"), "the cluster folder")
    with pytest.raises(ClusterError, match="must be an absolute path"):
        LocalCluster("/tmp/x;y", version="24.11")
    with pytest.raises(RootfsError, match="http"):
        Rootfs(RELEASES["24.11"], Path("/var/cache/ftslurm"), mirror="ftp://x'; rm")
    assert main(["--version", "24.11", "--root", "/tmp/a'b", "env"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and err.count("\n") == 1
    assert release_for("22.05") is None


def test_the_second_release_has_its_own_folder_ports_and_munge_socket():
    first, second = LocalCluster(), LocalCluster(version="24.11")
    assert first.layout.root != second.layout.root
    assert first.layout.munge_socket != second.layout.munge_socket
    ports = lambda lay: {lay.ctld_port, lay.dbd_port, lay.mysql_port, *lay.slurmd_ports}  # noqa: E731
    assert not ports(first.layout) & ports(second.layout)
    assert second.layout.chrooted and not first.layout.chrooted
    assert second.env()["PATH"].startswith(f"{second.layout.bin_dir}{os.pathsep}")
    # 24.11's one-agent ping round lasts MessageTimeout + TCPTimeout (12 s) with a node dead:
    # SlurmdTimeout must leave room for it, or the living nodes go down with the dead one.
    assert (first.layout.slurmd_timeout, second.layout.slurmd_timeout) == (10, 30)
    assert "SlurmdTimeout=30\n" in render_slurm_conf(second.layout)


def test_the_clusters_jobs_never_share_a_rendezvous_port_with_the_mocks():
    """The suite runs the mock's jobs (ids from 1) beside the local clusters' (ids from
    FirstJobId): none of the first 3000 of each, over 6 restarts, asks for the same port."""
    lay = LocalCluster().layout
    assert f"FirstJobId={lay.first_job_id}\n" in render_slurm_conf(lay)

    def ports(first: int) -> set[int]:
        return {
            rendezvous_port(job, restart)
            for job in range(first, first + 3000)
            for restart in range(6)
        }

    assert not ports(1) & ports(lay.first_job_id)


def test_env_sh_and_the_wrappers_quote_what_they_are_given(tmp_path):
    lay = ClusterLayout(root=Path("/tmp/it's here"), hostname="h", chrooted=True)
    out = subprocess.run(
        ["sh", "-c", render_env_sh(lay) + 'echo "$SLURM_CONF"; echo "$PATH"'],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        check=True,
    ).stdout.splitlines()
    assert out == ["/tmp/it's here/etc/slurm.conf", "/tmp/it's here/bin:/usr/bin:/bin"]
    # A wrapper whose chroot folder is absent from the caller's view refuses sbatch with
    # one line (the job's directory must be visible), and its text parses as shell.
    script = tmp_path / "sbatch"
    script.write_text(
        render_client_wrapper(
            "sbatch", "/usr/bin/sbatch", tmp_path / "no root", Path("/tmp/c'onf/slurm.conf")
        )
    )
    proc = subprocess.run(["sh", str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "not visible to the Slurm chroot" in proc.stderr
    # Root enters the chroot itself; a user through sudo, and runs the client as itself.
    assert 'exec sudo -n -E chroot --userspec="$(id -u):$(id -g)"' in script.read_text()


def test_a_binary_that_is_an_alternatives_link_is_found_inside_the_tree(tmp_path):
    """Debian installs `/usr/sbin/slurmctld -> /etc/alternatives/slurmctld`, an absolute link
    that resolves only inside the tree. On a host without Slurm the link dangles from outside,
    and the tree must still be usable (seen on a fresh machine: 'slurmctld is missing')."""
    rootfs = Rootfs(release_for("24.11"), cache=tmp_path)
    sbin = rootfs.path / "usr" / "sbin"
    sbin.mkdir(parents=True)
    (sbin / "slurmctld").symlink_to("/etc/alternatives/ftslurm-test-no-such-alternative")
    assert rootfs.binary("slurmctld") == "/usr/sbin/slurmctld"
    with pytest.raises(RootfsError, match="slurmd is missing"):
        rootfs.binary("slurmd")

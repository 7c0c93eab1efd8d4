"""A real multi-node Slurm cluster on one machine, for tests, demos and rehearsals.

`LocalCluster` starts munged, MariaDB, slurmdbd, slurmctld and one slurmd per node
(`n1`..`nN`, all on 127.0.0.1 with their own ports, spool and pid files), using
configuration written into its own folder; it never edits `/etc/slurm`. Clients find it
through `SLURM_CONF` (see `env()` and the `env.sh` it writes).

Fault controls act like the real thing: `fail_node` SIGKILLs the node's slurmd and every
process "on" that node, so slurmctld sees a node that stopped answering; `stop_controller`
takes slurmctld away while the rest keeps running.

It must run as root (it starts daemons as root and as the munge/mysql users).

`LocalCluster(version="24.11")` runs another Slurm release the same way, its daemons inside
a chroot of a Debian root filesystem that ships it (`rootfs`), with ports, folder and munge
socket of its own, so it runs beside the host's 22.05 cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from ftslurm.errors import ConfigError, FtslurmError
from ftslurm.fsutil import forget_node_memory, memory_base
from ftslurm.localcluster import users
from ftslurm.localcluster.config import (
    ClusterLayout,
    render_cgroup_conf,
    render_env_sh,
    render_slurm_conf,
    render_slurmdbd_conf,
)
from ftslurm.localcluster.rootfs import (
    DEFAULT_CACHE,
    HOST_RELEASE,
    Rootfs,
    RootfsError,
    Sysroot,
    release_for,
    sbin_path,
    write_client_wrappers,
)
from ftslurm.procutil import pid_alive

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path(os.environ.get("FTSLURM_LOCAL_CLUSTER_DIR", "/tmp/ftslurm-localcluster"))

DEBIAN_PACKAGES = ("slurm-wlm", "slurm-client", "munge", "slurmdbd", "mariadb-server")
REQUIRED_BINARIES = (
    "slurmctld",
    "slurmd",
    "slurmdbd",
    "sbatch",
    "squeue",
    "scontrol",
    "sacct",
    "sacctmgr",
    "sinfo",
    "munged",
    "mariadbd",
    "mariadb-install-db",
    "mariadb",
)
MARKER = "FTSLURM_LOCAL_CLUSTER"  # env var set on every daemon we start
NODE_MARKER = "FTSLURM_LOCAL_NODE"  # env var set on each slurmd (and inherited by its stepds)


class ClusterError(FtslurmError):
    """The local cluster could not be started or controlled."""


def default_root(version: str = HOST_RELEASE) -> Path:
    """The host release's cluster lives in DEFAULT_ROOT, another beside it, named after
    its version, so both can run at once."""
    if version == HOST_RELEASE:
        return DEFAULT_ROOT
    return DEFAULT_ROOT.with_name(f"{DEFAULT_ROOT.name}-{version}")


def wait_for(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.25) -> None:
    """Poll `cond` until it holds or `timeout` seconds pass (then raise ClusterError)."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return
        if time.monotonic() >= deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _read_pid(path: Path) -> int | None:
    """The live pid in a pid file, if it still belongs to the daemon the file is named after.

    A pid file left by an earlier boot can name a pid that now belongs to someone else;
    the process name (`munged`, `mariadbd`, `slurmd`, ...) must match the file's stem.
    """
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    if not pid_alive(pid):
        return None
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    expected = path.stem.split("-", 1)[0]  # slurmd-n1 -> slurmd
    expected = {"mysqld": "mariadbd"}.get(expected, expected)
    return pid if comm.startswith(expected[:15]) else None


def _proc_environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _all_pids() -> Iterable[int]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


@dataclass(frozen=True)
class DaemonStatus:
    name: str
    pid: int | None

    @property
    def alive(self) -> bool:
        return self.pid is not None


class LocalCluster:
    """Start, inspect, break and stop a local multi-node Slurm cluster."""

    def __init__(
        self,
        root: Path | str | None = None,
        *,
        version: str = HOST_RELEASE,
        cache: Path | str = DEFAULT_CACHE,
        **layout_overrides,
    ) -> None:
        try:
            release = release_for(version)
        except RootfsError as exc:
            raise ClusterError(str(exc)) from None
        self.version = version
        if release is not None:
            layout_overrides = {
                "base_port": release.base_port,
                "chrooted": True,
                "cluster_name": release.cluster_name,
                "slurmd_timeout": release.slurmd_timeout,
                **layout_overrides,
            }
        self.layout = ClusterLayout(
            root=Path(root or default_root(version)).resolve(),
            hostname=socket.gethostname().split(".")[0],
            **layout_overrides,
        )
        self.rootfs: Rootfs | None = None
        self.sysroot: Sysroot | None = None
        self.build_s = 0.0  # how long `up` spent building the root filesystem
        if release is not None:
            try:
                self.rootfs = Rootfs(release, Path(cache))
                # The mount point lives beside the cache, not in the cluster's folder: a walk
                # or removal of that folder (or of /tmp) must never reach the cached tree.
                name = str(self.layout.root).strip("/").replace("/", "_")
                self.sysroot = Sysroot(
                    self.rootfs, self.rootfs.cache / "mnt" / name, self.layout.root
                )
            except RootfsError as exc:
                raise ClusterError(str(exc)) from None

    # ------------------------------------------------------------------ env
    def env(self) -> dict[str, str]:
        """The environment Slurm's clients need to talk to this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.layout.slurm_conf)
        if self.layout.chrooted:
            env["PATH"] = os.pathsep.join([str(self.layout.bin_dir), env.get("PATH", "")])
        return env

    def _daemon_argv(self, name: str, *args: str, user: str | None = None) -> list[str]:
        """argv that runs this release's `name` (as `user`, if given): the host's binary,
        or the root filesystem's inside the chroot."""
        as_user = ["runuser", "-u", user, "--"] if user else []
        if self.sysroot is None or self.rootfs is None:
            return [*as_user, _sbin(name), *args]
        if not user:
            return self.sysroot.argv(name, *args)
        return self.sysroot.argv("runuser", *as_user[1:], self.rootfs.binary(name), *args)

    def _user_ids(self, user: str) -> tuple[int, int]:
        """The (uid, gid) the daemons' user has where they run (host or chroot)."""
        if self.rootfs is None:
            entry = pwd.getpwnam(user)
            return entry.pw_uid, entry.pw_gid
        return self.rootfs.passwd_ids(user)

    def _daemon_env(self, node: str | None = None) -> dict[str, str]:
        env = self.env()
        env[MARKER] = str(self.layout.root)
        if node:
            env[NODE_MARKER] = node
        return env

    def _run(
        self,
        argv: list[str],
        *,
        check: bool = True,
        timeout: float = 60,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env or self._daemon_env(),
            stdin=subprocess.DEVNULL,
        )
        if check and proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip().splitlines()
            raise ClusterError(f"{argv[0]} failed ({proc.returncode}): {msg[-1] if msg else ''}")
        return proc

    # ------------------------------------------------------------ packages
    @staticmethod
    def missing_binaries() -> list[str]:
        return [b for b in REQUIRED_BINARIES if shutil.which(b, path=sbin_path()) is None]

    def ensure_packages(self) -> None:
        """Install Slurm, munge, slurmdbd and MariaDB from Debian's packages when missing
        (for another release: build its root filesystem unless a complete one is cached)."""
        if self.rootfs is not None:
            try:
                self.build_s = self.rootfs.ensure()
            except (RootfsError, subprocess.TimeoutExpired) as exc:
                raise ClusterError(f"root filesystem for Slurm {self.version}: {exc}") from None
            return
        missing = self.missing_binaries()
        if not missing:
            return
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise ClusterError(
                f"missing {', '.join(missing)}; install the Debian packages "
                f"{' '.join(DEBIAN_PACKAGES)} (needs root)"
            )
        log.info("installing %s", " ".join(DEBIAN_PACKAGES))
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for argv in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *DEBIAN_PACKAGES],
        ):
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
            if proc.returncode != 0:
                raise ClusterError(f"{' '.join(argv[:2])} failed: {proc.stderr.strip()[-300:]}")
        still = self.missing_binaries()
        if still:
            raise ClusterError(f"still missing after install: {', '.join(still)}")

    # ------------------------------------------------------------ lifecycle
    def is_up(self) -> bool:
        return all(d.alive for d in self.daemons()) and self._ping_controller()

    def up(self, timeout: float = 120) -> None:
        """Start every daemon that is not running, then wait for all nodes to be idle."""
        if os.geteuid() != 0:
            raise ClusterError("the local Slurm cluster must be started as root")
        self.ensure_packages()
        lay = self.layout
        fresh = not lay.state_dir.exists()
        self._write_files()
        if self.sysroot is not None and self.rootfs is not None:
            try:
                self.sysroot.mount()
            except RootfsError as exc:
                raise ClusterError(str(exc)) from None
            write_client_wrappers(lay.bin_dir, self.rootfs, self.sysroot.path, lay.slurm_conf)
        self._start_munged()
        self._start_mysql()
        self._start_slurmdbd()
        self._register_accounting()
        self._start_slurmctld(clear_state=fresh)
        for node in lay.node_names:
            self._start_slurmd(node)
        self.wait_nodes_idle(timeout=timeout)

    def down(self) -> None:
        """Stop every daemon and every job process of this cluster; keep the folder."""
        lay = self.layout
        self._kill_matching(
            lambda env: env.get("SLURM_CONF") == str(lay.slurm_conf) and "SLURM_JOB_ID" in env,
            signal.SIGKILL,
        )
        for node in lay.node_names:
            self._stop_pidfile(lay.slurmd_pid_file(node))
        self._stop_pidfile(lay.pid_file("slurmctld"))
        self._stop_pidfile(lay.pid_file("slurmdbd"))
        self._stop_pidfile(lay.pid_file("mysqld"), timeout=30)
        self._stop_pidfile(lay.pid_file("munged"))
        # Anything we started that outlived its pid file (e.g. a slurmstepd).
        self._kill_matching(lambda env: env.get(MARKER) == str(lay.root), signal.SIGKILL)
        if self.sysroot is not None:
            # Whatever is mounted there, also what a crashed run left (the mount table says).
            wait_for(
                lambda: (
                    not self._kill_matching(
                        lambda env: env.get(MARKER) == str(lay.root), signal.SIGKILL
                    )
                ),
                10,
                "the cluster's processes to be gone",
            )
            try:
                self.sysroot.unmount()
            except RootfsError as exc:
                raise ClusterError(str(exc)) from None

    def destroy(self) -> None:
        """`down`, then remove the cluster's folder (jobs, accounting, logs)."""
        self.down()
        if self.sysroot is not None and self.sysroot.mounted():
            raise ClusterError(f"{self.sysroot.path} is still mounted; not removing anything")
        shutil.rmtree(self.layout.root, ignore_errors=True)

    def daemons(self) -> list[DaemonStatus]:
        lay = self.layout
        items = [
            ("munged", lay.pid_file("munged")),
            ("mysqld", lay.pid_file("mysqld")),
            ("slurmdbd", lay.pid_file("slurmdbd")),
            ("slurmctld", lay.pid_file("slurmctld")),
        ]
        items += [(f"slurmd-{n}", lay.slurmd_pid_file(n)) for n in lay.node_names]
        return [DaemonStatus(name, _read_pid(path)) for name, path in items]

    def node_states(self) -> dict[str, str]:
        """`{node: state}` as sinfo reports it (e.g. idle, alloc, down*); {} if unreachable."""
        try:
            proc = self._run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=15)
        except subprocess.TimeoutExpired:
            return {}
        if proc.returncode != 0:
            return {}
        states = {}
        for line in proc.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1].lower()
        return states

    def wait_nodes_idle(self, nodes: Iterable[str] | None = None, timeout: float = 120) -> None:
        wanted = list(nodes or self.layout.node_names)

        def idle() -> bool:
            st = self.node_states()
            return all(st.get(n) == "idle" for n in wanted)

        wait_for(idle, timeout, f"nodes {','.join(wanted)} to be idle", interval=0.5)

    # -------------------------------------------------------- fault controls
    def fail_node(self, node: str) -> list[int]:
        """Kill node `node` hard: its slurmd, its slurmstepds and every job process on it,
        and wipe its memory: every node here shares one host's /dev/shm, so the memory
        checkpoint tier's areas of `node` (`ftslurm.core.contract.node_memory_area`, under
        the base its job processes had, and the default one) are removed, as a real node's
        memory would be lost.

        Returns the pids killed. slurmctld marks the node DOWN after SlurmdTimeout.
        """
        self._check_node(node)
        if os.geteuid() != 0:
            return _pids_in(self._operator("fail-node", node))
        ours = self._job_process_on(node)
        bases = {memory_base({})}
        for pid in _all_pids():  # the bases of the job processes' owners, before they die
            env = _proc_environ(pid)
            if ours(env):
                with contextlib.suppress(ConfigError, OSError):
                    bases.add(memory_base(env, uid=os.stat(f"/proc/{pid}").st_uid))

        def on_node(env: dict[str, str]) -> bool:
            if env.get(MARKER) == str(self.layout.root) and env.get(NODE_MARKER) == node:
                return True  # slurmd and the slurmstepds it exec'd
            return ours(env)

        killed = self._kill_matching(on_node, signal.SIGKILL)
        for base in bases:
            forget_node_memory(base, node)
        return killed

    def kill_job_processes(self, node: str) -> list[int]:
        """Kill every job process on node `node` (its tasks and their children) and leave
        its slurmd: to Slurm the node is up and the job still runs there. Returns the pids."""
        self._check_node(node)
        if os.geteuid() != 0:
            return _pids_in(self._operator("kill-tasks", node))
        return self._kill_matching(self._job_process_on(node), signal.SIGKILL)

    def _job_process_on(self, node: str) -> Callable[[dict[str, str]], bool]:
        """Whether a process's environment is that of a job process on `node` (a task of
        this cluster's slurmd there, not a daemon we started)."""
        conf, root = str(self.layout.slurm_conf), str(self.layout.root)
        return lambda env: (
            env.get("SLURM_CONF") == conf
            and env.get("SLURMD_NODENAME") == node
            and env.get(MARKER) != root
        )

    def read_only_dir(self, path: Path | str, read_only: bool = True) -> None:
        """Make the folder `path` read-only for everyone, root too (a bind mount of it on
        itself, remounted `ro`: writes fail with EROFS), or writable again (`read_only=False`:
        the mount removed): a node-local disk gone read-only, the fault a health check of that
        folder meets. A caller who is not root goes through the operator; the operator takes
        only a real folder (no link) owned by the user who asked (`SUDO_UID`)."""
        if os.geteuid() != 0:
            self._operator("read-only-dir" if read_only else "writable-dir", str(path))
            return
        folder = Path(path)
        if folder.is_symlink() or not folder.is_dir():
            raise ClusterError(f"{folder} is not a folder")
        owner = os.environ.get("SUDO_UID")
        if owner is not None and str(folder.stat().st_uid) != owner:
            raise ClusterError(f"{folder} is not the asking user's folder")
        mount = shutil.which("mount", path=sbin_path()) or "mount"
        umount = shutil.which("umount", path=sbin_path()) or "umount"
        if read_only:
            self._run([mount, "--bind", str(folder), str(folder)])
            self._run([mount, "-o", "remount,ro,bind", str(folder)])
        else:
            self._run([umount, str(folder)], check=False)

    def revive_node(self, node: str, timeout: float = 60) -> None:
        """Restart a failed node's slurmd, resume it, and wait until it is idle again."""
        self._check_node(node)
        if os.geteuid() != 0:
            self._operator("revive-node", node)
            return
        self._start_slurmd(node)
        self._run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        self.wait_nodes_idle([node], timeout=timeout)

    @contextlib.contextmanager
    def slurmd_timeout(self, seconds: int) -> Iterator[None]:
        """Run with Slurm's `SlurmdTimeout` at `seconds` (e.g. its default, 300), then put
        back the layout's: slurm.conf is rewritten and `scontrol reconfigure` applies it at
        once (verified on 22.05: `scontrol show config` shows the new value)."""
        self.set_slurmd_timeout(seconds)
        try:
            yield
        finally:
            self.set_slurmd_timeout(None)

    def set_slurmd_timeout(self, seconds: int | None) -> None:
        """Rewrite slurm.conf with `SlurmdTimeout=seconds` (None: the layout's) and apply it."""
        if os.geteuid() != 0:
            self._operator("slurmd-timeout", "default" if seconds is None else str(seconds))
            return
        layout = self.layout if seconds is None else replace(self.layout, slurmd_timeout=seconds)
        layout.slurm_conf.write_text(render_slurm_conf(layout))
        self._run(["scontrol", "reconfigure"])

    def stop_controller(self, timeout: float = 30) -> None:
        """Stop slurmctld (its state is kept on disk); clients then cannot reach it."""
        if os.geteuid() != 0:
            self._operator("stop-controller")
            return
        self._stop_pidfile(self.layout.pid_file("slurmctld"), timeout=timeout)

    def start_controller(self, timeout: float = 60) -> None:
        """Start slurmctld again, recovering its saved state, and wait until it answers."""
        if os.geteuid() != 0:
            self._operator("start-controller")
            return
        self._start_slurmctld(clear_state=False)
        wait_for(self._ping_controller, timeout, "slurmctld to answer")

    # ------------------------------------------------------------ internals
    def _check_node(self, node: str) -> None:
        if node not in self.layout.node_names:
            names = ", ".join(self.layout.node_names)
            raise ClusterError(f"unknown node {node!r}; nodes are {names}")

    def _write_files(self) -> None:
        lay = self.layout
        for d in (lay.root, lay.etc, lay.log_dir, lay.run_dir, lay.spool, lay.state_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(lay.root, 0o755)
        for node in lay.node_names:
            (lay.spool / node).mkdir(exist_ok=True)
        # Slurm creates its logs 0600; made first, they stay readable to the cluster's users
        # (a failing test shows them) as long as the file exists.
        for name in ("slurmctld", *(f"slurmd-{node}" for node in lay.node_names)):
            log_file = lay.log_dir / f"{name}.log"
            log_file.touch()
            os.chmod(log_file, 0o644)
        lay.slurm_conf.write_text(render_slurm_conf(lay))
        lay.slurmdbd_conf.write_text(render_slurmdbd_conf(lay))
        if lay.chrooted:
            lay.cgroup_conf.write_text(render_cgroup_conf(lay))
        os.chmod(lay.slurmdbd_conf, 0o600)
        lay.env_file.write_text(render_env_sh(lay))

    def _start_munged(self) -> None:
        lay = self.layout
        if _read_pid(lay.pid_file("munged")):
            return
        munge_ids = self._user_ids("munge")
        lay.munge_dir.mkdir(exist_ok=True)
        # Every local user may reach the socket (search, no listing); the key stays 0400.
        os.chmod(lay.munge_dir, 0o711)
        if not lay.munge_key.exists():
            lay.munge_key.write_bytes(os.urandom(1024))
        os.chmod(lay.munge_key, 0o400)
        for path in (lay.munge_dir, lay.munge_key):
            os.chown(path, *munge_ids)
        pid_file = lay.munge_dir / "munged.pid"
        self._run(
            self._daemon_argv(
                "munged",
                "--force",
                f"--key-file={lay.munge_key}",
                f"--socket={lay.munge_socket}",
                f"--pid-file={pid_file}",
                f"--log-file={lay.munge_dir / 'munged.log'}",
                f"--seed-file={lay.munge_dir / 'munged.seed'}",
                user="munge",
            )
        )
        wait_for(lambda: _read_pid(pid_file) is not None, 15, "munged")
        lay.pid_file("munged").write_text(pid_file.read_text())

    def _start_mysql(self) -> None:
        lay = self.layout
        if _read_pid(lay.pid_file("mysqld")):
            return
        initialised = (lay.mysql_dir / "mysql").is_dir()
        lay.mysql_dir.mkdir(exist_ok=True)
        os.chown(lay.mysql_dir, *self._user_ids("mysql"))
        if not initialised:
            self._run(
                self._daemon_argv(
                    "mariadb-install-db",
                    "--no-defaults",
                    f"--datadir={lay.mysql_dir}",
                    "--user=mysql",
                    "--auth-root-authentication-method=socket",
                    "--skip-test-db",
                ),
                timeout=180,
            )
        # MariaDB 11.8 (trixie) turns TLS on by itself, and slurmdbd 24.11.5 with its
        # libmariadb then dies at start ("_check_mysql_concat_is_sane: null result"):
        # a loopback-only database needs no TLS.
        no_tls = ("--skip-ssl",) if lay.chrooted else ()
        with open(lay.log_dir / "mysqld.out", "ab") as out:
            proc = subprocess.Popen(
                self._daemon_argv(
                    "mariadbd",
                    "--no-defaults",
                    *no_tls,
                    f"--datadir={lay.mysql_dir}",
                    f"--socket={lay.mysql_socket}",
                    f"--port={lay.mysql_port}",
                    "--bind-address=127.0.0.1",
                    "--user=mysql",
                    "--skip-log-bin",
                    "--innodb-buffer-pool-size=128M",
                    "--innodb-lock-wait-timeout=900",
                    f"--log-error={lay.log_dir / 'mysqld.log'}",
                ),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                env=self._daemon_env(),
            )
        lay.pid_file("mysqld").write_text(f"{proc.pid}\n")
        sql = self._daemon_argv(
            "mariadb", "--no-defaults", *no_tls, f"--socket={lay.mysql_socket}", "-u", "root"
        )
        wait_for(
            lambda: (
                proc.poll() is None
                and self._run(sql + ["-e", "SELECT 1"], check=False).returncode == 0
            ),
            60,
            "MariaDB to accept connections",
        )
        pw = lay.db_password
        grants = "".join(
            f"CREATE USER IF NOT EXISTS 'slurm'@'{h}' IDENTIFIED BY '{pw}';"
            f"GRANT ALL ON slurm_acct_db.* TO 'slurm'@'{h}';"
            for h in ("localhost", "127.0.0.1")
        )
        self._run(sql + ["-e", grants + "FLUSH PRIVILEGES;"])

    def _start_slurmdbd(self) -> None:
        lay = self.layout
        if not _read_pid(lay.pid_file("slurmdbd")):
            self._run(self._daemon_argv("slurmdbd"))
        wait_for(
            lambda: (
                self._run(
                    ["sacctmgr", "-n", "-P", "show", "cluster"], check=False, timeout=15
                ).returncode
                == 0
            ),
            60,
            "slurmdbd to answer",
        )

    def _register_accounting(self) -> None:
        lay = self.layout
        have = self._run(["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster"]).stdout
        if lay.cluster_name not in have.split():
            self._run(["sacctmgr", "-i", "add", "cluster", lay.cluster_name])
        accounts = self._run(["sacctmgr", "-n", "-P", "show", "account", "format=account"]).stdout
        if "ftslurm" not in accounts.split():
            self._run(
                [
                    "sacctmgr",
                    "-i",
                    "add",
                    "account",
                    "ftslurm",
                    f"cluster={lay.cluster_name}",
                    "description=ftslurm",
                    "organization=ftslurm",
                ]
            )
        self._register_user(pwd.getpwuid(os.geteuid()).pw_name)

    def _register_user(self, user: str) -> None:
        known = self._run(["sacctmgr", "-n", "-P", "show", "user", "format=user"]).stdout
        if user not in known.split():
            self._run(
                [
                    "sacctmgr",
                    "-i",
                    "add",
                    "user",
                    user,
                    "account=ftslurm",
                    f"cluster={self.layout.cluster_name}",
                ]
            )

    # ------------------------------------------------------- ordinary users
    def add_user(self, user: str) -> list[Path]:
        """Make `user` an ordinary user of this (running) cluster: the system account
        (created if missing), registered in accounting, able to reach this project's
        interpreter and code, and allowed the fault controls through sudo
        (`users.render_sudo_rule`). Returns the folders opened for it."""
        if os.geteuid() != 0:
            raise ClusterError("adding a user to the local cluster needs root")
        try:
            entry = users.ensure_account(user)
            if self.rootfs is not None:  # the chroot's daemons look users up in its files
                self.rootfs.add_account(entry)
            self._register_user(user)
            python = users.this_python()
            reach = [
                Path(python).parent,
                Path(os.path.realpath(python)).parent,
                Path(sys.base_prefix),
                Path(__file__).parents[2],
            ]
            if self.sysroot is not None:  # the wrappers look for the user's folder in it
                reach.append(self.sysroot.path)
            opened = [p for path in reach for p in users.open_path(user, path)]
            if not users.runs_as(user, [python, "-c", "import ftslurm.localcluster"]):
                raise ClusterError(
                    f"{user} cannot run {python} -m ftslurm (is the project "
                    "readable by other users?)"
                )
            users.ensure_sudo(users.render_sudo_rule(user, python))
            if self.sysroot is not None:
                chroot = shutil.which("chroot", path=sbin_path()) or "/usr/sbin/chroot"
                users.ensure_sudo(
                    users.render_chroot_rule(user, chroot, self.sysroot.path.parent),
                    users.CHROOT_SUDOERS_FILE,
                )
        except (users.UserError, RootfsError, subprocess.TimeoutExpired) as exc:
            raise ClusterError(str(exc)) from None
        return opened

    def _operator(self, *command: str) -> str:
        """Run a fault control as the cluster's operator (root) for a caller who is not:
        `users.operator_argv` through $FTSLURM_CLUSTER_OPERATOR (default `sudo -n`)."""
        argv = users.operator_argv(
            users.operator_prefix(), users.this_python(), self.version, self.layout.root, *command
        )
        what = f"{command[0]} is a fault control of the cluster's operator (root)"
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
            )
        except FileNotFoundError:
            raise ClusterError(
                f"{what}; {argv[0]} is missing", hint="run it as root, or `add-user` this user"
            ) from None
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raise ClusterError(
                f"{what}: {lines[-1] if lines else f'exit {proc.returncode}'}",
                hint="run it as root, or `add-user` this user",
            )
        return proc.stdout

    def _start_slurmctld(self, clear_state: bool) -> None:
        lay = self.layout
        if not _read_pid(lay.pid_file("slurmctld")):
            self._run(self._daemon_argv("slurmctld", *(["-i"] if clear_state else [])))
        wait_for(self._ping_controller, 60, "slurmctld to answer")

    def _start_slurmd(self, node: str) -> None:
        if _read_pid(self.layout.slurmd_pid_file(node)):
            return
        self._run(self._daemon_argv("slurmd", "-N", node), env=self._daemon_env(node))
        wait_for(
            lambda: _read_pid(self.layout.slurmd_pid_file(node)) is not None,
            30,
            f"slurmd of {node}",
        )

    def _ping_controller(self) -> bool:
        try:
            proc = self._run(["scontrol", "ping"], check=False, timeout=15)
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0 and "UP" in proc.stdout

    def _stop_pidfile(self, path: Path, timeout: float = 20) -> None:
        pid = _read_pid(path)
        if pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        try:
            wait_for(lambda: not pid_alive(pid), timeout, f"pid {pid} to exit", interval=0.1)
        except ClusterError:
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not pid_alive(pid), 10, f"pid {pid} to die", interval=0.1)

    def _kill_matching(self, match: Callable[[dict[str, str]], bool], sig: int) -> list[int]:
        me = os.getpid()
        victims = [pid for pid in _all_pids() if pid != me and match(_proc_environ(pid))]
        for pid in victims:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return victims


def _pids_in(text: str) -> list[int]:
    """The pids a fault control printed (`... (pids 12 34)`)."""
    found = re.search(r"\(pids([\d ]*)\)", text)
    return [int(p) for p in found.group(1).split()] if found else []


def _sbin(name: str) -> str:
    return shutil.which(name, path=sbin_path()) or name

"""Another Slurm release for the local cluster: a Debian root filesystem and a chroot into it.

The host's Debian packages give one Slurm release (22.05 on bookworm). Sites run newer ones,
so the harness can build a second Debian suite's root filesystem with `debootstrap`
(e.g. trixie, which ships Slurm 24.11), install Slurm, slurmdbd, munge and MariaDB in it, and
run a second cluster's daemons inside it with `chroot`. The root filesystem is built once
into a cache folder and reused while it is complete (its marker file is written last).

Each cluster mounts the cached tree at a folder of its own (`Sysroot`), with /proc, /dev,
/tmp, the cluster's folder (at the same path as on the host) and the host's /etc/hosts and
/etc/resolv.conf under it: daemons, job processes and the clients see the same paths as the
host, and share its loopback network and process table (so the fault controls that act on
processes work unchanged). `Sysroot.unmount` reads the mount table, not a record of what was
mounted, so it cleans up after a crash too.

Clients on the host go through small wrapper scripts (`write_client_wrappers`) that exec
the release's binaries inside the chroot with the cluster's SLURM_CONF; the Python backend
finds them first on PATH and drives the other release unchanged.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HOST_RELEASE = "22.05"  # what the host's own Debian packages install (bookworm)
DEFAULT_CACHE = Path(os.environ.get("FTSLURM_ROOTFS_CACHE", "/var/cache/ftslurm"))
DEFAULT_MIRROR = os.environ.get("FTSLURM_DEBIAN_MIRROR", "http://deb.debian.org/debian")
ROOTFS_PACKAGES = ("slurm-wlm", "slurm-client", "munge", "slurmdbd", "mariadb-server")
# Written into the root filesystem once it is complete; it also tells a wrapper script
# that it already runs inside the chroot (a job's `srun`), where it must not chroot again.
MARKER = Path("etc/ftslurm-rootfs")
CLIENTS = (
    "sacct",
    "sacctmgr",
    "salloc",
    "sbatch",
    "scancel",
    "scontrol",
    "sdiag",
    "sinfo",
    "sprio",
    "squeue",
    "sreport",
    "srun",
    "sshare",
    "sstat",
)
# Clients whose working directory matters: it becomes the job's. Elsewhere an invisible one
# is replaced by "/".
CWD_CLIENTS = ("salloc", "sbatch", "srun")
BUILD_TIMEOUT_S = 1800


class RootfsError(Exception):
    """The root filesystem could not be built or mounted (the harness wraps it)."""


@dataclass(frozen=True)
class SlurmRelease:
    """A Slurm release the local cluster can run, and where it comes from."""

    version: str  # "24.11": what `--version` takes and tests are named after
    suite: str  # the Debian suite that ships it
    base_port: int  # a port range of its own, so both clusters can run at once
    cluster_name: str
    # SlurmdTimeout of the local cluster. 24.11 pings every node in one agent and applies the
    # answers when the slowest is in: with one slurmd dead that round lasts MessageTimeout plus
    # TCPTimeout (12 s seen with the defaults), so at 10 s the living nodes were declared down
    # with the dead one (seen under load: "Nodes n[1-4] not responding, setting DOWN").
    slurmd_timeout: int = 10

    @property
    def rootfs_name(self) -> str:
        return f"{self.suite}-slurm-{self.version}"


# Releases that run from a chroot. HOST_RELEASE is the host's own and needs none.
RELEASES: dict[str, SlurmRelease] = {
    "24.11": SlurmRelease(
        "24.11", "trixie", base_port=17800, cluster_name="ftslurm2411", slurmd_timeout=30
    ),
}
VERSIONS = (HOST_RELEASE, *RELEASES)


def release_for(version: str) -> SlurmRelease | None:
    """The chroot release for `version`; None for the host's own. Unknown: RootfsError."""
    if version == HOST_RELEASE:
        return None
    if version not in RELEASES:
        raise RootfsError(f"unknown Slurm version {version!r}; known: {', '.join(VERSIONS)}")
    return RELEASES[version]


_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._/+-]*$")
_MIRROR = re.compile(r"^https?://[A-Za-z0-9.-]+(:\d+)?(/[A-Za-z0-9._~/-]*)?$")


def checked_path(path: Path, what: str) -> Path:
    """An absolute path made only of characters that need no care in a shell or a mount
    option; anything else is refused here rather than quoted everywhere downstream."""
    text = str(path)
    if not _SAFE_PATH.match(text) or "/../" in f"{text}/":
        raise RootfsError(f"{what} {text!r} must be an absolute path of letters, digits and ._+-")
    return path


def run_checked(argv: list[str], timeout: float = 600, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env
    )
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise RootfsError(
            f"{' '.join(argv[:3])} failed ({proc.returncode}): {lines[-1] if lines else ''}"
        )
    return proc.stdout


# ------------------------------------------------------------------ the mount table
def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below `path`, deepest first (from /proc/self/mountinfo)."""
    base = str(path)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = _unescape(line.split()[4])
            if point == base or point.startswith(base.rstrip("/") + "/"):
                found.append(Path(point))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


# ------------------------------------------------------------------ building
class Rootfs:
    """The cached root filesystem of one release: built once, reused while complete."""

    def __init__(
        self, release: SlurmRelease, cache: Path = DEFAULT_CACHE, mirror: str = DEFAULT_MIRROR
    ) -> None:
        self.release = release
        self.cache = checked_path(Path(cache).resolve(), "the root filesystem cache")
        if not _MIRROR.match(mirror):
            raise RootfsError(f"Debian mirror {mirror!r} must be an http(s) URL")
        self.mirror = mirror
        self.path = self.cache / release.rootfs_name

    def complete(self) -> bool:
        return (self.path / MARKER).is_file()

    def version(self) -> str:
        """The Slurm version installed (as dpkg reported it when the tree was built)."""
        return (self.path / MARKER).read_text().strip() if self.complete() else ""

    def binary(self, name: str) -> str:
        """Where `name` lives inside the tree (/usr/sbin/slurmd, /usr/bin/mariadb, ...).

        Debian's alternatives make some of them absolute links (`/usr/sbin/slurmctld ->
        /etc/alternatives/slurmctld`) that only resolve inside the tree, so the link itself
        is what counts here, not whether the host happens to have the same one."""
        for folder in ("usr/sbin", "usr/bin", "sbin", "bin"):
            if os.path.lexists(self.path / folder / name):
                return f"/{folder}/{name}"
        raise RootfsError(f"{name} is missing from {self.path}; remove it to rebuild")

    def ensure(self) -> float:
        """Build the tree unless a complete one is cached; the seconds the build took."""
        if self.complete():
            return 0.0
        begin = time.monotonic()
        ensure_debian_package("debootstrap", "debootstrap")
        partial = self.path.with_name(self.path.name + ".partial")
        if mounts_under(partial):
            raise RootfsError(f"{partial} still has mounts; unmount them first")
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        log.info("building a Debian %s root filesystem in %s", self.release.suite, partial)
        run_checked(
            ["debootstrap", "--variant=minbase", self.release.suite, str(partial), self.mirror],
            timeout=BUILD_TIMEOUT_S,
        )
        # No package may start a daemon while it is installed into the tree.
        policy = partial / "usr/sbin/policy-rc.d"
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        proc = partial / "proc"
        run_checked(["mount", "-t", "proc", "proc", str(proc)])
        try:
            env = {
                "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                "DEBIAN_FRONTEND": "noninteractive",
                "LC_ALL": "C",
            }
            log.info("installing %s into it", " ".join(ROOTFS_PACKAGES))
            run_checked(["chroot", str(partial), "apt-get", "update", "-qq"], BUILD_TIMEOUT_S, env)
            install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends"]
            run_checked(["chroot", str(partial), *install, *ROOTFS_PACKAGES], BUILD_TIMEOUT_S, env)
            run_checked(["chroot", str(partial), "apt-get", "clean"], 120, env)
            version = run_checked(
                ["chroot", str(partial), "dpkg-query", "-W", "-f=${Version}", "slurm-client"],
                60,
                env,
            ).strip()
        finally:
            subprocess.run(["umount", str(proc)], capture_output=True, check=False)
        if not version.startswith(self.release.version + "."):
            raise RootfsError(
                f"{self.release.suite} installed Slurm {version}, not {self.release.version}"
            )
        (partial / MARKER).write_text(version + "\n")
        if self.path.exists():
            if mounts_under(self.path):
                raise RootfsError(f"{self.path} is incomplete but mounted; unmount it first")
            shutil.rmtree(self.path)
        partial.rename(self.path)
        took = time.monotonic() - begin
        log.info("root filesystem with Slurm %s ready in %.0f s", version, took)
        return took

    def add_account(self, entry: pwd.struct_passwd) -> None:
        """Give the tree the host's account `entry` (same name and ids) and its group, so
        the chroot's daemons know a host user's jobs; a no-op when the name is there."""
        with contextlib.suppress(RootfsError):
            self.passwd_ids(entry.pw_name)
            return
        group = grp.getgrgid(entry.pw_gid).gr_name
        with open(self.path / "etc/group", "a") as f:
            f.write(f"{group}:x:{entry.pw_gid}:\n")
        with open(self.path / "etc/passwd", "a") as f:
            f.write(
                f"{entry.pw_name}:x:{entry.pw_uid}:{entry.pw_gid}::{entry.pw_dir}:"
                f"{entry.pw_shell}\n"
            )

    def passwd_ids(self, user: str) -> tuple[int, int]:
        """(uid, gid) of `user` in the tree's /etc/passwd (its ids may differ from the host's)."""
        for line in (self.path / "etc/passwd").read_text().splitlines():
            fields = line.split(":")
            if len(fields) > 3 and fields[0] == user:
                return int(fields[2]), int(fields[3])
        raise RootfsError(f"no user {user!r} in {self.path}/etc/passwd")


def sbin_path() -> str:
    """PATH plus the system folders a user's PATH may lack (where root's tools live)."""
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def ensure_debian_package(binary: str, package: str) -> None:
    """Install Debian's `package` (root, apt) unless `binary` is already on the PATH or in
    /usr/sbin; the package lists are fetched first."""
    if shutil.which(binary, path=sbin_path()):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RootfsError(f"{binary} is missing; install Debian's {package} package (root)")
    log.info("installing %s", package)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package],
    ):
        run_checked(argv, 900, env)


# ------------------------------------------------------------------ one cluster's chroot
class Sysroot:
    """One cluster's view of a cached root filesystem: a bind mount at `path` with the
    host's /proc, /dev, /tmp and the cluster's folder under it."""

    def __init__(self, rootfs: Rootfs, path: Path, cluster_root: Path) -> None:
        self.rootfs = rootfs
        self.path = checked_path(path, "the chroot folder")
        self.cluster_root = checked_path(cluster_root, "the cluster folder")

    def _binds(self) -> list[tuple[str, Path]]:
        """(host source, mount point) after the tree itself, in mount order."""
        binds = [("/dev", self.path / "dev"), ("/tmp", self.path / "tmp")]
        if not self.cluster_root.is_relative_to("/tmp"):
            binds.append((str(self.cluster_root), self.path / self.cluster_root.relative_to("/")))
        for name in ("hosts", "resolv.conf"):
            if Path("/etc", name).is_file():
                binds.append((f"/etc/{name}", self.path / "etc" / name))
        return binds

    def mount(self) -> None:
        """Mount what is missing (after a crash some may be there already)."""
        have = set(mounts_under(self.path))
        self.path.mkdir(parents=True, exist_ok=True)
        if self.path not in have:
            run_checked(["mount", "--bind", str(self.rootfs.path), str(self.path)])
            # Mounts made below it are ours alone: none propagates back to the host.
            run_checked(["mount", "--make-rslave", str(self.path)])
        if self.path / "proc" not in have:
            run_checked(["mount", "-t", "proc", "proc", str(self.path / "proc")])
        for source, target in self._binds():
            if target in have:
                continue
            if Path(source).is_dir():
                target.mkdir(parents=True, exist_ok=True)
            elif not target.exists():
                target.touch()  # a minbase tree has no /etc/hosts to mount over
            flag = "--rbind" if source == "/dev" else "--bind"  # /dev/shm, /dev/pts with it
            run_checked(["mount", flag, source, str(target)])
            run_checked(["mount", "--make-rslave", str(target)])

    def mounted(self) -> bool:
        return self.path in mounts_under(self.path)

    def unmount(self) -> None:
        """Unmount everything at or below `path`, deepest first; a busy one lazily."""
        for point in mounts_under(self.path):
            proc = subprocess.run(["umount", str(point)], capture_output=True, check=False)
            if proc.returncode != 0:
                subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)
        left = mounts_under(self.path)
        if left:
            raise RootfsError(f"could not unmount {left[0]}")

    def argv(self, name: str, *args: str) -> list[str]:
        """Run the tree's `name` (a daemon or a client) inside the chroot."""
        return ["chroot", str(self.path), self.rootfs.binary(name), *args]


def render_client_wrapper(tool: str, binary: str, sysroot: Path, slurm_conf: Path) -> str:
    """A host-side `tool` that runs the chroot's `binary` with the cluster's SLURM_CONF.

    It keeps the caller's working directory (the job's, for sbatch) when the chroot can see
    it; inside the chroot already (a job's srun) it execs the binary directly. Entering a
    chroot needs root: a user's call enters it through sudo (`users.render_chroot_rule`)
    and runs the client as that user (`chroot --userspec`), with the user's environment and
    PATH, so Slurm sees the user's request."""
    root, conf, exe = (shlex.quote(str(v)) for v in (sysroot, slurm_conf, binary))
    if tool in CWD_CLIENTS:
        elsewhere = (
            f'echo "{tool}: the working directory $PWD is not visible to the '
            f'Slurm chroot (only /tmp and the cluster folder are)" >&2; exit 2'
        )
    else:
        elsewhere = "cwd=/"
    return f"""#!/bin/sh
# Written by ftslurm's local cluster harness: {tool} from a chrooted Slurm release.
if [ -e /{MARKER} ]; then SLURM_CONF={conf} exec {exe} "$@"; fi
cwd=$PWD
[ -d {root}"$cwd" ] || {{ {elsewhere}; }}
[ "$(id -u)" = 0 ] && exec chroot {root} /usr/bin/env -C "$cwd" SLURM_CONF={conf} {exe} "$@"
exec sudo -n -E chroot --userspec="$(id -u):$(id -g)" {root} \\
    /usr/bin/env -C "$cwd" PATH="$PATH" SLURM_CONF={conf} {exe} "$@"
"""


def write_client_wrappers(bin_dir: Path, rootfs: Rootfs, sysroot: Path, slurm_conf: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in CLIENTS:
        try:
            binary = rootfs.binary(tool)
        except RootfsError:
            continue  # not every release ships every client
        path = bin_dir / tool
        path.write_text(render_client_wrapper(tool, binary, sysroot, slurm_conf))
        path.chmod(0o755)

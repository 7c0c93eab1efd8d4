"""The daemon process: one per state directory, started on demand, stoppable, restartable.

`serve` is the foreground loop (`ftslurm daemon run`, e.g. under a systemd user unit);
`start` launches it detached and waits until it holds the lock; `stop` asks it to end.
Commands that change a run (`submit`, `cancel`) call `wake` so the loop looks at once;
between cycles the loop looks every `LOOK_S` at the running attempts' recovery folders,
node reports and batch host leases (no scheduler query) and runs a cycle at once when a
node was reported lost, a launcher ended or the batch host's lease fell silent.

One daemon per state directory, whatever host it runs on: the local `DaemonLock` keeps one
per host; across hosts sharing the directory (a network home, a daemon running as a Slurm
job) the daemon takes the lease in the database (`LeaseKeeper`), renews it every few
seconds from a thread of its own, and stops itself when it finds the lease taken. A daemon
that finds another host's lease renewed while it watches refuses to serve; one silent for
`DAEMON_LEASE_TIMEOUT_S` (the holder died with its host) is taken over.

Guarding the state (docs/daemon.md): the daemon refuses a damaged database at start
(`quick_check`) or one that lost committed changes (the mark); after a cycle that wrote,
it checkpoints the WAL into the database file and records the newest event id in the mark;
it backs the database up at start and every `BACKUP_INTERVAL_S` while something changed.
A full disk is logged once per episode and the loop keeps its cadence.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from ftslurm.backends import create_backend, split_backend_key
from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.core.leases import (
    DAEMON_LEASE_TIMEOUT_S,
    DaemonLease,
    Seen,
    daemon_lease_verdict,
    observe,
    poll_interval,
)
from ftslurm.daemon import as_job
from ftslurm.daemon.reconcile import Reconciler
from ftslurm.daemon.records import parse_tag
from ftslurm.daemon.store import (
    DB_NAME,
    DaemonAlreadyRunning,
    DaemonLock,
    DiskFull,
    Restored,
    StateError,
    Store,
    marked_backends,
    mirrored_runs,
    os_state_error,
    recover_state,
    this_host,
    write_mark,
)
from ftslurm.daemon.submission import backend_key
from ftslurm.errors import FtslurmError, TransientError
from ftslurm.paths import HOME_ENV

log = logging.getLogger("ftslurm.daemon")
WAKE_FILE = "wake"
LOG_FILE = "daemon.log"
BACKUP_INTERVAL_S = 300.0  # a backup at most this often, and only when something changed
# How often the daemon looks at the running attempts' recovery folders, node reports and
# batch host leases between cycles (`Reconciler.look`: no scheduler query), so a lost node
# is acted on in seconds whatever the back-off between cycles (up to a minute).
LOOK_S = 1.0


def wake(home: Path) -> None:
    """Ask a running daemon to run a cycle now (it watches this file's mtime)."""
    path = Path(home) / WAKE_FILE
    path.touch()
    os.utime(path)


class Keeper:
    """The daemon's care of its database between cycles: WAL checkpoint and mark after a
    cycle that wrote, a backup every `backup_interval_s` when something changed and at once
    when a run was added."""

    def __init__(self, store: Store, backup_interval_s: float) -> None:
        self.store = store
        self.backends = set(marked_backends(store.home))  # keys of the backends used
        self.backup_interval_s = backup_interval_s
        self._marked = (-1, -1)  # (connection changes, newest event id) last recorded
        self._backed_up: tuple[int, int] | None = None
        self._backed_up_run = -1  # the newest run (`Store.newest_run`) at the last backup
        self.next_backup = time.monotonic()

    def after_cycle(self, backends: Iterable[str] = ()) -> None:
        """Raises `StateError` (e.g. `DiskFull`) when a step could not be done."""
        newest = self.store.newest_event_id()
        seen = (self.store.changes(), newest)
        if seen != self._marked or not self.backends.issuperset(backends):
            self.store.checkpoint()
            self.backends.update(backends)
            try:
                write_mark(self.store.home, newest, self.backends)
            except OSError as exc:
                raise os_state_error(exc, self.store.home) from None
            self._marked = seen
        newest_run = self.store.newest_run()
        if time.monotonic() >= self.next_backup or newest_run != self._backed_up_run:
            # A new run is backed up at once: a backup without it could not bring it back.
            self._backed_up_run = newest_run
            if seen != self._backed_up:
                self.store.backup()
                self._backed_up = seen
                log.info("backed up %s (newest event %d)", self.store.path, newest)
            self.next_backup = time.monotonic() + self.backup_interval_s


class LeaseKeeper:
    """This daemon's lease on the state directory (module doc; `core.leases`)."""

    def __init__(
        self,
        store: Store,
        host: str,
        pid: int,
        timeout_s: float = DAEMON_LEASE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        job_id: str | None = None,
    ) -> None:
        self.store, self.host, self.pid, self.job_id = store, host, pid, job_id
        self.timeout_s, self.clock = timeout_s, clock
        self.owner = f"{host}:{pid}:{secrets.token_hex(4)}"
        self.held: DaemonLease | None = None  # what this daemon last wrote
        self.lost = threading.Event()  # set when another daemon took the lease over
        self._renewing = threading.Lock()  # the loop and the renewal thread both renew

    def _lease(self, seq: int, ended: str | None = None) -> DaemonLease:
        return DaemonLease(self.owner, self.host, self.pid, seq, time.time(), ended, self.job_id)

    def acquire(self, stop: threading.Event, patient: bool = False) -> None:
        """Take the lease, waiting (up to the timeout) while another host's holder has not
        shown whether it lives; `DaemonAlreadyRunning` when it does, unless `patient` (a
        daemon job's successor): then wait until it is released or falls silent."""
        seen = Seen(0, changed_at=self.clock())
        told = False
        while not stop.is_set():
            current = self.store.daemon_lease()
            seen = observe(seen, current, self.clock(), time.time())
            verdict = daemon_lease_verdict(
                current, seen, host=self.host, now=self.clock(), timeout=self.timeout_s
            )
            if verdict == "take":
                mine = self._lease(0)
                if self.store.swap_daemon_lease(mine, current):
                    if current is not None and current.ended is None:
                        log.warning(
                            "took over the lease of %s (pid %d on %s), silent for %.0fs",
                            self.store.home,
                            current.pid,
                            current.host,
                            self.clock() - seen.changed_at,
                        )
                    self.held = mine
                    return
                continue  # another daemon moved it meanwhile: read again
            assert current is not None
            if verdict == "held" and patient:
                seen = Seen(0, changed_at=self.clock())  # alive: silence counts from now
            elif verdict == "held":
                raise DaemonAlreadyRunning(
                    f"a daemon already serves {self.store.home} on host {current.host} "
                    f"(pid {current.pid})",
                    hint="use that one, or stop it on its host",
                )
            if not told:
                log.info(
                    "the lease of %s is held by pid %d on %s: waiting up to %.0fs to "
                    "see it renewed or silent",
                    self.store.home,
                    current.pid,
                    current.host,
                    self.timeout_s,
                )
                told = True
            stop.wait(poll_interval(self.timeout_s))
        raise DaemonAlreadyRunning("stopped while waiting for the daemon lease")

    def renew(self) -> bool:
        """Renew the lease; False (and `lost` set) when another daemon has taken it."""
        with self._renewing:
            held = self.held
            if held is None or self.lost.is_set():
                return False
            mine = self._lease(held.seq + 1)
            if self.store.swap_daemon_lease(mine, held):
                self.held = mine
                return True
            self.lost.set()
            return False

    def keep(self, stop: threading.Event) -> threading.Thread:
        """Renew every poll interval in a thread until `stop`; a lost lease sets `stop`."""

        def run() -> None:
            while not stop.wait(poll_interval(self.timeout_s)):
                try:
                    if not self.renew():
                        taken = self.store.daemon_lease()
                        log.error(
                            "the lease of %s was taken over by %s: stopping",
                            self.store.home,
                            taken.owner if taken else "nobody",
                        )
                        stop.set()
                        return
                except StateError as exc:  # the next renewal tries again
                    log.warning("could not renew the daemon lease: %s", exc.user_message())

        thread = threading.Thread(target=run, name="ftslurm-lease", daemon=True)
        thread.start()
        return thread

    def release(self) -> None:
        """Mark the lease released, if it is still this daemon's."""
        with self._renewing:
            held = self.held
            if held is None or self.lost.is_set():
                return
            with contextlib.suppress(StateError):
                self.store.swap_daemon_lease(self._lease(held.seq + 1, "stopped"), held)
            self.held = None


def _take_lock(lock: DaemonLock, stop: threading.Event, patient: bool) -> None:
    """Take this host's daemon lock; `patient` (a daemon job's successor, which may land on
    its predecessor's node): wait until the predecessor has left instead of refusing."""
    told = False
    while True:
        try:
            lock.acquire()
            return
        except DaemonAlreadyRunning:
            if not patient or stop.is_set():
                raise
            if not told:
                log.info("waiting for the daemon on this node to hand over and leave")
                told = True
            stop.wait(0.5)


def serve(
    home: Path,
    stop: threading.Event | None = None,
    backup_interval_s: float = BACKUP_INTERVAL_S,
    lease_timeout_s: float = DAEMON_LEASE_TIMEOUT_S,
    job: bool = False,
    successor: bool = False,
) -> None:
    """Run the reconcile loop until `stop` is set or SIGTERM/SIGINT arrives. `job`: this
    daemon is a Slurm job (`as_job`): it hands over to a successor at the handover signal;
    `successor`: it is one, and waits for its predecessor's lease."""
    home = Path(home)
    stop = stop or threading.Event()
    cache: dict[str, SchedulerBackend] = {}

    def backends(key: str) -> SchedulerBackend:
        if key not in cache:
            cache[key] = create_backend(*split_backend_key(key), abort=stop)
        return cache[key]

    handover = as_job.Handover(home, lambda: backends("slurm")) if job else None
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        if handover is not None:
            handover.install()
    host = this_host()
    lock = DaemonLock(home, host)
    _take_lock(lock, stop, patient=successor)
    try:
        store, lease, keeper = _open(
            home, host, stop, backup_interval_s, lease_timeout_s, job, successor
        )
    except BaseException:
        lock.release()
        raise
    renewer = lease.keep(stop)
    reconciler = Reconciler(store, backends, stop=stop)
    log.info("daemon %d serving %s", os.getpid(), home)
    disk_full = False  # an episode of a full disk is logged once, at its start and end
    try:
        while not stop.is_set():
            interval, full_now = _cycle(reconciler, lease, keeper, cache, home)
            if interval is None:
                break
            if full_now and not disk_full:
                log.error(
                    "disk full: %s; nothing recorded is lost, polling goes on and "
                    "recording resumes when there is room",
                    store.path,
                )
            elif disk_full and not full_now:
                log.warning("disk no longer full: %s; recording again", store.path)
            disk_full = full_now
            if handover is not None and handover.due():
                break  # the successor runs: the lease is released on the way out
            if handover is not None and handover.requested.is_set():
                interval = min(interval, as_job.SUCCESSOR_POLL_S)
            wait_s = min(interval, keeper.next_backup - time.monotonic())
            _idle(reconciler, stop, home / WAKE_FILE, wait_s)
    finally:
        stop.set()
        renewer.join()
        lease.release()
        store.close()
        lock.release()
        log.info("daemon %d stopped", os.getpid())


def _open(
    home: Path,
    host: str,
    stop: threading.Event,
    backup_interval_s: float,
    lease_timeout_s: float,
    job: bool,
    successor: bool,
) -> tuple[Store, LeaseKeeper, Keeper]:
    """The state database checked, the daemon lease taken and the first backup made."""
    store = Store(home)
    try:
        store.check_integrity()
        lease = LeaseKeeper(
            store,
            host,
            os.getpid(),
            lease_timeout_s,
            job_id=os.environ.get("SLURM_JOB_ID") if job else None,
        )
        lease.acquire(stop, patient=successor)
        keeper = Keeper(store, backup_interval_s)
        try:
            keeper.after_cycle()  # the backup at start, once the database passed the check
        except DiskFull as exc:  # serve all the same; the loop logs the episode
            log.error("%s; no backup at start", exc.message)
    except BaseException:
        store.close()
        raise
    return store, lease, keeper


def _cycle(
    reconciler: Reconciler,
    lease: LeaseKeeper,
    keeper: Keeper,
    cache: dict[str, SchedulerBackend],
    home: Path,
) -> tuple[float | None, bool]:
    """One reconcile cycle and the backup after it: the seconds to the next cycle (None:
    stop, the lease was taken over) and whether the disk was full."""
    full_now = False
    try:
        # A daemon that was paused (or cut off) past the lease timeout may have been
        # replaced: it checks before it acts, not only in the renewal thread.
        if not lease.renew():
            log.error("the lease of %s was taken over: stopping", home)
            return None, False
        interval = reconciler.cycle()
    except DiskFull:
        full_now, interval = True, reconciler.interval  # the usual cadence
    except FtslurmError as exc:
        log.warning("cycle failed: %s", exc.user_message())
        interval = 5.0
    except Exception:  # keep serving every other run; the log has the details
        log.exception("cycle failed")
        interval = 5.0
    try:
        keeper.after_cycle(cache)
    except DiskFull:
        full_now = True
    except StateError as exc:
        log.warning("could not checkpoint or back up: %s", exc.user_message())
    return interval, full_now


def _idle(reconciler: Reconciler, stop: threading.Event, wake_path: Path, wait_s: float) -> None:
    """Wait `wait_s` for the next cycle, or less: a command's wake-up, or a look (every
    second, whatever the back-off: a loss waits not) that finds a cycle due."""
    seen = _mtime(wake_path)
    deadline = time.monotonic() + wait_s
    next_look = time.monotonic() + LOOK_S
    while not stop.is_set() and time.monotonic() < deadline:
        if _mtime(wake_path) != seen:
            return
        if time.monotonic() >= next_look:
            began = time.monotonic()
            if _looked(reconciler):
                return
            took = time.monotonic() - began  # at most a tenth of the daemon's time
            next_look = time.monotonic() + max(LOOK_S, 10 * took)
        stop.wait(min(0.1, max(0.0, deadline - time.monotonic())))


def _looked(reconciler: Reconciler) -> bool:
    """`Reconciler.look`: whether a cycle must run now. A failed look waits for the cycle,
    which reads the same files and says what is wrong."""
    try:
        return reconciler.look()
    except Exception as exc:
        log.debug("look between cycles failed: %s", exc)
        return False


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0.0


@dataclass(frozen=True)
class Serving:
    """The daemon serving a state directory: this host's, or another host's (found through
    its lease in the database)."""

    host: str
    pid: int
    here: bool
    job_id: str | None = None  # the Slurm job it runs in (`ftslurm daemon submit`)
    pending: bool = False  # a daemon job still waiting in the queue (no host, no pid yet)

    def describe(self) -> str:
        if self.pending:
            return f"Slurm job {self.job_id}, pending"
        job = f", Slurm job {self.job_id}" if self.job_id else ""
        return f"pid {self.pid}{job}" if self.here else f"pid {self.pid} on host {self.host}{job}"


def serving(home: Path) -> Serving | None:
    """Which daemon serves `home`: this host's (it holds the lock), else another host's
    whose lease is held and was renewed within `DAEMON_LEASE_TIMEOUT_S` by this host's wall
    clock (an estimate, used only to find it: a daemon starting here runs the real test,
    `LeaseKeeper.acquire`); None when none does."""
    pid = running_pid(home)
    if pid is not None:
        return Serving(this_host(), pid, True)
    if not (Path(home) / DB_NAME).exists():
        return None
    try:
        with Store(home) as store:
            lease = store.daemon_lease()
    except StateError:  # a damaged database: whoever serves it, it is not served well
        return None
    if (
        lease is None
        or lease.ended is not None
        or lease.host == this_host()
        or abs(time.time() - lease.time) > DAEMON_LEASE_TIMEOUT_S
    ):
        return None
    return Serving(lease.host, lease.pid, False, lease.job_id)


def queued_daemon_job(home: Path) -> Serving | None:
    """The daemon job submitted last (`ftslurm daemon submit`) while it has not ended (it
    waits in the queue, or starts and has not taken the lease yet); None otherwise."""
    job = as_job.recorded(home)
    if job is None:
        return None
    info = create_backend("slurm").query([job[0]]).get(job[0])
    if info is None or info.state.is_terminal:
        return None
    return Serving("", 0, False, job[0], pending=True)


def running_pid(home: Path) -> int | None:
    """This host's daemon's pid, or None when none holds the lock here."""
    for _ in range(40):  # a daemon that just took the lock writes its pid at once
        pid = DaemonLock.holder_pid(home, this_host())
        if pid is None or pid > 0:
            return pid
        time.sleep(0.05)
    return None


def start(home: Path, timeout_s: float = 15.0, auto: bool = True) -> Serving:
    """Start the daemon for `home` on this host unless one serves it (here or on another
    host sharing the directory); return the one that serves. `auto` (a command that needs
    a daemon): where a daemon job was submitted (`ftslurm daemon submit`), never start one
    here: a queued daemon job counts as serving, an ended one is an error that says what to
    do. Not `auto` (`ftslurm daemon start`): serve from this host from now on."""
    home = Path(home)
    with Store(home) as store:  # creates the folder (0700) and the database
        store.check_integrity()  # refuse here, in one line, what the daemon would refuse
    found = serving(home)
    if found is not None:
        return found
    job = as_job.recorded(home)
    if job is not None and auto:
        queued = queued_daemon_job(home)
        if queued is not None:
            return queued
        raise FtslurmError(
            f"the daemon job {job[0]} has ended",
            hint="`ftslurm daemon submit` submits another; `ftslurm daemon "
            "start` serves from this host instead",
        )
    if job is not None:
        (home / as_job.DAEMON_JOB_FILE).unlink(missing_ok=True)
    logf = open(home / LOG_FILE, "ab")
    os.chmod(home / LOG_FILE, 0o600)
    env = dict(os.environ, **{HOME_ENV: str(home)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftslurm", "daemon", "run"],
        stdin=subprocess.DEVNULL,
        stdout=logf,
        stderr=logf,
        start_new_session=True,
        close_fds=True,
        env=env,
    )
    logf.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = running_pid(home)
        if pid is not None:
            threading.Thread(target=proc.wait, daemon=True).start()
            return Serving(this_host(), pid, True)
        code = proc.poll()
        if code is not None:
            found = serving(home)  # another start won the race, here or elsewhere
            if found is not None:
                return found
            raise FtslurmError(f"the daemon exited at once (code {code}); see {home / LOG_FILE}")
        time.sleep(0.05)
    raise FtslurmError(f"the daemon did not start within {timeout_s:.0f}s; see {home / LOG_FILE}")


def stop(home: Path, timeout_s: float = 30.0) -> int | None:
    """Stop this host's daemon for `home`; return the pid it had (None if none ran). A
    daemon serving from another host cannot be signalled from here: one line says where."""
    pid = running_pid(home)
    if pid is None:
        elsewhere = serving(home)
        if elsewhere is not None:
            raise FtslurmError(
                f"the daemon serving {home} runs on host {elsewhere.host} (pid {elsewhere.pid})",
                hint="stop it on that host",
            )
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if running_pid(home) is None:
            return pid
        time.sleep(0.05)
    raise FtslurmError(f"the daemon (pid {pid}) did not stop within {timeout_s:.0f}s")


def recover(home: Path) -> Restored:
    """Rebuild lost runs, or put the last backup back (`store.recover_state`); refused while
    a daemon runs (the daemon lock is held throughout, so none can start meanwhile). The
    scheduler is asked first which tagged jobs are active: the runs they belong to are
    adopted, and those no run claims afterwards are named."""
    lock = DaemonLock(home, this_host())
    lock.acquire()
    try:
        elsewhere = serving(home)
        if elsewhere is not None and not elsewhere.here:
            raise DaemonAlreadyRunning(
                f"a daemon serves {home} on host {elsewhere.host} (pid {elsewhere.pid})",
                hint="stop it first",
            )
        jobs = tagged_jobs(home)  # asked first: a scheduler that cannot answer stops it here
        newest: dict[str, tuple[int, str]] = {}
        for job_id, (run_id, attempt) in sorted(jobs.items(), key=lambda j: j[1][1]):
            newest[run_id] = (attempt, job_id)
        restored = recover_state(home, active=newest)
        with Store(home) as store:
            known = {r.run_id for r in store.list_runs()}
        unknown = sorted((job, run) for job, (run, _) in jobs.items() if run not in known)
        return replace(
            restored,
            rebuilt=[
                *restored.rebuilt,
                *(
                    f"job {job} carries the tag of run {run}, which neither the backup nor a "
                    "run folder holds: nothing manages it (cancel it, or submit the run again)"
                    for job, run in unknown
                ),
            ],
        )
    finally:
        lock.release()


def tagged_jobs(home: Path) -> dict[str, tuple[str, int]]:
    """Job id -> (run id, attempt) of the active jobs that carry an ftslurm tag, on every
    backend this state directory used (the mark's, the run folders'). A backend that cannot
    answer is a `TransientError`: recovering without its answer could lose a run's job."""
    keys = set(marked_backends(home)) | {
        backend_key(m["spec"]) for m in mirrored_runs(home).values() if "backend" in m["spec"]
    }
    found: dict[str, tuple[str, int]] = {}
    for key in sorted(keys):
        try:
            jobs = create_backend(*split_backend_key(key)).active_jobs()
        except FtslurmError as exc:
            raise TransientError(
                f"cannot ask the scheduler ({key}) which jobs are active: {exc.user_message()}",
                hint="recover when it answers; nothing was changed",
            ) from None
        for job in jobs:
            parsed = parse_tag(job.comment)
            if parsed is not None:
                found[job.job_id] = parsed
    return found


def configure_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )

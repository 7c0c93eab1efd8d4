"""The pre-flight health check a node's launcher runs before it joins the rendezvous (the
shell; the rules are `ftslurm.agent.health_rules`).

Within one bound for every check together (`HealthConfig.timeout_s`, 5 s by default), in
this order: the checkpoint directory (and the `dirs` a site adds, `{node}` replaced by the
node's name) reachable and writable at a sane speed (a small file written and fsynced,
then removed; a folder not made yet is probed in its nearest existing parent); free
memory; free space of the checkpoint directory's file system; the GPUs the job asked for
(count, a small kernel, memory free, in a process of its own started first, with
GPU_PROBE_S of its own: torch's import and CUDA's start take seconds; a CPU job skips it);
the site's command (as Slurm's HealthCheckProgram: non-zero or no exit within the bound
fails); last, on a job of at least MIN_NETWORK_PEERS + 1 nodes with a run directory, a
timed transfer to node rank 0's launcher, compared with the other nodes' (below a share of
the median fails; a peer missing or late makes it inconclusive, which passes). Every probe
that could block (a hung mount, a GPU driver, the command, a socket) runs bounded: past
the bound, the filesystem probe fails (a mount that takes the whole bound for a small file
is broken), the GPU and network probes pass as inconclusive.

An `unhealthy` fault injection aimed at the node (`ftslurm.core.inject`) fails its first
check at once, and is recorded in the run (`RunDir.fired_unhealthy`) so it fires once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ftslurm.agent import health_rules as rules
from ftslurm.agent.health_rules import Check, Result
from ftslurm.core.contract import EnvName, HealthConfig, RunDir
from ftslurm.core.inject import Injection
from ftslurm.fsutil import read_json, write_json_atomic

log = logging.getLogger("ftslurm.launch")

PROBE_BYTES = 1024 * 1024  # the file written and fsynced in each folder
NET_BYTES = 4 * 1024 * 1024  # the payload each node sends to node rank 0
SERVE_S = 120.0  # how long node rank 0 answers the probes (the others start within it)
POLL_S = 0.05

T = TypeVar("T")


@dataclass(frozen=True)
class Health:
    """What the checks found: every result, the verdict (the first failure, None: healthy),
    the injection that failed the node (None: none) and how long it took."""

    results: tuple[Result, ...]
    failure: Result | None
    injected: Injection | None
    seconds: float


def bounded(fn: Callable[[], T], seconds: float) -> tuple[T | None, bool]:
    """`fn()` in a thread, waited for at most `seconds`: (its value, True), or (None, False)
    when it did not return in time (the thread is left behind, a daemon: a hung mount may
    never return). An exception it raised is raised here."""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    worker = threading.Thread(target=call, name="ftslurm-health", daemon=True)
    worker.start()
    worker.join(max(0.0, seconds))
    if worker.is_alive():
        return None, False
    if "error" in box:
        raise box["error"]
    return box.get("value"), True


# ------------------------------------------------------------------------ the probes
def probe_write(folder: Path, node: str, nbytes: int = PROBE_BYTES) -> float:
    """Seconds to write and fsync `nbytes` in `folder`, the file removed after. A folder
    not made yet (the first job's checkpoint directory) is probed in its nearest existing
    parent, on the file system it will be made on: the check makes no folder, whose mode
    is the batch script's and the checkpoint manager's to set."""
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    path = folder / f".ftslurm-health-{node}-{os.getpid()}"
    data = os.urandom(nbytes)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    took = time.perf_counter() - started
    with contextlib.suppress(OSError):
        path.unlink()
    return took


def check_folder(folder: str, node: str, floor_mb_s: float, seconds: float) -> Result:
    try:
        took, done = bounded(lambda: probe_write(Path(folder), node), seconds)
    except OSError as exc:
        return rules.write_speed(folder, PROBE_BYTES, None, _os_error(exc), floor_mb_s)
    if not done:
        error = f"writing {PROBE_BYTES // 1024} KiB with fsync took over {seconds:.1f} s"
        return rules.write_speed(folder, PROBE_BYTES, None, error, floor_mb_s)
    return rules.write_speed(folder, PROBE_BYTES, took, None, floor_mb_s)


def _os_error(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def available_memory() -> int | None:
    """Bytes of memory available to a new job (Linux's MemAvailable; else free pages)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def free_disk(folder: str) -> int | None:
    """Free bytes of the file system `folder` is (or will be made) on."""
    path = Path(folder)
    while not path.exists() and path.parent != path:
        path = path.parent
    with contextlib.suppress(OSError):
        return shutil.disk_usage(path).free
    return None


# The GPU probe runs in a process of its own: CUDA contexts made in the launcher would hold
# memory on every GPU for the whole job. It prints its findings as JSON.
GPU_PROBE = """
import json, sys
asked = int(sys.argv[1])
try:
    import torch
except ImportError:
    print(json.dumps({"count": 0, "error": "torch is not installed: no GPU can be used"}))
    raise SystemExit
try:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    free, right = [], True
    for d in range(min(count, asked)):
        a = torch.ones(64, 64, device=f"cuda:{d}")
        right = right and float((a @ a).sum().item()) == 64.0 ** 3
        free.append(torch.cuda.mem_get_info(d)[0] / (1024 * 1024))
    print(json.dumps({"count": count, "kernel_ok": right, "free_mb": free}))
except Exception as exc:
    said = " ".join(str(exc).split())
    print(json.dumps({"count": 0, "error": f"{type(exc).__name__}: {said}"[:300]}))
"""


# The GPU probe's own allowance (seconds from the check's start): torch's import and a CUDA
# context on each GPU take seconds on a healthy node, more than the other checks' bound.
GPU_PROBE_S = 30.0


class GpuProbeRun:
    """The GPU probe, started first so that it runs beside the other checks."""

    def __init__(self, asked: int, environ: Mapping[str, str]) -> None:
        self.started = time.monotonic()
        self.error: str | None = None
        self.proc: subprocess.Popen[str] | None = None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", GPU_PROBE, str(asked)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                env=dict(environ),
                start_new_session=True,
            )
        except OSError as exc:
            self.error = f"the GPU probe could not start: {exc}"

    def result(self, until: float) -> rules.GpuProbe | None:
        """What it found, waited for until `until` (monotonic) at the latest; None: it did
        not finish (inconclusive: a GPU that hangs hangs the ranks, which hang detection
        catches; a slow CUDA start is no fault). Killed when it did not finish."""
        if self.proc is None:
            return rules.GpuProbe(0, error=self.error)
        try:
            out, err = self.proc.communicate(timeout=max(0.05, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()
            return None
        try:
            found = json.loads(out.strip().splitlines()[-1])
            return rules.GpuProbe(
                int(found.get("count", 0)),
                bool(found.get("kernel_ok", True)),
                tuple(float(x) for x in found.get("free_mb", ())),
                found.get("error"),
            )
        except (ValueError, IndexError, TypeError, AttributeError):
            tail = (err.strip().splitlines() or ["no output"])[-1][:300]
            return rules.GpuProbe(0, error=f"the GPU probe exited {self.proc.returncode}: {tail}")


def run_site(command: str, seconds: float, environ: Mapping[str, str]) -> Result:
    """The site's command in a shell of its own session, killed (its whole group) when it
    outlives `seconds`."""
    try:
        proc = subprocess.Popen(
            command,
            shell=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=dict(environ),
        )
    except OSError as exc:
        return rules.site(command, 127, False, str(exc))
    try:
        out, _ = proc.communicate(timeout=max(0.1, seconds))
        return rules.site(command, proc.returncode, False, out.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return rules.site(command, None, True, out.decode(errors="replace"))


# ------------------------------------------------------------------- the network probe
def serve_probes(run: RunDir, attempt: int, job: str, host: str, lifetime: float = SERVE_S) -> None:
    """Node rank 0: answer the other nodes' timed transfers for `lifetime` seconds, in a
    daemon thread (never blocks the launcher), its endpoint published in the run directory."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("", 0))
    server.listen(64)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    write_json_atomic(
        run.health_probe(attempt), {"host": host, "port": port, "job_id": job, "time": time.time()}
    )
    until = time.monotonic() + lifetime

    def answer(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            with contextlib.suppress(OSError):
                want = int.from_bytes(_read(conn, 8), "big")
                got = 0
                while got < want:
                    chunk = conn.recv(min(1 << 20, want - got))
                    if not chunk:
                        return
                    got += len(chunk)
                conn.sendall(b"k")

    def serve() -> None:
        with server:
            while time.monotonic() < until:
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, name="ftslurm-health-probe", daemon=True).start()


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data


def measure_transfer(host: str, port: int, seconds: float, nbytes: int = NET_BYTES) -> float | None:
    """MB/s of sending `nbytes` to node rank 0 and its acknowledgement; None when it did not
    complete within `seconds`."""
    deadline = time.monotonic() + seconds
    try:
        with socket.create_connection((host, port), timeout=max(0.1, seconds)) as conn:
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            payload = bytes(nbytes)
            started = time.perf_counter()
            conn.sendall(nbytes.to_bytes(8, "big"))
            conn.sendall(payload)
            if _read(conn, 1) != b"k":
                return None
            return nbytes / rules.MB / max(time.perf_counter() - started, 1e-9)
    except OSError:
        return None


def network(
    run: RunDir, attempt: int, job: str, node: str, node_rank: int, nnodes: int, ratio: float,
    deadline: float,
) -> Result:  # fmt: skip
    """A node other than rank 0: its transfer rate to node rank 0 against the others'."""
    probe_path = run.health_probe(attempt)
    endpoint = None
    while time.monotonic() < deadline:
        found = read_json(probe_path)
        if isinstance(found, dict) and str(found.get("job_id")) == job:
            endpoint = found
            break
        time.sleep(POLL_S)
    if endpoint is None:
        return rules.bandwidth(None, (), ratio)
    host, port = str(endpoint["host"]), int(endpoint["port"])
    own = measure_transfer(host, port, deadline - time.monotonic())
    if own is None:
        return rules.bandwidth(None, (), ratio)
    with contextlib.suppress(OSError):
        write_json_atomic(
            run.health_figure(attempt, node_rank),
            {"node": node, "node_rank": node_rank, "job_id": job, "mb_s": own, "time": time.time()},
        )
    peers = [r for r in range(1, nnodes) if r != node_rank]
    others: dict[int, float] = {}
    while True:
        for r in peers:
            if r not in others:
                got = read_json(run.health_figure(attempt, r))
                if isinstance(got, dict) and str(got.get("job_id")) == job:
                    with contextlib.suppress(TypeError, ValueError):
                        others[r] = float(got["mb_s"])
        if len(others) == len(peers) or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    return rules.bandwidth(own, others.values(), ratio)


# ------------------------------------------------------------------------ the whole
def run_checks(
    config: HealthConfig,
    *,
    checkpoint_dir: str | None,
    node: str,
    node_rank: int,
    nnodes: int,
    job: str,
    attempt: int,
    run: RunDir | None,
    injections: Iterable[Injection] = (),
    elapsed_s: float = 0.0,
    environ: Mapping[str, str] | None = None,
    host: str | None = None,
    probe_network: bool = True,
) -> Health:
    """This node's health check: every check within `config.timeout_s` (those left when the
    bound is spent are skipped), or the injection's failure when one is due.
    `probe_network` False: no network probe (between in-job rounds, where the nodes do not
    check together)."""
    started = time.monotonic()
    environ = os.environ if environ is None else environ
    fired = _fired(run)
    due = rules.injected(
        injections, node=node, node_rank=node_rank, nnodes=nnodes, elapsed_s=elapsed_s, fired=fired
    )
    if due is not None:
        failure = rules.injected_failure(Check.CHECKPOINT_DIR, due.spec())
        _record_fired(run, due.spec())
        return Health((failure,), failure, due, time.monotonic() - started)
    if not config.enabled:
        return Health((), None, None, 0.0)
    deadline = started + config.timeout_s
    left: Callable[[], float] = lambda: deadline - time.monotonic()  # noqa: E731
    results: list[Result] = []
    probe_network = probe_network and run is not None and nnodes > rules.MIN_NETWORK_PEERS
    if probe_network and node_rank == 0:
        with contextlib.suppress(OSError):  # first: the others measure while this node checks
            serve_probes(run, attempt, job, host or socket.gethostname())
    asked = rules.gpus_asked(environ)
    gpu = GpuProbeRun(asked, environ) if asked else None  # first: it runs beside the others
    folders = rules.node_dirs(config.dirs, node)
    if checkpoint_dir is None:  # a launcher started by hand: the ranks' folder is not known
        results.append(rules.skipped(Check.CHECKPOINT_DIR, rules.NO_CHECKPOINT_DIR))
    else:
        folders = [checkpoint_dir, *folders]
    ckpt = checkpoint_dir or "."
    for folder in folders:
        results.append(check_folder(folder, node, config.min_write_mb_s, left()))
        if not results[-1].ok:
            if gpu is not None:
                gpu.result(time.monotonic())  # not waited for: killed
            return _done(results, started)
    results.append(rules.free_memory(available_memory(), config.min_free_memory_mb))
    results.append(rules.free_disk(ckpt, free_disk(ckpt), config.min_free_disk_mb))
    probe = gpu.result(max(deadline, started + GPU_PROBE_S)) if gpu is not None else None
    results.append(rules.gpus(asked, probe, config.min_gpu_free_mb))
    if config.command:
        site_env = {**environ, EnvName.HEALTH_NODE.value: node}
        results.append(run_site(config.command, left(), site_env))
    if rules.verdict(results) is None and run is not None and node_rank > 0:
        if probe_network and config.min_bandwidth_ratio > 0:
            results.append(
                network(run, attempt, job, node, node_rank, nnodes, config.min_bandwidth_ratio,
                        deadline)
            )  # fmt: skip
    return _done(results, started)


def _done(results: list[Result], started: float) -> Health:
    return Health(tuple(results), rules.verdict(results), None, time.monotonic() - started)


def _fired(run: RunDir | None) -> list[str]:
    if run is None:
        return []
    found = read_json(run.fired_unhealthy)
    return [str(x) for x in found] if isinstance(found, list) else []


def _record_fired(run: RunDir | None, spec: str) -> None:
    if run is None:
        return
    try:
        run.fired_unhealthy.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run.fired_unhealthy, sorted({*_fired(run), spec}))
    except OSError as exc:
        log.warning("could not record the injection %s as fired: %s", spec, exc)


def said(health: Health) -> str:
    """One line for the launcher's log."""
    if health.failure is not None:
        return f"health check failed: {health.failure.check.value}: {health.failure.detail}"
    checks = ", ".join(r.check.value for r in health.results if not r.skipped)
    return f"health check passed in {health.seconds:.2f} s ({checks or 'none run'})"


def dump(health: Health) -> str:
    """Every result as JSON (the benchmark prints it)."""
    return json.dumps(
        [
            {"check": r.check.value, "ok": r.ok, "detail": r.detail, "skipped": r.skipped}
            for r in health.results
        ]
    )

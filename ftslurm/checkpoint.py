"""Checkpoint helpers for a training script: atomic saves, verified loads, RNG capture.

    from ftslurm.checkpoint import CheckpointManager, restore_training_state, training_state

    ckpt = CheckpointManager()                    # $FTSLURM_CHECKPOINT_DIR or ./checkpoints
    latest = ckpt.load_latest()
    step = restore_training_state(latest[1], model, opt) if latest else 0
    ...
    ckpt.checkpoint(step, training_state(model, opt, step, data_position=pos))
    ckpt.wait()                                   # before exiting after the checkpoint signal
                                                  # (the rank agent's exit() also waits)

`checkpoint()` is asynchronous by default: the step stands still only for the snapshot into
CPU memory (and for the previous save, if it is still writing: `busy="wait"`, the default;
`busy="skip"` skips this one with a warning instead); the file is written in the background.
Once it is on disk the daemon is told (`ftslurm.agent.progress.checkpoint_saved`: the step,
the blocking time, the background write time), so a step is never reported before it is
safe, and the tuned checkpoint interval (`ftslurm.core.cadence`) is never shorter than the
write. `CheckpointManager(asynchronous=False)` makes it block for the whole save, as
`save()` always does.

On-disk layout of a `CheckpointManager` folder (only rank 0 writes; every rank may read):

    step-0000000120.pt     torch.save of the whole state of step 120
    step-0000000120.json   its manifest: {"format", "step", "file", "size", "sha256",
                           "save_s", "time", "world_size"}
    .step-0000000140.pt.<pid>.<token>.tmp   a save in progress (or left by a crash);
                                            manifests are written the same way

Guarantees:

* A step file is written to a temporary file in the same folder, flushed and fsynced, then
  renamed into place and the folder fsynced; its manifest is written atomically after that.
  A checkpoint is *complete* when both files exist; temporary files are never taken for one.
* `load_latest` returns the newest checkpoint whose size and sha256 match its manifest,
  skipping (with a warning) truncated, corrupt or unfinished ones, and loads it with
  `torch.load(weights_only=True)`: states hold tensors, numbers, strings, None, lists, tuples
  and dicts (`capture_rng_state` encodes RNG states that way).
* Pruning keeps the newest `keep_last` complete checkpoints and never the one just written;
  it removes a manifest before its step file, so an interrupted prune leaves nothing that
  looks complete, and clears temporary and orphaned files of older steps.
* `save_async` copies the state to CPU memory before it returns (CUDA tensors into
  page-locked memory, reused from one save to the next, unless `pin_memory=False`) and
  writes it in a background (non-daemon) thread with the same protocol, one save in flight
  at a time; the training may change its tensors as soon as the call returns.

Sharded checkpoints (`save_sharded` / `load_sharded`) use torch.distributed.checkpoint into
`<directory>/sharded-step-<step>`: every rank writes into `.sharded-step-<step>.tmp`, and after
a barrier rank 0 renames it into place, so a folder with the final name is always complete.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import random
import re
import shutil
import threading
import time
import uuid
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ftslurm.agent import progress
from ftslurm.core.contract import CHECKPOINT_MANIFEST, JobEnv
from ftslurm.fsutil import (
    fsync_dir,
    make_dirs,
    read_json,
    restrict,
    sharing_modes,
    write_json_atomic,
)

log = logging.getLogger("ftslurm.checkpoint")

MANIFEST_FORMAT = 1
_STEP_FILE = re.compile(r"step-(\d+)\.pt")
_MANIFEST = CHECKPOINT_MANIFEST
_TEMP_FILE = re.compile(r"\.step-(\d+)\.(?:pt|json)\..+\.tmp")  # step file or manifest
_SHARDED = re.compile(r"sharded-step-(\d+)")
_HASH_IN_PARALLEL = 1 << 20  # writes at least this large are hashed while they are written
_READ_CHUNK = 8 << 20


# --------------------------------------------------------------------------- helpers
def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        return default


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _HashingWriter:
    """A write-only file for torch.save that hashes what it writes: large buffers are hashed
    in a helper thread while the main one writes them (both release the GIL), and their
    write-back to the disk is started at once (the pages also leave the page cache)."""

    def __init__(self, raw: Any, pool: ThreadPoolExecutor) -> None:
        self.raw, self.pool = raw, pool
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        pending = None
        if view.nbytes >= _HASH_IN_PARALLEL:
            pending = self.pool.submit(self.digest.update, view)
        else:
            self.digest.update(view)
        written = 0
        while written < view.nbytes:  # a raw file may write less than asked
            written += self.raw.write(view[written:])
        if pending is not None:
            pending.result()
            # Start writing these pages back now rather than all at the final fsync.
            with contextlib.suppress(AttributeError, OSError):
                os.posix_fadvise(self.raw.fileno(), self.size, written, os.POSIX_FADV_DONTNEED)
        self.size += written
        return written

    def flush(self) -> None:
        self.raw.flush()


def _snapshot(state: Any, pin_memory: bool = True) -> Any:
    """A CPU copy of `state`: tensors copied (`detach().to("cpu", copy=True)`; a tensor met
    twice stays one tensor), dicts, lists and tuples rebuilt, other values deep-copied.
    With `pin_memory`, CUDA tensors are copied into page-locked memory (which torch's host
    allocator keeps for the next snapshot) without waiting for each copy, then synchronised."""
    devices: set[torch.device] = set()
    snapshot = _copy(state, {}, devices, pin_memory)
    for device in devices:
        torch.cuda.synchronize(device)
    return snapshot


def _copy(obj: Any, memo: dict[int, Any], devices: set[torch.device], pin: bool) -> Any:
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        plain = type(t) is torch.Tensor and t.layout == torch.strided and not t.is_quantized
        if pin and t.is_cuda and plain:
            out: Any = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t, non_blocking=True)
            devices.add(t.device)
        else:
            out = t.to("cpu", copy=True)
    elif isinstance(obj, dict):
        items = [(k, _copy(v, memo, devices, pin)) for k, v in obj.items()]
        out = OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    elif isinstance(obj, (list, tuple)):
        items = [_copy(v, memo, devices, pin) for v in obj]
        if isinstance(obj, list):
            out = items
        else:
            out = type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    elif obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return obj
    else:
        out = copy.deepcopy(obj)
    memo[id(obj)] = out
    return out


# --------------------------------------------------------------------------- manager
_MANAGERS: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


class _Settles(Protocol):
    def settle(self) -> None: ...


# Other savers with work in flight in this process (the memory tier's background saves):
# `wait_for_saves` lets them finish too; their failures are theirs to log (a replica that
# could not be sent leaves the persistent checkpoint, and so the exit code, as it was).
_IN_FLIGHT: weakref.WeakSet[_Settles] = weakref.WeakSet()


def wait_for_saves() -> None:
    """Wait for every save still in flight in this process (the rank agent's exit path calls
    it before leaving with `os._exit`, which would cut a background save short); the first
    error of a failed save is raised after all of them are done."""
    for saver in list(_IN_FLIGHT):
        saver.settle()
    error: BaseException | None = None
    for manager in list(_MANAGERS):
        try:
            manager.wait()
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error


class SaveHandle:
    """A save running in the background: `wait()` returns its path or raises its error."""

    def __init__(self, step: int, path: Path, thread: threading.Thread | None = None) -> None:
        self.step, self.path = step, path
        self._thread = thread
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint save of step {self.step} still running")
        if self._error is not None:
            raise self._error
        return self.path


class CheckpointManager:
    """Single-file checkpoints of a training state in one folder (see the module doc).

    `directory` defaults to $FTSLURM_CHECKPOINT_DIR, else "checkpoints"; `rank` and
    `world_size` to torch.distributed's when it is initialised, else RANK / WORLD_SIZE, else
    0 / 1. Only rank 0 writes. `report` tells the daemon of each save
    (`ftslurm.agent.progress.checkpoint_saved`); `pin_memory` applies to asynchronous saves;
    `asynchronous` and `busy` to `checkpoint()` (the module doc).
    """

    def __init__(
        self,
        directory: str | Path | None = None,
        keep_last: int = 3,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        report: bool = True,
        pin_memory: bool = True,
        asynchronous: bool = True,
        busy: str = "wait",
        sharing: str | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        if busy not in ("wait", "skip"):
            raise ValueError(f"busy must be 'wait' or 'skip', got {busy!r}")
        self.asynchronous, self.busy = asynchronous, busy
        if directory is None:
            directory = JobEnv.from_environ(os.environ).checkpoint_folder
        self.directory = Path(directory)
        # Private by default (0700 folders, 0600 files): weights are the owner's alone.
        self.dir_mode, self.file_mode = sharing_modes(sharing)
        self.keep_last = keep_last
        on = _distributed()
        self.rank = rank if rank is not None else (dist.get_rank() if on else _env_int("RANK", 0))
        self.world_size = (
            world_size
            if world_size is not None
            else (dist.get_world_size() if on else _env_int("WORLD_SIZE", 1))
        )
        self.report = report
        self.pin_memory = pin_memory
        self._pending: SaveHandle | None = None
        _MANAGERS.add(self)

    # ------------------------------------------------------------------ paths
    def path_of(self, step: int) -> Path:
        return self.directory / f"step-{step:010d}.pt"

    def manifest_of(self, step: int) -> Path:
        return self.directory / f"step-{step:010d}.json"

    def _scan(self) -> tuple[dict[int, str], dict[int, str], list[tuple[int, str]]]:
        """Step files, manifests and temporary files present, by step."""
        files: dict[int, str] = {}
        manifests: dict[int, str] = {}
        temps: list[tuple[int, str]] = []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return files, manifests, temps
        for name in names:
            if m := _STEP_FILE.fullmatch(name):
                files[int(m.group(1))] = name
            elif m := _MANIFEST.fullmatch(name):
                manifests[int(m.group(1))] = name
            elif m := _TEMP_FILE.fullmatch(name):
                temps.append((int(m.group(1)), name))
        return files, manifests, temps

    def steps(self) -> list[int]:
        """Steps with both a step file and a manifest, ascending (contents not verified)."""
        files, manifests, _ = self._scan()
        return sorted(set(files) & set(manifests))

    # ------------------------------------------------------------------ saving
    def checkpoint(self, step: int, state: dict[str, Any]) -> SaveHandle | None:
        """Save `state` as the checkpoint of `step` the manager's way (the module doc):
        in the background unless `asynchronous=False`. None: skipped, the previous save
        still writing (`busy="skip"`)."""
        if not self.asynchronous:
            return SaveHandle(step, self.save(step, state))
        pending = self._pending
        if self.busy == "skip" and pending is not None and not pending.done():
            log.warning(
                "checkpoint of step %d skipped: the save of step %d is still writing",
                step,
                pending.step,
            )
            return None
        return self.save_async(step, state)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` as the checkpoint of `step` (rank 0 only) and return its path."""
        self._wait_previous()
        if self.rank != 0:
            return self.path_of(step)
        return self._write(step, state, time.monotonic())

    def save_async(self, step: int, state: dict[str, Any]) -> SaveHandle:
        """Copy `state` to CPU memory now and write it in the background (after the save
        still in flight, if any: this call waits for it)."""
        started = time.monotonic()  # the training stands still from here
        self._wait_previous()
        if self.rank != 0:
            return SaveHandle(step, self.path_of(step))
        snapshot = _snapshot(state, self.pin_memory)
        handle = SaveHandle(step, self.path_of(step))
        blocked = time.monotonic() - started

        def run() -> None:
            try:
                self._write(step, snapshot, started, blocked_s=blocked)
            except BaseException as exc:  # handed to wait()
                log.error("checkpoint save of step %d failed: %r", step, exc)
                handle._error = exc

        thread = threading.Thread(target=run, name=f"ftslurm-checkpoint-{step}")
        handle._thread = thread
        self._pending = handle
        thread.start()
        return handle

    def wait(self) -> None:
        """Wait for the save in flight, if any; its error (once) is raised here."""
        handle, self._pending = self._pending, None
        if handle is not None:
            handle.wait()

    def _wait_previous(self) -> None:
        handle, self._pending = self._pending, None
        if handle is not None:
            try:
                handle.wait()
            except Exception:  # logged by the writer; still raised by the handle's wait()
                pass

    def _write(
        self, step: int, state: dict[str, Any], started: float, blocked_s: float | None = None
    ) -> Path:
        """The save protocol (module doc). `blocked_s`: an asynchronous save, the time the
        training stood still for it (the rest of the time since `started` was written in
        the background)."""
        make_dirs(self.directory, self.dir_mode)
        path, manifest = self.path_of(step), self.manifest_of(step)
        tmp = self.directory / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.file_mode)
        try:
            with os.fdopen(fd, "wb", buffering=0) as raw, ThreadPoolExecutor(1) as pool:
                writer = _HashingWriter(raw, pool)
                torch.save(state, writer)
                raw.flush()
                os.fsync(raw.fileno())
            manifest.unlink(missing_ok=True)  # a re-saved step is incomplete until renamed
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.directory)
        seconds = time.monotonic() - started
        blocking = seconds if blocked_s is None else blocked_s
        write_json_atomic(
            manifest,
            {
                "format": MANIFEST_FORMAT,
                "step": int(step),
                "file": path.name,
                "size": writer.size,
                "sha256": writer.digest.hexdigest(),
                "save_s": seconds,
                "blocking_s": blocking,
                "time": time.time(),
                "world_size": self.world_size,
            },
            mode=self.file_mode,
        )
        log.info(
            "checkpoint of step %d saved: %s (%d bytes, %.2f s, %.2f s of it blocking)",
            step,
            path,
            writer.size,
            seconds,
            blocking,
        )
        self._prune(step)
        if self.report:
            progress.checkpoint_saved(
                step, blocking, None if blocked_s is None else seconds - blocked_s
            )
        return path

    def _prune(self, step: int) -> None:
        files, manifests, temps = self._scan()
        complete = sorted(set(files) & set(manifests))
        keep = set(complete[-self.keep_last :]) | {step}
        doomed = [manifests[s] for s in complete if s not in keep]
        doomed += [files[s] for s in complete if s not in keep]
        doomed += [files[s] for s in files if s < step and s not in manifests]
        doomed += [manifests[s] for s in manifests if s < step and s not in files]
        doomed += [name for s, name in temps if s <= step]
        for name in doomed:
            try:
                (self.directory / name).unlink()
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------ loading
    def _problem(self, step: int) -> str | None:
        """Why the checkpoint of `step` cannot be trusted, or None when it can."""
        meta = read_json(self.manifest_of(step))
        if not isinstance(meta, dict) or meta.get("step") != step:
            return "manifest missing or unreadable"
        try:
            size = self.path_of(step).stat().st_size
        except OSError as exc:
            return f"step file unreadable: {exc}"
        if size != meta.get("size"):
            return f"size {size} != {meta.get('size')} in the manifest"
        if _sha256_file(self.path_of(step)) != meta.get("sha256"):
            return "sha256 differs from the manifest"
        return None

    def load_latest(self, map_location: Any = "cpu") -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest verified checkpoint, or None when there is none."""
        files, manifests, _ = self._scan()
        for step in sorted(files, reverse=True):
            problem = "no manifest" if step not in manifests else self._problem(step)
            if problem is not None:
                log.warning("skipping checkpoint %s: %s", self.path_of(step), problem)
                continue
            state = torch.load(self.path_of(step), map_location=map_location, weights_only=True)
            return step, state
        return None


# --------------------------------------------------------------------------- RNG
def capture_rng_state() -> dict[str, Any]:
    """The states of python's `random`, numpy's global generator (when importable), torch's
    CPU generator and every CUDA device (when available), as tensors, numbers and None."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss,
        },
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "bit_generator": str(name),
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the generators back to what `capture_rng_state` recorded."""
    if "python" in state:
        py = state["python"]
        random.setstate(
            (int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"])
        )
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        import numpy as np

        npy = state["numpy"]
        np.random.set_state(
            (
                npy["bit_generator"],
                npy["key"].cpu().numpy().astype(np.uint32),
                npy["pos"],
                npy["has_gauss"],
                npy["cached_gaussian"],
            )
        )
    if state.get("cuda") is not None and torch.cuda.is_available():
        cuda = [s.cpu() for s in state["cuda"]]
        if len(cuda) != torch.cuda.device_count():
            log.warning(
                "checkpoint has CUDA RNG states of %d devices, this process sees %d",
                len(cuda),
                torch.cuda.device_count(),
            )
        for device, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device)


# --------------------------------------------------------------------------- training state
def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


def training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    *,
    data_position: Any = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything needed to continue bit for bit: weights (DDP unwrapped), optimizer, step,
    where the data loader stands, RNG states, and `extra`."""
    return {
        "model": _unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "step": int(step),
        "data_position": data_position,
        "rng": capture_rng_state(),
        "extra": extra if extra is not None else {},
    }


def restore_training_state(
    state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> int:
    """Load a `training_state` back into `model` and `optimizer`, restore the RNG states and
    return the step."""
    _unwrap(model).load_state_dict(state["model"])
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    if state.get("rng") is not None:
        restore_rng_state(state["rng"])
    return int(state["step"])


# --------------------------------------------------------------------------- sharded
def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _without_group_warning() -> Iterator[None]:
    """DCP warns when it runs without a process group; here that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def sharded_steps(directory: str | Path) -> list[int]:
    """Steps of the complete sharded checkpoints in `directory`, ascending."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(
        int(m.group(1))
        for n in names
        if (m := _SHARDED.fullmatch(n)) and (Path(directory, n, ".metadata")).is_file()
    )


def save_sharded(
    directory: str | Path, step: int, state_dict: dict[str, Any], sharing: str | None = None
) -> Path:
    """Collective: every rank saves its shards of `state_dict` with torch.distributed.checkpoint
    into `<directory>/sharded-step-<step>`; works without a process group too. The files are
    private unless `sharing` (default: the job's setting) is "group"."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    final = directory / f"sharded-step-{step}"
    tmp = directory / f".sharded-step-{step}.tmp"
    on = _distributed()
    rank = dist.get_rank() if on else 0
    dir_mode, file_mode = sharing_modes(sharing)
    if rank == 0:
        make_dirs(directory, dir_mode)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save
        make_dirs(tmp, dir_mode)
    _barrier()
    with _without_group_warning():
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not on)
    _barrier()
    if rank == 0:
        restrict(tmp, dir_mode, file_mode)  # torch wrote them with the umask's modes
        if final.exists():
            old = directory / f".sharded-step-{step}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(directory)
    _barrier()
    return final


def load_sharded(directory: str | Path, step: int, state_dict: dict[str, Any]) -> None:
    """Collective: load `sharded-step-<step>` into `state_dict` in place (each rank its own
    shards, as laid out by the tensors already in `state_dict`)."""
    import torch.distributed.checkpoint as dcp

    path = Path(directory) / f"sharded-step-{step}"
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no complete sharded checkpoint at {path}")
    with _without_group_warning():
        dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path), no_dist=not _distributed())

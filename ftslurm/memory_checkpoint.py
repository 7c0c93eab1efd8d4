"""The in-memory checkpoint tier: each rank's latest state in its node's memory, and a
replica in another node's, so that losing one node costs no read of shared storage.

    from ftslurm.memory_checkpoint import MemoryTier
    memory = MemoryTier()                    # after init_process_group (a collective)
    got = memory.load_latest(min_step=newest_on_disk)   # a collective
    if got is not None:
        step, state, tier = got              # tier: "memory" (this node) or "peer"
    ...
    memory.save(step, state)                 # a collective: every rank at the same step

Where: `$FTSLURM_MEMORY_DIR` (default `/dev/shm/ftslurm-<uid>`, a RAM-backed file system),
one area per run (`run_key`: `$FTSLURM_RUN_ID`, `$SLURM_JOB_ID`, ...) and node
(`$SLURMD_NODENAME`, else the host name):

    <base>/<run>/<node>/shard-<r>-step-<S>.pt     the state of rank r at step S
    <base>/<run>/<node>/shard-<r>-step-<S>.json   its manifest: size and sha256

Who holds what: rank r keeps its own state in its node's area and sends a copy to its
*partner*, the rank with the same local index on the next node (nodes in name order), which
keeps it in its own node's area. So a node's memory holds, per rank on it, two states: the
rank's own and one replica of a rank on the previous node (for a moment, while a new step
is written, the previous pair too); with fewer ranks on a node than on the one before, some
of its ranks keep more than one replica. With one node there are no replicas.

Restoring (`load_latest`): every rank lists what its node's area holds (a state whose
manifest gives its size) and all of them exchange the lists; the step restored is the newest
(not older than `min_step`) at which every rank's state has a holder. A rank whose state is
on its own node reads it; any other receives it from a holder (point to point, over a gloo
group of its own). Each state is verified (size and sha256) when it is read to be served,
so a restore reads and hashes only the states it uses, once; one that does not verify is
left out and the choice is made again without it (the other copy of that state, or an
older step). The answer is the same on every rank; None when memory cannot serve the whole
world (a replica lost with its node, corrupt, or the world changed size): the caller loads
the persistent tier (`ftslurm.checkpoint`), which is saved less often.

Saving is asynchronous by default, as on disk: the step stands still only for the snapshot
(a CPU copy of the state); serialising, keeping it in this node's area and exchanging the
replicas happen in a background thread on the tier's own gloo group, and the next save,
`load_latest`, `clear` and the rank agent's exit (`ftslurm.checkpoint.wait_for_saves`) wait
for it. Every rank saves at the same step, so the background exchanges pair up as the
blocking ones did. `MemoryTier(asynchronous=False)` blocks for all of it.

Each save is reported to the daemon (`ftslurm.agent.progress.memory_saved`, rank 0: the
step and how long the training stood still for it): the daemon then tunes two intervals,
a short one for this tier and a longer one for the disk, and the rank agent's
`checkpoint_tier` says which one a periodic checkpoint is for (`ftslurm.core.cadence`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftslurm.agent import progress
from ftslurm.checkpoint import _IN_FLIGHT, _snapshot
from ftslurm.core.contract import EnvName, node_memory_area
from ftslurm.fsutil import make_dirs, memory_base, read_json, write_json_atomic

log = logging.getLogger("ftslurm.memory_checkpoint")

_FILE = re.compile(r"shard-(\d+)-step-(\d+)\.pt")


def run_key(environ: Mapping[str, str]) -> str:
    """What names a training's states in node memory, the same across its restarts: the
    ftslurm run, else the Slurm job (a requeued job keeps its id), else torchrun's run id,
    else the rendezvous address of a plain launch."""
    for name in (EnvName.RUN_ID.value, "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        if environ.get(name):
            return re.sub(r"[^\w.-]", "_", environ[name])
    return f"local-{environ.get('MASTER_ADDR', 'localhost')}-{environ.get('MASTER_PORT', '0')}"


def partners(nodes: list[str]) -> dict[int, int]:
    """rank -> the rank that keeps its replica, from every rank's node (`nodes[r]`): the
    rank with the same local index on the next node, nodes in name order (the next node's
    rank of that index modulo its rank count). Empty with one node."""
    order = sorted(set(nodes))
    if len(order) < 2:
        return {}
    on = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    out = {}
    for r, n in enumerate(nodes):
        nxt = on[order[(order.index(n) + 1) % len(order)]]
        out[r] = nxt[on[n].index(r) % len(nxt)]
    return out


def holders(
    listings: list[dict[int, list[int]]], nodes: list[str], min_step: int | None
) -> tuple[int, dict[int, int]] | None:
    """The step to restore and, per rank, the rank that serves its state (itself when its
    node holds it), from what each rank's node area holds (`listings[r]`: shard -> verified
    steps) and every rank's node; None when no step at least `min_step` is held for every
    rank. Pure; every rank computes the same answer."""
    world = len(nodes)
    held: dict[int, dict[int, list[int]]] = {}  # step -> shard -> ranks whose node holds it
    for rank, listing in enumerate(listings):
        for shard, steps in listing.items():
            for step in steps:
                held.setdefault(step, {}).setdefault(shard, []).append(rank)
    for step in sorted(held, reverse=True):
        if min_step is not None and step < min_step:
            break
        by_shard = held[step]
        if any(shard not in by_shard for shard in range(world)):
            continue
        serve = {}
        for shard in range(world):
            ranks = sorted(set(by_shard[shard]))
            serve[shard] = shard if shard in ranks else ranks[shard % len(ranks)]
        return step, serve
    return None


class MemoryTier:
    """The memory tier of one process group (see the module doc). Create it on every rank
    after `init_process_group`, in the same order as other collectives."""

    def __init__(
        self,
        base: str | Path | None = None,
        run: str | None = None,
        node: str | None = None,
        asynchronous: bool = True,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("MemoryTier needs an initialised torch.distributed process group")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.run = run or run_key(os.environ)
        self.base = Path(base) if base is not None else memory_base()
        self.area = node_memory_area(self.base, self.run, self.node)
        self.asynchronous = asynchronous
        self._writer: threading.Thread | None = None  # the save still keeping and sending
        self._error: BaseException | None = None
        self.regroup()
        _IN_FLIGHT.add(self)  # the rank agent's exit waits for it (`wait_for_saves`)

    def regroup(self) -> None:
        """Create the tier's group over the current default process group and learn where
        every rank runs (at the start, and again after live recovery formed a new default
        group: `ftslurm.agent.live`). A collective."""
        self.settle()  # a save in flight went over the old group
        self.group = dist.new_group(backend="gloo")  # CPU tensors, whatever the training uses
        nodes: list[Any] = [None] * self.world
        dist.all_gather_object(nodes, self.node, group=self.group)
        self.nodes = [str(n) for n in nodes]
        self.partner = partners(self.nodes)
        # the ranks whose replicas this rank keeps (one with as many ranks on every node)
        self.keeps = [r for r, p in sorted(self.partner.items()) if p == self.rank]

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: dict[str, Any]) -> None:
        """Keep `state` as this rank's state at `step`: in this node's memory and, through
        the partner, in the next node's (a collective). Older steps of the shards this rank
        holds are dropped once the new ones are written."""
        started = time.monotonic()
        self.wait()  # the previous save's replicas go out first, in the same order on all
        snapshot = _snapshot(state)  # from a GPU: into page-locked memory, reused
        if not self.asynchronous:
            self._write(step, snapshot, started)
            return
        blocking = time.monotonic() - started
        self._writer = threading.Thread(
            target=self._write_in_background,
            args=(step, snapshot, blocking),
            name=f"ftslurm-memory-save-{step}",
            daemon=True,
        )
        self._writer.start()

    def _write_in_background(self, step: int, snapshot: Any, blocking: float) -> None:
        try:
            self._write(step, snapshot, None, blocking)
        except BaseException as exc:  # handed to the next wait()
            self._error = exc

    def _write(
        self, step: int, snapshot: Any, started: float | None, blocking: float | None = None
    ) -> None:
        """Serialise, keep in this node's area, exchange the replicas, drop older steps,
        and tell the daemon how long the training stood still for it."""
        buffer = io.BytesIO()
        torch.save(snapshot, buffer)
        data = buffer.getvalue()
        self._keep(self.rank, step, data)
        if self.partner:
            received = self._exchange(data, send_to=self.partner[self.rank], recv_from=self.keeps)
            for shard, replica in zip(self.keeps, received, strict=True):
                self._keep(shard, step, replica)
        for shard in (self.rank, *self.keeps):
            self._drop_older(shard, step)
        # the daemon tunes the memory tier's interval (and a longer disk one) from this
        stood = blocking if blocking is not None else time.monotonic() - (started or 0.0)
        progress.memory_saved(step, stood)

    def settle(self) -> None:
        """Wait for a background save and log (not raise) its failure: the exit path's."""
        try:
            self.wait()
        except Exception as exc:  # the memory tier is a cache; the disk is the record
            log.warning("rank %d: the memory tier's last save failed: %r", self.rank, exc)

    def wait(self) -> None:
        """Wait for a save still keeping and sending in the background; its error, if it
        failed (the step is then not held: `load_latest` verifies what it restores)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _keep(self, shard: int, step: int, data: bytes) -> None:
        make_dirs(self.area, 0o700)  # the node's memory: its owner's alone
        path = self.area / f"shard-{shard}-step-{step}.pt"
        tmp = self.area / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # a RAM file system: no fsync; a torn file has no manifest
        write_json_atomic(
            path.with_suffix(".json"),
            {
                "shard": shard,
                "step": step,
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            },
            mode=0o600,
        )

    def _drop_older(self, shard: int, step: int) -> None:
        for path in self.area.glob(f"shard-{shard}-step-*"):
            m = re.fullmatch(rf"shard-{shard}-step-(\d+)\.(pt|json)", path.name)
            if m and int(m.group(1)) < step:
                path.unlink(missing_ok=True)

    def _exchange(self, data: bytes, send_to: int, recv_from: list[int]) -> list[bytes]:
        """Send `data` to rank `send_to` and receive what each rank of `recv_from` sends
        this one."""
        sent = self._send(data, send_to)
        got = [self._receive(source) for source in recv_from]
        for work in sent:
            work.wait()
        return got

    def _send(self, data: bytes, to: int) -> list[Any]:
        """Start sending `data` to rank `to` (its size, then its bytes unless there are
        none); the works to wait."""
        works = [dist.isend(torch.tensor([len(data)], dtype=torch.int64), to, group=self.group)]
        if data:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            works.append(dist.isend(payload, to, group=self.group))
        return works

    def _receive(self, source: int) -> bytes:
        """What rank `source` sends this one with `_send`."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.irecv(size, source, group=self.group).wait()
        if not size.item():  # the holder's copy did not verify (`_serve`)
            return b""
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.irecv(payload, source, group=self.group).wait()
        return payload.numpy().tobytes()

    # ------------------------------------------------------------------ restoring
    def listing(self, leave_out: frozenset[tuple[int, int]] = frozenset()) -> dict[int, list[int]]:
        """What this node's area holds: shard -> steps whose state has a manifest giving its
        size (a torn write has none), but for the (shard, step) pairs in `leave_out`. The
        contents are verified when read (`_read`), not here."""
        found: dict[int, list[int]] = {}
        try:
            names = os.listdir(self.area)
        except OSError:
            return found
        for name in names:
            m = _FILE.fullmatch(name)
            if not m or (int(m.group(1)), int(m.group(2))) in leave_out:
                continue
            meta = read_json((self.area / name).with_suffix(".json"))
            try:
                size = (self.area / name).stat().st_size
            except OSError:
                continue
            if isinstance(meta, dict) and meta.get("size") == size:
                found.setdefault(int(m.group(1)), []).append(int(m.group(2)))
        return found

    def _serve(self, step: int, serve: dict[int, int], bad: set[tuple[int, int]]) -> bytes | None:
        """This rank's part of one round of a restore: read the states it serves (sending
        those of other ranks) and return its own, read or received; None or empty when a
        copy did not verify (the reader adds it to `bad`: the next round leaves it out)."""
        mine: bytes | None = None
        works = []
        for shard, holder in sorted(serve.items()):
            if holder == shard:
                if shard == self.rank:
                    mine = self._read(shard, step)
                    if mine is None:
                        bad.add((shard, step))
                continue
            if holder == self.rank:
                data = self._read(shard, step)
                if data is None:
                    bad.add((shard, step))
                works += self._send(data or b"", shard)  # empty: the receiver's round fails
            elif shard == self.rank:
                mine = self._receive(holder)
        for work in works:
            work.wait()
        return mine

    def _read(self, shard: int, step: int) -> bytes | None:
        """The verified bytes of a shard's state, or None (missing, torn or corrupt)."""
        path = self.area / f"shard-{shard}-step-{step}.pt"
        meta = read_json(path.with_suffix(".json"))
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if (
            not isinstance(meta, dict)
            or meta.get("size") != len(data)
            or meta.get("sha256") != hashlib.sha256(data).hexdigest()
        ):
            log.warning("memory checkpoint %s does not verify; left out", path)
            return None
        return data

    def load_latest(self, min_step: int | None = None) -> tuple[int, dict[str, Any], str] | None:
        """(step, this rank's state, "memory" or "peer") of the newest step, at least
        `min_step`, that memory holds for every rank; None on every rank otherwise (a
        collective)."""
        self.wait()
        bad: set[tuple[int, int]] = set()  # read here and found not to verify
        while True:  # each round that fails leaves out one more state on some rank
            listings: list[Any] = [None] * self.world
            dist.all_gather_object(listings, self.listing(frozenset(bad)), group=self.group)
            chosen = holders(
                [{int(k): v for k, v in x.items()} for x in listings], self.nodes, min_step
            )
            if chosen is None:
                return None
            step, serve = chosen
            mine = self._serve(step, serve, bad)
            ok = torch.tensor([1 if mine else 0], dtype=torch.int32)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
            if ok.item() and mine:
                break
        tier = "memory" if serve[self.rank] == self.rank else "peer"
        state = torch.load(io.BytesIO(mine), weights_only=True)
        log.info(
            "rank %d restored step %d from %s (%s)",
            self.rank,
            step,
            "this node's memory"
            if tier == "memory"
            else f"the replica on {self.nodes[serve[self.rank]]}",
            self.node,
        )
        return step, state, tier

    def clear(self) -> None:
        """Drop this run's area on this node (every rank of the node may call it)."""
        with contextlib.suppress(Exception):  # whatever it left is removed below
            self.wait()
        shutil.rmtree(self.area, ignore_errors=True)
        with contextlib.suppress(OSError):  # the run's folder, once no node area is left
            self.area.parent.rmdir()

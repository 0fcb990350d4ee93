"""The writer process: turns staged snapshots into durable, committed files.

The training process starts it once per engine as ``python -m async_ckpt.write.writer`` (a fresh
interpreter: never a fork of a CUDA process, and unlike multiprocessing's spawn it does not re-import
the user's ``__main__``). It never imports torch. The two talk over a Unix socket: staging buffers
arrive as memfd file descriptors, snapshots as small job messages naming a buffer. For each job the
writer encodes and writes the shard, tells the trainer the buffer is free again, fsyncs, and commits
the step to the manifest. When the training process dies the socket closes; the writer finishes the
jobs already queued (their bytes are staged and whole) and exits.

Protocol (tuples over ``multiprocessing.connection.Connection``):
  trainer -> writer: ("attach", buffer_id, nbytes) followed by the fd; ("detach", buffer_id);
                     ("snapshot", job); ("close",)
  writer -> trainer: ("ready", info); ("released", buffer_id, step);
                     ("committed", job, figures); ("abandoned", job, message);
                     ("failed", job, error class name, message)
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle, send_handle
from typing import Optional

import psutil

from .commit import POLL_INTERVAL_S, Attempt, Committer, CommitWatcher
from ..errors import DiskFullError, WriterDiedError
from ..format.shard import ChunkEncoder, ShardWriter, checksum
from ..storage.local import LocalStorage, as_checkpoint_error
from ..storage.locks import join_rank_lock
from ..format.manifest import ShardRecord
from ..format.names import shard_file_name
from ..format.layout import Plan, shard_layout, ShardLayout

log = logging.getLogger(__name__)
_READY_TIMEOUT_S = 120.0


class WriterClient:
    """The training process's handle on its writer process."""

    def __init__(self, config: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "async_ckpt.write.writer", "--fd", str(theirs.fileno()),
                 "--config", json.dumps(config)],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        event = self.next_event(_READY_TIMEOUT_S)
        if event is None or event[0] != "ready":
            self.kill()
            raise WriterDiedError(f"the writer process did not start (got {event!r}); see its stderr")
        self.pid = self.process.pid

    def attach(self, buffer_id: int, fd: int, nbytes: int) -> None:
        self._send(("attach", buffer_id, nbytes))
        try:
            send_handle(self.conn, fd, self.process.pid)
        except OSError as e:
            raise self.died() from e

    def detach(self, buffer_id: int) -> None:
        self._send(("detach", buffer_id))

    def submit(self, job: dict) -> None:
        self._send(("snapshot", job))

    def _send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except OSError as e:
            raise self.died() from e

    def next_event(self, timeout: Optional[float]) -> Optional[tuple]:
        """The next message from the writer, or None after ``timeout`` seconds (None: no limit).

        Raises WriterDiedError as soon as the writer is gone, instead of hanging."""
        if not wait([self.conn], timeout):
            return None
        try:
            return self.conn.recv()
        except (EOFError, OSError) as e:
            raise self.died() from e

    def died(self) -> WriterDiedError:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = (f"was killed by signal {-code}" if code is not None and code < 0
               else f"exited with code {code}" if code is not None else "stopped answering")
        return WriterDiedError(
            f"the checkpoint writer process (pid {self.process.pid}) {how}. Snapshots in flight are "
            "lost; committed ones are intact. Check memory and disk, then create a new engine "
            "(or restart the job) to resume from the newest committed snapshot")

    def rss(self) -> dict:
        try:
            info = psutil.Process(self.process.pid).memory_info()
        except psutil.Error:
            return {}
        return {"writer_rss": info.rss, "writer_shared": info.shared}

    def close(self, timeout: float) -> None:
        try:
            self.conn.send(("close",))
        except OSError:
            pass
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.error("writer process %d did not exit in %.0f s; killing it", self.process.pid, timeout)
            self.kill()
        self.conn.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


class SnapshotWriter:
    """The writer process's state: attached buffers, the current plan and shard layout, and the
    commit stage (rank 0 commits, the other ranks watch for the commit)."""

    def __init__(self, conn: Connection, config: dict):
        self.conn = conn
        self.root = config["root"]
        self.storage = LocalStorage(self.root)
        self.rank = config["rank"]
        self.world_size = config["world_size"]
        self.spread_replicated = config["spread_replicated"]
        self.reserve_bytes = config["reserve_bytes"]
        self.encoder = ChunkEncoder(config["compression"], config["level"])
        self.buffers: dict[int, mmap.mmap] = {}
        self.plan: Optional[Plan] = None
        self.layout: Optional[ShardLayout] = None
        self.stored_ratio = 1.0
        if self.rank == 0:
            self.commit = Committer(self.storage, self.world_size, config["keep_last"],
                                    config["keep_every"], config["commit_timeout"], self.send)
        else:
            self.commit = CommitWatcher(self.storage, config["commit_timeout"], self.send)

    def serve(self) -> None:
        """Handle the trainer's messages; between them, let the commit stage poll. Once the
        trainer is gone (or closed), rank 0 finishes committing what is pending, then returns."""
        orphaned = False
        while not orphaned or (self.rank == 0 and self.commit.pending):
            polling = bool(self.commit.pending)
            if orphaned:
                time.sleep(POLL_INTERVAL_S)
            elif wait([self.conn], POLL_INTERVAL_S if polling else None):
                orphaned = not self.receive()
            if polling and self.rank == 0:
                self.commit.poll(orphaned)
            elif polling and not orphaned:
                self.commit.poll()

    def receive(self) -> bool:
        """Handle one message; False once the trainer has closed the connection or died."""
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            return False
        kind = message[0]
        if kind == "attach":
            try:
                fd = recv_handle(self.conn)
            except (EOFError, OSError):
                return False  # the trainer died between the message and its fd: as if it closed
            self.buffers[message[1]] = mmap.mmap(fd, message[2], prot=mmap.PROT_READ)
            os.close(fd)
        elif kind == "detach":
            self.buffers.pop(message[1]).close()
        elif kind == "snapshot":
            self.handle(message[1])
        return kind != "close"

    def send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except OSError:
            pass  # the trainer died; still finish and commit what it staged

    def handle(self, job: dict) -> None:
        if job.get("plan") is not None:
            self.plan = job["plan"]
            self.layout = shard_layout(self.plan, self.rank, self.world_size, self.spread_replicated)
        step, buffer_id = job["step"], job["buffer_id"]
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.send(("released", buffer_id, step))

        try:
            attempt = self.write(job, memoryview(self.buffers[buffer_id]), release)
        except Exception as e:  # a failed snapshot must not stop the writer; the trainer decides
            release()
            error = as_checkpoint_error(e, f"step {step}")
            log.error("snapshot of step %d failed: %s", step, error)
            self.send(("failed", job["job"], type(error).__name__, str(error)))
            return
        self.commit.add(attempt)  # rank 0 commits; the others watch for it

    def write(self, job: dict, buf: memoryview, release) -> Attempt:
        """Write and fsync this rank's shard of one snapshot under its final name; calls
        ``release`` once the staging buffer is no longer read."""
        step, plan, layout = job["step"], self.plan, self.layout
        t_start = time.monotonic()
        regions = [plan.regions[i] for i in layout.written]
        raw_bytes = sum(r.nbytes for r in regions)
        self.check_space(raw_bytes)
        # The directory must be durable before our shard's final name is: rank 0 commits on names.
        self.storage.make_snapshot_dir(job["dir"])
        shard = ShardWriter(self.storage.create_shard(job["dir"], shard_file_name(self.rank)),
                            self.encoder, version=2 if layout.uses_references else 1)
        try:
            for region, fields in zip(regions, layout.replica_fields):
                shard.add_storage(buf[region.offset:region.offset + region.nbytes],
                                  region.itemsize, region.is_float, **fields)
            replicas = [{"entry": entry, "owner": owner, "nbytes": plan.regions[i].nbytes,
                         "xxh3": checksum(buf[plan.regions[i].offset:
                                              plan.regions[i].offset + plan.regions[i].nbytes])}
                        for i, entry, owner in layout.replicas]
            release()
            t_written = time.monotonic()
            size, index_digest = shard.finish({
                "step": step, "rank": self.rank, "world_size": self.world_size,
                "created": time.time(), "tensors": list(layout.tensors), "tree": job["tree"],
                **({"replicas": replicas} if replicas else {})})
        except BaseException:
            shard.abort()
            if self.world_size == 1:  # with several ranks the directory is shared; rank 0 cleans
                self.storage.remove([job["dir"]])
            raise
        t_durable = time.monotonic()
        self.stored_ratio = size / max(raw_bytes, 1)
        return Attempt(job=job["job"], step=step, dir=job["dir"],
                       shard=ShardRecord(self.rank, shard_file_name(self.rank), size, index_digest),
                       replicas=replicas, raw_bytes=raw_bytes, figures={
                           "queue_s": t_start - job["submitted"], "write_s": t_written - t_start,
                           "fsync_s": t_durable - t_written, "shard_bytes": size},
                       durable_at=t_durable)

    def check_space(self, raw_bytes: int) -> None:
        """Refuse a snapshot that cannot fit before writing a byte of it."""
        need = int(raw_bytes * self.stored_ratio * 1.05) + self.reserve_bytes
        free = self.storage.free_bytes()
        if free < need:
            raise DiskFullError(
                f"not enough space for a snapshot in {self.root}: about {need / 1e6:.0f} MB needed "
                f"(incl. the {self.reserve_bytes / 1e6:.0f} MB reserve), {free / 1e6:.0f} MB free. "
                "Free space or lower keep_last; committed snapshots are intact")


def _lower_priority(nice: int, io_idle: bool) -> None:
    if nice:
        os.nice(nice)
    if io_idle:
        try:
            psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, 7)
        except (psutil.Error, OSError, AttributeError) as e:
            log.debug("could not lower I/O priority: %s", e)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    config = json.loads(args.config)
    # A terminal's Ctrl-C or a scheduler's SIGTERM reaches the whole process group; the writer
    # finishes what the trainer staged and exits when the trainer closes the socket (or dies).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=config["log_level"], stream=sys.stderr,
                        format=f"async_ckpt writer[rank {config['rank']}] %(levelname)s %(message)s")
    conn = Connection(args.fd)
    _lower_priority(config["nice"], config["low_io_priority"])
    join_rank_lock(config["lock"])  # held until exit: no other engine cleans up under our feet
    conn.send(("ready", {"pid": os.getpid()}))
    SnapshotWriter(conn, config).serve()


if __name__ == "__main__":
    main()

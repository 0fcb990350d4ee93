"""The floors: this machine's limits for a byte count (copy, durable write, warm and cold read),
measured in the same run as the systems; method: docs/performance.md, "Reading the numbers"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .harness import evict, fsync_dir, remove, rotated, settle, timed

FLOOR_KEYS = ("copy_s", "durable_s", "read_cache_s", "read_cold_s")
MIB = 1 << 20
READ_CHUNK = MIB
WRITE_WAYS = ("dd bs=1M", "dd bs=8M", "python 1 MiB writes", "fio direct", "fio buffered")
READ_WAYS = ("one readinto", "1 MiB readinto")
FIO_MIN_BYTES = 64 * 10**6
FIO_DIRECT_DEPTH = 8


@dataclass(frozen=True)
class Fastest:
    """One kind of floor in one sample: the fastest way, and every way's time or "n/a (reason)"."""

    seconds: float
    way: str
    ways: dict[str, Union[float, str]]

    @classmethod
    def of(cls, ways: dict[str, Union[float, str]]) -> "Fastest":
        ran = {name: s for name, s in ways.items() if not isinstance(s, str)}
        way = min(ran, key=ran.__getitem__)
        return cls(ran[way], way, ways)

    def fields(self, key: str) -> dict:
        """``{key: seconds, stem_way: way, stem_ways: ways}``, stem being ``key`` less ``_s``."""
        stem = key.removesuffix("_s")
        return {key: self.seconds, f"{stem}_way": self.way, f"{stem}_ways": self.ways}


class Floors:
    """The floors for ``nbytes``, one sample per ``measure()`` call, to interleave with systems."""

    def __init__(self, directory: str, nbytes: int):
        self.directory, self.nbytes = directory, nbytes
        self.src = torch.ones(nbytes, dtype=torch.uint8)  # faulted in by the fill
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.buffer_bytes = 2 * nbytes
        self.samples: list[dict] = []

    def measure(self) -> dict:
        sample = {"copy_s": copy_s([self.src], [self.dst])}
        sample.update(self._disk(len(self.samples)))
        self.samples.append(sample)
        return sample

    def _disk(self, turn: int) -> dict:
        """Every write way, then reads of the last file: cold first, since the last cold read leaves
        the file cached for the warm ones."""
        paths, written = [], ""
        writes: dict[str, Union[float, str]] = {}
        waited = 0.0
        try:
            for way in rotated(WRITE_WAYS, turn):
                skip = self._skip(way)
                if skip:
                    writes[way] = skip
                    continue
                paths.append(os.path.join(self.directory, f"floor-{len(paths)}.bin"))
                waited += settle(self.nbytes).waited_s
                writes[way] = self._write(way, paths[-1])
                written = paths[-1] if isinstance(writes[way], float) else written
            cold, warm = {}, {}
            for way in rotated(READ_WAYS, turn):
                evict(written)
                cold[way] = timed(lambda: self._read(way, written))
            for way in rotated(READ_WAYS, turn):
                warm[way] = timed(lambda: self._read(way, written))
        finally:
            for path in paths:
                remove(path)
            fsync_dir(self.directory)
        return {**Fastest.of(writes).fields("durable_s"), **Fastest.of(warm).fields("read_cache_s"),
                **Fastest.of(cold).fields("read_cold_s"), "settle_s": waited}

    def _skip(self, way: str) -> Optional[str]:
        """Why ``way`` cannot run here, or None."""
        if not way.startswith("fio"):
            return None
        if shutil.which("fio") is None:
            return "n/a (fio is not installed: apt-get install fio)"
        if self.nbytes < FIO_MIN_BYTES:
            return f"n/a (under {FIO_MIN_BYTES / 1e6:g} MB: fio's runtime is in whole ms)"
        return None

    def _write(self, way: str, path: str) -> Union[float, str]:
        if way.startswith("dd"):
            return timed(lambda: self._dd(path, way.split()[1]))
        if way.startswith("fio"):
            return self._fio(path, direct=way == "fio direct")
        return timed(lambda: self._python_writes(path))

    def _dd(self, path: str, *flags: str) -> None:
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", *flags, f"count={self.nbytes}",
                        "iflag=count_bytes", "conv=fsync", "status=none"], check=True)

    def _python_writes(self, path: str) -> None:
        view = memoryview(self.src.numpy())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for offset in range(0, len(view), MIB):
                os.write(fd, view[offset:offset + MIB])
            os.fsync(fd)
        finally:
            os.close(fd)

    def _fio(self, path: str, direct: bool) -> Union[float, str]:
        """fio's job runtime, open to end fsync, without its start-up; "n/a (reason)" where it fails
        (O_DIRECT on tmpfs, say)."""
        how = (["--ioengine=libaio", f"--iodepth={FIO_DIRECT_DEPTH}", "--direct=1"] if direct
               else ["--ioengine=psync", "--direct=0"])
        done = subprocess.run(
            ["fio", "--name=floor", f"--filename={path}", "--rw=write", "--bs=1M",
             f"--size={-(-self.nbytes // MIB) * MIB}", "--end_fsync=1", "--fallocate=none",
             "--eta=never", "--output-format=json", *how], capture_output=True, text=True)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            return f"n/a (fio failed here: {lines[-1]})"
        return json.loads(done.stdout)["jobs"][0]["job_runtime"] / 1000

    def _read(self, way: str, path: str) -> None:
        read_into(path, self.dst, READ_CHUNK if way == "1 MiB readinto" else self.nbytes)

    def close(self) -> None:
        self.src = self.dst = None


def copy_s(sources: Sequence[torch.Tensor], twins: Sequence[torch.Tensor]) -> float:
    """Seconds of one ``copy_`` of every source into its preallocated twin: the copy floor, of
    one buffer here, of a state's own tensors where a part has them."""
    return timed(lambda: [twin.copy_(source) for source, twin in zip(sources, twins)])


def read_into(path: str, dst: torch.Tensor, chunk: int = READ_CHUNK) -> None:
    """Read ``path`` sequentially, ``chunk`` bytes a call, into ``dst`` (preallocated)."""
    view = memoryview(dst.numpy())
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:done + chunk])
            if not n:
                raise EOFError(f"{path} is shorter than {len(view)} bytes")
            done += n

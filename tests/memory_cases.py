"""Crafted snapshots that claim much more than they hold, and a child process that measures what a
read path costs on them (issue 40: memory within 1.2x of what is loaded, plus a fixed allowance).

Used by ``tests/test_memory.py``; ``python tests/memory_cases.py KIND SIZE OP...`` measures larger
sizes.

- ``write_case(kind, root, size)`` makes a committed snapshot in ``root`` that a real engine wrote
  and that is then edited (checksums and the manifest's record fixed up: they prove nothing):
  ``zstd_zeros`` (one storage of ``size`` zero bytes as ONE zstd chunk, a few KiB on disk),
  ``planes_zeros`` (``size`` bytes of float32 zeros as one planes chunk, every plane zstd),
  ``stride0`` (a bool mask of one byte expanded by a stride of 0 to ``size`` elements),
  ``big_list`` (a value that is a list of ``size`` small lists), ``world_size`` (a manifest whose
  snapshot claims ``size`` ranks, every shard record listed), ``whitespace`` (a manifest padded
  with ``size`` bytes of spaces).
- ``measure_each([(op, root), ...], timeout)`` runs each ``op`` (``OPS``) in a fresh interpreter,
  one after the other, and returns the peak resident memory each added (VmHWM after the call minus VmRSS before: the interpreter, torch
  and the library are loaded first and not counted), the error type it raised (None) and its time.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

import xxhash
import zstandard

from async_ckpt.format.shard import STORAGE_ALIGNMENT

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KINDS = ("zstd_zeros", "planes_zeros", "stride0", "big_list", "world_size", "whitespace")
OPS = ("load", "load_mmap", "restore", "verify", "export_pt", "export_safetensors", "ls",
       "inspect")


def write_case(kind: str, root: str, size: int) -> None:
    import torch
    from async_ckpt import CheckpointEngine

    state = {"t": torch.zeros(64, dtype=torch.uint8), "v": [1]}
    with CheckpointEngine(root, state, compression="zstd", heartbeat_interval=None) as engine:
        engine.snapshot(1)
    manifest_path = os.path.join(root, "manifest.json")
    manifest = json.load(open(manifest_path))
    record = manifest["snapshots"][0]
    shard_path = glob.glob(os.path.join(root, record["dir"], "rank-*.ackpt"))[0]
    data = open(shard_path, "rb").read()
    offset, length = _trailer(data)
    index = json.loads(data[offset:offset + length])
    tensor = next(t for t in index["tensors"] if t["shape"] == [64])
    storage_no = tensor["storage"]
    prefix = data[:offset]
    if kind in ("zstd_zeros", "planes_zeros"):
        prefix = _one_big_chunk(index, storage_no, prefix, size, kind == "planes_zeros")
        itemsize = 4 if kind == "planes_zeros" else 1
        tensor.update(dtype="float32" if itemsize == 4 else "uint8", shape=[size // itemsize])
    elif kind == "stride0":
        tensor.update(dtype="bool", shape=[size], stride=[0])
    elif kind == "big_list":
        index["tree"]["entries"]["v"]["state"] = [[]] * size
    blob = json.dumps(index, separators=(",", ":")).encode()
    digest = xxhash.xxh3_64_intdigest(blob)
    shard = prefix + blob + (len(prefix)).to_bytes(8, "little") + len(blob).to_bytes(8, "little") \
        + digest.to_bytes(8, "little") + b"ACKPTEND"
    open(shard_path, "wb").write(shard)
    record["shards"][0].update(bytes=len(shard), index_xxh3=f"{digest:016x}")
    if kind == "world_size":
        shard_record = record["shards"][0]
        record["world_size"] = size
        record["shards"] = [dict(shard_record, rank=r, file=f"rank-{r:05d}.ackpt")
                            for r in range(size)]
    text = json.dumps(manifest).encode()
    if kind == "whitespace":
        text = text[:-1] + b" " * size + text[-1:]
    open(manifest_path, "wb").write(text)


def _trailer(data: bytes) -> tuple[int, int]:
    offset = int.from_bytes(data[-32:-24], "little")
    return offset, int.from_bytes(data[-24:-16], "little")


def _one_big_chunk(index: dict, storage_no: int, prefix: bytes, size: int, planes: bool) -> bytes:
    """The data area with storage ``storage_no`` replaced by one chunk of ``size`` zero bytes,
    zstd (or planes of float32, each plane zstd), and the later chunks' offsets moved."""
    storage = index["storages"][storage_no]
    (old,) = storage["chunks"]
    compress = zstandard.ZstdCompressor(level=3).compress
    if planes:
        plane = compress(bytes(size // 4))
        stored = plane * 4
        fields = {"codec": "planes", "planes": [["zstd", len(plane)]] * 4}
        storage.update(itemsize=4, float=True)
    else:
        stored = compress(bytes(size))
        fields = {"codec": "zstd"}
    storage["nbytes"] = size
    storage["chunks"] = [dict(offset=old["offset"], stored=len(stored), raw=size,
                              xxh3=xxhash.xxh3_64_hexdigest(stored), **fields)]
    old_end, new_end = old["offset"] + old["stored"], old["offset"] + len(stored)
    if old_end == len(prefix):  # the last chunk: the index follows it directly
        return prefix[:old["offset"]] + stored
    # a later storage's first chunk starts at the next aligned offset (format 5)
    old_next, new_next = (n + -n % STORAGE_ALIGNMENT for n in (old_end, new_end))
    for other in index["storages"][storage_no + 1:]:
        for c in other.get("chunks", ()):
            c["offset"] += new_next - old_next
    return prefix[:old["offset"]] + stored + bytes(new_next - new_end) + prefix[old_next:]


MEASURED = "measured:"  # what starts the child's line of each case's figures
_CHILD = r"""
import gc, json, os, sys, time, traceback
cases, out = json.loads(sys.argv[1]), sys.argv[2]
import torch
import async_ckpt
from async_ckpt import load, CheckpointEngine
from async_ckpt.tools.cli import main as cli
from async_ckpt.read.snapshot import read_committed

from memory_cases import MEASURED, reset_peak, peak_added

def run(op, root):
    if op == "load":
        return load(root)
    if op == "load_mmap":
        return load(root, mmap=True)
    if op == "restore":
        with CheckpointEngine(root, {}, heartbeat_interval=None) as engine:
            return engine.restore()
    if op == "export_pt":
        return cli(["export", root, "--to", os.path.join(out, "x.pt")])
    if op == "export_safetensors":
        return cli(["export", root, "--to", os.path.join(out, "x.safetensors")])
    return cli([op, root])

for op, root in cases:
    base = reset_peak()
    start, error, result = time.perf_counter(), None, None
    try:
        result = run(op, root)
        if isinstance(result, int) and result != 0:
            error = f"exit {result}"
    except BaseException as e:
        error = type(e).__module__ + "." + type(e).__name__ + ": " + str(e)[:300]
        if not isinstance(e, async_ckpt.errors.CheckpointError):
            traceback.print_exc()
    seconds, peak = time.perf_counter() - start, peak_added(base)
    result = None  # what the next case measures starts from here
    gc.collect()
    for name in os.listdir(out):
        os.unlink(os.path.join(out, name))
    print(MEASURED, json.dumps({"peak": peak, "error": error, "seconds": seconds}), flush=True)
"""


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) << 10
    raise LookupError(field)


def reset_peak() -> int:
    """Start this process's peak resident memory (VmHWM) again from now; returns the resident
    memory now, which ``peak_added`` takes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: VmHWM := VmRSS
    return _status("VmRSS")


def peak_added(base: int) -> int:
    """The peak resident memory since ``reset_peak`` returned ``base``, above ``base``."""
    return max(0, _status("VmHWM") - base)


def measure_each(cases: list[tuple[str, str]], timeout: float = 120) -> list[dict]:
    """For each ``(op, root)``: ``{"peak": bytes added at peak, "error": None or
    "module.Type: message", "seconds"}``, or ``{"crash": returncode, "stderr": ...}`` when the
    child died. The cases run one after the other in one child (its start-up, importing torch,
    takes longer than most cases), each peak counted from the memory resident once the previous
    case's result is freed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cases), out], env=env,
                              capture_output=True, text=True, timeout=timeout)
    results = [json.loads(line.removeprefix(MEASURED)) for line in done.stdout.splitlines()
               if line.startswith(MEASURED)]  # the commands print lines of their own
    for result in results:
        result["stderr"] = done.stderr[-2000:]
    crashed = {"crash": done.returncode, "stderr": done.stderr[-2000:]}
    return results + [crashed] * (len(cases) - len(results))


if __name__ == "__main__":  # python tests/memory_cases.py KIND SIZE OP...: make one case, measure
    kind, size, ops = sys.argv[1], int(sys.argv[2]), sys.argv[3:] or list(OPS)
    with tempfile.TemporaryDirectory() as d:
        write_case(kind, os.path.join(d, "ck"), size)
        for op in ops:
            r, = measure_each([(op, os.path.join(d, "ck"))], timeout=600)  # a child each
            print(kind, size, op, {k: v for k, v in r.items() if k != "stderr"},
                  r.get("stderr", "")[-300:] if r.get("crash") is not None else "")

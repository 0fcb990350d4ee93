"""The remote tier against an S3-protocol server on loopback (``moto_server``): upload and restore
against the client's own best bulk transfer, and a training step while the store is down
(method: docs/performance.md, "What runs")."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from async_ckpt.format.manifest import read_manifest
from async_ckpt.storage.local import LocalStorage
from async_ckpt.storage.remote import PART_BYTES, TRANSFER_CONCURRENCY, ObjectStorage

from .markdown import ms, ratio, seconds, section, table
from .measure import log, ratio_spread, remove, spread
from .registry import OURS_REMOTE

FULL = {"bytes": 1 << 30, "rounds": 4, "steps": 20}
QUICK = {"bytes": 16 << 20, "rounds": 2, "steps": 3}
BUCKET = "bench-remote"


@contextlib.contextmanager
def _moto():
    """A moto S3 server on a free loopback port with ``BUCKET`` made, the AWS environment
    pointing at it while it runs: its process (stopped by ``_steps_while_down``)."""
    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)],  # this Python's moto, wherever its scripts went
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # moto imports for seconds on a busy machine
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                break
            if server.poll() is not None:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("moto_server did not start listening")
        boto3.client("s3").create_bucket(Bucket=BUCKET)  # raises if the server exited
        yield server
    finally:
        server.kill()
        server.wait()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _one_round(server: subprocess.Popen, root: str, nbytes: int, steps: int) -> dict:
    import boto3
    import obstore
    from boto3.s3.transfer import TransferConfig

    url = f"s3://{BUCKET}/bench-{uuid.uuid4().hex[:8]}"
    state = {"weights": torch.randn(nbytes // 4)}
    local = os.path.join(root, "node")
    with contextlib.closing(OURS_REMOTE.open(state, local, remote=url)) as system:
        system.save(0)
        system.wait()
        start = time.perf_counter()
        system.engine.wait(remote=True)
        upload_s = time.perf_counter() - start
    record = read_manifest(LocalStorage(local)).snapshots[-1]
    shard = os.path.join(local, record.dir, record.shards[0].file)
    storage = ObjectStorage(url)
    client = boto3.client("s3")
    transfer = TransferConfig(multipart_chunksize=PART_BYTES, max_concurrency=TRANSFER_CONCURRENCY)
    key = f"{storage.prefix}/floor.bin"
    floors = {}
    start = time.perf_counter()
    obstore.put(storage.store, "floor.bin", Path(shard), chunk_size=PART_BYTES,
                max_concurrency=TRANSFER_CONCURRENCY)
    floors["obstore put"] = time.perf_counter() - start
    start = time.perf_counter()
    client.upload_file(shard, BUCKET, key, Config=transfer)
    floors["boto3 upload_file"] = time.perf_counter() - start
    fresh = os.path.join(root, "fresh")
    target = {"weights": torch.empty(nbytes // 4)}
    with contextlib.closing(OURS_REMOTE.open(target, fresh, remote=url)) as system:
        start = time.perf_counter()
        system.restore()
        restore_s = time.perf_counter() - start
    assert torch.equal(target["weights"], state["weights"])
    downloads = {}
    start = time.perf_counter()
    size = os.path.getsize(shard)
    with open(os.path.join(root, "download.bin"), "wb") as f:
        for offset in range(0, size, PART_BYTES * TRANSFER_CONCURRENCY):
            starts = list(range(offset, min(size, offset + PART_BYTES * TRANSFER_CONCURRENCY),
                                PART_BYTES))
            for part in obstore.get_ranges(storage.store, "floor.bin", starts=starts,
                                           lengths=[min(PART_BYTES, size - s) for s in starts]):
                f.write(part)
    downloads["obstore ranged GETs"] = time.perf_counter() - start
    start = time.perf_counter()
    client.download_file(BUCKET, key, os.path.join(root, "download2.bin"), Config=transfer)
    downloads["boto3 download_file"] = time.perf_counter() - start
    storage.remove([record.dir])
    obstore.delete(storage.store, "floor.bin")
    obstore.delete(storage.store, "manifest.json")
    for name in ("node", "fresh", "download.bin", "download2.bin"):
        remove(os.path.join(root, name))
    return {"shard_bytes": size, "upload_s": upload_s, "upload_floor_s": min(floors.values()),
            "upload_floors": floors, "restore_s": restore_s,
            "download_floor_s": min(downloads.values()), "downloads": downloads,
            **_steps_while_down(server, os.path.join(root, "steps"), steps)}


def _steps_while_down(server: subprocess.Popen, local: str, steps: int) -> dict:
    """Median seconds of a training step (snapshot every step) with the store running, and with
    its process stopped, in blocks up, down, up, down; the server runs again on return."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(2)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    x = torch.randn(256, 2048)
    times: dict[str, list[float]] = {"up": [], "down": []}
    url = f"s3://{BUCKET}/steps-{uuid.uuid4().hex[:8]}"
    with contextlib.closing(OURS_REMOTE.open({"model": model, "optimizer": opt}, local, remote=url,
                                             keep_last=2)) as system:
        step = 0
        try:
            for phase in ("up", "down", "up", "down"):
                os.kill(server.pid, signal.SIGSTOP if phase == "down" else signal.SIGCONT)
                for _ in range(steps):
                    start = time.perf_counter()
                    model(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                    system.save(step)
                    times[phase].append(time.perf_counter() - start)
                    step += 1
        finally:
            os.kill(server.pid, signal.SIGCONT)
        lag = system.engine.stats()["upload_lag_steps"]
        system.engine.wait(remote=True)
    shutil.rmtree(local)
    return {"step_up_s": spread(times["up"])["median"], "step_down_s": spread(times["down"])["median"],
            "lag_steps_when_down": lag}


def run(root: str, quick: bool) -> dict:
    """Start a server, measure the rounds, stop it; the results block of results.json."""
    config = QUICK if quick else FULL
    with _moto() as server:
        rounds = []
        for n in range(config["rounds"]):
            rounds.append(_one_round(server, root, config["bytes"], config["steps"]))
            log(f"remote: round {n + 1}/{config['rounds']}: upload {rounds[-1]['upload_s']:.2f} s "
                f"(floor {rounds[-1]['upload_floor_s']:.2f}), restore {rounds[-1]['restore_s']:.2f}"
                f" s (download {rounds[-1]['download_floor_s']:.2f})")
    measured = rounds[1:] or rounds  # the first round warms up the server and the page cache
    figures = {key: spread([r[key] for r in measured]) for key in
               ("upload_s", "upload_floor_s", "restore_s", "download_floor_s", "step_up_s",
                "step_down_s")}
    ratios = {name: ratio_spread([r[key] for r in measured], [r[floor] for r in measured])
              for name, key, floor in (("upload", "upload_s", "upload_floor_s"),
                                       ("restore", "restore_s", "download_floor_s"),
                                       ("step_down", "step_down_s", "step_up_s"))}
    return {"config": config, "shard_bytes": rounds[0]["shard_bytes"], "figures": figures,
            "ratios": ratios, "rounds": rounds}


def render(block: dict) -> str:
    f, r, gb = block["figures"], block["ratios"], block["shard_bytes"] / 1e9

    def transfer(key: str) -> str:
        return f"{seconds(f[key], 2)}, {gb / f[key]['median']:.2f} GB/s"

    rows = [["upload (local commit → bucket manifest)", transfer("upload_s"),
             f"{transfer('upload_floor_s')} (best bulk upload)", ratio(r["upload"])],
            ["restore on an empty node", transfer("restore_s"),
             f"{transfer('download_floor_s')} (plain parallel download)", ratio(r["restore"])]]
    if "step_down_s" in f:  # results saved before this figure existed lack it
        rows.append(["training step, snapshot every step, store stopped", ms(f["step_down_s"]),
                     f"{ms(f['step_up_s'])} (store running)", ratio(r["step_down"])])
    return section("Remote tier (moto S3 server on loopback)",
                   f"A {gb:.3g} GB shard; median of {f['upload_s']['n']} rounds after a warm-up "
                   "(min–max).", table(["", "async_ckpt", "floor", "ratio"], rows))

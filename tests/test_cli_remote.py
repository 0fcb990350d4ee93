"""The `async-ckpt` commands on an object store prefix (``s3://bucket/prefix``), against a real
S3-protocol server on loopback (tests/s3server.py): the same output and exit codes as on the
local directory the same engine committed to, damage found in the bucket, gc confined to the
prefix, bad URLs and a store that cannot be reached.

An engine uploads steps 0-30 to a template prefix once per module; each test works on its own
server-side copy of it, so a test that damages or collects its prefix leaves the others alone.
"""

import json
import socket
import uuid

import pytest
import torch
from safetensors.torch import load_file

from async_ckpt import CheckpointEngine
from async_ckpt.format.manifest import read_manifest
from async_ckpt.storage.local import LocalStorage
from async_ckpt.storage.names import MANIFEST_NAME
from async_ckpt.format.shard import ShardReader
from async_ckpt.storage.remote import ObjectStorage
from async_ckpt.tools.cli import main
from conftest import assert_same, make_training_state, train_step

obstore = pytest.importorskip("obstore")

STEPS = [0, 10, 20, 30]
LEFTOVER = "step-00000000000000000099.0badf00d"


@pytest.fixture(scope="module")
def template(server, tmp_path_factory):
    """(local directory, URL): an engine's directory and the prefix it uploaded every step to."""
    local = str(tmp_path_factory.mktemp("template") / "ckpt")
    url = server.url("template")
    model, opt, sched = make_training_state(seed=3)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "extra": {"epoch": 7}}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in server.env.items():
            patch.setenv(name, value)
        with CheckpointEngine(local, state, keep_last=10, remote=url) as engine:
            for step in STEPS:
                train_step(model, opt, sched)
                engine.snapshot(step)
                engine.wait(remote=True)  # each one uploaded: none superseded before its turn
    return local, url


@pytest.fixture
def ckpt(template, server, monkeypatch):
    """(local directory, URL of this test's copy of the template prefix), with the AWS
    environment pointing at the server."""
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    local, url = template
    bucket = ObjectStorage(server.url(""))
    copy = f"run-{uuid.uuid4().hex[:8]}"
    for batch in obstore.list(bucket.store, "template"):
        for o in batch:
            obstore.copy(bucket.store, o["path"], copy + o["path"][len("template"):])
    return local, server.url(copy)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("async-ckpt: error: "), err
    return lines[0]


def table_rows(out):
    """ls's rows of committed snapshots: (step, files column, newest mark)."""
    rows = [line.split() for line in out.splitlines()[2:] if line[:12].strip().isdigit()]
    return [(int(r[0]), r[-1] if r[-1] != "newest" else r[-3], r[-1] == "newest") for r in rows]


def flip_chunk_byte(url, step):
    """Flip a byte of the first chunk of ``step``'s shard object; returns where it is."""
    storage = ObjectStorage(url)
    record = read_manifest(storage).find(step)
    file = record.shards[0].file
    with ShardReader(storage.open_shard(record.dir, file)) as reader:
        offset = reader.index["storages"][0]["chunks"][0]["offset"]
    key = f"{record.dir}/{file}"
    data = bytearray(bytes(obstore.get(storage.store, key).bytes()))
    data[offset + 3] ^= 0xFF
    obstore.put(storage.store, key, bytes(data))
    return storage.location(record.dir, file)


def test_ls_lists_the_same_snapshots_as_the_local_directory(capsys, ckpt):
    local, url = ckpt
    code, out, err = run(capsys, "ls", url)
    assert code == 0 and err == ""
    assert out.startswith(f"{url}: 4 committed snapshots")
    assert table_rows(out) == table_rows(run(capsys, "ls", local)[1]) == [
        (10 * i, "ok", i == 3) for i in range(4)]

    code, out, _ = run(capsys, "ls", url, "--json")
    remote, here = json.loads(out), json.loads(run(capsys, "ls", local, "--json")[1])
    assert code == 0 and remote["directory"] == url and remote["manifest"] is True
    fields = ("step", "dir", "world_size", "raw_bytes", "stored_bytes", "newest", "problems")
    assert ([[s[f] for f in fields] for s in remote["snapshots"]]
            == [[s[f] for f in fields] for s in here["snapshots"]])
    assert remote["newest_step"] == 30 and remote["leftovers"] == []


def test_ls_flags_a_missing_object_and_lists_leftovers_with_their_size(capsys, ckpt):
    _, url = ckpt
    storage = ObjectStorage(url)
    record = read_manifest(storage).find(10)
    obstore.delete(storage.store, f"{record.dir}/{record.shards[0].file}")
    obstore.put(storage.store, f"{LEFTOVER}/rank-00000.ackpt", b"half a shard")
    code, out, _ = run(capsys, "ls", url)
    assert code == 1 and f"step 10: {record.dir}/rank-00000.ackpt is missing" in out
    assert LEFTOVER in out.split("leftovers of snapshots that never committed")[1]
    doc = json.loads(run(capsys, "ls", url, "--json")[1])
    assert [bool(s["problems"]) for s in doc["snapshots"]] == [False, True, False, False]
    assert doc["leftovers"] == [{"name": LEFTOVER, "kind": "snapshot", "step": 99, "bytes": 12}]


def test_inspect_shows_the_entries_as_for_the_local_directory(capsys, ckpt):
    local, url = ckpt
    for options in ([], ["--step", "10"], ["--rank", "0"]):
        code, out, err = run(capsys, "inspect", url, *options)
        assert code == 0 and err == ""
        assert f" in {url}, rank 0 of 1, committed " in out.splitlines()[0]
        assert out.splitlines()[1:] == run(capsys, "inspect", local, *options)[1].splitlines()[1:]
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert rows["model.0.weight"][:3] == ["float32", "[32,", "32]"] and rows["extra.epoch"] == ["7"]
    for root in ckpt:
        code, _, err = run(capsys, "inspect", root, "--rank", "1")
        assert code == 2 and "step 30 has no shard of rank 1; its ranks: 0" in one_error_line(err)


def test_verify_passes_and_finds_a_flipped_byte(capsys, ckpt, tmp_path):
    local, url = ckpt
    code, out, err = run(capsys, "verify", url, "--all")
    assert code == 0 and err == "" and out.startswith(f"{url}: read every chunk of 4 snapshots")
    assert out.splitlines()[1:] == run(capsys, "verify", local, "--all")[1].splitlines()[1:]

    damaged = flip_chunk_byte(url, 30)
    code, out, err = run(capsys, "verify", url)
    assert code == 1 and err == ""  # the report is the output, as for a directory
    assert f"{damaged}: storage 0 chunk 0 fails its checksum" in out
    assert "restore() would pick step 20" in out
    code, out, err = run(capsys, "export", url, "--to", tmp_path / "x.pt")
    assert code == 1 and out == "" and "fails its checksum" in one_error_line(err)
    assert not (tmp_path / "x.pt").exists()


def test_export_gives_the_same_tensors_as_from_the_local_directory(capsys, ckpt, tmp_path):
    local, url = ckpt
    for name, read in (("all.pt", lambda p: torch.load(p, weights_only=False)),
                       ("all.safetensors", load_file)):
        files = []
        for root in ckpt:
            files.append(tmp_path / f"{len(files)}-{name}")
            code, out, err = run(capsys, "export", root, "--step", "20", "--rank", "0",
                                 "--to", files[-1])
            assert code == 0 and err == "" and "exported step 20 (all entries)" in out
        assert_same(read(files[0]), read(files[1]))
    assert read_manifest(LocalStorage(local)).steps() == STEPS  # nothing written into either


def test_gc_removes_leftovers_of_the_prefix_only_and_keeps_committed_snapshots(capsys, ckpt):
    local, url = ckpt
    storage, sibling = ObjectStorage(url), ObjectStorage(url + "-sibling")  # a longer name
    for store in (storage, sibling):
        obstore.put(store.store, f"{LEFTOVER}/rank-00000.ackpt", b"half a shard")
    committed = sorted(r.dir for r in read_manifest(storage).snapshots)

    code, _, err = run(capsys, "gc", url)  # a bucket has no locks: not without --force
    assert code == 2 and "--force" in one_error_line(err)
    code, out, _ = run(capsys, "gc", url, "--dry-run")
    assert code == 0 and [LEFTOVER, "12", "B", "leftover", "of", "uncommitted", "step", "99"] in [
        line.split() for line in out.splitlines()]
    assert storage.list_root() == sorted([MANIFEST_NAME, LEFTOVER, *committed])

    code, out, err = run(capsys, "gc", url, "--force")
    assert code == 0 and err == "" and "removed 1 of 1, freed 12 B" in out
    assert storage.list_root() == sorted([MANIFEST_NAME, *committed])
    assert read_manifest(storage).steps() == STEPS
    assert sibling.list_root() == [LEFTOVER]  # outside the prefix: untouched

    code, out, _ = run(capsys, "gc", url, "--force", "--keep-last", "1")
    assert code == 0 and "keeping 1 committed snapshot (step 30)" in out
    assert storage.list_root() == [MANIFEST_NAME, committed[-1]]
    assert run(capsys, "verify", url)[0] == 0

    code, _, err = run(capsys, "gc", local, "--force")  # a directory's locks decide there
    assert code == 2 and "--force is for an s3:// URL" in one_error_line(err)


COMMANDS = [["ls"], ["inspect"], ["verify"], ["export", "--to", "x.pt"], ["gc"]]


def test_a_bad_url_or_an_empty_prefix_is_a_usage_error(capsys, server, monkeypatch, tmp_path):
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    cases = [("s3://UPPER/x", "is not a valid s3://BUCKET/PREFIX URL"),
             ("s3://bucket/../x", "is not a valid s3://BUCKET/PREFIX URL"),
             (server.url("nothing-here"), "is not an async_ckpt checkpoint prefix")]
    for url, message in cases:
        for command, *options in COMMANDS:
            code, out, err = run(capsys, command, url, *options)
            assert code == 2 and out == "" and message in one_error_line(err), (command, url)
    assert not (tmp_path / "x.pt").exists()


def test_a_store_that_cannot_be_reached_is_one_line_and_exit_1(capsys, server, monkeypatch,
                                                                tmp_path):
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: every connection is refused
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed.getsockname()[1]}")
        for command, *options in COMMANDS:
            code, out, err = run(capsys, command, server.url("x"), *options)
            line = one_error_line(err)
            assert code == 1 and out == "" and server.url("x") in line, command
            assert "check that the store is up" in line, command
    assert not (tmp_path / "x.pt").exists()

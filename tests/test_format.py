"""The shard file format: round trips, golden bytes, and a reader that refuses every kind of damage.

Files are written with ShardWriter from numpy/bytes data (no torch) and always under ``tmp_path``.
Damaged indexes are written back with a matching trailer (``rewrite_index``), so the reader's
structural validation is what refuses them, not the index checksum.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from async_ckpt.errors import ChecksumMismatchError, CorruptSnapshotError, UnsupportedFormatError
from async_ckpt.format.records import Chunk, Replica, StorageEntry, StoredTensor
from async_ckpt.format.shard import (HEADER_SIZE, MAGIC, STORAGE_ALIGNMENT, TRAILER_MAGIC,
                                    TRAILER_SIZE, ChunkCache, ChunkEncoder, ShardReader,
                                    ShardWriter, checksum, tensor_table, version_needed)

META = {"step": 7, "rank": 0}
SMALL_CHUNK = 4096


# --- helpers -------------------------------------------------------------------------------------

def normal_f32(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.02, n).astype(np.float32)


def bf16_like(n: int, seed: int = 0) -> np.ndarray:
    """The top half of float32 N(0, 0.02) values: what a bf16 tensor's bytes look like."""
    return (normal_f32(n, seed).view(np.uint32) >> 16).astype(np.uint16)


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def write_shard(path, storages, compression="zstd", chunk_bytes=SMALL_CHUNK, meta=META, workers=0,
                version=1):
    """Write ``storages`` (a list of (data, itemsize, is_float)) and return finish()'s result."""
    writer = ShardWriter(str(path), ChunkEncoder(compression), chunk_bytes=chunk_bytes,
                         workers=workers, version=version)
    for data, itemsize, is_float in storages:
        writer.add_storage(memoryview(as_bytes(data)), itemsize, is_float)
    return writer.finish(dict(meta))


def as_bytes(data) -> bytes:
    return data.tobytes() if isinstance(data, np.ndarray) else bytes(data)


def read_storages(path, **kwargs) -> list[bytes]:
    with ShardReader(str(path), **kwargs) as reader:
        out = []
        for i, s in enumerate(reader.index["storages"]):
            buf = bytearray(s["nbytes"])
            reader.read_storage(i, buf)
            out.append(bytes(buf))
        return out


def index_of(path) -> dict:
    with ShardReader(str(path)) as reader:
        return reader.index


def split_file(data: bytes):
    """(header, data area, index blob, (index offset, length, digest, magic)) parsed independently."""
    trailer = struct.unpack("<QQQ8s", data[-32:])
    offset, length = trailer[0], trailer[1]
    return data[:16], data[16:offset], data[offset:offset + length], trailer


def rewrite_index(src, dst, index=None, blob: bytes | None = None) -> None:
    """Copy ``src`` to ``dst`` with its index replaced and a trailer that matches the new index."""
    data = open(src, "rb").read()
    header, area, _, _ = split_file(data)
    if blob is None:
        blob = json.dumps(index, separators=(",", ":")).encode()
    offset = len(header) + len(area)
    trailer = struct.pack("<QQQ8s", offset, len(blob), xxhash.xxh3_64_intdigest(blob), b"ACKPTEND")
    with open(dst, "wb") as f:
        f.write(header + area + blob + trailer)


def damaged_copy(src, dst, edit) -> None:
    data = bytearray(open(src, "rb").read())
    edit(data)
    with open(dst, "wb") as f:
        f.write(data)


def mixed_storages():
    """Two multi-chunk float storages (planes), compressible ints (zstd), noise (raw), an empty one."""
    return [
        (normal_f32(2500, seed=1), 4, True),           # 10000 bytes: 4096 + 4096 + 1808, planes
        (np.arange(3000, dtype=np.int32) % 7, 4, False),  # 12000 bytes, zstd
        (random_bytes(5000, seed=2), 1, False),        # raw
        (b"", 1, False),                               # no chunks
        (bf16_like(3000, seed=3), 2, True),            # 6000 bytes: 4096 + 1904, planes
    ]


@pytest.fixture
def mixed_file(tmp_path):
    path = tmp_path / "mixed.ackpt"
    write_shard(path, mixed_storages())
    return path


# --- round trips ---------------------------------------------------------------------------------

ROUND_TRIP_CASES = {
    # name: (data, itemsize, is_float, compression, expected codecs of the chunks)
    "raw-none-compression": (normal_f32(1000), 4, True, None, ["raw"]),
    "raw-none-compression-ints": (np.zeros(1000, np.int64), 8, False, None, ["raw", "raw"]),
    "f32-planes": (normal_f32(1024), 4, True, "zstd", ["planes"]),
    "bf16-planes": (bf16_like(2048), 2, True, "zstd", ["planes"]),
    "f16-planes": (np.random.default_rng(4).normal(0, 1, 2048).astype(np.float16), 2, True, "zstd",
                   ["planes"]),
    "f64-planes": (np.random.default_rng(5).normal(0, 0.02, 512), 8, True, "zstd", ["planes"]),
    "int-zeros-zstd": (np.zeros(512, np.int64), 8, False, "zstd", ["zstd"]),
    "int-small-zstd": (np.random.default_rng(6).integers(0, 10, 1024).astype(np.int32), 4, False,
                       "zstd", ["zstd"]),
    "bytes-noise-raw": (random_bytes(4000, seed=7), 1, False, "zstd", ["raw"]),
    "float-noise-raw": (random_bytes(4000, seed=8), 4, True, "zstd", ["raw"]),
    "empty-zstd": (b"", 4, True, "zstd", []),
    "empty-raw": (b"", 1, False, None, []),
}


@pytest.mark.parametrize("case", list(ROUND_TRIP_CASES))
def test_round_trip_codecs(tmp_path, case):
    data, itemsize, is_float, compression, codecs = ROUND_TRIP_CASES[case]
    path = tmp_path / "s.ackpt"
    write_shard(path, [(data, itemsize, is_float)], compression=compression)
    index = index_of(path)
    (storage,) = index["storages"]
    assert [c["codec"] for c in storage["chunks"]] == codecs
    assert storage["nbytes"] == len(as_bytes(data))
    assert storage["itemsize"] == itemsize and storage["float"] is is_float
    assert read_storages(path) == [as_bytes(data)]


def test_planes_store_only_the_top_plane_compressed(tmp_path):
    path = tmp_path / "s.ackpt"
    write_shard(path, [(normal_f32(1024), 4, True)])
    (chunk,) = index_of(path)["storages"][0]["chunks"]
    planes = chunk["planes"]
    assert planes[:3] == [["raw", 1024]] * 3
    assert planes[3][0] == "zstd" and 0 < planes[3][1] < 1024
    assert chunk["stored"] == 3 * 1024 + planes[3][1] < chunk["raw"] == 4096


@pytest.mark.parametrize("itemsize,chunk_bytes", [(1, 4096), (2, 4096), (4, 4098), (8, 4100),
                                                  (16, 4097)])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_storages_span_several_chunks(tmp_path, itemsize, chunk_bytes, compression):
    """Chunks hold a whole number of items: the step is chunk_bytes rounded down to the itemsize."""
    step = chunk_bytes - chunk_bytes % itemsize
    nbytes = 3 * step + 5 * itemsize  # not a multiple of the step
    rng = np.random.default_rng(itemsize)
    dtype = np.float32 if itemsize <= 4 else np.float64
    data = rng.normal(0, 0.02, nbytes // 4 + 1).astype(dtype).tobytes()[:nbytes]
    assert len(data) == nbytes
    path = tmp_path / "s.ackpt"
    write_shard(path, [(data, itemsize, True)], compression=compression, chunk_bytes=chunk_bytes)
    chunks = index_of(path)["storages"][0]["chunks"]
    assert [c["raw"] for c in chunks] == [step, step, step, 5 * itemsize]
    if compression is None:
        assert {c["codec"] for c in chunks} == {"raw"}
    assert read_storages(path) == [data]


def test_several_storages_in_one_file(mixed_file):
    index = index_of(mixed_file)
    codecs = [[c["codec"] for c in s["chunks"]] for s in index["storages"]]
    assert codecs == [["planes"] * 3, ["zstd"] * 3, ["raw"] * 2, [], ["planes"] * 2]
    assert read_storages(mixed_file) == [as_bytes(d) for d, _, _ in mixed_storages()]


def test_read_storage_refuses_a_buffer_of_the_wrong_size(mixed_file):
    with ShardReader(str(mixed_file)) as reader:
        with pytest.raises(ValueError):
            reader.read_storage(0, bytearray(9999))


def test_reads_into_numpy_buffers(mixed_file):
    with ShardReader(str(mixed_file)) as reader:
        out = np.empty(2500, np.float32)
        reader.read_storage(0, out)
    assert out.tobytes() == normal_f32(2500, seed=1).tobytes()


def test_writer_never_overwrites_an_existing_file(tmp_path):
    path = tmp_path / "s.ackpt"
    path.write_bytes(b"precious")
    with pytest.raises(FileExistsError):
        ShardWriter(str(path), ChunkEncoder(None))
    assert path.read_bytes() == b"precious"


# --- golden bytes and layout ---------------------------------------------------------------------

def test_golden_bytes_of_a_tiny_raw_file(tmp_path):
    """Pins the whole file; any change to the layout, the index's key order or the checksum fails."""
    payload = bytes(range(8))
    path = tmp_path / "golden.ackpt"
    size, digest = write_shard(path, [(payload, 1, False)], compression=None, meta={"step": 7})

    header = b"ACKPT\x00\r\n" + struct.pack("<II", 1, 0)
    index = {
        "format_version": 1,
        "byteorder": sys.byteorder,
        "step": 7,
        "storages": [{"nbytes": 8, "itemsize": 1, "float": False, "chunks": [
            {"offset": 16, "stored": 8, "raw": 8, "xxh3": "3a1c2d7c85af88f8", "codec": "raw"}]}],
    }
    blob = json.dumps(index, separators=(",", ":")).encode()
    index_digest = xxhash.xxh3_64_intdigest(blob)
    trailer = struct.pack("<QQQ", 24, len(blob), index_digest) + b"ACKPTEND"
    expected = header + payload + blob + trailer

    assert path.read_bytes() == expected
    assert (size, digest) == (len(expected), f"{index_digest:016x}")
    assert xxhash.xxh3_64_hexdigest(payload) == "3a1c2d7c85af88f8"


def test_golden_bytes_of_a_version_5_file(tmp_path):
    """Version 5 pins where the padding goes: each storage's first chunk at the next multiple of
    64 (zero bytes before it), chunks of one storage back to back, the index right after the
    last chunk, and no padding for a storage without chunks."""
    a, b = bytes(range(8)), bytes(range(100, 170))  # b: 70 bytes, two chunks of 64 and 6
    path = tmp_path / "golden5.ackpt"
    size, digest = write_shard(path, [(a, 1, False), (b"", 1, False), (b, 2, False)],
                               compression=None, chunk_bytes=64, meta={"step": 7}, version=5)

    header = b"ACKPT\x00\r\n" + struct.pack("<II", 5, 0)
    index = {
        "format_version": 5,
        "byteorder": sys.byteorder,
        "step": 7,
        "storages": [
            {"nbytes": 8, "itemsize": 1, "float": False, "chunks": [
                {"offset": 64, "stored": 8, "raw": 8, "xxh3": "3a1c2d7c85af88f8", "codec": "raw"}]},
            {"nbytes": 0, "itemsize": 1, "float": False, "chunks": []},
            {"nbytes": 70, "itemsize": 2, "float": False, "chunks": [
                {"offset": 128, "stored": 64, "raw": 64, "xxh3": xxhash.xxh3_64_hexdigest(b[:64]),
                 "codec": "raw"},
                {"offset": 192, "stored": 6, "raw": 6, "xxh3": xxhash.xxh3_64_hexdigest(b[64:]),
                 "codec": "raw"}]}],
    }
    blob = json.dumps(index, separators=(",", ":")).encode()
    trailer = struct.pack("<QQQ", 198, len(blob), xxhash.xxh3_64_intdigest(blob)) + b"ACKPTEND"
    expected = header + bytes(48) + a + bytes(56) + b + blob + trailer

    assert STORAGE_ALIGNMENT == 64
    assert path.read_bytes() == expected
    assert (size, digest) == (len(expected), f"{xxhash.xxh3_64_intdigest(blob):016x}")
    assert read_storages(path) == [a, b"", b]


def test_the_reader_s_records_are_what_the_index_says(tmp_path):
    """The records a reader builds from a validated index (format/records.py) hold every field
    of its storage table and replica digests; a replica's JSON is the index's, key for key."""
    b = bytes(range(100, 170))
    replica = Replica("model", 0, 70, xxhash.xxh3_64_hexdigest(b))
    path = tmp_path / "records.ackpt"
    write_shard(path, [(b"", 1, False), (b, 2, False)], compression=None, chunk_bytes=64,
                meta={"step": 7, "replicas": [replica.to_json()]}, version=5)
    with ShardReader(str(path)) as reader:
        assert reader.storages == (
            StorageEntry(0, 1),
            StorageEntry(70, 2, (Chunk(64, 64, 64, "raw", xxhash.xxh3_64_hexdigest(b[:64])),
                                 Chunk(128, 6, 6, "raw", xxhash.xxh3_64_hexdigest(b[64:])))))
        assert reader.replicas == (replica,) and reader.raw_bytes == 70
        assert reader.index["replicas"] == [{"entry": "model", "owner": 0, "nbytes": 70,
                                             "xxh3": replica.xxh3}]
        assert list(reader.index["replicas"][0]) == ["entry", "owner", "nbytes", "xxh3"]
    assert b'"replicas":[{"entry":"model","owner":0,"nbytes":70,"xxh3":"' in path.read_bytes()


TENSOR = {"storage": 1, "offset": 8, "dtype": "float32", "shape": [2, 3], "stride": [3, 1]}


def test_the_tensor_table_becomes_records(tmp_path):
    """``ShardReader.tensors``: the index's tensor table as records, every field kept; a
    replica's names the rank whose storage it views, a tensor with no elements no storage."""
    path = tmp_path / "tensors.ackpt"
    table = [TENSOR, {"storage": 0, "offset": 0, "dtype": "int64", "shape": [], "stride": [],
                      "rank": 1},
             {"storage": None, "offset": 0, "dtype": "bfloat16", "shape": [0, 4], "stride": [4, 1]}]
    write_shard(path, [(b"", 1, False), (bytes(32), 4, False)], compression=None,
                meta=META | {"tensors": table})
    with ShardReader(str(path)) as reader:
        assert reader.tensors == (StoredTensor(1, 8, "float32", (2, 3), (3, 1)),
                                  StoredTensor(0, 0, "int64", (), (), 1),
                                  StoredTensor(None, 0, "bfloat16", (0, 4), (4, 1)))
        assert [(t.end, t.nbytes) for t in reader.tensors] == [(32, 24), (8, 8), (0, 0)]
        assert reader.tensors[1].held_in(0) == (1, 0) and reader.tensors[0].held_in(0) == (0, 1)


@pytest.mark.parametrize("edit, why", [
    ({"dtype": "qint8"}, "unknown dtype 'qint8'"), ({"dtype": 5}, "unknown dtype '5'"),
    ({"shape": [2]}, "malformed shape or stride"), ({"stride": [3, -1]}, "malformed shape"),
    ({"shape": [2**40, 2**40], "stride": [0, 0]}, "more elements than any storage can hold"),
    ({"storage": "1"}, "bad storage reference"), ({"storage": None}, "bad storage reference"),
    ({"rank": None}, "bad storage reference"), ({"offset": -4}, "bad storage reference"),
    ({"offset": 2}, "its offset 2 is not a multiple of its element size"),
    ({"storage": 2}, "refers to storage 2, which does not exist"),
    ({"offset": 12}, "view lies outside its storage"), (None, "not an object"),
])
def test_a_damaged_tensor_record_is_refused_naming_its_file_and_number(edit, why):
    """The one check of a tensor record (a shard's table, a memory tier's hold): what it finds
    wrong, in the file and record it names."""
    record = None if edit is None else TENSOR | edit
    with pytest.raises(CorruptSnapshotError, match="^" + re.escape(f"shard: tensor 1: {why}")):
        tensor_table([TENSOR, record], "shard", [0, 32])
    with pytest.raises(CorruptSnapshotError, match="shard: the index has no tensor table"):
        tensor_table({"0": TENSOR}, "shard", [0, 32])


@pytest.mark.parametrize("workers", [0, 3])
def test_version_5_aligns_every_storage_whatever_the_chunk_sizes(tmp_path, workers):
    """Compressed chunks end anywhere; the next storage still starts aligned, also when chunks
    are encoded on threads and written in order."""
    path = tmp_path / "v5.ackpt"
    write_shard(path, mixed_storages() * 2, workers=workers, version=5)
    index = index_of(path)
    firsts = [s["chunks"][0]["offset"] for s in index["storages"] if s["chunks"]]
    assert len(firsts) == 8 and all(offset % STORAGE_ALIGNMENT == 0 for offset in firsts)
    assert read_storages(path) == [as_bytes(d) for d, _, _ in mixed_storages() * 2]


def test_the_writer_uses_version_5_exactly_when_the_shard_stores_bytes():
    """Padding is what an older reader would refuse as damage, so the version says it's there;
    a shard without stored chunks (values only, or only references) keeps the older version."""
    assert version_needed(False, stores_bytes=True) == 5
    assert version_needed(True, True, True, stores_bytes=True) == 5
    assert version_needed(False, stores_bytes=True, data_files=True, direct=True) == 7
    assert version_needed(False, direct=True) == 1  # nothing stored: nothing to align
    assert [version_needed(False), version_needed(True), version_needed(True, True),
            version_needed(True, True, True)] == [1, 2, 3, 4]


@pytest.mark.parametrize("version,first_offset,ok", [
    (5, 64, True), (5, 16, False), (5, 128, False), (5, 32, False),
    (4, 64, False), (4, 16, True), (6, 4096, False), (7, 4096, True), (7, 64, True),
    (7, 128, False), (7, 8192, False)])
def test_padding_is_accepted_only_in_version_5_and_only_up_to_the_next_aligned_offset(
        tmp_path, version, first_offset, ok):
    payload = bytes(range(8))
    path = tmp_path / "padded.ackpt"
    index = {"format_version": version, "byteorder": sys.byteorder, "storages": [
        {"nbytes": 8, "itemsize": 1, "float": False, "chunks": [
            {"offset": first_offset, "stored": 8, "raw": 8,
             "xxh3": xxhash.xxh3_64_hexdigest(payload), "codec": "raw"}]}]}
    blob = json.dumps(index).encode()
    area = bytes(first_offset - 16) + payload
    path.write_bytes(b"ACKPT\x00\r\n" + struct.pack("<II", version, 0) + area + blob
                     + struct.pack("<QQQ", 16 + len(area), len(blob), xxhash.xxh3_64_intdigest(blob))
                     + b"ACKPTEND")
    if ok:
        assert read_storages(path) == [payload]
    else:
        with pytest.raises(CorruptSnapshotError, match="storage 0 chunk 0 is not where"):
            ShardReader(str(path))


def test_verify_reports_padding_that_is_not_zero(tmp_path):
    path = tmp_path / "v5.ackpt"
    write_shard(path, [(b"ab", 1, False), (b"cd", 1, False)], compression=None, version=5)
    with ShardReader(str(path)) as reader:
        assert reader.verify() == []
    data = bytearray(path.read_bytes())
    data[100] = 1  # between storage 0 (at 64, 2 bytes) and storage 1 (at 128)
    path.write_bytes(bytes(data))
    with ShardReader(str(path)) as reader:
        assert reader.verify() == [f"{path}: the 62 bytes of padding before storage 1 are not "
                                   "zero (damaged on disk, or written by something else)"]
    assert read_storages(path) == [b"ab", b"cd"]  # padding means nothing to a reader


def test_padding_between_chunks_of_one_storage_is_damage(tmp_path):
    """Only a storage's first chunk may follow padding: the rest of it is contiguous, so that it
    maps as one run of bytes."""
    path = tmp_path / "v5.ackpt"
    write_shard(path, [(random_bytes(100), 1, False)], compression=None, chunk_bytes=64, version=5)
    index = index_of(path)
    index["storages"][0]["chunks"][1]["offset"] += 64
    bad = tmp_path / "bad.ackpt"
    rewrite_index(path, bad, index)
    with pytest.raises(CorruptSnapshotError, match="chunk 1 is not where"):
        ShardReader(str(bad))


def test_header_and_trailer_layout(mixed_file):
    data = mixed_file.read_bytes()
    header, area, blob, (offset, length, digest, magic) = split_file(data)
    assert header == MAGIC + (1).to_bytes(4, "little") + (0).to_bytes(4, "little")
    assert MAGIC == b"ACKPT\x00\r\n" and TRAILER_MAGIC == b"ACKPTEND"
    assert (HEADER_SIZE, TRAILER_SIZE) == (16, 32)
    assert magic == b"ACKPTEND"
    assert offset + length + 32 == len(data)
    assert digest == xxhash.xxh3_64_intdigest(blob)
    index = json.loads(blob)
    assert index["format_version"] == 1
    assert index["byteorder"] == sys.byteorder
    assert index["step"] == 7 and index["rank"] == 0
    assert list(index)[:2] == ["format_version", "byteorder"] and list(index)[-1] == "storages"


def test_chunks_tile_the_data_area_without_holes(mixed_file):
    data = mixed_file.read_bytes()
    _, area, _, (index_offset, _, _, _) = split_file(data)
    position = 16
    for storage in json.loads(data[index_offset:-32])["storages"]:
        for chunk in storage["chunks"]:
            assert chunk["offset"] == position
            stored = data[position:position + chunk["stored"]]
            assert xxhash.xxh3_64_hexdigest(stored) == chunk["xxh3"]
            position += chunk["stored"]
        assert sum(c["raw"] for c in storage["chunks"]) == storage["nbytes"]
    assert position == index_offset == 16 + len(area)


def test_finish_returns_the_file_size_and_index_checksum(mixed_file, tmp_path):
    path = tmp_path / "again.ackpt"
    size, digest = write_shard(path, mixed_storages())
    data = path.read_bytes()
    assert size == len(data) == os.path.getsize(path)
    _, _, blob, (_, _, trailer_digest, _) = split_file(data)
    assert digest == f"{trailer_digest:016x}" == xxhash.xxh3_64_hexdigest(blob)
    assert read_storages(path, expected_bytes=size, expected_index_xxh3=digest) == [
        as_bytes(d) for d, _, _ in mixed_storages()]


def test_reader_refuses_a_file_of_another_size(tmp_path):
    path = tmp_path / "s.ackpt"
    size, digest = write_shard(path, mixed_storages())
    for wrong in (size - 1, size + 1, 0):
        with pytest.raises(CorruptSnapshotError):
            ShardReader(str(path), expected_bytes=wrong, expected_index_xxh3=digest)


def test_reader_refuses_another_index_checksum(tmp_path):
    path = tmp_path / "s.ackpt"
    size, digest = write_shard(path, mixed_storages())
    wrong = f"{int(digest, 16) ^ 1:016x}"
    with pytest.raises(ChecksumMismatchError):
        ShardReader(str(path), expected_bytes=size, expected_index_xxh3=wrong)


def test_reader_refuses_the_shard_of_another_snapshot(tmp_path):
    """The manifest's digest ties the file to the snapshot: a different shard is refused."""
    a, b = tmp_path / "a.ackpt", tmp_path / "b.ackpt"
    size_a, digest_a = write_shard(a, [(b"x" * 100, 1, False)], meta={"step": 1})
    size_b, _ = write_shard(b, [(b"x" * 100, 1, False)], meta={"step": 2})
    assert size_a == size_b
    with pytest.raises(ChecksumMismatchError):
        ShardReader(str(b), expected_bytes=size_a, expected_index_xxh3=digest_a)


def test_missing_file_is_corrupt_snapshot(tmp_path):
    with pytest.raises(CorruptSnapshotError):
        ShardReader(str(tmp_path / "absent.ackpt"))


# --- damage --------------------------------------------------------------------------------------

def chunk_locations(path):
    """(storage, chunk number, chunk) for every chunk of the file."""
    return [(i, j, c) for i, s in enumerate(index_of(path)["storages"])
            for j, c in enumerate(s["chunks"])]


def test_a_flipped_byte_in_any_chunk_is_caught_there(mixed_file, tmp_path):
    original = [as_bytes(d) for d, _, _ in mixed_storages()]
    for i, j, chunk in chunk_locations(mixed_file):
        for where in (chunk["offset"], chunk["offset"] + chunk["stored"] // 2,
                      chunk["offset"] + chunk["stored"] - 1):
            bad = tmp_path / f"bad-{i}-{j}-{where}.ackpt"
            damaged_copy(mixed_file, bad, lambda d: d.__setitem__(where, d[where] ^ 0x10))
            with ShardReader(str(bad)) as reader:  # the index is intact: opening works
                for k, s in enumerate(reader.index["storages"]):
                    buf = bytearray(s["nbytes"])
                    if k == i:
                        with pytest.raises(ChecksumMismatchError):
                            reader.read_storage(k, buf)
                    else:
                        reader.read_storage(k, buf)
                        assert bytes(buf) == original[k]
                problems = reader.verify()
            assert len(problems) == 1, (chunk["codec"], problems)
            assert f"storage {i} chunk {j} " in problems[0]
            bad.unlink()


def test_verify_is_empty_for_an_intact_file(mixed_file):
    with ShardReader(str(mixed_file)) as reader:
        assert reader.verify() == []


def test_verify_reports_every_damaged_chunk(mixed_file, tmp_path):
    """verify() promises one line per damaged chunk, not one per damaged storage."""
    chunks = index_of(mixed_file)["storages"][0]["chunks"]
    assert len(chunks) == 3
    bad = tmp_path / "bad.ackpt"

    def flip_two(d):
        for c in (chunks[0], chunks[2]):
            d[c["offset"]] ^= 0xFF

    damaged_copy(mixed_file, bad, flip_two)
    with ShardReader(str(bad)) as reader:
        problems = reader.verify()
    assert len(problems) == 2, problems
    assert "storage 0 chunk 0 " in problems[0] and "storage 0 chunk 2 " in problems[1]


def test_a_flipped_byte_in_the_index_is_caught_at_open(mixed_file, tmp_path):
    data = mixed_file.read_bytes()
    _, _, blob, (offset, length, _, _) = split_file(data)
    for where in range(offset, offset + length):
        bad = tmp_path / "bad.ackpt"
        damaged_copy(mixed_file, bad, lambda d: d.__setitem__(where, d[where] ^ 0x01))
        with pytest.raises(ChecksumMismatchError):
            ShardReader(str(bad))
        bad.unlink()


def test_a_flipped_byte_in_the_trailer_is_caught_at_open(mixed_file, tmp_path):
    size = mixed_file.stat().st_size
    for where in range(size - 32, size):
        bad = tmp_path / "bad.ackpt"
        damaged_copy(mixed_file, bad, lambda d: d.__setitem__(where, d[where] ^ 0x04))
        with pytest.raises(CorruptSnapshotError):
            ShardReader(str(bad))
        bad.unlink()


def test_truncation_at_every_length_is_refused_at_open(tmp_path):
    path = tmp_path / "small.ackpt"
    size, _ = write_shard(path, [(normal_f32(96), 4, True), (np.zeros(40, np.int32), 4, False),
                                 (random_bytes(50), 1, False)], chunk_bytes=256)
    data = path.read_bytes()
    assert {c["codec"] for _, _, c in chunk_locations(path)} == {"planes", "zstd", "raw"}
    cut = tmp_path / "cut.ackpt"
    for length in range(size):
        cut.write_bytes(data[:length])
        with pytest.raises(CorruptSnapshotError):
            ShardReader(str(cut))
    cut.write_bytes(data)
    assert read_storages(cut)[1] == bytes(160)


def test_appended_bytes_are_refused(mixed_file, tmp_path):
    bad = tmp_path / "bad.ackpt"
    bad.write_bytes(mixed_file.read_bytes() + b"\0")
    with pytest.raises(CorruptSnapshotError):
        ShardReader(str(bad))


@pytest.mark.parametrize("magic", [b"ACKPT\x00\n\n", b"\x00" * 8, b"PK\x03\x04\x00\x00\x00\x00",
                                   b"ackpt\x00\r\n"])
def test_bad_header_magic_is_corrupt(mixed_file, tmp_path, magic):
    bad = tmp_path / "bad.ackpt"
    damaged_copy(mixed_file, bad, lambda d: d.__setitem__(slice(0, 8), magic))
    with pytest.raises(CorruptSnapshotError):
        ShardReader(str(bad))


@pytest.mark.parametrize("version", [0, 2, 0xFFFFFFFF])
def test_other_header_version_is_unsupported(mixed_file, tmp_path, version):
    bad = tmp_path / "bad.ackpt"
    damaged_copy(mixed_file, bad, lambda d: d.__setitem__(slice(8, 12), struct.pack("<I", version)))
    with pytest.raises(UnsupportedFormatError):
        ShardReader(str(bad))


@pytest.mark.parametrize("reserved", [1, 0x100, 0x80000000])
def test_nonzero_reserved_header_field_is_refused(mixed_file, tmp_path, reserved):
    """The header is MAGIC, version, uint32 0: any other value there is damage, not data."""
    bad = tmp_path / "bad.ackpt"
    damaged_copy(mixed_file, bad, lambda d: d.__setitem__(slice(12, 16), struct.pack("<I", reserved)))
    with pytest.raises(CorruptSnapshotError):
        read_storages(bad)


@pytest.mark.parametrize("offset,length_delta", [(0, 0), (15, 0), (16, 0), (None, 1), (None, -1)])
def test_trailer_pointing_elsewhere_is_corrupt(mixed_file, tmp_path, offset, length_delta):
    """A consistent digest does not help a trailer whose offset or length disagree with the file."""
    data = mixed_file.read_bytes()
    _, _, blob, (index_offset, length, digest, _) = split_file(data)
    trailer = struct.pack("<QQQ8s", index_offset if offset is None else offset,
                          length + length_delta, digest, b"ACKPTEND")
    bad = tmp_path / "bad.ackpt"
    bad.write_bytes(data[:-32] + trailer)
    with pytest.raises(CorruptSnapshotError):
        ShardReader(str(bad))


def test_rewrite_index_helper_keeps_a_valid_file_valid(mixed_file, tmp_path):
    """Guards the helper the tests below rely on: an unchanged index reads back fine."""
    copy = tmp_path / "copy.ackpt"
    rewrite_index(mixed_file, copy, index_of(mixed_file))
    assert copy.read_bytes() == mixed_file.read_bytes()
    assert read_storages(copy) == [as_bytes(d) for d, _, _ in mixed_storages()]


@pytest.mark.parametrize("field,value", [("format_version", 2), ("format_version", 0),
                                         ("format_version", "1"), ("format_version", None),
                                         ("byteorder", "big" if sys.byteorder == "little" else "little"),
                                         ("byteorder", None)])
def test_index_of_another_format_is_unsupported(mixed_file, tmp_path, field, value):
    index = index_of(mixed_file)
    if value is None:
        del index[field]
    else:
        index[field] = value
    bad = tmp_path / "bad.ackpt"
    rewrite_index(mixed_file, bad, index)
    with pytest.raises(UnsupportedFormatError):
        ShardReader(str(bad))


def _storage(index, i):
    return index["storages"][i]


def _chunk(index, i, j):
    return index["storages"][i]["chunks"][j]


def _set(getter, key, value):
    def edit(index):
        getter(index)[key] = value
    return edit


def _shift_chunk(i, j, delta):
    def edit(index):
        _chunk(index, i, j)["offset"] += delta
    return edit


def _grow_last_chunk(index):
    """The last chunk claims 10 bytes more: it runs into the index."""
    last = index["storages"][4]["chunks"][-1]
    last["stored"] += 10


def _raw_chunk_with_stored_not_raw(index):
    chunk = _chunk(index, 2, 1)  # raw, 5000 - 4096 = 904 bytes
    assert chunk["codec"] == "raw"
    chunk["raw"] -= 1
    _storage(index, 2)["nbytes"] -= 1


def _drop_a_plane(index):
    chunk = _chunk(index, 0, 0)
    dropped = chunk["planes"].pop(0)
    chunk["stored"] -= dropped[1]  # keep the sums consistent: only the table length is wrong


def _planes_sum_differs(index):
    _chunk(index, 0, 0)["planes"][3][1] += 1


def _raw_plane_of_wrong_size(index):
    planes = _chunk(index, 0, 0)["planes"]
    planes[0][1] += 1
    planes[3][1] -= 1


def _plane_of_unknown_codec(index):
    _chunk(index, 0, 0)["planes"][3][0] = "lz4"


def _planes_on_a_chunk_not_a_multiple_of_itemsize(index):
    _storage(index, 0)["itemsize"] = 3


def _nbytes_off_by_one(index):
    _storage(index, 1)["nbytes"] += 1


def _drop_last_storage(index):
    """Its chunks' bytes are left between the previous chunk and the index."""
    index["storages"].pop()


def _drop_a_middle_chunk(index):
    chunks = _storage(index, 1)["chunks"]
    removed = chunks.pop(1)
    _storage(index, 1)["nbytes"] -= removed["raw"]


def _swap_storages(index):
    s = index["storages"]
    s[0], s[1] = s[1], s[0]


INCONSISTENT_INDEXES = {
    "hole-between-chunks": _shift_chunk(0, 1, 1),
    "overlapping-chunks": _shift_chunk(0, 1, -1),
    "hole-before-first-chunk": _shift_chunk(0, 0, 1),
    "chunk-inside-the-header": _shift_chunk(0, 0, -16),
    "chunk-past-the-index": _grow_last_chunk,
    "missing-chunk": _drop_a_middle_chunk,
    "storages-out-of-order": _swap_storages,
    "bytes-after-the-last-chunk": _drop_last_storage,
    "raw-chunk-stored-not-raw": _raw_chunk_with_stored_not_raw,
    "planes-table-too-short": _drop_a_plane,
    "planes-sum-not-stored": _planes_sum_differs,
    "raw-plane-of-wrong-size": _raw_plane_of_wrong_size,
    "plane-of-unknown-codec": _plane_of_unknown_codec,
    "planes-itemsize-does-not-divide": _planes_on_a_chunk_not_a_multiple_of_itemsize,
    "planes-table-missing": lambda index: _chunk(index, 0, 0).pop("planes"),
    "planes-table-not-a-list": _set(lambda x: _chunk(x, 0, 0), "planes", {"0": 1}),
    "plane-entry-not-a-pair": lambda index: _chunk(index, 0, 0)["planes"].__setitem__(0, ["raw"]),
    "plane-length-float": lambda index: _chunk(index, 0, 0)["planes"][0].__setitem__(1, 1024.0),
    "nbytes-not-sum-of-chunks": _nbytes_off_by_one,
    "index-is-a-list": lambda index: [index],
    "storages-missing": lambda index: index.pop("storages"),
    "storages-not-a-list": _set(lambda x: x, "storages", {"0": {}}),
    "storage-not-an-object": lambda index: index["storages"].__setitem__(3, [1, 8]),
    "nbytes-string": _set(lambda x: _storage(x, 3), "nbytes", "0"),
    "nbytes-negative": _set(lambda x: _storage(x, 3), "nbytes", -1),
    "nbytes-bool": _set(lambda x: _storage(x, 3), "nbytes", False),
    "nbytes-float": _set(lambda x: _storage(x, 3), "nbytes", 0.0),
    "itemsize-zero": _set(lambda x: _storage(x, 2), "itemsize", 0),
    "itemsize-17": _set(lambda x: _storage(x, 2), "itemsize", 17),
    "chunks-missing": lambda index: _storage(index, 3).pop("chunks"),
    "chunks-null": _set(lambda x: _storage(x, 3), "chunks", None),
    "chunk-not-an-object": lambda index: _storage(index, 2)["chunks"].__setitem__(0, 16),
    "offset-float": _set(lambda x: _chunk(x, 0, 0), "offset", 16.0),
    "offset-string": _set(lambda x: _chunk(x, 0, 0), "offset", "16"),
    "stored-negative": _set(lambda x: _chunk(x, 1, 0), "stored", -1),
    "raw-zero": _set(lambda x: _chunk(x, 1, 0), "raw", 0),
    "raw-bool": _set(lambda x: _chunk(x, 2, 0), "raw", True),
    "raw-huge": _set(lambda x: _chunk(x, 1, 0), "raw", (1 << 30) + 1),
    "codec-unknown": _set(lambda x: _chunk(x, 1, 0), "codec", "lz4"),
    "codec-missing": lambda index: _chunk(index, 1, 0).pop("codec"),
    "codec-list": _set(lambda x: _chunk(x, 1, 0), "codec", ["zstd"]),
    "xxh3-int": _set(lambda x: _chunk(x, 1, 0), "xxh3", 123),
    "xxh3-missing": lambda index: _chunk(index, 1, 0).pop("xxh3"),
}


@pytest.mark.parametrize("case", list(INCONSISTENT_INDEXES))
def test_inconsistent_index_with_valid_checksum_is_corrupt(mixed_file, tmp_path, case):
    index = index_of(mixed_file)
    result = INCONSISTENT_INDEXES[case](index)
    if isinstance(result, list):  # an edit that replaces the whole index
        index = result
    bad = tmp_path / "bad.ackpt"
    rewrite_index(mixed_file, bad, index)
    with pytest.raises(CorruptSnapshotError) as excinfo:
        ShardReader(str(bad))
    assert excinfo.type is CorruptSnapshotError  # refused by validation, not by a checksum


@pytest.mark.parametrize("blob", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"format_version":1,"byteorder":"little","storages":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"format_version":1,"byteorder":"little","storages":[{"x":' * 50_000 + b"}]}" * 50_000,
    b"",
    b"not json",
    b'{"format_version":1,',
    b"\xff\xfe\x00{}",
    b'{"format_version":1,"byteorder":"' + sys.byteorder.encode() + b'","storages":[],"x":"\xc3"}',
    b"null",
    b"1",
    b'"storages"',
    b'{"format_version":1,"byteorder":"' + sys.byteorder.encode() + b'","storages":[]}',
], ids=["deep-lists", "deep-storages", "deep-objects", "empty", "not-json", "cut-json",
        "not-utf8", "bad-utf8-in-string", "null", "number", "string", "drops-all-storages"])
def test_hostile_index_blob_is_corrupt(mixed_file, tmp_path, blob):
    bad = tmp_path / "bad.ackpt"
    rewrite_index(mixed_file, bad, blob=blob)
    with pytest.raises(CorruptSnapshotError) as excinfo:
        ShardReader(str(bad))
    assert excinfo.type is CorruptSnapshotError


def test_chunk_that_decompresses_to_another_size_is_corrupt(tmp_path):
    """A zstd chunk whose index claims more (or fewer) raw bytes than it holds: refused at read."""
    path = tmp_path / "s.ackpt"
    write_shard(path, [(np.zeros(256, np.int32), 4, False)])
    for delta in (4, -4):
        index = index_of(path)
        storage = index["storages"][0]
        assert storage["chunks"][0]["codec"] == "zstd"
        storage["chunks"][0]["raw"] += delta
        storage["nbytes"] += delta
        bad = tmp_path / f"bad{delta}.ackpt"
        rewrite_index(path, bad, index)
        with ShardReader(str(bad)) as reader:
            with pytest.raises(CorruptSnapshotError):
                reader.read_storage(0, bytearray(1024 + delta))
            assert len(reader.verify()) == 1


def test_zstd_plane_that_decompresses_to_another_size_is_corrupt(tmp_path):
    """The planes table says raw planes are 2 bytes longer, the zstd plane 2*3 bytes shorter:
    consistent sums and a valid chunk checksum, but the top plane decodes to the wrong size."""
    path = tmp_path / "s.ackpt"
    write_shard(path, [(normal_f32(256), 4, True)])
    index = index_of(path)
    storage = index["storages"][0]
    chunk = storage["chunks"][0]
    assert chunk["codec"] == "planes"
    chunk["raw"] += 8
    storage["nbytes"] += 8
    for plane in chunk["planes"][:3]:
        plane[1] += 2
    chunk["planes"][3][1] -= 6
    bad = tmp_path / "bad.ackpt"
    rewrite_index(path, bad, index)
    with ShardReader(str(bad)) as reader:
        with pytest.raises(CorruptSnapshotError):
            reader.read_storage(0, bytearray(1024 + 8))


# --- fuzz ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "valid.ackpt"
    write_shard(path, [(normal_f32(300, seed=9), 4, True), (np.arange(200, dtype=np.int16) % 5, 2, False),
                       (random_bytes(300, seed=10), 1, False), (b"", 8, False),
                       (bf16_like(200, seed=11), 2, True)], chunk_bytes=512)
    data = path.read_bytes()
    assert {c["codec"] for _, _, c in chunk_locations(path)} == {"planes", "zstd", "raw"}
    return path, data, read_storages(path)


@settings(max_examples=400, deadline=None, database=None)  # nothing written to the cwd
@given(st.data())
def test_fuzz_damaged_files_are_refused_with_typed_errors(fuzz_file, data):
    path, original, _ = fuzz_file
    size = len(original)
    # Uniform over the file, plus extra weight on the header and the index/trailer end.
    positions = st.integers(0, size - 1) | st.integers(0, 63) | st.integers(size - 96, size - 1)
    flips = data.draw(st.dictionaries(positions, st.integers(1, 255), min_size=0, max_size=8))
    cut = data.draw(st.none() | st.integers(0, size - 1))
    if not flips and cut is None:
        flips = {data.draw(positions): 0x80}
    damaged = bytearray(original)
    for p, mask in flips.items():
        damaged[p] ^= mask
    if cut is not None:
        damaged = damaged[:cut]
    bad = path.with_name(f"damaged-{os.getpid()}.ackpt")
    bad.write_bytes(damaged)
    try:
        with pytest.raises((CorruptSnapshotError, UnsupportedFormatError)):
            read_storages(bad)
    finally:
        bad.unlink()


def test_fuzz_file_reads_back_intact(fuzz_file):
    path, _, contents = fuzz_file
    assert contents[1] == (np.arange(200, dtype=np.int16) % 5).tobytes()
    assert read_storages(path) == contents


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_encoding_on_worker_threads_writes_the_same_bytes(tmp_path, compression, workers):
    storages = [(normal_f32(5000, seed), 4, True) for seed in range(4)]
    storages += [(random_bytes(3001), 1, False), (b"", 1, False), (bf16_like(7000), 2, True)]
    one = write_shard(tmp_path / "one.ackpt", storages, compression)
    many = write_shard(tmp_path / "many.ackpt", storages, compression, workers=workers)
    assert one == many
    assert (tmp_path / "one.ackpt").read_bytes() == (tmp_path / "many.ackpt").read_bytes()


def test_flush_and_abort_return_only_once_no_worker_reads_the_source(tmp_path):
    import threading
    started, proceed, reads = threading.Event(), threading.Event(), []

    class SlowEncoder(ChunkEncoder):
        def encode(self, raw, itemsize, is_float):
            started.set()
            proceed.wait(5)
            reads.append(bytes(raw))  # the source is read here, on the worker
            return super().encode(raw, itemsize, is_float)

        def twin(self):
            return SlowEncoder(None)

    writer = ShardWriter(str(tmp_path / "rank-00000.ackpt"), SlowEncoder(None), chunk_bytes=SMALL_CHUNK,
                         workers=2)
    source = bytearray(random_bytes(SMALL_CHUNK * 2))
    writer.add_storage(memoryview(source), 1, False)  # returns while chunks are in flight
    assert started.wait(5) and reads == []
    threading.Timer(0.05, proceed.set).start()
    writer.abort()
    finished = len(reads)
    source[:] = bytes(len(source))  # the caller may reuse the memory now: nobody reads it
    assert len(reads) == finished and not (tmp_path / "rank-00000.ackpt").exists()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_checksums_made_while_staging_are_taken_for_raw_chunks_only(tmp_path, monkeypatch,
                                                                    workers, compression):
    """A storage given its chunks' checksums (made by the staging copy) is not read for them
    where its chunks are stored raw: what it was given is what the index holds (a wrong one is
    then damage a read finds); zstd chunks are checksummed as encoded. Storages with and without
    them, interleaved with chunks being encoded on workers, stay in order."""
    import async_ckpt.format.shard as shard_module

    monkeypatch.setattr(shard_module, "CHUNK_BYTES", SMALL_CHUNK)
    data = [random_bytes(SMALL_CHUNK * 2 + 100, seed) for seed in range(3)]
    given = [checksum(d[:SMALL_CHUNK]) for d in data]
    fake = "0123456789abcdef"
    path = str(tmp_path / "rank-00000.ackpt")
    writer = ShardWriter(path, ChunkEncoder(compression), chunk_bytes=SMALL_CHUNK, version=7,
                         workers=workers)
    writer.add_storage(memoryview(data[0]), 1, False,
                       checksums=[given[0], checksum(data[0][SMALL_CHUNK:2 * SMALL_CHUNK]), fake])
    writer.add_storage(memoryview(data[1]), 1, False)
    writer.add_storage(memoryview(data[2]), 1, False, checksums=[given[2]])  # not one a chunk
    writer.finish(META)
    with ShardReader(path) as reader:
        for i, d in enumerate(data):
            out = bytearray(len(d))
            if compression is None and i == 0:
                assert reader.storages[0].chunks[2].xxh3 == fake  # taken as given
                with pytest.raises(ChecksumMismatchError):
                    reader.read_storage(0, out)
                continue
            reader.read_storage(i, out)
            assert out == d
        assert (reader.verify() != []) == (compression is None)


@pytest.mark.parametrize("workers", [0, 2])
def test_encode_cpu_s_sums_the_cpu_each_chunk_took_on_whatever_thread(tmp_path, workers):
    """The writer's ``encode_cpu_s`` figure: CPU seconds of every chunk's encoding and checksum,
    counted on the thread that did it (a worker's CPU; not wall time, which a sleep adds to)."""
    import time

    class SpinningEncoder(ChunkEncoder):
        def encode(self, raw, itemsize, is_float):
            time.sleep(0.05)
            spun = time.thread_time() + 0.01
            while time.thread_time() < spun:
                pass
            return super().encode(raw, itemsize, is_float)

        def twin(self):
            return SpinningEncoder(None)

    writer = ShardWriter(str(tmp_path / "rank-00000.ackpt"), SpinningEncoder(None),
                         chunk_bytes=SMALL_CHUNK, workers=workers)
    try:
        writer.add_storage(memoryview(random_bytes(SMALL_CHUNK * 3)), 1, False)
        writer.flush()
        assert 3 * 0.01 <= writer.encode_cpu_s < 3 * 0.05
    finally:
        writer.abort()


@pytest.mark.parametrize("cached", [False, True])
def test_a_range_of_a_storage_reads_exactly_those_bytes_and_checks_whole_chunks(tmp_path, cached):
    """``read_range`` of any range (inside one chunk, across several, at the edges) gives the
    storage's bytes; without a cache a raw chunk's part is read straight into place, and a flipped
    byte anywhere in a chunk it touches, even outside the range, fails its checksum."""
    data = random_bytes(5 * SMALL_CHUNK + 123, seed=4)
    path = tmp_path / "rank-00000.ackpt"
    write_shard(path, [(data, 1, False)], compression=None)
    ranges = [(0, 1), (5, SMALL_CHUNK - 3), (SMALL_CHUNK - 7, 3 * SMALL_CHUNK + 9),
              (2 * SMALL_CHUNK, 3 * SMALL_CHUNK), (len(data) - 50, len(data)), (17, 17)]
    with ShardReader(str(path)) as reader:
        cache = ChunkCache() if cached else None
        for start, stop in ranges:
            out = bytearray(stop - start)
            reader.read_range(0, start, stop, out, cache)
            assert bytes(out) == data[start:stop], (start, stop)
    chunk = index_of(path)["storages"][0]["chunks"][1]
    where = chunk["offset"] + chunk["stored"] - 1  # chunk 1's last byte: outside the range below
    bad = tmp_path / "bad.ackpt"
    damaged_copy(path, bad, lambda d: d.__setitem__(where, d[where] ^ 0x01))
    with ShardReader(str(bad)) as reader:
        with pytest.raises(ChecksumMismatchError, match="chunk 1"):
            reader.read_range(0, SMALL_CHUNK + 1, SMALL_CHUNK + 9, bytearray(8),
                              ChunkCache() if cached else None)

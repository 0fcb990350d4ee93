"""The byte-shuffle filter: the C extension against the numpy reference, the public face, and
the fallback where the (optional) extension did not build.

C-vs-reference tests import ``async_ckpt._native`` directly so they never silently compare the
reference with itself; ``test_native_backend_is_built`` fails when the extension is missing. The
fallback runs in a fresh interpreter in which the extension cannot be imported
(``run_without_native``), as on a machine without a C compiler.
"""

from __future__ import annotations

import ast
import mmap
import os
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import async_ckpt
from async_ckpt.format import filters
from async_ckpt.format.filters import MAX_ITEMSIZE, shuffle_reference, unshuffle_reference
from test_format import ROUND_TRIP_CASES, as_bytes, index_of, read_storages, write_shard

try:
    from async_ckpt import _native
except ImportError:  # reported by test_native_backend_is_built
    _native = None

PURE_PYTHON = os.environ.get("ASYNC_CKPT_PURE_PYTHON", "") not in ("", "0")
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

needs_native = pytest.mark.skipif(  # only in the documented pure-Python run: otherwise they fail
    _native is None and PURE_PYTHON, reason="ASYNC_CKPT_PURE_PYTHON run without async_ckpt._native")

ITEMSIZES = range(1, MAX_ITEMSIZE + 1)
BACKENDS = pytest.mark.parametrize(
    "backend", [pytest.param("native", marks=needs_native), "reference"]
)
DIRECTIONS = pytest.mark.parametrize("direction", ["shuffle", "unshuffle"])

# Item counts below, at and across the C loops' 16- and 64-item tiles.
counts = st.integers(0, 700) | st.sampled_from([1, 15, 16, 17, 63, 64, 65, 128, 129])
seeds = st.integers(0, 2**32 - 1)


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def implementation(backend: str, direction: str):
    """One function of one backend, taken directly so the C one is never reached via BACKEND."""
    if backend == "native":
        return getattr(_native, direction)
    return getattr(filters, f"{direction}_reference")


def shuffled_reference(src: bytes, itemsize: int) -> bytes:
    out = bytearray(len(src))
    shuffle_reference(src, itemsize, out)
    return bytes(out)


def test_native_backend_is_built():
    """The extension is optional for an install, not for the suite: a build that failed would
    otherwise go unnoticed (setup.py only warns) and leave the C code untested."""
    if PURE_PYTHON:
        assert filters.BACKEND == "python"
    else:
        assert _native is not None, ("async_ckpt._native did not import: build it with a C "
                                     "compiler (pip install -e .), or run the suite with "
                                     "ASYNC_CKPT_PURE_PYTHON=1 to test the numpy fallback alone")
        assert filters.BACKEND == "native"


def test_only_filters_imports_the_extension():
    """One owner of "is the extension there": every other module shuffles through filters."""
    package = pathlib.Path(async_ckpt.__file__).parent
    importers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(name.rpartition(".")[2] == "_native" for name in names):
                importers.add(path.relative_to(package).as_posix())
    assert importers == {"format/filters.py"}


def run_without_native(code: str) -> str:
    """Run ``code`` in a fresh interpreter in which ``import async_ckpt._native`` fails, as where
    the optional extension did not build (``ASYNC_CKPT_PURE_PYTHON`` unset, so the fallback is
    what a missing module gives); returns its stdout."""
    hidden = "import sys\nsys.modules['async_ckpt._native'] = None  # an ImportError on import\n"
    result = subprocess.run([sys.executable, "-c", hidden + code], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS]),
                                     ASYNC_CKPT_PURE_PYTHON=""))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_without_the_extension_the_numpy_reference_runs():
    out = run_without_native("from async_ckpt.format import filters\nprint(filters.BACKEND)")
    assert out.strip() == "python"


def shuffled_storages() -> list[tuple]:
    """(data, itemsize, is_float) of every float width the planes codec shuffles (2, 4, 8, and 16
    bytes as complex128), and the zstd round-trip cases that are not shuffled."""
    storages = [(data, itemsize, is_float)
                for data, itemsize, is_float, compression, _ in ROUND_TRIP_CASES.values()
                if compression == "zstd"]
    complex_values = np.random.default_rng(9).normal(0, 0.02, (700, 2)).view(np.complex128)
    return storages + [(complex_values, 16, True)]


def test_shards_written_without_the_extension_are_byte_identical(tmp_path):
    """The same storages written with the extension and without it make the same file, and each
    side reads the other's back (shuffle on write, unshuffle on read, in both backends)."""
    native, fallback = tmp_path / "native.ackpt", tmp_path / "fallback.ackpt"
    write_shard(native, shuffled_storages())
    expected = [as_bytes(data) for data, _, _ in shuffled_storages()]
    run_without_native(
        "from async_ckpt.format import filters\n"
        "from test_filters import shuffled_storages\n"
        "from test_format import as_bytes, read_storages, write_shard\n"
        "assert filters.BACKEND == 'python', filters.BACKEND\n"
        f"write_shard({str(fallback)!r}, shuffled_storages())\n"
        f"got = read_storages({str(native)!r})\n"
        "assert got == [as_bytes(data) for data, _, _ in shuffled_storages()]\n")
    assert fallback.read_bytes() == native.read_bytes()
    assert read_storages(fallback) == expected
    codecs = [{c["codec"] for c in s["chunks"]} for s in index_of(native)["storages"]]
    assert codecs.count({"planes"}) >= 5  # every float width went through the shuffle


def test_golden_bytes():
    """Pins the plane layout: byte p of item i goes to dst[p*m + i]."""
    src = bytes(range(12))
    assert shuffled_reference(src, 4) == bytes([0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11])
    assert shuffled_reference(src, 3) == bytes([0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11])


def test_float32_planes():
    """The last plane of little-endian fp32 holds the sign and the high exponent bits."""
    values = np.array([1.0, -2.0, 0.5, -0.25], dtype="<f4")
    planes = shuffled_reference(values.tobytes(), 4)
    assert planes[12:] == bytes([0x3F, 0xC0, 0x3F, 0xBE])


@needs_native
@pytest.mark.parametrize("itemsize", ITEMSIZES)
@settings(max_examples=40, deadline=None)
@given(count=counts, seed=seeds)
def test_native_matches_reference(itemsize, count, seed):
    src = random_bytes(count * itemsize, seed)
    planes = bytearray(len(src))
    _native.shuffle(src, itemsize, planes)
    assert planes == shuffled_reference(src, itemsize)

    native_back = bytearray(len(src))
    reference_back = bytearray(len(src))
    _native.unshuffle(planes, itemsize, native_back)
    unshuffle_reference(planes, itemsize, reference_back)
    assert native_back == reference_back == src


@pytest.mark.parametrize("itemsize", ITEMSIZES)
@settings(max_examples=20, deadline=None)
@given(count=counts, seed=seeds)
def test_public_round_trip(itemsize, count, seed):
    src = random_bytes(count * itemsize, seed)
    planes = bytearray(len(src))
    back = bytearray(len(src))
    filters.shuffle(src, itemsize, planes)
    filters.unshuffle(planes, itemsize, back)
    assert planes == shuffled_reference(src, itemsize)
    assert back == src


BUFFER_KINDS = ["bytes", "bytearray", "memoryview", "numpy", "mmap", "mmap bytes"]


def buffer_kinds(data: bytes) -> dict[str, tuple[object, object]]:
    """(src, writable dst) pairs of every buffer type the writer hands to the filter."""
    n = len(data)
    region = mmap.mmap(-1, 2 * n + 16)
    region[8 : 8 + n] = data
    return {
        "bytes": (data, bytearray(n)),
        "bytearray": (bytearray(data), bytearray(n)),
        "memoryview": (memoryview(data), memoryview(bytearray(n))),
        "numpy": (np.frombuffer(data, np.float32).reshape(4, -1), np.zeros(n // 4, np.float32)),
        "mmap": (memoryview(region)[8 : 8 + n], memoryview(region)[n + 16 :]),
        "mmap bytes": (region[8 : 8 + n], np.zeros(n, np.uint8)),
    }


@BACKENDS
@pytest.mark.parametrize("kind", BUFFER_KINDS)
def test_buffer_types(backend, kind):
    data = random_bytes(4 * 100, seed=1)
    src, dst = buffer_kinds(data)[kind]
    implementation(backend, "shuffle")(src, 4, dst)
    assert bytes(memoryview(dst).cast("B")) == shuffled_reference(data, 4)
    back = bytearray(len(data))
    implementation(backend, "unshuffle")(dst, 4, back)
    assert back == data


@BACKENDS
@DIRECTIONS
@pytest.mark.parametrize(
    "src_len, itemsize, dst_len",
    [
        (8, 0, 8),  # itemsize out of range
        (8, -4, 8),
        (34, 17, 34),
        (6, 4, 6),  # length not a multiple of itemsize
        (8, 4, 4),  # dst wrong size
        (8, 4, 12),
        (0, 4, 4),
    ],
)
def test_bad_values_raise_value_error(backend, direction, src_len, itemsize, dst_len):
    with pytest.raises(ValueError):
        implementation(backend, direction)(bytes(src_len), itemsize, bytearray(dst_len))


def read_only_buffers() -> list[object]:
    frozen = np.zeros(8, np.uint8)
    frozen.flags.writeable = False
    mapped = mmap.mmap(-1, 8, access=mmap.ACCESS_READ)
    return [bytes(8), memoryview(bytearray(8)).toreadonly(), frozen, mapped]


@BACKENDS
@DIRECTIONS
@pytest.mark.parametrize("dst", read_only_buffers(), ids=["bytes", "memoryview", "numpy", "mmap"])
def test_read_only_dst_raises_type_error(backend, direction, dst):
    with pytest.raises(TypeError):
        implementation(backend, direction)(bytes(8), 4, dst)


@needs_native
@settings(max_examples=300, deadline=None)
@given(
    src_len=st.integers(0, 40),
    itemsize=st.integers(-3, 20) | st.integers(-(2**70), 2**70),
    dst_len=st.integers(0, 40),
    dst_writable=st.booleans(),
)
def test_reference_validates_like_native(src_len, itemsize, dst_len, dst_writable):
    """Every input is accepted by both or rejected by both with the same exception type."""

    def outcome(fn):
        dst = bytearray(dst_len) if dst_writable else bytes(dst_len)
        try:
            fn(bytes(src_len), itemsize, dst)
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            return type(e)
        return None

    assert outcome(_native.shuffle) is outcome(shuffle_reference)
    assert outcome(_native.unshuffle) is outcome(unshuffle_reference)


@needs_native
@pytest.mark.parametrize("fn", ["shuffle", "unshuffle"])
def test_native_releases_the_gil(fn):
    """The main thread runs Python while a worker is inside the C call.

    Proof without timing: the main thread sees dst with its first byte written and its last not yet
    written, a state that only exists mid-call (the loops run front to back). Retried a few times
    in case the scheduler never gives the main thread a turn during one call on a loaded machine.
    """
    n = 64 << 20
    src = b"\x01" * n
    for _ in range(5):
        dst = bytearray(n)
        worker = threading.Thread(target=getattr(_native, fn), args=(src, 4, dst))
        seen_mid_call = 0
        worker.start()
        while worker.is_alive():
            if dst[0] and not dst[-1]:
                seen_mid_call += 1
        worker.join()
        assert dst.count(1) == n
        if seen_mid_call:
            return
    pytest.fail(f"{fn} held the GIL: the main thread never ran during 5 calls on 64 MiB")


@needs_native
@pytest.mark.parametrize("value, expected", [("", "native"), ("0", "native"), ("1", "python")])
def test_pure_python_switch(value, expected):
    env = dict(os.environ, ASYNC_CKPT_PURE_PYTHON=value)
    result = subprocess.run(
        [sys.executable, "-c", "from async_ckpt.format import filters; print(filters.BACKEND)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == expected

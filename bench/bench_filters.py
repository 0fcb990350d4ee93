"""Byte-shuffle throughput: the C extension against the numpy reference and a memcpy floor.

The case for C at all: numpy's strided shuffle is slower than the disk it feeds. GB/s of input."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import numpy as np

from async_ckpt.format import filters


def best_seconds(fn: Callable[[], None], repeat: int) -> float:
    """Fastest of ``repeat`` calls, after an untimed one that faults the pages in."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_itemsize(name: str, src: np.ndarray, itemsize: int, repeat: int) -> None:
    src = src.view(np.uint8)
    planes = np.empty_like(src)
    back = np.empty_like(src)
    gb = src.nbytes / 1e9

    def rate(fn: Callable[[], None]) -> float:
        return gb / best_seconds(fn, repeat)

    memcpy = rate(lambda: np.copyto(back, src))
    c_shuffle = rate(lambda: filters.shuffle(src, itemsize, planes))
    c_unshuffle = rate(lambda: filters.unshuffle(planes, itemsize, back))
    assert np.array_equal(back, src), "C unshuffle(shuffle(x)) != x"
    np_shuffle = rate(lambda: filters.shuffle_reference(src, itemsize, planes))
    np_unshuffle = rate(lambda: filters.unshuffle_reference(planes, itemsize, back))

    print(f"{name}, itemsize {itemsize}, {src.nbytes >> 20} MiB   memcpy floor {memcpy:6.2f} GB/s")
    rows = (("shuffle", c_shuffle, np_shuffle), ("unshuffle", c_unshuffle, np_unshuffle))
    for op, c, ref in rows:
        print(
            f"  {op:<9}  C {c:6.2f} GB/s   numpy {ref:5.2f} GB/s   "
            f"C/numpy {c / ref:5.1f}x   C/memcpy {c / memcpy:4.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="buffer size in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case (default 5)")
    args = parser.parse_args()
    if filters.BACKEND != "native":
        sys.exit("the C extension is not in use (not built: pip install -e .; or "
                 "ASYNC_CKPT_PURE_PYTHON is set): there is nothing to compare numpy with")

    # fp32 weights ~ N(0, 0.02); their top halves are the same values truncated to bf16.
    n = (args.mib << 20) // 4
    fp32 = np.random.default_rng(0).standard_normal(n, dtype=np.float32) * np.float32(0.02)
    bf16_bits = np.tile((fp32.view(np.uint32) >> 16).astype(np.uint16), 2)

    bench_itemsize("float32", fp32, 4, args.repeat)
    bench_itemsize("bfloat16", bf16_bits, 2, args.repeat)


if __name__ == "__main__":
    main()

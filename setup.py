"""Declares the C extension only; all metadata lives in pyproject.toml.

The extension is optional: where it does not build (no C compiler, no Python headers) the package
installs anyway, with a warning, and ``async_ckpt.format.filters`` uses its NumPy version, which
writes the same bytes more slowly (``compression="zstd"`` only; see the README).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "async_ckpt._native",
            sources=["csrc/native.c"],
            extra_compile_args=["-O3", "-std=c99"],
            optional=True,
        )
    ]
)

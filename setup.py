"""Declares the C extension only; all metadata lives in pyproject.toml."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "async_ckpt._native",
            sources=["csrc/native.c"],
            extra_compile_args=["-O3", "-std=c99"],
        )
    ]
)

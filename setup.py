"""Declares the one compiled extension; all other metadata lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "goodput.data._interleave",
            sources=["goodput/data/_interleave.c"],
            extra_compile_args=["-O3"],
        )
    ]
)

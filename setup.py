"""Packages are found, not listed: every package under fsdp_strategy/, and callbacks/ (with any
subpackages) shipped as fsdp_strategy.callbacks (the mapping is in pyproject.toml)."""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["fsdp_strategy", "fsdp_strategy.*"]),
        *(f"fsdp_strategy.{name}" for name in find_packages(include=["callbacks", "callbacks.*"])),
    ]
)

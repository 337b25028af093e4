"""Packages are found, not listed: every package under fsdp_strategy/ (its callbacks/ included)."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["fsdp_strategy", "fsdp_strategy.*"]))

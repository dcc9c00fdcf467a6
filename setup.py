"""Only the package list lives here (pyproject.toml holds everything else): every ``kvprobe*`` package found
under kvprobe/, plus the repository's top-level experiments/ and configs/ installed as ``kvprobe.experiments``
and ``kvprobe.configs`` (mapped in pyproject's ``package-dir``), so nothing installs a top-level ``experiments``."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["kvprobe", "kvprobe.*"]), "kvprobe.experiments", "kvprobe.configs"])

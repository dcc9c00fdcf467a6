"""Only the package list lives here (pyproject.toml holds everything else): every ``kvprobe*`` package found
under kvprobe/, plus the repository's top-level experiments/ and configs/ installed as ``kvprobe.experiments``
and ``kvprobe.configs`` (mapped in pyproject's ``package-dir``), so nothing installs a top-level ``experiments``.
The data folders (no ``__init__.py``) are listed as packages too: setuptools installs a folder's data files only
as part of a package, and warns ("Package would be ignored") for every data folder that is not one."""

from setuptools import find_packages, setup

DATA_PACKAGES = ["kvprobe.configs.tasks", "kvprobe.organism.data", "kvprobe.tasks.data"]

setup(packages=[*find_packages(include=["kvprobe", "kvprobe.*"]), "kvprobe.experiments", "kvprobe.configs",
                *DATA_PACKAGES])

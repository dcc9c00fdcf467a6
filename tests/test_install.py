"""The wheel installs like its peers' and runs an experiment from a directory outside the checkout.

Builds the wheel from a copy of the working tree's files (what a fresh clone holds, so a stale ``build/`` can
never leak into it), installs it with ``--no-deps`` into a throwaway venv that sees the test environment's
packages (torch, transformers ...) but not its kvprobe, and runs ``kvprobe run locality`` there on the tiny
random-init model. ``-m 'not install'`` skips it in quick runs; ``make test`` runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.install, pytest.mark.slow]


def _tree_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split("\n")
    return [f for f in out if f and (REPO / f).is_file()]


def _outer_site_packages() -> list[str]:
    """The running environment's site-packages, handed to the throwaway venv by a .pth file: a path line in a
    .pth is appended to sys.path without processing that folder's own .pth files, so an editable kvprobe
    installed there never shadows the wheel."""
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    return sorted(p for p in paths if Path(p).is_dir())


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    for rel in _tree_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, capture_output=True, cwd=tmp)
    wheel = next(dist.glob("kvprobe-*.whl"))
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    purelib = Path(subprocess.run([str(env_dir / "bin" / "python"), "-c",
                                   "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "_outer_env.pth").write_text("\n".join(_outer_site_packages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-build-isolation", str(wheel)], check=True, capture_output=True, cwd=tmp)
    return wheel, env_dir


def test_wheel_holds_configs_and_experiments_under_kvprobe(installed):
    import zipfile

    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvprobe/configs/locality.yaml" in names and "kvprobe/configs/tasks/gated.yaml" in names
    assert "kvprobe/experiments/locality.py" in names
    assert "kvprobe/tasks/data/scenario_words.yaml" in names
    assert not any(n.startswith("experiments/") or n.startswith("configs/") for n in names)  # no top-level package
    top = next(n for n in names if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top).decode().split() == ["kvprobe"]


def test_installed_wheel_runs_an_experiment_outside_the_checkout(installed, tiny_text_dir, tmp_path):
    _, env_dir = installed
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1")
    python = str(env_dir / "bin" / "python")
    where = subprocess.run([python, "-c", "import kvprobe, kvprobe.experiments.locality as m; print(kvprobe.__file__); "
                            "import importlib.util as u; print(u.find_spec('experiments') is None)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert Path(where[0]).is_relative_to(env_dir) and where[1] == "True"  # the wheel's kvprobe; no `experiments`
    run = subprocess.run([str(env_dir / "bin" / "kvprobe"), "run", "locality", "--model", str(tiny_text_dir),
                          "--random-init", "--set", "task.n_instances=2", "--output-dir", "out", "--quiet"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    records = list((work / "out" / "locality").glob("*/*.json"))
    assert len(records) == 1
    rec = json.loads(records[0].read_text())
    assert rec["config"]["task"]["template"] == "configs/tasks/gated.yaml" and len(rec["rows"]) == 2

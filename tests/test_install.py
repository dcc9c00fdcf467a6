"""The wheels install like their peers' and show the paper's effect from a directory outside the checkout.

Builds the kvprobe wheel and the kvprobe-organisms wheel (``organisms/``: the recommended organisms) from a copy
of the working tree's files (what a fresh clone holds, so a stale ``build/`` can never leak into them), without a
setuptools warning, installs both with ``--no-deps`` into a throwaway venv that sees the test environment's
packages (torch, transformers, the embedded model packages ...) but not its kvprobe, and there runs
``kvprobe run locality`` on the tiny random-init model and on the recommended SmolLM2 organism (small n), then
``kvprobe report``, ``figures`` and ``claims`` on those runs. ``-m 'not install'`` skips it; ``make test`` runs it.
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
    for project in (src, src / "organisms"):
        build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                                str(dist), str(project)], capture_output=True, text=True, cwd=tmp)
        assert build.returncode == 0, build.stderr[-3000:]
        noise = [line for line in (build.stdout + build.stderr).splitlines() if "Warning" in line or "would be ignored"
                 in line]
        assert not noise, f"building {project.name} warns:\n" + "\n".join(noise[:10])
    wheel = next(dist.glob("kvprobe-*.whl"))
    organisms_wheel = next(dist.glob("kvprobe_organisms-*.whl"))
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    purelib = Path(subprocess.run([str(env_dir / "bin" / "python"), "-c",
                                   "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "_outer_env.pth").write_text("\n".join(_outer_site_packages()) + "\n")
    for built in (wheel, organisms_wheel):
        # the outer kvprobe (same version, seen through the .pth) must not count as already installed
        pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install",
                              "--no-deps", "--no-build-isolation", "--ignore-installed", str(built)],
                             capture_output=True, text=True, cwd=tmp)
        assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    assert (env_dir / "bin" / "kvprobe").exists(), "the kvprobe wheel did not install its console script"
    return wheel, env_dir


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "KVPROBE_ORGANISMS")}
    env.update(OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1")
    return env


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


def test_the_organisms_wheel_holds_the_recommended_organisms_and_the_kvprobe_wheel_no_weights(installed):
    import zipfile

    from kvprobe.models.organisms import load_registry

    wheel, _ = installed
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith((".safetensors", ".bin", ".gguf"))]
    organisms_wheel = next(wheel.parent.glob("kvprobe_organisms-*.whl"))
    names = zipfile.ZipFile(organisms_wheel).namelist()
    adapters = sorted(n.split("/")[1] for n in names if n.endswith("adapter_model.safetensors"))
    assert adapters == sorted(load_registry(REPO / "organisms").recommended().values())
    assert "kvprobe_organisms/registry.yaml" in names


def test_installed_wheels_run_the_recommended_organism_and_draw_its_figure(installed, tmp_path):
    """A user with the two wheels and no checkout: the SmolLM2 organism gates (every instance included), and
    report, figures and claims read those runs, writing only inside runs/, naming CLI commands, never make."""
    _, env_dir = installed
    work = tmp_path / "elsewhere"
    work.mkdir()
    kvprobe = str(env_dir / "bin" / "kvprobe")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([kvprobe, *args], cwd=work, env=_env(), capture_output=True, text=True, timeout=600)

    run = cli("run", "locality", "--model", "smollm2-135m-gated-v3n2-seed2", "--set", "task.n_instances=2", "--quiet")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "2 of 2 instances" in run.stdout and "field-only" in run.stdout, run.stdout
    records = list((work / "runs" / "locality" / "smollm2-135m-gated-v3n2-seed2").glob("*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["summary"]["n_included"] == 2
    report = cli("report")  # reads runs/: an installed kvprobe has no published results/
    assert report.returncode == 0 and "smollm2-135m-gated-v3n2-seed2" in report.stdout, report.stderr
    figures = cli("figures")
    assert figures.returncode == 0, figures.stderr[-2000:]
    assert (work / "runs" / "figures" / "fig3a_locality.png").is_file()
    claims = cli("claims")
    assert claims.returncode == 0, claims.stderr[-2000:]
    # the forest draws tested effects only; two instances test none (kvprobe's verdicts need 10), so it is not drawn
    assert (work / "runs" / "claims.json").is_file() and not (work / "runs" / "figures" / "claims_forest.png").exists()
    assert sorted(p.name for p in work.iterdir()) == ["runs"], "something was written outside runs/"
    for out in (run, report, figures, claims):
        assert "make " not in out.stdout + out.stderr, "a message names a make target, and there is no Makefile"
    empty = subprocess.run([kvprobe, "report", "--results", "nothing"], cwd=work, env=_env(), capture_output=True,
                           text=True)
    assert empty.returncode == 2 and "`kvprobe " in empty.stderr and "make" not in empty.stderr, empty.stderr


def test_installed_wheel_runs_an_experiment_outside_the_checkout(installed, tiny_text_dir, tmp_path):
    _, env_dir = installed
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = _env()
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

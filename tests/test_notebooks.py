"""The light notebook path: `make notebooks` runs every notebook headless with nbclient (no server, nothing
installed), and the notebooks select records by (experiment, task, model), pooling nothing across tasks."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from kvprobe.notebooks import main

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
def test_every_notebook_runs_headless(tmp_path, capsys, monkeypatch):
    assert NOTEBOOKS
    monkeypatch.setenv("KVPROBE_INTEROP_N", "1")  # the kernel inherits it: one instance through each wrapper
    assert main([str(REPO / "notebooks"), "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob("*.ipynb")) == [p.name for p in NOTEBOOKS]
    for executed in tmp_path.glob("*.ipynb"):
        outputs = [o for c in nbformat.read(executed, as_version=4).cells if c.cell_type == "code"
                   for o in c.get("outputs", [])]
        assert outputs and not any(o.get("output_type") == "error" for o in outputs), executed.name
    results = json.dumps([c.get("outputs", []) for c in nbformat.read(tmp_path / "results.ipynb", 4).cells])
    assert "% gated)" not in results, "results.ipynb pools tasks into one rate per model"


def test_a_failing_notebook_is_one_clear_line(tmp_path, capsys):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("raise ValueError('broken on purpose')")])
    folder = tmp_path / "nbs"
    folder.mkdir()
    nbformat.write(nb, folder / "broken.ipynb")
    assert main([str(folder), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "broken.ipynb" in err and "broken on purpose" in err
    assert not (tmp_path / "out" / "broken.ipynb").exists()


def test_no_notebook_groups_rows_by_model_alone():
    for path in NOTEBOOKS:
        source = "\n".join(c.source for c in nbformat.read(path, 4).cells if c.cell_type == "code")
        assert 'groupby("model")' not in source, f"{path.name} pools tasks: group by (experiment, task, model)"

"""Nothing published is written by a command that was not asked to publish.

`kvprobe figures` and `kvprobe claims` on a scratch folder of records write inside that folder, never into the
published figures/ or results/; no command deletes a figure it did not draw; a failing command leaves no partial
output; a random-init model is named as such (never by its machine path) in figures and tables.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kvprobe.app.cli import main

REPO = Path(__file__).resolve().parents[1]
ORGANISM = "smollm2-135m-gated-v3n2-seed2"
RECORD = REPO / "results" / "locality" / ORGANISM / "561ca5f6e26d.json"


def _tracked_state() -> tuple[str, dict[str, str]]:
    """`git status` of the checkout and the hash of every file under figures/ and results/ (tracked or not)."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", "figures", "results",
                             "README.md", "RESULTS.md", "docs"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout
    hashes = {str(p.relative_to(REPO)): hashlib.sha256(p.read_bytes()).hexdigest()
              for folder in ("figures", "results") for p in sorted((REPO / folder).rglob("*")) if p.is_file()}
    return status, hashes


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A scratch folder of records: the organism's locality record (n 48, 48 included) and a random-init run
    whose model is named by an absolute directory path, as a `--random-init` run records it."""
    folder = tmp_path / "runs"
    organism = folder / "locality" / ORGANISM / RECORD.name
    organism.parent.mkdir(parents=True)
    shutil.copy(RECORD, organism)
    rec = json.loads(RECORD.read_text())
    machine_path = str(tmp_path / "models" / "tiny-llama")
    rec["model"] = {**rec["model"], "name": machine_path, "random_init": True}
    rec["config"]["model"] = machine_path
    rec["config_hash"] = "0123456789ab"
    random_init = folder / "locality" / "tiny-llama" / "0123456789ab.json"
    random_init.parent.mkdir(parents=True)
    random_init.write_text(json.dumps(rec))
    return folder


def test_figures_and_claims_on_a_scratch_folder_write_only_inside_it(scratch, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # where `make figures` runs: the defaults must still not touch figures/ or results/
    before = _tracked_state()
    assert main(["figures", "--results", str(scratch)]) == 0
    assert main(["claims", "--results", str(scratch)]) == 0
    out = capsys.readouterr().out
    assert _tracked_state() == before, "a scratch folder's figures or claims changed a published file"
    assert (scratch / "figures" / "fig3a_locality.png").is_file()
    assert (scratch / "figures" / "claims_forest.png").is_file()
    assert (scratch / "claims.json").is_file() and (scratch / "claims.json").stat().st_mode & 0o777 == 0o644
    assert "figures/claims_forest.png" in out and str(REPO / "figures") not in out


def test_figures_never_delete_a_figure_they_did_not_draw(scratch, tmp_path):
    out = tmp_path / "figs"
    out.mkdir()
    kept = {name: (out / name) for name in ("fig14a_serve.png", "figC_offtemplate.png", "notes.txt")}
    for p in kept.values():
        p.write_bytes(b"not drawn by this call")
    assert main(["figures", "--results", str(scratch), "--out", str(out)]) == 0
    for p in kept.values():
        assert p.read_bytes() == b"not drawn by this call", f"{p.name} was replaced or deleted"
    drawn = out / "fig3a_locality.png"
    assert drawn.is_file() and drawn.stat().st_mode & 0o777 == 0o644


def test_failing_commands_leave_no_partial_output(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["claims", "--results", str(empty)]) == 2
    assert main(["figures", "--results", str(empty)]) == 2
    assert main(["figures", "--results", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.count("kvprobe: error:") == 3 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["empty"], "a failing command left files or folders"


def test_a_random_init_model_is_marked_and_never_named_by_its_path(scratch, capsys):
    from kvprobe.runner.records import load_records
    from kvprobe.app.report import report_rows

    names = {r["model"]["name"] for r in load_records(scratch)}
    assert names == {ORGANISM, "tiny-llama (random init)"}
    models = {row[2] for row in report_rows(scratch)}
    assert models == names
    assert main(["report", "--results", str(scratch)]) == 0
    table = capsys.readouterr().out
    assert "tiny-llama (random init)" in table and str(scratch.parent) not in table


def test_figures_claims_and_report_need_no_study_file(scratch, tmp_path, monkeypatch, capsys):
    """An installed kvprobe has no study.yaml: every command reads the folder it is given, whole."""
    import kvprobe.study

    monkeypatch.setattr(kvprobe.study, "_study_file", lambda: tmp_path / "absent" / "study.yaml")
    monkeypatch.chdir(tmp_path)
    assert main(["figures", "--results", str(scratch)]) == 0
    assert main(["claims", "--results", str(scratch)]) == 0
    assert main(["report", "--results", str(scratch)]) == 0
    assert (scratch / "figures" / "fig3a_locality.png").is_file() and (scratch / "claims.json").is_file()
    assert "make " not in capsys.readouterr().err
    from kvprobe.app.report import _organism_for

    assert _organism_for("smollm2-135m") == ORGANISM  # a null run still names the organism that shows the effect


def test_a_random_init_run_names_its_model_by_folder(tiny_text_dir, tmp_path, capsys):
    assert main(["run", "locality", "--model", str(tiny_text_dir), "--random-init", "--set", "task.n_instances=2",
                 "--set", "gate.min_flip=0", "--output-dir", str(tmp_path / "out"), "--quiet"]) == 0
    out = capsys.readouterr().out
    result = next(line for line in out.splitlines() if line.startswith("result:"))
    assert result.startswith(f"result: {tiny_text_dir.name} (random init), ") and "of 2 instances included" in result
    assert str(tiny_text_dir) not in result and "RANDOM-INIT MODEL" in out


def test_only_the_published_folder_draws_into_figures(monkeypatch, tmp_path):
    from kvprobe.study import output_paths, publishes_into

    monkeypatch.chdir(REPO)
    assert publishes_into("results") and output_paths("results") == (Path("figures"),
                                                                      Path("figures/claims_forest.png"))
    assert not publishes_into("runs") and output_paths("runs")[0] == Path("runs/figures")
    assert not publishes_into(tmp_path) and output_paths(tmp_path)[1] == tmp_path / "figures" / "claims_forest.png"

"""One clear message per failure, and nothing lost: each test fails if its behaviour regresses."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import warnings
from pathlib import Path

import pytest

from kvprobe.errors import KVProbeError
from kvprobe.runner import experiment as experiment_module
from kvprobe.app.cli import main
from kvprobe.runner.records import RecordLock, check_clean_tree, git_commit


def _run_args(model_dir, out, n=3, *extra):
    return ["run", "configs/locality.yaml", "--model", str(model_dir), "--set", f"task.n_instances={n}",
            "--output-dir", str(out), "--quiet", *extra]


def _patch_run_instance(monkeypatch, wrap):
    """The locality experiment with its run_instance wrapped (the Experiment is frozen: replace, don't mutate)."""
    real = experiment_module.get_experiment

    def fake(name):
        exp = real(name)
        return dataclasses.replace(exp, run_instance=wrap(exp.run_instance))

    monkeypatch.setattr(experiment_module, "get_experiment", fake)


# -- malformed YAML --------------------------------------------------------------------------------------

def test_malformed_yaml_is_one_line_with_file_line_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("experiment: locality\ntask:\n  n_instances: [1, 2\n  n_filler: 20\n")
    assert main(["run", str(bad)]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and "Traceback" not in err + captured.out
    assert err.startswith(f"kvprobe: error: {bad}:4:")  # the line and column where the parser gave up
    assert "malformed YAML" in err


# -- Ctrl-C ----------------------------------------------------------------------------------------------

def test_ctrl_c_keeps_the_finished_instances_and_says_how_to_resume(tiny_text_dir, tmp_path, monkeypatch, capsys):
    calls = {"n": 0}

    def wrap(run_instance):
        def interrupted_on_second(ctx, inst):
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
            return run_instance(ctx, inst)
        return interrupted_on_second

    _patch_run_instance(monkeypatch, wrap)
    out = tmp_path / "results"
    assert main(_run_args(tiny_text_dir, out)) == 130
    captured = capsys.readouterr()
    partial = next(out.rglob("*.partial.jsonl"))
    assert captured.err == (f"kvprobe: interrupted: 1 of 3 instances saved to {partial}; rerun the same command "
                            "to resume\n")
    assert "Traceback" not in captured.out and len(partial.read_text().splitlines()) == 1
    assert not list(out.rglob("*.lock"))  # the lock is released with the run
    monkeypatch.undo()
    assert main(_run_args(tiny_text_dir, out)) == 0
    record = json.loads(next(p for p in out.rglob("*.json")).read_text())
    assert record["timings"]["resumed_instances"] == 1 and len(record["rows"]) == 3
    assert record["git"]["allow_dirty"] is False and "dirty" in record["git"]


# -- corrupt or incomplete records -----------------------------------------------------------------------

def _good_record() -> dict:
    return {"schema_version": 2, "created": "2026-01-01T00:00:00+00:00", "experiment": "locality",
            "config": {"model": "m", "task": {"template": "configs/tasks/gated.yaml"}}, "model": {"name": "m"},
            "summary": {}, "rows": []}


@pytest.mark.parametrize("damage", ["truncated", "missing_summary", "missing_task"])
@pytest.mark.parametrize("command", ["report", "figures", "claims"])
def test_corrupt_or_incomplete_record_stops_report_figures_and_claims(damage, command, tmp_path, capsys):
    results = tmp_path / "results"
    bad = results / "locality" / "m" / "abc123.json"
    bad.parent.mkdir(parents=True)
    rec = _good_record()
    if damage == "truncated":
        bad.write_text(json.dumps(rec)[:40])
    else:
        if damage == "missing_summary":
            del rec["summary"]
        else:
            del rec["config"]["task"]
        bad.write_text(json.dumps(rec))
    args = {"report": ["report", "--results", str(results)],
            "figures": ["figures", "--results", str(results), "--out", str(tmp_path / "figs")],
            "claims": ["claims", "--results", str(results), "--figure", ""]}[command]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and err.count("\n") == 1
    assert ("corrupt" if damage == "truncated" else "incomplete") in err
    if damage != "truncated":
        assert ("summary" if damage == "missing_summary" else "config.task") in err


# -- concurrent identical runs ---------------------------------------------------------------------------

def _record_path(model_dir, out, n=2):
    from kvprobe.runner.config import load_config, validate_params
    from kvprobe.runner.experiment import get_experiment, record_hash
    from kvprobe.runner.records import record_path

    cfg = load_config("configs/locality.yaml", {"model": str(model_dir), "output_dir": str(out),
                                                "task": {"n_instances": n}})
    params = validate_params(get_experiment("locality").params, cfg.params, "test")
    return record_path(out, "locality", cfg.model, record_hash(cfg, params))


def test_a_second_identical_run_is_refused_while_the_first_holds_the_lock(tiny_text_dir, tmp_path, capsys):
    out = tmp_path / "results"
    path = _record_path(tiny_text_dir, out)
    with RecordLock(path):  # the first run, still going
        assert main(_run_args(tiny_text_dir, out, 2)) == 2
        err = capsys.readouterr().err
        assert "another run of this exact config is in progress" in err and str(path.with_suffix(".lock")) in err
        assert not path.exists() and not path.with_name(path.stem + ".partial.jsonl").exists()  # nothing computed
    assert main(_run_args(tiny_text_dir, out, 2)) == 0
    assert path.exists() and not path.with_suffix(".lock").exists()


def test_the_lock_is_held_across_processes(tmp_path):
    """flock between two processes: a child cannot take the lock a parent holds, and can once it is released."""
    import sys

    path = tmp_path / "x" / "abc.json"
    probe = ("import sys; from pathlib import Path; from kvprobe.runner.records import RecordLock\n"
             "from kvprobe.errors import KVProbeError\n"
             f"try:\n    RecordLock(Path({str(path)!r})).__enter__()\nexcept KVProbeError:\n    sys.exit(3)\n")
    cwd = Path(__file__).resolve().parents[1]
    with RecordLock(path):
        assert subprocess.run([sys.executable, "-c", probe], cwd=cwd).returncode == 3
    assert subprocess.run([sys.executable, "-c", probe], cwd=cwd).returncode == 0


# -- unknown names: the closest matches ------------------------------------------------------------------

def test_unknown_names_suggest_the_closest(capsys):
    from kvprobe.runner.config import load_config
    from kvprobe.runner.experiment import get_experiment

    with pytest.raises(KVProbeError, match=r"key 'task.n_instance' is not a known key \(did you mean 'n_instances'"):
        load_config("configs/locality.yaml", {"task": {"n_instance": 3}})
    with pytest.raises(KVProbeError, match=r"did you mean 'locality'"):
        get_experiment("localty")
    assert main(["run", "localty"]) == 2
    assert "did you mean 'locality'" in capsys.readouterr().err
    assert main(["run", "configs/locality.yaml", "--model", "qwen2.5-coder-0.5", "--quiet"]) == 2
    assert "did you mean 'qwen2.5-coder-0.5b'" in capsys.readouterr().err


def test_config_name_and_path_both_resolve(tmp_path, monkeypatch):
    from kvprobe.runner.config import load_config

    monkeypatch.chdir(tmp_path)  # outside the checkout: kvprobe's own configs are still found
    assert load_config("locality").experiment == load_config("configs/locality.yaml").experiment == "locality"


# -- --quiet ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def weighted_dir(tiny_text_dir, tmp_path_factory):
    """A model directory with real (saved) weights, so transformers shows its loading bar."""
    from kvprobe.models.loading import load_model

    lm = load_model(str(tiny_text_dir))
    d = tmp_path_factory.mktemp("weighted")
    lm.model.save_pretrained(d)
    lm.tokenizer.save_pretrained(d)
    return d


@pytest.mark.parametrize("quiet", [False, True])
def test_quiet_silences_library_bars_and_warnings(quiet, weighted_dir, tmp_path, monkeypatch, capfd):
    def wrap(run_instance):
        def noisy(ctx, inst):
            warnings.warn("a library's deprecation notice", UserWarning)
            return run_instance(ctx, inst)
        return noisy

    _patch_run_instance(monkeypatch, wrap)
    args = _run_args(weighted_dir, tmp_path / "r", 1)
    if not quiet:
        args.remove("--quiet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(args) == 0
    err = capfd.readouterr().err
    noise = ("Loading weights" in err, any("deprecation notice" in str(w.message) for w in caught))
    assert noise == ((False, False) if quiet else (True, True))


# -- a dirty working tree --------------------------------------------------------------------------------

@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()

    def git(*a):
        subprocess.run(["git", *a], cwd=root, check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (root / ".gitignore").write_text("runs/\n")
    (root / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("commit", "-qm", "init")
    return root


def test_dirty_tree_refuses_to_publish_unless_allowed(repo):
    published, scratch = repo / "results" / "e" / "m" / "h.json", repo / "runs" / "e" / "m" / "h.json"
    check_clean_tree(published, False, repo)  # clean: fine
    (repo / "untracked.txt").write_text("notes")
    check_clean_tree(published, False, repo)  # untracked files do not count
    (repo / "code.py").write_text("x = 2\n")
    with pytest.raises(KVProbeError, match=r"uncommitted changes to tracked files \(code.py\).*--allow-dirty"):
        check_clean_tree(published, False, repo)
    check_clean_tree(published, True, repo)  # --allow-dirty
    check_clean_tree(scratch, False, repo)  # git-ignored runs/: scratch, never published
    check_clean_tree(repo.parent / "elsewhere" / "h.json", False, repo)  # outside the checkout (a test's tmp dir)


def test_record_git_block_says_allow_dirty():
    assert git_commit(True)["allow_dirty"] is True and git_commit()["allow_dirty"] is False


def test_run_checks_the_tree_before_computing_and_records_allow_dirty(tiny_text_dir, tmp_path, monkeypatch, capsys):
    seen = []

    def dirty_tree(path, allow_dirty):
        seen.append(path)
        if not allow_dirty:
            raise KVProbeError("the working tree has uncommitted changes to tracked files (code.py)")

    monkeypatch.setattr(experiment_module, "check_clean_tree", dirty_tree)
    out = tmp_path / "results"
    assert main(_run_args(tiny_text_dir, out, 2)) == 2
    assert "uncommitted changes" in capsys.readouterr().err and not list(out.rglob("*.json*"))
    assert main(_run_args(tiny_text_dir, out, 2, "--allow-dirty")) == 0
    record = json.loads(next(out.rglob("*.json")).read_text())
    assert record["git"]["allow_dirty"] is True and seen[-1] == next(out.rglob("*.json"))


def test_quiet_silences_the_gguf_dequantization_bar(capfd):
    """transformers' GGUF loader draws a bare tqdm bar (outside its own progress-bar switch) on a first load."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from kvprobe.app.cli import quiet_libraries

    def dequantize():
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass

    with quiet_libraries(True):
        dequantize()
    assert "de-quantizing" not in capfd.readouterr().err
    dequantize()  # restored on exit
    assert "de-quantizing" in capfd.readouterr().err

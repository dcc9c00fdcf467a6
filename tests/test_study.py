"""The study (study.yaml): validated, every run it names has its committed record, and only its runs
are published (a smoke run or a `--set` override is scratch and goes to runs/)."""

from pathlib import Path

import pytest

from kvprobe.errors import KVProbeError
from kvprobe.runner.config import load_config, validate_params
from kvprobe.runner.experiment import get_experiment, record_hash
from kvprobe.runner.records import load_records
from kvprobe.study import is_published, load_study, published_records, published_runs

REPO = Path(__file__).resolve().parents[1]


def _hash(config: str, overrides: dict) -> tuple[str, str]:
    cfg = load_config(REPO / "configs" / f"{config}.yaml", overrides)
    params = validate_params(get_experiment(cfg.experiment).params, cfg.params, config)
    return cfg.model, record_hash(cfg, params)


def test_every_study_run_has_its_committed_record_and_one_per_key():
    runs = published_runs(REPO / "study.yaml")
    records = published_records(load_records(REPO / "results"), REPO / "study.yaml")
    assert len(records) == len(runs), "a study run has no committed record: run it, or remove it from the study"
    keys = [(r["experiment"], r["_task"], r["model"]["name"]) for r in records]
    assert len(set(keys)) == len(keys)
    study = load_study(REPO / "study.yaml")
    assert sum(m.kind == "organism" for m in study.models.values()) == 2
    assert {"smollm2-135m", "qwen2.5-coder-0.5b"} <= set(study.models)


def test_default_run_is_published_and_a_smoke_run_is_not():
    assert is_published(*_hash("locality", {}))  # `make exp-locality`: CI's reproduction of the committed record
    assert not is_published(*_hash("locality", {"task": {"n_instances": 2}}))
    assert not is_published(*_hash("locality", {"model": "smollm2-135m-gated-v2"}))  # archive model
    assert is_published(*_hash("locality_chat", {"model": "qwen2.5-coder-0.5b"}))
    assert not is_published(*_hash("locality", {"model": "qwen2.5-coder-0.5b"}))  # the study's has n=24


def test_study_file_is_validated(tmp_path):
    bad = tmp_path / "study.yaml"
    bad.write_text("models:\n  m:\n    kind: pretrained\n    family: f\n    about: a\n    use_when: u\n"
                   "    load: 1 s\n    runs: [{config: locality, sets: {}}]\n")
    with pytest.raises(KVProbeError, match="sets"):
        load_study(bad)
    dup = tmp_path / "dup.yaml"
    dup.write_text("models:\n  smollm2-135m:\n    kind: pretrained\n    family: f\n    about: a\n    use_when: u\n"
                   "    load: 1 s\n    runs: [{config: locality}, {config: locality, set: {seed: 1}}]\n")
    with pytest.raises(KVProbeError, match="give one a `task:` name"):
        published_runs(dup)


def test_a_smoke_run_goes_to_runs_and_publish_sends_it_to_results(tiny_text_dir, tmp_path, monkeypatch):
    from kvprobe.runner.experiment import run_experiment

    monkeypatch.chdir(tmp_path)  # the default output folders, results/ and runs/, are relative to here
    cfg = load_config(REPO / "configs" / "locality.yaml", {"model": str(tiny_text_dir), "task": {"n_instances": 2}})
    scratch, _ = run_experiment(cfg, progress=False)
    assert scratch.parts[0] == "runs" and not (tmp_path / "results").exists()
    again, _ = run_experiment(cfg, progress=False)  # scratch is replaced, never a refusal
    assert again == scratch
    published, rec = run_experiment(cfg, progress=False, publish=True)
    assert published.parts[0] == "results" and "reproduction" not in rec


def test_first_contact_sentence_reads_the_numbers_beside_the_paper():
    from kvprobe.app.report import interpretation

    records = {(r["model"]["name"], r["_task"]): r for r in published_records(load_records(REPO / "results"))
               if r["experiment"] == "locality"}
    none = interpretation(records[("smollm2-135m", "gated")])
    assert "does not gate" in none and "make exp-locality MODEL=smollm2-135m-gated-v3n2-seed2" in none
    organism = records[("smollm2-135m-gated-v3n2-seed2", "gated")]
    some = interpretation(organism)
    fo = organism["summary"]["recovery"]["field_only"]["gated"]["mean"]
    assert f"recovers {fo:.2f}" in some and "paper: field-only -0.028" in some and "as in the paper" in some
    qwen = interpretation(records[("qwen2.5-coder-0.5b", "gated")])
    assert "MODEL=qwen2.5-coder-0.5b-gated-v3-cal2" in qwen


def test_the_run_core_takes_the_publication_policy_and_the_cli_passes_the_study(tiny_text_dir, tmp_path,
                                                                                monkeypatch):
    """run_experiment never asks the study: its ``publishes`` argument decides. The Python default (None) publishes
    nothing, so a run from Python goes to runs/ unless it passes publish=True, a policy or an output_dir;
    `kvprobe run` passes the study's policy (kvprobe.study.is_published)."""
    from kvprobe import study
    from kvprobe.app.cli import main
    from kvprobe.errors import KVProbeError
    from kvprobe.runner.experiment import run_experiment

    monkeypatch.chdir(tmp_path)
    cfg = load_config(REPO / "configs" / "locality.yaml", {"model": str(tiny_text_dir), "task": {"n_instances": 2}})
    scratch, _ = run_experiment(cfg, progress=False)
    assert scratch.parts[0] == "runs" and not (tmp_path / "results").exists()
    asked = []
    published, _ = run_experiment(cfg, progress=False, publishes=lambda model, h: asked.append((model, h)) or True)
    assert published.parts[0] == "results" and asked == [(cfg.model, published.stem)]

    seen = {}

    def fake_run(cfg, **kwargs):
        seen.update(kwargs)
        raise KVProbeError("stop here")

    monkeypatch.setattr("kvprobe.runner.experiment.run_experiment", fake_run)
    assert main(["run", str(REPO / "configs" / "locality.yaml"), "--model", str(tiny_text_dir)]) == 2
    assert seen["publishes"] is study.is_published

"""Small failures a newcomer meets first: each is one clear line (rc 2) naming the fix, found before a model loads."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from kvprobe.app.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_a_malformed_set_value_is_one_line(capsys):
    assert main(["run", "locality", "--set", "task.generator={formats: [system_user]", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("kvprobe: error: --set task.generator: the value") and "not valid YAML" in err


def test_a_misspelled_task_template_is_reported_before_the_model_loads(monkeypatch, capsys):
    import kvprobe.models.loading

    def never(*args, **kwargs):
        raise AssertionError("the model loaded before the template was checked")

    monkeypatch.setattr(kvprobe.models.loading, "load_model", never)
    assert main(["run", "locality", "--model", "smollm2-135m", "--set", "task.template=configs/tasks/gatd.yaml",
                 "--output-dir", "unused", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "key 'task.template'" in err and "did you mean 'configs/tasks/gated.yaml'" in err
    assert err.count("\n") == 1


def test_restore_with_a_typo_suggests_instead_of_listing_every_organism(capsys):
    assert main(["organism", "restore", "smollm2-135m-gated-v2x"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'smollm2-135m-gated-v2'" in err
    assert err.count("smollm2-135m-gated") <= 4, "the message lists the registry instead of suggesting"


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("kvprobe ")


def test_records_are_written_with_the_umask_mode(tmp_path):
    from kvprobe.runner.records import atomic_write_json

    old = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "a.json", {"x": 1})
        os.umask(0o027)
        atomic_write_json(tmp_path / "b.json", {"x": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o640
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}


def test_the_smollm2_gguf_is_named_by_its_quantization():
    from kvprobe.models.registry import REGISTRY

    quant = REGISTRY["smollm2-135m"].gguf_file.split(".")[-2]  # SmolLM2-135M-Instruct.Q4_1.gguf -> Q4_1
    for doc in ("README.md", "study.yaml"):
        text = (REPO / doc).read_text()
        assert f"{quant} GGUF" in text and "Q8 GGUF" not in text, doc

"""The CLI end to end on a config-only tiny model with a word-level tokenizer (no weights, offline)."""

import json

from kvprobe.app.cli import main


def test_run_locality_end_to_end_then_reproduce_then_overwrite(tiny_text_dir, tmp_path, capsys):
    results = tmp_path / "results"
    args = ["run", "configs/locality.yaml", "--model", str(tiny_text_dir), "--output-dir", str(results),
            "--set", "task.n_instances=3", "--set", "gate.min_flip=0", "--quiet"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "full_downstream" in out and "record:" in out
    records = list(results.glob("locality/*/*.json"))
    assert len(records) == 1
    rec = json.loads(records[0].read_text())
    assert rec["summary"]["n_instances"] == 3 and len(rec["rows"]) == 3
    assert rec["config"]["task"]["n_instances"] == 3 and rec["config_hash"] in records[0].name
    for row in rec["rows"]:
        assert abs(row["full_downstream"] - 1) < 1e-3 and abs(row["stale"]) < 1e-3 and abs(row["oracle"] - 1) < 1e-3
    for key in ("git", "packages", "model", "seed", "timings"):
        assert key in rec
    committed = records[0].read_bytes()
    # Same config again: a reproduction run in runs/, checked against the record, which stays as it was.
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "reproduction check" in out and "verdict: reproduced" in out
    assert records[0].read_bytes() == committed
    assert (tmp_path / "runs" / records[0].relative_to(results)).exists()
    assert main(args + ["--overwrite"]) == 0
    capsys.readouterr()
    assert main(["report", "--results", str(results)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 3 and table[2].startswith("| locality | gated | ") and "full-downstream (identity) 1.00" in table[2]


def test_report_without_records_is_one_clear_error(tmp_path, capsys):
    assert main(["report", "--results", str(tmp_path)]) == 2
    assert "no records" in capsys.readouterr().err


def test_every_config_has_a_headline_and_the_papers_value():
    """The README's results table is `kvprobe report`: each experiment says what to report and what the
    paper measured for the task its configs run."""
    from pathlib import Path

    from kvprobe.runner.config import load_config
    from kvprobe.runner.experiment import get_experiment

    for path in sorted(Path("configs").glob("*.yaml")):
        cfg = load_config(path)
        exp = get_experiment(cfg.experiment)
        assert exp.headline is not None, path
        assert exp.paper.get(Path(cfg.task.template).stem), f"{path}: no paper value for its task template"


def test_same_config_same_numbers(tiny_text_dir, tmp_path):
    base = ["run", "configs/locality.yaml", "--model", str(tiny_text_dir), "--set", "task.n_instances=2", "--quiet"]
    assert main(base + ["--output-dir", str(tmp_path / "a")]) == 0
    assert main(base + ["--output-dir", str(tmp_path / "b")]) == 0
    a, b = (json.loads(next((tmp_path / d).glob("locality/*/*.json")).read_text()) for d in "ab")
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(a["rows"]) == strip(b["rows"]) and a["summary"] == b["summary"]


def test_models_lists_aliases_and_errors_are_one_line(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "llama-3.1-8b" in out and "meta-llama/Llama-3.1-8B-Instruct" in out
    assert main(["run", "configs/locality.yaml", "--model", "not-a-model", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvprobe: error: unknown model 'not-a-model'") and err.count("\n") == 1


def test_organism_compare_names_the_missing_validation_block(capsys):
    # The v1 organism predates the larger validation draw: the message names the command that scores it.
    assert main(["organism", "compare", "smollm2-135m-gated", "smollm2-135m-gated-v2"]) == 2
    err = capsys.readouterr().err
    assert "smollm2-135m-gated holds no larger validation block" in err
    assert main(["organism", "compare", "smollm2-135m-gated", "smollm2-135m-gated-v2", "--split", "test"]) == 2
    assert "--split test` first" in capsys.readouterr().err
    assert "kvprobe organism validate smollm2-135m-gated --seeds" in err
    v2 = "kvprobe/tasks/data/scenario_words_v2.yaml"
    assert main(["organism", "compare", "smollm2-135m-gated", "smollm2-135m-gated-v2", "--words", v2]) == 2
    assert f"(validation_large@scenario_words_v2): run `kvprobe organism validate smollm2-135m-gated --seeds ... " \
           f"--words {v2}` first" in capsys.readouterr().err


def test_organism_agreement_and_the_email_draw_read_the_committed_cards(capsys):
    v2 = "kvprobe/tasks/data/scenario_words_v2.yaml"
    pair = "smollm2-135m-gated-v3u,smollm2-135m-gated-v3c"
    assert main(["organism", "agreement", "--words", v2, "--recipes", pair]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Over the 6 seeds scored on all three draws") and "email (second validation format) " in out
    assert main(["organism", "agreement", "--recipes", pair]) == 2  # no email draw of word list 1
    assert "fewer than 4 organism seeds" in capsys.readouterr().err
    assert main(["organism", "compare", "smollm2-135m-gated-v3u", "smollm2-135m-gated-v3c", "--words", v2,
                 "--split", "validation_email"]) == 0
    out = capsys.readouterr().out
    assert "email (second validation format)" in out and "both cells" not in out and "preferred" not in out


def test_organism_choose_applies_the_preregistered_rule_to_the_committed_cards(capsys):
    v2 = "kvprobe/tasks/data/scenario_words_v2.yaml"
    assert main(["organism", "choose", "smollm2-135m-gated-v3n2", "smollm2-135m-gated-v3n", "--words", v2]) == 0
    out = capsys.readouterr().out
    assert "train formats + email (second validation format): smollm2-135m-gated-v3n2 - smollm2-135m-gated-v3n +0.044" in out
    assert out.rstrip().endswith("chosen: smollm2-135m-gated-v3n2, by accuracy (95% CI excludes 0)")
    assert main(["organism", "choose", "smollm2-135m-gated-v3n2", "smollm2-135m-gated-v3n"]) == 2  # no --words: its recipe's list
    assert "holds no validation_large@scenario_words_v3 draw" in capsys.readouterr().err  # its own list, unscored

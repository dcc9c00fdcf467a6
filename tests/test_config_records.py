import json

import pytest

from kvprobe.errors import KVProbeError
from kvprobe.runner.config import load_config, parse_overrides
from kvprobe.runner.experiment import get_experiment, record_hash, run_experiment
from kvprobe.runner.records import RecordWriter, atomic_write_json
from tests.test_generator import tiny_generator_dir  # noqa: F401  (fixture)


def test_unknown_key_names_the_key_and_the_allowed_ones(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("experiment: locality\ntask:\n  n_instance: 3\n")
    with pytest.raises(KVProbeError) as err:
        load_config(cfg)
    msg = str(err.value)
    assert "task.n_instance" in msg and "n_instances" in msg and "allowed" in msg


def test_bad_value_and_bad_override_are_clear(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("experiment: locality\ninclusion:\n  min_flip: -1\n")
    with pytest.raises(KVProbeError, match="inclusion.min_flip"):
        load_config(cfg)
    with pytest.raises(KVProbeError, match="key=value"):
        parse_overrides(["seed"])
    assert parse_overrides(["task.n_instances=3", "seed=2"]) == {"task": {"n_instances": 3}, "seed": 2}


def test_unknown_params_key_is_refused_before_loading_a_model(tmp_path):
    cfg = load_config(None, {"experiment": "locality", "model": "no-such-model", "params": {"readout": 2},
                             "output_dir": str(tmp_path)})
    with pytest.raises(KVProbeError, match="params.readout"):
        run_experiment(cfg, progress=False)


def test_config_hash_ignores_output_dir_only():
    a = load_config(None, {"experiment": "locality", "output_dir": "x"})
    b = load_config(None, {"experiment": "locality", "output_dir": "y"})
    c = load_config(None, {"experiment": "locality", "seed": 1})
    assert a.hash() == b.hash() != c.hash()


def test_record_hash_covers_resolved_params_defaults_included():
    params_model = get_experiment("locality").params
    implicit = load_config(None, {"experiment": "locality"})
    explicit = load_config(None, {"experiment": "locality", "params": {"readout_tokens": 1}})
    other = load_config(None, {"experiment": "locality", "params": {"readout_tokens": 2}})

    def h(cfg):
        return record_hash(cfg, params_model.model_validate(cfg.params))

    # the default spelled out names the same record; a changed value (or a changed default) a new one
    assert h(implicit) == h(explicit) != h(other)


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "r.json"
    atomic_write_json(path, {"a": 1})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    atomic_write_json(path, {"x": float("nan")})
    assert json.loads(path.read_text()) == {"x": None}


def test_writer_refuses_finished_and_resumes_partial(tmp_path):
    path = tmp_path / "exp" / "m" / "h.json"
    w = RecordWriter(path)
    w.add_row({"index": 0, "v": 1.0})
    w.add_row({"index": 1, "v": 2.0})
    with w.partial.open("a") as f:
        f.write('{"index": 2, "v"')  # a row cut by an interruption
    resumed = RecordWriter(path)
    assert sorted(resumed.done) == [0, 1]
    resumed.finish({"rows": []})
    assert not resumed.partial.exists()
    with pytest.raises(KVProbeError, match="--overwrite"):
        RecordWriter(path)
    RecordWriter(path, overwrite=True)


def test_inclusion_is_the_gate_section_under_its_new_name_and_keeps_the_hash(tmp_path):
    old = load_config(None, {"experiment": "locality", "gate": {"min_flip": 1.0}})
    new = load_config(None, {"experiment": "locality", "inclusion": {"min_flip": 1.0}})
    via_set = load_config(None, parse_overrides(["experiment=locality", "inclusion.min_flip=1.0"]))
    assert old == new == via_set and new.gate.min_flip == 1.0
    assert old.hash() == new.hash() != load_config(None, {"experiment": "locality"}).hash()
    with pytest.raises(KVProbeError, match="keep only 'inclusion'"):
        load_config(None, {"experiment": "locality", "gate": {}, "inclusion": {}})


def test_hash_neutral_param_renames_no_record_at_its_default():
    from pydantic import BaseModel, ConfigDict

    from kvprobe.runner.config import hash_neutral, hashed_params

    class Before(BaseModel):
        model_config = ConfigDict(extra="forbid")
        top_k: int = 8

    class After(Before):
        ranking: str = hash_neutral("exact")

    cfg = load_config(None, {"experiment": "locality"})
    assert hashed_params(After()) == hashed_params(Before()) == {"top_k": 8}
    assert record_hash(cfg, After(), "t") == record_hash(cfg, Before(), "t")
    assert record_hash(cfg, After(ranking="atp"), "t") != record_hash(cfg, Before(), "t")
    assert "ranking" in After().model_dump()  # the record's params still show it


def test_committed_records_keep_their_names_under_the_current_code():
    """Every committed record's name is the hash its stored config and params get from today's code: a renamed
    config section or a new param must not orphan a committed record."""
    from pathlib import Path

    checked = 0
    for path in sorted((Path(__file__).parents[1] / "results").glob("*/*/*.json")):
        rec = json.loads(path.read_text())
        if "params_resolved" not in rec:
            continue
        cfg = load_config(None, rec["config"])
        params = get_experiment(rec["experiment"]).params.model_validate(rec["params_resolved"])
        assert record_hash(cfg, params, rec["task_template_sha256"]) == rec["config_hash"], path
        checked += 1
    assert checked >= 40


def test_generator_task_runs_a_template_free_probe_and_is_refused_where_the_template_is_read(tiny_generator_dir,
                                                                                           tmp_path):
    from kvprobe.app.cli import main

    gen = ["--set", "task.generator={split: test, formats: [system_user, tool_call]}", "--set", "task.n_instances=2",
           "--set", "inclusion.min_flip=0", "--quiet", "--model", str(tiny_generator_dir), "--output-dir",
           str(tmp_path)]
    assert main(["run", "configs/locality.yaml", *gen]) == 0
    rec = json.loads(next(tmp_path.glob("locality/*/*.json")).read_text())
    assert [r["format"] for r in rec["rows"]] == ["system_user", "tool_call"]
    assert rec["config"]["task"]["generator"]["split"] == "test"
    plain = load_config(None, {"experiment": "locality"})
    assert plain.hash() != load_config(None, {"experiment": "locality", "task": {"generator": {}}}).hash()
    with pytest.raises(KVProbeError, match="task.generator.formats"):
        load_config(None, {"experiment": "locality", "task": {"generator": {"formats": ["nope"]}}})
    assert main(["run", "configs/long_horizon.yaml", *gen]) == 2  # reads the template's own layout
    # the edit experiments take generated instances: the erratum is the generator's correction line
    assert main(["run", "configs/edit_frontier.yaml", *gen, "--set", "params.selective_k=[1]"]) == 0
    rows = json.loads(next(tmp_path.glob("edit_frontier/*/*.json")).read_text())["rows"]
    assert all(r["erratum_text"].startswith("Correction: ") for r in rows)


def test_generator_renders_the_templates_own_scenarios_when_named(tiny_generator_dir, tmp_path):
    """task.scenarios with task.generator: the named hand-written scenarios (their own rules, never
    counterfactual) in the generator's formats, cycling; the record's task says so."""
    from kvprobe.app.cli import main
    from kvprobe.runner.records import task_stem

    names = ["order_status", "refund_window"]
    assert main(["run", "configs/locality.yaml", "--set", "task.generator={formats: [system_user]}",
                 "--set", f"task.scenarios=[{', '.join(names)}]", "--set", "task.n_instances=3",
                 "--set", "inclusion.min_flip=0", "--quiet", "--model", str(tiny_generator_dir),
                 "--output-dir", str(tmp_path)]) == 0
    rec = json.loads(next(tmp_path.glob("locality/*/*.json")).read_text())
    assert [r["field"] for r in rec["rows"]] == ["order_status", "purchase_age", "order_status"]
    assert not any(r["counterfactual"] for r in rec["rows"])
    assert task_stem(rec) == "generated_template_system_user"

import json

import pytest

from kvprobe.errors import KVProbeError
from kvprobe.runner.config import load_config, parse_overrides
from kvprobe.runner.experiment import get_experiment, record_hash, run_experiment
from kvprobe.runner.records import RecordWriter, atomic_write_json


def test_unknown_key_names_the_key_and_the_allowed_ones(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("experiment: locality\ntask:\n  n_instance: 3\n")
    with pytest.raises(KVProbeError) as err:
        load_config(cfg)
    msg = str(err.value)
    assert "task.n_instance" in msg and "n_instances" in msg and "allowed" in msg


def test_bad_value_and_bad_override_are_clear(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("experiment: locality\ngate:\n  min_flip: -1\n")
    with pytest.raises(KVProbeError, match="gate.min_flip"):
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

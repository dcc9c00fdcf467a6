"""A new probe is three files: its module, its config and its test. Nothing else in kvprobe names it.

In a temporary folder this writes a toy probe (``probes/toy.py``: its EXPERIMENT with its paper section, one claim
and its own figure; ``probes/toy.yaml``; ``tests/test_toy.py``), makes it discoverable through
``$KVPROBE_EXPERIMENTS`` and publishes its run in a one-line study (as a real probe is published by a line in
``study.yaml``). Then it checks what the shell finds by itself: ``kvprobe run toy`` runs it on a tiny random-init
model, its figure is drawn, its claim enters the claims table, it gets its docs page, its row in the section's
generated table and in the experiments table, and the claims summary lists it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

from kvprobe.app.cli import main
from kvprobe.runner.plugins import EXPERIMENTS_ENV

TOY_MODULE = '''\
"""Toy probe: the spread of a model's next-token logits after each instance's prompt.

Three files make it: this module, toy.yaml and its test; kvprobe finds the rest here."""

from typing import Any

import torch

from kvprobe.claims import Claim
from kvprobe.runner.experiment import Context, Experiment


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    ids = ctx.lm.tokenizer.encode(inst.body(inst.old_value))
    with torch.no_grad():
        logits = ctx.lm.model(torch.tensor([ids])).logits[0, -1]
    return {"scenario": inst.scenario, "spread": float(logits.std())}


def summarize(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    values = [r["spread"] for r in rows]
    return {"n_instances": len(rows), "spread": {"mean": sum(values) / len(values)}}


def draw(records: list[dict[str, Any]], path: Any) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.bar(range(len(records)), [r["summary"]["spread"]["mean"] for r in records])
    fig.savefig(path)
    plt.close(fig)


EXPERIMENT = Experiment(
    name="toy", doc=__doc__, run_instance=run_instance, summarize=summarize, section="appG",
    headline=lambda s: f"logit spread {s['spread']['mean']:.3f}",
    claims=(Claim("spread_positive", "the toy's logits are not flat", "greater", "spread", 0.0, gated=False,
                  role="effect", paper="a toy statement: logits vary", paper_value=0.0, location="toy"),),
    figures={"fig_toy": draw})
'''

TOY_CONFIG = """\
experiment: toy
task:
  n_instances: 4
"""

TOY_TEST = '''\
from kvprobe.runner.experiment import get_experiment


def test_toy_summary():
    exp = get_experiment("toy")
    assert exp.summarize(None, [{"spread": 1.0}, {"spread": 3.0}])["spread"]["mean"] == 2.0
    assert exp.section == "appG" and "fig_toy" in exp.figures
'''


@pytest.fixture
def toy_model(tmp_path, tiny_text_dir) -> Path:
    """The tiny Llama of ``tiny_text_dir`` with its seeded random weights saved (so its records name it by its
    folder, as the study lists it; a ``--random-init`` run is named "<folder> (random init)" instead)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvprobe.models.loading import RANDOM_INIT_MARKER

    folder = tmp_path / "tiny-llama"
    shutil.copytree(tiny_text_dir, folder)
    (folder / RANDOM_INIT_MARKER).unlink(missing_ok=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    return folder


@pytest.fixture
def toy(tmp_path, toy_model, monkeypatch):
    """A checkout-like folder holding the toy's three files and a study that publishes its run."""
    from kvprobe import study
    from kvprobe.runner.experiment import available_experiments

    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "toy.py").write_text(TOY_MODULE)
    (tmp_path / "probes" / "toy.yaml").write_text(TOY_CONFIG)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_toy.py").write_text(TOY_TEST)
    (tmp_path / "study.yaml").write_text(textwrap.dedent(f"""\
        models:
          "{toy_model}":
            kind: pretrained
            family: llama
            about: a tiny random-init model
            use_when: the toy probe's test
            load: 1 s
            runs: [{{config: toy}}]
        """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(EXPERIMENTS_ENV, str(tmp_path / "probes"))
    study._published.cache_clear()
    yield tmp_path
    study._published.cache_clear()
    sys.modules.pop("kvprobe.experiments.toy", None)
    monkeypatch.delenv(EXPERIMENTS_ENV)
    assert "toy" not in available_experiments()  # the plugin folder leaves with the variable


def test_a_probe_is_three_files_and_the_shell_finds_the_rest(toy, toy_model, capsys):
    from kvprobe.app.pages import claims_summary, pages
    from kvprobe.app.report import experiments_table, section_table
    from kvprobe.figures import FIGURES
    from kvprobe.runner.experiment import available_experiments
    from kvprobe.runner.sections import experiments_in

    assert "toy" in available_experiments() and "toy" in experiments_in("appG")
    assert FIGURES["fig_toy"][0] == "toy"

    # its own test runs as written (imported from where the probe's author keeps it)
    spec = importlib.util.spec_from_file_location("toy_probe_test", toy / "tests" / "test_toy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.test_toy_summary()

    # kvprobe run toy: the config is found by name in the plugin folder, the run is published by the study
    assert main(["run", "toy", "--model", str(toy_model), "--quiet"]) == 0
    records = sorted((toy / "results" / "toy").glob("*/*.json"))
    assert len(records) == 1, capsys.readouterr().out
    record = json.loads(records[0].read_text())
    assert record["summary"]["n_instances"] == 4 and record["model"]["name"] == str(toy_model)

    # its figure, drawn from its own declaration
    assert main(["figures"]) == 0
    assert (toy / "figures" / "fig_toy.png").stat().st_size > 1000

    # its declared claim enters the claims table
    assert main(["claims"]) == 0
    rows = json.loads((toy / "results" / "claims.json").read_text())["claims"]
    assert [r["id"] for r in rows if r["id"].startswith("toy.")] == ["toy.spread_positive"]

    # its page, its section's table, the experiments table and the claims summary
    page = pages(toy / "results")["toy.md"]
    assert page.startswith("# toy\n") and "Toy probe: the spread" in page
    assert "the toy's logits are not flat" in page and "logit spread" in page
    table = section_table(toy / "results", "appG")
    assert f"| {toy_model} | gated |" in table and "logit spread" in table
    assert "| `make exp-toy` | Toy probe: the spread" in experiments_table()
    summary = claims_summary(toy / "results")  # tabulated where it has a verdict, else named by its key
    assert "toy: the toy's logits are not flat" in summary or "*toy*: `spread_positive`" in summary


def test_a_plugin_may_not_shadow_a_built_in_experiment(tmp_path, monkeypatch):
    from kvprobe.errors import KVProbeError
    from kvprobe.runner.experiment import available_experiments

    (tmp_path / "locality.py").write_text("EXPERIMENT = None\n")
    monkeypatch.setenv(EXPERIMENTS_ENV, str(tmp_path))
    with pytest.raises(KVProbeError, match="locality would shadow a built-in experiment"):
        available_experiments()
    monkeypatch.delenv(EXPERIMENTS_ENV)
    assert "locality" in available_experiments()


def test_the_default_test_paths_hold_no_plugin(monkeypatch):
    """Without the variable, the experiments are exactly the modules of experiments/."""
    from kvprobe.runner.experiment import available_experiments

    monkeypatch.delenv(EXPERIMENTS_ENV, raising=False)
    repo = Path(__file__).resolve().parents[1]
    assert set(available_experiments()) == {p.stem for p in (repo / "experiments").glob("*.py")
                                            if not p.stem.startswith("_")}


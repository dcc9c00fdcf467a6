"""Per-experiment facts are declared by each experiment and found by the shell, never listed elsewhere: its paper
section, its place there, its figures and its row of the README's experiments table."""

import re
from pathlib import Path

from kvprobe.runner.experiment import available_experiments, get_experiment
from kvprobe.runner.sections import BY_KEY, SECTIONS, experiment_order, experiments_by_section

REPO = Path(__file__).resolve().parents[1]


def test_every_experiment_declares_a_paper_section():
    missing = sorted(n for n in available_experiments() if get_experiment(n).section not in BY_KEY)
    assert not missing, f"declare Experiment(section=...) with a key of kvprobe.runner.sections.SECTIONS: {missing}"
    assert set(experiments_by_section()) == {s.key for s in SECTIONS}  # and every section has an experiment


def test_the_paper_order_comes_from_the_declarations():
    order = experiment_order()
    assert sorted(order) == sorted(available_experiments())
    assert order[:5] == ("locality", "locality_distance", "suffix", "knockout", "probes")
    keys = [get_experiment(n).section for n in order]
    assert keys == sorted(keys, key=list(BY_KEY).index)  # sections in the paper's order, each in one run


def test_figures_are_collected_from_their_modules_and_name_real_experiments():
    from kvprobe.figures import BENCH, FIGURES

    known = set(available_experiments())
    assert len(FIGURES) >= 30 and "claims_forest" in FIGURES and "fig14a_serve" in BENCH
    assert all(experiment in known or experiment == "" for experiment, _ in FIGURES.values())
    source = (REPO / "kvprobe" / "figures" / "__init__.py").read_text()
    assert "noqa: E402" not in source and "FIGURES.update" not in source  # no hand registration left


def test_the_experiments_table_has_a_row_per_experiment():
    from kvprobe.app.report import experiments_table

    table = experiments_table()
    rows = table.splitlines()[2:]
    assert len(rows) == len(available_experiments())
    for name in available_experiments():
        assert re.search(rf"`make exp-{name}`", table), name


def test_readme_and_results_list_experiments_through_generated_blocks():
    """The README's experiments table and RESULTS.md's section tables are generated blocks (test_docs checks they
    equal their regeneration), so a new experiment appears in both without an edit."""
    readme = (REPO / "README.md").read_text()
    assert "<!-- kvprobe:experiments -->" in readme
    block = readme.split("<!-- kvprobe:experiments -->", 1)[1].split("<!-- /kvprobe:experiments -->", 1)[0]
    assert all(f"`make exp-{name}`" in block for name in available_experiments())
    results = (REPO / "RESULTS.md").read_text()
    assert "<!-- kvprobe:section sec3 -->" in results

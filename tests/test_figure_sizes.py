"""Committed figures are printable: every PNG under figures/ fits a page (longest side <= 2600 px) and a
6.5-inch column at its committed dpi, and a figure is a pure function of the records (rendering twice gives the
same bytes)."""

from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
COLUMN_INCHES = 6.5


def _width_inches(path: Path) -> float:
    with Image.open(path) as im:
        dpi = im.info.get("dpi")
        assert dpi and dpi[0] > 0, f"{path.name} has no dpi metadata: save it with an explicit dpi"
        return im.size[0] / dpi[0]


def test_every_committed_figure_is_within_the_size_bound():
    pngs = sorted((REPO / "figures").glob("*.png"))
    assert pngs
    for p in pngs:
        with Image.open(p) as im:
            assert max(im.size) <= 2600, f"{p.name} is {im.size[0]}x{im.size[1]} px: wrap its panels into a grid"


def test_every_committed_figure_fits_a_column():
    wide = {p.name: round(_width_inches(p), 2) for p in sorted((REPO / "figures").glob("*.png"))
            if _width_inches(p) > COLUMN_INCHES + 0.01}
    assert not wide, f"wider than a {COLUMN_INCHES}-inch column at their dpi (inches): {wide}"


# every figure FIGURES draws, from the published records (the benchmark figure is drawn by its own module)
@pytest.mark.parametrize("stem", ["fig_memory", "fig11_locomo", "sec9_tau2", "fig3a_locality_sizes", "fig7b_agent",
                                  "fig7a_edit_in_transplant", "table1_weight_edit", "figG_twohop_blocks",
                                  "fig15a_heads", "fig3a_locality", "fig6b_transplant"])
def test_figures_draw_within_a_column(stem, tmp_path):
    from kvprobe.figures import FIGURES
    from kvprobe.app.report import published

    experiment, draw = FIGURES[stem]
    draw([r for r in published(REPO / "results") if not experiment or r["experiment"] == experiment],
         tmp_path / f"{stem}.png")
    assert _width_inches(tmp_path / f"{stem}.png") <= COLUMN_INCHES + 0.01


def test_rendering_is_idempotent(tmp_path):
    """`make figures` on a clean tree changes nothing: the same published records draw the same bytes."""
    from kvprobe.figures import FIGURES
    from kvprobe.runner.records import load_records
    from kvprobe.study import published_records

    published = published_records(load_records(REPO / "results"))
    experiment, draw = FIGURES["fig3a_locality"]
    draw([r for r in published if not experiment or r["experiment"] == experiment], tmp_path / "a.png")
    draw([r for r in published if not experiment or r["experiment"] == experiment], tmp_path / "b.png")
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    assert (tmp_path / "a.png").read_bytes() == (REPO / "figures" / "fig3a_locality.png").read_bytes()


def test_the_claims_forest_draws_every_study_model():
    """The forest once kept four models and silently dropped the fifth (the recommended Qwen2 organism)."""
    from kvprobe.figures.claims import forest_models
    from kvprobe.app.report import published
    from kvprobe.study import study_models

    drawn = forest_models(published(REPO / "results"))
    assert drawn == [m for m in study_models() if m in {r["model"]["name"] for r in published(REPO / "results")}]
    assert len(drawn) == len(study_models())


def test_panels_at_chance_are_marked(tmp_path, monkeypatch):
    """Memory E1 and E3 (full-recompute accuracy 0.50, n 10) say they are at chance; an informative panel does not."""
    from kvprobe.figures import common, memory
    from kvprobe.app.report import published

    assert common.covers_chance({"mean": 0.5, "ci_low": 0.19, "ci_high": 0.81})
    assert not common.covers_chance({"mean": 1.0, "ci_low": 0.69, "ci_high": 1.0})
    marked: list[str] = []
    monkeypatch.setattr(memory, "mark_at_chance", lambda ax, what: marked.append(ax.get_title()))
    memory.fig_memory([r for r in published(REPO / "results") if r["experiment"] == "memory"], tmp_path / "m.png")
    assert sorted(t.split()[0] for t in marked) == ["E1", "E2", "E3"]

"""Committed figures are printable: every PNG under figures/ fits a page (longest side <= 2600 px at the
committed dpi), and a figure is a pure function of the records (rendering twice gives the same bytes)."""

from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[1]


def test_every_committed_figure_is_within_the_size_bound():
    pngs = sorted((REPO / "figures").glob("*.png"))
    assert pngs
    for p in pngs:
        with Image.open(p) as im:
            assert max(im.size) <= 2600, f"{p.name} is {im.size[0]}x{im.size[1]} px: wrap its panels into a grid"


def test_rendering_is_idempotent(tmp_path):
    """`make figures` on a clean tree changes nothing: the same published records draw the same bytes."""
    from kvprobe.figures import FIGURES
    from kvprobe.runner.records import load_records
    from kvprobe.study import published_records

    published = published_records(load_records(REPO / "results", "locality"))
    experiment, draw = FIGURES["fig3a_locality"]
    draw([r for r in published if r["experiment"] == experiment], tmp_path / "a.png")
    draw([r for r in published if r["experiment"] == experiment], tmp_path / "b.png")
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    assert (tmp_path / "a.png").read_bytes() == (REPO / "figures" / "fig3a_locality.png").read_bytes()


def test_the_claims_forest_draws_every_study_model():
    """The forest once kept four models and silently dropped the fifth (the recommended Qwen2 organism)."""
    from kvprobe.figures.claims import forest_models
    from kvprobe.runner.report import published
    from kvprobe.study import study_models

    drawn = forest_models(published(REPO / "results"))
    assert drawn == [m for m in study_models() if m in {r["model"]["name"] for r in published(REPO / "results")}]
    assert len(drawn) == len(study_models())

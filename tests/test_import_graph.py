"""kvprobe's own import graph (tools/import_graph.py): no circles, even through function-local imports, and at
most two arrows that run back up the layering (the one-release CLI shim, runner.cli -> app.cli, and the
documented backends -> models TYPE_CHECKING import)."""

from pathlib import Path

from tools.import_graph import main, summary

REPO = Path(__file__).resolve().parents[1]


def test_no_circles_and_at_most_two_arrows_back_up(capsys):
    s = summary(REPO)
    assert s["circles"] == [], s["circles"]
    assert len(s["arrows back up"]) <= 2, s["arrows back up"]
    assert main(["--root", str(REPO)]) == 0
    assert "circles: 0" in capsys.readouterr().out


def test_the_measure_sees_a_circle_through_a_function_local_import_and_an_arrow_back_up(tmp_path):
    pkg = tmp_path / "kvprobe"
    (pkg / "low").mkdir(parents=True)
    (tmp_path / "experiments").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from kvprobe.high import b\n")
    (pkg / "high.py").write_text("from kvprobe.low import a\n")
    (tmp_path / "experiments" / "__init__.py").write_text("")
    (tmp_path / "experiments" / "x.py").write_text("from kvprobe import high\n")
    s = summary(tmp_path)
    assert s["circles"] == [["kvprobe.high", "kvprobe.low.a"]]
    assert list(s["arrows back up"]) in ([("low", "high")], [("high", "low")])
    assert s["floor of"]["experiments"] > s["floor of"]["high"]  # it imports high, so it stands above it

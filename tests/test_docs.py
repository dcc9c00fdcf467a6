"""The README stays a newcomer's page and the generated tables in README.md / RESULTS.md match the records."""

import json
import re
from pathlib import Path

import pytest

from kvprobe.errors import KVProbeError
from kvprobe.runner.report import refresh_markdown, stale_documents

REPO = Path(__file__).resolve().parents[1]


def test_generated_blocks_match_the_committed_records():
    from kvprobe.runner.pages import stale_pages

    docs = [REPO / "README.md", REPO / "RESULTS.md", REPO / "docs" / "history" / "organisms.md"]
    assert stale_documents(docs, REPO / "results") == [], "run `make report` and commit README.md / RESULTS.md"
    assert stale_pages(REPO / "results", REPO / "docs" / "results") == [], "run `make report` and commit docs/results"
    for doc in docs:  # every block was generated, none left as a placeholder
        assert "(generated)" not in doc.read_text()
    # the curated page as a reader sees it (the markers of generated blocks and prose references are not text)
    assert len(_rendered((REPO / "RESULTS.md").read_text()).encode()) <= 80_000  # detail lives in docs/results


def test_published_tables_ignore_a_smoke_record_beside_them(tmp_path):
    """A scratch record in results/ (e.g. from --output-dir results) changes no published table or page."""
    import shutil

    from kvprobe.runner.pages import pages
    from kvprobe.runner.report import headline_table

    results = tmp_path / "results"
    shutil.copytree(REPO / "results" / "locality", results / "locality")
    shutil.copy(REPO / "results" / "claims.json", results / "claims.json")
    before_table, before_page = headline_table(results), pages(results)["locality.md"]
    src = next((results / "locality" / "smollm2-135m-gated-v2").glob("*.json"))
    smoke = json.loads(src.read_text())
    smoke.update(config_hash="0123456789ab", created="2099-01-01T00:00:00+00:00")
    smoke["summary"]["n_instances"] = smoke["summary"]["n_included"] = 2
    (results / "locality" / "smollm2-135m-gated-v3n2-seed2" / "0123456789ab.json").write_text(json.dumps(smoke))
    assert headline_table(results) == before_table
    assert pages(results)["locality.md"] == before_page


def test_refresh_rewrites_only_the_blocks(tmp_path):
    text = "prose 1\n<!-- kvprobe:headlines -->\nold numbers\n<!-- /kvprobe:headlines -->\nprose 2\n"
    out = refresh_markdown(text, REPO / "results")
    assert out.startswith("prose 1\n<!-- kvprobe:headlines -->\n| model |") and out.endswith("prose 2\n")
    assert "old numbers" not in out and "smollm2-135m" in out
    with pytest.raises(KVProbeError, match="unknown generated block"):
        refresh_markdown("<!-- kvprobe:nope -->\nx\n<!-- /kvprobe:nope -->", REPO / "results")


def _rendered(markdown: str) -> str:
    """Markdown without its HTML comments (the generated blocks' and prose references' markers)."""
    return re.sub(r"<!--.*?-->", "", markdown, flags=re.S)


def test_readme_has_exactly_the_two_setup_commands():
    readme = (REPO / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("##", 1)[0]
    block = re.search(r"```\n(.*?)```", setup, re.S).group(1)
    assert block.split("\n")[:-1] == ["make exp-locality", "make test"]
    assert len(_rendered(readme).encode()) < 20_000  # full results live in RESULTS.md
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_compare_block_puts_two_models_side_by_side_from_their_report_rows():
    from kvprobe.runner.report import compare_rows, report_rows

    a, b = "smollm2-135m", "smollm2-135m-gated-v2"
    rows = compare_rows(REPO / "results", a, b)
    report = {(r[0], r[1], r[2]): r for r in report_rows(REPO / "results")}
    assert rows, "both models have records for some experiment"
    for exp, task, inc_a, inc_b, flip_a, flip_b, head_a, head_b in rows:
        assert [inc_a, flip_a, head_a] == report[(exp, task, a)][3:6]
        assert [inc_b, flip_b, head_b] == report[(exp, task, b)][3:6]
    only_a = {(r[0], r[1]) for r in report.values() if r[2] == a} - {(r[0], r[1]) for r in report.values() if r[2] == b}
    assert not only_a & {(r[0], r[1]) for r in rows}  # a row needs both models

    out = refresh_markdown(f"<!-- kvprobe:compare {a} {b} -->\nold\n<!-- /kvprobe:compare -->\n", REPO / "results")
    assert f"| headline: {a} | headline: {b} |" in out and "old" not in out
    with pytest.raises(KVProbeError, match="takes two model names"):
        refresh_markdown(f"<!-- kvprobe:compare {a} -->\nx\n<!-- /kvprobe:compare -->", REPO / "results")
    with pytest.raises(KVProbeError, match="takes no arguments"):
        refresh_markdown(f"<!-- kvprobe:headlines {a} -->\nx\n<!-- /kvprobe:headlines -->", REPO / "results")
    with pytest.raises(KVProbeError, match="no records for model 'nope'"):
        compare_rows(REPO / "results", a, "nope")


def test_section_table_prints_a_repeated_paper_value_once():
    """Consecutive rows of one experiment share the paper's value: the first row carries it, the rest say so."""
    from kvprobe.runner.report import section_table

    table = section_table(REPO / "results", "knockout")
    paper_cells = [line.rsplit(" | ", 1)[-1].rstrip(" |") for line in table.splitlines()[2:]]
    assert len(paper_cells) >= 2
    assert paper_cells[0] not in ("", "as above")
    assert all(cell == "as above" for cell in paper_cells[1:] if cell)

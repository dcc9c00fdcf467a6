"""The README stays a newcomer's page and the generated tables in README.md / RESULTS.md match the records."""

import json
import re
from pathlib import Path

import pytest

from kvprobe.errors import KVProbeError
from kvprobe.app.report import refresh_markdown, stale_documents

REPO = Path(__file__).resolve().parents[1]


def test_generated_blocks_match_the_committed_records():
    from kvprobe.app.pages import stale_pages

    docs = [REPO / "README.md", REPO / "RESULTS.md", REPO / "docs" / "engineering.md",
            REPO / "docs" / "locality_sizes.md", REPO / "docs" / "history" / "organisms.md"]
    assert stale_documents(docs, REPO / "results") == [], "run `make report` and commit README.md / RESULTS.md"
    assert stale_pages(REPO / "results", REPO / "docs" / "results") == [], "run `make report` and commit docs/results"
    for doc in docs:  # every block was generated, none left as a placeholder
        assert "(generated)" not in doc.read_text()
    # the curated page as a reader sees it (the markers of generated blocks and prose references are not text)
    assert len(_rendered((REPO / "RESULTS.md").read_text()).encode()) <= 80_000  # detail lives in docs/results


def test_published_tables_ignore_a_smoke_record_beside_them(tmp_path):
    """A scratch record in results/ (e.g. from --output-dir results) changes no published table or page."""
    import shutil

    from kvprobe.app.pages import pages
    from kvprobe.app.report import headline_table

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
    from kvprobe.app.report import compare_rows, report_rows

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
    from kvprobe.app.report import section_table

    table = section_table(REPO / "results", "knockout")
    paper_cells = [line.rsplit(" | ", 1)[-1].rstrip(" |") for line in table.splitlines()[2:]]
    assert len(paper_cells) >= 2
    assert paper_cells[0] not in ("", "as above")
    assert all(cell == "as above" for cell in paper_cells[1:] if cell)


# -- every measured number in the prose is a reference ----------------------------------------------------------
# The curated pages' prose (outside the generated <!-- kvprobe:NAME --> blocks) types no measured number: each is a
# <!-- kvprobe:v SOURCE|FORMAT -->...<!-- /kvprobe:v --> reference that `make report` fills from a published
# record, a committed benchmark / gate output or the paper registry, so the regeneration test above fails when a
# reference's text differs from its source.
PROSE_DOCS = ("README.md", "RESULTS.md", "docs/engineering.md", "docs/locality_sizes.md")
_SKIP = (
    re.compile(r"<!-- kvprobe:(?P<name>[a-z_]+)(?: [^\s>]+)* -->\n.*?<!-- /kvprobe:(?P=name) -->", re.S),  # blocks
    re.compile(r"<!-- kvprobe:v [^>]+? -->.*?<!-- /kvprobe:v -->", re.S),  # references
    re.compile(r"```.*?```", re.S),  # code blocks (commands, committed outputs)
    re.compile(r"<!--.*?-->", re.S),
    re.compile(r"`[^`\n]*`"),  # code spans: file names, configs, commands
    re.compile(r"\]\([^)]*\)"),  # link targets
)
# A measured number: a decimal (0.86, -0.028, 2.2e-7), a percentage, a ratio (24.5x), or a count "k / n", "k of n".
# Digits glued to a letter, dot, hyphen or slash are parts of names (Qwen2.5-Coder-0.5B, Llama-3.1-8B, v3n2, 4-9B,
# torch==2.13.0), and a bare integer (28 turns, 36 scenarios, section numbers) is a design count, not a measurement.
_MEASURED = re.compile(r"(?<![\w.\-/=^])[-+]?(?:\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+)(?![\w.])"
                       r"|(?<![\w.\-/])\d+(?:\.\d+)?(?:%|x\b)"
                       r"|(?<![\w.\-/])\d+ ?(?:/|of) ?\d+(?![\w.])")
ALLOWED = {  # numbers in the prose that are not measurements, each with why
    r"\b0\.5 nats": "the inclusion threshold (inclusion.min_flip, a config value)",
    r"\b95% CIs?": "the level of every interval",
    r"\+-0\.1 margin": "kvprobe's declared TOST margin, not a measurement",
    r"Python \d+\.\d+": "a version",
    r"Figs?\. \d+/\d+": "figure numbers",
}


def hand_typed_numbers(text: str) -> list[str]:
    """The measured numbers typed by hand in ``text``'s prose (outside blocks, references, code and links)."""
    for pattern in _SKIP:
        text = pattern.sub(" ", text)
    for pattern in ALLOWED:
        text = re.sub(pattern, " ", text)
    return [m.group(0) for m in _MEASURED.finditer(text)]


def test_the_prose_types_no_measured_number():
    found = {doc: hand_typed_numbers((REPO / doc).read_text()) for doc in PROSE_DOCS}
    found = {doc: nums for doc, nums in found.items() if nums}
    assert not found, (f"hand-typed numbers in the prose: {found}; write each as <!-- kvprobe:v SOURCE|FORMAT -->"
                       f"<!-- /kvprobe:v --> (kvprobe/app/report.py) and run `make report`, or point to a table")


def test_a_hand_typed_or_edited_number_is_caught():
    """Mutations: a number typed into the prose is flagged; an edited reference no longer equals its regeneration
    (so test_generated_blocks_match_the_committed_records fails); names, versions and code are not numbers."""
    from kvprobe.app.report import refresh_values

    assert hand_typed_numbers("the top 8 recover 0.42 of it, 13 / 24 included, 24.5x faster, 7%") == \
        ["0.42", "13 / 24", "24.5x", "7%"]
    assert hand_typed_numbers("Qwen2.5-Coder-0.5B and Llama-3.1-8B on smollm2-135m-gated-v3n2-seed2 (v0.1.0), "
                              "`torch==2.13.0`, [x](results/a_0.5.json), 28 turns, Sec. 3 (1), at least 0.5 nats") == []
    text = (REPO / "RESULTS.md").read_text()
    assert refresh_values(text, REPO / "results") == text
    ref = "561ca5f6e26d#summary.recovery.field_only.gated|ci -->"
    assert ref + "0.01 [0.00, 0.02]<" in text, "the mutation edits the organism's field-only reference"
    edited = text.replace(ref + "0.01 [0.00, 0.02]<", ref + "0.02 [0.00, 0.02]<")
    assert refresh_values(edited, REPO / "results") == text  # the report restores the record's number ...
    assert refresh_values(edited, REPO / "results") != edited  # ... so the committed page would be stale
    assert hand_typed_numbers(text.replace("## Principal findings", "## Principal findings (0.93 overall)")) == ["0.93"]


def test_prose_references_resolve_from_published_records_outputs_and_the_registry():
    from kvprobe.app.report import bench_output, resolve_value

    res = REPO / "results"
    full = "locality/smollm2-135m-gated-v3n2-seed2/561ca5f6e26d#summary.recovery.field_only.gated|ci"
    assert resolve_value(full, res) == resolve_value("561ca5f6e26d#summary.recovery.field_only.gated|ci", res)
    assert resolve_value("a61d761be158#summary|kn", res) == "13 / 24"
    assert resolve_value("794c5fff4526#summary.cells.document_qa, rule before field.150.recovery.field_only.gated|ci",
                         res) == "0.60 (4 clusters: no interval)"  # no interval from fewer than 5 clusters
    assert resolve_value("gate/smollm2-135m#rows.1.key_rel_layer0|e", res) == "1e-7"
    assert resolve_value("bench/ttft_smollm2-135m#rows.0.chunk_tokens|int", res) == "1000"
    assert resolve_value("paper:locality.field_only_zero", res) == "-0.028"
    assert resolve_value("paper:edit_frontier.erratum_vs_reprefill|.2f", res) == "1.00"
    assert bench_output(res, "edit_smollm2-135m.txt").startswith("```\nsmollm2-135m: prompt 680 tokens")
    with pytest.raises(KVProbeError, match="not a record the study publishes"):
        resolve_value("locality/smollm2-135m-gated-v2/" + next(
            (res / "locality" / "smollm2-135m-gated-v2").glob("*.json")).stem + "#summary.n_instances|int", res)
    with pytest.raises(KVProbeError, match="0 published records have the hash"):
        resolve_value("0123456789ab#summary.n_instances", res)
    with pytest.raises(KVProbeError, match="no committed output"):
        bench_output(res, "nope.txt")


def test_prose_references_read_a_claims_row_by_its_key(tmp_path):
    import json

    from kvprobe.app.report import resolve_value

    with pytest.raises(KVProbeError, match="run `kvprobe claims` first"):
        resolve_value("claims#trends.up.slope_per_decade|+.2f", tmp_path)
    (tmp_path / "claims.json").write_text(json.dumps({"trends": [{"key": "down", "slope_per_decade": -0.5},
                                                                 {"key": "up", "slope_per_decade": 0.25}]}))
    assert resolve_value("claims#trends.up.slope_per_decade|+.2f", tmp_path) == "+0.25"
    assert resolve_value("claims#trends.1.slope_per_decade|.1f", tmp_path) == "0.2"
    with pytest.raises(KVProbeError, match="no 'sideways'"):
        resolve_value("claims#trends.sideways.slope_per_decade", tmp_path)

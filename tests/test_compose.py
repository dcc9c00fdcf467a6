"""Splice and seam repair: exact where theory says so; blocks are write-once with provenance."""

import torch

from kvprobe.kv import prefill, read_logits
from kvprobe.kv.blocks import Block, BlockLibrary
from kvprobe.kv.compose import Live, Spliced, assemble, precompile
from kvprobe.app.cli import main


def _ids(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_seam_repair_equals_full_prefill_and_splice_is_close(tiny_lm):
    head, chunk, tail = _ids(7, 0), _ids(12, 1), _ids(5, 2)
    full = read_logits(tiny_lm, prefill(tiny_lm, head + chunk + tail[:-1]), tail[-1:])[0]
    block = precompile(tiny_lm, chunk)
    repaired = assemble(tiny_lm, [Live(tuple(head)), Spliced(tuple(chunk), block, seam=len(chunk)), Live(tuple(tail[:-1]))])
    assert (read_logits(tiny_lm, repaired, tail[-1:])[0] - full).abs().max() < 1e-4
    spliced = assemble(tiny_lm, [Live(tuple(head)), Spliced(tuple(chunk), block), Live(tuple(tail[:-1]))])
    assert spliced.positions.tolist() == list(range(len(head) + len(chunk) + len(tail) - 1))
    # A chunk with no preceding context is exactly its isolated prefill.
    alone = assemble(tiny_lm, [Spliced(tuple(chunk), block), Live(tuple(tail[:-1]))])
    ref = read_logits(tiny_lm, prefill(tiny_lm, chunk + tail[:-1]), tail[-1:])[0]
    assert (read_logits(tiny_lm, alone, tail[-1:])[0] - ref).abs().max() < 1e-4


def test_block_library_round_trip_and_provenance(tiny_lm, tmp_path):
    from kvprobe.kv.rope import shift

    ids = _ids(9, 3)
    block = Block.from_state(precompile(tiny_lm, ids), ids, tiny_lm.fingerprint, "tok")
    lib = BlockLibrary(tmp_path)
    bid = lib.put(block)
    payload_file = tmp_path / f"{bid}.safetensors"
    mtime = payload_file.stat().st_mtime_ns
    got = lib.get(bid)
    assert got.payload.max_abs_diff(block.payload) == 0 and got.identity == block.identity
    got.policy["priority"] = "high"
    lib.update_policy(got)  # policy changes without rewriting the payload
    assert payload_file.stat().st_mtime_ns == mtime and lib.get(bid).policy == {"priority": "high"}
    moved = block.derive(shift(block.payload, 40, tiny_lm))
    assert moved.identity.parent == bid and moved.block_id != bid and moved.identity.position_start == 40
    assert lib.find(ids, tiny_lm.fingerprint, "tok").block_id == bid


def test_transplant_cli_end_to_end(tiny_text_dir, tmp_path):
    import json

    assert main(["run", "configs/transplant.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path),
                 "--set", "task.n_instances=2", "--set", "params.seam_repair=[0,2]", "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("transplant/*/*.json")).read_text())
    assert rec["summary"]["gate"]["passed"] and {"seam0", "seam2", "no_rotation", "blocks2", "tools_seam0",
                                                 "conversation_seam0", "conversation_no_rotation"} <= set(
        rec["summary"]["variants"])
    for row in rec["rows"]:  # policy, tools and conversation chunks: in prompt order, back to back
        c = row["chunks"]
        assert c["policy"][0] < c["policy"][1] == c["tools"][0] < c["tools"][1] == c["conversation"][0] \
            < c["conversation"][1] < row["n_tokens"]
    from kvprobe.app.report import report_rows

    (row,) = report_rows(tmp_path)
    from pathlib import Path

    # a random-init model is named by its folder and marked, never by a machine path
    assert row[2] == f"{Path(rec['model']['name']).name} (random init)"
    assert [row[0], row[1], row[3]] == ["transplant", "gated", "- / 2"] and "no_rotation cos" in row[5]


def test_transplant_agreement_by_direction_separates_a_default_action():
    """A spliced cache that takes one action whatever the field says agrees only in one direction; the split
    and Fisher's test show it, and balanced agreement gives p = 1."""
    from kvprobe.experiments.transplant import agreement_by_direction

    rows = [{"scenario": f"s{i}", "direction": d, "seam0_agree": float(a)}
            for i, (d, a) in enumerate([("allow_to_block", 0)] * 9 + [("allow_to_block", 1)]
                                       + [("block_to_allow", 1)] * 10)]
    out = agreement_by_direction(rows, "seam0")
    assert (out["by_direction"]["allow_to_block"]["k"], out["by_direction"]["allow_to_block"]["n"]) == (1, 10)
    assert out["by_direction"]["block_to_allow"]["k"] == 10 and out["fisher_p"] < 1e-3
    balanced = [{**r, "seam0_agree": float(i % 2)} for i, r in enumerate(rows)]
    assert agreement_by_direction(balanced, "seam0")["fisher_p"] == 1.0
    one_way = agreement_by_direction(rows[:10], "seam0")
    assert "fisher_p" not in one_way and list(one_way["by_direction"]) == ["allow_to_block"]

"""agent on a tiny model: the policy is composed once and never prefilled again, each later turn prefills only
its delta over the previous turn's cache, and the unified path reads as full recompute would."""

from __future__ import annotations

import json

from kvprobe.runner.cli import main


def test_agent_end_to_end(tiny_text_dir, tmp_path):
    assert main(["run", "configs/agent.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path),
                 "--set", "task.n_instances=2", "--set", "params.turns=3", "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("agent/*/*.json")).read_text())
    for row in rec["rows"]:
        t1, t2, t3 = row["turns"]
        assert t1["unified_prefilled"] == t1["n_tokens"] - row["policy_tokens"]  # the policy is spliced, not run
        assert t2["n_tokens"] > t1["n_tokens"] and t3["unified_prefilled"] < t3["n_tokens"] - row["policy_tokens"]
        assert t1["value"] != t2["value"] == t3["value"] or t2["value"] != t3["value"]
        assert row["prefill_ratio"] > 1 and all(0.9 < t["cosine"] <= 1.0001 for t in row["turns"])
        # front keeps the policy cached (reprefill from the field on), end re-prefills it every turn
        assert t1["front"]["prefilled"] == t1["front"]["n_tokens"] == t1["end"]["n_tokens"] == t1["n_tokens"] - \
            (t1["n_tokens"] - t1["end"]["n_tokens"])
        for t in (t2, t3):
            assert t["front"]["prefilled"] < t["end"]["prefilled"] < t["end"]["n_tokens"]
            assert t["end"]["prefilled"] > row["policy_tokens"]
        assert t3["front"]["agree"] and t3["end"]["agree"] and "agree" not in t2["front"]
        assert row["baseline_prefill_ratio"]["end"] > row["baseline_prefill_ratio"]["front"]
    s = rec["summary"]
    assert s["n_decisions"] == 6 and s["agreement"]["n"] == 6
    assert set(s["baselines"]) == {"front", "end"} and s["baselines"]["front"]["agreement_last_turn"]["n"] == 2
    from kvprobe.figures.agent import fig7b_agent

    fig7b_agent([rec], tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 1000


def test_agent_benchmark_runs_side_by_side(tiny_text_dir):
    """The benchmark's run() on a tiny model: both paths time every turn and return positive seconds."""
    import importlib.util
    from pathlib import Path

    from kvprobe.models.loading import load_model

    spec = importlib.util.spec_from_file_location("bench_agent", Path(__file__).parents[1] / "benchmarks" / "agent.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lm = load_model(str(tiny_text_dir), device="cpu", dtype="float32")
    ids = list(range(5, 45))
    states = [ids[24:28], ids[40:44], ids[24:28]]
    t = bench.run(lm, ids[:20], ids[20:24], states, [ids[28:31], ids[31:34]], ids[34:40], 2)
    assert set(t) == {"unified", "reprefill", "front", "end"} and all(v > 0 for v in t.values())

"""The τ² retail environment (its own tool scores the decision) and the tau2 experiment on a tiny model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tau2", reason="the τ²-bench package: `make install` installs it (--no-deps)")

from kvprobe.envs import tau2_retail  # noqa: E402


def test_the_environment_s_own_tool_is_the_reward():
    order = tau2_retail.pending_orders(1)[0]["order_id"]
    assert tau2_retail.score("cancel", order, None)["reward"]
    assert not tau2_retail.score("deny", order, None)["reward"]
    after = tau2_retail.score("cancel", order, "processed")
    assert not after["reward"] and "Non-pending" in after["tool_message"]  # the tool's own status check
    assert tau2_retail.score("deny", order, "processed")["reward"]
    assert len(tau2_retail.policy()) > 5000  # read from the package, not a copy


def test_importing_the_tools_prints_no_env_file_warning():
    """tau2 warns at import that it found no .env; kvprobe reads none, so a user should not see it."""
    import subprocess
    import sys
    code = "from kvprobe.envs import tau2_retail; tau2_retail.retail_tools()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "No .env file found" not in done.stderr + done.stdout


def test_tau2_experiment_end_to_end(tiny_text_dir, tmp_path):
    from kvprobe.runner.cli import main

    main(["run", "configs/tau2.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path),
          "--set", "task.n_instances=2", "--quiet"])
    rec = json.loads(next(tmp_path.rglob("*.json")).read_text())
    s = rec["summary"]
    assert set(s["arm_b"]) == {"stale", "in_place", "erratum", "field_erratum", "transplant", "full_reprefill"}
    assert s["arm_b"]["full_reprefill"]["recompute_fraction"] == 1.0 and s["arm_b"]["stale"]["recompute_fraction"] == 0
    assert s["prefix_cache_max_abs_logit_diff"] < 1e-3  # prefix caching computes the full prefill
    for row in rec["rows"]:  # every reward is the tool's verdict on the decision taken
        for arm, pending in (("arm_a", True), ("arm_b", False)):
            for m in row[arm].values():
                assert m["tool_accepts_cancel"] is pending  # the state change reached the environment's db
                assert m["reward"] == ((m["action"] == "cancel") == pending)
    from kvprobe.figures import FIGURES

    FIGURES["sec9_tau2"][1]([rec], tmp_path / "s9.png")
    assert (tmp_path / "s9.png").stat().st_size > 0

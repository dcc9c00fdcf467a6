"""llama.cpp backend: the paper's operations on the engine's own KV cache, checked for exactness against the
engine's own reprefill where theory says they are identical, against kvprobe's HF oracle on the same GGUF
weights within stated tolerances (the engine multiplies quantised Q4_1 weights; HF runs them dequantised), and
by the edit-effect check, which must pass the correct edit and fail a no-op and a position-shifted one."""

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="the engine extra is not installed (pip install kvprobe[engine])")

pytestmark = [pytest.mark.engine, pytest.mark.slow]

# Tolerances, from smollm2-135m (Q4_1 GGUF; gated template, direct format; results/bench/engine_oracle_*.txt
# has the measured spread) and stated here:
COS_VS_HF = 0.99  # engine operation vs HF's same operation: logit cosine over the whole vocabulary (min 0.996)
COS_VS_SELF = 0.99  # engine operation vs the engine's own full reprefill of the prompt it answers (min 0.994)
DECISION_MARGIN = 0.5  # nats: decisions must agree wherever the reference's |logit diff| is at least this


@pytest.fixture(scope="module")
def engine():
    from kvprobe.backends.llamacpp import LlamaCppEngine
    from kvprobe.models.gguf_export import gguf_path

    with LlamaCppEngine(gguf_path("smollm2-135m"), n_ctx=2048, n_threads=1) as eng:
        yield eng


@pytest.fixture(scope="module")
def ids(smollm):
    text = ("The store policy says that orders can be cancelled only while they are pending. The order status is "
            "pending. Can the order be cancelled? Answer:")
    return smollm.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_cache_operations_are_exact_where_theory_says_so(engine, ids):
    n = len(ids)
    ref = engine.full_reprefill(ids).logits
    # in-place refresh with the field's own tokens: the same cells at the same positions
    engine.cache_context(ids[:-1])
    same = engine.in_place(ids[:-1], [10, 11], ids[-1:])
    assert np.abs(same.logits - ref).max() < 1e-4 and same.decoded_tokens == 3
    assert engine.seq_pos_max(engine.REQUEST) == n - 2 and engine.seq_pos_max(engine.HOLD) == -1  # cache restored
    # an append that shares the whole cached prefix decodes only the new tokens
    engine.cache_context(ids[:-5])
    app = engine.append(ids[:-5], ids)
    assert app.decoded_tokens == 5 and np.abs(app.logits - ref).max() < 1e-4
    # transplant with no head and no seam on a cleared cache: the chunk's cells, then the tail's, in position
    # order in llama.cpp's cell buffer -> the same numbers as the reprefill.
    engine.clear()
    seq = engine.precompile(ids[:20])
    tr0 = engine.transplant([], seq, 20, ids[0], ids[20:], seam=0)
    assert np.abs(tr0.logits - ref).max() < 1e-4 and tr0.decoded_tokens == n - 20
    assert engine.seq_pos_max(seq) == 19  # the precompiled chunk is back at 0..L-1 for the next request
    # With the seam token recomputed (same empty context, so the same K/V) the request's cells sit out of
    # position order in the buffer (the seam cell is newer than the chunk's), and this engine's attention
    # numerics then differ (measured max |dlogit| ~0.6 here; 0 when in order): within tolerance, not exact.
    tr = engine.transplant([], seq, 20, ids[0], ids[20:])
    cos = float(tr.logits @ ref / np.linalg.norm(tr.logits) / np.linalg.norm(ref))
    assert cos >= COS_VS_SELF and tr.logits.argmax() == ref.argmax() and tr.decoded_tokens == 1 + n - 20


def test_in_place_changes_the_answer_and_keeps_the_stale_suffix(engine, smollm):
    tok = smollm.tokenizer
    old = tok("Order status: delivered. Policy: cancel only pending orders. Can it be cancelled? Answer:",
              add_special_tokens=False)["input_ids"]
    new = tok("Order status: pending. Policy: cancel only pending orders. Can it be cancelled? Answer:",
              add_special_tokens=False)["input_ids"]
    assert len(old) == len(new)
    diff = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
    engine.cache_context(old[:-1])
    edited = engine.in_place(new[:-1], diff, new[-1:])
    stale = engine.full_reprefill(old).logits
    fresh = engine.full_reprefill(new).logits
    assert np.abs(edited.logits - stale).max() > 1e-2  # the new field's cells are read
    assert np.abs(edited.logits - fresh).max() > 1e-5  # and the suffix cells are the stale ones (no recompute)


def test_operations_agree_with_the_hf_oracle_on_the_same_gguf(engine, smollm, template):
    """Agreement, not discrimination: these tolerances also pass a no-op edit on this pretrained model (its
    decision barely depends on the field); the edit-effect check below is the one that can fail."""
    from kvprobe.kv.engine_oracle import OPERATIONS, compare_instance
    from kvprobe.tasks.gated import generate_instances

    rows = [compare_instance(smollm, engine, template, inst)
            for inst in generate_instances(template, 1, seed=0, n_filler=2)]
    for row in rows:
        for name in OPERATIONS:
            op = row["operations"][name]
            assert op["cos_vs_hf"] >= COS_VS_HF, (name, op)
            assert op["cos_vs_self"] >= COS_VS_SELF, (name, op)
            if abs(op["hf_ld"]) >= DECISION_MARGIN:
                assert op["agree_vs_hf"], (name, op)
            if abs(op["engine_ref_ld"]) >= DECISION_MARGIN:
                assert op["agree_vs_self"], (name, op)
        assert row["operations"]["in_place"]["engine_decoded"] == len(row["field_slots"]) + 1


def test_server_streams_tokens_and_reports_the_engines_reuse(engine, ids):
    import http.client
    import json
    import threading

    from kvprobe.backends.server import PrefixCachingEngine, make_server

    engine.clear()
    server = make_server(PrefixCachingEngine(engine))
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def generate(tokens):
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=600)
        conn.request("POST", "/generate", json.dumps({"tokens": tokens, "max_tokens": 3}))
        lines = [json.loads(x) for x in conn.getresponse().read().decode().splitlines()]
        conn.close()
        return lines

    try:
        first = generate(ids[:20])
        assert [("token" in x) for x in first] == [True, True, True, False] and first[-1]["engine_reused_tokens"] == 0
        second = generate(ids)  # shares at least the first 20 tokens: the engine evaluates only the rest
        from kvprobe.backends.llamacpp import common_prefix

        shared = common_prefix(ids[:20] + [x["token"] for x in first[:2]], ids)
        assert shared >= 20 and second[-1]["engine_reused_tokens"] == shared
        assert second[-1]["engine_evaluated_prompt_tokens"] == len(ids) - shared
        edited = generate([ids[0], 7] + ids[2:])  # a change at position 1 invalidates everything after it
        assert edited[-1]["engine_reused_tokens"] == 1
    finally:
        server.shutdown()
        server.server_close()


def _bench(script, tmp_path, *args):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / script), "--out-dir", str(tmp_path), *args],
                          cwd=repo, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _llama_server_or_skip():
    from kvprobe.backends.llama_server import locate_llama_server
    from kvprobe.errors import KVProbeError

    try:
        return locate_llama_server()
    except KVProbeError as e:
        pytest.skip(str(e))


def test_bench_serve_reads_hit_rates_from_llama_servers_own_counters(tmp_path):
    """Both arms through llama-server (a separate process) on a short policy prefix: the erratum reuses the
    cached prefix and the in-prefix edit (field at the prefix's top) reuses almost nothing, by the server's
    per-response timings, which agree with its /metrics counters; the server is gone afterwards."""
    import json

    _llama_server_or_skip()
    stdout = _bench("serve.py", tmp_path, "--prefix-tokens", "300", "--rates", "50", "--requests", "2",
                    "--max-tokens", "2", "--slots", "2", "--cell-seconds", "300")
    rec = json.loads((tmp_path / "serve_smollm2-135m.json").read_text())
    assert "ratios, same load" in stdout and rec["server"]["kind"] == "llama-server"
    assert rec["server"]["argv"][rec["server"]["argv"].index("--host") + 1] == "127.0.0.1"
    assert rec["server"]["argv"][rec["server"]["argv"].index("-t") + 1] == "1"
    (size,) = rec["sizes"]
    cells = {(c["arm"], c["rate"]): c for c in size["cells"]}
    assert set(cells) == {(a, r) for a in ("erratum", "in_prefix_edit") for r in (50.0, None)}
    for c in cells.values():
        assert c["done"] == c["sent"] == 2 and c["hit_source"].startswith("llama-server timings")
        assert c["reused_tokens"] + c["evaluated_tokens"] == c["prompt_tokens"]
        assert c["metrics"]["reused_tokens"] == c["reused_tokens"]  # /metrics counts what the responses said
        assert c["metrics"]["queried_tokens"] == c["prompt_tokens"]
    # every slot was warmed (pinned by id_slot); which slot then takes a request is the server's choice
    assert all(cells[("erratum", r)]["hit_rate"] > 0.8 for r in (50.0, None)), [
        (k, c["hit_rate"], c.get("slots_used")) for k, c in cells.items()]
    assert all(cells[("in_prefix_edit", r)]["hit_rate"] < 0.1 for r in (50.0, None))


def test_llama_server_binds_loopback_and_is_stopped_on_error():
    from kvprobe.backends.llama_server import LlamaServer
    from kvprobe.models.gguf_export import gguf_path

    binary = _llama_server_or_skip()
    srv = LlamaServer(binary, gguf_path("smollm2-135m"), n_parallel=1, ctx_per_slot=256)
    with pytest.raises(RuntimeError, match="boom"):
        with srv:
            proc = srv._proc
            assert srv.running and srv.get("/health")[0] == 200
            assert "127.0.0.1" in proc.args and proc.args[proc.args.index("--host") + 1] == "127.0.0.1"
            raise RuntimeError("boom")
    assert not srv.running and proc.poll() is not None  # the process is gone, not orphaned


def test_bench_serve_baseline_is_labelled_as_kvprobes_own_cache(tmp_path):
    import json

    _bench("serve.py", tmp_path, "--server", "kvprobe-inprocess", "--prefix-tokens", "300", "--rates", "50",
           "--requests", "2", "--max-tokens", "2", "--cell-seconds", "300")
    rec = json.loads((tmp_path / "serve_baseline_smollm2-135m.json").read_text())
    assert rec["benchmark"] == "serve_baseline" and rec["engine"].startswith("BASELINE")
    assert not (tmp_path / "serve_smollm2-135m.json").exists()  # Fig. 14a never draws it
    assert all(c["hit_source"].startswith("baseline: kvprobe") for c in rec["sizes"][0]["cells"])


ORGANISM = "smollm2-135m-gated-v3n2-seed2"  # the recommended smollm2 organism (organisms/registry.yaml)


def test_edit_effect_check_passes_the_edit_and_fails_a_noop_and_a_shifted_edit(template):
    """On the recommended organism's F32 GGUF (exported on demand), the third gated instance (seed 0): the
    engine's noise there is ~0.01 nats over batch splits (0 at the check's fixed kernel path), the in-place
    edit moves the decision by ~0.2 nats and the field+erratum edit by ~2 nats in the HF oracle. The correct edit
    matches the oracle's effect; a no-op (effect 0) and a refresh whose keys sit 40 positions off do not."""
    from kvprobe.backends.llamacpp import LlamaCppEngine
    from kvprobe.kv.engine_oracle import OPS, edit_effect, engine_check, judge
    from kvprobe.models.gguf_export import export_organism_gguf
    from kvprobe.models.loading import load_model
    from kvprobe.tasks.gated import generate_instances

    lm = load_model(ORGANISM)
    inst = generate_instances(template, 3, seed=0, n_filler=2)[2]
    with LlamaCppEngine(export_organism_gguf(ORGANISM, "f32"), n_ctx=1024, n_threads=1) as eng:
        row = edit_effect(lm, eng, template, inst)  # noise over batch splits 16, 64 and 512
    assert row["noise_same_path"] == 0.0 and 0 < row["noise"] < 0.05
    assert all(judge([row], op)["judged"] == 1 for op in OPS)  # both effects are well above the noise
    assert engine_check([row], "correct") == "pass"
    assert engine_check([row], "noop") == "fail"
    assert engine_check([row], "shift40") == "fail"
    assert all(judge([row], op, "noop")["verdict"] == "fail" for op in OPS)


def test_bench_ttft_runs_both_backends_and_the_store_tiers(tmp_path):
    import json

    _bench("ttft.py", tmp_path, "--lengths", "96", "192", "--repeats", "1", "--block-tokens", "64")
    rec = json.loads((tmp_path / "ttft_smollm2-135m.json").read_text())
    assert [r["chunk_tokens"] for r in rec["rows"]] == [96, 192]
    for r in rec["rows"]:
        assert r["blocks"] == -(-r["chunk_tokens"] // 64)
        assert r["hf_cos"] > 0.99 and r["hf_cos_cold"] == pytest.approx(r["hf_cos"], abs=1e-6)  # same bytes
        assert r["engine_cos"] > COS_VS_SELF and r["engine_transplant_decoded"] == rec["head_tokens"] + 1 + rec["suffix_tokens"]
        assert r["hf_full_s"] > 0 and r["engine_full_s"] > 0
    assert set(rec["growth_exponent"]) >= {"hf_full_s", "hf_warm_s", "hf_cold_s", "engine_full_s",
                                           "engine_transplant_s"}


def test_organism_gguf_holds_the_merged_weights(ids):
    """gguf_path(organism): the base GGUF with the peft-merged tensors written in (the server's flavour), built
    into the kvprobe cache; llama.cpp on it answers as the HF organism does (same argmax, cosine >= 0.999), and
    the organism's file is not the base's."""
    import torch

    from kvprobe.backends.llamacpp import LlamaCppEngine
    from kvprobe.cache_dir import cache_root
    from kvprobe.models.gguf_export import gguf_path
    from kvprobe.models.loading import load_model

    path = gguf_path(ORGANISM)
    assert path.is_relative_to(cache_root()) and path != gguf_path("smollm2-135m")
    lm = load_model(ORGANISM)
    with torch.no_grad():
        hf = lm.model(torch.tensor([ids])).logits[0, -1].double().numpy()
    with LlamaCppEngine(path, n_ctx=256, n_threads=1) as eng:
        le = eng.full_reprefill(ids).logits.astype(np.float64)
    with LlamaCppEngine(gguf_path("smollm2-135m"), n_ctx=256, n_threads=1) as eng:
        base = eng.full_reprefill(ids).logits.astype(np.float64)
    cos = float(le @ hf / np.linalg.norm(le) / np.linalg.norm(hf))
    assert cos >= 0.999 and le.argmax() == hf.argmax()
    assert np.abs(le - base).max() > 0.1  # the adapter is in the file

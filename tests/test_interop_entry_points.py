"""Every public entry point that takes a model takes a TransformerLens bridge, an nnsight LanguageModel or a Hugging
Face model (converted once at the boundary) and gives the native LoadedModel's numbers.

Each wrapper gets its own copy of the native tiny model (booting a bridge rewrites its model's modules in place).
"""

from __future__ import annotations

import copy

import pytest

from kvprobe import edit  # the public edits: a wrapper is converted at this boundary
from kvprobe.compose import Live, Spliced, assemble, precompile  # the public compose functions
from kvprobe.models.loading import load_model
from kvprobe.probes import Case
from kvprobe.probes.sweep import KV, sweep
from kvprobe.runner.config import load_config
from kvprobe.runner.experiment import run_experiment
from kvprobe.tasks.gated import generate_instances
from tests.test_interop import boot_bridge

TOL = 1e-4
WRAPPERS = ("hf", "bridge", "nnsight")


@pytest.fixture(scope="module")
def native(tiny_text_dir):
    return load_model(str(tiny_text_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def wrapped(native, tmp_path_factory):
    import nnsight
    from transformers import AutoModelForCausalLM

    saved = tmp_path_factory.mktemp("hf")
    native.model.save_pretrained(saved)
    native.tokenizer.save_pretrained(saved)
    return {"hf": AutoModelForCausalLM.from_pretrained(str(saved)).eval(),  # its tokenizer is found beside it
            "bridge": boot_bridge(copy.deepcopy(native.model), native.tokenizer),
            "nnsight": nnsight.LanguageModel(copy.deepcopy(native.model), tokenizer=native.tokenizer)}


@pytest.fixture(scope="module")
def inst(template):
    return generate_instances(template, 1, seed=0)[0]


@pytest.mark.parametrize("kind", WRAPPERS)
def test_case_build_and_sweep_take_each_wrapper(kind, native, wrapped, inst):
    ref = Case.build(native, inst)
    got = Case.build(wrapped[kind], inst)
    assert got.pair.ids_old == ref.pair.ids_old
    assert got.pp.old.max_abs_diff(ref.pp.old) < TOL and got.pp.new.max_abs_diff(ref.pp.new) < TOL
    assert abs(got.anchor.stale_ld - ref.anchor.stale_ld) < TOL and abs(got.anchor.oracle_ld - ref.anchor.oracle_ld) < TOL
    patches = {"field": KV.of(ref.pp.field_slots), "layer0": KV.of(ref.pp.downstream_slots, layers=[0])}
    want = sweep(native, ref, patches, metric="logit_diff")
    have = sweep(wrapped[kind], ref, patches, metric="logit_diff")
    assert want.keys() == have.keys() and all(abs(have[k] - want[k]) < TOL for k in want)


@pytest.mark.parametrize("kind", WRAPPERS)
def test_edits_and_compose_take_each_wrapper(kind, native, wrapped, inst):
    e = edit.FieldEdit.from_pair(Case.build(native, inst).pp)
    for method in (edit.in_place, edit.full_downstream, edit.full_reprefill):
        assert method(wrapped[kind], e).state.max_abs_diff(method(native, e).state) < TOL
    assert edit.cacheblend(wrapped[kind], e, 0.25).state.max_abs_diff(edit.cacheblend(native, e, 0.25).state) < TOL
    head, chunk, tail = e.ids[:5], e.ids[5:12], e.ids[12:16]

    def composed(lm):
        return assemble(lm, [Live(tuple(head)), Spliced(tuple(chunk), precompile(lm, chunk), seam=2), Live(tuple(tail))])

    assert composed(wrapped[kind]).max_abs_diff(composed(native)) < TOL


def _run_rows(lm, model_dir, out):
    cfg = load_config("configs/locality.yaml", {"model": str(model_dir), "output_dir": str(out),
                                                "task": {"n_instances": 2}})
    _, record = run_experiment(cfg, lm=lm, progress=False)
    return [{k: v for k, v in r.items() if k != "seconds"} for r in record["rows"]]


@pytest.fixture(scope="module")
def native_rows(native, tiny_text_dir, tmp_path_factory):
    return _run_rows(native, tiny_text_dir, tmp_path_factory.mktemp("native"))


@pytest.mark.parametrize("kind", WRAPPERS)
def test_run_experiment_takes_each_wrapper(kind, native_rows, wrapped, tiny_text_dir, tmp_path):
    have = _run_rows(wrapped[kind], tiny_text_dir, tmp_path)
    assert len(have) == len(native_rows) == 2
    for a, b in zip(have, native_rows):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], float):
                assert abs(a[k] - b[k]) < TOL, k
            else:
                assert a[k] == b[k], k

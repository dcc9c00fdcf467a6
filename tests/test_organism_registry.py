"""The organism registry (organisms/registry.yaml) against the cards, the committed records and the git history."""

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvprobe.errors import KVProbeError
from kvprobe.models import organisms as orgreg

REPO = Path(__file__).resolve().parents[1]
ORGS = REPO / "organisms"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


@pytest.fixture(scope="module")
def reg() -> orgreg.Registry:
    return orgreg.load_registry(ORGS)


def _tracked(*paths: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", *paths], cwd=REPO, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def _git_available() -> bool:
    return shutil.which("git") is not None and (REPO / ".git").exists()


needs_git = pytest.mark.skipif(not _git_available(), reason="not a git checkout: the history adapters live in git")


@pytest.fixture(scope="module")
def history_blobs(reg) -> dict[str, bytes]:
    """Every organism's adapter bytes at the commit the registry names (one `git cat-file --batch`)."""
    if not _git_available():
        pytest.skip("not a git checkout")
    aliases = list(reg.organisms)
    query = "".join(f"{reg.organisms[a].git.commit}:{reg.organisms[a].git.path}\n" for a in aliases).encode()
    out = subprocess.run(["git", "cat-file", "--batch"], cwd=REPO, input=query, capture_output=True, check=True).stdout
    blobs, pos = {}, 0
    for alias in aliases:
        header_end = out.index(b"\n", pos)
        header = out[pos:header_end].decode()
        assert not header.endswith("missing"), f"{alias}: {header} (the registry's git.commit / git.path)"
        size = int(header.split()[2])
        blobs[alias] = out[header_end + 1:header_end + 1 + size]
        pos = header_end + 1 + size + 1
    return blobs


def test_exactly_one_recommended_organism_per_family(reg):
    assert reg.recommended() == {"llama": "smollm2-135m-gated-v3n2-seed2", "qwen2": "qwen2.5-coder-0.5b-gated-v3-cal2"}
    assert {o.status for a, o in reg.organisms.items() if a not in reg.recommended().values()} == {"history"}


def test_the_schema_refuses_extra_keys_two_recommended_and_an_unknown_lineage(tmp_path, reg):
    raw = yaml.safe_load((ORGS / "registry.yaml").read_text())
    good = raw["smollm2-135m-gated-v3n2-seed2"]
    cases = {
        "extra key": {"smollm2-135m-gated-v3n2-seed2": {**good, "notes": "x"}},
        "two recommended": {"smollm2-135m-gated-v3n2-seed2": good, "b": {**good, "lineage": None}},
        "no recommended": {"smollm2-135m-gated-v3n2-seed2": {**good, "status": "history", "lineage": None}},
        "unknown lineage": {"smollm2-135m-gated-v3n2-seed2": good},
        "short commit": {"smollm2-135m-gated-v3n2-seed2": {**good, "lineage": None,
                                                           "git": {**good["git"], "commit": "dba7836"}}},
    }
    messages = {"extra key": "Extra inputs", "two recommended": "2 recommended",
                "no recommended": "0 recommended", "unknown lineage": "is not an organism",
                "short commit": "40-hex"}
    for name, data in cases.items():
        (tmp_path / "registry.yaml").write_text(yaml.safe_dump(data))
        with pytest.raises(KVProbeError, match=messages[name]):
            orgreg.load_registry(tmp_path)


def test_every_organism_folder_is_registered_and_its_card_agrees(reg):
    from kvprobe.models.registry import REGISTRY

    folders = {p.parent.name for p in ORGS.glob("*/card.json")}
    assert folders == set(reg.organisms), "organisms/ folders and registry entries differ"
    for alias, o in reg.organisms.items():
        card = json.loads((ORGS / o.card).read_text())
        assert o.card == f"{alias}/card.json" and card["alias"] == alias
        assert card["base_model"] == o.base_model and REGISTRY[o.base_model].family == o.family
        assert card["recipe"].get("init_from") == o.lineage, f"{alias}: lineage differs from the card's init_from"
        assert card["recipe"]["seed"] == o.seed
        cfg = (ORGS / alias / "adapter_config.json").read_bytes()
        assert hashlib.sha256(cfg).hexdigest() == o.adapter_config_sha256, alias
    # a lineage is acyclic and stays within one base model
    for alias in reg.organisms:
        chain = reg.ancestors(alias)
        assert alias not in chain and len(set(chain)) == len(chain)


def test_every_organism_a_record_uses_is_registered_with_exactly_its_records(reg):
    from kvprobe.models.registry import REGISTRY

    found = orgreg.records_by_model(REPO / "results")
    organisms = {m for m in found if m not in REGISTRY or REGISTRY[m].kind == "organism"}
    missing = sorted(organisms - set(reg.organisms))
    assert not missing, f"records use organisms the registry lacks: {missing}"
    for alias, o in reg.organisms.items():
        assert o.records == found.get(alias, []), (f"{alias}: the registry's records differ from results/: run "
                                                   "`kvprobe organism registry --sync`")


def test_weights_live_only_in_the_recommended_folders_and_never_under_the_package(reg):
    tracked = _tracked() if _git_available() else [str(p.relative_to(REPO)) for p in REPO.rglob("*")]
    under_package = [p for p in tracked if p.startswith("kvprobe/") and p.endswith(WEIGHT_SUFFIXES)]
    assert not under_package, f"model weights under kvprobe/: {under_package}"
    weights = sorted(p for p in tracked if p.startswith("organisms/") and p.endswith(WEIGHT_SUFFIXES))
    assert weights == sorted(f"organisms/{a}/{orgreg.ADAPTER_FILE}" for a in reg.recommended().values())
    for alias in reg.recommended().values():
        data = (ORGS / alias / orgreg.ADAPTER_FILE).read_bytes()
        assert hashlib.sha256(data).hexdigest() == reg.organisms[alias].adapter_sha256


@needs_git
def test_each_registry_sha256_is_the_adapter_git_holds_at_the_named_commit(reg, history_blobs):
    for alias, o in reg.organisms.items():
        assert hashlib.sha256(history_blobs[alias]).hexdigest() == o.adapter_sha256, alias
        # the named commit is the last one that added or changed the adapter at that path (later ones moved it)
        last = subprocess.run(["git", "log", "-1", "--format=%H", "--diff-filter=AM", "--", o.git.path], cwd=REPO,
                              capture_output=True, check=True, text=True).stdout.strip()
        assert last == o.git.commit, alias


@needs_git
def test_every_committed_record_of_an_organism_has_the_fingerprint_of_the_registered_adapter(reg, history_blobs,
                                                                                            tmp_path):
    """Each record's model fingerprint is recomputed from the card's base fingerprint and the adapter bytes
    git holds (no model is loaded); each base model's records carry the base fingerprint the cards name."""
    from kvprobe.models.loading import organism_fingerprint

    base_fps: dict[str, set[str]] = {}
    for alias, o in reg.organisms.items():
        card = json.loads((ORGS / o.card).read_text())
        base_fps.setdefault(o.base_model, set()).add(card["base_fingerprint"])
        if not o.records:
            continue
        folder = tmp_path / alias
        folder.mkdir()
        (folder / "adapter_config.json").write_bytes((ORGS / alias / "adapter_config.json").read_bytes())
        (folder / orgreg.ADAPTER_FILE).write_bytes(history_blobs[alias])
        expected = organism_fingerprint(card["base_fingerprint"], folder)
        for rec in o.records:
            got = json.loads((REPO / rec).read_text())["model"]["fingerprint"]
            assert got == expected, f"{rec}: fingerprint {got}, the registered adapter gives {expected}"
    found = orgreg.records_by_model(REPO / "results")
    for base, fps in base_fps.items():
        assert len(fps) == 1, f"organisms of {base} name several base fingerprints: {fps}"
        for rec in found.get(base, []):
            assert json.loads((REPO / rec).read_text())["model"]["fingerprint"] in fps, rec


def _one_entry_registry(tmp_path: Path, reg, alias: str, **changes) -> Path:
    root = tmp_path / "organisms"
    (root / alias).mkdir(parents=True)
    for name in ("card.json", "adapter_config.json"):
        shutil.copy(ORGS / alias / name, root / alias / name)
    o = reg.organisms[alias].model_copy(update={"lineage": None, "status": "recommended", **changes})
    orgreg.write_registry(orgreg.Registry(organisms={alias: o}), root)
    return root


@needs_git
def test_restore_brings_a_history_adapter_back_verified_and_refuses_a_wrong_sha(tmp_path, reg, history_blobs):
    alias = "smollm2-135m-gated-v2"
    assert reg.organisms[alias].status == "history" and not orgreg.adapter_present(alias)
    root = _one_entry_registry(tmp_path / "a", reg, alias)
    path = orgreg.restore(alias, root=root, repo=REPO)
    assert path.read_bytes() == history_blobs[alias]
    assert orgreg.restore(alias, root=root, repo=REPO) == path  # already there and intact: nothing to do
    path.write_bytes(b"tampered")
    with pytest.raises(KVProbeError, match="sha256 differs"):
        orgreg.restore(alias, root=root, repo=REPO)
    wrong = _one_entry_registry(tmp_path / "b", reg, alias, adapter_sha256="0" * 64)
    with pytest.raises(KVProbeError, match="the registry entry of smollm2-135m-gated-v2 is wrong"):
        orgreg.restore(alias, root=wrong, repo=REPO)
    assert not (wrong / alias / orgreg.ADAPTER_FILE).exists()  # nothing unverified is left behind
    with pytest.raises(KVProbeError, match="is not in organisms/registry.yaml"):
        orgreg.restore("no-such-organism", root=root, repo=REPO)


def test_a_restored_history_adapter_is_ignored_by_git():
    if not _git_available():
        pytest.skip("not a git checkout")
    path = "organisms/smollm2-135m-gated-v2/adapter_model.safetensors"
    assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0


def test_loading_an_unrestored_history_organism_names_the_restore_command(reg):
    from kvprobe.models.loading import load_model

    alias = next(a for a, o in reg.organisms.items() if o.status == "history" and not orgreg.adapter_present(a))
    with pytest.raises(KVProbeError) as err:
        load_model(alias, device="cpu")
    assert f"`kvprobe organism restore {alias}`" in str(err.value) and str(err.value).count("\n") == 0


def test_the_models_listing_and_the_registry_command_read_the_registry(capsys):
    from kvprobe.app.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("smollm2-135m-gated",
                                                                                          "qwen2.5-coder-0.5b-gated"))}
    assert rows["smollm2-135m-gated-v3n2-seed2"][1:4] == ["llama", "recommended", "here"]
    assert rows["qwen2.5-coder-0.5b-gated-v3-cal2"][1:4] == ["qwen2", "recommended", "here"]
    assert rows["smollm2-135m-gated-v2"][1:3] == ["llama", "history"]
    assert main(["organism", "registry", "--check"]) == 0
    capsys.readouterr()
    assert main(["organism", "registry", "--recommended"]) == 0
    assert "smollm2-135m-gated-v2 " not in capsys.readouterr().out


def test_a_sealed_test_draw_refuses_a_dirty_tree_and_a_second_scoring_and_validate_refuses_test(capsys):
    from organisms.tooling.draws import TEST_DRAWS, check_may_score
    from kvprobe.app.cli import main

    sealed = [n for n, d in TEST_DRAWS.items() if d.sealed]
    assert sealed and all(TEST_DRAWS[n].pairs for n in sealed)  # a sealed draw's size is fixed in advance
    name = sealed[0]
    assert check_may_score(name, ["a"], [], dirty=False) is TEST_DRAWS[name]
    with pytest.raises(KVProbeError, match="clean working tree"):
        check_may_score(name, ["a"], [], dirty=True)
    log = [{"draw": name, "aliases": ["a"], "git_commit": "f" * 40, "scored_at": "2026-01-01T00:00:00+00:00"}]
    with pytest.raises(KVProbeError, match="scored once"):
        check_may_score(name, ["b", "a"], log, dirty=False)
    assert check_may_score(name, ["b"], log, dirty=False) is TEST_DRAWS[name]  # another organism: its one scoring
    assert check_may_score("v2", ["a"], [{**log[0], "draw": "v2"}], dirty=True).sealed is False  # logged, not sealed
    with pytest.raises(KVProbeError, match="--draw nope"):
        check_may_score("nope", ["a"], [], dirty=False)
    assert main(["organism", "validate", "smollm2-135m-gated-v3n2-seed2", "--split", "test"]) == 2
    assert "kvprobe organism test ALIAS --draw NAME" in capsys.readouterr().err


def test_the_sealed_word_list_holds_only_new_test_words():
    """Every test-split word and rule phrasing of the sealed list is absent from every earlier list."""
    from organisms.tooling.draws import TEST_DRAWS
    from kvprobe.tasks.generator import WORDS_FILE, check_splits, load_words, split_words

    sealed = load_words(REPO / TEST_DRAWS["sealed-1"].words)
    check_splits(sealed)
    earlier = [load_words(WORDS_FILE.with_name(n)) for n in
               ("scenario_words.yaml", "scenario_words_v2.yaml", "scenario_words_v3.yaml")]
    for kind in ("subjects", "attributes", "value_pairs", "action_pairs", "rules"):
        old = {w for words in earlier for split in ("train", "validation", "test")
               for e in split_words(words, kind, split) for w in (e if isinstance(e, tuple) else (e,))}
        new = {w for e in split_words(sealed, kind, "test") for w in (e if isinstance(e, tuple) else (e,))}
        assert new and not new & old, (kind, sorted(new & old))

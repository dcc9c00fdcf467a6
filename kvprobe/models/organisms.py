"""The organism registry: ``organisms/registry.yaml`` at the top level of a checkout, one entry per organism.

An organism is a base model + a LoRA adapter merged at load. Each has a folder ``organisms/<alias>/`` holding
``card.json`` (recipe, data hashes, held-out evaluation) and ``adapter_config.json``. The weights
(``adapter_model.safetensors``) are in the working tree only for the ``recommended`` organisms (one per
family); a ``history`` organism's weights stay in git, at the commit the registry names, and
``kvprobe organism restore ALIAS`` writes them back (checked against the registry's sha256).

Organism names never change: they are part of record keys and config hashes.

It lives with the model registry (:mod:`kvprobe.models.registry` registers each organism as an alias from it);
this module imports no other part of :mod:`kvprobe.models`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from collections import Counter
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from kvprobe.errors import KVProbeError

ADAPTER_FILE = "adapter_model.safetensors"
REGISTRY_FILE = "registry.yaml"
RESTORE_HINT = "kvprobe organism restore {alias}"


def _installed_organisms() -> Path | None:
    """The organisms folder an installed companion distribution provides (``kvprobe-organisms``, built from a
    checkout's ``organisms/``: the recommended organisms and the registry), found by its entry point."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="kvprobe.organisms"):
        try:
            root = Path(ep.load()())
        except Exception:  # a broken companion must not break kvprobe: it is simply not used
            continue
        if (root / REGISTRY_FILE).exists():
            return root
    return None


def _organisms_root() -> Path:
    """``$KVPROBE_ORGANISMS`` if set; else the checkout's ``organisms/`` (editable install); else
    ``./organisms`` when it holds a registry (an installed wheel run from a checkout); else the installed
    ``kvprobe-organisms`` distribution (an installed wheel anywhere: ``make install`` installs it)."""
    env = os.environ.get("KVPROBE_ORGANISMS")
    if env:
        return Path(env).expanduser()
    checkout = Path(__file__).resolve().parents[2] / "organisms"
    if (checkout / REGISTRY_FILE).exists():
        return checkout
    here = Path.cwd() / "organisms"
    if (here / REGISTRY_FILE).exists():
        return here
    return _installed_organisms() or checkout


# Read at call time everywhere (tests point it at a temporary folder).
ORGANISMS_DIR = _organisms_root()


class GitSource(BaseModel):
    """Where git holds the adapter weights: the commit that last changed them, and their path there."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    commit: str
    path: str

    @model_validator(mode="after")
    def _full_hash(self) -> "GitSource":
        if len(self.commit) != 40 or any(c not in "0123456789abcdef" for c in self.commit):
            raise ValueError(f"git.commit '{self.commit}' must be a full 40-hex commit hash")
        return self


class Organism(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    base_model: str
    family: str  # the base model's architecture family (llama: SmolLM2; qwen2: Qwen2.5)
    lineage: str | None  # the organism whose adapter initialized this one (card recipe.init_from); None: fresh
    recipe: str  # the recipe's short name; its seeds share it
    seed: int
    purpose: str  # one line: what this recipe was trained to test
    status: Literal["recommended", "history"]
    adapter_sha256: str  # sha256 of adapter_model.safetensors
    adapter_config_sha256: str  # sha256 of adapter_config.json (the organism fingerprint hashes both)
    card: str  # relative to the organisms folder
    git: GitSource
    records: list[str]  # results/ paths whose config.model is this alias


class Registry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    organisms: dict[str, Organism]

    @model_validator(mode="after")
    def _consistent(self) -> "Registry":
        per_family = Counter(o.family for o in self.organisms.values() if o.status == "recommended")
        for family in sorted({o.family for o in self.organisms.values()}):
            if per_family[family] != 1:
                raise ValueError(f"family {family} has {per_family[family]} recommended organisms; exactly one "
                                 "must be `status: recommended` (every other one `history`)")
        for alias, o in self.organisms.items():
            if o.lineage is not None and o.lineage not in self.organisms:
                raise ValueError(f"{alias}: lineage {o.lineage} is not an organism of this registry")
            if o.lineage is not None and self.organisms[o.lineage].base_model != o.base_model:
                raise ValueError(f"{alias}: lineage {o.lineage} has another base model")
        return self

    def recommended(self) -> dict[str, str]:
        """family -> its recommended alias."""
        return {o.family: a for a, o in self.organisms.items() if o.status == "recommended"}

    def ancestors(self, alias: str) -> list[str]:
        """The lineage chain of ``alias``, nearest first."""
        chain, cur = [], self.organisms[alias].lineage
        while cur is not None:
            chain.append(cur)
            cur = self.organisms[cur].lineage
        return chain


def registry_path(root: Path | None = None) -> Path:
    return (root or ORGANISMS_DIR) / REGISTRY_FILE


@functools.lru_cache(maxsize=8)
def _load(path: Path, text: str) -> Registry:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KVProbeError(f"{path.name}: not valid YAML ({exc})") from exc
    try:
        return Registry(organisms=raw or {})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"][1:]) or "(top level)"
        raise KVProbeError(f"organisms/{path.name}: {where}: {err['msg']} (fix that entry; the schema is "
                           "kvprobe.models.organisms.Organism)") from exc


def load_registry(root: Path | None = None) -> Registry:
    """The validated registry; an empty one where this installation has no ``organisms/`` folder (a wheel)."""
    path = registry_path(root)
    if not path.exists():
        return Registry(organisms={})
    return _load(path, path.read_text())  # parsed once per content


def organism_folder_of(alias: str, root: Path | None = None) -> Path:
    return (root or ORGANISMS_DIR) / alias


def adapter_present(alias: str, root: Path | None = None) -> bool:
    return (organism_folder_of(alias, root) / ADAPTER_FILE).exists()


def require_adapter(alias: str, folder: Path) -> None:
    """Raise one clear error when an organism's weights are not in its folder (a history organism)."""
    if (folder / ADAPTER_FILE).exists():
        return
    entry = load_registry().organisms.get(alias)
    if entry is not None and entry.status == "history":
        raise KVProbeError(f"organism '{alias}' is a history organism: its adapter weights are kept in git, not in "
                           f"the working tree. Restore them with `{RESTORE_HINT.format(alias=alias)}` (checked "
                           "against the registry's sha256), then load it again")
    raise KVProbeError(f"organism '{alias}' has no {ADAPTER_FILE} in organisms/{alias}/: retrain it with "
                       "`kvprobe organism train`" + (f" or `{RESTORE_HINT.format(alias=alias)}`" if entry else ""))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def git_blob(commit: str, path: str, repo: Path | None = None) -> bytes:
    """The bytes of ``path`` at ``commit`` (``git show commit:path``) in the checkout holding the organisms."""
    cwd = repo or ORGANISMS_DIR.parent
    try:
        out = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=cwd, capture_output=True, check=True)
    except FileNotFoundError as exc:
        raise KVProbeError("git is not installed: restoring a history organism reads it from the git history") from exc
    except subprocess.CalledProcessError as exc:
        msg = exc.stderr.decode(errors="replace").strip().splitlines()
        raise KVProbeError(f"git cannot read {path} at {commit[:12]} ({msg[0] if msg else 'no output'}): restore needs "
                           "a full clone of kvprobe (not a shallow one: `git fetch --unshallow`)") from exc
    return out.stdout


def restore(alias: str, root: Path | None = None, repo: Path | None = None) -> Path:
    """Write a history organism's adapter weights from git into ``organisms/<alias>/``, verified by sha256.

    The restored file is ignored by git (``.gitignore``): history weights enter the tree once, in the commit
    the registry names, and never again."""
    reg = load_registry(root)
    entry = reg.organisms.get(alias)
    if entry is None:
        from kvprobe.errors import closest

        raise KVProbeError(f"'{alias}' is not in organisms/{REGISTRY_FILE}{closest(alias, reg.organisms)}: "
                           "`kvprobe models` lists the organisms")
    target = organism_folder_of(alias, root) / ADAPTER_FILE
    if target.exists():
        if sha256_bytes(target.read_bytes()) != entry.adapter_sha256:
            raise KVProbeError(f"organisms/{alias}/{ADAPTER_FILE} exists but its sha256 differs from the registry's: "
                               "delete it and restore again")
        return target
    data = git_blob(entry.git.commit, entry.git.path, repo or (root or ORGANISMS_DIR).parent)
    got = sha256_bytes(data)
    if got != entry.adapter_sha256:
        raise KVProbeError(f"{entry.git.path} at {entry.git.commit[:12]} has sha256 {got[:16]}..., the registry says "
                           f"{entry.adapter_sha256[:16]}...: the registry entry of {alias} is wrong")
    tmp = target.with_suffix(".partial")
    tmp.write_bytes(data)
    tmp.replace(target)
    return target


def records_by_model(results: Path) -> dict[str, list[str]]:
    """model alias -> the record paths (relative to the results folder's parent) whose ``config.model`` it is."""
    import json

    out: dict[str, list[str]] = {}
    for p in sorted(results.rglob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        model = data.get("config", {}).get("model") if isinstance(data, dict) else None
        if isinstance(model, str):
            out.setdefault(model, []).append(p.relative_to(results.parent).as_posix())
    return out


_HEADER = """\
# kvprobe's organisms: a base model + a LoRA adapter, merged at load (`kvprobe.load_model(alias)`).
# Validated by kvprobe.models.organisms (pydantic, extra keys refused); tests/test_organism_registry.py checks it
# against the cards, the committed records and the git history.
#
# status: exactly one `recommended` organism per family, the one the study's results are about: the recipe the
#   pre-registered choosing rule kept (RESULTS.md), at the seed its probe suite ran on. Its adapter is in the
#   tree. Every other organism is `history`: its weights are in git at `git.commit` / `git.path`, and
#   `kvprobe organism restore ALIAS` brings them back into organisms/ALIAS/ (sha256-checked, git-ignored).
# lineage: the organism whose adapter initialized this one (the card's recipe.init_from); a continued
#   organism's adapter is complete on its own (loading never needs its ancestors; training a continuation does).
# records: results/ files whose config.model is this alias (`kvprobe organism registry --sync` rewrites them).
# Rewritten by that command: edit the other fields by hand, keep this layout.
# Organism names never change: they are part of record keys and config hashes.
"""


def write_registry(reg: Registry, root: Path | None = None) -> Path:
    path = registry_path(root)
    body = "\n".join(yaml.safe_dump({a: o.model_dump()}, sort_keys=False, width=118, allow_unicode=True)
                     for a, o in reg.organisms.items())  # a blank line between organisms
    tmp = path.with_suffix(".tmp")
    tmp.write_text(_HEADER + "\n" + body)
    tmp.replace(path)
    return path


def sync_records(results: Path, root: Path | None = None) -> tuple[Registry, list[str]]:
    """The registry with each organism's ``records`` rebuilt from ``results``; also the aliases that changed."""
    reg = load_registry(root)
    found = records_by_model(results)
    changed, organisms = [], {}
    for alias, o in reg.organisms.items():
        recs = found.get(alias, [])
        if recs != o.records:
            changed.append(alias)
        organisms[alias] = o.model_copy(update={"records": recs})
    return Registry(organisms=organisms), changed


def organisms_table(history: bool = True, root: Path | None = None) -> str:
    """The registry as a plain-text table: recommended first, then history (one row per organism)."""
    reg = load_registry(root)
    if not reg.organisms:
        return (f"no organism registry here ({REGISTRY_FILE} lives in the organisms/ folder of a kvprobe checkout: "
                "install the recommended organisms with `pip install kvprobe-organisms` built from it (`make install` "
                "does), or set KVPROBE_ORGANISMS to point at one)")
    rows = [(a, o) for a, o in reg.organisms.items() if history or o.status == "recommended"]
    rows.sort(key=lambda r: (r[1].status != "recommended", r[1].family, r[0]))
    w = max(len(a) for a, _ in rows) + 2
    lines = [f"{'organism':<{w}}{'family':<8}{'status':<13}{'adapter':<30}lineage"]
    for alias, o in rows:
        here = "here" if adapter_present(alias, root) else "in git (organism restore)"
        lines.append(f"{alias:<{w}}{o.family:<8}{o.status:<13}{here:<30}{o.lineage or '(base model)'}")
    n_hist = sum(o.status == "history" for o in reg.organisms.values())
    lines.append(f"\n{len(reg.organisms)} organisms in organisms/{REGISTRY_FILE} ({n_hist} history). A history "
                 f"organism loads after `{RESTORE_HINT.format(alias='ALIAS')}`.")
    return "\n".join(lines)

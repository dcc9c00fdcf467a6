"""The paper's sections, in its order; each experiment names its own (``Experiment(section=KEY)``).

Nothing here lists experiments: the order of the generated pages, of the claims summary and of the claims figure
is read from the experiments' declarations (section, then ``section_order``, then name). A new experiment in an
existing section adds no line here; a new section adds one :class:`Section`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Section:
    key: str  # what an experiment declares: Experiment(section="sec3")
    label: str  # where it is in the paper, short ("§3", "App. C")
    title: str  # the heading


SECTIONS: tuple[Section, ...] = (
    Section("sec3", "§3", "§3 Where the field's effect lives: locality, suffix, knockout, probes"),
    Section("sec4", "§4", "§4 Editing: chain of thought and the erratum's wording"),
    Section("sec5", "§5", "§5 Composing: transplanting a precompiled skill"),
    Section("appC", "App. C", "App. C Mechanism controls: dissociation, timing, specificity, writability"),
    Section("appD", "App. D", "App. D The circuit: heads, write share, scrubbing, directions, SAE features"),
    Section("appE", "App. E", "App. E Editing: the baseline frontier and the K-sweep"),
    Section("sec6", "§6", "§6 Edit and compose together: editing inside a transplant, the unified agent"),
    Section("screen", "App. H", "The competence screen: which study model decides each application task (App. H's gate)"),
    Section("sec7", "§7", "§7 User memory and LoCoMo"),
    Section("sec9", "§9, Tab. 1", "§9 and Tab. 1: the real τ² retail policy, and weight editing against the KV edit"),
    Section("appG", "App. G", "App. G Long-horizon robustness, and two-hop facts across blocks"),
)
BY_KEY = {s.key: s for s in SECTIONS}


def section(key: str) -> Section:
    """A section by key; a key no section has (a plugin's own) is a section of its own, after the paper's."""
    return BY_KEY.get(key) or Section(key, key, key)


def _rank(key: str) -> tuple[int, str]:
    keys = list(BY_KEY)
    return (keys.index(key), "") if key in BY_KEY else (len(keys), key)


def experiments_by_section() -> dict[str, list[str]]:
    """Section key -> its experiments, both in order: the paper's sections first (an experiment without a section
    comes last, under the key "")."""
    from kvprobe.runner.experiment import available_experiments, get_experiment

    experiments = {name: get_experiment(name) for name in available_experiments()}
    declared = [(e.section, e.section_order, name) for name, e in experiments.items()]
    out: dict[str, list[str]] = {}
    for key, _, name in sorted(declared, key=lambda d: (d[0] == "", _rank(d[0]), d[1], d[2])):
        out.setdefault(key, []).append(name)
    return out


def experiment_order() -> tuple[str, ...]:
    """Every experiment, in section order."""
    return tuple(name for names in experiments_by_section().values() for name in names)


def experiments_in(key: str) -> tuple[str, ...]:
    """The experiments of one section, in order (empty for a key no experiment declares)."""
    return tuple(experiments_by_section().get(key, ()))

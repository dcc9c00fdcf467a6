"""The organism selection study's tooling: how the recommended organisms were chosen. Not part of kvprobe (the
library trains, registers, restores and loads organisms); it lives beside the organisms it scores, in a checkout.

- :mod:`organisms.tooling.seeds`: the spread over training seeds of one recipe (stored in the first card);
- :mod:`organisms.tooling.validation`: the larger validation draws, paired recipe differences, the
  pre-registered choosing rule and the history tables;
- :mod:`organisms.tooling.draws`: the logged test draws, a sealed one scored once per organism;
- :mod:`organisms.tooling.cli`: their commands (``python -m organisms.tooling --help``; in a checkout also
  ``kvprobe organism seeds|validate|compare|choose|agreement|test``);
- :mod:`organisms.tooling.blocks`: the tables of ``docs/history/organisms.md`` as ``kvprobe report`` blocks.

kvprobe finds this package through :func:`kvprobe.organism.selection.tooling`; nothing in kvprobe imports it by
name, and the kvprobe and kvprobe-organisms wheels do not ship it.
"""

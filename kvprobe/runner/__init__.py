"""The run core: config schema, the Experiment contract and run loop, records, reproduction checks, sections.

It imports none of the application (:mod:`kvprobe.app`: CLI, report, pages), the figures, the claims, the study,
the organisms or the features; experiments are loaded by name (:mod:`kvprobe.runner.experiment`)."""

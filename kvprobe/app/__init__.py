"""The application shell on top of kvprobe: the ``kvprobe`` command line (:mod:`kvprobe.app.cli` and the
commands it registers, :mod:`kvprobe.app.commands`), the generated report blocks (:mod:`kvprobe.app.report`),
the result pages (:mod:`kvprobe.app.pages`) and the ``kvprobe claims`` command (:mod:`kvprobe.app.claims_cli`).

Nothing below imports this package. It finds per-experiment facts (sections, figures, claims) in the experiments'
declarations instead of listing them. Importing it registers the pages' generated block (``claims_summary``)."""

from kvprobe.app import pages as _pages  # noqa: F401  (registers its report block)

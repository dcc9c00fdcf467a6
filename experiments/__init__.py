"""One module per probe or capability; each defines ``EXPERIMENT`` (see kvprobe.runner.experiment)."""

"""Config schema, experiment registry, record writer and the ``kvprobe`` CLI."""

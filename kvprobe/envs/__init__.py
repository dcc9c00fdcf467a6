"""Real environments used as they are (τ²-bench retail: :mod:`kvprobe.envs.tau2_retail`)."""

from kvprobe.stats.bootstrap import bootstrap_ci, cluster_bootstrap_ci, summarize

__all__ = ["bootstrap_ci", "cluster_bootstrap_ci", "summarize"]

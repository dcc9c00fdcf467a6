"""Statistics through statsmodels/scipy: cluster bootstrap, exact proportions, TOST, McNemar, GEE, BH-FDR,
power (see kvprobe.stats.inference)."""

from kvprobe.stats.bootstrap import bootstrap_ci, cluster_bootstrap_ci, cluster_means, summarize
from kvprobe.stats.inference import (bh_fdr, binom_at_least, binom_at_most, gee_binomial, mcnemar_exact,
                                     n_binom_bound, n_mcnemar, n_paired_t, power_binom_bound, power_mcnemar,
                                     power_paired_t, proportion_ci, sign_test, summarize_proportion,
                                     tost_paired)

__all__ = ["bh_fdr", "binom_at_least", "binom_at_most", "bootstrap_ci", "cluster_bootstrap_ci", "cluster_means",
           "gee_binomial",
           "mcnemar_exact", "n_binom_bound", "n_mcnemar", "n_paired_t", "power_binom_bound", "power_mcnemar",
           "power_paired_t", "proportion_ci", "sign_test", "summarize", "summarize_proportion", "tost_paired"]

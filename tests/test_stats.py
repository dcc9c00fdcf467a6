"""kvprobe.stats wrappers agree with direct statsmodels/scipy calls, and the cluster bootstrap behaves."""

from __future__ import annotations

import numpy as np
import pytest

from kvprobe.stats import (bh_fdr, binom_at_least, cluster_bootstrap_ci, gee_binomial, mcnemar_exact, n_binom_bound,
                           n_mcnemar, n_paired_t, proportion_ci, summarize, summarize_proportion, tost_paired)


def test_clopper_pearson_of_zero_in_twelve_is_not_zero_width():
    lo, hi = proportion_ci(0, 12)
    assert lo == 0.0 and hi == pytest.approx(0.2646, abs=1e-3)
    s = summarize_proportion([False] * 12)
    assert s["mean"] == 0.0 and s["ci_high"] == pytest.approx(hi) and s["k"] == 0 and s["n"] == 12


def test_proportion_ci_matches_statsmodels():
    from statsmodels.stats.proportion import proportion_confint

    for k, n in [(3, 12), (12, 12), (7, 40)]:
        assert proportion_ci(k, n) == pytest.approx(proportion_confint(k, n, alpha=0.05, method="beta"))
        assert proportion_ci(k, n, method="wilson") == pytest.approx(proportion_confint(k, n, method="wilson"))


def test_cluster_bootstrap_widens_when_clusters_are_correlated():
    rng = np.random.default_rng(1)
    cluster_means = rng.normal(0, 1, size=8)
    values = np.repeat(cluster_means, 10) + rng.normal(0, 0.01, size=80)  # ten near-copies per cluster
    clusters = np.repeat(np.arange(8), 10)
    _, lo_c, hi_c = cluster_bootstrap_ci(values, clusters, seed=0)
    _, lo_i, hi_i = cluster_bootstrap_ci(values, np.arange(80), seed=0)  # each value its own cluster
    assert (hi_c - lo_c) > 2 * (hi_i - lo_i)
    # with independent values the two agree closely: the widening comes from the correlation
    iid = rng.normal(0, 1, size=80)
    _, a, b = cluster_bootstrap_ci(iid, np.repeat(np.arange(40), 2), seed=0)
    _, c, d = cluster_bootstrap_ci(iid, np.arange(80), seed=0)
    assert (b - a) == pytest.approx(d - c, rel=0.3)


def test_summarize_clusters_and_gives_no_interval_over_one_cluster():
    s = summarize([0.1, 0.2, 0.3, 0.4], clusters=["a", "a", "b", "b"])
    assert s["n"] == 4 and s["n_clusters"] == 2 and "cluster" in s["ci_method"] and s["ci_low"] is not None
    one = summarize([0.1, 0.3], clusters=["a", "a"])
    assert one["mean"] == pytest.approx(0.2) and one["ci_low"] is None and one["ci_high"] is None
    assert "one cluster" in one["ci_note"]
    assert summarize([0.5])["ci_low"] is None and summarize([])["mean"] is None
    assert summarize([None, 1.0, 2.0], clusters=["x", "y", "z"])["n"] == 2  # missing values leave their cluster


def test_tost_paired_matches_statsmodels():
    from statsmodels.stats.weightstats import ttost_paired

    rng = np.random.default_rng(0)
    x, y = rng.normal(0.02, 0.05, 20), np.zeros(20)
    ours = tost_paired(x, y, -0.1, 0.1)
    p, (t1, p1, _), (t2, p2, _) = ttost_paired(x, y, -0.1, 0.1)
    assert ours["p"] == pytest.approx(p) and ours["p_low"] == pytest.approx(p1) and ours["p_upp"] == pytest.approx(p2)
    assert ours["p"] < 0.05
    far = tost_paired(x + 0.5, y, -0.1, 0.1)
    assert far["p"] > 0.5  # outside the bounds: equivalence not shown
    assert tost_paired([0.0, 0.0], [0.0, 0.0], -0.1, 0.1)["p"] is None  # no variance: no t statistic


def test_mcnemar_exact_matches_statsmodels():
    from statsmodels.stats.contingency_tables import mcnemar

    a = [True] * 9 + [False] * 2 + [True] * 5 + [False] * 4
    b = [False] * 9 + [True] * 2 + [True] * 5 + [False] * 4
    ours = mcnemar_exact(a, b)
    assert ours["a_only"] == 9 and ours["b_only"] == 2
    assert ours["p"] == pytest.approx(mcnemar([[5, 9], [2, 4]], exact=True).pvalue)
    assert mcnemar_exact([True] * 12, [False] * 12)["p"] == pytest.approx(2 * 0.5 ** 12)


def test_gee_binomial_matches_statsmodels_and_uses_keywords():
    import pandas as pd
    import statsmodels.api as sm

    rng = np.random.default_rng(3)
    n_clusters = 30
    cluster = np.repeat(np.arange(n_clusters), 2)
    cond = np.tile(["base", "treat"], n_clusters)
    frailty = np.repeat(rng.normal(0, 1, n_clusters), 2)
    y = rng.random(2 * n_clusters) < 1 / (1 + np.exp(-(frailty + 1.2 * (cond == "treat"))))
    ours = gee_binomial(y, cond, cluster, reference="base")
    exog = sm.add_constant(pd.DataFrame({"treat": (cond == "treat").astype(float)}))
    direct = sm.GEE(y.astype(float), exog, groups=cluster, family=sm.families.Binomial(),
                    cov_struct=sm.cov_struct.Exchangeable()).fit()
    assert ours["coefficients"]["treat"]["beta"] == pytest.approx(direct.params["treat"], rel=1e-6)
    assert ours["coefficients"]["treat"]["p"] == pytest.approx(direct.pvalues["treat"], rel=1e-6)
    assert ours["n_clusters"] == n_clusters and ours["finite"]


def test_bh_fdr_is_benjamini_hochberg_not_the_default():
    from statsmodels.stats.multitest import multipletests

    p = [0.01, 0.02, 0.03, 0.04, 0.2]
    q = bh_fdr([p[0], None, *p[1:]])
    assert q[1] is None
    assert [v for v in q if v is not None] == pytest.approx(multipletests(p, method="fdr_bh")[1])
    assert not np.allclose(multipletests(p)[1], multipletests(p, method="fdr_bh")[1])  # default is Holm-Sidak
    assert q[0] == pytest.approx(0.05) and q[-1] == pytest.approx(0.2)  # p * m / rank, then the step-up minimum


def test_power_helpers():
    from scipy.stats import binom
    from statsmodels.stats.power import TTestPower

    n = n_paired_t(0.1, 0.2)
    assert TTestPower().power(0.5, n, 0.05, alternative="larger") >= 0.8 > \
        TTestPower().power(0.5, n - 1, 0.05, alternative="larger")
    assert n_paired_t(0.1, 0.0) is None and n_paired_t(-0.1, 0.2) is None
    # all n correct must beat a 0.97 bound: 0.97 ** n <= 0.05 first at n = 99
    assert n_binom_bound(1.0, 0.97) == 99 and 0.97 ** 99 <= 0.05 < 0.97 ** 98
    assert binom_at_least(12, 12, 0.9)["p"] == pytest.approx(0.9 ** 12)
    assert binom_at_least(5, 12, 0.9)["p"] == pytest.approx(binom.sf(4, 12, 0.9))
    # McNemar with every pair discordant toward a: 2 * 0.5 ** n <= 0.05 first at n = 6
    assert n_mcnemar(1.0, 0.0) == 6
    assert n_mcnemar(0.3, 0.1) > n_mcnemar(0.5, 0.1) and n_mcnemar(0.1, 0.3) is None


def test_power_helpers_agree_with_the_n_needed_and_with_statsmodels():
    from statsmodels.stats.power import TTestPower

    from kvprobe.stats import power_binom_bound, power_mcnemar, power_paired_t

    n = n_mcnemar(0.6, 0.1)
    assert power_mcnemar(0.6, 0.1, n) >= 0.8 > power_mcnemar(0.6, 0.1, n - 1)
    n = n_binom_bound(0.99, 0.9)
    assert power_binom_bound(0.99, 0.9, n) >= 0.8 > power_binom_bound(0.99, 0.9, n - 1)
    assert power_binom_bound(1.0, 0.97, 98) == 0.0 and power_binom_bound(1.0, 0.97, 99) == 1.0  # 0.97**99 < 0.05
    assert power_paired_t(0.3, 0.5, 12) == pytest.approx(TTestPower().power(0.6, 12, 0.05, alternative="larger"))
    assert power_paired_t(-0.1, 0.5, 12) == 0.0 and power_paired_t(0.1, 0.0, 12) is None


def test_sign_test_and_cluster_means():
    from scipy.stats import binomtest

    from kvprobe.stats import cluster_means, sign_test

    res = sign_test([0.5, 1.0, 0.2, 0.0, -0.3, 0.4, 1.0])
    assert (res["positive"], res["negative"]) == (5, 1)
    assert res["p"] == pytest.approx(binomtest(5, 6, 0.5).pvalue)
    keys, means = cluster_means([1.0, 3.0, 2.0, None, 4.0], ["b", "b", "a", "a", "c"])
    assert keys == ["a", "b", "c"] and means == [2.0, 2.0, 4.0]

"""The paper's tests, as thin wrappers over statsmodels and scipy (paper Appendix H, "Confirmatory
protocol": cluster-bootstrap CIs, TOST equivalence, GEE-logistic, McNemar, BH-FDR).

Each wrapper returns a plain dict (JSON-ready) naming the test, so a record or a claims row says what it
used. Power helpers answer "how many instances would detect the paper's effect at 80% power, given our
variance" through ``statsmodels.stats.power``; the exact-binomial one, which statsmodels does not offer for
a one-sided bound, sums scipy's binomial distribution.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

ALPHA = 0.05
POWER = 0.8


def _finite(x: Sequence[float | None]) -> np.ndarray:
    return np.asarray([float(v) for v in x if v is not None and np.isfinite(float(v))], dtype=float)


def proportion_ci(count: int, nobs: int, alpha: float = ALPHA, method: str = "beta") -> tuple[float, float]:
    """Exact Clopper-Pearson interval (``method="beta"``) or Wilson (``"wilson"``) for ``count / nobs``."""
    from statsmodels.stats.proportion import proportion_confint

    lo, hi = proportion_confint(count, nobs, alpha=alpha, method=method)
    return float(lo), float(hi)


def summarize_proportion(flags: Sequence[bool | None], clusters: Sequence[Any] | None = None,
                         alpha: float = ALPHA) -> dict[str, Any]:
    """{mean, ci_low, ci_high, n, k, n_clusters, ci_method} of a rate, with the exact (Clopper-Pearson)
    interval. The exact interval treats instances as independent; ``n_clusters`` < ``n`` says they share
    scenarios (then the interval is optimistic)."""
    keys = list(range(len(flags))) if clusters is None else list(clusters)
    kept = [(bool(f), str(c)) for f, c in zip(flags, keys, strict=True) if f is not None]
    n, k = len(kept), sum(f for f, _ in kept)
    out: dict[str, Any] = {"mean": k / n if n else None, "ci_low": None, "ci_high": None, "n": n, "k": k,
                           "n_clusters": len({c for _, c in kept}), "ci_method": "clopper-pearson (exact)"}
    if n == 0:
        out["ci_note"] = "no instance"
    else:
        out["ci_low"], out["ci_high"] = proportion_ci(k, n, alpha)
    return out


def tost_paired(x: Sequence[float], y: Sequence[float], low: float, upp: float) -> dict[str, Any]:
    """Paired TOST equivalence: is mean(x - y) within (low, upp)? ``statsmodels.stats.weightstats.
    ttost_paired``; p is the larger of the two one-sided p-values. NaN-free pairs only; p None when the
    differences have no variance (a t statistic does not exist)."""
    from statsmodels.stats.weightstats import ttost_paired

    pairs = [(float(a), float(b)) for a, b in zip(x, y, strict=True)
             if a is not None and b is not None and np.isfinite(float(a)) and np.isfinite(float(b))]
    a, b = np.asarray([p[0] for p in pairs]), np.asarray([p[1] for p in pairs])
    out: dict[str, Any] = {"test": f"paired TOST (bounds {low:+.3g}, {upp:+.3g})", "low": low, "upp": upp,
                           "n": len(pairs), "p": None, "mean_diff": float((a - b).mean()) if pairs else None}
    if len(pairs) < 2 or np.std(a - b) == 0:
        out["note"] = "fewer than two pairs" if len(pairs) < 2 else "no variance: t undefined"
        return out
    p, (t1, p1, df1), (t2, p2, df2) = ttost_paired(a, b, low, upp)
    out.update(p=float(p), t_low=float(t1), p_low=float(p1), t_upp=float(t2), p_upp=float(p2), df=float(df1))
    return out


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> dict[str, Any]:
    """Exact McNemar test of paired binary outcomes (``statsmodels ... mcnemar(exact=True)``): the 2x2
    table of (a, b) outcomes; only discordant pairs carry information. Two-sided p."""
    from statsmodels.stats.contingency_tables import mcnemar

    pairs = [(bool(u), bool(v)) for u, v in zip(a, b, strict=True) if u is not None and v is not None]
    table = np.zeros((2, 2), dtype=int)
    for u, v in pairs:
        table[int(not u), int(not v)] += 1  # row/col 0 = True
    res = mcnemar(table, exact=True)
    return {"test": "McNemar (exact)", "p": float(res.pvalue), "n": len(pairs), "table": table.tolist(),
            "a_only": int(table[0, 1]), "b_only": int(table[1, 0])}


def gee_binomial(outcome: Sequence[bool], condition: Sequence[str], clusters: Sequence[Any], reference: str
                 ) -> dict[str, Any]:
    """GEE logistic regression of a binary outcome on condition (dummy-coded against ``reference``), with
    an exchangeable working correlation within cluster and robust SEs: per condition, the log-odds
    coefficient and its Wald p. ``family`` and ``cov_struct`` go by keyword (GEE's 4th positional
    argument is ``time``)."""
    import pandas as pd
    import statsmodels.api as sm
    import statsmodels.formula.api as smf

    df = pd.DataFrame({"y": [float(bool(v)) for v in outcome], "condition": [str(c) for c in condition],
                       "cluster": [str(c) for c in clusters]})
    formula = f"y ~ C(condition, Treatment(reference={reference!r}))"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence chatter; a failed fit shows as non-finite numbers
        fit = smf.gee(formula, groups="cluster", data=df, family=sm.families.Binomial(),
                      cov_struct=sm.cov_struct.Exchangeable()).fit()
    coefs = {}
    for name, beta in fit.params.items():
        if name == "Intercept":
            continue
        label = name.split("[T.", 1)[1].rstrip("]")
        coefs[label] = {"beta": float(beta), "se": float(fit.bse[name]), "p": float(fit.pvalues[name])}
    return {"test": "GEE logistic (exchangeable within scenario, robust SE)", "reference": reference,
            "n": int(len(df)), "n_clusters": int(df["cluster"].nunique()), "coefficients": coefs,
            "finite": bool(np.all(np.isfinite(fit.params)) and np.all(np.isfinite(fit.bse)))}


def gee_trend(outcome: Sequence[float], x: Sequence[float], clusters: Sequence[Any],
              strata: Sequence[str] | None = None, alpha: float = ALPHA) -> dict[str, Any]:
    """Linear GEE of ``outcome`` on ``x`` (a slope per unit of x), with fixed effects for ``strata`` (e.g. the
    prompt-format x distance cell) and an independence working correlation within cluster. The SE is the
    bias-reduced (Mancl-DeRouen) sandwich, and the interval and p use a t with (clusters - 1) degrees of freedom:
    with about a dozen clusters the plain sandwich is too narrow. A binary outcome gives a linear-probability
    slope (a rate per unit of x), which stays finite where a logit would separate (a size that never gates)."""
    import pandas as pd
    import statsmodels.api as sm
    import statsmodels.formula.api as smf
    from scipy import stats as sstats

    df = pd.DataFrame({"y": [float(v) for v in outcome], "x": [float(v) for v in x],
                       "cluster": [str(c) for c in clusters]})
    formula = "y ~ x"
    if strata is not None and len(set(strata)) > 1:
        df["stratum"] = [str(s) for s in strata]
        formula += " + C(stratum)"
    n_clusters = int(df["cluster"].nunique())
    out: dict[str, Any] = {"test": "linear GEE, independence within scenario, bias-reduced sandwich SE, "
                                   "t with clusters - 1 df", "n": int(len(df)), "n_clusters": n_clusters,
                           "x_values": sorted({round(v, 6) for v in df["x"]}), "slope": None, "se": None,
                           "ci_low": None, "ci_high": None, "p_two_sided": None, "df": n_clusters - 1}
    if len(df) < 3 or n_clusters < 2 or df["x"].nunique() < 2 or df["y"].nunique() < 2:
        return out  # nothing to fit (a constant outcome has no slope to estimate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = smf.gee(formula, groups="cluster", data=df, family=sm.families.Gaussian(),
                      cov_struct=sm.cov_struct.Independence()).fit(cov_type="bias_reduced")
    slope, se = float(fit.params["x"]), float(fit.bse["x"])
    dof = n_clusters - 1
    q = float(sstats.t.ppf(1 - alpha / 2, dof))
    out.update({"slope": slope, "se": se, "ci_low": slope - q * se, "ci_high": slope + q * se,
                "p_two_sided": float(2 * sstats.t.sf(abs(slope / se), dof)) if se > 0 else None,
                "p_greater": float(sstats.t.sf(slope / se, dof)) if se > 0 else None,
                "p_less": float(sstats.t.cdf(slope / se, dof)) if se > 0 else None})
    return out


def bh_fdr(pvalues: Sequence[float | None], alpha: float = ALPHA) -> list[float | None]:
    """Benjamini-Hochberg q-values (``multipletests(method="fdr_bh")``; its default is Holm-Sidak).
    None in, None out (a claim without a p-value takes no part in the correction)."""
    from statsmodels.stats.multitest import multipletests

    idx = [i for i, p in enumerate(pvalues) if p is not None and np.isfinite(p)]
    out: list[float | None] = [None] * len(pvalues)
    if idx:
        _, q, _, _ = multipletests([pvalues[i] for i in idx], alpha=alpha, method="fdr_bh")
        for i, v in zip(idx, q):
            out[i] = float(v)
    return out


def n_paired_t(effect: float, sd: float, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Instances a one-sided paired t-test needs to detect a mean difference ``effect`` when the
    differences have standard deviation ``sd`` (``TTestPower.solve_power``). Also the TOST approximation:
    pass the distance from the expected difference to the nearer equivalence bound. None when undefined
    (no variance, or no effect in the tested direction)."""
    from statsmodels.stats.power import TTestPower

    if not (sd and np.isfinite(sd) and sd > 0) or not np.isfinite(effect) or effect <= 0:
        return None
    analysis = TTestPower()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if analysis.power(effect_size=effect / sd, nobs=2, alpha=alpha, alternative="larger") >= power:
            return 2  # the smallest n a t-test has; solve_power does not converge this far out
        n = analysis.solve_power(effect_size=effect / sd, alpha=alpha, power=power, alternative="larger")
    n = float(np.atleast_1d(n)[0])
    return max(2, math.ceil(n)) if np.isfinite(n) else None


@functools.lru_cache(maxsize=8)
def _mcnemar_critical(alpha: float, n_max: int) -> np.ndarray:
    from scipy.stats import binom

    crit = np.full(n_max + 1, -1)
    for d in range(1, n_max + 1):
        cs = np.arange(d + 1)
        ok = cs[2 * binom.cdf(cs, d, 0.5) <= alpha]
        crit[d] = ok[-1] if ok.size else -1
    return crit


def power_mcnemar(p_a_only: float, p_b_only: float, n: int, alpha: float = ALPHA, n_max: int = 1000) -> float:
    """Probability that the exact two-sided McNemar test (as statsmodels computes it: ``2 * Binom(d, 1/2).cdf(
    min(b, c))``) rejects in the direction a > b with ``n`` pairs, when a pair is "a only" with probability
    ``p_a_only`` and "b only" with ``p_b_only`` (also the cluster sign test: a pair is then a cluster).
    statsmodels has no McNemar power; this sums scipy's binomial over the number of discordant pairs."""
    from scipy.stats import binom

    disc = p_a_only + p_b_only
    if disc <= 0 or n < 1:
        return 0.0
    theta = p_a_only / disc
    ds = np.arange(n + 1)
    crit = _mcnemar_critical(alpha, max(n_max, n))[: n + 1]  # largest "b only" count that rejects, -1 if none
    reject = np.where(crit >= 0, binom.sf(ds - crit - 1, ds, theta), 0.0)  # P(reject toward a | d discordant)
    return float(np.dot(binom.pmf(ds, n, min(disc, 1.0)), reject))


def n_mcnemar(p_a_only: float, p_b_only: float, alpha: float = ALPHA, power: float = POWER,
              n_max: int = 1000) -> int | None:
    """Smallest number of pairs at which :func:`power_mcnemar` reaches ``power``. None if a does not beat b
    or no n up to ``n_max`` suffices."""
    disc = p_a_only + p_b_only
    if p_a_only <= p_b_only or disc <= 0 or disc > 1 + 1e-12:
        return None
    for n in range(1, n_max + 1):
        if power_mcnemar(p_a_only, p_b_only, n, alpha, n_max) >= power:
            return n
    return None


def sign_test(diffs: Sequence[float]) -> dict[str, Any]:
    """Exact two-sided sign test of paired differences (``scipy.stats.binomtest`` on the positive vs negative
    ones; ties carry no information). On cluster means of paired booleans it is McNemar's test with the
    cluster as the unit."""
    from scipy.stats import binomtest

    x = _finite(diffs)
    pos, neg = int((x > 0).sum()), int((x < 0).sum())
    p = float(binomtest(pos, pos + neg, 0.5).pvalue) if pos + neg else None
    return {"test": "exact sign test (two-sided)", "p": p, "n": int(x.size), "positive": pos, "negative": neg}


def power_paired_t(effect: float, sd: float, n: int, alpha: float = ALPHA) -> float | None:
    """Power of the one-sided paired t-test to detect a mean difference ``effect`` from ``n`` pairs whose
    differences have standard deviation ``sd`` (``TTestPower.power``). None when undefined; 0 for no
    effect in the tested direction."""
    from statsmodels.stats.power import TTestPower

    if not (sd and np.isfinite(sd) and sd > 0) or not np.isfinite(effect) or n < 2:
        return None
    if effect <= 0:
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(TTestPower().power(effect_size=effect / sd, nobs=n, alpha=alpha, alternative="larger"))


def power_binom_bound(p_true: float, bound: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the exact one-sided binomial test of ``rate > bound`` with ``n`` trials at true rate
    ``p_true`` (the critical count from the null distribution, its probability under ``p_true``)."""
    from scipy.stats import binom

    if n < 1:
        return 0.0
    ks = np.arange(n + 1)
    ok = ks[binom.sf(ks - 1, n, bound) <= alpha]
    return float(binom.sf(ok[0] - 1, n, p_true)) if ok.size else 0.0


def binom_at_least(count: int, nobs: int, bound: float) -> dict[str, Any]:
    """Exact one-sided binomial test that the rate exceeds ``bound`` (``scipy.stats.binomtest``)."""
    from scipy.stats import binomtest

    p = float(binomtest(count, nobs, bound, alternative="greater").pvalue) if nobs else None
    return {"test": f"exact binomial, rate > {bound:.3g}", "p": p, "n": nobs, "k": count}


def binom_at_most(count: int, nobs: int, bound: float) -> dict[str, Any]:
    """Exact one-sided binomial test that the rate is below ``bound`` (``scipy.stats.binomtest``)."""
    from scipy.stats import binomtest

    p = float(binomtest(count, nobs, bound, alternative="less").pvalue) if nobs else None
    return {"test": f"exact binomial, rate < {bound:.3g}", "p": p, "n": nobs, "k": count}


def n_binom_bound(p_true: float, bound: float, greater: bool = True, alpha: float = ALPHA,
                  power: float = POWER, n_max: int = 5000) -> int | None:
    """Smallest n at which the exact one-sided binomial test of ``rate > bound`` (or ``< bound``) rejects
    with probability >= ``power`` when the true rate is ``p_true``: the critical count from the null
    distribution, its probability under the alternative (scipy's binomial). None if p_true is not beyond
    the bound or no n up to ``n_max`` suffices."""
    from scipy.stats import binom

    if (greater and p_true <= bound) or (not greater and p_true >= bound):
        return None
    for n in range(1, n_max + 1):
        ks = np.arange(n + 1)
        if greater:  # reject for k >= c, the smallest c with P0(X >= c) <= alpha
            ok = ks[binom.sf(ks - 1, n, bound) <= alpha]
            pw = binom.sf(ok[0] - 1, n, p_true) if ok.size else 0.0
        else:
            ok = ks[binom.cdf(ks, n, bound) <= alpha]
            pw = binom.cdf(ok[-1], n, p_true) if ok.size else 0.0
        if pw >= power:
            return n
    return None

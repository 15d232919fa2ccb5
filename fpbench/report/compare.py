"""`fpbench compare`: two methods on the same cells, seed by seed.

For each (dataset, partition) cell and metric both methods ran, the runs are paired by seed
(the same seed gives both methods the same partition, client sampling and data), and the
per-seed differences B - A are tested with a paired two-sided Student t-test
(`scipy.stats.ttest_rel`). The gap *exceeds seed noise* when the test rejects "no
difference" at level `alpha`, which is the same as the (1 - alpha) t-interval of the mean
difference excluding 0. With fewer than two pairs there is no test. Differences that are all
equal are decided without the test (its statistic is infinite or undefined): a non-zero one
exceeds the noise (p = 0), zero does not (p = 1); equal means equal up to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from fpbench.errors import FpbenchError
from fpbench.report.tables import final_values

CELL = ["dataset", "partition"]
COLUMNS = [
    *CELL, "metric", "n", "seeds", "mean_a", "mean_b", "diffs", "mean_diff", "std_diff",
    "ci_low", "ci_high", "t", "p", "verdict",
]  # fmt: skip


def compare_methods(
    metrics: pd.DataFrame,
    a: str,
    b: str,
    metric_names: Sequence[str],
    *,
    alpha: float = 0.05,
    suite: str | None = None,
) -> pd.DataFrame:
    """One row per (dataset, partition, metric) that both methods have (columns `COLUMNS`).

    `diffs` is the list of per-seed differences B - A in seed order (`seeds`); means, the
    differences' sample std and the interval are fractions like the stored values.

    Raises:
        FpbenchError: a method has no runs, or the two share no seed of any cell.
    """
    if a == b:
        raise FpbenchError(f"compare needs two different methods, got {a} twice")
    if not 0 < alpha < 1:
        raise FpbenchError(f"--alpha must be between 0 and 1, got {alpha}")
    values = final_values(metrics, metric_names, suite=suite)
    for method in (a, b):
        if method not in set(values["method"]):
            known = ", ".join(sorted(set(values["method"])))
            raise FpbenchError(f"no runs of method {method!r} with these metrics; stored: {known}")
    keys = [*CELL, "metric", "seed"]
    left = values[values["method"] == a][[*keys, "value"]]
    right = values[values["method"] == b][[*keys, "value"]]
    pairs = left.merge(right, on=keys, suffixes=("_a", "_b"))
    if pairs.empty:
        raise FpbenchError(f"{a} and {b} share no (dataset, partition, seed) to compare")
    rows = []
    for (dataset, partition, metric), group in pairs.groupby([*CELL, "metric"], sort=False):
        group = group.sort_values("seed")
        diffs = (group["value_b"] - group["value_a"]).tolist()
        rows.append(
            {
                "dataset": dataset,
                "partition": partition,
                "metric": metric,
                "n": len(diffs),
                "seeds": group["seed"].tolist(),
                "mean_a": group["value_a"].mean(),
                "mean_b": group["value_b"].mean(),
                "diffs": diffs,
                **paired_test(group["value_a"].tolist(), group["value_b"].tolist(), alpha),
            }
        )
    order = {m: i for i, m in enumerate(metric_names)}
    out = pd.DataFrame(rows, columns=COLUMNS)
    return out.sort_values("metric", key=lambda c: c.map(order), kind="stable").reset_index(
        drop=True
    )


def federation_of(
    metrics: pd.DataFrame, a: str, b: str
) -> tuple[tuple[str, str], tuple[str, str]] | None:
    """The (learner, strategy) of methods a and b, where the frame has those columns."""
    if not {"learner", "strategy"} <= set(metrics.columns):
        return None
    out = []
    for method in (a, b):
        rows = metrics[metrics["method"] == method]
        out.append((str(rows["learner"].iloc[0]), str(rows["strategy"].iloc[0])))
    return out[0], out[1]


def paired_test(a: Sequence[float], b: Sequence[float], alpha: float = 0.05) -> dict:
    """Mean and sample std of the differences b - a, their (1 - alpha) Student-t interval,
    the paired t statistic and two-sided p, and the verdict (see the module docstring)."""
    from scipy import stats

    diffs = [y - x for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    nan = float("nan")
    if n < 2:
        return {
            "mean_diff": mean, "std_diff": nan, "ci_low": nan, "ci_high": nan, "t": nan,
            "p": nan, "verdict": "one seed: no test",
        }  # fmt: skip
    std = float(pd.Series(diffs).std(ddof=1))
    if std <= 1e-12 * max(abs(mean), 1.0):  # equal up to float rounding (0.2 - 0.1, 0.3 - 0.2)
        std = 0.0
    half = float(stats.t.ppf(1 - alpha / 2, n - 1)) * std / n**0.5
    if std == 0:
        t, p = (math.copysign(math.inf, mean) if mean else nan), (0.0 if mean else 1.0)
    else:
        result = stats.ttest_rel(b, a)
        t, p = float(result.statistic), float(result.pvalue)
    verdict = "exceeds seed noise" if p < alpha else "within seed noise"
    return {
        "mean_diff": mean, "std_diff": std, "ci_low": mean - half, "ci_high": mean + half,
        "t": t, "p": p, "verdict": verdict,
    }  # fmt: skip

"""Solver times of the NP-hardness reduction checker, per instance and exact method."""

from __future__ import annotations

import os

import polars as pl

from evictlab.plots.common import Figure, require, save, setup


def hardness_times(trials: pl.DataFrame, out: str | os.PathLike[str]) -> Figure:
    """Strip plot of decision times (ms, log scale) per exact method, coloured by the expected answer.

    ``trials``: the table of :func:`evictlab.hardness.check.run_check` (``trials.parquet``).
    """
    methods = [c[:-2] for c in trials.columns if c.endswith("_s") and c[:-2] in trials.columns]
    require(trials, ["expected", "agreed"] + [m + "_s" for m in methods], "hardness figure")
    plt = setup()
    import seaborn as sns

    long = (trials.select("trial", "expected", *[pl.col(m + "_s") for m in methods])
            .unpivot(index=["trial", "expected"], variable_name="method", value_name="seconds")
            .drop_nulls("seconds")
            .with_columns((pl.col("seconds") * 1e3).alias("ms"), pl.col("method").str.replace("_s$", "").str.replace("_", " ")))
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    sns.stripplot(data=long.to_pandas(), x="method", y="ms", hue="expected", dodge=True, size=3, alpha=0.7, ax=ax)
    ax.set_yscale("log")
    ax.set_xlabel("exact method (source = k-subset-sum, image = ZERO-ES)")
    ax.set_ylabel("decision time (ms, log scale)")
    agreed = int(trials["agreed"].sum())
    ax.set_title(f"ZERO-ES reduction checker: {agreed}/{trials.height} instances agree", fontsize=10)
    caption = ("Each point is one instance decided by one exact method: CP-SAT or the exact (count, sum) dynamic "
               "program, on the k-subset-sum source and on its ZERO-ES image (uniform mass, 1-D integer values, "
               "s = 2k). All four answers must agree and every certificate is mapped across the reduction and "
               "verified in integer arithmetic.")
    return save(fig, out, caption)

"""Dropped-mass predictors of a significant selection gap, as versioned JSON (no pickle).

Label: ``kappa_hat > threshold`` (default 1.11, docs/theory.md section 2), on rows with e(T_s) > 0.
Features (computed by :func:`feature_frame` from a prepared results table):

- ``dropped_mass`` m_s = D(T_s), the attention mass outside the top-s keys;
- ``entropy_norm`` = H(p) / log(n) (Shannon entropy of the row in nats over its maximum,
  so rows with different key counts and models share one scale);
- ``log2_s`` = log2 of the budget s;
- ``depth`` = layer / (last layer of that model), in [0, 1].

Feature sets: ``mass`` = (dropped_mass,), ``extended`` = all four.

Fitting (:func:`fit_predictor`): rows are split by ``row_id`` (all budgets of one attention
row go to the same part, seeded) into train / calibration / test = 50/25/25 %. A
standardised L2 logistic regression is fitted on train; Platt scaling (a 1-D logistic
regression on the decision value) on the calibration part makes the probabilities
calibrated; ROC AUC is reported on the held-out test part. Everything needed to predict —
feature list, scaler, coefficients, calibration — is stored as plain JSON numbers.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import polars as pl

from evictlab.errors import CorruptFileError, InputError
from evictlab.io import atomic_write_json
from evictlab.stats.bootstrap import AUC, Design, bootstrap, roc_auc
from evictlab.stats.ceilings import CLUSTER_LEVELS, DEFAULT_THRESHOLD, design_for
from evictlab.stats.results import split_zero

FORMAT = "evictlab.predictor"
VERSION = 1
FEATURE_SETS: dict[str, tuple[str, ...]] = {
    "mass": ("dropped_mass",),
    "extended": ("dropped_mass", "entropy_norm", "log2_s", "depth"),
}
KNOWN_FEATURES = ("dropped_mass", "entropy_norm", "log2_s", "depth")
_FEATURE_SOURCES = {"dropped_mass": "dropped_mass", "entropy_norm": "entropy", "log2_s": "s", "depth": "layer"}


def feature_frame(df: pl.DataFrame, features: Sequence[str], source: str = "results") -> pl.DataFrame:
    """Add the named feature columns to a prepared results table; clear error if one can't be built."""
    for f in features:
        if f not in KNOWN_FEATURES:
            raise InputError("features", f"unknown feature {f!r}", f"use some of {list(KNOWN_FEATURES)}")
        col = _FEATURE_SOURCES[f]
        if col not in df.columns:
            raise InputError(source, f"feature {f!r} needs column {col!r}, which the table lacks",
                             "re-solve with a solver that writes it, or use the 'mass' feature set")
    exprs = []
    if "entropy_norm" in features:
        exprs.append(
            pl.when(pl.col("n") > 1).then(pl.col("entropy") / pl.col("n").cast(pl.Float64).log())
            .otherwise(0.0).alias("entropy_norm"))
    if "log2_s" in features:
        exprs.append(pl.col("s").cast(pl.Float64).log(2).alias("log2_s"))
    return df.with_columns(exprs) if exprs else df


def label(df: pl.DataFrame, threshold: float = DEFAULT_THRESHOLD) -> np.ndarray:
    """Significant-gap label: kappa_hat > threshold."""
    return (df["kappa_hat"].cast(pl.Float64).to_numpy() > threshold)


def _matrix(df: pl.DataFrame, features: Sequence[str], source: str) -> np.ndarray:
    X = df.select([pl.col(f).cast(pl.Float64) for f in features]).to_numpy()
    bad = ~np.isfinite(X)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise InputError(source, f"feature {features[c]!r} is not finite in {int(bad.any(axis=1).sum())} rows (first: row {r})",
                         "drop or repair those rows in the solver output")
    return X


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


@dataclass
class Predictor:
    """A fitted, calibrated logistic-regression predictor of kappa_hat > threshold."""

    features: list[str]
    scaler_mean: list[float]
    scaler_scale: list[float]
    coef: list[float]
    intercept: float
    calib_a: float
    calib_b: float
    threshold: float
    metadata: dict[str, Any] = field(default_factory=dict)

    # ---- prediction -------------------------------------------------------------------
    def decision(self, X: np.ndarray) -> np.ndarray:
        """Uncalibrated log-odds of the fitted logistic regression, ``X`` of shape (rows, features)."""
        Z = (X - np.asarray(self.scaler_mean)) / np.asarray(self.scaler_scale)
        return Z @ np.asarray(self.coef) + self.intercept

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """Calibrated probability of a significant gap (Platt: sigmoid(a * decision + b))."""
        return _sigmoid(self.calib_a * self.decision(X) + self.calib_b)

    def score_table(self, df: pl.DataFrame, source: str = "results") -> np.ndarray:
        """Probabilities for a prepared results table (features are built from it)."""
        df = feature_frame(df, self.features, source)
        return self.predict_proba(_matrix(df, self.features, source))

    # ---- JSON -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "features": list(self.features),
            "scaler": {"mean": list(map(float, self.scaler_mean)), "scale": list(map(float, self.scaler_scale))},
            "logistic": {"coef": list(map(float, self.coef)), "intercept": float(self.intercept)},
            "calibration": {"method": "platt", "a": float(self.calib_a), "b": float(self.calib_b)},
            "label": {"definition": "kappa_hat > threshold", "threshold": float(self.threshold)},
            "metadata": self.metadata,
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the predictor as versioned JSON (atomically)."""
        atomic_write_json(path, self.to_dict())
        return Path(path)

    @classmethod
    def from_dict(cls, d: Any, source: str = "predictor") -> "Predictor":
        """Rebuild from :meth:`to_dict` output, checking format, version and every field."""
        if not isinstance(d, dict):
            raise CorruptFileError(source, "top level is not a JSON object", "refit with `evictlab predictor fit`")
        if d.get("format") != FORMAT:
            raise CorruptFileError(source, f"format is {d.get('format')!r}, expected {FORMAT!r}",
                                   "pass a file written by `evictlab predictor fit`")
        if d.get("version") != VERSION:
            raise InputError(source, f"predictor version {d.get('version')!r} is not supported (this evictlab reads version {VERSION})",
                             "refit it with this evictlab: `evictlab predictor fit RESULTS --out predictor.json`")
        try:
            feats = [str(f) for f in d["features"]]
            mean = [float(x) for x in d["scaler"]["mean"]]
            scale = [float(x) for x in d["scaler"]["scale"]]
            coef = [float(x) for x in d["logistic"]["coef"]]
            inter = float(d["logistic"]["intercept"])
            a = float(d["calibration"]["a"])
            b = float(d["calibration"]["b"])
            thr = float(d["label"]["threshold"])
            meta = dict(d.get("metadata", {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptFileError(source, f"missing or malformed field ({exc!r})", "refit with `evictlab predictor fit`") from exc
        k = len(feats)
        if k == 0 or not (len(mean) == len(scale) == len(coef) == k):
            raise CorruptFileError(source, f"{k} features but scaler/coef lengths {len(mean)}/{len(scale)}/{len(coef)}",
                                   "refit with `evictlab predictor fit`")
        unknown = [f for f in feats if f not in KNOWN_FEATURES]
        if unknown:
            raise InputError(source, f"features {unknown} are unknown to this evictlab", f"refit with features among {list(KNOWN_FEATURES)}")
        nums = mean + scale + coef + [inter, a, b, thr]
        if not all(math.isfinite(x) for x in nums) or any(x <= 0 for x in scale):
            raise CorruptFileError(source, "non-finite number or non-positive scale", "refit with `evictlab predictor fit`")
        return cls(feats, mean, scale, coef, inter, a, b, thr, meta)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Predictor":
        """Read a predictor JSON file with clear errors for missing, corrupt or foreign files."""
        p = Path(path)
        if not p.exists():
            raise InputError(str(p), "no such predictor file", "fit one with `evictlab predictor fit RESULTS --out predictor.json`")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptFileError(str(p), f"not valid JSON ({exc})", "refit with `evictlab predictor fit`") from exc
        return cls.from_dict(d, source=str(p))


def split_rows(row_ids: np.ndarray, seed: int, fractions: tuple[float, float, float] = (0.5, 0.25, 0.25)) -> np.ndarray:
    """Part of each observation: 0 train, 1 calibration, 2 test, by a seeded shuffle of distinct row ids."""
    uniq = np.unique(row_ids)
    rng = np.random.default_rng([int(seed), 7])
    perm = rng.permutation(uniq.size)
    cut1 = int(round(fractions[0] * uniq.size))
    cut2 = cut1 + int(round(fractions[1] * uniq.size))
    part_of = np.empty(uniq.size, dtype=np.int8)
    part_of[perm[:cut1]] = 0
    part_of[perm[cut1:cut2]] = 1
    part_of[perm[cut2:]] = 2
    return part_of[np.searchsorted(uniq, row_ids)]


def fit_predictor(
    df: pl.DataFrame,
    features: Sequence[str] = FEATURE_SETS["mass"],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    seed: int = 0,
    C: float = 1.0,
    source: str = "results",
) -> tuple[Predictor, pl.DataFrame]:
    """Fit a calibrated logistic regression; return it and the held-out test rows (with ``part``).

    ``df`` is a prepared results table; rows with e(T_s) = 0 are excluded (their label is
    undefined) and counted in the metadata.
    """
    from sklearn.linear_model import LogisticRegression

    features = list(features)
    used, zero = split_zero(df)
    used = feature_frame(used, features, source)
    X = _matrix(used, features, source)
    y = label(used, threshold)
    part = split_rows(used["row_id"].to_numpy(), seed)
    tr, ca = part == 0, part == 1
    for name, m in (("training", tr), ("calibration", ca)):
        if m.sum() < 4 or y[m].all() or not y[m].any():
            raise InputError(source, f"the {name} part has {int(m.sum())} rows with {int(y[m].sum())} positives: both classes are needed",
                             "use more rows, or a threshold between the observed kappa_hat values (--threshold)")
    mean = X[tr].mean(axis=0)
    scale = X[tr].std(axis=0)
    scale[scale <= 0] = 1.0
    lr = LogisticRegression(C=C, max_iter=2000)
    lr.fit((X[tr] - mean) / scale, y[tr])
    pred = Predictor(features, mean.tolist(), scale.tolist(), lr.coef_[0].tolist(), float(lr.intercept_[0]),
                     1.0, 0.0, float(threshold))
    z = pred.decision(X[ca]).reshape(-1, 1)
    platt = LogisticRegression(C=1e6, max_iter=2000)
    platt.fit(z, y[ca])
    pred.calib_a = float(platt.coef_[0, 0])
    pred.calib_b = float(platt.intercept_[0])
    test = used.with_columns(pl.Series("part", part)).filter(pl.col("part") == 2)
    pt = pred.predict_proba(X[part == 2])
    yt = y[part == 2]
    pred.metadata = {
        "trained_on": source,
        "models": sorted(used["model"].unique().to_list()),
        "budgets": sorted(int(s) for s in used["s"].unique().to_list()),
        "rows": {"train": int(tr.sum()), "calibration": int(ca.sum()), "test": int((part == 2).sum()),
                 "e_top_zero_excluded": zero.height},
        "positives_train": int(y[tr].sum()),
        "seed": int(seed), "C": float(C),
        "split": "by row_id, seeded shuffle, 50/25/25 train/calibration/test",
        "test_auc": roc_auc(yt, pt),
        "test_brier": float(np.mean((pt - yt) ** 2)) if yt.size else float("nan"),
        "sklearn_version": _sk_version(),
    }
    return pred, test


def parse_features(spec: str, field: str = "--features") -> list[str]:
    """A feature set by name (:data:`FEATURE_SETS`: ``mass``, ``extended``) or a comma
    list of :data:`KNOWN_FEATURES`; :class:`InputError` naming ``field`` otherwise."""
    from evictlab.cliutil import parse_list

    if spec in FEATURE_SETS:
        return list(FEATURE_SETS[spec])
    feats = parse_list(spec, field, "feature")
    bad = [f for f in feats if f not in KNOWN_FEATURES]
    if not feats or bad:
        raise InputError(field, f"unknown feature set or features {bad or spec!r}",
                         f"use 'mass', 'extended' or a comma list of {', '.join(KNOWN_FEATURES)}")
    return feats


def fit_and_evaluate(df: pl.DataFrame, features: Sequence[str], *, threshold: float = DEFAULT_THRESHOLD,
                     seed: int = 0, n_boot: int = 1000, source: str = "results") -> tuple[Predictor, pl.DataFrame]:
    """``evictlab predictor fit``'s computation: :func:`fit_predictor` on the prepared results
    ``df``, then its held-out AUC per (model, s) with bootstrap CIs (:func:`evaluate`,
    ``n_boot`` resamples), stored in ``metadata["held_out_auc"]``. Returns the predictor and
    the held-out table. :class:`InputError` (``--threshold``) for a threshold that is not
    positive."""
    if not threshold > 0:
        raise InputError("--threshold", f"must be positive, got {threshold}", "use e.g. 1.11")
    pred, test = fit_predictor(df, features, threshold=threshold, seed=seed, source=source)
    held = evaluate(pred, test, seed=seed, n_boot=n_boot, name="held-out")
    pred.metadata["held_out_auc"] = held.select("model", "s", "auc", "auc_lo", "auc_hi", "rows").to_dicts()
    return pred, held


def _sk_version() -> str:
    import sklearn

    return sklearn.__version__


def evaluate(
    pred: Predictor,
    df: pl.DataFrame,
    *,
    seed: int = 0,
    n_boot: int = 1000,
    by: Sequence[str] = ("model", "s"),
    source: str = "results",
    name: str = "predictor",
    clusters: Sequence[str] | None = CLUSTER_LEVELS,
    compare_rows: bool = False,
) -> pl.DataFrame:
    """ROC AUC (with bootstrap CI), Brier score and base rate per group, plus an ``all`` row per model.

    Rows with e(T_s) = 0 are excluded and counted (``rows_e_top_zero``). Intervals resample
    ``clusters`` (see :func:`evictlab.stats.ceilings.design_for`; None = rows).
    """
    used, zero = split_zero(df)
    prob = pred.score_table(used, source)
    y = label(used, pred.threshold)
    used = used.with_columns(pl.Series("_p", prob), pl.Series("_y", y))
    return _auc_rows(used, zero, "_p", by=list(by), seed=seed, n_boot=n_boot, name=name, clusters=clusters,
                     compare_rows=compare_rows)


def auc_by_group(df: pl.DataFrame, score: str = "dropped_mass", *, threshold: float = DEFAULT_THRESHOLD,
                 seed: int = 0, n_boot: int = 1000, by: Sequence[str] = ("model", "s"),
                 name: str | None = None, clusters: Sequence[str] | None = CLUSTER_LEVELS,
                 compare_rows: bool = False) -> pl.DataFrame:
    """AUC of a raw column (default: dropped mass) as a score for kappa_hat > threshold, per group.

    ``by`` starting with ``model``: one row per group plus one per model pooled over the
    other keys (``"all"``). ``by`` without ``model`` pools the models (resampling models,
    then prompts, then rows; ``model`` = ``pooled (A + B)``).
    """
    used, zero = split_zero(df)
    used = used.with_columns(pl.Series("_y", label(used, threshold)))
    return _auc_rows(used, zero, score, by=list(by), seed=seed, n_boot=n_boot, name=name or score,
                     clusters=clusters, compare_rows=compare_rows)


def _auc_rows(used: pl.DataFrame, zero: pl.DataFrame, score: str, *, by: list[str], seed: int,
              n_boot: int, name: str, clusters: Sequence[str] | None, compare_rows: bool) -> pl.DataFrame:
    from evictlab.stats.ceilings import pooled_name

    rows: list[dict[str, Any]] = []
    groups = [(k, g) for k, g in used.group_by(by)]
    groups.sort(key=lambda kv: kv[0])
    # pooled over budgets, per model
    extra = [(tuple([m] + ["all"] * (len(by) - 1)), g) for (m,), g in sorted(used.group_by(["model"]), key=lambda kv: kv[0])] \
        if by and by[0] == "model" and len(by) > 1 else []
    models = sorted(used["model"].unique().to_list()) if "model" in used.columns else []
    for key, g in groups + extra:
        keyd = {k: str(v) for k, v in zip(by, key)}
        yy = g["_y"].to_numpy().astype(bool)
        sc = g[score].cast(pl.Float64).to_numpy()
        tag = f"{name}|" + "|".join(f"{k}={v}" for k, v in keyd.items())
        design = design_for(g, clusters)
        est = bootstrap({"auc": AUC(yy, sc)}, design, seed=seed, key=tag, n_boot=n_boot)["auc"]
        zmask = np.ones(zero.height, dtype=bool)
        for k, v in keyd.items():
            if v != "all" and k in zero.columns:
                zmask &= (zero[k].cast(pl.Utf8).to_numpy() == v)
        brier = float(np.mean((sc - yy) ** 2)) if score == "_p" and yy.size else float("nan")
        row = {"predictor": name, **({} if "model" in keyd else {"model": pooled_name(models)}), **keyd,
               "rows": int(yy.size), "positives": int(yy.sum()),
               "base_rate": float(yy.mean()) if yy.size else float("nan"),
               "auc": est.value, "auc_lo": est.lo, "auc_hi": est.hi, "brier": brier,
               "rows_e_top_zero": int(zmask.sum()),
               "prompts": int(g.select(*[c for c in ("model", "prompt_id") if c in g.columns]).n_unique())
               if "prompt_id" in g.columns else 0,
               "interval": est.method}
        if compare_rows:
            r = bootstrap({"auc": AUC(yy, sc)}, Design.rows(g.height), seed=seed, key=tag + "|rows", n_boot=n_boot)["auc"]
            row.update({"auc_row_lo": r.lo, "auc_row_hi": r.hi})
        rows.append(row)
    return pl.DataFrame(rows)

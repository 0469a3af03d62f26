"""``evictlab dilution check``: dilution quantities and bound checks on every labelled row.

For every row of a labelled row dataset (schema version 2, a task source) and every kept set
of :mod:`evictlab.dilution.keptsets` at every budget s, :func:`run_check` computes the
quantities of :mod:`evictlab.dilution.measures` and writes one table row per
(row, kept set, s), plus one per row for the full cache (``method = "full"``, A = every
key). Then it checks the inequalities of docs/theory.md section 7 on every row
(:data:`CHECKS`), counting violations where the assumptions hold (there must be none) and,
separately, where they fail, with the slack, and writes the summaries, figures and report.

Outputs, for ``--out T.parquet``: ``T.parquet`` (the long table), ``T.heads.parquet`` (per
layer, query head, kept set, s), ``T.bounds.parquet`` (one row per check), ``T.md`` (the
report), ``T.figures/`` (PNG + PDF) and ``T.run_record.json``. The run is resumable: blocks
are processed in chunks written to ``T.parts/`` (the part store, :mod:`evictlab.parts`); the folder
goes only after the run record, the last file, is written, so a run killed while writing its
outputs is finished by the rerun (a ``T.parquet`` with ``T.parts/`` beside it is unfinished).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from evictlab.dilution import keptsets
from evictlab.dilution.labels import USEFUL_PARTS, PromptLabels, prompt_labels
from evictlab.dilution.measures import TOL, kept_measures, row_measures
from evictlab.errors import InputError, refuse_duplicates

__all__ = ["CHECKS", "CheckConfig", "bound_checks", "check_block", "head_table", "run_check"]

_META = ("row_id", "prompt_id", "layer", "q_head", "kv_head", "position", "n")
_EXTRA = ("block", "key_lo", "key_hi", "scale", "kind")


@dataclass(frozen=True)
class CheckConfig:
    """Settings of ``evictlab dilution check`` (its options).

    ``budgets``: kept-set sizes s (keys kept per row); ``methods``: kept sets among
    :data:`~evictlab.dilution.keptsets.KEPT_SETS`; ``useful``: which part of an asked fact
    is useful (:data:`~evictlab.dilution.labels.USEFUL_PARTS`); ``stated_margin``: a margin
    Delta_0 assumed for the stated-margin check (None: skip it); ``sinks``, ``recent``: the
    scorers' always-kept keys; ``pool_max_s``: the pool optimum only for s up to this;
    ``r_m``, ``r_e``: the candidate pool; ``chunk_blocks``: blocks per part file.
    """

    budgets: tuple[int, ...] = (32, 128, 512)
    methods: tuple[str, ...] = keptsets.KEPT_SETS
    useful: str = "fact"
    stated_margin: float | None = None
    sinks: int = 4
    recent: int = 16
    pool_max_s: int = 64
    r_m: int = 2
    r_e: int = 2
    chunk_blocks: int = 32

    def check(self) -> None:
        unknown = [m for m in self.methods if m not in keptsets.KEPT_SETS]
        if unknown or not self.methods:
            raise InputError("--methods", f"unknown or no kept set {unknown or self.methods}",
                             f"use some of: {', '.join(keptsets.KEPT_SETS)}")
        refuse_duplicates(self.methods, "--methods", "method")
        if self.useful not in USEFUL_PARTS:
            raise InputError("--useful", f"unknown part {self.useful!r}", f"use one of: {', '.join(USEFUL_PARTS)}")
        for name, v, lo in (("--sinks", self.sinks, 0), ("--recent", self.recent, 0),
                            ("--pool-max-s", self.pool_max_s, 0), ("--chunk-blocks", self.chunk_blocks, 1)):
            if v < lo:
                raise InputError(name, f"must be >= {lo}, got {v}", f"pass {lo} or more")
        keptsets.check_budgets(self.budgets, self.sinks, self.recent)
        if self.stated_margin is not None and not np.isfinite(self.stated_margin):
            raise InputError("--margin", f"{self.stated_margin} is not a finite number", "pass e.g. --margin 2.0")


# ----------------------------------------------------------------------------- blocks


def _blocks(store: Any, blocks: list[int] | None, max_rows: int = 4096) -> Iterator[Any]:
    """The rows of each block as one RowBatch (rows of a block are contiguous in row order)."""
    flt = None if blocks is None else pl.col("block").is_in(blocks)
    carry = None
    for batch in store.iter_batches(max_rows=max_rows, filter=flt, columns=_EXTRA, with_keys=True,
                                    with_queries=True):
        ids = batch.meta["block"].to_numpy()
        cuts = np.flatnonzero(np.diff(ids)) + 1
        groups = np.split(np.arange(ids.size), cuts)
        for j, g in enumerate(groups):
            part = batch.take(g)
            if carry is not None:
                if int(carry.meta["block"][0]) == int(ids[g[0]]):
                    part = type(batch).concat([carry, part])
                else:
                    yield carry
                carry = None
            if j == len(groups) - 1:
                carry = part
            else:
                yield part
    if carry is not None:
        yield carry


def dense_block(rb: Any, n_layers: int) -> keptsets.Block:
    """Lay the rows of one block (a RowBatch whose rows share a block) out densely."""
    m = rb.meta
    lo, hi = m["key_lo"].to_numpy(), m["key_hi"].to_numpy()
    R, L, d = m.height, int(hi.max()), rb.values.shape[1]
    P = np.zeros((R, L))
    visible = np.zeros((R, L), bool)
    values = np.zeros((L, d))
    keys = np.zeros((L, d)) if rb.keys is not None else None
    key_pos = np.full(L, -1, np.int64)
    for r in range(R):
        a, b = int(lo[r]), int(hi[r])
        seg = slice(int(rb.p_off[r]), int(rb.p_off[r + 1]))
        P[r, a:b] = rb.p[seg]
        visible[r, a:b] = True
        vs = int(rb.v_start[r])
        values[a:b] = rb.values[vs:vs + b - a]
        if keys is not None:
            keys[a:b] = rb.keys[vs:vs + b - a]
        key_pos[a:b] = rb.key_index[seg]
    scale = m["scale"].to_numpy()
    logits = np.full((R, L), -np.inf)
    is_q = (m["kind"] == "query").to_numpy()
    for r in range(R):
        a, b = int(lo[r]), int(hi[r])
        if is_q[r] and keys is not None and rb.queries is not None:
            logits[r, a:b] = scale[r] * (keys[a:b] @ rb.queries[r])
        else:  # logits rows: log p = logits - logsumexp(logits), the same differences
            with np.errstate(divide="ignore"):
                logits[r, a:b] = np.log(P[r, a:b])
    return keptsets.Block(P=P, logits=logits, visible=visible, lo=lo, hi=hi, key_pos=key_pos, values=values,
                          keys=keys, queries=rb.queries, position=m["position"].to_numpy(),
                          q_head=m["q_head"].to_numpy(), scale=scale, layer=int(m["layer"][0]), n_layers=n_layers)


def _kept_sets(cfg: CheckConfig, rb: Any, blk: keptsets.Block) -> Iterator[tuple[str, int, np.ndarray, np.ndarray]]:
    for s in cfg.budgets:
        for name in cfg.methods:
            if name == "top_mass":
                kept, ok = keptsets.top_mass(blk, s)
            elif name == "pool":
                if s > cfg.pool_max_s:
                    continue
                kept, ok = keptsets.pool_optimum(rb, blk, s, cfg.r_m, cfg.r_e)
            else:
                kept, ok = keptsets.scorer(blk, name, s, sinks=cfg.sinks, recent=cfg.recent)
            if ok.any():
                yield name, int(s), kept, ok


def check_block(rb: Any, labels: PromptLabels, cfg: CheckConfig, n_layers: int) -> pl.DataFrame:
    """The table rows of one block: per row the full cache, then every defined kept set."""
    blk = dense_block(rb, n_layers)
    useful = np.isin(blk.key_pos, labels.useful)
    rows = row_measures(blk.P, blk.logits, blk.visible, useful, cfg.stated_margin)
    tot = (blk.P * blk.visible).sum(1)
    other = np.isin(blk.key_pos, labels.other_facts)
    sink = blk.key_pos == 0
    question = (blk.key_pos >= labels.n_context) if labels.n_context is not None else np.zeros_like(sink)
    filler = ~(useful | other | sink | question)
    cats = {f"mass_{k}": (blk.P * (blk.visible & mask[None, :])).sum(1) / tot
            for k, mask in (("other_facts", other), ("sink", sink), ("question", question), ("filler", filler))}
    base = {c: rb.meta[c].to_numpy() for c in _META}
    base["kind"] = rb.meta["kind"].to_numpy()
    row_part = {**base, **{k: v for k, v in rows.items() if k != "defined"}, "useful_visible": rows["n_useful"] > 0,
                **cats}
    frames = []
    everything = blk.visible
    for name, s, kept, ok in [("full", 0, everything, np.ones(len(tot), bool)), *_kept_sets(cfg, rb, blk)]:
        km = kept_measures(blk.P, blk.logits, blk.visible, useful, blk.values, kept)
        sel = np.flatnonzero(ok)
        data = {k: np.asarray(v)[sel] for k, v in row_part.items()}
        data.update({k: np.asarray(v)[sel] for k, v in km.items()})
        data["method"] = np.full(sel.size, name, dtype=object)
        data["s"] = np.where(name == "full", base["n"][sel], s).astype(np.int64)
        frames.append(pl.DataFrame(data))
    return pl.concat(frames, how="vertical")


# ----------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Check:
    """One inequality or identity of docs/theory.md section 7, as a test on table rows."""

    name: str
    statement: str
    theorem: str
    scope: pl.Expr                             # rows the check is about
    assumption: pl.Expr                        # rows where the theorem's assumptions hold
    slack: pl.Expr                             # >= -tolerance when the inequality holds
    tol: pl.Expr = field(default_factory=lambda: pl.lit(TOL))


def _full() -> pl.Expr:
    return pl.col("method") == "full"


def _kept() -> pl.Expr:
    return pl.col("method") != "full"


def _checks(stated: bool) -> list[Check]:
    defined = pl.col("bound_margin").is_not_null() & pl.col("bound_margin").is_not_nan()
    contains = pl.col("contains_useful") & (pl.col("kept_useful") > 0)
    both = (pl.col("kept_useful") > 0) & (pl.col("kept_distractors") > 0)
    out = [
        Check("alpha_from_logits", "alpha computed from p equals alpha from the logits", "sanity",
              _full(), pl.lit(True), -(pl.col("alpha") - pl.col("alpha_logits")).abs()),
        Check("margin_lower", "alpha >= 1/(1 + (|D|/|U|) e^-Delta), Delta = min l_U - max l_D", "Theorem 1",
              _full() & defined, pl.lit(True), pl.col("slack_margin")),
        Check("mean_margin_lower", "alpha >= 1/(1 + (|D|/|U|) e^-(mean l_U - max l_D))", "Theorem 1 (Jensen)",
              _full() & defined, pl.lit(True), pl.col("slack_mean")),
        Check("spread_upper", "alpha <= 1/(1 + (|D|/|U|) e^-Gamma), Gamma = max l_U - min l_D", "Theorem 1 (upper)",
              _full() & defined, pl.lit(True), pl.col("slack_upper")),
        Check("kept_raises_alpha", "U in A  =>  alpha_A >= alpha", "Theorem 2",
              _kept() & pl.col("alpha_kept").is_not_nan(), contains,
              pl.col("alpha_kept") - pl.col("alpha")),
        Check("alpha_rho_identity", "U in A  =>  alpha_A = Z_U / (Z_U + rho Z_D)", "Theorem 2",
              _kept() & pl.col("alpha_kept").is_not_nan(), contains,
              -(pl.col("alpha_kept") - pl.col("alpha_rho")).abs()),
        Check("share_criterion", "alpha_A >= alpha  <=>  sigma_U >= sigma_D (any A)", "Theorem 2'",
              _kept() & pl.col("alpha_kept").is_not_nan() & pl.col("sigma_distractor").is_not_nan()
              & (pl.col("alpha") > 0) & (pl.col("alpha") < 1), pl.lit(True),
              # sign agreement: a disagreement beyond the tolerance is a violation
              pl.when(((pl.col("alpha_kept") - pl.col("alpha")) > TOL)
                      & ((pl.col("sigma_useful") - pl.col("sigma_distractor")) < -TOL)).then(-1.0)
              .when(((pl.col("alpha_kept") - pl.col("alpha")) < -TOL)
                    & ((pl.col("sigma_useful") - pl.col("sigma_distractor")) > TOL)).then(-1.0)
              .otherwise((pl.col("alpha_kept") - pl.col("alpha")).abs())),
        Check("margin_lower_kept", "alpha_A >= 1/(1 + (|D n A|/|U n A|) e^-Delta_A)", "Theorem 1 on A",
              _kept() & both, pl.lit(True), pl.col("slack_margin_kept")),
        Check("error_identity", "U in A  =>  ||m_A - m_U|| = (1 - alpha_A) ||m_{D n A} - m_U||", "Theorem 3",
              _kept() & pl.col("err_kept").is_not_nan(), contains, -pl.col("identity_gap"),
              TOL * (1 + pl.col("value_scale"))),
        Check("error_bound", "U in A  =>  ||m_A - m_U|| <= (1 - alpha_A) max_{i in D n A} ||v_i - m_U||", "Theorem 3",
              _kept() & pl.col("err_kept").is_not_nan(), contains,
              pl.col("err_bound") - pl.col("err_kept"), TOL * (1 + pl.col("value_scale"))),
        Check("error_scaling", "U in A  =>  err_A / err = (1 - alpha_A)/(1 - alpha) x value_shift", "Theorem 3",
              _kept() & pl.col("err_ratio").is_finite() & pl.col("value_shift").is_finite()
              & (pl.col("alpha") < 1 - 1e-6), contains,
              -(pl.col("err_ratio") - pl.col("error_scaling") * pl.col("value_shift")).abs(),
              TOL * (1 + pl.col("err_ratio").abs()) * 1e3),
    ]
    if stated:
        out.append(Check("stated_margin_lower", "Delta >= Delta_0  =>  alpha >= 1/(1 + (|D|/|U|) e^-Delta_0)",
                         "Theorem 1 (stated margin)", _full() & defined, pl.col("stated_holds"),
                         pl.col("slack_stated")))
    return out


CHECKS = tuple(c.name for c in _checks(True))
"""Names of the checks :func:`bound_checks` reports (``stated_margin_lower`` only with ``--margin``)."""


def bound_checks(table: pl.DataFrame, stated: bool = False) -> pl.DataFrame:
    """One row per check: rows in scope, where the assumptions hold and fail, violations in
    each (slack below -tolerance), and the slack's min / median / max where they hold."""
    out = []
    for c in _checks(stated):
        d = table.filter(c.scope).with_columns(
            c.assumption.fill_null(False).alias("_holds"), c.slack.alias("_slack"), c.tol.alias("_tol"))
        holds = d.filter(pl.col("_holds"))
        fails = d.filter(~pl.col("_holds"))
        sl = holds["_slack"].drop_nans().drop_nulls()
        out.append({
            "check": c.name, "theorem": c.theorem, "statement": c.statement, "rows": d.height,
            "assumption_holds": holds.height, "violations": int((holds["_slack"] < -holds["_tol"]).sum()),
            "assumption_fails": fails.height,
            "violations_when_fails": int((fails["_slack"] < -fails["_tol"]).sum()),
            "slack_min": float(sl.min()) if sl.len() else None,
            "slack_median": float(sl.median()) if sl.len() else None,
            "slack_max": float(sl.max()) if sl.len() else None,
        })
    return pl.DataFrame(out, infer_schema_length=None)


def head_table(table: pl.DataFrame) -> pl.DataFrame:
    """Per (layer, query head, kept set, s): medians and means of the dilution quantities.

    ``s`` of the full cache is null (A = every key of each row). Rows whose useful keys are
    not visible (e.g. a fact after the query position) count in ``rows`` only.
    """
    t = table.with_columns(pl.when(pl.col("method") == "full").then(None).otherwise(pl.col("s")).alias("s"))
    vis = pl.col("useful_visible")
    return (t.group_by("layer", "q_head", "method", "s").agg(
        pl.len().alias("rows"), vis.sum().alias("rows_useful_visible"),
        pl.col("alpha").filter(vis).mean().alias("alpha_mean"),
        pl.col("alpha").filter(vis).median().alias("alpha_median"),
        pl.col("alpha_kept").filter(vis).mean().alias("alpha_kept_mean"),
        pl.col("alpha_kept").filter(vis).median().alias("alpha_kept_median"),
        pl.col("contains_useful").filter(vis).mean().alias("contains_useful_share"),
        pl.col("error_scaling").filter(vis & pl.col("error_scaling").is_finite()).median().alias("error_scaling_median"),
        pl.col("err_ratio").filter(vis & pl.col("err_ratio").is_finite()).median().alias("err_ratio_median"),
        pl.col("margin").filter(vis).median().alias("margin_median"),
        pl.col("mass_sink").mean().alias("mass_sink_mean"),
        pl.col("mass_other_facts").mean().alias("mass_other_facts_mean"),
    ).sort("layer", "q_head", "method", "s", nulls_last=False))


# ----------------------------------------------------------------------------- runner


@dataclass
class CheckSummary:
    """What a check run did."""

    out: str
    rows: int
    table_rows: int
    blocks: int
    blocks_skipped: int
    violations: int
    seconds: float


def _job(store: Any, cfg: CheckConfig) -> dict[str, Any]:
    man = store.manifest
    return {"rows": str(Path(store.path).resolve()), "created": man["created"],
            "index_sha256": man.get("index_sha256"), "counts": man["counts"], "config": asdict(cfg),
            "version": 1}


def _parts_dir(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def _check_out(out: Path, overwrite: bool) -> Path:
    """The output rule (:func:`evictlab.io.check_output_file`), except that an ``out`` whose
    parts folder is still there belongs to an interrupted run (killed while writing its
    outputs, :func:`evictlab.parts.finished`): it is finished, not refused."""
    from evictlab.io import check_output_file, check_output_path
    from evictlab.parts import finished

    if out.exists() and not finished(out, _parts_dir(out)):
        return check_output_path(out, "--out", directory=False)
    return check_output_file(out, "--out", overwrite=overwrite)


def run_check(rows: str | Path, out: str | Path, cfg: CheckConfig, *, overwrite: bool = False,
              progress: bool = True, make_report: bool = True) -> CheckSummary:
    """Run the check of the dataset ``rows`` into ``out`` (module docstring); resumable."""
    import time

    from tqdm.auto import tqdm

    from evictlab.io import write_checked_parquet
    from evictlab.parts import PartStore
    from evictlab.record import RunRecord, record_path
    from evictlab.rows.reader import RowStore

    cfg.check()
    out = _check_out(Path(out), overwrite)
    store = RowStore.open(rows)
    labels = prompt_labels(store, cfg.useful)  # refuses unlabelled datasets
    n_max = int(store.meta["n"].max())
    too_big = [s for s in cfg.budgets if s >= n_max]  # a kept set of s keys needs rows of n > s keys
    if too_big:
        raise InputError("--keep", f"budget {too_big[0]} is not below any row's key count (the rows of {rows} "
                         f"have at most {n_max} keys)", f"use budgets below {n_max}")
    record = RunRecord(kind="dilution.check", config={"rows": str(rows), **asdict(cfg)}, model=store.manifest["model"])
    t0 = time.perf_counter()
    meta = store.meta
    blocks = meta["block"].unique(maintain_order=True).to_list()
    n_layers = int(meta["layer"].max()) + 1
    chunks = [blocks[i:i + cfg.chunk_blocks] for i in range(0, len(blocks), cfg.chunk_blocks)]
    keys = [f"{k:05d}" for k in range(len(chunks))]
    parts = PartStore(_parts_dir(out), _job(store, cfg), keys)
    with parts.lock(out):
        _check_out(out, overwrite)  # again: another run may have finished meanwhile
        parts.open()
        todo = [(k, c) for k, c in zip(keys, chunks) if not parts.done(k)]
        skipped = sum(len(c) for k, c in zip(keys, chunks) if parts.done(k))
        bar = tqdm(total=len(blocks), initial=skipped, desc="dilution check", unit="block", disable=not progress)
        block_prompt = dict(zip(meta["block"].to_list(), meta["prompt_id"].to_list()))
        for k, chunk in todo:
            frames = []
            for rb in _blocks(store, chunk):
                pid = block_prompt[int(rb.meta["block"][0])]
                frames.append(check_block(rb, labels[pid], cfg, n_layers))
                bar.update(1)
            df = pl.concat(frames, how="vertical") if frames else pl.DataFrame()
            parts.write(k, df.with_columns(pl.lit(store.manifest["model"]).alias("model"),
                                           pl.lit(store.manifest["capture_mode"]).alias("protocol")))
        bar.close()
        table = parts.collect()
        checks = bound_checks(table, cfg.stated_margin is not None)
        heads = head_table(table)
        # The files beside the table first, the table next, the run record last, and only then
        # the parts folder goes: a run killed anywhere before that leaves its parts, and the
        # rerun finishes it (the parts are intact, the outputs are written again).
        for name, df in (("heads", heads), ("bounds", checks)):
            write_checked_parquet(df, out.with_name(f"{out.stem}.{name}.parquet"))
        if make_report:
            from evictlab.dilution.report import check_report

            check_report(out, table, heads, checks, cfg, store)
        write_checked_parquet(table, out)
        violations = int(checks["violations"].sum())
        summary = CheckSummary(out=str(out), rows=store.n_rows, table_rows=table.height, blocks=len(blocks),
                               blocks_skipped=skipped, violations=violations,
                               seconds=round(time.perf_counter() - t0, 2))
        record.write(record_path(out), output=str(out), summary=asdict(summary),
                     checks=checks.select("check", "violations", "assumption_holds").to_dicts())
        parts.remove()
    return summary

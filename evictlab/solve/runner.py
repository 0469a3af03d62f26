"""The rows -> results runner behind ``evictlab solve`` (resumable, one part file per chunk).

For every row of a dataset and every budget s it computes (``docs/solvers.md``): ``e_top``
(forced error of T_s), ``es_hat`` (exact optimum over the candidate pool, bounded
enumeration), ``e_bal`` (balancing selector), free-weight errors of T_s and of the argmin,
the dropped mass and entropy, and optionally the certified optimum over all keys. Output:
one Parquet row per (row_id, s) with the columns of :data:`RESULT_COLUMNS` (the contract
"Solver results" in ``docs/architecture.md``).

Resumability (the part store, :mod:`evictlab.parts`): the rows (in ``row_id`` order) are cut
into chunks of ``chunk_rows``; chunk k is written atomically to
``<out>.parts/part-{k:05d}.parquet`` with its checksum in its own footer
(:func:`evictlab.io.write_checked_parquet`, as ``<out>``). A rerun with the same job
(dataset content, budgets, pool, ...) first checks every part already written (checksum,
readable, and here the expected rows and columns; a part without a checksum, from an older
evictlab, is recomputed), discards and reports a damaged one, and computes only the missing
chunks; when all are there they are concatenated into ``<out>`` atomically, a run record is
written beside it, and the parts folder is removed (a ``<out>`` with its parts folder still
beside it is unfinished: the same command finishes it). Interrupting a run (Ctrl-C, kill) leaves only complete
parts. Where the time went is recorded per phase (:data:`PHASES`, seconds) in the summary
and the run record (``phases_s``), so a slowdown shows which phase grew. One run per ``--out``: the run holds ``<out>``'s lock (``evictlab.io``), so a second
run on the same output is refused at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from math import comb
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable

import numpy as np
import polars as pl

from evictlab.errors import InputError
from evictlab.io import check_output_path, exclusive_lock, remove_temp_files, write_checked_parquet
from evictlab.parts import PartStore, finished
from evictlab.record import RunRecord, record_path

#: ``kappa_hat = e_top / max(es_hat, KAPPA_EPS)`` (absolute, in value units).
KAPPA_EPS = 1e-12
#: A row's ``e_top`` counts as zero when ``e_top <= ZERO_REL * max(max_i ||v_i - mu||, ||mu||)``
#: (rounding level); such rows are kept and flagged ``e_top_zero``, with null gap/kappa.
ZERO_REL = 1e-12
#: Default cap on the number of subsets enumerated per (row, s): C(|C_s|, s).
MAX_SUBSETS = 100_000_000

#: Columns of the results table, in order (``--certify`` adds :data:`CERT_COLUMNS`).
RESULT_COLUMNS: tuple[str, ...] = (
    "row_id", "s", "n", "e_top", "es_hat", "e_bal", "gap_closed", "kappa_hat", "dropped_mass",
    "e_free_top", "e_free_opt", "pi_top", "pi_opt", "kept", "kept_pos", "e_top_zero", "entropy",
    "prompt_id", "layer", "q_head", "kv_head", "position", "model", "pool_size", "n_subsets",
    "n_swaps", "kept_bal",
)
CERT_COLUMNS: tuple[str, ...] = ("es_cert", "cert_status", "cert_lb", "cert_gap", "cert_nodes", "kept_cert")
#: Columns added by ``--search all`` (the all-key local search, ``evictlab.solve.localsearch``).
LS_COLUMNS: tuple[str, ...] = ("es_ls", "gap_closed_ls", "kept_ls", "ls_moves")
#: Columns added by ``--bound`` (the lower bound of ``evictlab.solve.bound``, at any n).
BOUND_COLUMNS: tuple[str, ...] = ("es_lb", "es_bb", "gap_closed_ub", "gap_closed_bb", "lb_status", "lb_nodes")
#: Values of ``--search``: the candidate pool only, or also the all-key search.
SEARCH_MODES: tuple[str, ...] = ("pool", "all")


@dataclass(frozen=True)
class SolveConfig:
    """Everything that changes the numbers of a solve run (stored in the job file).

    budgets: the s values; r_m, r_e: pool parameters C_s(r_m, r_e); max_swaps: balancing
    swap limit K; certify: also run branch and bound over all keys for rows with
    ``n <= cert_max_n`` and ``s <= cert_max_s`` (others get status "skipped") with at most
    ``cert_nodes`` bound evaluations per (row, s); chunk_rows: rows per part file;
    max_subsets: refuse pools whose C(|C_s|, s) exceeds it. search: ``"pool"``, or ``"all"``
    to add the all-key local search (columns :data:`LS_COLUMNS`) with a pair shortlist of
    ``ls_pairs`` keys, ``ls_kicks`` perturbation rounds and seed ``ls_seed``. The
    certificate is seeded with the all-key search's set (run internally for the certified
    rows when ``search == "pool"``). bound: also the certified lower bound on ES(s) of
    every (row, s) at any n (:mod:`evictlab.solve.bound`, columns :data:`BOUND_COLUMNS`)
    with at most ``bound_nodes`` node evaluations, seeded like the certificate.
    """

    budgets: tuple[int, ...]
    r_m: int = 2
    r_e: int = 2
    max_swaps: int = 64
    certify: bool = False
    cert_max_n: int = 256
    cert_max_s: int = 8
    cert_nodes: int = 20_000_000
    chunk_rows: int = 4096
    max_subsets: int = MAX_SUBSETS
    search: str = "pool"
    ls_pairs: int = 8
    ls_kicks: int = 0
    ls_seed: int = 0
    bound: bool = False
    bound_nodes: int = 64

    def to_dict(self) -> dict[str, Any]:
        """The job's settings (the bound's only when it is on: runs without ``--bound`` keep
        the job files and run records they had before it existed)."""
        d = asdict(self)
        d["budgets"] = list(self.budgets)
        if not self.bound:
            del d["bound"], d["bound_nodes"]
        return d


def _int(x: Any, name: str, lo: int) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or int(x) < lo:
        raise InputError(name, f"must be an integer >= {lo}, got {x!r}", f"pass an integer >= {lo}")
    return int(x)


def check_config(cfg: SolveConfig, n_min: int, n_max: int, n_min_row: int | None = None) -> SolveConfig:
    """Validate a config against the dataset's key counts; returns it with budgets sorted.

    Raises :class:`InputError` for an empty or non-positive budget list, duplicates, a
    budget above the smallest row's n (``budgets s > n`` are rejected, never skipped), bad
    pool parameters, or a pool whose enumeration exceeds ``max_subsets``.
    """
    if len(cfg.budgets) == 0:
        raise InputError("--keep", "no budget given", "pass e.g. --keep 4 8 16 32")
    bud = [_int(s, "--keep", 1) for s in cfg.budgets]
    if len(set(bud)) != len(bud):
        raise InputError("--keep", f"has duplicates {bud}", "list each budget once")
    r_m = _int(cfg.r_m, "--pool (r_m)", 0)
    r_e = _int(cfg.r_e, "--pool (r_e)", 0)
    _int(cfg.max_swaps, "--max-swaps", 0)
    _int(cfg.chunk_rows, "--chunk-rows", 1)
    _int(cfg.cert_max_n, "--cert-max-n", 1)
    _int(cfg.cert_max_s, "--cert-max-s", 1)
    _int(cfg.cert_nodes, "--cert-nodes", 1)
    _int(cfg.max_subsets, "max_subsets", 1)
    check_bound_nodes(cfg.bound_nodes)
    if cfg.search not in SEARCH_MODES:
        raise InputError("--search", f"must be one of {', '.join(SEARCH_MODES)}, got {cfg.search!r}",
                         "pass --search pool (candidate pool only) or --search all (also the all-key search)")
    _int(cfg.ls_pairs, "--ls-pairs", 0)
    _int(cfg.ls_kicks, "--ls-kicks", 0)
    if _int(cfg.ls_seed, "--ls-seed", 0) >= 2**63:
        raise InputError("--ls-seed", f"must be below 2^63, got {cfg.ls_seed}", "pass a smaller seed")
    too_big = [s for s in bud if s > n_min]
    if too_big:
        where = f" (row_id {n_min_row})" if n_min_row is not None else ""
        raise InputError(
            "--keep", f"budget s = {too_big[0]} exceeds the number of keys n = {n_min} of the "
            f"shortest row{where}; a budget must satisfy s <= n for every row",
            f"use budgets <= {n_min}, or filter rows with n < {max(too_big)} out of the dataset")
    for s in bud:
        c = min(n_max, s + r_m + r_e)
        m = comb(c, s)
        if m > cfg.max_subsets:
            raise InputError(
                "--pool", f"s = {s} with pool size |C_s| = {c} means C({c}, {s}) = {m:.3e} subsets "
                f"per row, above the limit {cfg.max_subsets:.1e}",
                "lower r_m + r_e (e.g. --pool 2 2) or the budget")
    return SolveConfig(**{**asdict(cfg), "budgets": tuple(sorted(bud))})


def check_bound_nodes(x: Any) -> int:
    """``--bound-nodes``: an integer in ``1..BOUND_MAX_NODES`` (InputError otherwise)."""
    from evictlab.solve.bound import BOUND_MAX_NODES

    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or not 1 <= int(x) <= BOUND_MAX_NODES:
        raise InputError("--bound-nodes", f"must be an integer from 1 to {BOUND_MAX_NODES:,}, got {x!r}",
                         "pass e.g. --bound-nodes 64 (the default; more nodes: a tighter bound, slower)")
    return int(x)


def _list_col(name: str, arr: np.ndarray) -> pl.Series:
    """An ``(N, k)`` int64 array as a polars ``list[i64]`` column."""
    if arr.shape[1] == 0:
        return pl.Series(name, [[] for _ in range(arr.shape[0])], dtype=pl.List(pl.Int64))
    return pl.Series(name, np.ascontiguousarray(arr)).cast(pl.List(pl.Int64))


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` with the conventions of pi: inf if den = 0 < num, NaN (-> null) if both 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = num / den
    r = np.where((den == 0) & (num == 0), np.nan, r)
    return np.where((den == 0) & (num > 0), np.inf, r)


def solve_batch(batch: Any, cfg: SolveConfig, model: str | None = None) -> pl.DataFrame:
    """Solve one :class:`evictlab.rows.batch.RowBatch` for every budget; one row per (row_id, s).

    ``cfg`` must already be checked (:func:`check_config`). Rows are sorted by
    ``(row_id, s)``. Columns: :data:`RESULT_COLUMNS` (+ :data:`LS_COLUMNS` with
    ``search == "all"``, + :data:`CERT_COLUMNS` with certify).
    """
    from evictlab.core.threads import single_blas_thread
    from evictlab.solve.bound import LB_STATUS_NAMES, batch_bound
    from evictlab.solve.certify import STATUS_NAMES, batch_certify
    from evictlab.solve.kernels import batch_solve
    from evictlab.solve.localsearch import batch_localsearch

    p = np.ascontiguousarray(batch.p, dtype=np.float64)
    off = np.ascontiguousarray(batch.p_off, dtype=np.int64)
    vals = np.ascontiguousarray(batch.values, dtype=np.float64)
    vs = np.ascontiguousarray(batch.v_start, dtype=np.int64)
    bud = np.asarray(cfg.budgets, dtype=np.int64)
    n = np.diff(off)
    if n.size and int(n.min()) < int(bud.max()):
        i = int(np.argmin(n))
        raise InputError("--keep", f"budget s = {int(bud.max())} exceeds n = {int(n[i])} of row_id "
                         f"{int(batch.meta['row_id'][i])}", "use budgets <= the smallest n")
    # LAPACK calls inside the Numba threads (SVD in the certificate, the exact free-weight
    # phase) must not start their own BLAS thread pools (single_blas_thread).
    with single_blas_thread():
        (e_top, es_hat, e_bal, dropped, kept_top, kept_opt, kept_bal, pool_size, n_sub, n_sw, ent,
         ef_top, ef_opt, scale) = batch_solve(p, off, vals, vs, bud, cfg.r_m, cfg.r_e, cfg.max_swaps)
        row_ids = np.ascontiguousarray(batch.meta["row_id"].to_numpy(), dtype=np.int64)
        todo = np.zeros((n.shape[0], bud.shape[0]), dtype=np.bool_)
        if cfg.search == "all" or cfg.bound:  # the all-key set also seeds the bound
            todo[:] = True
        elif cfg.certify:  # the all-key set seeds the certificate (rows it will certify)
            todo[:] = (n[:, None] <= cfg.cert_max_n) & (bud[None, :] <= cfg.cert_max_s)
        if todo.any():
            es_ls, kept_ls, moves_ls = batch_localsearch(
                p, off, vals, vs, bud, row_ids, kept_top, kept_opt, kept_bal, es_hat, todo,
                cfg.ls_pairs, cfg.ls_kicks, cfg.ls_seed)
        if cfg.certify:
            seeds = np.stack([kept_opt, kept_ls]) if todo.any() else kept_opt[None]
            es_c, kept_c, st_c, lb_c, nodes_c = batch_certify(
                p, off, vals, vs, bud, seeds, cfg.cert_max_n, cfg.cert_max_s, cfg.cert_nodes)
        if cfg.bound:
            lb_b, ub_b, st_b, nodes_b = batch_bound(p, off, vals, vs, bud, np.stack([kept_opt, kept_ls]),
                                                    cfg.bound_nodes)
    meta = batch.meta
    key_index = np.asarray(batch.key_index, dtype=np.int64)
    frames = []
    for b, s in enumerate(cfg.budgets):
        et, eh = e_top[:, b], es_hat[:, b]
        zero = et <= ZERO_REL * scale
        with np.errstate(divide="ignore", invalid="ignore"):
            gap = np.where(zero, np.nan, (et - eh) / et)
            kap = np.where(zero, np.nan, et / np.maximum(eh, KAPPA_EPS))
        ko = kept_opt[:, b, :s]
        pos = key_index[off[:-1, None] + ko]
        cols: dict[str, Any] = {
            "row_id": meta["row_id"].to_numpy(),
            "s": np.full(n.shape[0], s, dtype=np.int64),
            "n": n,
            "e_top": et,
            "es_hat": eh,
            "e_bal": e_bal[:, b],
            "gap_closed": gap,
            "kappa_hat": kap,
            "dropped_mass": dropped[:, b],
            "e_free_top": ef_top[:, b],
            "e_free_opt": ef_opt[:, b],
            "pi_top": _ratio(et, ef_top[:, b]),
            "pi_opt": _ratio(eh, ef_opt[:, b]),
        }
        df = pl.DataFrame(cols).with_columns(
            pl.col("gap_closed", "kappa_hat", "pi_top", "pi_opt").fill_nan(None))
        df = df.with_columns(
            _list_col("kept", ko), _list_col("kept_pos", pos),
            pl.Series("e_top_zero", zero), pl.Series("entropy", ent),
            meta["prompt_id"], meta["layer"], meta["q_head"], meta["kv_head"], meta["position"],
            pl.lit(model, dtype=pl.String).alias("model"),
            pl.Series("pool_size", pool_size[:, b]), pl.Series("n_subsets", n_sub[:, b]),
            pl.Series("n_swaps", n_sw[:, b]), _list_col("kept_bal", kept_bal[:, b, :s]),
        )
        if cfg.search == "all":
            el = es_ls[:, b]
            with np.errstate(divide="ignore", invalid="ignore"):
                gap_ls = np.where(zero, np.nan, (et - el) / et)
            df = df.with_columns(
                pl.Series("es_ls", el), pl.Series("gap_closed_ls", gap_ls).fill_nan(None),
                _list_col("kept_ls", kept_ls[:, b, :s]), pl.Series("ls_moves", moves_ls[:, b]))
        if cfg.certify:
            st = st_c[:, b]
            es = es_c[:, b]
            lb = lb_c[:, b]
            df = df.with_columns(
                pl.Series("es_cert", es).fill_nan(None),
                pl.Series("cert_status", [STATUS_NAMES[int(x)] for x in st], dtype=pl.String),
                pl.Series("cert_lb", lb).fill_nan(None),
                pl.Series("cert_gap", es - lb).fill_nan(None),
                pl.Series("cert_nodes", nodes_c[:, b]),
                _list_col("kept_cert", kept_c[:, b, :s]),
            ).with_columns(
                pl.when(pl.col("cert_status") == "skipped").then(None)
                .otherwise(pl.col("kept_cert")).alias("kept_cert"))
        if cfg.bound:
            lb, bb = lb_b[:, b], np.minimum(ub_b[:, b], es_ls[:, b])
            with np.errstate(divide="ignore", invalid="ignore"):
                g_ub = np.where(zero, np.nan, (et - lb) / et)
                g_bb = np.where(zero, np.nan, (et - bb) / et)
            df = df.with_columns(
                pl.Series("es_lb", lb), pl.Series("es_bb", bb),
                pl.Series("gap_closed_ub", g_ub).fill_nan(None), pl.Series("gap_closed_bb", g_bb).fill_nan(None),
                pl.Series("lb_status", [LB_STATUS_NAMES[int(x)] for x in st_b[:, b]], dtype=pl.String),
                pl.Series("lb_nodes", nodes_b[:, b]))
        frames.append(df)
    out = pl.concat(frames, how="vertical").sort(["row_id", "s"])
    return out.select(result_columns(cfg))


def result_columns(cfg: SolveConfig) -> list[str]:
    """The columns of a results table (and of every part file) solved with ``cfg``, in order."""
    return (list(RESULT_COLUMNS) + (list(LS_COLUMNS) if cfg.search == "all" else [])
            + (list(CERT_COLUMNS) if cfg.certify else []) + (list(BOUND_COLUMNS) if cfg.bound else []))


@dataclass
class SolveSummary:
    """What a call of :func:`solve_rows` did."""

    out: Path | None
    parts_total: int
    parts_done_before: int
    parts_written: int
    rows: int
    complete: bool
    record: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)


#: The phases of a local solve, in order, timed into ``SolveSummary.extra["phases_s"]`` and the
#: run record: ``open`` (the dataset, its index, the job), ``checks`` (verifying parts already
#: written), ``compile`` (the first call of the kernels on a one-row batch: Numba compiles them,
#: ~50 s of CPU after any change to a kernel file, or loads them from its cache, under 1 s),
#: ``read`` (rows from the shards, p recomputed), ``solve`` (the kernels: enumeration,
#: selector, free-weight solves, all-key search, certificate; and the result frames),
#: ``write`` (part files with their checksums), ``collect`` (the parts verified and read back),
#: ``write_out`` (the results file), ``record`` (the run record).
PHASES = ("open", "checks", "compile", "read", "solve", "write", "collect", "write_out", "record")


def warm_kernels(cfg: SolveConfig, d: int) -> None:
    """Run :func:`solve_batch` once on a one-row batch of head dim ``d``, so the kernels
    ``cfg`` uses are compiled (or loaded from Numba's cache) before any row is solved, and
    that cost is timed as its own phase."""
    from evictlab.rows.batch import RowBatch

    n = int(max(cfg.budgets)) + cfg.r_m + cfg.r_e + 2
    rng = np.random.default_rng(0)
    meta = pl.DataFrame({"row_id": [0], "prompt_id": [0], "layer": [0], "q_head": [0], "kv_head": [0],
                         "position": [-1], "n": [n]}, schema={c: pl.Int64 for c in
                                                          ("row_id", "prompt_id", "layer", "q_head", "kv_head",
                                                           "position", "n")})
    batch = RowBatch(p=rng.dirichlet(np.ones(n)), p_off=np.array([0, n], dtype=np.int64),
                     values=rng.standard_normal((n, d)), v_start=np.zeros(1, dtype=np.int64),
                     key_index=np.arange(n, dtype=np.int64), meta=meta)
    solve_batch(batch, cfg)


class _Clock:
    """Seconds per phase (:data:`PHASES`)."""

    def __init__(self) -> None:
        self.s = {p: 0.0 for p in PHASES}
        self.t = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the last lap to ``phase``."""
        now = time.perf_counter()
        self.s[phase] += now - self.t
        self.t = now

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.s.items()}


def parts_dir_for(out: Path) -> Path:
    """Folder of the part files of ``out`` (``RESULTS.parquet`` -> ``RESULTS.parquet.parts``)."""
    return out.with_name(out.name + ".parts")


def _dataset_id(store: Any) -> str:
    """A digest identifying the dataset content (its shards' checksums and row count)."""
    man = store.manifest
    h = hashlib.sha256()
    h.update(json.dumps([sh.get("sha256") for sh in man.get("shards", [])]).encode())
    h.update(str(store.n_rows).encode())
    return h.hexdigest()[:16]


def _part_check(ids: Callable[[int], np.ndarray], cfg: SolveConfig) -> Callable[[str, pl.DataFrame], str | None]:
    """The content check of an intact part (:class:`~evictlab.parts.PartStore`'s ``check``):
    part ``k`` holds the columns of ``cfg`` and the (row_id, s) pairs of rows ``ids(k)``, in
    order (checked without recomputing anything)."""

    def check(key: str, df: pl.DataFrame) -> str | None:
        if df.columns != result_columns(cfg):
            return "has other columns than this job writes"
        rows = ids(int(key))
        want_ids = np.repeat(rows, len(cfg.budgets))
        want_s = np.tile(np.asarray(cfg.budgets, dtype=np.int64), rows.shape[0])
        try:
            ok = (np.array_equal(df["row_id"].to_numpy(), want_ids)
                  and np.array_equal(df["s"].to_numpy(), want_s))
        except Exception:  # noqa: BLE001 -- a column of an unexpected type
            ok = False
        return None if ok else "does not hold the expected (row_id, s) pairs"

    return check


def solve_rows(
    rows: str | Path,
    out: str | Path,
    cfg: SolveConfig,
    *,
    threads: int | None = None,
    overwrite: bool = False,
    restart: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    on_rows: Callable[[int], None] | None = None,
    notify: Callable[[str], None] | None = None,
    executor: Any = None,
) -> SolveSummary:
    """Solve every row of the dataset at ``rows`` and write ``out`` (Parquet), resumably.

    Args:
        rows: row dataset directory (``evictlab.rows``); it must be complete.
        out: results file; its parent folder must exist. Its part files live in
            ``<out>.parts/`` until the end; the run holds ``out``'s lock throughout.
        cfg: the solve configuration (checked here against the dataset).
        threads: CPU threads of the Numba kernels (``None`` or 0: Numba's default, all cores;
            the meaning of ``--threads`` in every command).
        overwrite: replace an existing ``out``; restart: discard part files of an earlier,
            different job instead of refusing.
        progress: show a tqdm bar (rows); stop_after: write at most this many new parts,
            then return without concatenating (used to test interruption).
        on_rows: optional callback with the number of rows finished after each part.
        notify: optional callback receiving one-line notices (a damaged part discarded).
        executor: where the parts are computed (:mod:`evictlab.executor`); None or a
            :class:`~evictlab.executor.LocalExecutor`: here, streaming the rows; a
            :class:`~evictlab.executor.ray_backend.RayExecutor`: one Ray task per part
            (:func:`solve_part`, ``threads`` CPUs each, 1 if 0), the driver writes the parts.
    """
    import numba

    threads = threads or None  # 0 = the library default, as --threads everywhere
    if threads is not None:
        _int(threads, "--threads", 1)
        if threads > numba.config.NUMBA_NUM_THREADS:
            raise InputError("--threads", f"{threads} exceeds the {numba.config.NUMBA_NUM_THREADS} "
                             "threads Numba was started with", "use fewer threads (or set NUMBA_NUM_THREADS)")
    out = check_output_path(out, "--out", directory=False)
    with exclusive_lock(out, "--out"):
        if finished(out, parts_dir_for(out)) and not overwrite:  # a results file with its parts beside it is unfinished
            raise InputError("--out", f"{out} already exists", "pass --overwrite or choose another --out")
        if threads is not None:
            numba.set_num_threads(threads)
        return _solve_locked(Path(rows), out, cfg, threads, restart, progress, stop_after, on_rows,
                             notify or (lambda msg: None), executor)


def _solve_locked(rows: Path, out: Path, cfg: SolveConfig, threads: int | None, restart: bool,
                  progress: bool, stop_after: int | None, on_rows: Callable[[int], None] | None,
                  notify: Callable[[str], None], executor: Any) -> SolveSummary:
    """:func:`solve_rows` once ``out``'s lock is held."""
    from tqdm import tqdm

    from evictlab.rows.reader import RowStore

    remote = executor is not None and executor.name != "local"
    record = RunRecord(kind="solve", config={**cfg.to_dict(), "rows": str(rows), "threads": threads,
                                             "executor": "ray" if remote else "local"})
    clock = _Clock()
    store = RowStore.open(rows)
    index = store.meta.select("row_id", "n").sort("row_id")
    ids = index["row_id"].to_numpy()
    nn = index["n"].to_numpy()
    i_min = int(np.argmin(nn))
    cfg = check_config(cfg, int(nn[i_min]), int(nn.max()), int(ids[i_min]))
    model = store.manifest.get("model")
    record.model = model
    n_parts = (ids.shape[0] + cfg.chunk_rows - 1) // cfg.chunk_rows

    def chunk(k: int) -> np.ndarray:
        return ids[k * cfg.chunk_rows:(k + 1) * cfg.chunk_rows]

    # The dataset is named by its content digest (its path is recorded, not compared: a moved
    # dataset still resumes).
    job = {"dataset": _dataset_id(store), "n_rows": int(ids.shape[0]), "config": cfg.to_dict()}
    parts = PartStore(parts_dir_for(out), job, [f"{k:05d}" for k in range(n_parts)], info={"rows": str(rows.resolve())},
                      check=_part_check(chunk, cfg), restart_option="--restart",
                      notify=lambda line: notify(f"warning: {line}"))
    remove_temp_files(out.parent, (out.name,))
    clock.lap("open")
    parts.open(restart)  # every part already there is checked before anything is computed
    done = [int(k) for k in parts.units if parts.done(k)]
    clock.lap("checks")
    pending = [int(k) for k in parts.pending()]
    written = 0
    rows_done = sum(chunk(k).shape[0] for k in done)
    if pending:
        if remote:
            tasks = [SolvePart(str(rows.resolve()), job["dataset"], k, int(chunk(k)[0]), int(chunk(k)[-1]), cfg,
                               model, threads or 1) for k in pending]
            from evictlab.executor import TaskSpec, task_bar

            bar: Any = task_bar("solve", initial=len(done), disable=not progress)
            results = _remote_parts(executor, tasks, TaskSpec(cpus=threads or 1), bar)
        else:
            warm_kernels(cfg, store.head_dim)
            clock.lap("compile")
            bar = tqdm(total=int(ids.shape[0]), initial=rows_done, unit="row", desc="solve",
                       disable=not progress)
            results: Iterator[tuple[int, pl.DataFrame]] = _local_parts(store, pending, chunk, cfg, model, bar, clock)
        try:
            for k, df in results:
                clock.lap("solve")  # a remote run: the wait for the part
                parts.write(f"{k:05d}", df)
                clock.lap("write")
                written += 1
                if on_rows is not None:
                    on_rows(chunk(k).shape[0])
                if stop_after is not None and written >= stop_after:
                    break
        finally:
            results.close()  # cancels the tasks still out (Ray) after a break or an error
            bar.close()
    complete = not parts.pending()
    summary = SolveSummary(out=None, parts_total=n_parts, parts_done_before=len(done),
                           parts_written=written, rows=int(ids.shape[0]), complete=complete,
                           extra={"parts_discarded": list(parts.discarded), "phases_s": clock.rounded()})
    if not complete:
        return summary
    table = parts.collect()
    clock.lap("collect")
    write_checked_parquet(table, out)
    clock.lap("write_out")
    rec = record.write(record_path(out), output=str(out), rows_out=table.height,
                       parts=n_parts, parts_resumed=len(done), executor=record.config["executor"],
                       phases_s={k: v for k, v in clock.rounded().items() if k != "record"})
    clock.lap("record")
    summary.extra["phases_s"] = clock.rounded()
    parts.remove()
    summary.out = out
    summary.record = rec
    return summary


def _local_parts(store: Any, pending: list[int], chunk: Callable[[int], np.ndarray], cfg: SolveConfig,
                 model: str | None, bar: Any, clock: _Clock) -> Iterator[tuple[int, pl.DataFrame]]:
    """The local executor: stream the pending chunks' rows in ``row_id`` order (one shard in
    memory at a time) and solve each chunk here; yields ``(k, results)`` (the time reading a
    batch is charged to ``read``, solving it to ``solve``)."""
    todo_ids = np.concatenate([chunk(k) for k in pending])
    flt = pl.col("row_id").is_in(pl.Series(todo_ids).implode())
    for k, batch in zip(pending, store.iter_batches(cfg.chunk_rows, filter=flt)):
        clock.lap("read")
        got = batch.meta["row_id"].to_numpy()
        if not np.array_equal(np.sort(got), chunk(k)):
            raise RuntimeError(f"batch for part {k} does not hold the expected rows")
        df = solve_batch(batch, cfg, model)
        bar.update(batch.n_rows)
        yield k, df


def _remote_parts(executor: Any, tasks: list[SolvePart], spec: Any, bar: Any) -> Iterator[tuple[int, pl.DataFrame]]:
    """A remote executor: one task per part (:func:`solve_part`), yields ``(k, results)`` as
    parts finish; closing this generator cancels the tasks still out."""
    with contextlib.closing(executor.map(solve_part, tasks, spec=spec, on_progress=bar)) as it:
        for task, df in it:
            yield task.k, df


@dataclass(frozen=True)
class SolvePart:
    """One remote task: part ``k`` = rows ``first..last`` (row ids, inclusive) of the dataset at
    ``rows`` whose content digest is ``dataset``, solved with ``cfg`` on ``threads`` threads."""

    rows: str
    dataset: str
    k: int
    first: int
    last: int
    cfg: SolveConfig
    model: str | None
    threads: int


#: Row datasets opened by this worker process: path -> RowStore (shards verified once each).
_STORES: dict[str, Any] = {}


def worker_store(path: str, dataset: str) -> Any:
    """The dataset at ``path`` as this process sees it, checked to be the driver's (content
    digest ``dataset``): a node whose copy differs, is missing or is incomplete refuses with
    an InputError naming the node."""
    import socket

    from evictlab.rows.reader import RowStore

    store = _STORES.get(path)
    if store is None or _dataset_id(store) != dataset:
        try:
            store = RowStore.open(path)
        except InputError as exc:
            raise InputError(exc.field, f"on node {socket.gethostname()}: {exc.problem}",
                             "every node must read the same dataset at the same path (a shared folder, or "
                             f"identical copies); {exc.fix}") from None
        _STORES[path] = store
    got = _dataset_id(store)
    if got != dataset:
        raise InputError("ROWS", f"node {socket.gethostname()} reads a different dataset at {path} (content "
                         f"digest {got}, the driver's is {dataset}): rows of two datasets would be mixed",
                         "give every node the same dataset at the same path (a shared folder, or identical "
                         "copies)")
    return store


def solve_part(task: SolvePart) -> pl.DataFrame:
    """Solve one part (a Ray task, :class:`SolvePart`): the same rows and the same
    :func:`solve_batch` as the local run, so the same bits."""
    import numba

    store = worker_store(task.rows, task.dataset)
    numba.set_num_threads(min(task.threads, numba.config.NUMBA_NUM_THREADS))
    batches = list(store.iter_batches(task.last - task.first + 1,
                                      filter=pl.col("row_id").is_between(task.first, task.last)))
    got = batches[0].meta["row_id"].to_numpy() if len(batches) == 1 else None
    if got is None or not np.array_equal(got, np.arange(task.first, task.last + 1)):
        raise RuntimeError(f"part {task.k}: the dataset does not hold rows {task.first}..{task.last} in order")
    return solve_batch(batches[0], task.cfg, task.model)

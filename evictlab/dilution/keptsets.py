"""Kept sets A for the rows of one block: top-mass, the query-agnostic scorers, the pool optimum.

Every kept set has s keys among the keys its row sees (rows with ``n <= s`` evict nothing
and get no kept set). The sets, per row r at query position t (docs/dilution.md):

- ``top_mass``: T_s of the row's own weights (ties to the more recent key). It uses the
  row's own attention, so it is an ORACLE for that query, not a method.
- ``streaming_llm``, ``h2o``, ``snapkv``: the library's scorers
  (:data:`evictlab.methods.REGISTRY`) and :func:`~evictlab.methods.base.select_keep`
  (``sinks`` + ``recent`` always kept), run on the block's keys and values with the
  captured queries of the block's KV-head group at positions *before* t as the queries the
  scorer has seen (none of them is the row's own query). A row dataset holds queries only
  at the captured positions, so H2O accumulates over those queries only, and SnapKV's
  observation window is the latest captured query before t (``window=1``: keys after it
  count as inside the window). Rows with no earlier captured query get no H2O/SnapKV set.
  In a query-aware dataset the earlier queries are question tokens (then the sets are
  query-aware; the table's ``protocol`` column says so).
- ``pool``: the exact minimiser of the forced error e(A) over the s-subsets of the
  candidate pool C_s(r_m, r_e) (:func:`evictlab.solve.solve_batch`), limited to
  ``s <= pool_max_s`` because the enumeration grows as C(s + r_m + r_e, s).

ExpectedAttention and Compactor need the model's RoPE base per layer (not in a row
dataset), KVzip a reconstruction pass and the oracle scorer the future queries: they are
not evaluated here (the decode-time sweep, :mod:`evictlab.dilution.sweep`, runs them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from evictlab.errors import InputError

#: Kept-set names evaluated by ``evictlab dilution check``, in report order.
KEPT_SETS = ("top_mass", "streaming_llm", "h2o", "snapkv", "pool")
#: Registry scorers evaluated on row data, with the parameters forced by what rows hold.
ROW_SCORERS: dict[str, dict[str, int]] = {"streaming_llm": {}, "h2o": {}, "snapkv": {"window": 1}}
#: What each kept set is, for tables and reports.
KEPT_SET_NOTES = {
    "top_mass": "ORACLE for the row: T_s of its own attention",
    "streaming_llm": "sinks + most recent keys (query-agnostic)",
    "h2o": "attention accumulated over the captured queries before the row (query-agnostic)",
    "snapkv": "pooled attention of the latest captured query before the row, window=1 (query-agnostic)",
    "pool": "argmin of the forced error e(A) over the candidate pool C_s(r_m, r_e)",
}


@dataclass
class Block:
    """The rows of one (prompt, layer, KV head) block, densely laid out over its L keys.

    ``P``, ``logits``: float64 ``(R, L)``; ``visible`` bool ``(R, L)``; ``lo``, ``hi``: int64
    ``(R,)`` (row r sees keys ``[lo[r], hi[r])``); ``key_pos``: int64 ``(L,)`` absolute
    positions; ``values``: float64 ``(L, d)``; ``keys``: float64 ``(L, d)`` or None;
    ``queries``: float64 ``(R, d)`` (NaN rows: logits rows) or None; ``position``,
    ``q_head``: int64 ``(R,)``; ``scale``: float64 ``(R,)``; ``layer``, ``n_layers``: ints.
    """

    P: np.ndarray
    logits: np.ndarray
    visible: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    key_pos: np.ndarray
    values: np.ndarray
    keys: np.ndarray | None
    queries: np.ndarray | None
    position: np.ndarray
    q_head: np.ndarray
    scale: np.ndarray
    layer: int
    n_layers: int

    @property
    def n(self) -> np.ndarray:
        return self.hi - self.lo


def _empty(block: Block) -> tuple[np.ndarray, np.ndarray]:
    R, L = block.P.shape
    return np.zeros((R, L), bool), np.zeros(R, bool)


def top_mass(block: Block, s: int) -> tuple[np.ndarray, np.ndarray]:
    """``(kept (R, L), defined (R,))``: T_s of each row with n > s (ties to the larger index)."""
    from evictlab.core.kernels import batch_top_mass

    kept, defined = _empty(block)
    rows = np.flatnonzero(block.n > s)
    if rows.size:
        n = block.n[rows]
        off = np.concatenate([[0], np.cumsum(n)])
        p = np.concatenate([block.P[r, block.lo[r]:block.hi[r]] for r in rows])
        top = batch_top_mass(p, off, s)
        for i, r in enumerate(rows):
            kept[r, block.lo[r] + top[i]] = True
        defined[rows] = True
    return kept, defined


def check_budgets(budgets: tuple[int, ...], sinks: int, recent: int) -> None:
    """InputError (``--keep``) for a budget the scorers' always-kept keys do not fit in."""
    if not budgets or any(int(s) < 1 for s in budgets):
        raise InputError("--keep", f"{list(budgets)} is empty or has a budget below 1", "pass e.g. --keep 32,128")
    if len(set(budgets)) != len(budgets):
        raise InputError("--keep", f"{list(budgets)} repeats a budget", "list each budget once")
    low = [s for s in budgets if s < sinks + recent]
    if low:
        raise InputError("--keep", f"budget {low[0]} is below the scorers' {sinks} sinks + {recent} recent keys",
                         f"use budgets >= {sinks + recent} or lower --sinks/--recent")


def scorer(block: Block, name: str, s: int, *, sinks: int, recent: int) -> tuple[np.ndarray, np.ndarray]:
    """``(kept, defined)`` of registry scorer ``name`` (see the module docstring), size ``s``.

    The kept set depends only on the row's query position (a KV head keeps one set for
    its whole group), so it is computed once per position and shared by the group's heads.
    """
    import torch

    from evictlab.methods import make_scorer
    from evictlab.methods.base import ScoreInputs, select_keep

    kept, defined = _empty(block)
    sc = make_scorer(name, **ROW_SCORERS[name])
    uses_queries = name != "streaming_llm"
    heads = np.unique(block.q_head)
    have_q = block.queries is not None and np.isfinite(block.queries).all(axis=1)
    if block.keys is None:
        return kept, defined
    keys_t = torch.from_numpy(block.keys.astype(np.float32))[None, None]
    values_t = torch.from_numpy(block.values.astype(np.float32))[None, None]
    grid = {(int(h), int(p)): i for i, (h, p) in enumerate(zip(block.q_head, block.position))}
    for t in np.unique(block.position):
        at = np.flatnonzero(block.position == t)
        r0 = at[0]
        lo, hi = int(block.lo[r0]), int(block.hi[r0])
        n = hi - lo
        if n <= s:
            continue
        q = torch.zeros((1, len(heads), 0, block.values.shape[1]), dtype=torch.float32)
        q_pos = np.zeros(0, np.int64)
        if uses_queries:
            earlier = np.unique(block.position[block.position < t])
            idx = np.array([[grid.get((int(h), int(p)), -1) for p in earlier] for h in heads], np.int64)
            if earlier.size == 0 or (idx < 0).any() or not have_q[idx].all():
                continue  # no earlier captured query (or a head lacks one): no set for this position
            q = torch.from_numpy(block.queries[idx].astype(np.float32))[None]  # (1, heads, q, d)
            q_pos = earlier.astype(np.int64)
        pos = torch.from_numpy(block.key_pos[lo:hi].astype(np.int64))
        inputs = ScoreInputs(
            layer=block.layer, n_layers=block.n_layers, keys=keys_t[:, :, lo:hi], values=values_t[:, :, lo:hi],
            positions=pos, queries=q, q_positions=torch.from_numpy(q_pos), scaling=float(block.scale[r0]), state={})
        scores = sc.score(inputs).reshape(1, 1, n)
        keep = select_keep(scores, [s], pos, sinks=sinks, recent=recent)[0][0].numpy()
        for r in at:
            kept[r, lo + keep] = True
        defined[at] = True
    return kept, defined


def pool_optimum(batch: object, block: Block, s: int, r_m: int, r_e: int) -> tuple[np.ndarray, np.ndarray]:
    """``(kept, defined)``: the pool argmin of e(A) (``evictlab.solve``) for rows with n > s.

    ``batch`` is the block's :class:`~evictlab.rows.batch.RowBatch`, rows in the block's order.
    """
    from evictlab.solve import SolveConfig, solve_batch

    kept, defined = _empty(block)
    rows = np.flatnonzero(block.n > s)
    if rows.size == 0:
        return kept, defined
    sub = batch.take(rows)  # type: ignore[attr-defined]
    res = solve_batch(sub, SolveConfig(budgets=(int(s),), r_m=r_m, r_e=r_e, max_swaps=0))
    for i, r in enumerate(rows):
        kept[r, block.lo[r] + np.asarray(res["kept"][i], np.int64)] = True
    defined[rows] = True
    return kept, defined

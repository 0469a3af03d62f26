"""Paper B's claims on hand-made result tables (no model): which arms pair with the learned
gates' global arm, the pooled difference and its direction, the configuration counts, the
full-cache verdict, and `eval compare` writing them."""

from __future__ import annotations

import polars as pl

from evictlab.eval.claims.gates import retention_gates
from test_eval_contour import _frame, _rows


def _grid() -> pl.DataFrame:
    # 8 contexts at two budgets; the global arm answers 6 of 8, equal sizes 2 of 8, SnapKV 4,
    # the full cache 8 (so the gates' arm is 25 points below it)
    return _frame(
        *[_rows("trimkv+global", [1] * 6 + [0] * 2, [-1] * 8, budget=b) for b in ("64/cell", "128/cell")],
        *[_rows("trimkv", [1] * 2 + [0] * 6, [-1] * 8, budget=b) for b in ("64/cell", "128/cell")],
        *[_rows("snapkv", [1] * 4 + [0] * 4, [-1] * 8, budget=b) for b in ("64/cell", "128/cell")],
        *[_rows("snapkv", [1] * 8, [-1] * 8, budget=b, mode="masked", bytes_live=1000) for b in ("64/cell",)],
        _rows("full", [1] * 8, [0] * 8),
    )


def test_the_global_arm_pairs_with_equal_sizes_every_other_method_and_the_full_cache() -> None:
    claims, detail = retention_gates(_grid(), n_boot=200)
    by = {c.claim_id: c for c in claims}
    assert set(by) == {"gates:trimkv+global_vs_trimkv", "gates:trimkv+global_vs_snapkv", "gates:trimkv+global_vs_full"}
    g = by["gates:trimkv+global_vs_trimkv"]
    assert g.our_value.startswith("+50.0 [") and "exact match 0.750 vs 0.250" in g.our_value
    assert "configurations 2 won / 0 tied / 0 lost of 2" in g.our_value and "the paper's direction" in g.our_value
    assert g.verdict == "no paper value"
    s = by["gates:trimkv+global_vs_snapkv"]   # the masked SnapKV arm is not a matched-bytes partner
    assert s.our_value.startswith("+25.0 [") and "of 2" in s.our_value
    f = by["gates:trimkv+global_vs_full"]
    # two misses in eight contexts: a resample can hold neither, so the interval reaches 0
    assert f.our_value.startswith("-25.0 [-50.0, +0.0]") and f.verdict == "paper within ours"
    worse = _frame(_rows("trimkv+global", [1] * 2 + [0] * 6, [-1] * 8), _rows("full", [1] * 8, [0] * 8))
    (w,) = retention_gates(worse, n_boot=200)[0]
    assert w.our_value.startswith("-75.0 [") and w.verdict == "ours below paper"
    # one detail row per (budget, other arm), the full cache's exact match beside each
    assert detail.height == 6 and (detail["full_em"] == 1.0).all()
    assert set(detail["method_b"]) == {"trimkv", "snapkv", "full"}


def test_two_gate_sets_pair_once_and_a_grid_without_gates_has_no_rows() -> None:
    res = _frame(_rows("trimkv[gates=a]+global", [1, 1, 0, 0], [-1] * 4),
                 _rows("trimkv[gates=b]+global", [1, 0, 0, 0], [-1] * 4),
                 _rows("trimkv[gates=b]", [1, 1, 1, 0], [-1] * 4), _rows("full", [1] * 4, [0] * 4))
    claims, _ = retention_gates(res, n_boot=200)
    ids = [c.claim_id for c in claims]
    assert "gates:trimkv[gates=a]+global_vs_trimkv[gates=b]+global" in ids
    assert "gates:trimkv[gates=b]+global_vs_trimkv[gates=a]+global" not in ids
    # equal sizes pair with the global arm of the same gates only
    assert "gates:trimkv[gates=b]+global_vs_trimkv[gates=b]" in ids
    assert "gates:trimkv[gates=a]+global_vs_trimkv[gates=b]" not in ids
    claims, detail = retention_gates(_frame(_rows("snapkv", [1], [-1]), _rows("full", [1], [0])), n_boot=200)
    assert claims == [] and detail.height == 0


def test_compare_writes_the_gates_detail_and_claims(tmp_path) -> None:
    from evictlab.eval.commands import write_comparison
    from evictlab.eval.compare import TieRule

    written, _ = write_comparison(_grid(), tmp_path / "pairs.parquet", TieRule(n_boot=200), {"spec": {}})
    assert "pairs_gates.parquet" in {p.name for p in written}
    claims = pl.read_parquet(tmp_path / "pairs_claims.parquet")
    assert claims.filter(pl.col("claim_id").str.starts_with("gates:")).height == 3
    assert "Learned retention gates" in (tmp_path / "pairs.md").read_text()

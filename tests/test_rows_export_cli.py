"""`evictlab rows export` arrays exactly as the issue specifies, and the rows CLI contracts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from evictlab.cli import app
from evictlab.errors import InputError
from evictlab.rows.export import export_arrays, export_npz
from evictlab.rows.reader import RowStore
from evictlab.rows.writer import RowWriter

D = 3
EXPORT_ARRAYS = {
    "p": np.float64, "values": np.float64, "n": np.int64, "row_id": np.int64,
    "prompt_id": np.int64, "layer": np.int64, "q_head": np.int64, "kv_head": np.int64,
    "position": np.int64, "key_index": np.int64, "prompt_tokens": np.int64,
}


def _sparse_prompts(path: Path) -> None:
    """Prompts 0, 2, 5 (not dense), different token lengths, windows and prefixes."""
    rng = np.random.default_rng(4)
    with RowWriter(path, model="toy", capture_mode="query-aware", head_dim=D) as w:
        for pid, ntok in ((2, 6), (0, 4), (5, 9)):
            w.add_prompt(pid, list(range(10 * pid, 10 * pid + ntok)))
            L = ntok
            b = w.add_block(pid, 1, 2, rng.standard_normal((L, D)), rng.standard_normal((L, D)),
                            np.arange(L) * 2)
            w.add_query_rows(b, rng.standard_normal((2, D)), [4, 5], [L - 1, L - 1], [0, 1],
                             [L, L - 1], 0.7)
            w.add_logit_rows(b, [rng.standard_normal(2)], [6], [-1], key_lo=[1])
            w.end_prompt(pid)


def test_export_arrays_exactly_as_specified(tmp_path: Path) -> None:
    _sparse_prompts(tmp_path / "ds")
    info = export_npz(tmp_path / "ds", tmp_path / "out.npz")
    with np.load(tmp_path / "out.npz", allow_pickle=False) as z:
        arr = {k: z[k] for k in z.files}
    assert set(arr) == set(EXPORT_ARRAYS)
    for k, dt in EXPORT_ARRAYS.items():
        assert arr[k].dtype == dt, k
    store = RowStore.open(tmp_path / "ds")
    N, n_max = store.n_rows, int(store.meta["n"].max())
    assert info["rows"] == N == 9 and n_max == 9
    assert arr["p"].shape == (N, n_max) and arr["values"].shape == (N, n_max, D)
    assert arr["key_index"].shape == (N, n_max)
    for k in ("n", "row_id", "prompt_id", "layer", "q_head", "kv_head", "position"):
        assert arr[k].shape == (N,)
        assert arr[k].tolist() == store.meta[k].to_list(), k
    ref = store.get_rows(list(range(N)))
    for i in range(N):
        n = int(arr["n"][i])
        p, v = ref.row(i)
        assert np.array_equal(arr["p"][i, :n], p) and (arr["p"][i, n:] == 0).all()
        assert np.array_equal(arr["values"][i, :n], v) and (arr["values"][i, n:] == 0).all()
        ki = ref.key_index[ref.p_off[i]:ref.p_off[i + 1]]
        assert np.array_equal(arr["key_index"][i, :n], ki) and (arr["key_index"][i, n:] == -1).all()
    # p rows are distributions; key_index holds the stored absolute positions (2 * key)
    np.testing.assert_allclose(arr["p"].sum(axis=1), 1.0, atol=1e-12)
    assert arr["key_index"][0, :6].tolist() == [0, 2, 4, 6, 8, 10]
    # prompt ids 0, 2, 5 -> P = 6 rows; absent ids 1, 3, 4 are all -1; L_max = 9
    pt = arr["prompt_tokens"]
    assert pt.shape == (6, 9)
    assert pt[0].tolist() == [0, 1, 2, 3] + [-1] * 5
    assert pt[2].tolist() == [20, 21, 22, 23, 24, 25] + [-1] * 3
    assert pt[5].tolist() == list(range(50, 59))
    assert (pt[[1, 3, 4]] == -1).all()


def test_export_limit_and_bad_arguments(tmp_path: Path) -> None:
    _sparse_prompts(tmp_path / "ds")
    store = RowStore.open(tmp_path / "ds")
    a = export_arrays(store, limit=3)  # first 3 rows: prompt 2 only
    assert a["row_id"].tolist() == [0, 1, 2] and a["p"].shape == (3, 6)
    assert a["prompt_tokens"].shape == (3, 6) and (a["prompt_tokens"][:2] == -1).all()
    assert export_arrays(store, limit=1000)["n"].shape == (9,)
    for bad in (0, -2):
        with pytest.raises(InputError, match="--limit"):
            export_arrays(store, limit=bad)
    with pytest.raises(InputError, match="--limit.*GiB"):
        export_arrays(store, max_bytes=100)
    with pytest.raises(InputError, match="--out"):
        export_npz(tmp_path / "ds", tmp_path / "out.txt")


def test_synthetic_export_has_minus_one_positions(tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["rows", "synth", "--count", "50", "--keys", "10", "--dim", "4",
                            "--seed", "1", "--out", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["rows", "export", str(tmp_path / "s"), "--out",
                            str(tmp_path / "s.npz"), "--limit", "20"])
    assert r.exit_code == 0, r.output
    with np.load(tmp_path / "s.npz") as z:
        assert z["p"].shape[0] == 20 and (z["position"] == -1).all()
        assert (z["key_index"] == -1).all() and z["prompt_tokens"].shape == (1, 0)
    rec = json.loads((tmp_path / "s.run_record.json").read_text())
    assert rec["kind"] == "rows.export" and rec["config"]["limit"] == 20


def test_cli_synth_inspect_export(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["rows", "synth", "--count", "120", "--keys", "16", "--dim", "8", "--seed", "7",
            "--rows-per-block", "50", "--kind", "logits", "--alpha", "0.3",
            "--values", "clustered"]
    assert runner.invoke(app, [*args, "--out", str(tmp_path / "a")]).exit_code == 0
    assert runner.invoke(app, [*args, "--out", str(tmp_path / "b")]).exit_code == 0
    ma = json.loads((tmp_path / "a" / "manifest.json").read_text())
    mb = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert [s["sha256"] for s in ma["shards"]] == [s["sha256"] for s in mb["shards"]]
    assert ma["source"]["alpha"] == 0.3 and ma["counts"]["logit_rows"] == 120
    rec = json.loads((tmp_path / "a" / "run_record.json").read_text())
    assert rec["kind"] == "rows.synth" and rec["seed"] == 7
    r = runner.invoke(app, ["rows", "inspect", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    for needle in ("status          complete", "schema version  2", "models", "synthetic", "capture modes",
                   "rows            120 (query 0, logits 120)", "n range", "d range",
                   "8..8", "blocks          3"):
        assert needle in r.output, needle
    r = runner.invoke(app, ["rows", "inspect", str(tmp_path / "a"), "--json", "--verify"])
    s = json.loads(r.output)
    assert s["rows"] == 120 and s["n_max"] <= 16 and s["schema_version"] == 2
    # existing output: the same command has nothing to do; other settings are refused,
    # then replace it with --overwrite
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert r.exit_code == 0 and "nothing to do" in r.output
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "a"), "--seed", "8"])
    assert isinstance(r.exception, InputError) and r.exception.field == "--out"
    assert "--seed: 7 there, 8 now" in str(r.exception)
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "a"), "--overwrite", "--seed", "8"])
    assert r.exit_code == 0
    r = runner.invoke(app, ["rows", "export", str(tmp_path / "a"), "--out",
                            str(tmp_path / "a.npz")])
    assert r.exit_code == 0 and "wrote 120 rows" in r.output


def test_cli_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    """Through the real entry point (evictlab.cli.main): InputError -> one line, code 2."""
    cmd = [sys.executable, "-m", "evictlab.cli", "rows", "inspect", str(tmp_path / "none")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "not a directory" in res.stderr
    assert "Traceback" not in res.stderr

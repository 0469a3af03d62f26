"""``evictlab dilution check`` end to end on captures of a tiny model: the table against an
independent recomputation from the row dataset, no bound violation, kept sets, resume after
an interruption, two runs at once, unlabelled and bad input through the entry point."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from cli_helpers import run_cli
from evictlab.capture.config import CaptureConfig
from evictlab.capture.runner import run_capture
from evictlab.capture.testing import ByteTokenizer, tiny_model
from evictlab.dilution import check as check_mod
from evictlab.dilution.check import CHECKS, CheckConfig, run_check
from evictlab.dilution.labels import prompt_labels
from evictlab.errors import InputError
from evictlab.rows.reader import RowStore

CFG = CheckConfig(budgets=(8, 24), sinks=2, recent=4, pool_max_s=8, chunk_blocks=2)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, Path]:
    """A query-aware and a query-agnostic capture of multi_key on a tiny Llama, and a text capture."""
    model = tiny_model("llama", seed=5)[0]
    tok = ByteTokenizer()
    base = tmp_path_factory.mktemp("dilution_rows")
    cap = CaptureConfig(model="tiny-llama", source="multi_key", context=420, positions=3, prompts=1, seed=3,
                        mode="query-aware")
    out = {}
    for mode in ("query-aware", "query-agnostic"):
        out[mode] = base / mode
        run_capture(replace(cap, mode=mode), out[mode], model=model, tokenizer=tok, progress=False)
    text = base / "t.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 20)
    out["text"] = base / "text"
    run_capture(replace(cap, source=f"file:{text}", mode="query-agnostic", context=64), out["text"],
                model=model, tokenizer=tok, progress=False)
    return out


@pytest.fixture(scope="module")
def checked(rows, tmp_path_factory) -> dict[str, pl.DataFrame]:
    base = tmp_path_factory.mktemp("dilution_check")
    out = {}
    for mode in ("query-aware", "query-agnostic"):
        t = base / f"{mode}.parquet"
        # figures and report once (they cost more CPU than the check itself)
        s = run_check(rows[mode], t, replace(CFG, stated_margin=0.5), progress=False,
                      make_report=mode == "query-aware")
        assert s.violations == 0
        out[mode] = pl.read_parquet(t)
        out[mode + ".bounds"] = pl.read_parquet(base / f"{mode}.bounds.parquet")
        out[mode + ".path"] = t
    return out


@pytest.mark.parametrize("mode", ["query-aware", "query-agnostic"])
def test_alpha_equals_a_recomputation_from_the_rows(rows, checked, mode: str) -> None:
    """alpha of every full-cache row = its weight on the useful positions, read straight from
    the dataset's (p, key_index) pairs (no dense layout, no logits)."""
    store = RowStore.open(rows[mode])
    labels = prompt_labels(store)
    table = checked[mode].filter(pl.col("method") == "full").sort("row_id")
    want = {}
    for b in store.iter_batches(max_rows=4096):
        for r in range(b.meta.height):
            seg = slice(int(b.p_off[r]), int(b.p_off[r + 1]))
            u = np.isin(b.key_index[seg], labels[int(b.meta["prompt_id"][r])].useful)
            p = b.p[seg].astype(np.float64)
            want[int(b.meta["row_id"][r])] = p[u].sum() / p.sum()
    assert table.height == store.n_rows == len(want)
    got = dict(zip(table["row_id"].to_list(), table["alpha"].to_list()))
    np.testing.assert_allclose([got[k] for k in want], [want[k] for k in want], atol=1e-6)  # p stored as float32
    # alpha is never 0 when a useful key is visible, and the mass split adds up to 1
    vis = table.filter(pl.col("useful_visible"))
    assert vis.height > 0 and (vis["alpha"] > 0).all()
    parts = table["alpha"] + sum(table[f"mass_{k}"] for k in ("other_facts", "sink", "question", "filler"))
    np.testing.assert_allclose(parts.to_numpy(), 1.0, atol=1e-12)
    if mode == "query-agnostic":
        assert (table["mass_question"] == 0).all()


@pytest.mark.parametrize("mode", ["query-aware", "query-agnostic"])
def test_no_violation_and_every_check_is_exercised(checked, mode: str) -> None:
    b = {r["check"]: r for r in checked[mode + ".bounds"].to_dicts()}
    assert set(b) == set(CHECKS)
    assert sum(r["violations"] for r in b.values()) == 0
    for name in ("alpha_from_logits", "margin_lower", "mean_margin_lower", "spread_upper", "share_criterion",
                 "margin_lower_kept"):
        assert b[name]["assumption_holds"] > 0, name
    # the checks compare non-trivial numbers: the lower bound is strictly below alpha somewhere
    assert b["margin_lower"]["slack_max"] > 1e-3 and b["spread_upper"]["slack_max"] > 1e-3
    # with --margin 0.5 the tiny model's rows mostly fail the assumed margin: counted, not violations
    assert b["stated_margin_lower"]["assumption_fails"] > 0


def test_kept_sets_have_their_size_and_top_mass_is_the_rows_top_s(checked) -> None:
    t = checked["query-aware"]
    kept = t.filter(pl.col("method") != "full")
    assert set(kept["method"]) == {"top_mass", "streaming_llm", "h2o", "snapkv", "pool"}
    assert (kept["kept"] == kept["s"]).all() and (kept["n"] > kept["s"]).all()
    assert kept.filter(pl.col("method") == "pool")["s"].max() <= CFG.pool_max_s
    # top_mass keeps the s largest weights: it maximises P(A), so its useful mass among all
    # s-sets is not what it maximises, but its kept weight P(A) = sigma_U alpha + sigma_D (1 - alpha)
    # is at least every other method's at the same row and s
    pa = kept.with_columns((pl.col("sigma_useful").fill_nan(0) * pl.col("alpha")
                            + pl.col("sigma_distractor").fill_nan(0) * (1 - pl.col("alpha"))).alias("pa"))
    top = pa.filter(pl.col("method") == "top_mass").select("row_id", "s", pl.col("pa").alias("pa_top"))
    j = pa.filter(pl.col("method") != "top_mass").join(top, on=["row_id", "s"])
    assert j.height > 0 and (j["pa"] <= j["pa_top"] + 1e-12).all()


def test_table_rows_name_their_protocol_and_model(checked) -> None:
    for mode in ("query-aware", "query-agnostic"):
        t = checked[mode]
        assert set(t["protocol"]) == {mode} and set(t["model"]) == {"tiny-llama"}


def test_outputs_and_report(checked) -> None:
    t = checked["query-aware.path"]
    for suffix in (".heads.parquet", ".bounds.parquet", ".md", ".run_record.json"):
        assert t.with_name(t.stem + suffix).is_file(), suffix
    assert any(t.with_name(t.stem + ".figures").iterdir())
    assert not t.with_name(t.name + ".parts").exists()  # removed once the table is complete
    report = t.with_name(t.stem + ".md").read_text()
    assert "violations" in report and "query-aware" in report
    heads = pl.read_parquet(t.with_name(t.stem + ".heads.parquet"))
    full = heads.filter(pl.col("method") == "full")
    assert full["s"].null_count() == full.height and (full["rows"] > 0).all()


def test_an_interrupted_check_resumes_to_the_same_table(rows, checked, tmp_path: Path, monkeypatch) -> None:
    real, calls = check_mod.check_block, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # inside the second chunk (2 blocks per chunk, 4 blocks)
            raise KeyboardInterrupt
        return real(*a, **k)

    out = tmp_path / "t.parquet"
    cfg = replace(CFG, stated_margin=0.5)
    monkeypatch.setattr(check_mod, "check_block", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_check(rows["query-aware"], out, cfg, progress=False, make_report=False)
    assert not out.exists() and out.with_name(out.name + ".parts").is_dir()
    monkeypatch.setattr(check_mod, "check_block", real)
    # other settings are refused while the parts of this run are there
    with pytest.raises(InputError, match="other settings"):
        run_check(rows["query-aware"], out, replace(cfg, budgets=(8,)), progress=False, make_report=False)
    s = run_check(rows["query-aware"], out, cfg, progress=False, make_report=False)
    assert s.blocks_skipped == 2 and s.blocks == 4
    assert pl.read_parquet(out).equals(checked["query-aware"])


def test_two_runs_at_once_are_refused(rows, tmp_path: Path, monkeypatch) -> None:
    """A second run on the same --out is refused at once (it never waits) while the first
    holds it; the first finishes normally. (The lock refuses another thread as it refuses
    another process: evictlab/io.py FileLock.)"""
    out = tmp_path / "t.parquet"
    started, release = threading.Event(), threading.Event()
    real = check_mod.check_block

    def slow(*a, **k):
        if threading.current_thread() is not threading.main_thread():
            started.set()
            release.wait(120)
        return real(*a, **k)

    monkeypatch.setattr(check_mod, "check_block", slow)
    cfg = replace(CFG, methods=("top_mass",))
    first = threading.Thread(target=run_check, args=(rows["query-agnostic"], out, cfg),
                             kwargs={"progress": False, "make_report": False})
    first.start()
    try:
        assert started.wait(120)
        with pytest.raises(InputError, match="being written by another evictlab run") as exc:
            run_check(rows["query-agnostic"], out, cfg, progress=False, make_report=False)
        assert exc.value.field == "--out"
    finally:
        release.set()
        first.join(300)
    assert out.is_file() and not out.with_name(out.name + ".parts").exists()


# ----------------------------------------------------------------------------- entry point


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Fix:" in lines[0], err
    return lines[0]


def test_text_rows_are_refused_with_one_line(rows, tmp_path: Path, capsys, monkeypatch) -> None:
    code, _, err = run_cli(["dilution", "check", str(rows["text"]), "--out", str(tmp_path / "t.parquet")],
                         capsys, monkeypatch)
    line = _one_error_line(err)
    assert code == 2 and "without fact labels" in line and "--source needle" in line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("extra", "option"), [
    (["--keep", "8,x"], "--keep"),
    (["--keep", "0"], "--keep"),
    (["--keep", "8,8"], "--keep"),
    (["--keep", "8"], "--keep"),  # below the default 4 sinks + 16 recent
    (["--methods", "top_mass,snapkvv"], "--methods"),
    (["--methods", "expected_attention"], "--methods"),
    (["--useful", "needle"], "--useful"),
    (["--margin", "nan"], "--margin"),
    (["--sinks", "-1"], "--sinks"),
    (["--chunk-blocks", "0"], "--chunk-blocks"),
    (["--threads", "-2"], "--threads"),
])
def test_bad_options_are_one_line_naming_the_option(rows, tmp_path: Path, capsys, monkeypatch, extra, option):
    code, _, err = run_cli(["dilution", "check", str(rows["query-aware"]), "--out", str(tmp_path / "t.parquet"),
                          *extra], capsys, monkeypatch)
    assert code == 2 and _one_error_line(err).startswith(f"error: {option}: ")
    assert not list(tmp_path.iterdir())


def test_bad_paths(rows, tmp_path: Path, capsys, monkeypatch) -> None:
    cases = [
        ([str(tmp_path / "missing"), "--out", str(tmp_path / "t.parquet")], "missing"),
        ([str(rows["query-aware"]), "--out", str(tmp_path / "no" / "t.parquet")], "--out"),
        ([str(rows["query-aware"]), "--out", str(tmp_path)], "--out"),
    ]
    for argv, what in cases:
        code, _, err = run_cli(["dilution", "check", *argv], capsys, monkeypatch)
        assert code == 2 and what in _one_error_line(err), err
    done = tmp_path / "done.parquet"
    done.write_bytes(b"x")
    code, _, err = run_cli(["dilution", "check", str(rows["query-aware"]), "--out", str(done)], capsys, monkeypatch)
    assert code == 2 and "--overwrite" in _one_error_line(err)


def test_ctrl_c_is_one_line_and_a_rerun_finishes(rows, tmp_path: Path, capsys, monkeypatch) -> None:
    real, calls = check_mod.check_block, {"n": 0}

    def interrupted(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    out = tmp_path / "t.parquet"
    argv = ["dilution", "check", str(rows["query-agnostic"]), "--out", str(out), "--keep", "24",
            "--methods", "top_mass", "--chunk-blocks", "1", "--quiet"]
    monkeypatch.setattr(check_mod, "check_block", interrupted)
    code, _, err = run_cli(argv, capsys, monkeypatch)
    assert code == 130 and "Traceback" not in err and "rerun the same command to resume" in err
    assert not out.exists()
    monkeypatch.setattr(check_mod, "check_block", real)
    code, stdout, err = run_cli(argv, capsys, monkeypatch)
    assert code == 0, err
    assert "1 already done" in stdout and "violations where the assumptions hold: 0" in stdout
    assert out.is_file()



@pytest.mark.parametrize("killed_at", ["table", "record"])
def test_killed_while_writing_the_outputs_the_rerun_finishes(rows, tmp_path: Path, capsys, monkeypatch,
                                                             killed_at: str) -> None:
    """Issue 28, item 3: a run killed during its final writes (after the table, before the run
    record) used to leave the tables, no report or record, and a .parts/ folder, and the rerun
    said "--out already exists". Now the parts stay until the record is written, and the rerun
    finishes from them: every output written, the parts folder gone."""
    import evictlab.io as io_mod
    from evictlab.record import RunRecord

    out = tmp_path / "t.parquet"
    argv = ["dilution", "check", str(rows["query-agnostic"]), "--out", str(out), "--keep", "24",
            "--methods", "top_mass", "--chunk-blocks", "1", "--quiet"]
    real_write, real_record = io_mod.write_checked_parquet, RunRecord.write

    def kill_on_table(df, dest, **kw):  # noqa: ANN001, ANN003
        if Path(dest) == out:
            raise KeyboardInterrupt
        return real_write(df, dest, **kw)

    def kill_on_record(self, path, **kw):  # noqa: ANN001, ANN003
        raise KeyboardInterrupt

    if killed_at == "table":
        monkeypatch.setattr(io_mod, "write_checked_parquet", kill_on_table)
    else:
        monkeypatch.setattr(RunRecord, "write", kill_on_record)
    code, _, err = run_cli(argv, capsys, monkeypatch)
    assert code == 130 and "rerun the same command to resume" in err
    assert (tmp_path / "t.parquet.parts").is_dir() and not (tmp_path / "t.run_record.json").exists()
    monkeypatch.setattr(io_mod, "write_checked_parquet", real_write)
    monkeypatch.setattr(RunRecord, "write", real_record)
    code, stdout, err = run_cli(argv, capsys, monkeypatch)
    assert code == 0, err
    for name in ("t.parquet", "t.heads.parquet", "t.bounds.parquet", "t.md", "t.run_record.json"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "t.figures").is_dir() and not (tmp_path / "t.parquet.parts").exists()
    # and a finished check is refused again without --overwrite
    code, _, err = run_cli(argv, capsys, monkeypatch)
    assert code == 2 and "--overwrite" in _one_error_line(err)


def test_budgets_no_row_can_use_are_refused(rows, tmp_path: Path, capsys, monkeypatch) -> None:
    """Issue 28, item 7: `--keep 5000` (then `--budgets`) on rows of at most ~90 keys used to exit 0 with
    empty tables; it is refused, as `solve` refuses s > n."""
    n_max = int(RowStore.open(rows["query-agnostic"]).meta["n"].max())
    out = tmp_path / "t.parquet"
    code, _, err = run_cli(["dilution", "check", str(rows["query-agnostic"]), "--out", str(out), "--keep",
                            f"24,{n_max}", "--methods", "top_mass"], capsys, monkeypatch)
    line = _one_error_line(err)
    assert code == 2 and line.startswith(f"error: --keep: budget {n_max} is not below any row's key count")
    assert f"use budgets below {n_max}" in line and not out.exists() and not (tmp_path / "t.parquet.parts").exists()

"""Files evictlab reads back are checked (issue 28, item 2): Parquet files carry the SHA-256
of their own bytes in their footer (``evictlab.io.write_checked_parquet``); a damaged one is
named in one line (``CorruptFileError``, exit 2 through the CLI) and, for resumable part
files, discarded and recomputed. A file without a checksum (an older evictlab wrote it) is
read with one warning line (finished outputs) or recomputed (part files)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from evictlab import cli
from evictlab.capture.testing import save_tiny_folder
from evictlab.parts import PartStore
from evictlab.errors import CorruptFileError
from evictlab.eval.grid import PARTS, RESULTS, run_grid
from evictlab.eval.spec import GridSpec, LoopSettings
from evictlab.io import check_parquet, read_checked_parquet, write_checked_parquet
from evictlab.stats.planted import planted_results

FRAME = pl.DataFrame({"a": [1, 2, 3], "b": ["x", "y", "z"], "k": [[1, 2], [3], []], "f": [0.5, 1.5, None]})


def _flip(path: Path, byte: int, bit: int = 2) -> None:
    raw = bytearray(path.read_bytes())
    raw[byte] ^= 1 << bit
    path.write_bytes(bytes(raw))


def _error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------------- io


def test_round_trip_same_bytes_and_the_digest_is_in_the_footer(tmp_path: Path) -> None:
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    da, db = write_checked_parquet(FRAME, a), write_checked_parquet(FRAME, b)
    assert da == db and a.read_bytes() == b.read_bytes()  # same frame, same bytes
    assert check_parquet(a, "fix") is True
    assert read_checked_parquet(a, "fix").equals(FRAME)
    assert pl.read_parquet_metadata(a)["evictlab.sha256"] == da


def test_every_single_bit_flip_is_detected(tmp_path: Path) -> None:
    """Each byte of the file (data pages, page headers, footer, its length, the magic, the
    checksum entry itself) with one bit flipped, a different bit per byte."""
    good = tmp_path / "good.parquet"
    write_checked_parquet(FRAME, good)
    raw = good.read_bytes()
    bad = tmp_path / "bad.parquet"
    missed = []
    for i in range(len(raw)):
        flipped = bytearray(raw)
        flipped[i] ^= 1 << (i % 8)
        bad.write_bytes(bytes(flipped))
        try:
            check_parquet(bad, "fix")
            missed.append(i)
        except CorruptFileError:
            pass
    assert missed == []


def test_truncated_and_missing_files(tmp_path: Path) -> None:
    p = tmp_path / "t.parquet"
    write_checked_parquet(FRAME, p)
    p.write_bytes(p.read_bytes()[:-20])
    with pytest.raises(CorruptFileError, match="t.parquet: is not a complete Parquet file.*Fix: redo it"):
        read_checked_parquet(p, "redo it")
    with pytest.raises(CorruptFileError, match="is missing"):
        read_checked_parquet(tmp_path / "none.parquet", "redo it")


def test_a_file_without_a_checksum_is_read_with_a_warning_or_refused(tmp_path: Path) -> None:
    old = tmp_path / "old.parquet"
    FRAME.write_parquet(old)  # what evictlab wrote before the checksums
    assert check_parquet(old, "fix") is False
    lines: list[str] = []
    assert read_checked_parquet(old, "rerun it", notify=lines.append).equals(FRAME)
    assert len(lines) == 1 and "old.parquet carries no checksum" in lines[0] and "rerun it" in lines[0]
    with pytest.raises(CorruptFileError, match="carries no checksum"):
        read_checked_parquet(old, "rerun it", legacy="refuse")


# ---------------------------------------------------------------------------------- the grid


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    save_tiny_folder(folder, "llama")
    return folder


def _spec(model: Path) -> GridSpec:
    return GridSpec.build(models=[str(model)], tasks=["needle"], contexts=[160], methods=["snapkv", "h2o"],
                          budgets=["24"], n=2, seed=3,
                          loop=LoopSettings(sinks=2, recent=8, chunk_size=64, compress_every=8, window=16,
                                            block_size=8))


def test_a_damaged_eval_part_is_discarded_and_run_again(tiny: Path, tmp_path: Path) -> None:
    """Used to be trusted: a flipped bit in a part changed answer_logprob in results.parquet
    with exit 0. Now the part is named in one warning, deleted and its unit (one context:
    every cell's rows of one example) run again."""
    import torch

    from evictlab.eval.grid import part_path

    torch.set_num_threads(1)
    spec = _spec(tiny)
    volatile = ["wall_s", "prefill_s"]
    clean = tmp_path / "clean"
    run_grid(spec, clean)
    reference = pl.read_parquet(clean / RESULTS).drop(volatile)
    out = tmp_path / "g"
    run_grid(spec, out)
    (out / RESULTS).unlink()  # as an interrupted run leaves it: parts only
    part = part_path(out, spec.units()[0])
    _flip(part, part.stat().st_size // 3)
    lines: list[str] = []
    r = run_grid(spec, out, notify=lines.append)
    assert len(lines) == 1 and f"discarded the damaged part file {part}" in lines[0] and "checksum" in lines[0]
    assert (r.ran, r.resumed) == (1, len(spec.units()) - 1)
    assert pl.read_parquet(out / RESULTS).drop(volatile).equals(reference)
    # a part from an older evictlab (no checksum) is run again too
    (out / RESULTS).unlink()
    pl.read_parquet(part).write_parquet(part)
    lines.clear()
    r = run_grid(spec, out, notify=lines.append)
    assert r.ran == 1 and "carries no checksum" in lines[0]
    assert pl.read_parquet(out / RESULTS).drop(volatile).equals(reference)


def test_eval_compare_refuses_a_damaged_results_file(tiny: Path, tmp_path: Path, capsys) -> None:
    import torch

    torch.set_num_threads(1)
    out = tmp_path / "g"
    run_grid(_spec(tiny), out)
    _flip(out / RESULTS, (out / RESULTS).stat().st_size // 2)
    code = cli.run(["eval", "compare", str(out)])
    line = _error_line(capsys.readouterr().err)
    assert code == 2 and f"{out / RESULTS}: fails its checksum" in line
    assert not (out / "pairs.parquet").exists()


# ---------------------------------------------------------------------------------- solver results


def test_predictor_eval_refuses_a_damaged_solver_output(tmp_path: Path, capsys) -> None:
    """Used to read a bit-flipped results file (kappa_hat values changed) without a word."""
    res = tmp_path / "r.parquet"
    write_checked_parquet(planted_results(300, seed=1), res)
    pred = tmp_path / "p.json"
    assert cli.run(["predictor", "fit", str(res), "--out", str(pred), "--n-boot", "20"]) == 0
    capsys.readouterr()
    _flip(res, res.stat().st_size // 2)
    code = cli.run(["predictor", "eval", str(pred), str(res), "--n-boot", "20"])
    line = _error_line(capsys.readouterr().err)
    assert code == 2 and f"{res}: fails its checksum" in line and "evictlab solve" in line


def test_solver_output_of_an_older_evictlab_is_read_with_one_warning(tmp_path: Path, capsys) -> None:
    res = tmp_path / "r.parquet"
    planted_results(300, seed=1).write_parquet(res)  # no checksum
    code = cli.run(["predictor", "fit", str(res), "--out", str(tmp_path / "p.json"), "--n-boot", "20"])
    err = capsys.readouterr().err
    assert code == 0
    assert [x for x in err.splitlines() if x.startswith("warning:")] == [
        f"warning: {res} carries no checksum (written by an older evictlab); it is read unverified. To check it, "
        "re-run `evictlab solve` to rewrite it"]


# ---------------------------------------------------------------------------------- dilution parts


def test_dilution_parts_damaged_or_unchecked_are_recomputed(tmp_path: Path) -> None:
    keys = ("00000", "00001", "00002")
    store = PartStore(tmp_path / "t.parts", {"a": 1}, keys).open()
    for k in ("00000", "00001", "00002"):
        store.write(k, FRAME.with_columns(pl.lit(k).alias("key")))
    _flip(store.path("00001"), 40)
    FRAME.write_parquet(store.path("00002"))  # no checksum
    lines: list[str] = []
    again = PartStore(tmp_path / "t.parts", {"a": 1}, keys, notify=lines.append).open()
    assert [again.done(k) for k in ("00000", "00001", "00002")] == [True, False, False]
    assert len(lines) == 2 and "part-00001.parquet (fails its checksum" in lines[0]
    assert "part-00002.parquet (carries no checksum" in lines[1]
    assert not again.path("00001").exists() and not again.path("00002").exists()
    assert again.read("00000")["key"].to_list() == ["00000"] * 3

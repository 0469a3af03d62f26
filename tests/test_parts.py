"""The part store (evictlab/parts.py) that solve, eval run and dilution share: the manifest
check, checksummed parts verified on resume, side parts, the order of collection, the lock
and what marks a finished run. Each caller's own resume and kill tests live with it
(test_solve_durability, test_eval_grid, test_dilution_check, test_dilution_sweep)."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl
import pytest

from evictlab.errors import InputError
from evictlab.io import write_checked_parquet
from evictlab.parts import PartStore, finished, job_differences

JOB = {"config": {"budgets": [2, 5], "pool": [2, 2]}, "dataset": "abc"}


def _frame(k: int) -> pl.DataFrame:
    return pl.DataFrame({"unit": [k, k], "x": [k * 0.5, k * 1.5]})


def _store(folder: Path, job: dict | None = None, units=("00", "01", "02"), **kw) -> tuple[PartStore, list[str]]:
    lines: list[str] = []
    return PartStore(folder, job or JOB, list(units), notify=lines.append, **kw), lines


def test_resume_keeps_written_parts_and_collects_in_unit_order(tmp_path: Path) -> None:
    store, _ = _store(tmp_path / "o.parts")
    assert store.open().pending() == ["00", "01", "02"]
    store.write("02", _frame(2))  # written out of order
    store.write("00", _frame(0))
    again, lines = _store(tmp_path / "o.parts")
    assert again.resume() is True and lines == []
    assert again.pending() == ["01"] and again.done("00") and again.done("02")
    again.write("01", _frame(1))
    got = again.collect()
    assert got["unit"].to_list() == [0, 0, 1, 1, 2, 2]  # the units' order, not the writes'
    assert got.equals(pl.concat([_frame(k) for k in range(3)]))


@pytest.mark.parametrize("damage", ["flip", "truncate", "unchecked"])
def test_a_damaged_part_is_named_in_one_line_and_computed_again(tmp_path: Path, damage: str) -> None:
    store, _ = _store(tmp_path / "o.parts")
    store.open()
    for k in range(3):
        store.write(f"{k:02d}", _frame(k))
    f = store.path("01")
    raw = bytearray(f.read_bytes())
    if damage == "flip":
        raw[len(raw) // 3] ^= 0x10
        f.write_bytes(bytes(raw))
    elif damage == "truncate":
        f.write_bytes(bytes(raw[:len(raw) // 2]))
    else:  # a part written without a checksum (an older evictlab)
        _frame(1).write_parquet(f)
    again, lines = _store(tmp_path / "o.parts")
    again.resume()
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith(f"discarded the damaged part file {f} (") and lines[0].endswith("it is recomputed")
    assert again.pending() == ["01"] and again.discarded == [f.name] and not f.exists()


def test_the_callers_content_check_runs_on_intact_parts(tmp_path: Path) -> None:
    store, _ = _store(tmp_path / "o.parts")
    store.open()
    for k in range(3):
        store.write(f"{k:02d}", _frame(k))
    store.path("01").write_bytes(store.path("00").read_bytes())  # intact bytes, the wrong unit's rows
    again, lines = _store(tmp_path / "o.parts", check=lambda key, df: None if df["unit"][0] == int(key)
                          else "holds another unit's rows")
    again.resume()
    assert again.pending() == ["01"] and "(holds another unit's rows)" in lines[0]


def test_another_job_is_refused_naming_what_differs_and_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "o.parts"
    store, _ = _store(folder)
    store.open()
    store.write("00", _frame(0))
    other = {"config": {"budgets": [2], "pool": [2, 2]}, "dataset": "abc"}
    with pytest.raises(InputError) as e:
        _store(folder, other)[0].resume()
    assert e.value.field == "--out"
    assert f"{folder} holds the parts of a run with other settings: config.budgets [2, 5] there, [2] now" \
        in e.value.problem
    assert f"delete {folder}" in e.value.fix and "job.json" in e.value.fix
    with pytest.raises(InputError, match=r"or pass --restart\) to discard them"):
        _store(folder, other, restart_option="--restart")[0].resume()
    fresh, _ = _store(folder, other)
    assert fresh.resume(restart=True) is False and not folder.exists()  # discarded
    fresh.start()
    assert fresh.pending() == ["00", "01", "02"]


def test_info_fields_are_recorded_but_not_compared(tmp_path: Path) -> None:
    store, _ = _store(tmp_path / "o.parts", info={"rows": "/old/place"})
    store.open()
    moved, _ = _store(tmp_path / "o.parts", info={"rows": "/new/place"})
    assert moved.resume() is True


def test_parts_without_a_manifest_are_refused_unless_adopted(tmp_path: Path) -> None:
    folder = tmp_path / "o.parts"
    store, _ = _store(folder)
    store.open()
    store.write("00", _frame(0))
    (folder / "job.json").unlink()  # a run killed while starting, or a hand-made folder
    with pytest.raises(InputError, match="it has no job.json"):
        _store(folder)[0].resume()
    adopting, _ = _store(folder, adopt=True)
    assert adopting.resume() is False and adopting.done("00")  # verified, used; a new run's manifest
    adopting.start()
    assert (folder / "job.json").is_file()


def test_side_parts_are_written_first_and_a_damaged_one_reruns_the_unit(tmp_path: Path) -> None:
    units = {"a": ("trace",), "b": ()}
    store = PartStore(tmp_path / "p", JOB, units, name=lambda k, side: f"{k}{'.' + side if side else ''}.parquet")
    store.open()
    store.write("a", _frame(0), {"trace": _frame(9)})
    store.write("b", _frame(1))
    assert (tmp_path / "p" / "a.trace.parquet").is_file()
    assert store.collect("trace")["unit"].to_list() == [9, 9]
    (tmp_path / "p" / "a.trace.parquet").write_bytes(b"PAR1garbage")
    lines: list[str] = []
    again = PartStore(tmp_path / "p", JOB, units, name=store._name, notify=lines.append)
    again.resume()
    assert again.pending() == ["a"] and not (tmp_path / "p" / "a.parquet").exists() and len(lines) == 1


def test_collect_of_empty_parts(tmp_path: Path) -> None:
    store, _ = _store(tmp_path / "o.parts", units=("0", "1"))
    store.open()
    store.write("0", _frame(0).clear())
    store.write("1", _frame(1).clear())
    assert store.collect().equals(pl.DataFrame())
    schema = pl.DataFrame(schema={"unit": pl.Int64})
    assert store.collect(empty=schema).schema == schema.schema


def test_finished_means_the_output_exists_and_its_parts_are_gone(tmp_path: Path) -> None:
    out = tmp_path / "o.parquet"
    store, _ = _store(tmp_path / "o.parquet.parts", units=("00",))
    store.open()
    store.write("00", _frame(0))
    write_checked_parquet(store.collect(), out)
    assert not store.finished(out)  # killed before the folder went: the rerun finishes it
    os.replace(store.dir, tmp_path / "o.parquet.parts.removing")  # killed while removing it
    assert not finished(out, store.dir)
    store.remove()
    assert finished(out, store.dir) and not (tmp_path / "o.parquet.parts.removing").exists()


def test_the_folder_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "o.parts").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        _store(tmp_path / "o.parts")[0].resume()


def test_a_second_writer_is_refused_at_once(tmp_path: Path) -> None:
    """Another writer (here a thread; the lock is re-entrant only in its own thread) is
    refused at once, naming the store's field."""
    import threading

    store, _ = _store(tmp_path / "o.parts")
    errors: list[BaseException] = []

    def second() -> None:
        try:
            with _store(tmp_path / "o.parts")[0].lock(tmp_path / "o.parquet"):
                pass
        except InputError as exc:
            errors.append(exc)

    with store.lock(tmp_path / "o.parquet"):
        t = threading.Thread(target=second)
        t.start()
        t.join(30)
    assert len(errors) == 1 and errors[0].field == "--out"
    assert "being written by another evictlab run" in errors[0].problem


def test_job_differences_names_nested_fields() -> None:
    assert job_differences(JOB, JOB) == []
    assert job_differences({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 4}) == [
        "a.c 2 there, 3 now", "d absent there, 4 now"]

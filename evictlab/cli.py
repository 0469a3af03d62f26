"""The ``evictlab`` command line: thin typer commands that call the library.

Each package owns its commands in ``evictlab/<package>/commands.py`` and registers them
below, one line each. Command modules import heavy libraries (torch, transformers)
inside the command functions so ``evictlab --help`` stays fast.

Conventions every command follows (enforced here, in :func:`run`):

* exit 0: success (``--help`` included);
* exit 1: a failure that is not the user's input (e.g. two exact methods disagree; a bug
  prints its traceback and also exits 1);
* exit 2: bad usage or bad input, printed as ONE line ``error: <what>. Fix: <how>``;
  click/typer usage errors (unknown command or option, missing or badly typed value,
  extra argument, a group called without a command) add the usage line after it;
* exit 3: ``hardness decide`` stopped by ``--time-limit`` without an answer;
* exit 130 (Ctrl-C, SIGINT) or 143 (SIGTERM): one line
  ``interrupted; rerun the same command to resume`` and no traceback. Both signals
  unwind the command like a KeyboardInterrupt, so atomic writers remove their temporary
  files and resumable runs keep what they had committed.

Usage errors are recognised by duck typing (the class names click has used since 7.0:
``UsageError``, ``ClickException``, ``Abort``, ``Exit``), so the same code works with
click's own exceptions (typer <= 0.2x with click 8.1-8.3) and with the copy of click that
newer typer releases vendor as ``typer._click``.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Any, Sequence

import typer

from evictlab.errors import EvictlabError

# rich_markup_mode=None: help texts are printed as written. Rich markup would eat every
# "[...]" (e.g. "[ceil(keys*(1-spread)), keys]") and mangle JSON examples.
app = typer.Typer(
    name="evictlab",
    help="Exact analysis of KV-cache eviction: capture -> rows -> solve -> stats -> contour -> decode.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

# --- registration: one line per package (keep sorted by data flow) ---------------------
from evictlab.models.commands import models_app  # noqa: E402

app.add_typer(models_app, name="models")
from evictlab.capture.commands import capture  # noqa: E402

app.command("capture")(capture)
from evictlab.rows.commands import app as rows_app  # noqa: E402

app.add_typer(rows_app, name="rows")
from evictlab.solve.commands import SOLVE_CONTEXT, SolveCommand, solve  # noqa: E402

app.command("solve", cls=SolveCommand, context_settings=SOLVE_CONTEXT)(solve)
from evictlab.hardness.commands import app as hardness_app  # noqa: E402

app.add_typer(hardness_app, name="hardness")
from evictlab.stats.commands import predictor_app  # noqa: E402

app.add_typer(predictor_app, name="predictor")
from evictlab.contour.commands import contour_app  # noqa: E402

app.add_typer(contour_app, name="contour")
from evictlab.pipeline import demo  # noqa: E402

app.command("demo")(demo)
from evictlab.decode.commands import audit, decode  # noqa: E402

app.command("audit")(audit)
app.command("decode")(decode)
from evictlab.eval.commands import eval_app  # noqa: E402

app.add_typer(eval_app, name="eval")
from evictlab.dilution.commands import app as dilution_app  # noqa: E402

app.add_typer(dilution_app, name="dilution")
from evictlab.gates.commands import gates_app  # noqa: E402

app.add_typer(gates_app, name="gates")
# --- end registration -----------------------------------------------------------------


@app.command("version")
def version() -> None:
    """Print the evictlab version (and, on stderr, packages that differ from constraints.txt)."""
    from evictlab import __version__
    from evictlab.record import drift_lines, version_drift

    typer.echo(__version__)
    for line in drift_lines(version_drift()):
        typer.echo(f"note: {line}", err=True)


PROG = "evictlab"
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM
INTERRUPTED_LINE = "interrupted; rerun the same command to resume"


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: run the command line and exit with its code (see the module doc)."""
    sys.exit(run(argv))


def run(argv: Sequence[str] | None = None) -> int:
    """Run ``evictlab ARGV`` and return its exit code; usage errors and signals never raise."""
    from evictlab.cliutil import written_outputs

    args = list(sys.argv[1:] if argv is None else argv)
    written_outputs(reset=True)
    with _SignalsAsInterrupt() as signals:
        try:
            code = _invoke(args)
        except BaseException as exc:  # noqa: BLE001 - sorted below; anything unknown is re-raised
            if signals.received is not None or _caused_by_interrupt(exc):
                return _interrupted(signals.received)
            return _report(exc, args)
        if signals.received is not None or code == EXIT_INTERRUPTED:
            # newer typer turns a KeyboardInterrupt into a silent exit code 130
            return _interrupted(signals.received)
        return code


# --- invocation -----------------------------------------------------------------------


def _invoke(args: list[str]) -> int:
    from evictlab.cliutil import renamed_options

    command = typer.main.get_command(app)
    group, path, rest = _resolve(command, args)
    if _is_group(group) and not rest:
        # `evictlab` or `evictlab rows` alone: the same answer whatever the click version
        # (click 8.1 printed the help and exited 0, click 8.2 exits 2).
        ctx = _context(group, path)
        typer.echo(ctx.get_help(), err=True)
        return _usage_error(f"{' '.join(path)}: no command given",
                            _help_fix(path, "name one of the commands listed above", "them"), ctx=None)
    # Old spellings of renamed options still work this release, with one note each.
    rest, notes = renamed_options(" ".join(path[1:]), rest)
    for note in notes:
        typer.echo(note, err=True)
    args = [*path[1:], *rest]
    # standalone_mode=False: errors come back to us as exceptions, an Exit as its code.
    rv = command.main(args=args, prog_name=PROG, standalone_mode=False)
    return rv if isinstance(rv, int) and not isinstance(rv, bool) else 0


def _resolve(command: Any, args: list[str]) -> tuple[Any, list[str], list[str]]:
    """The deepest (sub)command named by the leading words of ``args``, its path and the rest."""
    path = [PROG]
    while _is_group(command) and args and not args[0].startswith("-"):
        sub = command.commands.get(args[0])
        if sub is None:
            break
        command, path, args = sub, [*path, args[0]], args[1:]
    return command, path, args


def _is_group(command: Any) -> bool:
    return isinstance(getattr(command, "commands", None), dict)


def _context(command: Any, path: list[str]) -> Any:
    """A bare click context (no parsing) for the usage and help texts of ``command``."""
    return command.context_class(command, info_name=" ".join(path))


# --- reporting ------------------------------------------------------------------------


def _report(exc: BaseException, args: list[str]) -> int:
    """Turn an exception from a command into an exit code, printing one line; re-raise bugs."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if isinstance(exc, SystemExit):  # a command's sys.exit(code)
        raise exc
    if isinstance(exc, EvictlabError):
        _error_line(str(exc))
        return EXIT_USAGE
    if "Exit" in names and isinstance(getattr(exc, "exit_code", None), int):
        return int(exc.exit_code)  # type: ignore[attr-defined]
    if "UsageError" in names:
        return _click_usage_error(exc, args)
    if "ClickException" in names:
        _error_line(_sentence(exc.format_message()))
        return int(getattr(exc, "exit_code", 1))
    if "Abort" in names:  # end of input at a prompt; interrupts were handled before
        _error_line("aborted")
        return 1
    if isinstance(exc, BrokenPipeError):  # `evictlab ... | head`: stop quietly
        _silence_stdout()
        return 1
    raise exc


def _click_usage_error(exc: Any, args: list[str]) -> int:
    ctx = getattr(exc, "ctx", None)
    if ctx is not None:
        command, path = ctx.command, ctx.command_path.split()
    else:  # some parser errors (e.g. too few values for an option) carry no context
        command, path, _ = _resolve(typer.main.get_command(app), args)
        ctx = _context(command, path)
    names = {cls.__name__ for cls in type(exc).__mro__}
    message = _sentence(exc.format_message())
    if "NoArgsIsHelpError" in names:  # a command declared no_args_is_help (click >= 8.2)
        typer.echo(exc.format_message(), err=True)
        message = f"{' '.join(path)}: no arguments given"
    if "NoSuchOption" in names:
        fix = _help_fix(path, "check the spelling", "the options")
    elif "MissingParameter" in names:
        fix = _help_fix(path, f"pass {_param_name(exc.param) or 'it'}", "what it takes")
    elif "BadParameter" in names:
        fix = _help_fix(path, f"pass a valid value for {_param_name(exc.param) or 'it'}", "what it takes")
    elif "BadOptionUsage" in names and getattr(exc, "option_name", None):
        fix = _help_fix(path, f"give {exc.option_name} the values it expects", "them")
    elif _is_group(command):
        fix = _help_fix(path, "use one of the commands", "them")
    elif message.lower().startswith("got unexpected extra argument"):
        fix = _help_fix(path, "remove the extra value(s) or quote a value that contains spaces", "the arguments")
    else:
        fix = _help_fix(path, "correct the command line", "the usage")
    return _usage_error(message, fix, ctx)


def _usage_error(message: str, fix: str, ctx: Any) -> int:
    _error_line(f"{message}. Fix: {fix}")
    if ctx is not None:
        typer.echo(ctx.get_usage(), err=True)
    return EXIT_USAGE


def _help_fix(path: list[str], what: str, lists: str) -> str:
    return f"{what} (`{' '.join(path)} --help` shows {lists})"


def _param_name(param: Any) -> str | None:
    """``--long-option`` for an option, ``the NAME argument`` for an argument."""
    if param is None:
        return None
    opts = [o for o in getattr(param, "opts", ()) if o.startswith("-")]
    if opts:
        return max(opts, key=len)
    name = getattr(param, "name", None)
    return f"the {str(name).upper()} argument" if name else None


def _sentence(text: str) -> str:
    """One line without the final period, first letter lower-cased unless it starts an acronym."""
    line = " ".join(str(text).split()).rstrip(".")
    if len(line) > 1 and line[0].isupper() and line[1].islower():
        line = line[0].lower() + line[1:]
    return line


def _error_line(text: str) -> None:
    typer.secho(f"error: {text}", err=True, fg=typer.colors.RED)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


# --- interrupts -----------------------------------------------------------------------


def _caused_by_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised while handling, a KeyboardInterrupt.

    A KeyboardInterrupt raised inside a Numba-compiled (or Numba-parallel) function comes
    back as ``SystemError: ... returned a result with an exception set`` whose
    ``__cause__``/``__context__`` chain holds the KeyboardInterrupt; older click wraps it in
    ``Abort``.
    """
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, KeyboardInterrupt):
            return True
        stack.extend((e.__cause__, e.__context__))
    return False


def _interrupted(signum: int | None) -> int:
    from evictlab.cliutil import written_outputs

    done = written_outputs()
    if done:  # the command's outputs were complete before the signal: the run succeeded
        typer.echo(f"note: interrupted after the outputs were complete ({', '.join(done)}); nothing to rerun",
                   err=True)
        return 0
    typer.echo(INTERRUPTED_LINE, err=True)
    return EXIT_TERMINATED if signum == signal.SIGTERM else EXIT_INTERRUPTED


class _SignalsAsInterrupt:
    """While active, SIGINT and SIGTERM raise KeyboardInterrupt and are remembered.

    SIGTERM (``kill``, a batch scheduler) then unwinds like Ctrl-C: ``finally`` blocks and
    atomic writers clean up. A signal the process inherited as ignored (``nohup``, a
    background job of a non-interactive shell) stays ignored, and a handler someone else
    installed is left alone. The previous handlers come back on exit.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        raise KeyboardInterrupt

    def __enter__(self) -> _SignalsAsInterrupt:
        defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
        for signum, default in defaults.items():
            try:
                if signal.getsignal(signum) is default:
                    self._previous[signum] = signal.signal(signum, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


if __name__ == "__main__":
    main()

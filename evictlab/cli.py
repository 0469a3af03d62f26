"""The ``evictlab`` command line: thin typer commands that call the library.

Each package owns its commands in ``evictlab/<package>/commands.py`` and registers them
below, one line each. Command modules import heavy libraries (torch, transformers)
inside the command functions so ``evictlab --help`` stays fast.
"""

from __future__ import annotations

import sys

import typer

from evictlab.errors import EvictlabError

app = typer.Typer(
    name="evictlab",
    help="Exact analysis of KV-cache eviction: capture -> rows -> solve -> stats -> contour -> decode.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# --- registration: one line per package (keep sorted by data flow) ---------------------
from evictlab.capture.commands import capture, models_app  # noqa: E402

app.add_typer(models_app, name="models")
app.command("capture")(capture)
from evictlab.rows.commands import app as rows_app  # noqa: E402

app.add_typer(rows_app, name="rows")
from evictlab.solve.commands import SOLVE_CONTEXT, SolveCommand, solve  # noqa: E402

app.command("solve", cls=SolveCommand, context_settings=SOLVE_CONTEXT)(solve)
from evictlab.hardness.commands import app as hardness_app  # noqa: E402

app.add_typer(hardness_app, name="hardness")
from evictlab.stats.commands import predictor_app  # noqa: E402

app.add_typer(predictor_app, name="predictor")
from evictlab.pipeline import demo  # noqa: E402

app.command("demo")(demo)
from evictlab.decode.commands import audit, decode  # noqa: E402

app.command("audit")(audit)
app.command("decode")(decode)
# --- end registration -----------------------------------------------------------------


@app.command("version")
def version() -> None:
    """Print the evictlab version."""
    from evictlab import __version__

    typer.echo(__version__)


def main() -> None:
    """Entry point that turns evictlab's own errors into one clear line and exit code 2."""
    try:
        # Without standalone mode click hands typer.Exit back as a return value (its exit
        # code) instead of raising; pass it on so `raise typer.Exit(1)` still fails the shell.
        rc = app(standalone_mode=False)
        if isinstance(rc, int) and not isinstance(rc, bool) and rc != 0:
            sys.exit(rc)
    except EvictlabError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click usage errors and aborts
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, click.exceptions.Abort):
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()

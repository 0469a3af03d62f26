"""``evictlab hardness ...``: thin commands over :mod:`evictlab.hardness`.

* ``check``  generate balanced yes/no instances, decide both sides with both methods, report.
* ``reduce`` write the ZERO-ES image of a k-subset-sum instance.
* ``decide`` decide a ZERO-ES instance exactly and print the kept indices of a solution.

Exit codes: 0 success, 1 disagreement between exact methods (a bug), 2 bad input (printed
as one line by ``evictlab.cli.main``), 3 ``decide`` stopped by ``--time-limit`` without an answer. Failures exit through ``sys.exit`` because
``cli.main`` runs typer in non-standalone mode, where a ``typer.Exit`` code is not propagated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from evictlab.cliutil import QUIET
from evictlab.errors import InputError

app = typer.Typer(
    help="NP-hardness of zero-error forced-weight eviction: reduce, decide, check.",
    no_args_is_help=True,
)


@app.command("check")
def check_command(
    trials: int = typer.Option(100, "--trials", help="Number of source instances (half planted yes, half proved no)."),
    size: int = typer.Option(8, "--size", help="Number of source values n (the image has 2n+1)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of numpy.random.default_rng."),
    magnitude: Optional[int] = typer.Option(
        None, "--magnitude", help="Values drawn from [-M, M]; default 2^n (at least 8), capped for CP-SAT."
    ),
    time_limit: Optional[float] = typer.Option(
        None, "--time-limit", help="CP-SAT seconds per decision; default none (always a proof)."
    ),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder for trials.parquet and run_record.json."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace trials.parquet and run_record.json in --out."),
    quiet: bool = QUIET,
) -> None:
    """Decide source and image with CP-SAT and the exact DP; exit 1 on any disagreement."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from evictlab.hardness.check import SOLVERS, check_reduction
    from evictlab.hardness.deciders import check_time_limit
    from evictlab.io import check_output_file
    from evictlab.record import RECORD_NAME, RunRecord, record_path

    check_time_limit(time_limit)
    if out is not None and out.exists():  # refused before the run, not after it
        if not out.is_dir():
            raise InputError("--out", f"{out} is a file", "pass a folder (new or existing) for --out")
        for name in ("trials.parquet", RECORD_NAME):
            check_output_file(out / name, "--out", overwrite=overwrite)
    record = RunRecord(kind="hardness-check", seed=seed,
                       config={"trials": trials, "size": size, "magnitude": magnitude, "time_limit": time_limit})
    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=quiet) as progress:
        task = progress.add_task("checking", total=trials if trials > 0 else None)
        table, summary = check_reduction(trials, size, seed=seed, magnitude=magnitude, time_limit_s=time_limit,
                                         on_trial=lambda _row: progress.advance(task))

    counts = Table(title=f"ZERO-ES reduction check (n = {size}, seed = {seed})")
    for col in ("tried", "yes", "no", "agreed", "disagreed", "certificates verified"):
        counts.add_column(col, justify="right")
    counts.add_row(str(summary.tried), str(summary.yes), str(summary.no), str(summary.agreed),
                   str(summary.disagreed), str(summary.certificates_checked))
    times = Table(title="solver times (ms)")
    for col in ("solver", "total", "mean", "max"):
        times.add_column(col, justify="right")
    for name in SOLVERS:
        total, mean, worst = summary.seconds[name]
        times.add_row(name.replace("_", " "), f"{1e3 * total:.1f}", f"{1e3 * mean:.2f}", f"{1e3 * worst:.2f}")
    stdout = Console()
    stdout.print(counts)
    stdout.print(times)

    if out is not None:
        from evictlab.io import write_checked_parquet

        write_checked_parquet(table, out / "trials.parquet")
        record.write(record_path(out, folder=True), summary={"tried": summary.tried, "agreed": summary.agreed,
                                                       "disagreed": summary.disagreed})
        stdout.print(f"wrote {out / 'trials.parquet'} and {out / 'run_record.json'}")
    if summary.disagreed:
        for row in table.filter(~table["agreed"]).head(10).iter_rows(named=True):
            stdout.print(f"[red]trial {row['trial']} ({row['family']}): {row['error']}[/red]")
        sys.exit(1)


@app.command("reduce")
def reduce_command(
    source: Path = typer.Argument(..., help='k-subset-sum JSON: {"problem": "k-subset-sum", "values": [...], "k": .., "target": ..}'),
    out: Path = typer.Option(..., "--out", help='Where to write the image: {"problem": "zero-es", "values": [...], "s": ..}'),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file."),
) -> None:
    """Write the ZERO-ES image of a k-subset-sum instance (same answer, polynomial size)."""
    from evictlab.hardness.instances import SOURCE_PROBLEM, load_instance, within_cpsat_limits
    from evictlab.hardness.reduction import reduce_instance
    from evictlab.io import atomic_write_json, check_output_file

    check_output_file(out, "--out", overwrite=overwrite)
    src = load_instance(source, expect=SOURCE_PROBLEM)
    image = reduce_instance(src)  # type: ignore[arg-type]
    atomic_write_json(out, image.to_json())
    typer.echo(f"wrote {out}: {image.n} values, s = {image.s}")
    if not within_cpsat_limits(image):
        typer.echo("note: the image exceeds CP-SAT's int64 limit; decide it with --method dp", err=True)


@app.command("decide")
def decide_command(
    image: Path = typer.Argument(..., help='ZERO-ES JSON: {"problem": "zero-es", "values": [...], "s": ..}'),
    as_json: bool = typer.Option(False, "--json", help='Print one object {"answer": "yes"|"no", "kept": [indices]}.'),
    method: str = typer.Option("both", "--method", help="cpsat, dp, or both (cross-checked; default)."),
    time_limit: Optional[float] = typer.Option(None, "--time-limit", help="CP-SAT seconds; default none."),
) -> None:
    """Decide whether some s kept values have the mean of all values (ES(s) = 0)."""
    from evictlab.hardness.deciders import DisagreementError, UndecidedError, check_decide_options, decide_checked
    from evictlab.hardness.instances import IMAGE_PROBLEM, load_instance

    check_decide_options(method, time_limit)
    inst = load_instance(image, expect=IMAGE_PROBLEM)
    try:
        first = decide_checked(inst, method, time_limit_s=time_limit)  # type: ignore[arg-type]
    except UndecidedError as exc:  # not bad input and not an answer: its own exit code
        typer.echo(f"undecided: {exc}; raise or drop --time-limit, or use --method dp", err=True)
        sys.exit(3)
    except DisagreementError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(1)
    if as_json:
        typer.echo(json.dumps({"answer": first.answer, "kept": list(first.certificate)}))
    else:
        typer.echo(first.answer)
        if first.yes:
            typer.echo("kept: " + " ".join(str(i) for i in first.certificate))

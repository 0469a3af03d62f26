"""``evictlab contour fit``: ContourKV profiles from captured rows (thin: calls evictlab.contour.fit)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from evictlab.cliutil import QUIET

contour_app = typer.Typer(help="ContourKV: per-cell dropped-mass profiles for the contourkv allocators.",
                          no_args_is_help=True, add_completion=False)

#: Relative budgets shown in the summary (b / n).
_SHOWN = (1 / 64, 1 / 16, 1 / 4)


@contour_app.command("fit")
def fit(
    rows: Path = typer.Argument(..., help="Row dataset directory (evictlab capture --out ROWS)."),
    results: Optional[Path] = typer.Argument(None, help="Solver results of these rows (evictlab solve ROWS --out "
                                             "RESULTS): per-cell selection ceilings are stored beside the profile."),
    out: Path = typer.Option(..., "--out", help="Where to write the profile JSON (the run record goes beside it)."),
    predictor: Optional[Path] = typer.Option(None, "--predictor", help="Predictor JSON (evictlab predictor fit) to "
                                             "embed, for the contourkv_pred allocator."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out (and its run record)."),
    quiet: bool = QUIET,
) -> None:
    """Fit per-cell dropped-mass profiles; use them with --method SCORER+contourkv --allocator-param profile=OUT."""
    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    from evictlab.cliutil import outputs_written
    from evictlab.contour.fit import fit_profile
    from evictlab.io import check_output_file
    from evictlab.record import RunRecord, record_path

    out = check_output_file(out, "--out", overwrite=overwrite)
    record = RunRecord(kind="contour.fit", config={"rows": str(rows), "results": None if results is None else str(results),
                                                   "predictor": None if predictor is None else str(predictor)})
    with tqdm(unit="row", desc="contour fit", disable=True if quiet else None) as bar:
        prof = fit_profile(rows, results, predictor, progress=bar.update)
    record.model = prof.model
    # The run record first, the profile last: the profile (one atomic write) is the output's
    # commit, so an interrupt before it leaves no --out (the rerun runs), and after it the run
    # has succeeded (exit 0), whatever the summary below was doing.
    record.write(record_path(out), output=str(out))
    prof.save(out)
    outputs_written(out)

    import numpy as np

    g = prof.geometry
    cols = [int(np.argmin(np.abs(prof.grid - r))) for r in _SHOWN]
    flat = prof.dropped[..., cols[1]].reshape(-1)
    order = np.argsort(-flat, kind="stable")
    pick = list(order[:5]) + [c for c in order[-3:] if c not in order[:5]]
    table = Table(title=f"{prof.model}: {g['n_layers']} layers x {g['kv_heads']} KV heads, "
                        f"{prof.source['rows_used']} rows (n {prof.source['n_min']}..{prof.source['n_max']}); "
                        "flattest 5 and peakiest 3 cells")
    for c in ("layer", "kv_head", "rows", *[f"D(b = n/{round(1 / prof.grid[j])})" for j in cols], "H/log n"):
        table.add_column(c, justify="right")
    for c in pick:
        l, h = divmod(int(c), g["kv_heads"])
        table.add_row(str(l), str(h), str(int(prof.rows[l, h])), *[f"{prof.dropped[l, h, j]:.3f}" for j in cols],
                      f"{prof.entropy_norm[l, h]:.3f}")
    Console(stderr=True).print(table)
    if prof.selection is not None:
        typer.echo(f"selection ceilings per cell stored for budgets {prof.selection['budgets']}", err=True)
    if prof.predictor is not None:
        typer.echo(f"embedded predictor ({'+'.join(prof.predictor['features'])}): use --method SCORER+contourkv_pred",
                   err=True)
    typer.echo(f"wrote {out}")

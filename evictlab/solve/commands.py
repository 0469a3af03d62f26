"""``evictlab solve``: rows -> per-(row, s) optima (a thin wrapper over evictlab.solve.runner)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

import typer

from evictlab.errors import InputError


def _parse_budgets(first: List[str], extra: List[str]) -> tuple[int, ...]:
    """Budgets from ``--budgets`` values (repeated or comma-separated) and trailing numbers."""
    out: list[int] = []
    for tok in [*first, *extra]:
        for part in str(tok).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                out.append(int(part))
            except ValueError:
                raise InputError("--budgets", f"{part!r} is not an integer",
                                 "write budgets as integers, e.g. --budgets 4 8 16 32") from None
    return tuple(out)


def solve(
    ctx: typer.Context,
    rows: Path = typer.Argument(..., help="Row dataset directory (put it before --budgets)."),
    budgets: List[str] = typer.Option(
        ..., "--budgets",
        help="Budgets s: `--budgets 4 8 16 32`, `--budgets 4,8,16,32` or `--budgets 4 --budgets 8`."),
    out: Path = typer.Option(..., "--out", help="Results Parquet file (one row per (row_id, s))."),
    pool: Tuple[int, int] = typer.Option((2, 2), "--pool", help="Candidate pool r_m r_e, e.g. --pool 2 2."),
    certify: bool = typer.Option(False, "--certify",
                                 help="Also certify ES(s) over all keys (rows n <= --cert-max-n, s <= --cert-max-s)."),
    max_swaps: int = typer.Option(64, "--max-swaps", help="Balancing selector: at most K swaps."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Numba threads (default: all cores)."),
    chunk_rows: int = typer.Option(4096, "--chunk-rows", help="Rows per resumable part file."),
    cert_max_n: int = typer.Option(256, "--cert-max-n", help="Certify only rows with n <= this."),
    cert_max_s: int = typer.Option(8, "--cert-max-s", help="Certify only budgets s <= this."),
    cert_nodes: int = typer.Option(20_000_000, "--cert-nodes",
                                   help="Branch-and-bound node limit per (row, s); beyond it status 'limit'."),
    search: str = typer.Option("pool", "--search",
                               help="pool: candidate-pool optimum only; all: also the all-key local search "
                                    "(columns es_ls, gap_closed_ls, kept_ls, ls_moves)."),
    ls_pairs: int = typer.Option(8, "--ls-pairs", help="All-key search: pair swaps among this many shortlisted keys (0: single swaps only)."),
    ls_kicks: int = typer.Option(0, "--ls-kicks", help="All-key search: random restarts from the best set (slower, finds more)."),
    ls_seed: int = typer.Option(0, "--ls-seed", help="All-key search: seed of the kicks."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out."),
    restart: bool = typer.Option(False, "--restart", help="Discard part files of a different earlier job."),
) -> None:
    """Exact pool optimum ES_hat, balancing selector and (optionally) certified ES(s) for every row.

    Resumable: an interrupted run leaves <out>.parts/; rerunning the same command skips
    the finished parts. A run record is written to <out stem>.run_record.json.
    """
    from evictlab.solve.runner import SolveConfig, solve_rows

    bud = _parse_budgets(budgets, list(ctx.args))
    cfg = SolveConfig(budgets=bud, r_m=pool[0], r_e=pool[1], max_swaps=max_swaps, certify=certify,
                      cert_max_n=cert_max_n, cert_max_s=cert_max_s, cert_nodes=cert_nodes,
                      chunk_rows=chunk_rows, search=search, ls_pairs=ls_pairs, ls_kicks=ls_kicks,
                      ls_seed=ls_seed)
    summary = solve_rows(rows, out, cfg, threads=threads, overwrite=overwrite, restart=restart)
    resumed = f", {summary.parts_done_before} parts resumed" if summary.parts_done_before else ""
    typer.echo(f"wrote {summary.rows} rows x {len(bud)} budgets to {out}{resumed}")


#: typer settings needed so that `--budgets 4 8 16 32` passes the trailing numbers as ctx.args
SOLVE_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": False}

"""``evictlab solve``: rows -> per-(row, s) optima (a thin wrapper over evictlab.solve.runner)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, List, Optional, Tuple

import typer
from typer.core import TyperCommand

from evictlab.cliutil import QUIET
from evictlab.errors import InputError
from evictlab.executor.commands import EXECUTOR_OPTIONS

#: A token that continues a ``--keep`` list: an integer or a comma-separated list.
_BUDGET_TOKEN = re.compile(r"^[0-9][0-9,]*$")
_NUMBER = re.compile(r"^-?[0-9][0-9.,]*$")
_BUDGETS_HINT = "list every kept-key count right after --keep, e.g. --keep 4 8 16 32"


def expand_budgets(args: list[str]) -> list[str]:
    """``--keep 4 8 16`` -> ``--keep 4 --keep 8 --keep 16``.

    A click option takes a fixed number of values, so the numbers after the first one
    are rewritten as repeated options. Only integers and comma lists continue the list;
    anything else (an option, the ROWS path) ends it.
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        tok = args[i]
        out.append(tok)
        i += 1
        if tok == "--":
            out.extend(args[i:])
            break
        if tok == "--keep" and i < len(args) and not args[i].startswith("-"):
            out.append(args[i])
            i += 1
        if tok == "--keep" or tok.startswith("--keep="):
            while i < len(args) and _BUDGET_TOKEN.match(args[i]):
                out += ["--keep", args[i]]
                i += 1
    return out


def stray_argument(params: list[Any], args: list[str]) -> InputError | None:
    """The error for the first argument no option or parameter takes (None if none).

    Walks ``args`` (after :func:`expand_budgets`) as click will, knowing each option's
    number of values, so the error can name the option the stray value follows: a
    trailing number after ``--pool 2 2`` must not be taken as a budget (or anything).
    Unknown options are left to click.
    """
    takes: dict[str, int] = {}
    n_positional = 0
    for p in params:
        if getattr(p, "param_type_name", "") == "argument":
            n_positional += max(int(p.nargs), 1)
        elif getattr(p, "param_type_name", "") == "option":
            n = 0 if (p.is_flag or p.count) else int(p.nargs)
            for name in [*p.opts, *p.secondary_opts]:
                takes[name] = n
    positional, after = 0, None
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--":  # everything after it is positional
            extra = args[i + 1:][max(n_positional - positional, 0):]
            if not extra:
                return None
            tok, after = extra[0], None
        elif tok.startswith("-") and len(tok) > 1 and not _NUMBER.match(tok):
            name, eq, _ = tok.partition("=")
            if name not in takes:
                return None
            i += 1 + (0 if eq else takes[name])
            after = name
            continue
        elif positional < n_positional:
            positional += 1
            after = None
            i += 1
            continue
        if after == "--keep":
            return InputError("--keep", f"{tok!r} is not a kept-key count (they are positive "
                              "integers)", _BUDGETS_HINT)
        if after == "--pool":
            return InputError("--pool", f"takes exactly two numbers (r_m r_e), but {tok!r} "
                              "follows them", f"write --pool R_M R_E (e.g. --pool 2 2); "
                              f"{_BUDGETS_HINT}")
        if after is not None:
            n = takes[after]
            what = "no value" if n == 0 else f"{n} value{'s' if n > 1 else ''}"
            return InputError(after, f"takes {what}, but {tok!r} follows", f"remove {tok!r}; "
                              f"{_BUDGETS_HINT}")
        return InputError("ROWS", f"unexpected extra argument {tok!r} (solve reads one row "
                          "dataset)", f"pass one ROWS directory; {_BUDGETS_HINT}")
    return None


class SolveCommand(TyperCommand):
    """The ``solve`` command: ``--keep`` takes several numbers, and a number that no
    option takes is an error naming the option it follows (never a silent budget)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        args = expand_budgets(list(args))
        if not ctx.resilient_parsing and "--help" not in args:
            err = stray_argument(self.get_params(ctx), args)
            if err is not None:
                raise err
        return super().parse_args(ctx, args)


def _parse_budgets(values: List[str]) -> tuple[int, ...]:
    """The budgets s from ``--keep`` values (each an integer or a comma-separated list; the
    list rule of :mod:`evictlab.cliutil`: no empty entry, no budget twice)."""
    from evictlab.cliutil import parse_ints

    return tuple(parse_ints(values, "--keep", "kept-key count", example="4,8,16,32"))


def solve(
    ctx: typer.Context,
    rows: Path = typer.Argument(..., help="Row dataset directory (put it before --keep)."),
    budgets: List[str] = typer.Option(
        ..., "--keep",
        help="Keys kept per row, the budgets s: `--keep 4 8 16 32`, `--keep 4,8,16,32` or `--keep 4 --keep 8` "
             "(formerly --budgets)."),
    out: Path = typer.Option(..., "--out", help="Results Parquet file (one row per (row_id, s))."),
    pool: Tuple[int, int] = typer.Option((2, 2), "--pool", help="Candidate pool r_m r_e, e.g. --pool 2 2."),
    certify: bool = typer.Option(False, "--certify",
                                 help="Also certify ES(s) over all keys (rows n <= --cert-max-n, s <= --cert-max-s)."),
    max_swaps: int = typer.Option(64, "--max-swaps", help="Balancing selector: at most K swaps."),
    threads: int = typer.Option(0, "--threads", min=0, help="CPU threads of the computation (Numba) (0 = the library default, all cores)."),
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
    bound: bool = typer.Option(False, "--bound",
                               help="Also a certified lower bound on ES(s) at any n (columns es_lb, es_bb, "
                                    "gap_closed_ub, gap_closed_bb, lb_status, lb_nodes; docs/solvers.md)."),
    bound_nodes: int = typer.Option(64, "--bound-nodes",
                                    help="With --bound: node evaluations per (row, s) (1..100000; more: tighter, slower)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out."),
    restart: bool = typer.Option(False, "--restart", help="Discard part files of a different earlier job."),
    executor: str = EXECUTOR_OPTIONS["executor"],
    address: Optional[str] = EXECUTOR_OPTIONS["address"],
    quiet: bool = QUIET,
) -> None:
    """Exact pool optimum ES_hat, balancing selector and (optionally) certified ES(s) for every row.

    Resumable: an interrupted run leaves <out>.parts/; rerunning the same command checks
    the finished parts and computes only the rest. One run per --out at a time; the parent
    folder of --out must exist. A run record is written to <out stem>.run_record.json.
    With --executor ray each part is one Ray task (--threads CPUs each, 1 if 0); the results
    are the local run's, bit for bit.
    """
    from evictlab.cliutil import outputs_written, refuse_unused
    from evictlab.executor import check_executor
    from evictlab.executor.commands import executor_for
    from evictlab.solve.runner import SolveConfig, solve_rows

    check_executor(executor, address)
    for param in ("cert_max_n", "cert_max_s", "cert_nodes"):
        refuse_unused(ctx, param, "--" + param.replace("_", "-"), certify, "--certify")
    for param in ("ls_pairs", "ls_kicks", "ls_seed"):  # the all-key search also seeds the certificate
        refuse_unused(ctx, param, "--" + param.replace("_", "-"), search == "all" or certify or bound,
                      "--search all (or --certify, --bound)")
    refuse_unused(ctx, "bound_nodes", "--bound-nodes", bound, "--bound")
    if bound:
        from evictlab.solve.runner import check_bound_nodes

        check_bound_nodes(bound_nodes)

    bud = _parse_budgets(budgets)
    cfg = SolveConfig(budgets=bud, r_m=pool[0], r_e=pool[1], max_swaps=max_swaps, certify=certify,
                      cert_max_n=cert_max_n, cert_max_s=cert_max_s, cert_nodes=cert_nodes,
                      chunk_rows=chunk_rows, search=search, ls_pairs=ls_pairs, ls_kicks=ls_kicks,
                      ls_seed=ls_seed, bound=bound, bound_nodes=bound_nodes)
    with executor_for(executor, address) as ex:
        summary = solve_rows(rows, out, cfg, threads=threads, overwrite=overwrite, restart=restart, progress=not quiet,
                             notify=lambda msg: typer.echo(msg, err=True), executor=ex)
    outputs_written(out)
    resumed = f", {summary.parts_done_before} parts resumed" if summary.parts_done_before else ""
    typer.echo(f"wrote {summary.rows} rows x {len(bud)} budgets to {out}{resumed}")


#: click settings of ``solve`` (register with ``cls=SolveCommand``, which reads the
#: numbers after ``--keep``): no extra arguments, no unknown options.
SOLVE_CONTEXT = {"allow_extra_args": False, "ignore_unknown_options": False}

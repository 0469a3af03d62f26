"""``evictlab rows ...``: synth, inspect, export (thin wrappers over evictlab.rows)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from evictlab.cliutil import QUIET
from evictlab.errors import InputError
from evictlab.io import DEFAULT_MAX_GIB

if TYPE_CHECKING:
    from evictlab.rows.reader import RowStore

app = typer.Typer(help="The attention-row dataset: generate, inspect, export.",
                  no_args_is_help=True, add_completion=False)


@app.command("synth")
def synth(
    rows: int = typer.Option(..., "--count", help="Number of attention rows N to generate (formerly --rows; ROWS "
                             "always names a dataset)."),
    keys: int = typer.Option(..., "--keys", help="Keys per row n (the largest; see --spread)."),
    dim: int = typer.Option(..., "--dim", help="Head dimension d."),
    seed: int = typer.Option(..., "--seed", help="Seed of the single numpy Generator."),
    out: Path = typer.Option(..., "--out", help="New dataset directory."),
    kind: str = typer.Option("query", "--kind", help="query (q, K stored) or logits (Dirichlet)."),
    alpha: Optional[float] = typer.Option(None, "--alpha",
                                          help="Dirichlet concentration (logits kind; default 0.1)."),
    temperature: Optional[float] = typer.Option(
        None, "--temperature", help="Logit std ~ 1/temperature (query kind; default 0.5)."),
    sinks: Optional[int] = typer.Option(None, "--sinks",
                                        help="Attention-sink keys per block (query kind; default 1)."),
    sink_boost: Optional[float] = typer.Option(
        None, "--sink-boost", help="Logit boost of sink keys (query kind; default 6)."),
    recency: Optional[float] = typer.Option(
        None, "--recency", help="Logit bonus of the last key vs the first (query kind; default 0)."),
    values: str = typer.Option("gaussian", "--values", help="gaussian or clustered."),
    clusters: Optional[int] = typer.Option(None, "--clusters", show_default=False,
                                           help="Clusters per block (--values clustered only; default 8)."),
    rows_per_block: int = typer.Option(256, "--rows-per-block",
                                       help="Rows sharing one stored key/value block."),
    spread: float = typer.Option(0.25, "--spread",
                                 help="Row n uniform in [ceil(keys*(1-spread)), keys]."),
    rows_per_shard: int = typer.Option(16384, "--rows-per-shard", help="Rows per array shard."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Replace a row dataset at --out that has other settings."),
    max_gib: float = typer.Option(DEFAULT_MAX_GIB, "--max-gib", help="Refuse a dataset that would take more disk "
                                  "than this (GiB, estimated before anything is written)."),
    quiet: bool = QUIET,
) -> None:
    """Write a seeded synthetic row dataset (same arguments -> identical shard files).

    Resumable: rerunning an interrupted command continues where it stopped, with the same
    final files as an uninterrupted run. The parent folder of --out must exist.
    """
    from tqdm import tqdm

    from evictlab.io import check_output_path, check_output_size, exclusive_lock
    from evictlab.record import RunRecord
    from evictlab.rows.schema import RECORD_FILE
    from evictlab.rows.synth import SynthConfig, estimated_bytes, synthesize

    cfg = SynthConfig(rows=rows, keys=keys, dim=dim, seed=seed, kind=kind, alpha=alpha,
                      temperature=temperature, sinks=sinks, sink_boost=sink_boost,
                      recency=recency, values=values, clusters=clusters,
                      rows_per_block=rows_per_block, spread=spread,
                      rows_per_shard=rows_per_shard)
    record = RunRecord(kind="rows.synth", config=cfg.validate(), model="synthetic", seed=seed)
    check_output_size(estimated_bytes(cfg), max_gib, f"{rows:,} rows of {keys:,} keys (d = {dim})",
                      "generate fewer rows (--count) or --keys (or raise --max-gib)", option="--count")
    check_output_path(out, "--out", directory=True)
    with exclusive_lock(out, "--out"):  # also covers the run record
        with tqdm(total=rows, unit="row", desc="synth", disable=True if quiet else None) as bar:
            summary = synthesize(out, cfg, progress=bar.update, overwrite=overwrite)
        if summary.already_complete:
            typer.echo(f"{out} already holds this dataset ({summary.rows} rows, complete); "
                       "nothing to do (pass --overwrite to write it again)")
            return
        record.write(out / RECORD_FILE, output=str(out),
                     summary={"rows": summary.rows, "rows_resumed": summary.rows_resumed})
    resumed = f", resumed after {summary.rows_resumed} committed rows" if summary.rows_resumed else ""
    typer.echo(f"wrote {rows} rows (n <= {keys}, d = {dim}, kind {kind}) to {out}{resumed}")


@app.command("inspect")
def inspect(
    path: Path = typer.Argument(..., help="Row dataset directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    verify: bool = typer.Option(False, "--verify",
                                help="Also check every shard's checksum and every stored number."),
) -> None:
    """Counts, n and d ranges, models, schema version and capture modes of a dataset."""
    from evictlab.rows.reader import RowStore, progress_text, writer_command

    store = RowStore.open(path, allow_empty=True, allow_incomplete=True)
    s = store.verify() if verify else store.summary()
    warning = None if store.complete else _incomplete_warning(store)
    if warning:
        typer.secho(f"warning: {warning}", err=True, fg=typer.colors.YELLOW)
    if as_json:
        typer.echo(json.dumps(s, indent=2, sort_keys=True))
        return
    lines = [
        ("path", s["path"]),
        ("status", "complete" if s["complete"] else f"INCOMPLETE ({progress_text(store.manifest)} "
         f"committed; rerun the same {writer_command(store.manifest)} command to resume)"),
        ("schema version", s["schema_version"]),
        ("models", ", ".join(s["models"])),
        ("capture modes", ", ".join(s["capture_modes"])),
        ("rows", f"{s['rows']} (query {s['query_rows']}, logits {s['logit_rows']})"),
        ("prompts", s["prompts"]),
        ("labels", f"fact spans on {s['labelled_prompts']} of {s['prompts']} prompts"),
        ("blocks", s["blocks"]),
        ("shards", f"{s['shards']} ({s['bytes'] / 2**20:.1f} MiB)"),
        ("n range", f"{s['n_min']}..{s['n_max']} (mean {s['n_mean']:.1f})" if s["rows"] else "-"),
        ("d range", f"{s['d_min']}..{s['d_max']}"),
        ("layers", _ranges(s["layers"])),
        ("query heads", _ranges(s["q_heads"])),
        ("kv heads", _ranges(s["kv_heads"])),
        ("created", s["created"]),
    ]
    if verify:
        lines.append(("verified", "all committed shards: size, sha256, structure, finite numbers"))
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        typer.echo(f"{k:<{width}}  {v}")


def _incomplete_warning(store: RowStore) -> str:
    """One line on an unfinished dataset: how far it got and how to finish it."""
    from evictlab.rows.reader import progress_text, writer_command

    man = store.manifest
    return (f"{store.path} is incomplete ({progress_text(man)} committed); "
            f"the run writing it was interrupted or is still running. Other commands refuse it "
            f"until it is finished: rerun the same {writer_command(man)} command to resume it")


def _ranges(xs: list[int]) -> str:
    """Compact '0..3, 7' rendering of sorted integers."""
    if not xs:
        return "-"
    parts, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:  # type: ignore[list-item]
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(str(start) if start == prev else f"{start}..{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(parts)


@app.command("export")
def export(
    path: Path = typer.Argument(..., help="Row dataset directory."),
    out: Path = typer.Option(..., "--out", help="Output FILE.npz."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Export only the first N rows."),
    max_gib: float = typer.Option(DEFAULT_MAX_GIB, "--max-gib",
                                  help="Refuse if the dense arrays would exceed this size."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file."),
) -> None:
    """Export rows as dense padded arrays (p, values, n, ids, key_index, prompt_tokens)."""
    from evictlab.io import check_output_path, exclusive_lock
    from evictlab.record import RunRecord, record_path
    from evictlab.rows.export import export_npz

    record = RunRecord(kind="rows.export", config={"path": str(path), "limit": limit,
                                                   "max_gib": max_gib})
    check_output_path(out, "--out", directory=False)
    with exclusive_lock(out, "--out"):  # also covers the run record
        info = export_npz(path, out, limit=limit, max_bytes=int(max_gib * 2**30),
                          overwrite=overwrite)
        record.write(record_path(out), output=str(out), summary=info)
    typer.echo(f"wrote {info['rows']} rows (n_max {info['n_max']}, d {info['head_dim']}) to {out}")

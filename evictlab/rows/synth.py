"""Seeded synthetic attention rows with controllable peakedness (for tests and demos).

Two kinds of rows, both written through :class:`evictlab.rows.writer.RowWriter`:

* ``kind="query"``: random keys and a query per row; ``p = softmax(q . K^T / sqrt(d))``
  is recomputed at read time exactly as for captured rows. Knobs:
  ``temperature`` (the logits' standard deviation is about ``1/temperature``: small means
  peaked), ``sinks`` (the first ``sinks`` keys of every block get a logit boost of
  ``sink_boost``: attention sinks), ``recency`` (a logit bonus rising linearly from 0 on the
  first key of a block to ``recency`` on its last: later keys are favoured).
* ``kind="logits"``: Dirichlet(alpha, ..., alpha) masses stored as log-masses (float64);
  small ``alpha`` is peaked, large ``alpha`` flat.

Values are Gaussian N(0, I) or clustered (``clusters`` centres N(0, I), values = centre +
0.25 * noise), so forced and free-weight errors range from large to near zero.

Structure: ``rows_per_block`` rows share one block of keys/values (one synthetic prompt
per block with empty token ids, ``prompt_id`` = block number, layer 0, KV head 0, query
head 0, positions -1). Row r sees the causal prefix of ``n_r`` keys, ``n_r`` drawn
uniformly from ``[ceil(keys * (1 - spread)), keys]`` (``spread=0``: every row has
exactly ``keys`` keys). Everything comes from one ``numpy.random.default_rng(seed)``
stream, block by block, and shards are written byte-reproducibly: the same arguments give
identical shard files.

Resuming: the dataset is marked complete only when the last row is committed. Rerunning
with the same arguments on an interrupted dataset continues it: the committed blocks are
regenerated (to advance the random stream) but not written, and the result is
byte-identical to an uninterrupted run. Different arguments are refused (``--overwrite``
starts over).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from evictlab.errors import InputError
from evictlab.io import check_output_path, exclusive_lock, remove_temp_files
from evictlab.rows.reader import read_manifest
from evictlab.rows.schema import MANIFEST_FILE, is_complete
from evictlab.rows.writer import RowWriter

#: ``source.generator`` in the manifest of every synthetic dataset.
GENERATOR = "evictlab.rows.synth"

KINDS = ("query", "logits")
VALUE_MODES = ("gaussian", "clustered")


@dataclass(frozen=True)
class SynthConfig:
    """Every knob of the generator (defaults give moderately peaked query rows)."""

    rows: int
    keys: int
    dim: int
    seed: int = 0
    kind: str = "query"
    alpha: float | None = None          # logits kind only; default 0.1
    temperature: float | None = None    # query kind only; default 0.5
    sinks: int | None = None            # query kind only; default 1
    sink_boost: float | None = None     # query kind only; default 6.0 (logit units)
    recency: float | None = None        # query kind only; default 0.0 (logit units)
    values: str = "gaussian"
    clusters: int | None = None         # clustered values only; default 8
    rows_per_block: int = 256
    spread: float = 0.25
    rows_per_shard: int = 16384

    def validate(self) -> dict[str, Any]:
        """Check every knob (InputError naming its flag); return :meth:`resolved`."""
        return _check(self)

    def resolved(self) -> dict[str, Any]:
        """Knobs with kind-specific defaults filled in (what the manifest records)."""
        out = asdict(self)
        out["clusters"] = 8 if self.clusters is None else self.clusters  # recorded for every --values
        if self.kind == "query":
            out.update(
                temperature=0.5 if self.temperature is None else self.temperature,
                sinks=1 if self.sinks is None else self.sinks,
                sink_boost=6.0 if self.sink_boost is None else self.sink_boost,
                recency=0.0 if self.recency is None else self.recency,
            )
        else:
            out.update(alpha=0.1 if self.alpha is None else self.alpha)
        return out


def estimated_bytes(cfg: SynthConfig) -> int:
    """Bytes the dataset of ``cfg`` takes on disk, estimated from the shard layout (within a
    few percent): per block of ``rows_per_block`` rows its values (and, query kind, keys) as
    float32 and its positions as int64, per row its query (or logits) as float32 and its
    index entry (~100 bytes)."""
    blocks = -(-int(cfg.rows) // max(int(cfg.rows_per_block), 1))
    per_key = cfg.dim * 4 * (2 if cfg.kind == "query" else 1) + 8
    per_row = (cfg.dim * 4 if cfg.kind == "query" else cfg.keys * 4) + 100
    return blocks * cfg.keys * per_key + int(cfg.rows) * per_row


def _check(cfg: SynthConfig) -> dict[str, Any]:
    """Validate ``cfg`` (InputError naming the CLI flag) and return ``cfg.resolved()``."""

    def need(ok: bool, field: str, problem: str, fix: str) -> None:
        if not ok:
            raise InputError(field, problem, fix)

    need(cfg.clusters is None or cfg.values == "clustered", "--clusters", "only applies with --values clustered",
         "drop --clusters, or pass --values clustered")
    for name in ("rows", "keys", "dim", "rows_per_block", "rows_per_shard", "clusters"):
        v = getattr(cfg, name) if name != "clusters" else cfg.resolved()["clusters"]
        need(isinstance(v, (int, np.integer)) and v >= 1, "--count" if name == "rows" else f"--{name.replace('_', '-')}",
             f"must be a positive integer, got {v!r}", "pass an integer >= 1")
    need(isinstance(cfg.seed, (int, np.integer)) and cfg.seed >= 0, "--seed",
         f"must be a non-negative integer, got {cfg.seed!r}", "pass e.g. --seed 0")
    need(cfg.kind in KINDS, "--kind", f"{cfg.kind!r} is not one of {KINDS}", "pick one of those")
    need(cfg.values in VALUE_MODES, "--values", f"{cfg.values!r} is not one of {VALUE_MODES}",
         "pick one of those")
    need(0.0 <= cfg.spread < 1.0, "--spread", f"must be in [0, 1), got {cfg.spread!r}",
         "pass e.g. 0.25 (0: every row sees exactly --keys keys)")
    query_only = {"temperature": cfg.temperature, "sinks": cfg.sinks,
                  "sink_boost": cfg.sink_boost, "recency": cfg.recency}
    if cfg.kind == "logits":
        for k, v in query_only.items():
            need(v is None, f"--{k.replace('_', '-')}", "only applies to --kind query",
                 "drop it, or use --kind query")
    else:
        need(cfg.alpha is None, "--alpha", "only applies to --kind logits",
             "drop it, or use --kind logits")
    r = cfg.resolved()
    if cfg.kind == "logits":
        need(math.isfinite(r["alpha"]) and r["alpha"] > 0, "--alpha",
             f"must be finite and > 0, got {r['alpha']!r}", "pass e.g. 0.1 (peaked) or 10 (flat)")
    else:
        need(math.isfinite(r["temperature"]) and r["temperature"] > 0, "--temperature",
             f"must be finite and > 0, got {r['temperature']!r}", "pass e.g. 0.5")
        need(isinstance(r["sinks"], (int, np.integer)) and 0 <= r["sinks"] <= cfg.keys,
             "--sinks", f"must be an integer in [0, keys={cfg.keys}], got {r['sinks']!r}",
             "pass e.g. 1")
        need(math.isfinite(r["sink_boost"]) and math.isfinite(r["recency"]),
             "--sink-boost/--recency", "must be finite", "pass finite logit offsets")
        special = int(r["sinks"] > 0) + int(r["recency"] != 0)
        need(cfg.dim > special, "--dim", f"must exceed {special} to encode sinks/recency "
             "in separate directions", "raise --dim or drop --sinks/--recency")
    return r


def _query_block(rng: np.random.Generator, L: int, R: int, d: int,
                 r: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Keys float32 ``[L, d]`` and queries float32 ``[R, d]`` of one block.

    Sinks and recency live in orthonormal directions u, w that the random part of every
    query is projected off, so with scale 1/sqrt(d) the sink keys get exactly
    ``sink_boost`` (plus the usual random logit) and key j gets ``recency * j/(L-1)``.
    """
    keys = rng.standard_normal((L, d), dtype=np.float32).astype(np.float64)
    g = rng.standard_normal((R, d), dtype=np.float32).astype(np.float64)
    n_special = int(r["sinks"] > 0) + int(r["recency"] != 0)
    q = g / r["temperature"]
    if n_special:
        basis, _ = np.linalg.qr(rng.standard_normal((d, n_special)))
        q = (g - (g @ basis) @ basis.T) / r["temperature"] + basis.sum(axis=1)[None, :]
        root_d = math.sqrt(d)
        col = 0
        if r["sinks"] > 0:
            keys[: r["sinks"]] += r["sink_boost"] * root_d * basis[:, col]
            col += 1
        if r["recency"] != 0:
            ramp = np.arange(L, dtype=np.float64) / max(L - 1, 1)
            keys += (r["recency"] * root_d) * ramp[:, None] * basis[:, col][None, :]
    return keys.astype(np.float32), q.astype(np.float32)


def _values(rng: np.random.Generator, L: int, d: int, mode: str, clusters: int) -> np.ndarray:
    """Value vectors float32 ``[L, d]``."""
    if mode == "gaussian":
        return rng.standard_normal((L, d), dtype=np.float32)
    centres = rng.standard_normal((clusters, d), dtype=np.float32)
    which = rng.integers(0, clusters, size=L)
    return centres[which] + np.float32(0.25) * rng.standard_normal((L, d), dtype=np.float32)


def _dirichlet_logits(rng: np.random.Generator, n: np.ndarray, alpha: float) -> list[np.ndarray]:
    """Log-masses of Dirichlet(alpha) rows of lengths ``n``, float64, always finite.

    Uses Gamma(a) = Gamma(a+1) * U^(1/a) in log space, so tiny alpha never underflows to
    log(0); softmax of the result is an exact Dirichlet(alpha) draw.
    """
    total = int(n.sum())
    lg = np.log(rng.standard_gamma(alpha + 1.0, size=total)) + np.log(
        rng.random(total) + np.finfo(np.float64).tiny) / alpha
    return np.split(lg, np.cumsum(n)[:-1])


@dataclass(frozen=True)
class SynthSummary:
    """What :func:`synthesize` did: the dataset ``out`` holds ``rows`` rows; ``rows_resumed``
    of them were committed by an earlier, interrupted run with the same arguments;
    ``already_complete``: the dataset was already finished, nothing was written."""

    out: Path
    rows: int
    rows_resumed: int
    already_complete: bool


def _prepare_out(out: Path, source: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """Check what is at ``out`` (caller holds its lock); return its manifest if it is a
    dataset to resume or a finished one, None to start fresh."""
    if out.exists():
        remove_temp_files(out, (MANIFEST_FILE,))  # of a run killed while starting
    if not out.exists() or not any(out.iterdir()):
        return None
    if not (out / MANIFEST_FILE).exists():
        raise InputError("--out", f"{out} exists, is not empty and is not a row dataset",
                         "choose a new directory (nothing there is deleted, even with --overwrite)")
    if overwrite:
        shutil.rmtree(out)
        return None
    man = read_manifest(out)
    old = man["source"]
    new = json.loads(json.dumps(source))  # as the manifest stores it
    if old != new:
        key = next((k for k in new if old.get(k) != new[k]), None) or next(
            (k for k in old if k not in new), "generator")
        state = "a finished" if is_complete(man) else "an unfinished"
        flag = "--" + key.replace("_", "-") if key != "generator" else "the generator"
        raise InputError("--out", f"{out} holds {state} dataset made with different settings "
                         f"({flag}: {old.get(key)!r} there, {new.get(key)!r} now)",
                         "rerun with the same arguments to resume or keep it, pass --overwrite "
                         "to replace it, or choose another --out")
    return man


def synthesize(out: str | os.PathLike[str], cfg: SynthConfig,
               progress: Callable[[int], Any] | None = None, *,
               overwrite: bool = False) -> SynthSummary:
    """Write the synthetic row dataset described by ``cfg`` to ``out``, resumably.

    ``out`` must not exist, be an empty directory, or hold a dataset written with the same
    ``cfg`` (an unfinished one is resumed, a finished one is left as it is); ``overwrite``
    replaces a row dataset written with other settings. Its parent folder must exist.
    ``progress`` (optional) is called with the number of rows added (or found committed).
    """
    r = _check(cfg)
    out = check_output_path(out, "--out", directory=True)
    source = {"generator": GENERATOR, **r}
    with exclusive_lock(out, "--out"):
        man = _prepare_out(out, source, overwrite)
        if man is not None and is_complete(man):
            return SynthSummary(out, man["counts"]["rows"], man["counts"]["rows"], True)
        rng = np.random.default_rng(cfg.seed)
        d = cfg.dim
        n_lo = max(1, math.ceil(cfg.keys * (1.0 - cfg.spread)))
        scale = 1.0 / math.sqrt(d)
        with RowWriter(out, model="synthetic", capture_mode="synthetic", head_dim=d,
                       source=source, rows_per_shard=cfg.rows_per_shard,
                       expected={"rows": cfg.rows}) as w:
            resumed = w.n_rows
            done_blocks = w.completed_prompts
            if progress is not None and resumed:
                progress(resumed)
            done, block = 0, 0
            clusters = cfg.resolved()["clusters"]
            while done < cfg.rows:
                R = min(cfg.rows_per_block, cfg.rows - done)
                # Committed blocks are drawn again (same random stream) but not written.
                write = block not in done_blocks
                n = rng.integers(n_lo, cfg.keys + 1, size=R).astype(np.int64)
                L = int(n.max())
                if write:
                    w.add_prompt(block, [], source="synthetic", mode="synthetic",
                                 text=f"synthetic block {block}")
                vals = _values(rng, L, d, cfg.values, clusters)
                pos = np.full(L, -1, np.int64)
                heads = np.zeros(R, np.int64)
                row_pos = np.full(R, -1, np.int64)
                lo = np.zeros(R, np.int64)
                if cfg.kind == "query":
                    keys, q = _query_block(rng, L, R, d, r)
                    if write:
                        b = w.add_block(block, 0, 0, keys, vals, pos)
                        w.add_query_rows(b, q, heads, row_pos, lo, n, scale)
                else:
                    logits = _dirichlet_logits(rng, n, r["alpha"])
                    if write:
                        b = w.add_block(block, 0, 0, None, vals, pos)
                        w.add_logit_rows(b, logits, heads, row_pos, lo, n)
                if write:
                    w.end_prompt(block)
                    if progress is not None:
                        progress(R)
                done += R
                block += 1
    return SynthSummary(out, cfg.rows, resumed, False)

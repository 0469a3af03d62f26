"""``evictlab dilution sweep``: needle retrieval with a growing number of distractors, every
method at matched bytes through the decode loop (docs/dilution.md).

For each distractor count k and example i (:func:`evictlab.tasks.distractors.make_example`),
:func:`reference` runs the full cache once (the answer's logits, teacher-forced) and one
hooked forward over context + question that records the last question token's attention
rows in every layer (the useful-mass rows). Then :func:`run_unit`, the unit of work, runs
one method on that example: the decode loop in the paged store (``mode="physical"``) at the
sweep's budget, query-agnostic (the context is compressed before the question is appended),
teacher-forced over the answer; it returns one result row (:data:`RESULT_COLUMNS`).

Methods: ``full`` (the stock cache, nothing evicted), ``oracle_labels`` (ORACLE: evicts
distractors only, by the labels), and any ``scorer`` or ``scorer+allocator`` of the registry
(query-agnostic ones; ``oracle`` and ``kvzip`` also run, labelled by their own notes).

Resumable: each unit's row is a part file in ``DIR/results.parts/`` (the part store, :mod:`evictlab.parts`);
an example whose units are all done is skipped, so a rerun after Ctrl-C continues where it
stopped. At the end ``DIR/results.parquet``, ``DIR/summary.parquet``,
``DIR/verdict.parquet``, ``DIR/report.md``, ``DIR/sweep.png|pdf`` and ``DIR/run_record.json``.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from evictlab.tasks.distractors import KINDS, MAX_DISTRACTORS, DilutionExample
from evictlab.errors import InputError

__all__ = ["RESULT_COLUMNS", "Reference", "SweepConfig", "reference", "run_sweep", "run_unit", "summarize", "verdicts"]

FULL = "full"
ORACLE = "oracle_labels"
DEFAULT_METHODS = ("full", "oracle_labels", "streaming_llm", "h2o", "snapkv", "expected_attention",
                   "snapkv+adakv", "snapkv+pyramidkv")

RESULT_COLUMNS: dict[str, Any] = {
    "model": pl.Utf8, "kind": pl.Utf8, "distractors": pl.Int64, "example": pl.Int64, "seed": pl.Int64,
    "method": pl.Utf8, "scorer": pl.Utf8, "allocator": pl.Utf8, "oracle": pl.Boolean, "mode": pl.Utf8,
    "protocol": pl.Utf8, "budget": pl.Utf8, "budget_tokens": pl.Int64, "context_tokens": pl.Int64,
    "question_tokens": pl.Int64, "answer_tokens": pl.Int64, "useful_tokens": pl.Int64,
    "exact_match": pl.Float64, "answer_logprob": pl.Float64, "kl": pl.Float64, "top1_agreement": pl.Float64,
    "useful_mass": pl.Float64, "useful_mass_max": pl.Float64, "useful_kept": pl.Float64,
    "bytes_live": pl.Int64, "bytes_full": pl.Int64, "compressions": pl.Int64, "wall_s": pl.Float64,
}
"""Columns of ``results.parquet`` (one row per (distractor count, method, example))."""


@dataclass(frozen=True)
class SweepConfig:
    """Settings of ``evictlab dilution sweep`` (its options); validated by :meth:`check`
    before any model loads. ``budget``: kept entries, as ``evictlab decode --budget``
    (``128`` = 128 per cell, ``4096total``, ``2MiB``); ``context``: filler tokens besides
    the needles; loop settings as ``evictlab decode``."""

    model: str = "smollm2-135m"
    distractors: tuple[int, ...] = (0, 4, 16, 64, 256)
    n: int = 5
    methods: tuple[str, ...] = DEFAULT_METHODS
    budget: str = "128"
    context: int = 512
    kind: str = "near_miss"
    seed: int = 0
    device: str = "cpu"
    sinks: int = 4
    recent: int = 16
    chunk: int = 256
    window: int = 32
    compress_every: int = 16
    #: layers whose attention enters the useful mass ("all", or a list like 0,5,10-12)
    layers: str = "all"
    #: ``--scorer-param`` assignments ``(key, value)``, routed as in ``evictlab decode``: a key
    #: goes to the methods' scorers that have it (``trimkv.gates=DIR`` to one), e.g.
    #: ``(("gates", "default"),)`` for the learned gates of ``trimkv+global``
    scorer_params: tuple[tuple[str, str], ...] = ()

    def routed_params(self) -> dict[str, dict[str, str]]:
        """``{scorer: {key: value}}`` of :attr:`scorer_params` over the methods' scorers
        (:func:`evictlab.methods.registry.route_params`; InputError ``--scorer-param``)."""
        from evictlab.methods import parse_method
        from evictlab.methods.registry import route_params

        scorers = [parse_method(m)[0] for m in self.methods if m != FULL]
        if not self.scorer_params:
            return {n: {} for n in scorers}
        try:
            return route_params(dict(self.scorer_params), scorers, "scorer")
        except InputError as exc:
            raise InputError("--scorer-param", exc.problem, exc.fix) from None

    def check(self) -> None:
        from evictlab.capture.config import parse_layers
        from evictlab.kv.budget import Budget
        from evictlab.methods import canonical_method, parse_method
        from evictlab.models.loading import check_device

        check_device(self.device)
        parse_layers(self.layers, None)
        if not self.distractors or any(k < 0 or k > MAX_DISTRACTORS for k in self.distractors):
            raise InputError("--distractors", f"{list(self.distractors)} is empty or outside 0..{MAX_DISTRACTORS}",
                             f"pass counts like 0,4,16,64,256 (at most {MAX_DISTRACTORS})")
        if len(set(self.distractors)) != len(self.distractors):
            raise InputError("--distractors", f"{list(self.distractors)} repeats a count", "list each count once")
        if self.n < 1:
            raise InputError("--n", f"{self.n} examples", "use --n 1 or more")
        if self.kind not in KINDS:
            raise InputError("--kind", f"unknown kind {self.kind!r}", f"use one of: {', '.join(KINDS)}")
        if self.context < 64:
            raise InputError("--context", f"{self.context} filler tokens is too short", "use at least 64")
        if not self.methods:
            raise InputError("--methods", "no method given", f"use e.g. {','.join(DEFAULT_METHODS)}")
        canon = []
        for m in self.methods:
            try:
                canon.append(m if m == FULL else canonical_method(m))
            except InputError as exc:
                raise InputError("--methods", exc.problem, exc.fix) from None
        if len(set(canon)) != len(canon):
            raise InputError("--methods", f"{list(self.methods)} repeats a method", "list each method once")
        routed = self.routed_params()
        for m in self.methods:  # every method built once now: bad parameters, a missing gates folder
            if m != FULL:
                try:
                    _method(m, tuple(sorted(routed[parse_method(m)[0]].items())))
                except InputError as exc:
                    field = "--scorer-param" if exc.field in ("scorer_param", "gates") else "--methods"
                    raise InputError(field, exc.problem, exc.fix) from None
        try:
            Budget.parse(self.budget)
        except InputError as exc:
            raise InputError("--budget", exc.problem, exc.fix) from None
        for name in ("sinks", "recent"):
            if getattr(self, name) < 0:
                raise InputError(f"--{name}", f"must be >= 0, got {getattr(self, name)}", "pass 0 or more")
        for name in ("chunk", "window", "compress_every"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')}", f"must be positive, got {getattr(self, name)}",
                                 "pass a positive integer")

    def loop_settings(self) -> Any:
        """The loop's :class:`~evictlab.decode.config.LoopSettings` of the sweep."""
        from evictlab.decode.config import LoopSettings

        return LoopSettings(sinks=self.sinks, recent=self.recent, chunk_size=self.chunk, window=self.window,
                            compress_every=self.compress_every)

    def decode_config(self, method: str, example: DilutionExample | None = None) -> Any:
        """The loop's ``DecodeConfig`` for ``method`` (``oracle_labels`` gets the example's labels)."""
        from evictlab.decode.config import DecodeConfig
        from evictlab.kv.budget import Budget

        from evictlab.methods import parse_method

        if method == FULL:
            return DecodeConfig(mode="full", loop=self.loop_settings())
        params = tuple(sorted(self.routed_params()[parse_method(method)[0]].items()))
        cfg = DecodeConfig(mode="physical", budget=Budget.parse(self.budget), method=_method(method, params),
                           loop=self.loop_settings())
        return cfg if example is None else cfg.with_labels(example.useful_spec)


@functools.lru_cache(maxsize=64)
def _method(spec: str, scorer_params: tuple[tuple[str, str], ...] = ()) -> Any:
    """A sweep method built once per process and parameter set (the label ORACLE gets each
    example's labels from :meth:`~evictlab.decode.config.DecodeConfig.with_labels`)."""
    from evictlab.methods import build_method

    return build_method(spec, scorer_params=dict(scorer_params))


def _key(*parts: object) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", "__".join(str(p) for p in parts))


# ----------------------------------------------------------------------------- one example


@dataclass
class Reference:
    """The full cache on one example: answer logits ``(T, vocab)`` float32, its wall time and
    bytes, and the useful-mass rows: per layer the last question token's attention
    ``(q_heads, L)`` float64 over the L tokens of context + question (0 where not visible)."""

    logits: Any
    wall_s: float
    bytes_full: int
    rows: list[np.ndarray]
    kv_of: list[np.ndarray]  # per layer: KV head of each query head
    layers: list[int]        # the model layer of each entry of rows / kv_of


def reference(lm: Any, tok: Any, ex: DilutionExample, cfg: SweepConfig, layers: list[int] | None = None) -> Reference:
    """Run the full cache and the useful-mass forward on ``ex`` (``layers``: the layers whose
    attention rows are recorded, None = all)."""
    import torch

    from evictlab.capture.forward import capture_prompt
    from evictlab.decode.loop import run_sequence

    dev = next(lm.parameters()).device
    c, q, a = (torch.tensor([x], dtype=torch.long, device=dev) for x in (ex.context_ids, ex.question_ids, ex.answer_ids))
    with torch.no_grad():
        out = run_sequence(lm, c, q, cfg.decode_config(FULL), answer_ids=a, tokenizer=tok)
    tokens = ex.context_ids + ex.question_ids
    last = np.array([len(tokens) - 1], np.int64)
    caps = capture_prompt(lm, tokens, last, layers, dev)
    rows, kv_of = [], []
    for layer in sorted(caps):
        cap = caps[layer]
        lo, hi = (int(x[0]) for x in cap.key_range(last))
        P = np.zeros((cap.n_q_heads, len(tokens)))
        for h in range(cap.n_q_heads):
            k = cap.keys[cap.kv_head_of(h), lo:hi].double().numpy()
            z = (k @ cap.queries[h, 0].double().numpy()) * cap.scaling
            e = np.exp(z - z.max())
            P[h, lo:hi] = e / e.sum()
        rows.append(P)
        kv_of.append(np.array([cap.kv_head_of(h) for h in range(cap.n_q_heads)]))
    return Reference(out.logits[0].float().cpu(), float(out.wall_s), int(out.bytes_full_cache), rows, kv_of,
                     sorted(caps))


def useful_mass(ref: Reference, ex: DilutionExample, kept: list[Any] | None) -> tuple[float, float, float]:
    """``(mean, max, useful kept)`` over layers and query heads of alpha_A for the last question
    token: its full-cache attention renormalised over the kept keys (``kept``: per layer the
    positions each KV head kept after the context, ``(1, kv_heads, S)`` with -1 padding; None:
    every key), the question's own tokens always kept. ``useful kept``: the share of the
    useful tokens kept, averaged over (layer, KV head) cells."""
    n_ctx = len(ex.context_ids)
    a, b = ex.useful
    alphas, kept_share = [], []
    for i, (layer, P) in enumerate(zip(ref.layers, ref.rows)):
        L = P.shape[1]
        useful = np.zeros(L, bool)
        useful[a:b] = True
        if kept is None:
            masks = {int(g): np.ones(L, bool) for g in np.unique(ref.kv_of[i])}
        else:
            masks = {}
            pos = kept[layer][0].cpu().numpy()
            for g in range(pos.shape[0]):
                m = np.zeros(L, bool)
                p = pos[g][pos[g] >= 0]
                m[p[p < L]] = True
                m[n_ctx:] = True
                masks[g] = m
                kept_share.append(float(m[a:b].mean()))
        for h in range(P.shape[0]):
            m = masks[int(ref.kv_of[i][h])]
            pa = P[h, m].sum()
            alphas.append(P[h, m & useful].sum() / pa if pa > 0 else np.nan)
    arr = np.array(alphas)
    return float(np.nanmean(arr)), float(np.nanmax(arr)), float(np.mean(kept_share)) if kept_share else 1.0


def run_unit(lm: Any, tok: Any, ex: DilutionExample, method: str, cfg: SweepConfig, ref: Reference) -> dict[str, Any]:
    """The unit of work: ``method`` on example ``ex`` -> one result row (:data:`RESULT_COLUMNS`).

    (On the evaluation engine the same example is one context of the task
    ``dilution_KIND_kK``, :func:`evictlab.tasks.examples.dilution_example`; docs/dilution.md,
    "The sweep on the evaluation engine".)
    """
    import torch

    from evictlab.decode.loop import run_sequence
    from evictlab.eval.runner import example_metrics
    from evictlab.kv.budget import Budget
    from evictlab.methods import parse_method
    from evictlab.models.geometry import model_geometry

    answer = torch.tensor(ex.answer_ids, dtype=torch.long)
    g = model_geometry(lm)
    row: dict[str, Any] = {
        "model": cfg.model, "kind": cfg.kind, "distractors": ex.distractors, "example": ex.index, "seed": cfg.seed,
        "method": method, "context_tokens": len(ex.context_ids), "question_tokens": len(ex.question_ids),
        "answer_tokens": len(ex.answer_ids), "useful_tokens": ex.useful[1] - ex.useful[0], "budget": cfg.budget,
    }
    if method == FULL:
        logits, kept, wall = ref.logits, None, ref.wall_s
        row.update(scorer="none", allocator="none", oracle=False, mode="full", protocol="none", budget_tokens=None,
                   bytes_live=ref.bytes_full, compressions=0)
    else:
        scorer, alloc = parse_method(method)
        dcfg = cfg.decode_config(method, ex)
        dev = next(lm.parameters()).device
        c, q, a = (torch.tensor([x], dtype=torch.long, device=dev)
                   for x in (ex.context_ids, ex.question_ids, ex.answer_ids))
        t0 = time.perf_counter()
        with torch.no_grad():
            out = run_sequence(lm, c, q, dcfg, answer_ids=a, tokenizer=tok)
        wall = time.perf_counter() - t0
        logits, kept = out.logits[0].float().cpu(), out.context_kept
        row.update(scorer=scorer, allocator=alloc, oracle=scorer in (ORACLE, "oracle"), mode="physical",
                   protocol="query-agnostic",
                   budget_tokens=Budget.parse(cfg.budget).total_tokens(g.n_layers, g.kv_heads, g.head_dim, g.dtype),
                   bytes_live=out.after_compression("bytes_live") or out.peak("bytes_live"),
                   compressions=out.compressions)
    # the evaluation grid's per-example metrics, so the sweep's numbers mean what the grid's do
    met = example_metrics(ref.logits, logits, answer)
    mass, mass_max, kept_share = useful_mass(ref, ex, kept)
    row.update(exact_match=met["exact_match"], answer_logprob=met["answer_logprob"], kl=met["kl"],
               top1_agreement=met["top1_agreement"], useful_mass=mass, useful_mass_max=mass_max, useful_kept=kept_share, bytes_full=ref.bytes_full,
               wall_s=wall)
    return row


# ----------------------------------------------------------------------------- tables


def summarize(results: pl.DataFrame) -> pl.DataFrame:
    """Means per (model, kind, distractors, method) over examples."""
    return (results.group_by("model", "kind", "distractors", "method", maintain_order=True).agg(
        pl.len().alias("n"), pl.col("oracle").first(), pl.col("context_tokens").mean().alias("context_tokens"),
        *[pl.col(c).mean() for c in ("exact_match", "answer_logprob", "kl", "useful_mass", "useful_mass_max",
                                     "useful_kept")],
        pl.col("bytes_live").max().alias("bytes_live"), pl.col("bytes_full").max().alias("bytes_full"),
    ).sort("model", "kind", "distractors"))


#: Fewer paired examples than this get no verdict: a bootstrap over 2-4 examples has a
#: handful of distinct resamples, and its interval would claim far more than it knows.
MIN_VERDICT_N = 5


def verdicts(results: pl.DataFrame, seed: int = 0, n_boot: int = 2000) -> pl.DataFrame:
    """Each method against the full cache on the same examples, per (model, kind, distractors).

    ``em_diff`` / ``logprob_diff``: mean over examples of (method - full), with a 95% paired
    percentile-bootstrap interval over examples. Rule: ``beats full`` / ``loses to full``
    when the exact-match interval excludes 0; otherwise by the log-probability interval
    (``beats full (log-prob)`` / ``loses to full (log-prob)``); otherwise ``tie``. With fewer
    than :data:`MIN_VERDICT_N` examples the verdict is ``too few examples`` (the means and
    intervals are still reported).
    """
    from evictlab.stats.bootstrap import bootstrap_mean

    key = ["model", "kind", "distractors", "example"]
    full = results.filter(pl.col("method") == FULL).select(*key, pl.col("exact_match").alias("em_full"),
                                                            pl.col("answer_logprob").alias("lp_full"))
    out = []
    others = results.filter(pl.col("method") != FULL).join(full, on=key, how="inner")
    for (model, kind, k, method), grp in others.group_by("model", "kind", "distractors", "method", maintain_order=True):
        em = (grp["exact_match"] - grp["em_full"]).to_numpy()
        lp = (grp["answer_logprob"] - grp["lp_full"]).to_numpy()
        e = bootstrap_mean(em, seed=seed, key=f"{model}/{kind}/{k}/{method}/em", n_boot=n_boot)
        p = bootstrap_mean(lp, seed=seed, key=f"{model}/{kind}/{k}/{method}/lp", n_boot=n_boot)
        if grp.height < MIN_VERDICT_N:
            v = "too few examples"
        elif e.lo > 0 or e.hi < 0:
            v = "beats full" if e.value > 0 else "loses to full"
        elif p.lo > 0 or p.hi < 0:
            v = "beats full (log-prob)" if p.value > 0 else "loses to full (log-prob)"
        else:
            v = "tie"
        out.append({"model": model, "kind": kind, "distractors": k, "method": method, "oracle": bool(grp["oracle"][0]),
                    "n": grp.height, "em_full": float(grp["em_full"].mean()), "em": float(grp["exact_match"].mean()),
                    "em_diff": e.value, "em_diff_lo": e.lo, "em_diff_hi": e.hi,
                    "logprob_diff": p.value, "logprob_diff_lo": p.lo, "logprob_diff_hi": p.hi, "verdict": v})
    return pl.DataFrame(out, infer_schema_length=None).sort("model", "kind", "distractors", "method") if out else \
        pl.DataFrame()


# ----------------------------------------------------------------------------- runner


@dataclass
class SweepSummary:
    out: str
    units: int
    units_skipped: int
    seconds: float


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse a finished sweep folder (unless ``overwrite``) and a non-empty folder that is not a sweep's."""
    from evictlab.parts import finished

    if not out_dir.is_dir() or (out_dir / "results.parts").is_dir():
        return  # a new folder, or an interrupted run to resume
    if (out_dir / "results.parquet").is_file():
        if finished(out_dir / "results.parquet", out_dir / "results.parts") and not overwrite:
            raise InputError("--out", f"{out_dir} holds a finished sweep",
                             "pass --overwrite to run it again, or choose another --out")
    elif any(not p.name.endswith(".lock") for p in out_dir.iterdir()):
        raise InputError("--out", f"{out_dir} is a non-empty folder that holds no sweep",
                         "choose a new folder name for --out (it is created)")


def run_sweep(cfg: SweepConfig, out_dir: str | Path, *, progress: bool = True, model: Any = None,
              tokenizer: Any = None, threads: int = 0, overwrite: bool = False) -> SweepSummary:
    """Run (or resume) the sweep into ``out_dir`` (module docstring). A finished sweep in
    ``out_dir`` is refused unless ``overwrite`` (then it is computed again and replaced)."""
    import torch
    from tqdm.auto import tqdm

    from evictlab.capture.config import parse_layers
    from evictlab.tasks.distractors import make_example
    from evictlab.io import check_output_path, write_checked_parquet
    from evictlab.parts import PartStore
    from evictlab.models.geometry import model_geometry
    from evictlab.record import RunRecord, record_path

    cfg.check()
    t0 = time.perf_counter()
    out_dir = check_output_path(out_dir, "--out", directory=True)
    _check_out_dir(out_dir, overwrite)
    out_dir.mkdir(exist_ok=True)
    record = RunRecord(kind="dilution.sweep", config=asdict(cfg), model=cfg.model, seed=cfg.seed)
    if threads:
        torch.set_num_threads(threads)
    units = [(k, i, m) for k in cfg.distractors for i in range(cfg.n) for m in cfg.methods]
    keys = {u: _key("k", u[0], "e", u[1], u[2]) for u in units}
    parts = PartStore(out_dir / "results.parts", {"config": asdict(cfg), "version": 1}, [keys[u] for u in units])
    with parts.lock(out_dir / "results.parquet"):
        _check_out_dir(out_dir, overwrite)  # again under the lock: another run may have finished meanwhile
        layers: list[int] | None = None

        def model_checks() -> None:
            """Load the model and refuse what its geometry rules out (layers, a budget below
            the always-kept floor), before any run."""
            nonlocal model, tokenizer, layers
            if model is None:
                from evictlab.models.loading import load_model

                model, tokenizer = load_model(cfg.model, device=cfg.device)
            g = model_geometry(model)
            layers = parse_layers(cfg.layers, g.n_layers)
            for m in cfg.methods:
                if m != FULL:
                    dc = cfg.decode_config(m)
                    try:
                        dc.budget_tokens(g, cfg.context)
                    except InputError as exc:
                        raise InputError("--budget", exc.problem, exc.fix) from None
                    try:  # gates=default: shipped gates for these weights, refused before any part
                        dc.method.check_weights(model)
                    except InputError as exc:
                        raise InputError("--scorer-param", exc.problem, exc.fix) from None

        if not parts.dir.is_dir():  # a new run: refused before its parts folder exists (a refusal leaves nothing)
            model_checks()
        parts.open()
        skipped = sum(parts.done(keys[u]) for u in units)
        if skipped < len(units) and layers is None:
            model_checks()
        bar = tqdm(total=len(units), initial=skipped, desc=f"dilution sweep {cfg.model}", unit="run",
                   disable=not progress)
        for k in cfg.distractors:
            for i in range(cfg.n):
                todo = [m for m in cfg.methods if not parts.done(keys[(k, i, m)])]
                if not todo:
                    continue
                ex = make_example(tokenizer, i, k, filler=cfg.context, kind=cfg.kind, seed=cfg.seed)
                ref = reference(model, tokenizer, ex, cfg, layers)
                for m in todo:
                    row = run_unit(model, tokenizer, ex, m, cfg, ref)
                    parts.write(keys[(k, i, m)], pl.DataFrame([row], schema=RESULT_COLUMNS))
                    bar.update(1)
                    bar.set_postfix(k=k, example=i, method=m)
        bar.close()
        results = parts.collect()
        summary, verdict = summarize(results), verdicts(results, seed=cfg.seed)
        for name, df in (("results", results), ("summary", summary), ("verdict", verdict)):
            write_checked_parquet(df, out_dir / f"{name}.parquet")
        from evictlab.plots.dilution import sweep_lines
        from evictlab.dilution.report import sweep_report

        fig = sweep_lines(summary, out_dir / "sweep")
        sweep_report(out_dir, summary, verdict, cfg, fig)
        s = SweepSummary(out=str(out_dir), units=len(units), units_skipped=skipped,
                         seconds=round(time.perf_counter() - t0, 1))
        record.write(record_path(out_dir, folder=True), output=str(out_dir), summary=asdict(s))
        parts.remove()
    return s

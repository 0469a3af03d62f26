"""The capture run: prompts -> model forward under hooks -> verified rows in a RowWriter.

One prompt at a time: build its tokens (:func:`evictlab.capture.prompts.build_prompt`),
choose its query positions (:func:`query_positions`), run one forward pass with
:class:`~evictlab.capture.hooks.AttentionCapture`, check every captured row against the
attention module's own per-head output (:func:`~evictlab.capture.hooks.verify_layer`),
then write one block per (layer, KV head) and one query row per (layer, query head,
position) into :class:`evictlab.rows.writer.RowWriter`, and end the prompt.

Blocks hold only the keys the layer's rows see: on full-attention layers keys
``[0, max position]``; on sliding-window layers (Gemma 3) keys
``[min position - W + 1, max position]``. Block key positions are absolute token positions.

Labels: task prompts carry the token spans of their inserted facts
(:attr:`~evictlab.capture.prompts.PromptTokens.facts`), written into the dataset's
``facts`` column (schema version 2); text prompts have none.

Resuming: the writer commits whole prompts; a rerun with the same settings skips the
prompts listed in ``completed_prompts`` (prompt id = prompt index), so an interrupted run
continues where it stopped without duplicating rows. Raising ``--prompts`` on a finished
dataset appends more prompts. Any other setting that differs is refused: rows of one
dataset must come from one configuration. A run record (``run_record.json``) is written at
the end of every run.

Query positions (documented choice, ours)
    ``query-agnostic``: the context is the whole prompt (no question is appended); the P
    positions are stratified over the last half of the context: split
    ``[n_ctx // 2, n_ctx)`` into P equal strata and draw one position uniformly in each
    (seeded per prompt). Late positions see many keys (at least half the context), like the
    compression-time queries of a real eviction pipeline, and strata avoid aliasing with
    periodic text structure.
    ``query-aware``: task prompts only; the positions are the question's tokens (all of
    them if there are at most P, else P stratified over the question).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from evictlab.capture.hooks import AttentionCapture, CaptureMismatchError, verify_layer
from evictlab.capture.prompts import PromptTokens, build_prompt, check_source
from evictlab.errors import InputError
from evictlab.models.sites import find_attention_sites

MODES = ("query-agnostic", "query-aware")
#: Largest |mu - module output| / max(1, max|v|) accepted for a captured row (see
#: :func:`~evictlab.capture.hooks.verify_layer`). float32 forward passes agree with the
#: float64 recomputation to ~1e-7..1e-6 on every supported family; a model the hooks do
#: not understand is off by orders of magnitude more.
VERIFY_TOL = 1e-4
#: One-line statement of the query-position rule, stored in every dataset's manifest.
POSITIONS_RULE = {
    "query-agnostic": "context only (no question shown); P positions stratified over the last "
                      "half of the context, one uniform draw per stratum, seeded per prompt",
    "query-aware": "context + question; the question's token positions (all if <= P, else P "
                   "stratified over the question)",
}
#: The settings a resumed run must share with the dataset it extends.
_FIXED = ("model", "source", "context", "positions", "mode", "layers", "seed")


@dataclass
class CaptureConfig:
    """Settings of one capture run (the CLI flags of ``evictlab capture``)."""

    model: str = "smollm2-135m"
    source: str = "shakespeare"
    context: int = 2048
    positions: int = 32
    prompts: int = 4
    mode: str = "query-agnostic"
    layers: str = "all"
    device: str = "cpu"
    seed: int = 0
    rows_per_shard: int = 16384
    #: torch CPU threads (0 = torch's default). On a shared, oversubscribed machine one
    #: thread can be ~10x faster than two (spinning OpenMP workers); see docs/performance.md.
    threads: int = 0
    #: prompts per forward pass (consecutive prompts of equal length; text sources always
    #: are); 0 = auto: 8 on CUDA, 1 on CPU (docs/performance.md, capture batching)
    batch: int = 0

    def check(self) -> None:
        """InputError on any setting that cannot work, before the model is loaded."""
        from evictlab.capture.texts import is_text_source

        check_source(self.source)
        if self.mode not in MODES:
            raise InputError("--mode", f"unknown mode {self.mode!r}", f"use one of: {', '.join(MODES)}")
        if self.mode == "query-aware" and is_text_source(self.source):
            raise InputError("--mode", f"query-aware capture needs a question, {self.source} passages have none",
                             "use a task source (needle, multi_needle, multi_key, variable_tracking)")
        for name, val, lo in (("--context", self.context, 16), ("--positions", self.positions, 1),
                              ("--prompts", self.prompts, 1), ("--rows-per-shard", self.rows_per_shard, 1),
                              ("--batch", self.batch, 0)):
            if not isinstance(val, int) or val < lo:
                raise InputError(name, f"must be an integer >= {lo}, got {val!r}", f"pass {name} {max(lo, 1)} or more")
        if self.mode == "query-agnostic" and self.positions > self.context // 2:
            raise InputError("--positions", f"{self.positions} positions do not fit in the last half "
                             f"of a {self.context}-token context", f"use at most {self.context // 2}")
        parse_layers(self.layers, None)


def parse_layers(spec: str, n_layers: int | None) -> list[int] | None:
    """``"all"`` -> None; ``"0,5,10-12"`` -> ``[0, 5, 10, 11, 12]`` (checked against n_layers)."""
    if spec.strip().lower() == "all":
        return None
    out: set[int] = set()
    try:
        for part in spec.split(","):
            part = part.strip()
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if b < a:
                    raise ValueError(part)
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
    except ValueError:
        raise InputError("--layers", f"cannot parse {spec!r}", "use 'all' or a list like 0,5,10-12") from None
    if not out or min(out) < 0:
        raise InputError("--layers", f"{spec!r} selects no valid layer", "use 'all' or layers >= 0")
    if n_layers is not None and max(out) >= n_layers:
        raise InputError("--layers", f"layer {max(out)} does not exist (the model has {n_layers})",
                         f"use layers 0..{n_layers - 1}")
    return sorted(out)


def _stratified(lo: int, hi: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """k distinct sorted ints in ``[lo, hi)``: one uniform draw from each of k equal strata."""
    edges = np.floor(np.linspace(lo, hi, k + 1)).astype(np.int64)
    return np.array([int(rng.integers(a, max(a + 1, b))) for a, b in zip(edges[:-1], edges[1:])], np.int64)


def query_positions(prompt: PromptTokens, mode: str, k: int, seed: int, index: int) -> np.ndarray:
    """The query positions of prompt ``index`` (see the module docstring), int64 sorted."""
    rng = np.random.default_rng([seed, index, 7])
    if mode == "query-agnostic":
        n = prompt.n_context
        if k > n // 2:
            raise InputError("--positions", f"{k} positions do not fit in the last half of a "
                             f"{n}-token context", f"use at most {n // 2}")
        return _stratified(n // 2, n, k, rng)
    n0, n1 = prompt.n_context, len(prompt.tokens)
    if n1 <= n0:
        raise InputError("--mode", "query-aware capture needs a question after the context",
                         "use a task source")
    if n1 - n0 <= k:
        return np.arange(n0, n1, dtype=np.int64)
    return _stratified(n0, n1, k, rng)


@dataclass
class CaptureSummary:
    """What a capture run did."""

    out: str
    rows_total: int
    rows_written: int
    prompts_written: int
    prompts_skipped: int
    seconds: float
    rows_per_second: float
    max_verify_error: float


def _tokens_for_forward(prompt: PromptTokens, mode: str) -> list[int]:
    # query-agnostic: the question is never shown to the model (compress before asking)
    return prompt.tokens[: prompt.n_context] if mode == "query-agnostic" else prompt.tokens


def capture_prompt(model: Any, tokens: list[int], positions: np.ndarray, layers: list[int] | None,
                   device: Any) -> dict[int, Any]:
    """One forward over ``tokens`` under hooks; ``{layer: LayerCapture}``, every row verified."""
    return capture_batch(model, [tokens], [positions], layers, device)[0]


def capture_batch(model: Any, token_lists: list[list[int]], position_lists: list[np.ndarray],
                  layers: list[int] | None, device: Any) -> list[dict[int, Any]]:
    """One forward over several prompts of equal length; one ``{layer: LayerCapture}`` per prompt.

    Every captured row is verified against the attention module's own output.
    """
    import torch

    if len({len(t) for t in token_lists}) != 1:
        # the runner groups equal lengths (capture's --batch), so this is a caller's bug, not user input
        raise ValueError(f"capture_batch: prompts of one forward must have equal lengths, got "
                         f"{sorted({len(t) for t in token_lists})}")
    ids = torch.tensor(token_lists, dtype=torch.long, device=device)
    # the decoder stack without the LM head: logits are not needed, and the head is ~20% of
    # SmolLM2's FLOPs (a 49k-word vocabulary)
    body = getattr(model, "base_model", model)
    with torch.inference_mode(), AttentionCapture(model, list(position_lists), layers) as cap:
        body(input_ids=ids, use_cache=False)
    for item in cap.items:
        for layer, c in item.items():
            err = verify_layer(c)
            c.verify_error = err  # type: ignore[attr-defined]
            if not err <= VERIFY_TOL:
                raise CaptureMismatchError(
                    f"layer {layer}: captured rows reproduce the module's output only to {err:.2e} "
                    f"(> {VERIFY_TOL:g}); this architecture computes attention in a way the hooks "
                    "do not see (e.g. logit soft-capping or a value norm), so its rows would be wrong")
    return cap.items


def write_prompt(writer: Any, prompt_id: int, prompt: PromptTokens, mode: str,
                 captures: dict[int, Any]) -> int:
    """Write one prompt's blocks and rows; return the number of rows written."""
    # fact labels (task sources) travel with the prompt; a resumed schema-1 dataset has none
    facts = prompt.facts if writer.writes_labels else None
    writer.add_prompt(prompt_id, _tokens_for_forward(prompt, mode), source=prompt.source, mode=mode,
                      text=json.dumps({"name": prompt.prompt_id, "n_context": prompt.n_context,
                                       "answer": prompt.answer,
                                       **({"origin": prompt.origin} if prompt.origin else {})}),
                      facts=facts)
    rows = 0
    for layer in sorted(captures):
        c = captures[layer]
        lo, hi = c.key_range(c.positions)
        a, b = int(lo.min()), int(hi.max())  # keys any row of this layer sees
        for g in range(c.n_kv_heads):
            block = writer.add_block(prompt_id, layer, g, c.keys[g, a:b].numpy(),
                                     c.values[g, a:b].numpy(), np.arange(a, b, dtype=np.int64))
            heads = [h for h in range(c.n_q_heads) if c.kv_head_of(h) == g]
            P = c.positions.size
            q = c.queries[heads].reshape(len(heads) * P, -1).numpy()
            writer.add_query_rows(
                block, q, np.repeat(heads, P), np.tile(c.positions, len(heads)),
                np.tile(lo - a, len(heads)), np.tile(hi - a, len(heads)), c.scaling,
            )
            rows += len(heads) * P
    writer.end_prompt(prompt_id)
    return rows


def _text_provenance(cfg: CaptureConfig) -> dict[str, str]:
    """For text sources: the prompt rule and a hash of the source's text (read now, so a
    missing file or a bad JSON line is reported before the model loads)."""
    from evictlab.capture.texts import PROMPT_RULE, is_text_source, load_text_source

    if not is_text_source(cfg.source):
        return {}
    src = load_text_source(cfg.source)
    longest = max(len(d.text) for d in src.documents)
    if longest + 1 < cfg.context:  # a token covers at least one character (+1: a BOS token)
        raise InputError("--context", f"{cfg.context} tokens is longer than every text of {cfg.source} "
                         f"(longest: {longest} characters)",
                         f"use longer texts (English prose: about {4 * cfg.context} characters for {cfg.context} tokens) "
                         "or a smaller --context")
    return {"prompt_rule": PROMPT_RULE, "text_sha256": src.sha256()}


def _check_resume(out: Path, cfg: CaptureConfig, text: dict[str, str]) -> None:
    man_path = out / "manifest.json"
    if not man_path.is_file():
        return
    try:
        src = json.loads(man_path.read_text()).get("source", {})
        old = src.get("capture", {})
    except (OSError, ValueError, AttributeError):
        return  # RowWriter reports a damaged manifest with its own message
    mine = asdict(cfg)
    diff = [k for k in _FIXED if k in old and old[k] != mine[k]]
    if diff:
        k = diff[0]
        raise InputError(f"--{k}", f"is {mine[k]!r} but the dataset at {out} was captured with {old[k]!r}",
                         "resume with the same settings (only --prompts may grow), or use a new --out")
    for key, what in (("prompt_rule", "an earlier prompt rule"), ("text_sha256", "a different text")):
        if key in text and src.get(key) != text[key]:
            raise InputError("--source", f"the dataset at {out} was captured from {what} "
                             f"({key} {src.get(key)!r:.40} vs {text[key]!r:.40})",
                             "use a new --out (its prompts could not be rebuilt)")


def run_capture(cfg: CaptureConfig, out: str | Path, *, model: Any = None, tokenizer: Any = None,
                progress: bool = True, model_label: str | None = None) -> CaptureSummary:
    """Capture ``cfg.prompts`` prompts into the row dataset at ``out`` (resuming if present).

    ``model``/``tokenizer`` may be passed pre-loaded (tests, notebooks); otherwise
    ``cfg.model`` is loaded with :func:`evictlab.models.loading.load_model`.
    """
    from tqdm.auto import tqdm

    from evictlab.io import check_output_path
    from evictlab.models.loading import check_device, load_model
    from evictlab.report.record import RunRecord
    from evictlab.rows.schema import RECORD_FILE
    from evictlab.rows.writer import RowWriter

    cfg.check()
    out = check_output_path(out, "--out", directory=True)  # before the model is loaded
    text = _text_provenance(cfg)
    _check_resume(out, cfg, text)
    record = RunRecord(kind="capture", config=asdict(cfg), model=model_label or cfg.model, seed=cfg.seed)
    device = check_device(cfg.device)
    if cfg.threads < 0:
        raise InputError("--threads", f"must be >= 0, got {cfg.threads}", "pass 0 (torch default) or a thread count")
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    if model is None:
        model, tokenizer = load_model(cfg.model, device=cfg.device)
    else:
        model.to(device)
    sites = find_attention_sites(model)
    layers = parse_layers(cfg.layers, max(s.layer for s in sites) + 1)
    head_dim = sites[0].head_dim
    if any(s.head_dim != head_dim for s in sites):
        raise InputError("--model", "layers have different head dims", "capture layers of one head dim (--layers)")
    source = {"capture": asdict(cfg), "model_class": type(model).__name__,
              "quantisation": _quantisation(cfg.model),
              "gqa": {str(s.layer): [s.n_q_heads, s.n_kv_heads] for s in sites},
              "sliding_window": {str(s.layer): s.sliding_window for s in sites},
              "positions_rule": POSITIONS_RULE[cfg.mode], **text}
    # a prompt the settings cannot build (e.g. a text shorter than --context) is refused
    # before the dataset folder exists
    build_prompt(cfg.source, cfg.context, tokenizer, cfg.seed, 0)
    t0 = time.perf_counter()
    written = skipped = rows_written = 0
    worst = 0.0
    # The dataset is marked complete only when this block ends normally, after the last
    # prompt; an exception or a kill leaves it incomplete (readers refuse it until resumed).
    with RowWriter(out, model=model_label or cfg.model, capture_mode=cfg.mode, head_dim=head_dim,
                   source=source, rows_per_shard=cfg.rows_per_shard,
                   expected={"prompts": cfg.prompts}) as writer:
        done = writer.completed_prompts
        todo = [i for i in range(cfg.prompts) if i not in done]
        skipped = cfg.prompts - len(todo)
        per = cfg.batch or (8 if device.type == "cuda" else 1)
        bar = tqdm(total=cfg.prompts, initial=skipped, desc=f"capture {cfg.model}", unit="prompt",
                   disable=not progress)
        while todo:
            group = [todo.pop(0)]
            built = [build_prompt(cfg.source, cfg.context, tokenizer, cfg.seed, group[0])]
            # consecutive prompts of the same length share one forward
            while todo and len(group) < per:
                nxt = build_prompt(cfg.source, cfg.context, tokenizer, cfg.seed, todo[0])
                if len(_tokens_for_forward(nxt, cfg.mode)) != len(_tokens_for_forward(built[0], cfg.mode)):
                    break
                group.append(todo.pop(0))
                built.append(nxt)
            pos = [query_positions(p, cfg.mode, cfg.positions, cfg.seed, i) for p, i in zip(built, group)]
            items = capture_batch(model, [_tokens_for_forward(p, cfg.mode) for p in built], pos, layers, device)
            for i, prompt, caps in zip(group, built, items):
                worst = max([worst, *(c.verify_error for c in caps.values())])
                rows_written += write_prompt(writer, i, prompt, cfg.mode, caps)
                written += 1
            dt = time.perf_counter() - t0
            bar.update(len(group))
            bar.set_postfix(rows=rows_written, rows_s=f"{rows_written / max(dt, 1e-9):.0f}")
        bar.close()
    seconds = time.perf_counter() - t0
    from evictlab.rows.reader import RowStore

    total = RowStore.open(out).n_rows
    summary = CaptureSummary(out=str(out), rows_total=total, rows_written=rows_written,
                             prompts_written=written, prompts_skipped=skipped, seconds=round(seconds, 3),
                             rows_per_second=round(rows_written / seconds, 1) if seconds > 0 else 0.0,
                             max_verify_error=worst)
    record.write(out / RECORD_FILE, output=str(out), summary=asdict(summary))
    return summary


def _quantisation(name: str) -> str | None:
    from evictlab.models.registry import MODELS

    spec = MODELS.get(name)
    return spec.quantisation if spec else None

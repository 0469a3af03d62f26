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

Executors: the local run does all of this here. A remote executor (``--executor ray``,
``docs/cluster.md``) first runs :func:`capture_probe` on a worker (model geometry for the
manifest, every prompt's forward length and token digest), then one :func:`capture_group`
task per forward group (the local run's groups, :func:`plan_groups`); each task returns its
prompts' :class:`PromptRows` and this process writes them with :func:`write_rows` in
prompt order, so the dataset is the local run's bit for bit.

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

import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from evictlab.capture.hooks import AttentionCapture, CaptureMismatchError, verify_layer
from evictlab.capture.prompts import PromptTokens, build_prompt, check_source
from evictlab.errors import InputError, refuse_duplicates
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
    from evictlab.cliutil import parse_list

    if spec.strip().lower() == "all":
        return None
    layers: list[int] = []
    try:
        for part in parse_list(spec, "--layers", "layer"):
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if b < a:
                    raise ValueError(part)
                layers += range(a, b + 1)
            else:
                layers.append(int(part))
    except InputError:
        raise
    except ValueError:
        raise InputError("--layers", f"cannot parse {spec!r}", "use 'all' or a list like 0,5,10-12") from None
    refuse_duplicates(layers, "--layers", "layer")  # also a layer inside a range given again
    out = set(layers)
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


@dataclass
class BlockRows:
    """One (layer, KV head) block of a prompt and the query rows that read it, as
    :meth:`~evictlab.rows.writer.RowWriter.add_block` and ``add_query_rows`` take them."""

    layer: int
    kv_head: int
    keys: np.ndarray            # float32 [L, d], post-RoPE
    values: np.ndarray          # float32 [L, d]
    key_positions: np.ndarray   # int64 [L], absolute token positions
    queries: np.ndarray         # float32 [R, d], post-RoPE
    q_heads: np.ndarray         # int64 [R]
    positions: np.ndarray       # int64 [R], query token positions
    key_lo: np.ndarray          # int64 [R], row r sees block keys [key_lo, key_hi)
    key_hi: np.ndarray          # int64 [R]
    scale: float


@dataclass
class PromptRows:
    """Everything one captured prompt adds to a dataset (picklable: what a remote task
    returns to the driver, which alone writes)."""

    prompt_id: int
    tokens: list[int]
    source: str
    mode: str
    text: str
    blocks: list[BlockRows]
    verify_error: float
    #: fact labels of a task prompt (token spans, rows schema version 2), None for text prompts
    facts: tuple[dict[str, Any], ...] | None = None

    @property
    def n_rows(self) -> int:
        return sum(int(b.q_heads.size) for b in self.blocks)


def prompt_rows(prompt_id: int, prompt: PromptTokens, mode: str, captures: dict[int, Any]) -> PromptRows:
    """One prompt's blocks and rows from its captures (``{layer: LayerCapture}``)."""
    blocks = []
    for layer in sorted(captures):
        c = captures[layer]
        lo, hi = c.key_range(c.positions)
        a, b = int(lo.min()), int(hi.max())  # keys any row of this layer sees
        for g in range(c.n_kv_heads):
            heads = [h for h in range(c.n_q_heads) if c.kv_head_of(h) == g]
            P = c.positions.size
            blocks.append(BlockRows(
                layer, g, c.keys[g, a:b].numpy(), c.values[g, a:b].numpy(), np.arange(a, b, dtype=np.int64),
                c.queries[heads].reshape(len(heads) * P, -1).numpy(), np.repeat(heads, P),
                np.tile(c.positions, len(heads)), np.tile(lo - a, len(heads)), np.tile(hi - a, len(heads)),
                c.scaling))
    return PromptRows(prompt_id, list(_tokens_for_forward(prompt, mode)), prompt.source, mode,
                      json.dumps({"name": prompt.prompt_id, "n_context": prompt.n_context, "answer": prompt.answer,
                                  **({"origin": prompt.origin} if prompt.origin else {})}),
                      blocks, max([0.0, *(float(getattr(c, "verify_error", 0.0)) for c in captures.values())]),
                      prompt.facts)


def write_rows(writer: Any, rows: PromptRows) -> int:
    """Write one prompt's blocks and rows into ``writer``; return the number of rows written."""
    # fact labels travel with the prompt; a resumed schema-1 dataset takes none
    writer.add_prompt(rows.prompt_id, rows.tokens, source=rows.source, mode=rows.mode, text=rows.text,
                      facts=rows.facts if writer.writes_labels else None)
    for b in rows.blocks:
        block = writer.add_block(rows.prompt_id, b.layer, b.kv_head, b.keys, b.values, b.key_positions)
        writer.add_query_rows(block, b.queries, b.q_heads, b.positions, b.key_lo, b.key_hi, b.scale)
    writer.end_prompt(rows.prompt_id)
    return rows.n_rows


def write_prompt(writer: Any, prompt_id: int, prompt: PromptTokens, mode: str,
                 captures: dict[int, Any]) -> int:
    """Write one prompt's blocks and rows; return the number of rows written."""
    return write_rows(writer, prompt_rows(prompt_id, prompt, mode, captures))


def plan_groups(todo: list[int], length: Any, per: int) -> list[list[int]]:
    """Prompts per forward pass: consecutive prompts of ``todo`` with equal forward lengths
    (``length(i)``), at most ``per`` of them (the same groups on every executor)."""
    groups: list[list[int]] = []
    for i in todo:
        if groups and len(groups[-1]) < per and length(i) == length(groups[-1][0]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def capture_prompts(model: Any, prompts: list[PromptTokens], ids: list[int], cfg: CaptureConfig,
                    layers: list[int] | None, device: Any) -> list[PromptRows]:
    """One forward over ``prompts`` (ids ``ids``, equal forward lengths); their rows."""
    pos = [query_positions(p, cfg.mode, cfg.positions, cfg.seed, i) for p, i in zip(prompts, ids)]
    items = capture_batch(model, [_tokens_for_forward(p, cfg.mode) for p in prompts], pos, layers, device)
    return [prompt_rows(i, p, cfg.mode, caps) for i, p, caps in zip(ids, prompts, items)]


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
                progress: bool = True, model_label: str | None = None, executor: Any = None,
                max_gib: float | None = None) -> CaptureSummary:
    """Capture ``cfg.prompts`` prompts into the row dataset at ``out`` (resuming if present).

    ``model``/``tokenizer`` may be passed pre-loaded (tests, notebooks); otherwise
    ``cfg.model`` is loaded with :func:`evictlab.models.loading.load_model`. ``executor``
    (:mod:`evictlab.executor`): None or local runs the forwards here; a Ray executor runs one
    task per forward group (:func:`capture_group`, one prompt on CPU), each loading the
    model on its worker, and this process writes the rows in prompt order, so the dataset
    holds the same rows in the same shards as a local run. ``max_gib``: refuse (before
    anything is written, once the model's geometry is known) a dataset estimated above this
    many GiB (:func:`capture_bytes`; default :data:`evictlab.io.DEFAULT_MAX_GIB`).
    """
    from evictlab.io import check_output_path
    from evictlab.report.record import RunRecord
    from evictlab.rows.schema import RECORD_FILE

    cfg.check()
    if max_gib is not None and not max_gib > 0:
        raise InputError("--max-gib", f"must be > 0, got {max_gib}", "pass e.g. --max-gib 4")
    out = check_output_path(out, "--out", directory=True)  # before the model is loaded
    text = _text_provenance(cfg)
    _check_resume(out, cfg, text)
    if cfg.threads < 0:
        raise InputError("--threads", f"must be >= 0, got {cfg.threads}", "pass 0 (torch default) or a thread count")
    remote = executor is not None and executor.name != "local"
    record = RunRecord(kind="capture", config={**asdict(cfg), "executor": "ray" if remote else "local"},
                       model=model_label or cfg.model, seed=cfg.seed)
    t0 = time.perf_counter()
    if remote:
        if model is not None:
            raise InputError("model", "a pre-loaded model cannot be sent to remote workers",
                             "pass the model by name (cfg.model), or use the local executor")
        written, skipped, rows_written, worst = _capture_remote(cfg, out, text, executor, progress, model_label,
                                                                max_gib)
    else:
        written, skipped, rows_written, worst = _capture_local(cfg, out, text, model, tokenizer, progress,
                                                               model_label, max_gib)
    seconds = time.perf_counter() - t0
    from evictlab.rows.reader import RowStore

    total = RowStore.open(out).n_rows
    summary = CaptureSummary(out=str(out), rows_total=total, rows_written=rows_written,
                             prompts_written=written, prompts_skipped=skipped, seconds=round(seconds, 3),
                             rows_per_second=round(rows_written / seconds, 1) if seconds > 0 else 0.0,
                             max_verify_error=worst)
    record.write(out / RECORD_FILE, output=str(out), summary=asdict(summary))
    return summary


def _source_info(cfg: CaptureConfig, model: Any, text: dict[str, str]) -> tuple[dict[str, Any], int, int]:
    """The manifest's ``source`` entry, the head dim and the layer count of a loaded model."""
    sites = find_attention_sites(model)
    head_dim = sites[0].head_dim
    if any(s.head_dim != head_dim for s in sites):
        raise InputError("--model", "layers have different head dims", "capture layers of one head dim (--layers)")
    source = {"capture": asdict(cfg), "model_class": type(model).__name__,
              "quantisation": _quantisation(cfg.model),
              "gqa": {str(s.layer): [s.n_q_heads, s.n_kv_heads] for s in sites},
              "sliding_window": {str(s.layer): s.sliding_window for s in sites},
              "positions_rule": POSITIONS_RULE[cfg.mode], **text}
    return source, head_dim, max(s.layer for s in sites) + 1


def capture_bytes(cfg: CaptureConfig, source: dict[str, Any], head_dim: int) -> int:
    """Bytes the dataset of ``cfg`` takes on disk, estimated (a little under: prompts are
    taken as ``--context`` tokens) from the model's heads per layer (``source["gqa"]``): per
    prompt and captured layer its keys and values (float32) and positions (int64) per KV
    head, and per row its query (float32) and index entry (~100 bytes)."""
    gqa = {int(k): v for k, v in source["gqa"].items()}
    layers = parse_layers(cfg.layers, max(gqa) + 1) or sorted(gqa)
    per_prompt = sum(gqa[l][1] * cfg.context * (2 * head_dim * 4 + 8) + gqa[l][0] * cfg.positions * (head_dim * 4 + 100)
                     for l in layers)
    return cfg.prompts * per_prompt


def _check_size(cfg: CaptureConfig, source: dict[str, Any], head_dim: int, max_gib: float | None) -> None:
    from evictlab.io import DEFAULT_MAX_GIB, check_output_size

    check_output_size(capture_bytes(cfg, source, head_dim), DEFAULT_MAX_GIB if max_gib is None else max_gib,
                      f"{cfg.prompts:,} prompts of {cfg.context:,} tokens with {cfg.positions} positions",
                      "capture fewer --prompts, --positions or --layers, or a shorter --context (or raise --max-gib)",
                      option="--prompts")


def _auto_batch(cfg: CaptureConfig, device_type: str) -> int:
    return cfg.batch or (8 if device_type == "cuda" else 1)


def _capture_local(cfg: CaptureConfig, out: Path, text: dict[str, str], model: Any, tokenizer: Any,
                   progress: bool, model_label: str | None, max_gib: float | None = None) -> tuple[int, int, int, float]:
    """The local executor: forwards here, prompt group after prompt group."""
    from tqdm.auto import tqdm

    from evictlab.models.loading import check_device, load_model
    from evictlab.rows.writer import RowWriter

    device = check_device(cfg.device)
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    if model is None:
        model, tokenizer = load_model(cfg.model, device=cfg.device)
    else:
        model.to(device)
    source, head_dim, n_layers = _source_info(cfg, model, text)
    layers = parse_layers(cfg.layers, n_layers)
    _check_size(cfg, source, head_dim, max_gib)
    # a prompt the settings cannot build (e.g. a text shorter than --context) is refused
    # before the dataset folder exists
    built = {0: build_prompt(cfg.source, cfg.context, tokenizer, cfg.seed, 0)}

    def prompt(i: int) -> PromptTokens:
        if i not in built:
            built[i] = build_prompt(cfg.source, cfg.context, tokenizer, cfg.seed, i)
        return built[i]

    written = rows_written = 0
    worst = 0.0
    t0 = time.perf_counter()
    # The dataset is marked complete only when this block ends normally, after the last
    # prompt; an exception or a kill leaves it incomplete (readers refuse it until resumed).
    with RowWriter(out, model=model_label or cfg.model, capture_mode=cfg.mode, head_dim=head_dim,
                   source=source, rows_per_shard=cfg.rows_per_shard,
                   expected={"prompts": cfg.prompts}) as writer:
        done = writer.completed_prompts
        todo = [i for i in range(cfg.prompts) if i not in done]
        skipped = cfg.prompts - len(todo)
        if 0 in done:
            built.clear()
        per = _auto_batch(cfg, device.type)
        bar = tqdm(total=cfg.prompts, initial=skipped, desc=f"capture {cfg.model}", unit="prompt",
                   disable=not progress)
        # groups are planned lazily, so each prompt is built once, just before its forward
        group: list[int] = []
        for pos, i in enumerate(todo):
            group.append(i)
            nxt = todo[pos + 1] if pos + 1 < len(todo) else None
            if (nxt is not None and len(group) < per
                    and _forward_len(prompt(nxt), cfg.mode) == _forward_len(prompt(group[0]), cfg.mode)):
                continue
            batch = [prompt(j) for j in group]
            for j in group:
                del built[j]
            for rows in capture_prompts(model, batch, group, cfg, layers, device):
                worst = max(worst, rows.verify_error)
                rows_written += write_rows(writer, rows)
                written += 1
            bar.update(len(group))
            bar.set_postfix(rows=rows_written, rows_s=f"{rows_written / max(time.perf_counter() - t0, 1e-9):.0f}")
            group = []
        bar.close()
    return written, skipped, rows_written, worst


def _forward_len(prompt: PromptTokens, mode: str) -> int:
    return len(_tokens_for_forward(prompt, mode))


# --------------------------------------------------------------------------- remote


@dataclass(frozen=True)
class CapturePlan:
    """What the probe task learns on a worker before any capture task runs: the manifest's
    ``source`` entry, the head dim, every prompt's forward length and token digest, and the
    digest of the weights (:func:`~evictlab.models.loading.weights_digest`)."""

    source: dict[str, Any]
    head_dim: int
    lengths: tuple[int, ...]
    token_digests: tuple[str, ...]
    weights: str


@dataclass(frozen=True)
class CaptureTask:
    """One remote task: prompts ``prompt_ids`` (one forward) under ``cfg``; the worker checks
    that its weights and prompts are the probe's (``weights``, ``token_digests``)."""

    cfg: CaptureConfig
    prompt_ids: tuple[int, ...]
    weights: str
    token_digests: tuple[str, ...]


def _token_digest(prompt: PromptTokens) -> str:
    import hashlib

    return hashlib.sha256(np.asarray(prompt.tokens, dtype=np.int64).tobytes()
                          + str(prompt.n_context).encode()).hexdigest()[:16]


def _worker_model(cfg: CaptureConfig) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, device)`` on this worker (loaded once per process), torch threads
    = the task's CPUs."""
    import torch

    from evictlab.models.loading import check_device, load_cached

    device = check_device(cfg.device)
    torch.set_num_threads(cfg.threads or 1)
    model, tok = load_cached(cfg.model, cfg.device)
    return model, tok, device


def capture_probe(cfg: CaptureConfig) -> CapturePlan:
    """The first remote task of a capture: load the model, check the settings the local run
    checks (layers, head dims, the first prompt) and plan the prompts (:class:`CapturePlan`)."""
    from evictlab.models.loading import weights_digest

    model, tok, _ = _worker_model(cfg)
    source, head_dim, n_layers = _source_info(cfg, model, _text_provenance(cfg))
    parse_layers(cfg.layers, n_layers)
    prompts = [build_prompt(cfg.source, cfg.context, tok, cfg.seed, i) for i in range(cfg.prompts)]
    return CapturePlan(source, head_dim, tuple(_forward_len(p, cfg.mode) for p in prompts),
                       tuple(_token_digest(p) for p in prompts), weights_digest(model))


def capture_group(task: CaptureTask) -> list[PromptRows]:
    """One remote capture task: the forward over ``task.prompt_ids`` and its verified rows.

    Refuses (InputError) when this worker's weights or prompts differ from the probe's: a
    node with another copy of the model or of the source text would mix two datasets.
    """
    import socket

    from evictlab.models.loading import weights_digest

    cfg = task.cfg
    model, tok, device = _worker_model(cfg)
    got = weights_digest(model)
    if got != task.weights:
        raise InputError("--model", f"node {socket.gethostname()} loaded other weights for {cfg.model} (digest "
                         f"{got}, the first task's {task.weights}): rows of two models would be mixed",
                         "give every node the same model files (a shared EVICTLAB_CACHE, or the same "
                         "`evictlab models pull` on each)")
    ids = list(task.prompt_ids)
    prompts = [build_prompt(cfg.source, cfg.context, tok, cfg.seed, i) for i in ids]
    for i, p, want in zip(ids, prompts, task.token_digests):
        if _token_digest(p) != want:
            raise InputError("--source", f"node {socket.gethostname()} builds prompt {i} with other tokens than the "
                             "first task (another source text or tokenizer): rows of two datasets would be mixed",
                             "give every node the same source files and model (shared storage)")
    _, _, n_layers = _source_info(cfg, model, {})
    return capture_prompts(model, prompts, ids, cfg, parse_layers(cfg.layers, n_layers), device)


def _device_type(device: str) -> str:
    """``cpu`` or ``cuda`` from ``--device`` (checked on the workers, which own the GPUs)."""
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise InputError("--device", f"device type {kind!r} is not supported", "use cpu or cuda")
    return kind


def _capture_remote(cfg: CaptureConfig, out: Path, text: dict[str, str], executor: Any, progress: bool,
                    model_label: str | None, max_gib: float | None = None) -> tuple[int, int, int, float]:
    """A remote executor: a probe task, then one task per forward group; rows are written
    here, in prompt order."""
    from evictlab.executor import TaskSpec, task_bar
    from evictlab.rows.writer import RowWriter

    kind = _device_type(cfg.device)
    spec = TaskSpec(cpus=cfg.threads or 1, gpus=1 if kind == "cuda" else 0)
    ((_, plan),) = list(executor.map(capture_probe, [cfg], spec=spec))
    if plan.source.get("text_sha256") != text.get("text_sha256"):
        raise InputError("--source", f"the worker read another text for {cfg.source} than this machine",
                         "give every node the same source files (shared storage)")
    _check_size(cfg, plan.source, plan.head_dim, max_gib)
    written = rows_written = 0
    worst = 0.0
    with RowWriter(out, model=model_label or cfg.model, capture_mode=cfg.mode, head_dim=plan.head_dim,
                   source=plan.source, rows_per_shard=cfg.rows_per_shard,
                   expected={"prompts": cfg.prompts}) as writer:
        done = writer.completed_prompts
        todo = [i for i in range(cfg.prompts) if i not in done]
        skipped = cfg.prompts - len(todo)
        groups = plan_groups(todo, lambda i: plan.lengths[i], _auto_batch(cfg, kind))
        tasks = [CaptureTask(cfg, tuple(g), plan.weights, tuple(plan.token_digests[i] for i in g)) for g in groups]
        bar = task_bar(f"capture {cfg.model}", disable=not progress)
        # closing(): an error or Ctrl-C here cancels the tasks still out at once
        with contextlib.closing(executor.map(capture_group, tasks, spec=spec, ordered=True, on_progress=bar)) as it:
            try:
                for _, rows_list in it:
                    for rows in rows_list:
                        worst = max(worst, rows.verify_error)
                        rows_written += write_rows(writer, rows)
                        written += 1
            finally:
                bar.close()
    return written, skipped, rows_written, worst


def _quantisation(name: str) -> str | None:
    from evictlab.models.registry import MODELS

    spec = MODELS.get(name)
    return spec.quantisation if spec else None

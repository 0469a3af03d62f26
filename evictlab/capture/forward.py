"""One forward over prompts under hooks -> verified rows, as the row writer takes them.

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
from dataclasses import dataclass
from typing import Any

import numpy as np

from evictlab.capture.config import CaptureConfig
from evictlab.capture.hooks import AttentionCapture, CaptureMismatchError, verify_layer
from evictlab.errors import InputError
from evictlab.tasks.sources import PromptTokens


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
        raise InputError("--protocol", "query-aware capture needs a question after the context",
                         "use a task source")
    if n1 - n0 <= k:
        return np.arange(n0, n1, dtype=np.int64)
    return _stratified(n0, n1, k, rng)


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


def forward_len(prompt: PromptTokens, mode: str) -> int:
    """Tokens of ``prompt``'s forward under ``mode`` (prompts of equal length share one forward)."""
    return len(_tokens_for_forward(prompt, mode))

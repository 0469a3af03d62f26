"""Scorers: one small dataclass per eviction method, each with one ``score(inputs)``.

Every ``score`` takes a :class:`~evictlab.methods.base.ScoreInputs` for one layer and returns
``(b, hk, s)`` float32 scores, higher = keep (shapes: ``b`` batch, ``hq`` query heads, ``hk``
KV heads, ``s`` held keys, ``q`` chunk queries, ``m`` extra queries, ``d`` head dim). Sinks
and the recency window are kept by :func:`~evictlab.methods.base.select_keep` whatever the
scores say, so no scorer pads them itself. Formulas, sources and what is ours:
``docs/methods.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from evictlab.errors import InputError
from evictlab.kv.attention import combine_groups, query_attention
from evictlab.methods.base import ScoreInputs

__all__ = [
    "H2O",
    "KVZIP_PROMPT",
    "Compactor",
    "ExpectedAttention",
    "KVzip",
    "Oracle",
    "SnapKV",
    "StreamingLLM",
    "rope_inv_freq",
    "rope_rotate",
]


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """``(d/2,)`` float64 RoPE inverse frequencies ``theta ** (-2i/d)`` (unscaled RoPE)."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x (..., n, d)`` to ``positions (n,)`` with Hugging Face's half-split RoPE.

    Dimension ``i`` pairs with ``i + d/2`` and turns by ``pos * theta ** (-2i/d)``, i.e.
    ``x * cos + rotate_half(x) * sin``. Negative positions undo a rotation, which is how the
    scorers recover pre-RoPE queries/keys from the post-RoPE ones they are given.
    """
    d = x.shape[-1]
    angles = positions.to(x.device, torch.float64)[:, None] * rope_inv_freq(d, theta, x.device)[None, :]
    cos, sin = torch.cos(angles).repeat(1, 2), torch.sin(angles).repeat(1, 2)
    x64 = x.double()
    half = torch.cat([-x64[..., d // 2:], x64[..., : d // 2]], dim=-1)
    return (x64 * cos + half * sin).to(x.dtype)


def _pool(x: torch.Tensor, kernel: int, how: Literal["avg", "max"]) -> torch.Tensor:
    """1-D pooling along the last axis of ``(..., s)``, stride 1, same length (odd kernel)."""
    flat = x.reshape(-1, 1, x.shape[-1])
    if how == "avg":
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    return out.reshape(x.shape)


def _zscore(x: torch.Tensor) -> torch.Tensor:
    """Standardise ``(b, hk, s)`` per batch item over all heads and keys."""
    mu = x.mean(dim=(1, 2), keepdim=True)
    sd = x.std(dim=(1, 2), keepdim=True).clamp_min(1e-6)
    return (x - mu) / sd


def _require_extra(inputs: ScoreInputs, name: str, what: str) -> torch.Tensor:
    if inputs.extra_queries is None:
        raise InputError("extra_queries", f"{name} needs {what}, none were passed",
                         f"run the decode loop with a scorer whose needs include it ({name}.needs)")
    return inputs.extra_queries


@dataclass
class StreamingLLM:
    """StreamingLLM (Xiao et al., 2023): keep the attention sinks and the most recent keys.

    Score = the key's absolute position, so with the sinks forced by ``select_keep`` the kept
    set is the sinks + the newest keys. Identical for every KV head (no GQA combination).

    Shapes: ``positions (s,)`` or ``(b, s)`` -> scores ``(b, hk, s)``.
    """

    name: str = "streaming_llm"
    needs: frozenset[str] = field(default_factory=frozenset)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        b, hk, s, _ = inputs.keys.shape
        pos = inputs.positions.to(inputs.keys.device, torch.float32)  # (s,) or (b, s)
        return (pos if pos.ndim == 1 else pos[:, None, :]).expand(b, hk, s).clone()


@dataclass
class H2O:
    """H2O (Zhang et al., 2023): attention accumulated over every query processed so far.

    score[k] = sum over all processed queries t (every chunk, causal) of the group-mean
    attention probability ``mean_{h in group} softmax_t(q_t^h . K * scaling)[k]``.
    The running sum lives in ``inputs.state`` keyed by absolute position, so a key keeps its
    history across chunks and evictions; keys new to this call start at 0. Each call adds the
    attention of ``inputs.queries`` over the keys held now (after earlier evictions, as H2O
    does at decode time).

    Shapes: ``queries (b, hq, q, d)``, ``keys (b, hk, s, d)`` -> ``(b, hk, s)``.
    GQA: mean over the group's query heads.
    """

    name: str = "h2o"
    needs: frozenset[str] = field(default_factory=frozenset)
    #: the decode loop passes every query processed since the previous call (not a window)
    uses_all_queries: ClassVar[bool] = True

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        keys, pos = inputs.keys, inputs.positions.to(inputs.keys.device)
        b, hk, s, _ = keys.shape
        acc = torch.zeros(b, hk, s, dtype=torch.float32, device=keys.device)
        prev_acc, prev_pos = inputs.state.get("h2o_acc"), inputs.state.get("h2o_positions")
        if prev_acc is not None and prev_pos is not None and prev_pos.numel() > 0:
            # Carry each surviving key's running sum over by matching absolute positions.
            order = torch.argsort(prev_pos)
            sorted_pos = prev_pos[order]
            idx = torch.searchsorted(sorted_pos, pos).clamp_max(sorted_pos.numel() - 1)
            found = sorted_pos[idx] == pos
            carried = prev_acc[:, :, order[idx]]
            acc = torch.where(found[None, None, :], carried, acc)
        mass = query_attention(inputs.queries, keys, inputs.scaling, inputs.q_positions, pos, reduce="sum")
        acc = acc + combine_groups(mass, hk, "mean")
        inputs.state["h2o_acc"] = acc
        inputs.state["h2o_positions"] = pos.clone()
        return acc.clone()


@dataclass
class SnapKV:
    """SnapKV (Li et al., 2024): pooled attention of an observation window.

    The window is the last ``window`` queries of the chunk. For keys before the window:
    ``a^h[k] = mean_{t in window} softmax_t(q_t^h . K * scaling)[k]`` (causal), smoothed by a
    1-D ``pooling`` kernel of size ``kernel`` along the key axis (over the keys before the
    window, in held order, zero-padded), then averaged over the group. Keys inside the
    window (position >= the window's first query) get the batch item's maximum score, as in
    SnapKV/kvpress, so they are preferred over everything else.

    Shapes: ``queries (b, hq, q, d)``, ``keys (b, hk, s, d)``, ``positions (s,)`` or
    ``(b, s)`` (one row per batch item) -> ``(b, hk, s)``. GQA: pool per query head, then
    mean over the group. :meth:`score_cells` scores many cells in one call.
    """

    window: int = 32
    kernel: int = 5
    pooling: Literal["avg", "max"] = "avg"
    name: str = "snapkv"
    needs: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise InputError("kernel", f"{self.kernel} is not a positive odd number", "use 5 or 7")
        if self.window < 1:
            raise InputError("window", f"{self.window} < 1", "use a window of at least one query")
        if self.pooling not in ("avg", "max"):
            raise InputError("pooling", f"unknown {self.pooling!r}", "use 'avg' or 'max'")

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        hk = inputs.keys.shape[1]
        pos = inputs.positions.to(inputs.keys.device)
        qw, qpos = inputs.queries[:, :, -self.window:], inputs.q_positions[-self.window:]
        probs = query_attention(qw, inputs.keys, inputs.scaling, qpos, pos, reduce="mean")  # (b, hq, s)
        b, hq, s = probs.shape
        past = (pos < qpos.min().to(pos.device)).expand(b, s)  # keys before the window, per item
        # Pool each item's past keys as if compacted: a stable sort puts them first, in held
        # order; slots after them are the pooling's padding (0 for avg, -inf for max, as F.*_pool1d).
        order = torch.argsort((~past).to(torch.int8), dim=-1, stable=True)[:, None, :].expand(b, hq, s)
        n_past = past.sum(-1)  # (b,)
        pad = torch.arange(s, device=pos.device)[None, :] >= n_past[:, None]  # (b, s), in sorted order
        packed = probs.gather(-1, order).masked_fill(pad[:, None, :], 0.0 if self.pooling == "avg" else -math.inf)
        out = torch.empty_like(probs).scatter_(-1, order, _pool(packed, self.kernel, self.pooling))
        scores = combine_groups(out, hk, "mean")
        # Window keys: the item's largest past score (1.0 when it has no past key).
        top = scores.masked_fill(~past[:, None, :], -math.inf).amax(dim=(1, 2))
        top = torch.where(n_past > 0, top, torch.ones_like(top))
        return torch.where(past[:, None, :], scores, top[:, None, None])

    def score_cells(self, cells: Sequence[ScoreInputs]) -> list[torch.Tensor]:
        """``[self.score(c) for c in cells]`` in one call: single-item cells of equal length
        with the same queries' positions are stacked along the batch axis (their positions as
        one row each), which is what the decode loop's cells of one layer usually are."""
        c0 = cells[0]
        same = all(c.keys.shape == c0.keys.shape and c.queries.shape == c0.queries.shape and c.positions.ndim == 1
                   and (c.q_positions is c0.q_positions or torch.equal(c.q_positions, c0.q_positions)) for c in cells)
        if len(cells) == 1 or c0.keys.shape[0] != 1 or not same:
            return [self.score(c) for c in cells]
        stacked = ScoreInputs(
            layer=c0.layer, n_layers=c0.n_layers, keys=torch.cat([c.keys for c in cells]),
            values=torch.cat([c.values for c in cells]), positions=torch.stack([c.positions for c in cells]),
            queries=torch.cat([c.queries[:, :, -self.window:] for c in cells]), q_positions=c0.q_positions,
            scaling=c0.scaling)
        return list(self.score(stacked).split(1))


@dataclass
class ExpectedAttention:
    """Expected attention of future queries (Devoto et al., 2025, kvpress ExpectedAttention).

    From the chunk's queries (positions >= ``n_sink``; earlier ones are sink outliers) we
    undo RoPE (``rope_theta`` must be the model's), take the per-head mean ``mu`` and
    covariance ``Sigma`` of the pre-RoPE queries, and move them to the next ``n_future``
    positions ``P+1 .. P+n_future`` (``P`` = last query position) with the *averaged*
    rotation ``Rbar = mean_t R(P+t)``: ``mu' = Rbar mu``, ``Sigma' = Rbar Sigma Rbar^T``. For a
    Gaussian query ``E[exp(s q.k)] = exp(s mu'.k + s^2/2 k^T Sigma' k)`` (``s`` = scaling), so

        a^h[k] = softmax_k(s mu'.k + s^2/2 k^T Sigma' k)      (over held keys)
        score[k] = (mean_{h in group} a^h[k] + epsilon) * ||v_k||   (``use_vnorm``)

    Approximations (as in the reference press): one averaged rotation instead of a mixture
    over future positions; the softmax of expected logits stands in for expected softmax;
    query statistics assumed stationary. Unscaled RoPE only (no YaRN/llama3 scaling).

    Shapes: ``queries (b, hq, q, d)``, ``keys/values (b, hk, s, d)`` -> ``(b, hk, s)``.
    GQA: mean over the group's query heads.
    """

    n_future: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    rope_theta: float = 10000.0
    name: str = "expected_attention"
    needs: frozenset[str] = field(default_factory=frozenset)
    #: the decode loop passes every query of the chunk (all since the previous call)
    uses_all_queries: ClassVar[bool] = True

    def query_statistics(self, inputs: ScoreInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Future-rotated mean ``(b, hq, d)`` and covariance ``(b, hq, d, d)``, float64."""
        q, qpos = inputs.queries, inputs.q_positions.to(inputs.queries.device)
        use = qpos >= self.n_sink
        if not use.any():  # a chunk made only of sinks: use it rather than nothing
            use = torch.ones_like(use)
        pre = rope_rotate(q[:, :, use].double(), -qpos[use], self.rope_theta)  # (b, hq, n, d)
        mu = pre.mean(dim=2)
        centred = pre - mu[:, :, None]
        cov = centred.transpose(-1, -2) @ centred / pre.shape[2]
        d = q.shape[-1]
        future = int(qpos.max()) + 1 + torch.arange(self.n_future, device=q.device)
        angles = future[:, None].double() * rope_inv_freq(d, self.rope_theta, q.device)[None, :]
        c_bar = torch.cos(angles).mean(0).repeat(2)  # (d,)
        s_bar = torch.sin(angles).mean(0).repeat(2)
        half = d // 2
        perm = torch.zeros(d, d, dtype=torch.float64, device=q.device)  # rotate_half as a matrix
        perm[:half, half:] = -torch.eye(half, dtype=torch.float64, device=q.device)
        perm[half:, :half] = torch.eye(half, dtype=torch.float64, device=q.device)
        r_bar = torch.diag(c_bar) + s_bar[:, None] * perm
        return mu @ r_bar.T, r_bar @ cov @ r_bar.T

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        b, hk, s, d = inputs.keys.shape
        mu, cov = self.query_statistics(inputs)
        hq = mu.shape[1]
        k = inputs.keys.double().repeat_interleave(hq // hk, dim=1)  # (b, hq, s, d)
        sc = inputs.scaling
        logits = sc * torch.einsum("bhd,bhsd->bhs", mu, k)
        if self.use_covariance:
            logits = logits + 0.5 * sc * sc * torch.einsum("bhsi,bhij,bhsj->bhs", k, cov, k)
        scores = combine_groups(torch.softmax(logits, dim=-1), hk, "mean")
        if self.use_vnorm:
            scores = (scores + self.epsilon) * inputs.values.double().norm(dim=-1)
        return scores.float()


KVZIP_PROMPT = "\n\nRepeat the previous context exactly."
"""Text the decode loop appends after the context for KVzip's reconstruction pass (KVzip's)."""


@dataclass
class KVzip:
    """KVzip-style (Kim et al., 2025): attention received while the model repeats the context.

    The decode loop (``needs={"reconstruction"}``) runs, after the context is in the cache,
    a teacher-forced pass over ``KVZIP_PROMPT`` + the context tokens again (see
    :meth:`reconstruction_ids`) and passes that pass's post-RoPE queries of this layer as
    ``extra_queries`` ``(b, hq, m, d)``; those tokens' own keys are not stored. Then

        score[k] = max_{h in group} max_{t <= m} softmax_t(q_t^h . K * scaling)[k]

    with the softmax over the held keys only (ours: KVzip also normalises over the
    reconstruction tokens' own keys, which rescales each query's row but not its ranking).

    Shapes: ``extra_queries (b, hq, m, d)``, ``keys (b, hk, s, d)`` -> ``(b, hk, s)``.
    GQA: max over the group's query heads (KVzip's choice).
    """

    name: str = "kvzip"
    needs: frozenset[str] = field(default_factory=lambda: frozenset({"reconstruction"}))

    @staticmethod
    def reconstruction_ids(context_ids: torch.Tensor, tokenizer) -> torch.Tensor:
        """``(b, p + n)`` token ids of the reconstruction pass: prompt then the context again."""
        prompt = tokenizer.encode(KVZIP_PROMPT, add_special_tokens=False)
        p = torch.tensor(prompt, dtype=torch.long, device=context_ids.device)
        return torch.cat([p.expand(context_ids.shape[0], -1), context_ids], dim=1)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        xq = _require_extra(inputs, "kvzip", "reconstruction-pass queries")
        peak = query_attention(xq, inputs.keys, inputs.scaling, reduce="max")  # (b, hq, s); all after the keys
        return combine_groups(peak, inputs.keys.shape[1], "max")


@dataclass
class Compactor:
    """Compactor-style (Chari & Van Durme, 2025): key leverage + non-causal attention.

    1. Leverage: pre-RoPE keys (RoPE undone with ``rope_theta``), centred over the sequence,
       ``X (s, d)``; ``lev[k] = X_k (X^T X)^+ X_k^T``. Exact (SVD) when ``sketch_dim`` is
       None; else ``X`` is first right-multiplied by a seeded Gaussian ``(d, sketch_dim)``
       sketch (Compactor's approximation). Keys that are geometric outliers score high.
    2. Non-causal attention: ``att[k] = (mean_{h in group} sum_t softmax_t(q_t^h . K *
       scaling)[k]) * ||v_k||`` over the chunk's queries with no causal mask, then a 1-D
       average pool of width 3.
    3. ``score = blend * z(lev) + z(att)``, ``z`` standardising per batch item over all
       heads and keys.

    Ours: Compactor tiles a prefill into 256-token blocks with unit logit scale; here the
    chunk's queries attend to all held keys with the module's scale (the decode loop's chunk
    is the tile). Leverage uses an exact SVD by default because d is small.

    Shapes: ``queries (b, hq, q, d)``, ``keys/values (b, hk, s, d)`` -> ``(b, hk, s)``.
    GQA: leverage is per KV head already; attention is the group mean.
    """

    blend: float = 0.35
    sketch_dim: int | None = None
    seed: int = 0
    rope_theta: float = 10000.0
    name: str = "compactor"
    needs: frozenset[str] = field(default_factory=frozenset)
    #: the decode loop passes every query of the chunk (all since the previous call)
    uses_all_queries: ClassVar[bool] = True

    def leverage(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``(b, hk, s)`` float64 leverage of each key within its head's key matrix."""
        x = rope_rotate(keys.double(), -positions.to(keys.device), self.rope_theta)
        x = x - x.mean(dim=2, keepdim=True)
        if self.sketch_dim is not None:
            gen = torch.Generator().manual_seed(self.seed)  # CPU generator: same sketch on any device
            phi = torch.randn(x.shape[-1], self.sketch_dim, generator=gen, dtype=torch.float64)
            x = x @ (phi.to(x.device) / self.sketch_dim ** 0.5)
        u, sv, _ = torch.linalg.svd(x, full_matrices=False)
        # Rank-revealing cut: directions with negligible singular values carry no leverage.
        rank_ok = sv > sv[..., :1] * max(x.shape[-2:]) * torch.finfo(torch.float64).eps
        return (u.square() * rank_ok[..., None, :]).sum(dim=-1)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        hk = inputs.keys.shape[1]
        lev = self.leverage(inputs.keys, inputs.positions)
        mass = query_attention(inputs.queries, inputs.keys, inputs.scaling, reduce="sum")  # no causal mask
        att = combine_groups(mass, hk, "mean").double() * inputs.values.double().norm(dim=-1)
        att = _pool(att, 3, "avg")
        return (self.blend * _zscore(lev) + _zscore(att)).float()


@dataclass
class Oracle:
    """ORACLE (an upper reference, not a method): attention of the true future queries.

    The decode loop (``needs={"future"}``) passes the post-RoPE queries this layer will issue
    at the next ``m`` positions (from a full-cache run) as ``extra_queries``;

        score[k] = mean_{h in group} mean_{t <= m} softmax_t(q_t^h . K * scaling)[k]

    over the held keys, i.e. the attention mass the future will put on each key, restricted to
    keys held now. Keeping the top scores keeps the most future mass.

    Shapes: ``extra_queries (b, hq, m, d)``, ``keys (b, hk, s, d)`` -> ``(b, hk, s)``.
    GQA: mean over the group's query heads.
    """

    name: str = "oracle"
    needs: frozenset[str] = field(default_factory=lambda: frozenset({"future"}))

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        xq = _require_extra(inputs, "oracle", "the true future queries")
        mean = query_attention(xq, inputs.keys, inputs.scaling, reduce="mean")  # (b, hq, s)
        return combine_groups(mean, inputs.keys.shape[1], "mean")

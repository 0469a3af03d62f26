"""Record post-RoPE queries, keys and values from stock transformers attention modules.

:class:`AttentionCapture` is a context manager that registers PyTorch hooks on every
attention module of a model (the sites of :func:`evictlab.models.sites.find_attention_sites`)
and removes every handle in ``finally``. Nothing is patched: no copied forward, no global attention function, no
change to ``model.config``. Per attention module it hooks

- the module that produces the pre-RoPE query / key: ``q_norm`` / ``k_norm`` when the
  architecture has them (Gemma 3 and Qwen3 normalise per head, OLMo2 the whole projection;
  in every supported family the norm is the last step before RoPE), else ``q_proj`` /
  ``k_proj``; and ``v_proj`` for the values;
- the module itself with a forward *pre*-hook (with kwargs) to read ``position_embeddings``
  (the ``(cos, sin)`` pair the model computed for this layer type: Gemma 3 uses different
  RoPE bases on sliding and full layers), and a forward hook that applies the modeling
  file's own ``apply_rotary_pos_emb`` to the recorded query and key (the same function, on
  the same float32 tensors, as the forward: bit-identical post-RoPE vectors);
- ``o_proj`` with a forward pre-hook: its input is the module's per-head attention output
  ``mu`` (before the output projection), recorded at the query positions so every captured
  row can be checked against the model's own result (:func:`verify_layer`).

Which keys a row sees
    A query at absolute position t on a full-attention layer sees keys ``[0, t]``; on a
    sliding-window layer with window W (``module.sliding_window``) it sees
    ``[max(0, t - W + 1), t]``, matching transformers' sliding mask (key j visible iff
    ``t - W < j <= t``). Tests compare this against ``output_attentions``.

GQA
    Query head h reads KV head ``h // (n_q_heads // n_kv_heads)`` (transformers'
    ``repeat_kv`` layout); :meth:`LayerCapture.kv_head_of` records it.

Batches
    Several prompts of equal length may run in one forward (batch B): pass one position list
    per prompt (``positions=[[...], [...]]``); ``items[b]`` then holds prompt b's layers
    (``captures`` is ``items[0]``). No padding is supported: rows of a padded prompt would
    see pad keys. The forward should use ``use_cache=False`` (keys come from the hooks, not
    from a cache).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from evictlab.errors import EvictlabError, InputError
from evictlab.models.sites import AttentionSite, find_attention_sites, to_heads_layout


class CaptureMismatchError(EvictlabError, RuntimeError):
    """Captured rows do not reproduce the attention module's own output (unsupported model)."""


@dataclass
class LayerCapture:
    """What one forward recorded for one layer (CPU, float32).

    Attributes:
        queries: ``(n_q_heads, P, d)`` post-RoPE queries at the P capture positions.
        keys: ``(n_kv_heads, L, d)`` post-RoPE keys of all L tokens.
        values: ``(n_kv_heads, L, d)`` values of all L tokens.
        head_out: ``(n_q_heads, P, d)`` the module's own per-head output (o_proj input).
        positions: int64 ``(P,)`` absolute query positions (sorted, unique).
        scaling: the module's logit scale (``p = softmax(scaling * q.K^T)``).
        sliding_window: W for sliding-window layers, else None.
    """

    layer: int
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    head_out: torch.Tensor
    positions: np.ndarray
    scaling: float
    sliding_window: int | None
    n_q_heads: int
    n_kv_heads: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_q_heads // self.n_kv_heads

    def kv_head_of(self, q_head: int) -> int:
        """The KV head query head ``q_head`` reads (transformers' repeat_kv layout)."""
        return q_head // self.group

    def key_range(self, positions: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)`` int64 arrays: position t sees keys ``[lo, hi)`` (absolute indices)."""
        t = np.asarray(positions, dtype=np.int64)
        hi = t + 1
        lo = np.zeros_like(t) if self.sliding_window is None else np.maximum(0, t - self.sliding_window + 1)
        return lo, hi


@dataclass
class _Pending:
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    head_out: list[torch.Tensor] | None = None  # per batch item: (H, P_b, d)


@dataclass
class AttentionCapture:
    """Context manager recording each chosen layer's post-RoPE q/k, v and per-head output.

    Usage::

        with AttentionCapture(model, positions=[100, 200], layers=None) as cap:
            model(input_ids, use_cache=False)
        cap.layers[3].queries   # (n_q_heads, 2, d)

    ``positions``: absolute query positions to record queries and outputs at (keys and
    values are recorded for every token), or one such list per prompt of a batch (then
    ``items[b]`` is prompt b's ``{layer: LayerCapture}``). ``layers``: layer indices, None
    for all. Every hook handle is removed on exit, also when the forward raised.
    """

    model: nn.Module
    positions: Sequence[int] | Sequence[Sequence[int]]
    layers: Sequence[int] | None = None
    sites: list[AttentionSite] = field(init=False)
    captures: dict[int, LayerCapture] = field(init=False, default_factory=dict)
    items: list[dict[int, LayerCapture]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        all_sites = find_attention_sites(self.model)
        known = [s.layer for s in all_sites]
        if self.layers is None:
            self.sites = all_sites
        else:
            bad = sorted(set(self.layers) - set(known))
            if bad:
                raise InputError("--layers", f"layers {bad} do not exist (the model has layers "
                                 f"0..{max(known)})", "pick layers from that range, or 'all'")
            want = set(self.layers)
            self.sites = [s for s in all_sites if s.layer in want]
        per_item = len(self.positions) > 0 and all(isinstance(p, (Sequence, np.ndarray)) for p in self.positions)
        sets = list(self.positions) if per_item else [self.positions]
        self._pos_items = [np.unique(np.asarray(p, dtype=np.int64)) for p in sets]
        if any(pos.size == 0 or pos[0] < 0 for pos in self._pos_items):
            raise InputError("positions", "must be a non-empty list of positions >= 0",
                             "pass the query positions to capture")
        self._handles: list[Any] = []
        self._pending: dict[int, _Pending] = {}

    # -- context manager --------------------------------------------------------------

    def __enter__(self) -> AttentionCapture:
        self.items = [{} for _ in self._pos_items]
        self.captures = self.items[0]
        try:
            for site in self.sites:
                self._attach(site)
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        try:
            for h in self._handles:
                h.remove()
        finally:
            self._handles = []
            self._pending = {}

    # -- hooks ------------------------------------------------------------------------

    def _attach(self, site: AttentionSite) -> None:
        st = _Pending()
        self._pending[site.layer] = st
        fwd_sig = inspect.signature(site.module.forward)

        def pre_attn(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            bound = fwd_sig.bind_partial(*args, **kwargs).arguments
            hs = bound.get("hidden_states", args[0] if args else None)
            if hs is not None and hs.shape[0] != len(self._pos_items):
                raise InputError("batch", f"the forward has batch {hs.shape[0]} but {len(self._pos_items)} "
                                 "position list(s) were given", "pass one position list per prompt of the batch")
            pe = bound.get("position_embeddings")
            if pe is None:
                raise InputError("--model", f"{type(mod).__name__} received no position_embeddings",
                                 "use a model whose attention takes (cos, sin) from the decoder")
            st.cos_sin = (pe[0], pe[1])
            st.q = st.k = st.v = st.head_out = None

        def on_q(mod: nn.Module, inputs: tuple[Any, ...], out: torch.Tensor) -> None:
            st.q = to_heads_layout(out, inputs[0], site.n_q_heads, site.head_dim)

        def on_k(mod: nn.Module, inputs: tuple[Any, ...], out: torch.Tensor) -> None:
            st.k = to_heads_layout(out, inputs[0], site.n_kv_heads, site.head_dim)

        def on_v(mod: nn.Module, inputs: tuple[Any, ...], out: torch.Tensor) -> None:
            st.v = to_heads_layout(out, inputs[0], site.n_kv_heads, site.head_dim)

        def pre_o(mod: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]  # (B, L, H*d): the per-head outputs, concatenated over heads
            B, L, _ = x.shape
            heads = x.view(B, L, site.n_q_heads, site.head_dim)
            st.head_out = [heads[b, torch.as_tensor(pos[pos < L], device=x.device)].transpose(0, 1)
                           for b, pos in enumerate(self._pos_items)]

        def post_attn(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            if st.q is None or st.k is None or st.v is None or st.cos_sin is None or st.head_out is None:
                raise InputError("--model", f"{type(mod).__name__} did not run the expected "
                                 "q/k/v/o projections", "use a standard decoder attention module")
            cos, sin = st.cos_sin
            q, k = site.rope(st.q, st.k, cos, sin)  # (B, H, L, d), (B, Hkv, L, d)
            L = k.shape[2]
            cpu = dict(device="cpu", dtype=torch.float32)
            for b, all_pos in enumerate(self._pos_items):
                pos = all_pos[all_pos < L]
                if pos.size < all_pos.size:
                    raise InputError("positions", f"position {int(all_pos[-1])} is beyond the "
                                     f"{L}-token input", "capture positions inside the prompt")
                idx = torch.as_tensor(pos, device=q.device)
                self.items[b][site.layer] = LayerCapture(
                    layer=site.layer,
                    queries=q[b][:, idx].detach().to(**cpu),
                    keys=k[b].detach().to(**cpu),
                    values=st.v[b].detach().to(**cpu),
                    head_out=st.head_out[b].detach().to(**cpu),
                    positions=pos.copy(), scaling=site.scaling, sliding_window=site.sliding_window,
                    n_q_heads=site.n_q_heads, n_kv_heads=site.n_kv_heads,
                )
            st.q = st.k = st.v = st.head_out = None
            st.cos_sin = None

        self._handles.append(site.module.register_forward_pre_hook(pre_attn, with_kwargs=True))
        self._handles.append(site.q_src.register_forward_hook(on_q))
        self._handles.append(site.k_src.register_forward_hook(on_k))
        self._handles.append(site.v_src.register_forward_hook(on_v))
        self._handles.append(site.o_proj.register_forward_pre_hook(pre_o))
        self._handles.append(site.module.register_forward_hook(post_attn, with_kwargs=True))


# --------------------------------------------------------------------------- row math


def row_probs(q: np.ndarray, keys: np.ndarray, scaling: float) -> np.ndarray:
    """float64 ``softmax(scaling * keys @ q)``: q ``(d,)``, keys ``(n, d)`` -> ``(n,)``."""
    z = (keys.astype(np.float64) @ q.astype(np.float64)) * scaling
    z -= z.max()
    e = np.exp(z)
    return e / e.sum()


def verify_layer(cap: LayerCapture) -> float:
    """Largest scaled error ``|mu - head_out| / max(1, max|v|)`` over the layer's rows.

    mu = softmax(scaling * q.K[lo:hi]^T) V[lo:hi] is recomputed in float64 for every (query
    head, position); the reference is the module's own output for that head (o_proj input,
    float32). The error is divided by the largest value magnitude the row reads (at least
    1), because float32 rounding of the model's own ``p @ V`` grows with |v|: Gemma 3's
    first layer has values up to ~100, where an exact capture still differs by ~3e-5
    absolute (3e-7 relative). A model whose rows are rebuilt exactly gives ~1e-7..1e-6;
    anything large means the hooks do not see what the model computes (e.g. logit
    soft-capping, a value norm).
    """
    lo, hi = cap.key_range(cap.positions)
    K = cap.keys.double().numpy()
    V = cap.values.double().numpy()
    Q = cap.queries.double().numpy()
    ref = cap.head_out.double().numpy()
    worst = 0.0
    for h in range(cap.n_q_heads):
        g = cap.kv_head_of(h)
        for j in range(cap.positions.size):
            a, b = int(lo[j]), int(hi[j])
            p = row_probs(Q[h, j], K[g, a:b], cap.scaling)
            Vr = V[g, a:b]
            mu = p @ Vr
            scale = max(1.0, float(np.abs(Vr).max()))
            worst = max(worst, float(np.abs(mu - ref[h, j]).max()) / scale)
    return worst

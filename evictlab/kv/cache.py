"""Plugging a KV store into a stock transformers model: a ``Cache`` subclass plus hooks.

No model code is copied. Two pieces:

1. :class:`EvictionCache` (a ``transformers.Cache``): each layer's ``update(k, v)`` appends
   the new keys/values to the store and returns that layer's K/V for attention,
   ``(batch, kv_heads, S, head_dim)`` with every head's live entries left-aligned (see
   :mod:`evictlab.kv.base`). For the paged store this is a **transient gather copy** of the
   layer's live entries on every forward (the stock ``DynamicCache`` also copies the whole
   layer, by ``torch.cat``, on every step). The masked store returns views (no copy).
2. :func:`attach` (a context manager) registers, on every attention module, a forward
   pre-hook (``with_kwargs=True``) that replaces ``attention_mask`` with a per-layer,
   per-head additive mask built from the store's slot positions (padding and evicted
   entries get the dtype minimum; causality is by absolute position, so it stays right
   after eviction). It also records post-RoPE queries for the scorers: a forward hook on
   the module's ``q_norm`` (if it has one, e.g. OLMo2/Gemma3) or ``q_proj`` output, rotated
   with the modeling module's own ``apply_rotary_pos_emb`` and the ``position_embeddings``
   the pre-hook saw. The hook points are :func:`evictlab.models.sites.find_attention_sites`'s.
   Hooks are removed in ``finally``.

Positions: a layer's next token position is the number of tokens it has seen (not the
number it holds), so ``get_seq_length`` returns tokens seen and the model's default
``position_ids`` stay correct after eviction. Batch items must be the same length (no
padding): every sequence of a batch is at the same position.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from evictlab.errors import InputError
from evictlab.kv.attention import position_mask
from evictlab.kv.base import KVStore
from evictlab.models.sites import AttentionSite, find_attention_sites, to_heads_layout


class _StoreLayer(CacheLayerMixin):
    """One layer's view of a shared :class:`KVStore` (transformers' per-layer cache object)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, store: KVStore, layer: int) -> None:
        super().__init__()
        self.store = store
        self.layer = layer
        self.seen = 0  # tokens appended so far = absolute position of the next token

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(batch, kv_heads, q_len, head_dim)`` keys/values; return the layer's K/V."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        pos = torch.arange(self.seen, self.seen + q, device=key_states.device)
        k, v = self.store.append_gather(self.layer, key_states, value_states, pos)
        self.seen += q
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Only used by the model's own mask builder, whose mask the pre-hook replaces.
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1


class EvictionCache(Cache):
    """A transformers ``Cache`` whose storage is a :class:`KVStore` (physical or masked).

    Use it as ``model(input_ids, cache=cache, use_cache=True)`` inside :func:`attach`.
    Eviction itself is done between forward calls by the decode loop
    (:mod:`evictlab.decode.loop`) through ``store.keep``.
    """

    def __init__(self, store: KVStore) -> None:
        self.store = store
        super().__init__(layers=[_StoreLayer(store, l) for l in range(store.n_layers)])
        #: per layer: post-RoPE queries ``(batch, q_heads, m, d)`` and their positions ``(m,)``
        #: recorded so far (since the last consuming :meth:`take_queries`), trimmed to the
        #: last ``query_window`` queries.
        self.queries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: how many recent queries to keep per layer: ``0`` records none, ``None`` keeps all
        #: (until consumed by ``take_queries(layer, consume=True)``).
        self.query_window: int | None = 0
        self._pe: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def seen(self) -> int:
        """Tokens processed so far (absolute position of the next token)."""
        return self.layers[0].seen

    def record_queries(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        """Append ``q`` ``(batch, q_heads, q_len, d)`` to the layer's query window."""
        if not self.recording:
            return
        if layer in self.queries:
            old_q, old_p = self.queries[layer]
            q, positions = torch.cat([old_q, q], 2), torch.cat([old_p, positions])
        w = self.query_window
        if w is None:
            self.queries[layer] = (q.detach(), positions)
        else:
            self.queries[layer] = (q[:, :, -w:].detach(), positions[-w:])

    @property
    def recording(self) -> bool:
        """Whether forwards record queries (``query_window`` is ``None`` or positive)."""
        return self.query_window is None or self.query_window > 0

    def take_queries(self, layer: int, *, consume: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The recorded queries of ``layer``.

        ``consume=False`` leaves them recorded (a sliding observation window may span two
        compressions); ``consume=True`` removes them, so the next call returns only queries
        recorded after this one (for scorers that must see every query exactly once).
        """
        return self.queries.pop(layer, None) if consume else self.queries.get(layer)


@contextlib.contextmanager
def attach(model: torch.nn.Module, cache: EvictionCache) -> Iterator[EvictionCache]:
    """Register the mask pre-hooks and query hooks on ``model`` for ``cache``; remove on exit.

    Hooks go on the attention sites of :func:`evictlab.models.sites.find_attention_sites`
    (the module, and its ``q_norm`` or ``q_proj``).
    """
    sites = find_attention_sites(model)
    if len(sites) != cache.store.n_layers:
        raise InputError("model", f"found {len(sites)} attention modules for a {cache.store.n_layers}-layer store",
                         "build the store from this model's geometry")
    handles: list[Any] = []

    def make_pre_hook(site: AttentionSite):  # noqa: ANN202 - closure over the site
        layer, n_rep = site.layer, site.n_q_heads // site.n_kv_heads

        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            q_len = hidden.shape[1]
            seen = cache.layers[layer].seen
            new_pos = torch.arange(seen, seen + q_len, device=hidden.device)
            slot_pos = cache.store.layout_positions(layer, new_pos)
            kwargs["attention_mask"] = position_mask(slot_pos, new_pos, n_rep, hidden.dtype)
            if "position_embeddings" in kwargs and kwargs["position_embeddings"] is not None:
                cache._pe[layer] = kwargs["position_embeddings"]
            return args, kwargs

        return pre_hook

    def make_q_hook(site: AttentionSite):  # noqa: ANN202 - closure over the site
        layer = site.layer

        def q_hook(_sub: torch.nn.Module, inp: Any, out: torch.Tensor) -> None:
            if not cache.recording:
                return
            # q_proj (b, q_len, heads * d), or a per-head q_norm in either 4-D layout
            q = to_heads_layout(out, inp[0], site.n_q_heads, site.head_dim)
            q_len = q.shape[2]
            if layer in cache._pe:
                cos, sin = cache._pe[layer]
                q, _ = site.rope(q, q, cos, sin)
            seen = cache.layers[layer].seen
            cache.record_queries(layer, q, torch.arange(seen, seen + q_len, device=q.device))

        return q_hook

    try:
        for site in sites:
            handles.append(site.module.register_forward_pre_hook(make_pre_hook(site), with_kwargs=True))
            handles.append(site.q_src.register_forward_hook(make_q_hook(site)))
        yield cache
    finally:
        for h in handles:
            h.remove()
        cache._pe.clear()

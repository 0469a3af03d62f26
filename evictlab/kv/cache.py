"""Plugging a KV store into a stock transformers model: a ``Cache`` subclass, hooks, and
an attention function registered under a new name.

No model code is copied and no existing attention function is replaced. The pieces:

1. :class:`EvictionCache` (a ``transformers.Cache``): each layer's ``update(k, v)`` appends
   the new keys/values to the store. What it returns depends on how the model was loaded:

   - **ragged** (the model's ``attn_implementation`` is :data:`RAGGED_ATTENTION`, chosen
     at load time by :func:`evictlab.models.loading.load_model`): only the new K/V (no
     copy); the attention function :func:`ragged_attention_forward` reads the store cell by
     cell with scaled-dot-product kernels (:func:`evictlab.kv.attention.ragged_attention`),
     and no mask or padded K/V is ever built;
   - **rectangular** (any stock implementation, e.g. ``eager``, the exactness reference):
     the layer's K/V ``(batch, kv_heads, S, head_dim)`` with every head's live entries
     left-aligned (:mod:`evictlab.kv.base`): for the paged store a transient gather copy of
     the layer on every forward; the masked store returns views.
2. :func:`attach` (a context manager) registers on every attention module a forward
   pre-hook (``with_kwargs=True``). Ragged: it hands the attention function the call's
   context (cache, layer, first query position, sliding window) as one keyword argument,
   and the attention function records the post-RoPE queries for the scorers.
   Rectangular: it replaces ``attention_mask`` with a per-layer, per-head additive mask
   built from the store's slot positions (padding, evicted entries, future slots and, on
   sliding layers, slots ``window`` or more positions back get the dtype minimum), and a
   forward hook on ``q_norm`` (OLMo2, Gemma3) or ``q_proj`` records the post-RoPE queries,
   rotated with the modeling module's own ``apply_rotary_pos_emb``. The hook points are
   :func:`evictlab.models.sites.find_attention_sites`'s. Hooks are removed in ``finally``.

Positions: a layer's next token position is the number of tokens it has seen (not the
number it holds), so ``get_seq_length`` returns tokens seen and the model's default
``position_ids`` stay correct after eviction. Batch items must be the same length (no
padding): every sequence of a batch is at the same position.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from evictlab.errors import InputError
from evictlab.kv.attention import position_mask, ragged_attention
from evictlab.kv.base import KVStore
from evictlab.models.sites import AttentionSite, find_attention_sites, to_heads_layout

#: The name :func:`register_ragged_attention` gives :func:`ragged_attention_forward` in
#: transformers' ``AttentionInterface``; pass it as ``attn_implementation`` at load time.
RAGGED_ATTENTION = "evictlab_ragged"
_CALL = "evictlab_call"  # the keyword argument that carries a RaggedCall to the attention function


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
        self.ragged = False  # set by attach(): the model reads the store itself (no gather)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(batch, kv_heads, q_len, head_dim)`` keys/values; return the layer's K/V."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        pos = torch.arange(self.seen, self.seen + q)  # host positions: the store reads them without a sync
        if self.ragged:  # ragged_attention_forward reads the store: nothing to gather
            self.store.append(self.layer, key_states, value_states, pos)
            self.seen += q
            return key_states, value_states
        k, v = self.store.append_gather(self.layer, key_states, value_states, pos)
        self.seen += q
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Only used by the model's own mask builder, whose mask nothing reads: the pre-hook
        # replaces it (rectangular) or the attention function ignores it (ragged, where a
        # square size lets the builder skip building it).
        return (query_length if self.ragged else self.seen + query_length), 0

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

    def __init__(self, store: KVStore | None, *, n_layers: int | None = None) -> None:
        if store is None and n_layers is None:
            raise InputError("store", "an unbound cache needs its layer count", "pass a store or n_layers=")
        self.store = store  # type: ignore[assignment]  # None until bind(): see below
        n = store.n_layers if store is not None else int(n_layers)  # type: ignore[arg-type]
        super().__init__(layers=[_StoreLayer(store, l) for l in range(n)])  # type: ignore[arg-type]
        #: per layer: post-RoPE queries ``(batch, q_heads, m, d)`` and their positions ``(m,)``
        #: recorded so far (since the last consuming :meth:`take_queries`), trimmed to the
        #: last ``query_window`` queries.
        self.queries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: how many recent queries to keep per layer: ``0`` records none, ``None`` keeps all
        #: (until consumed by ``take_queries(layer, consume=True)``).
        self.query_window: int | None = 0
        self._pe: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def bind(self, store: KVStore) -> EvictionCache:
        """Hold ``store`` from now on: a cache made without one (``EvictionCache(None,
        n_layers=L)``, e.g. handed to ``model.generate`` before the prompt's length is known)
        gets its store when the first forward arrives (:mod:`evictlab.api`). Only before any
        token was seen: positions, recorded queries and the store start together. Returns
        the cache."""
        if self.seen:
            raise InputError("cache", f"this cache has already seen {self.seen} tokens", "bind a store to a new cache")
        if store.n_layers != len(self.layers):
            raise InputError("store", f"a {store.n_layers}-layer store for a {len(self.layers)}-layer cache",
                             "build the store from this model's geometry")
        self.store = store
        for layer in self.layers:
            layer.store = store
        self.queries.clear()
        return self

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
        elif q.shape[2] > w:  # a copy: a view would keep the whole chunk's queries alive
            self.queries[layer] = (q[:, :, -w:].detach().clone(), positions[-w:])
        else:
            self.queries[layer] = (q.detach(), positions)

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


class RaggedCall(NamedTuple):
    """What :func:`attach`'s pre-hook hands :func:`ragged_attention_forward` for one layer's call."""

    cache: EvictionCache
    layer: int
    q_first: int  #: absolute position of the call's first query (tokens seen before it)
    window: int | None  #: the layer's sliding window, None for full attention


def ragged_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (registered as :data:`RAGGED_ATTENTION`).

    Inside :func:`attach` (a :class:`RaggedCall` in ``kwargs``): records the post-RoPE
    ``query`` ``(batch, q_heads, q_len, d)`` for the scorers and returns
    :func:`~evictlab.kv.attention.ragged_attention` over the store, ``(batch, q_len,
    q_heads, d)``; ``key``/``value`` (this forward's new entries, already appended) and
    the model's mask are not used. Anywhere else (no cache, the stock ``DynamicCache``) it
    is transformers' own ``sdpa_attention_forward``, unchanged, with the mask transformers
    built for it (the name is registered with the sdpa mask builder).
    """
    call = kwargs.pop(_CALL, None)
    if call is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("softcap") is not None or dropout:
        raise InputError("model", "logit soft-capping and attention dropout are not supported by evictlab's "
                         "ragged attention", "load the model with attn_implementation='eager' for this run")
    q_pos = torch.arange(call.q_first, call.q_first + query.shape[2])
    call.cache.record_queries(call.layer, query, q_pos.to(query.device))
    scale = float(module.scaling if scaling is None else scaling)
    out = ragged_attention(call.cache.store, call.layer, query, q_pos, scale, call.window, own_keys=True)
    return out.transpose(1, 2).contiguous(), None


def register_ragged_attention() -> str:
    """Register :func:`ragged_attention_forward` in transformers' ``AttentionInterface``
    (and the sdpa mask builder in ``AttentionMaskInterface``) under the new name
    :data:`RAGGED_ATTENTION`, and return the name. Adds an entry; replaces nothing;
    idempotent. Called by whoever loads a model for the decode loop (``decode``, ``audit``, the
    evaluation grid), which passes the name to :func:`evictlab.models.loading.load_model`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(RAGGED_ATTENTION, ragged_attention_forward)
    AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)
    return RAGGED_ATTENTION


def is_ragged(model: torch.nn.Module) -> bool:
    """Whether ``model`` was loaded with :data:`RAGGED_ATTENTION` (read, never changed)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == RAGGED_ATTENTION


def rotated_queries(site: AttentionSite, out: torch.Tensor, inp: Any,
                    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Post-RoPE queries ``(batch, q_heads, q_len, d)`` from the output of the site's query
    source (``q_proj`` ``(b, q_len, heads * d)``, or a per-head ``q_norm`` in either 4-D
    layout) and the layer's ``(cos, sin)``, rotated with the modeling module's own
    ``apply_rotary_pos_emb``: the tensor the attention function receives."""
    q = to_heads_layout(out, inp[0], site.n_q_heads, site.head_dim)
    if position_embeddings is not None:
        cos, sin = position_embeddings
        q, _ = site.rope(q, q, cos, sin)
    return q


@contextlib.contextmanager
def query_source_hooks(model: torch.nn.Module,
                       on_query: Callable[[AttentionSite, torch.Tensor, Any, Any], None]) -> Iterator[None]:
    """For every forward of ``model`` (any cache, any attention implementation): calls
    ``on_query(site, out, inp, position_embeddings)`` with the output and input of each
    layer's query source and that call's ``(cos, sin)`` (None for a model without RoPE
    tables), for :func:`rotated_queries`. Records only: the forward is unchanged. Hooks are
    removed on exit."""
    sites = find_attention_sites(model)
    pe: dict[int, Any] = {}
    handles: list[Any] = []

    def make_pre(site: AttentionSite):  # noqa: ANN202 - closure over the site
        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            pe[site.layer] = kwargs.get("position_embeddings")

        return pre_hook

    def make_q(site: AttentionSite):  # noqa: ANN202 - closure over the site
        def q_hook(_sub: torch.nn.Module, inp: Any, out: torch.Tensor) -> None:
            on_query(site, out, inp, pe.get(site.layer))

        return q_hook

    try:
        for site in sites:
            handles.append(site.module.register_forward_pre_hook(make_pre(site), with_kwargs=True))
            handles.append(site.q_src.register_forward_hook(make_q(site)))
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def attach(model: torch.nn.Module, cache: EvictionCache,
           windows: Sequence[int | None] | None = None) -> Iterator[EvictionCache]:
    """Register the pre-hooks (and, rectangular, the query hooks) on ``model`` for ``cache``;
    remove them on exit.

    ``windows``: per layer, the sliding window (a query at ``t`` attends keys with
    ``t - pos < window``) or None; None = no windows (see
    :func:`evictlab.decode.compress.attach_model`, which passes the model's). Hooks go on the
    attention sites of :func:`evictlab.models.sites.find_attention_sites` (the module, and
    its ``q_norm`` or ``q_proj``).
    """
    sites = find_attention_sites(model)
    if len(sites) != cache.store.n_layers:
        raise InputError("model", f"found {len(sites)} attention modules for a {cache.store.n_layers}-layer store",
                         "build the store from this model's geometry")
    windows = list(windows) if windows is not None else [None] * len(sites)
    if len(windows) != len(sites):
        raise InputError("windows", f"{len(windows)} windows for {len(sites)} layers", "pass one per layer")
    ragged = is_ragged(model)
    handles: list[Any] = []

    def make_ragged_hook(site: AttentionSite):  # noqa: ANN202 - closure over the site
        layer, w = site.layer, windows[site.layer]

        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            kwargs[_CALL] = RaggedCall(cache, layer, cache.layers[layer].seen, w)
            return args, kwargs

        return pre_hook

    def make_mask_hook(site: AttentionSite):  # noqa: ANN202 - closure over the site
        layer, n_rep, w = site.layer, site.n_q_heads // site.n_kv_heads, windows[site.layer]

        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            q_len = hidden.shape[1]
            seen = cache.layers[layer].seen
            new_pos = torch.arange(seen, seen + q_len, device=hidden.device)
            slot_pos = cache.store.layout_positions(layer, new_pos).to(hidden.device)
            mask = position_mask(slot_pos, new_pos, n_rep, hidden.dtype)
            if w is not None:  # also mask slots w or more positions back (the model's sliding mask)
                far = slot_pos[:, :, None, :] <= (new_pos - w)[None, None, :, None]
                mask = mask.masked_fill(far.repeat_interleave(n_rep, dim=1), torch.finfo(mask.dtype).min)
            kwargs["attention_mask"] = mask
            if "position_embeddings" in kwargs and kwargs["position_embeddings"] is not None:
                cache._pe[layer] = kwargs["position_embeddings"]
            return args, kwargs

        return pre_hook

    def make_q_hook(site: AttentionSite):  # noqa: ANN202 - closure over the site
        layer = site.layer

        def q_hook(_sub: torch.nn.Module, inp: Any, out: torch.Tensor) -> None:
            if not cache.recording:
                return
            q = rotated_queries(site, out, inp, cache._pe.get(layer))
            seen = cache.layers[layer].seen
            cache.record_queries(layer, q, torch.arange(seen, seen + q.shape[2], device=q.device))

        return q_hook

    try:
        for site in sites:
            cache.layers[site.layer].ragged = ragged
            if ragged:
                handles.append(site.module.register_forward_pre_hook(make_ragged_hook(site), with_kwargs=True))
            else:
                handles.append(site.module.register_forward_pre_hook(make_mask_hook(site), with_kwargs=True))
                handles.append(site.q_src.register_forward_hook(make_q_hook(site)))
        yield cache
    finally:
        for h in handles:
            h.remove()
        for layer in cache.layers:
            layer.ragged = False
        cache._pe.clear()

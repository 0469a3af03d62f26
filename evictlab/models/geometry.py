"""What a model's KV cache looks like: layers, heads, head size, dtype, windows, RoPE bases.

Everything the KV stores, the decode loop and the eviction methods need to know about a
model comes from :func:`model_geometry` as one frozen :class:`ModelGeometry`, read from the
model's (text) config and its attention modules; nothing else in evictlab reads
``model.config`` for shapes. The config is only read, never changed.

Per layer:

- the **sliding window** ``w`` of a sliding-attention layer (a query at position ``t``
  attends keys with ``t - pos < w``, transformers' ``sliding_window_overlay``), or ``None``
  for a full-attention layer (:func:`layer_windows`);
- the **RoPE base** (:class:`RopeSpec`): Gemma 3 gives ``rope_parameters`` per layer type
  (base 10,000 on sliding layers, 1,000,000 on full ones); most models one base for all.
  Scorers that undo RoPE need a plain (unscaled) base; :meth:`RopeSpec.plain_theta` refuses
  scaled RoPE types and a missing base with an :class:`InputError`, lazily, so models with
  scaled RoPE still run every scorer that does not undo it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from evictlab.errors import InputError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = ["ModelGeometry", "RopeSpec", "layer_windows", "model_geometry", "rope_spec_of", "rope_theta_of",
           "text_config"]


def text_config(model_or_config: Any) -> Any:
    """The text part of a model's config (``get_text_config()`` for multimodal configs).

    Accepts a model (anything with ``.config``) or a config.
    """
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


@dataclass(frozen=True)
class RopeSpec:
    """One layer's rotary embedding: the base ``theta`` (None if the config has none) and
    the RoPE type (``"default"`` = plain RoPE; anything else is scaled)."""

    theta: float | None
    rope_type: str = "default"

    def plain_theta(self) -> float:
        """The base, for code that undoes plain RoPE; InputError if missing or scaled."""
        if self.theta is None:
            raise InputError("model.config", "has no rope_theta", "pass rope_theta=... to make_scorer explicitly")
        if self.rope_type not in ("default", None):
            raise InputError("model.config", f"RoPE type {self.rope_type!r} is scaled; the scorers undo plain RoPE only",
                             "use a model with default RoPE or a scorer that needs no rope_theta")
        return float(self.theta)


def rope_spec_of(config: Any) -> RopeSpec:
    """The RoPE base and type of a transformers config (``rope_theta``, or
    ``rope_parameters`` in transformers v5, or ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = getattr(config, "rope_theta", None) or (params.get("rope_theta") if isinstance(params, dict) else None)
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    return RopeSpec(None if theta is None else float(theta), rope_type if rope_type is not None else "default")


def rope_theta_of(config: Any) -> float:
    """The plain RoPE base of a transformers config; InputError if missing or scaled."""
    return rope_spec_of(config).plain_theta()


def _layer_ropes(cfg: Any, n: int) -> tuple[RopeSpec, ...]:
    """Per layer, its RoPE spec: one per layer type when ``rope_parameters`` is given per
    type (Gemma 3) and no global ``rope_theta`` overrides it; else the config's one."""
    rp = getattr(cfg, "rope_parameters", None)
    types = list(getattr(cfg, "layer_types", None) or [])[:n]
    if (isinstance(rp, dict) and len(types) == n and "rope_theta" not in rp
            and all(isinstance(rp.get(t), dict) for t in types)):
        by_type = {t: rope_spec_of(SimpleNamespace(rope_parameters=rp[t])) for t in dict.fromkeys(types)}
        return tuple(by_type[t] for t in types)
    return (rope_spec_of(cfg),) * n


def layer_windows(model: Any) -> list[int | None]:
    """Per layer, the sliding window ``w`` of a sliding-attention layer, or ``None`` for a
    full-attention layer.

    Read from the config's ``layer_types`` (Gemma 3, Qwen2: ``"sliding_attention"`` /
    ``"full_attention"``); a config without ``layer_types`` but with a ``sliding_window``
    (Mistral) slides on every layer. Other layer types (chunked, linear attention) and
    bidirectional attention are an :class:`InputError`. ``model`` is a model or a config.
    """
    cfg = text_config(model)
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = list(getattr(cfg, "layer_types", None) or [])
    if getattr(cfg, "use_bidirectional_attention", False):
        raise InputError("model", "bidirectional attention is not causal decoding", "use a causal decoder model")
    if not types:
        slides = bool(window) and getattr(cfg, "use_sliding_window", True) is not False
        return [int(window) if slides else None] * n
    bad = sorted({t for t in types[:n] if t not in ("full_attention", "sliding_attention")})
    if bad or len(types) < n:
        raise InputError("model", f"layer types {bad or types} are not supported by the eviction loop",
                         "use a model whose layers are full_attention or sliding_attention")
    if "sliding_attention" in types[:n] and not window:
        raise InputError("model", "sliding_attention layers without a sliding_window in the config",
                         "set config.sliding_window")
    return [int(window) if t == "sliding_attention" else None for t in types[:n]]


@dataclass(frozen=True)
class ModelGeometry:
    """The shape of a model's KV cache and attention, per sequence.

    Attributes:
        n_layers: decoder layers (one KV cell per layer and KV head).
        q_heads: query heads per layer.
        kv_heads: KV heads per layer (``q_heads % kv_heads == 0``; GQA group ``q_heads //
            kv_heads``, transformers' ``repeat_kv`` layout).
        head_dim: per-head size ``d`` of keys, values and queries.
        dtype: the model's parameter dtype (the K/V dtype of the cache).
        scaling: the attention logit scale (``softmax(scaling * q.k)``), read from the
            attention modules (Gemma 3: ``query_pre_attn_scalar ** -0.5``), else ``d ** -0.5``.
        windows: per layer, the sliding window or None (:func:`layer_windows`).
        rope: per layer, the :class:`RopeSpec` (base and type).
        vocab_size: the vocabulary size (None if the config has none).
    """

    n_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scaling: float
    windows: tuple[int | None, ...]
    rope: tuple[RopeSpec, ...]
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if min(self.n_layers, self.q_heads, self.kv_heads, self.head_dim) <= 0 or self.q_heads % self.kv_heads:
            raise InputError("model", f"{self.q_heads} query / {self.kv_heads} KV heads of size {self.head_dim} "
                             f"in {self.n_layers} layers is not a decoder geometry", "use a multi-head/GQA decoder")
        if len(self.windows) != self.n_layers or len(self.rope) != self.n_layers:
            raise InputError("model", "windows and rope must have one entry per layer",
                             "build the geometry with model_geometry(model)")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.q_heads // self.kv_heads

    @property
    def cells(self) -> int:
        """KV cells per sequence: ``n_layers x kv_heads``."""
        return self.n_layers * self.kv_heads

    @property
    def dtype_bytes(self) -> int:
        """Bytes per K or V element."""
        import torch

        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_entry(self) -> int:
        """Bytes of one cached entry of one cell: K and V, ``2 x head_dim x dtype size``."""
        return 2 * self.head_dim * self.dtype_bytes

    def held_without_eviction(self, tokens: int) -> list[int]:
        """Per layer, the entries one cell holds after ``tokens`` tokens with no eviction:
        all of them on full-attention layers, the last ``window - 1`` on sliding ones (what
        transformers' ``DynamicSlidingWindowLayer`` keeps)."""
        return [min(tokens, w - 1) if w else tokens for w in self.windows]

    def full_cache_tokens(self, tokens: int) -> int:
        """Entries per sequence a cache without eviction holds after ``tokens`` tokens."""
        return self.kv_heads * sum(self.held_without_eviction(tokens))


def model_geometry(model: Any) -> ModelGeometry:
    """The :class:`ModelGeometry` of a transformers model (its text config and modules).

    Raises :class:`InputError` for attention kinds the eviction loop cannot make exact (see
    :func:`layer_windows`).
    """
    from evictlab.models.sites import attention_modules

    cfg = text_config(model)
    hq = cfg.num_attention_heads
    hk = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    n = cfg.num_hidden_layers
    windows = layer_windows(model)
    mods = attention_modules(model)
    scaling = float(mods[0].scaling) if mods else float(d) ** -0.5
    vocab = getattr(cfg, "vocab_size", None)
    return ModelGeometry(
        n_layers=int(n), q_heads=int(hq), kv_heads=int(hk), head_dim=int(d), dtype=next(model.parameters()).dtype,
        scaling=scaling, windows=tuple(windows), rope=_layer_ropes(cfg, n),
        vocab_size=None if vocab is None else int(vocab),
    )

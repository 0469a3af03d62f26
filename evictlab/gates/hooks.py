"""Attaching retention gates to a stock transformers model: forward pre-hooks, nothing else.

Both context managers register one forward pre-hook (``with_kwargs=True``) on every
attention module of :func:`evictlab.models.sites.find_attention_sites` and remove them in
``finally``; no forward is copied, nothing is patched globally and ``model.config`` is never
touched. The attention module's ``hidden_states`` argument IS the token's normed hidden
state (decoder layers apply their input layernorm right before calling attention), so the
gate reads exactly what the key and value projections read.

- :func:`gated_attention` (training): computes ``log beta`` ``(b, T, hk)`` for every token
  of the layer, stores it in ``record[layer]`` (for the capacity loss) and replaces the
  module's ``attention_mask`` by the model's own mask plus :func:`~evictlab.gates.loss.
  retention_bias` ``(t - i) log beta_i``, per KV head repeated over its query group:
  ``(b, q_heads, T, T)``. The eager and sdpa attention functions add a float mask to the
  scaled logits, so the bias reaches the softmax and gradients flow into the gates. A model
  that passes no mask (sdpa's ``is_causal`` path) gets the causal mask built here; a boolean
  mask (True = attend) is turned into 0 / dtype minimum. Runs without a KV cache only
  (``use_cache=False``: every key's ``log beta`` comes from this forward).
- :func:`recording_gates` (inference): under ``torch.no_grad`` calls
  ``on_log_beta(layer, log_beta)`` with ``(b, q_len, hk)`` for the tokens of each forward,
  before the layer appends them to its cache; the attention itself is untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from evictlab.errors import InputError
from evictlab.gates.loss import retention_bias
from evictlab.gates.modules import RetentionGates
from evictlab.models.sites import AttentionSite, find_attention_sites

__all__ = ["check_gates_fit", "gated_attention", "recording_gates"]


def check_gates_fit(model: torch.nn.Module, gates: RetentionGates, what: str = "gates") -> list[AttentionSite]:
    """The model's attention sites; :class:`InputError` (field ``what``) unless the gates'
    layers, KV heads and hidden size are the model's."""
    from evictlab.models.geometry import text_config

    sites = find_attention_sites(model)
    spec = gates.spec
    hidden = int(getattr(text_config(model), "hidden_size", spec.hidden_size))
    have = (len(sites), sites[0].n_kv_heads, hidden)
    want = (spec.n_layers, spec.kv_heads, spec.hidden_size)
    if have != want:
        raise InputError(what, f"the gates are for {want[0]} layers x {want[1]} KV heads of hidden size {want[2]}, "
                         f"the model has {have[0]} x {have[1]} of size {have[2]}",
                         "train gates for this model (evictlab gates train --model ...)")
    return sites


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _float_mask(mask: torch.Tensor | None, b: int, t: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The model's mask as an additive float ``(b, 1 or heads, T, T)`` mask (causal if None)."""
    if mask is None:
        pos = torch.arange(t, device=device)
        allowed = (pos[None, :] <= pos[:, None])[None, None]
        return torch.zeros(1, 1, t, t, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


@contextlib.contextmanager
def gated_attention(model: torch.nn.Module, gates: RetentionGates,
                    record: dict[int, torch.Tensor] | None = None) -> Iterator[dict[int, torch.Tensor]]:
    """Training-time gating: every attention logit gets ``(t - i) log beta_i`` (see the module
    docstring). Yields ``record``: ``{layer: (b, T, hk) log beta}`` of the last forward."""
    record = {} if record is None else record
    sites = check_gates_fit(model, gates)
    handles: list[Any] = []

    def make_hook(site: AttentionSite):  # noqa: ANN202 - closure over the site
        layer, n_rep = site.layer, site.n_q_heads // site.n_kv_heads

        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            hidden = _hidden(args, kwargs)
            b, t = hidden.shape[0], hidden.shape[1]
            mask = kwargs.get("attention_mask")
            if mask is not None and (mask.dim() != 4 or mask.shape[-1] != t or mask.shape[-2] != t):
                raise RuntimeError(f"layer {layer}: gated_attention needs a forward without a KV cache "
                                   f"(use_cache=False); got a mask of shape {tuple(mask.shape)} for {t} tokens")
            lb = gates.log_beta(layer, hidden)  # (b, T, hk) float32
            record[layer] = lb
            pos = torch.arange(t, device=hidden.device)
            bias = retention_bias(lb, pos, pos).repeat_interleave(n_rep, dim=1)  # (b, hq, T, T)
            base = _float_mask(mask, b, t, hidden.dtype, hidden.device)
            kwargs["attention_mask"] = (base.to(torch.float32) + bias).to(base.dtype)
            return args, kwargs

        return pre_hook

    try:
        for site in sites:
            handles.append(site.module.register_forward_pre_hook(make_hook(site), with_kwargs=True))
        yield record
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def recording_gates(model: torch.nn.Module, gates: RetentionGates,
                    on_log_beta: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """Inference: ``on_log_beta(layer, (b, q_len, hk) log beta)`` for every forward's tokens,
    called before the layer's attention (so before its cache appends them)."""
    sites = check_gates_fit(model, gates, "scorer_param")
    handles: list[Any] = []

    def make_hook(site: AttentionSite):  # noqa: ANN202 - closure over the site
        layer = site.layer

        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            with torch.no_grad():
                on_log_beta(layer, gates.log_beta(layer, _hidden(args, kwargs)))

        return pre_hook

    try:
        for site in sites:
            handles.append(site.module.register_forward_pre_hook(make_hook(site), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()

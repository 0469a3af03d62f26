"""Where hooks attach on a stock transformers model: its attention modules and their parts.

An attention module is found by structure, not by class name: a module with ``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``head_dim`` and ``scaling`` (every transformers
decoder we support: Llama, Qwen2/3, OLMo2, Gemma 3, Mistral, ...). :func:`find_attention_sites`
describes each one as an :class:`AttentionSite`: the submodule that produces the pre-RoPE
query / key (``q_norm`` / ``k_norm`` when the architecture has them, the last step before
RoPE in every supported family, else ``q_proj`` / ``k_proj``), ``v_proj``, ``o_proj``, the
modeling file's own ``apply_rotary_pos_emb`` (so hooks rotate exactly as the forward does),
and the head counts. Both capture (:mod:`evictlab.capture.hooks`) and the KV-cache glue
(:mod:`evictlab.kv.cache`) hook these sites; :func:`to_heads_layout` brings what a hooked
projection or norm produced to ``(batch, heads, seq, head_dim)``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from evictlab.errors import InputError

__all__ = ["AttentionSite", "attention_modules", "find_attention_sites", "to_heads_layout"]

_ATTENTION_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")


@dataclass
class AttentionSite:
    """One attention module and the submodules the hooks attach to."""

    layer: int
    name: str
    module: nn.Module
    q_src: nn.Module
    k_src: nn.Module
    v_src: nn.Module
    o_proj: nn.Module
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Every attention module of ``model`` (found by structure), in layer order
    (``layer_idx`` where the module has one, else the order of ``named_modules``)."""
    found = [m for m in model.modules() if all(hasattr(m, a) for a in _ATTENTION_ATTRS)]

    def layer(i: int) -> int:
        idx = getattr(found[i], "layer_idx", None)
        return i if idx is None else int(idx)

    return [found[i] for i in sorted(range(len(found)), key=layer)]


def find_attention_sites(model: nn.Module) -> list[AttentionSite]:
    """Every attention module of ``model`` in layer order, with its hook points.

    Raises InputError naming what is missing for architectures we cannot hook exactly.
    """
    sites: list[AttentionSite] = []
    names = {id(m): n for n, m in model.named_modules()}
    for mod in attention_modules(model):
        cls = type(mod).__name__
        rope = getattr(sys.modules.get(type(mod).__module__), "apply_rotary_pos_emb", None)
        if rope is None:
            raise InputError("--model", f"attention class {cls} has no apply_rotary_pos_emb in its "
                             "modeling file, so post-RoPE vectors cannot be rebuilt exactly",
                             "use a RoPE decoder (Llama, Qwen2/3, OLMo2, Gemma 3, Mistral, ...)")
        if getattr(mod, "is_causal", True) is not True:
            raise InputError("--model", f"{cls} is not causal (bidirectional attention)",
                             "capture needs a causal decoder")
        head_dim = int(mod.head_dim)
        q_out = int(mod.q_proj.out_features)
        k_out = int(mod.k_proj.out_features)
        n_q, n_kv = q_out // head_dim, k_out // head_dim
        if n_q * head_dim != q_out or n_kv * head_dim != k_out or n_q % n_kv:
            raise InputError("--model", f"{cls}: projection sizes {q_out}/{k_out} do not split "
                             f"into heads of {head_dim}", "use a standard multi-head/GQA model")
        q_norm = getattr(mod, "q_norm", None)
        k_norm = getattr(mod, "k_norm", None)
        sw = getattr(mod, "sliding_window", None)
        layer = getattr(mod, "layer_idx", None)
        sites.append(AttentionSite(
            layer=int(layer) if layer is not None else len(sites), name=names[id(mod)], module=mod,
            q_src=q_norm if isinstance(q_norm, nn.Module) else mod.q_proj,
            k_src=k_norm if isinstance(k_norm, nn.Module) else mod.k_proj,
            v_src=mod.v_proj, o_proj=mod.o_proj, rope=rope, n_q_heads=n_q, n_kv_heads=n_kv,
            head_dim=head_dim, scaling=float(mod.scaling),
            sliding_window=int(sw) if sw else None,
        ))
    if not sites:
        raise InputError("--model", f"no attention modules with q_proj/k_proj/v_proj/o_proj found "
                         f"in {type(model).__name__}", "use a Hugging Face decoder-only causal LM")
    return sites


def to_heads_layout(x: torch.Tensor, inp: torch.Tensor, n_heads: int, d: int) -> torch.Tensor:
    """Bring a recorded projection/norm output to ``(B, H, L, d)``.

    ``x`` is ``(B, L, H*d)`` (projection, or OLMo2's whole-projection norm) or 4-D
    (per-head norm) in either ``(B, H, L, d)`` (Gemma 3: norm after the transpose) or
    ``(B, L, H, d)`` (norm before it) layout. The layout of a 4-D output is read from its
    input's strides (the input is a view of the contiguous ``(B, L, H*d)`` projection,
    so the token axis has stride ``H*d`` and the head axis stride ``d``): unambiguous even
    when L == H.
    """
    if x.dim() == 3:
        B, L, _ = x.shape
        return x.view(B, L, n_heads, d).transpose(1, 2)
    if x.dim() != 4:
        raise InputError("--model", f"unexpected projection output of shape {tuple(x.shape)}",
                         "use a standard decoder attention module")
    heads_first = x.shape[1] == n_heads and (x.shape[2] != n_heads or inp.stride(1) < inp.stride(2))
    return x if heads_first else x.transpose(1, 2)

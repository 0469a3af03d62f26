"""Record post-RoPE queries, keys and values from stock transformers attention modules.

:class:`AttentionCapture` is a context manager that registers PyTorch hooks on every
attention module of a model (found by structure: a module with ``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``head_dim`` and ``scaling``) and removes every handle in
``finally``. Nothing is patched: no copied forward, no global attention function, no
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
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from evictlab.errors import EvictlabError, InputError


class CaptureMismatchError(EvictlabError, RuntimeError):
    """Captured rows do not reproduce the attention module's own output (unsupported model)."""


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


def find_attention_sites(model: nn.Module) -> list[AttentionSite]:
    """Every attention module of ``model`` in layer order, with its hook points.

    Raises InputError naming what is missing for architectures we cannot hook exactly.
    """
    sites: list[AttentionSite] = []
    for name, mod in model.named_modules():
        if not all(hasattr(mod, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            continue
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
            layer=int(layer) if layer is not None else len(sites), name=name, module=mod,
            q_src=q_norm if isinstance(q_norm, nn.Module) else mod.q_proj,
            k_src=k_norm if isinstance(k_norm, nn.Module) else mod.k_proj,
            v_src=mod.v_proj, o_proj=mod.o_proj, rope=rope, n_q_heads=n_q, n_kv_heads=n_kv,
            head_dim=head_dim, scaling=float(mod.scaling),
            sliding_window=int(sw) if sw else None,
        ))
    if not sites:
        raise InputError("--model", f"no attention modules with q_proj/k_proj/v_proj/o_proj found "
                         f"in {type(model).__name__}", "use a Hugging Face decoder-only causal LM")
    sites.sort(key=lambda s: s.layer)
    return sites


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


def _to_bhld(x: torch.Tensor, inp: torch.Tensor, n_heads: int, d: int) -> torch.Tensor:
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
            st.q = _to_bhld(out, inputs[0], site.n_q_heads, site.head_dim)

        def on_k(mod: nn.Module, inputs: tuple[Any, ...], out: torch.Tensor) -> None:
            st.k = _to_bhld(out, inputs[0], site.n_kv_heads, site.head_dim)

        def on_v(mod: nn.Module, inputs: tuple[Any, ...], out: torch.Tensor) -> None:
            st.v = _to_bhld(out, inputs[0], site.n_kv_heads, site.head_dim)

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

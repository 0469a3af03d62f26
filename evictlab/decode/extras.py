"""The decode loop's extras for two kinds of scorers: KVzip-style reconstruction passes and
the labelled oracle's true future queries.

A scorer whose ``needs`` include ``"reconstruction"`` gets, before each compression, the
queries of a pass that re-feeds the context after its own prompt (:func:`recon_ids`); one
whose ``needs`` include ``"future"`` gets the queries the model will really issue
(:func:`oracle_queries`, teacher-forced runs only).
"""

from __future__ import annotations

from typing import Any

import torch

from evictlab.errors import InputError
from evictlab.kv.cache import EvictionCache, attach
from evictlab.kv.masked import MaskedKVStore
from evictlab.models.geometry import ModelGeometry, model_geometry


def oracle_queries(model: torch.nn.Module, ids: torch.Tensor, n_future: int) -> dict[int, torch.Tensor]:
    """True future queries (labelled oracle): the last ``n_future`` positions of a dense pass."""
    g = model_geometry(model)
    store = MaskedKVStore(g.n_layers, ids.shape[0], g.kv_heads, g.head_dim, dtype=g.dtype, device=ids.device,
                          initial_capacity=ids.shape[1])
    cache = EvictionCache(store)
    cache.query_window = n_future
    with attach(model, cache, g.windows):
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return {l: cache.queries[l][0] for l in range(g.n_layers)}


def tokens_out_tensor(tokens: list[torch.Tensor], window: int) -> torch.Tensor:
    """The last ``window`` decoded tokens as ``(batch, <=window)`` (for a reconstruction pass)."""
    return torch.stack(tokens[-window:], 1)


class PromptEncoder:
    """``encode(text, add_special_tokens=...)`` over any tokenizer the loop accepts: a Hugging
    Face tokenizer, a callable stand-in (``ByteTokenizer``), or ``None`` (byte vocabulary)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        from evictlab.tasks.examples import encode_text

        return encode_text(self.tokenizer, text, special=add_special_tokens)


def check_recon_tokenizer(geometry: ModelGeometry, scorer: Any, tokenizer: Any) -> None:
    """Without a tokenizer the reconstruction prompt is UTF-8 bytes: only right for a byte vocab."""
    if tokenizer is not None or getattr(scorer, "reconstruction_ids", None) is None:
        return
    if geometry.vocab_size != 256:
        raise InputError("tokenizer", f"{getattr(scorer, 'name', 'the scorer')}'s reconstruction prompt needs the "
                         f"model's tokenizer (None means the 256-token byte vocabulary of the tiny test models, "
                         f"this model has {geometry.vocab_size or '?'} tokens)",
                         "pass tokenizer=... to run_sequence / run_audit")


def recon_ids(scorer: Any, chunk: torch.Tensor, tokenizer: Any) -> torch.Tensor:
    """Token ids ``(batch, p + n)`` of a reconstruction pass over ``chunk`` ``(batch, n)``.

    A scorer with ``reconstruction_ids(chunk, tokenizer)`` (KVzip: its "repeat the previous
    context" prompt, then the chunk) builds them, with the prompt tokenised by ``tokenizer``
    (``None``: UTF-8 bytes, the tiny models' vocabulary); otherwise the chunk alone is re-fed.
    """
    build = getattr(scorer, "reconstruction_ids", None)
    if build is None:
        return chunk
    return build(chunk, PromptEncoder(tokenizer))

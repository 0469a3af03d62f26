"""The full cache's bytes are what a cache without eviction holds at the end (issue 28,
item 10): the masked store, which frees nothing, used to report one entry per cell fewer
(90 x 512 B on SmolLM2) than ``bytes_full_cache``, which counted the last answer token that
is never fed. The arithmetic on a tiny model, against the stock cache's own length."""

from __future__ import annotations

import pytest
import torch

from evictlab.capture.testing import tiny_model
from evictlab.decode.config import DecodeConfig
from evictlab.decode.loop import run_sequence
from evictlab.kv.budget import Budget, kv_bytes
from evictlab.kv.cache import register_ragged_attention
from evictlab.models.geometry import model_geometry


@pytest.mark.parametrize("teacher_forced", [True, False])
def test_masked_store_holds_exactly_the_full_cache(teacher_forced: bool) -> None:
    model, _ = tiny_model("llama", attn_implementation=register_ragged_attention())
    g = model_geometry(model)
    gen = torch.Generator().manual_seed(0)
    ctx, q, ans = (torch.randint(3, 256, (1, k), generator=gen) for k in (100, 7, 5))
    kw = {"answer_ids": ans} if teacher_forced else {"max_new_tokens": 5}
    base = dict(budget=Budget.parse("24"), scorer="snapkv", sinks=2, recent=4, chunk_size=32)
    masked = run_sequence(model, ctx, q, DecodeConfig.of(mode="masked", **base), **kw)
    fed = 100 + 7 + 5 - 1  # the last decode token's logits are the last output: it is never fed
    assert masked.bytes_full_cache == kv_bytes(fed * g.cells, g.head_dim, g.dtype)
    assert masked.peak("bytes_live") == masked.bytes_full_cache  # masking frees nothing
    full = run_sequence(model, ctx, q, DecodeConfig.of(mode="full", chunk_size=32), **kw)
    assert full.bytes_full_cache == masked.bytes_full_cache
    # the stock cache of the same run holds exactly `fed` entries per cell
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.cat([ctx, q, ans[:, :-1]], 1), cache=cache, use_cache=True)
    assert cache.get_seq_length() == fed

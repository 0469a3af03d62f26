"""The decode loop end to end on the tiny model: budgets, modes, determinism, batching."""

from __future__ import annotations

import pytest
import torch

from evictlab.capture.testing import tiny_model
from evictlab.decode.config import DecodeConfig
from evictlab.decode.loop import run_sequence
from evictlab.errors import BudgetExceededError, InputError
from evictlab.kv.budget import Budget, kv_bytes
from evictlab.kv.paged import PagedKVStore


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)  # far faster than 2 threads on a shared 2-core machine
    model, _ = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(3, 256, (2, 200), generator=g)
    q = torch.randint(3, 256, (2, 6), generator=g)
    a = torch.randint(3, 256, (2, 20), generator=g)
    full = run_sequence(model, ctx, q, DecodeConfig.of(mode="full", chunk_size=64), answer_ids=a)
    return model, ctx, q, a, full


def _cfg(**kw) -> DecodeConfig:
    base = dict(mode="physical", budget=Budget("tokens_per_cell", 40), scorer="streaming_llm", allocator="uniform",
                chunk_size=48, compress_every=8, block_size=8, sinks=2, recent=8)
    base.update(kw)
    return DecodeConfig.of(**base)


def test_large_budget_equals_full_cache(setup) -> None:
    model, ctx, q, a, full = setup
    out = run_sequence(model, ctx, q, _cfg(budget=Budget("tokens_per_cell", 1000)), answer_ids=a)
    assert out.compressions == 0
    torch.testing.assert_close(out.logits, full.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("allocator", ["uniform", "pyramidkv", "adakv"])
def test_physical_and_masked_agree_and_only_physical_frees(setup, allocator: str) -> None:
    model, ctx, q, a, full = setup
    phys = run_sequence(model, ctx, q, _cfg(allocator=allocator), answer_ids=a)
    mask = run_sequence(model, ctx, q, _cfg(mode="masked", allocator=allocator), answer_ids=a)
    torch.testing.assert_close(phys.logits, mask.logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(phys.logits, full.logits, atol=1e-3)  # eviction changed something
    budget_tokens = 40 * 2 * 2
    per_entry = kv_bytes(1, 16, torch.float32)
    # After every compression the physical store holds at most the budget (x batch 2)...
    assert phys.after_compression("bytes_live") <= 2 * budget_tokens * per_entry
    assert phys.after_compression("live_tokens") == 2 * budget_tokens
    # ...while the masked store still holds every entry appended so far.
    assert mask.after_compression("bytes_live") > 4 * phys.after_compression("bytes_live")
    assert mask.after_compression("live_tokens") == 2 * budget_tokens
    # Peak physical allocation is bounded by budget + one chunk per cell (+ page slack).
    cells = 2 * 2 * 2
    bound = (2 * budget_tokens + cells * (48 + 2 * 8)) * per_entry
    assert phys.peak("bytes_allocated") <= bound < phys.bytes_full_cache


def test_deterministic(setup) -> None:
    model, ctx, q, a, _ = setup
    r1 = run_sequence(model, ctx, q, _cfg(allocator="adakv"), answer_ids=a)
    r2 = run_sequence(model, ctx, q, _cfg(allocator="adakv"), answer_ids=a)
    assert torch.equal(r1.logits, r2.logits)
    assert [t.report for t in r1.trace] == [t.report for t in r2.trace]


def test_batch_items_are_independent(setup) -> None:
    model, ctx, q, a, _ = setup
    both = run_sequence(model, ctx, q, _cfg(), answer_ids=a)
    one = run_sequence(model, ctx[1:], q[1:], _cfg(), answer_ids=a[1:])
    torch.testing.assert_close(both.logits[1:], one.logits, rtol=1e-4, atol=1e-4)


def test_greedy_decoding_and_decode_time_compression(setup) -> None:
    model, ctx, q, _, _ = setup
    out = run_sequence(model, ctx, q, _cfg(compress_every=4), max_new_tokens=13)
    assert out.tokens.shape == (2, 13)
    assert torch.equal(out.tokens, out.logits.argmax(-1))
    phases = [t.phase for t in out.trace]
    assert phases.count("compress") > (200 // 48)  # prefill chunks + decode compressions


def test_query_agnostic_ranking_never_sees_the_question(setup) -> None:
    """Changing the question must not change which context entries are kept, unless the
    labelled query-aware option lets the ranking see it."""
    model, ctx, q, a, _ = setup
    q2 = torch.flip(q, [1])
    kept = {}
    for aware in (False, True):
        for name, question in (("q", q), ("q2", q2)):
            out = run_sequence(model, ctx, question, _cfg(scorer="snapkv", allocator="adakv", query_aware=aware),
                               answer_ids=a[:, :1])
            kept[(aware, name)] = out.context_kept
    for l1, l2 in zip(kept[(False, "q")], kept[(False, "q2")]):
        assert torch.equal(l1, l2)
    assert any(not torch.equal(l1, l2) for l1, l2 in zip(kept[(True, "q")], kept[(True, "q2")]))


def test_budget_below_floor_raises(setup) -> None:
    model, ctx, q, a, _ = setup
    with pytest.raises(InputError):
        run_sequence(model, ctx, q, _cfg(budget=Budget("tokens_per_cell", 5)), answer_ids=a)


def test_pool_exhaustion_raises_instead_of_growing() -> None:
    store = PagedKVStore(1, 1, 1, 4, capacity_blocks=2, block_size=2)
    store.append_gather(0, torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4), torch.arange(4))
    with pytest.raises(BudgetExceededError):
        store.append_gather(0, torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), torch.tensor([4]))



def _page_slack(cells: int, block_size: int, per_entry: int) -> int:
    """One partial page per cell plus the paged pool's null block."""
    return (cells + 1) * block_size * per_entry


@pytest.mark.parametrize("budget", [Budget("tokens_per_cell", 1000), Budget("bytes", 2 << 30)])
def test_budget_above_the_full_cache_allocates_no_more_than_it(setup, budget: Budget) -> None:
    """A budget above what the run can hold: nothing evicted, said so, and the pool is the
    full cache plus page slack (it used to be sized by the budget: 2 GiB for 2GiB)."""
    model, ctx, q, a, full = setup
    out = run_sequence(model, ctx, q, _cfg(budget=budget), answer_ids=a)
    assert out.compressions == 0
    torch.testing.assert_close(out.logits, full.logits, rtol=1e-4, atol=1e-4)
    # per sequence: every token fed (all but the last answer token) in each of 2 layers x 2 KV heads
    full_tokens = (200 + 6 + 20 - 1) * 2 * 2
    assert out.budget_effective_tokens == full_tokens < out.budget_tokens
    per_entry = kv_bytes(1, 16, torch.float32)
    assert out.bytes_full_cache == 2 * full_tokens * per_entry
    assert out.peak("bytes_allocated") <= out.bytes_full_cache + _page_slack(2 * 2 * 2, 8, per_entry)


def test_prefill_headroom_is_what_is_fed_not_the_chunk_option(setup) -> None:
    """--chunk 2048 on a 200-token context: the headroom is the 200 tokens fed, so the pool
    stays below the full cache plus page slack (it used to hold budget + 2048 per cell)."""
    model, ctx, q, a, _ = setup
    out = run_sequence(model, ctx, q, _cfg(chunk_size=2048), answer_ids=a)
    assert out.compressions >= 1 and out.budget_effective_tokens == out.budget_tokens == 40 * 4
    per_entry = kv_bytes(1, 16, torch.float32)
    assert out.peak("bytes_allocated") <= out.bytes_full_cache + _page_slack(2 * 2 * 2, 8, per_entry)
    assert out.peak("live_tokens") == 2 * 200 * 4  # the whole context was held once, as fed


def test_pool_after_prefill_is_budget_plus_decode_headroom(setup) -> None:
    """After the context the pool drops its prefill headroom: budget + one partial page per
    cell + (question + compress_every) per cell, in whole pages."""
    model, ctx, q, a, _ = setup
    out = run_sequence(model, ctx, q, _cfg(), answer_ids=a)
    resize = [t for t in out.trace if t.phase == "resize"]
    assert len(resize) == 1
    cells, bs, per_entry = 2 * 2 * 2, 8, kv_bytes(1, 16, torch.float32)
    blocks = -(-2 * 40 * 4 // bs) + cells + cells * -(-(6 + 8) // bs)
    assert resize[0].report.bytes_allocated == (blocks + 1) * bs * per_entry

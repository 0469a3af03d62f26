"""The paged (physical) and masked stores: contents, compaction, byte accounting, budgets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from evictlab.errors import BudgetExceededError, InputError
from evictlab.kv.blocks import BlockPool
from evictlab.kv.budget import Budget, kv_bytes
from evictlab.kv.masked import MaskedKVStore
from evictlab.kv.paged import PagedKVStore

L, B, H, D = 2, 2, 3, 8


def _paged(blocks: int = 64, bs: int = 4) -> PagedKVStore:
    return PagedKVStore(L, B, H, D, capacity_blocks=blocks, block_size=bs)


def _fill(store, n: int, seed: int = 0, chunk: int = 5) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Append n tokens per layer in chunks; return the dense reference K/V per layer."""
    g = torch.Generator().manual_seed(seed)
    ref = {}
    for l in range(L):
        k = torch.randn(B, H, n, D, generator=g)
        v = torch.randn(B, H, n, D, generator=g)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            store.append_gather(l, k[:, :, s:e], v[:, :, s:e], torch.arange(s, e))
        ref[l] = (k, v)
    return ref


def _random_keep(n_per_cell: np.ndarray, rng: np.random.Generator) -> list[list[torch.Tensor]]:
    return [[torch.from_numpy(np.sort(rng.choice(int(n), size=int(rng.integers(1, n + 1)), replace=False)))
             for n in row] for row in n_per_cell]


@pytest.mark.parametrize("store_kind", ["paged", "masked"])
def test_gather_matches_reference_after_random_evictions(store_kind: str) -> None:
    store = _paged(blocks=128) if store_kind == "paged" else MaskedKVStore(L, B, H, D, initial_capacity=4)
    ref = _fill(store, 23)
    rng = np.random.default_rng(1)
    # Reference: per cell, list of original token indices still live.
    live = {(l, b, h): np.arange(23) for l in range(L) for b in range(B) for h in range(H)}
    for _round in range(3):
        for l in range(L):
            lens = store.lengths(l).numpy()
            keep = _random_keep(lens, rng)
            store.keep(l, keep)
            for b in range(B):
                for h in range(H):
                    live[(l, b, h)] = live[(l, b, h)][keep[b][h].numpy()]
    for l in range(L):
        k, v, pos = store.gather(l)
        for b in range(B):
            for h in range(H):
                idx = live[(l, b, h)]
                n = idx.size
                assert int(store.lengths(l)[b, h]) == n
                torch.testing.assert_close(k[b, h, :n], ref[l][0][b, h, idx], rtol=0, atol=0)
                torch.testing.assert_close(v[b, h, :n], ref[l][1][b, h, idx], rtol=0, atol=0)
                assert pos[b, h, :n].tolist() == idx.tolist()
                assert (pos[b, h, n:] == -1).all()


def test_paged_frees_blocks_and_accounts_bytes_exactly() -> None:
    bs = 4
    store = _paged(blocks=64, bs=bs)
    _fill(store, 10)
    rep = store.bytes()
    per_entry = kv_bytes(1, D, torch.float32)
    assert rep.live_tokens == rep.held_tokens == L * B * H * 10
    assert rep.bytes_live == L * B * H * 10 * per_entry
    # 10 tokens -> 3 blocks of 4 per cell: page slack is counted in bytes_in_use.
    assert store.blocks_in_use == L * B * H * 3
    assert rep.bytes_in_use == L * B * H * 3 * bs * per_entry
    assert rep.bytes_allocated == (64 + 1) * bs * per_entry  # + the null block
    assert rep.bytes_index > 0
    # Ragged per-head eviction: head h keeps h+1 entries in every layer and batch item.
    for l in range(L):
        store.keep(l, [[torch.arange(h + 1) for h in range(H)] for _ in range(B)])
    rep = store.bytes()
    kept = L * B * sum(h + 1 for h in range(H))
    assert rep.live_tokens == kept and rep.bytes_live == kept * per_entry
    assert store.blocks_in_use == L * B * H  # every cell fits in one block now
    assert store.block_table.shape == (L, B, H, 3)
    assert (store.block_table[..., 1:] == -1).all()
    # Shrinking the pool keeps contents and reports the smaller allocation.
    before = [store.gather(l) for l in range(L)]
    store.resize(store.blocks_in_use + 2)
    assert store.bytes().bytes_allocated == (L * B * H + 2 + 1) * bs * per_entry
    for l in range(L):
        for a, b in zip(before[l], store.gather(l)):
            assert torch.equal(a, b)


def test_masked_store_holds_full_cache_bytes() -> None:
    store = MaskedKVStore(L, B, H, D, initial_capacity=4)
    _fill(store, 12)
    for l in range(L):
        store.keep(l, [[torch.tensor([0, 11]) for _ in range(H)] for _ in range(B)])
    rep = store.bytes()
    per_entry = kv_bytes(1, D, torch.float32)
    assert rep.live_tokens == L * B * H * 2
    assert rep.held_tokens == L * B * H * 12  # masking frees nothing
    assert rep.bytes_live == L * B * H * 12 * per_entry
    assert rep.bytes_allocated >= rep.bytes_live


def test_paged_append_over_capacity_raises_and_changes_nothing() -> None:
    store = _paged(blocks=L * B * H * 2, bs=4)
    _fill(store, 8)  # exactly full
    before = store.bytes()
    with pytest.raises(BudgetExceededError):
        store.append_gather(0, torch.zeros(B, H, 1, D), torch.zeros(B, H, 1, D), torch.tensor([8]))
    assert store.bytes() == before
    assert int(store.lengths(0).sum()) == B * H * 8


def test_keep_rejects_unsorted_or_out_of_range() -> None:
    store = _paged()
    _fill(store, 6)
    bad = [[torch.tensor([3, 1]) for _ in range(H)] for _ in range(B)]
    with pytest.raises(InputError):
        store.keep(0, bad)
    with pytest.raises(InputError):
        store.keep(0, [[torch.tensor([0, 6]) for _ in range(H)] for _ in range(B)])


def test_layout_positions_predicts_append_gather() -> None:
    for store in (_paged(), MaskedKVStore(L, B, H, D, initial_capacity=4)):
        _fill(store, 9)
        store.keep(0, [[torch.arange(0, 9, h + 1) for h in range(H)] for _ in range(B)])
        new = torch.arange(9, 12)
        planned = store.layout_positions(0, new)
        k, _ = store.append_gather(0, torch.randn(B, H, 3, D), torch.randn(B, H, 3, D), new)
        assert planned.shape[-1] == k.shape[2]
        if isinstance(store, PagedKVStore):
            assert torch.equal(planned, store.gather(0)[2])
        else:  # masked: evicted slots are -1, every slot still present
            assert planned.shape[-1] == 12 and int((planned >= 0).sum()) == int(store.lengths(0).sum())


def test_budget_units_and_parse() -> None:
    assert Budget("tokens_per_cell", 16).total_tokens(30, 3, 64, torch.float32) == 16 * 90
    assert Budget("total_tokens", 1000).total_tokens(30, 3, 64, torch.float32) == 1000
    assert Budget("bytes", 512 * 10 + 7).total_tokens(30, 3, 64, torch.float32) == 10
    assert Budget.parse("128") == Budget("tokens_per_cell", 128)
    assert Budget.parse("4096total") == Budget("total_tokens", 4096)
    assert Budget.parse("2MiB") == Budget("bytes", 2 << 20)
    with pytest.raises(InputError):
        Budget.parse("lots")
    with pytest.raises(InputError):
        Budget("tokens_per_cell", 0)
    with pytest.raises(InputError):
        Budget("bytes", 100).total_tokens(1, 1, 64, torch.float32)


def test_for_budget_sizes_in_tokens_and_caps_by_what_can_be_held() -> None:
    from evictlab.models.geometry import ModelGeometry, RopeSpec

    g = ModelGeometry(n_layers=3, q_heads=4, kv_heads=2, head_dim=8, dtype=torch.float32, scaling=8 ** -0.5,
                      windows=(None, None, 5), rope=(RopeSpec(1e4),) * 3)
    cells = 3 * 2 * 2  # batch 2
    store = PagedKVStore.for_budget(g, 2, kept_tokens=50, headroom_tokens_per_cell=10, block_size=4)
    assert store.capacity_blocks == -(-100 // 4) + cells + cells * 3
    # What can be held is less: 20 tokens per full-layer cell, 6 on the sliding layer.
    capped = PagedKVStore.for_budget(g, 2, kept_tokens=50, headroom_tokens_per_cell=10, block_size=4,
                                     max_cell_tokens=[20, 20, 6])
    assert capped.capacity_blocks == 2 * 2 * (5 + 5 + 2)
    huge = PagedKVStore.for_budget(g, 2, kept_tokens=10**9, headroom_tokens_per_cell=10**6, block_size=4,
                                   max_cell_tokens=[20, 20, 6])
    assert huge.capacity_blocks == capped.capacity_blocks
    # reserve_headroom: the budget plus a new headroom, never below the blocks in use.
    k = torch.randn(2, 2, 9, 8)
    for layer in range(3):
        store.append(layer, k, k, torch.arange(9))
    in_use = store.blocks_in_use
    store.reserve_headroom(1)
    assert store.capacity_blocks == max(in_use, -(-100 // 4) + cells) + cells
    assert store.blocks_in_use == in_use and store.cell_len.sum() == 3 * 2 * 2 * 9
    with pytest.raises(InputError):
        PagedKVStore(1, 1, 1, 4, capacity_blocks=4).reserve_headroom(1)
    with pytest.raises(InputError):
        PagedKVStore.for_budget(g, 1, kept_tokens=10, headroom_tokens_per_cell=1, max_cell_tokens=[1, 2])


def test_block_pool_takes_the_wanted_block_else_the_lowest_free_and_never_grows() -> None:
    pool = BlockPool(4, 2, 3, torch.float32, torch.device("cpu"))
    assert pool.kv.shape == (2, 5, 2, 3) and pool.pos.shape == (5, 2)  # + the null block
    assert pool.null_block == 4
    assert pool.take(2) == 2
    assert pool.take(2) == 0  # taken: the lowest free one
    assert pool.take(-1) == 1  # no wish
    assert pool.take(9) == 3  # outside the pool
    assert pool.in_use == 4
    with pytest.raises(BudgetExceededError, match="pool is full"):
        pool.take(0)
    pool.release(1)
    assert pool.take(3) == 1
    pool.kv[:, 2] = 7.0
    pool.pos[2] = torch.tensor([5, 6])
    pool.reallocate(6, np.array([2]), np.array([5]))  # only block 2 survives, as block 5
    assert pool.capacity == 6 and pool.in_use == 1 and pool.kv.shape == (2, 7, 2, 3)
    assert bool((pool.kv[:, 5] == 7.0).all())
    assert pool.pos[5].tolist() == [5, 6]
    assert int((pool.pos >= 0).sum()) == 2  # every other slot empty
    assert pool.take(5) == 0

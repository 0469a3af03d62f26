"""Retention gates: shapes and sharing, the capacity loss by hand, the training bias equals
eviction in the limit beta -> {0, 1}, and the log-beta side table follows the paged store."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from evictlab.capture.testing import tiny_model
from evictlab.errors import InputError
from evictlab.gates.hooks import gated_attention, recording_gates
from evictlab.gates.loss import capacity_loss, distillation_terms, retained_mass, retention_bias
from evictlab.gates.modules import GateSpec, RetentionGates
from evictlab.gates.side import LogBetaTable


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # far faster than 2 threads on a shared 2-core machine


def test_gate_shapes_and_initial_retention() -> None:
    spec = GateSpec(n_layers=3, hidden_size=16, kv_heads=2, intermediate=8, bias_init=8.0)
    gates = RetentionGates(spec, seed=1)
    x = torch.randn(2, 5, 16)
    lb = gates.log_beta(1, x)
    assert lb.shape == (2, 5, 2) and lb.dtype == torch.float32
    assert (lb < 0).all()
    # beta starts near 1: logit 8 +- the tiny random part
    torch.testing.assert_close(lb.exp(), torch.full_like(lb, 1 / (1 + math.exp(-8))), atol=2e-4, rtol=0)
    # log-space: beta so close to 1 that log(sigmoid) in float32 would round to 0, logsigmoid does not
    with torch.no_grad():
        huge = RetentionGates(GateSpec(1, 4, 1, intermediate=2, bias_init=40.0)).log_beta(0, torch.zeros(1, 1, 4))
    assert float(torch.log(torch.sigmoid(torch.tensor(40.0)))) == 0.0
    assert float(huge) < 0 and float(huge) == pytest.approx(-math.exp(-40), rel=1e-3)
    assert torch.equal(RetentionGates(spec, seed=1).log_beta(1, x), lb)  # seeded: same gates
    with pytest.raises(InputError, match="width 7"):
        gates.log_beta(0, torch.randn(1, 2, 7))


def test_shared_projection_is_one_object_and_local_is_not() -> None:
    shared = RetentionGates(GateSpec(n_layers=4, hidden_size=8, kv_heads=2, intermediate=4))
    ids = {id(shared.projection_of(l)) for l in range(4)}
    assert len(ids) == 1 and shared.projection_of(0) is shared.projection
    assert {n for n, _ in shared.named_parameters() if "proj" in n} == {"projection.weight", "projection.bias"}
    local = RetentionGates(GateSpec(n_layers=4, hidden_size=8, kv_heads=2, intermediate=4, shared=False))
    assert len({id(local.projection_of(l)) for l in range(4)}) == 4
    n_shared = sum(p.numel() for p in shared.parameters())
    n_local = sum(p.numel() for p in local.parameters())
    assert n_local - n_shared == 3 * (2 * 4 + 2)
    # a change to the shared projection moves every layer's output; a local one moves one layer's
    x = torch.randn(1, 3, 8)
    before = [shared.log_beta(l, x) for l in range(4)]
    with torch.no_grad():
        shared.projection.bias += 1.0
        local.projections[2].bias += 1.0
    assert all(not torch.equal(shared.log_beta(l, x), before[l]) for l in range(4))
    local_before = RetentionGates(GateSpec(n_layers=4, hidden_size=8, kv_heads=2, intermediate=4, shared=False))
    changed = [not torch.equal(local.log_beta(l, x), local_before.log_beta(l, x)) for l in range(4)]
    assert changed == [False, False, True, False]


# ---------------------------------------------------------------- losses


def test_capacity_loss_by_hand() -> None:
    # One layer, one head, beta = 1/2 for every token: S_0 = 1, S_1 = 1.5, S_2 = 1.75.
    lb = torch.full((1, 3, 1), math.log(0.5))
    torch.testing.assert_close(retained_mass([lb]), torch.tensor([[1.0, 1.5, 1.75]]))
    # M = 1: C_t = 1, 2, 3; t = 0 cannot overshoot; terms 0.5/1 and 0.75/2.
    assert float(capacity_loss([lb], 1.0)) == pytest.approx((0.5 + 0.375) / 2)
    # Two layers x two heads with different betas per token (a hand table).
    b = torch.tensor([[[0.5, 1.0], [0.25, 0.5]]])  # (1, T=2, hk=2)
    l0, l1 = b.log(), torch.full((1, 2, 2), math.log(0.1))
    s = retained_mass([l0, l1])
    # t=0: every key at age 0 -> 4 entries. t=1: layer 0: (0.5 + 1) + (1.0 + 1); layer 1: 2 x (0.1 + 1)
    torch.testing.assert_close(s, torch.tensor([[4.0, 3.5 + 2.2]]))
    # M = 3: C_0 = 4 (range 1, overshoot 1), C_1 = 8 (range 5, overshoot 2.7)
    assert float(capacity_loss([l0, l1], 3.0)) == pytest.approx((1.0 + 2.7 / 5) / 2)
    # Within budget: zero loss; budget above every C_t: zero loss with a graph.
    assert float(capacity_loss([l0, l1], 7.0)) == 0.0
    z = capacity_loss([l0.requires_grad_()], 100.0)
    assert float(z.detach()) == 0.0 and z.requires_grad
    # Padding: the second sequence is 2 long; its step 2 is left out of the mean.
    lb2 = torch.full((2, 3, 1), math.log(0.5))
    padded = capacity_loss([lb2], 1.0, torch.tensor([3, 2]))
    assert float(padded) == pytest.approx((0.5 + 0.375 + 0.5) / 3)


def test_retained_mass_matches_a_loop() -> None:
    g = torch.Generator().manual_seed(3)
    lbs = [-torch.rand(2, 7, 3, generator=g) for _ in range(2)]
    ref = torch.zeros(2, 7, dtype=torch.float64)
    for lb in lbs:
        for b in range(2):
            for t in range(7):
                for j in range(t + 1):
                    ref[b, t] += torch.exp((t - j) * lb[b, j].double()).sum()
    torch.testing.assert_close(retained_mass(lbs).double(), ref, rtol=1e-5, atol=1e-5)


def test_retention_bias_values_and_limits() -> None:
    lb = torch.tensor([[[-0.5], [float("-inf")], [0.0]]])  # (1, 3, 1)
    pos = torch.arange(3)
    bias = retention_bias(lb, pos, pos)[0, 0]
    expected = torch.tensor([[0.0, 0.0, 0.0], [-0.5, 0.0, 0.0], [-1.0, float("-inf"), 0.0]])
    assert torch.equal(bias, expected)  # -inf only strictly after the key, never NaN
    assert not torch.isnan(bias).any()


def test_distillation_terms_reference() -> None:
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 4, 5, generator=g), torch.randn(2, 4, 5, generator=g)
    ids = torch.randint(0, 5, (2, 4), generator=g)
    ce, kl = distillation_terms(s, t, ids, torch.tensor([4, 3]))
    rows = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    ref_ce = np.mean([-torch.log_softmax(s[b, i], -1)[ids[b, i + 1]].item() for b, i in rows])
    ref_kl = np.mean([(torch.softmax(t[b, i], -1) * (torch.log_softmax(t[b, i], -1)
                                                        - torch.log_softmax(s[b, i], -1))).sum().item() for b, i in rows])
    assert float(ce) == pytest.approx(ref_ce, rel=1e-5) and float(kl) == pytest.approx(ref_kl, rel=1e-5)
    assert float(distillation_terms(t, t, ids)[1]) == pytest.approx(0.0, abs=1e-6)


# ---------------------------------------------------------------- bias == eviction in the limit


class FixedGates:
    """Stand-in gates: preset ``log beta`` per layer ``(1, T, hk)`` (the hooks only read spec and log_beta)."""

    def __init__(self, spec: GateSpec, lbs: list[torch.Tensor]) -> None:
        self.spec, self.lbs = spec, lbs

    def log_beta(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.lbs[layer][:, : hidden.shape[1]]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bias_with_beta_one_changes_nothing_and_beta_zero_is_eviction(family: str) -> None:
    from evictlab.decode.compress import attach_model
    from evictlab.kv.cache import EvictionCache
    from evictlab.kv.paged import PagedKVStore
    from evictlab.models.geometry import model_geometry

    model, _ = tiny_model(family)
    geo = model_geometry(model)
    spec = GateSpec(n_layers=geo.n_layers, hidden_size=64, kv_heads=geo.kv_heads)
    T, victim, layer, head = 24, 5, 1, 1
    ids = torch.randint(3, 256, (1, T), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        ones = [torch.zeros(1, T, geo.kv_heads) for _ in range(geo.n_layers)]
        with gated_attention(model, FixedGates(spec, ones)):
            same = model(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(same, plain, rtol=0, atol=1e-6)  # beta = 1: no change
        lbs = [torch.zeros(1, T, geo.kv_heads) for _ in range(geo.n_layers)]
        lbs[layer][0, victim, head] = float("-inf")  # beta -> 0 for one entry of one cell
        with gated_attention(model, FixedGates(spec, lbs)):
            gated = model(input_ids=ids, use_cache=False).logits
        # The same entry evicted for real: feed up to it, drop it from that cell of the paged store, feed the rest.
        store = PagedKVStore(geo.n_layers, 1, geo.kv_heads, geo.head_dim, capacity_blocks=64, block_size=4)
        cache = EvictionCache(store)
        with attach_model(model, cache):
            first = model(input_ids=ids[:, :victim + 1], cache=cache, use_cache=True).logits
            n = int(store.lengths(layer)[0, head])
            keep = [[torch.arange(n) if h != head else torch.tensor([j for j in range(n) if j != victim])
                     for h in range(geo.kv_heads)]]
            store.keep(layer, keep)
            rest = model(input_ids=ids[:, victim + 1:], cache=cache, use_cache=True).logits
    evicted = torch.cat([first, rest], 1)
    torch.testing.assert_close(gated, evicted, rtol=1e-4, atol=1e-5)
    assert (gated[0, victim + 1:] - plain[0, victim + 1:]).abs().max() > 1e-3  # the eviction mattered
    torch.testing.assert_close(gated[:, : victim + 1], plain[:, : victim + 1], rtol=0, atol=1e-6)


def test_bias_reaches_the_gates_gradient_and_hooks_are_removed() -> None:
    model, _ = tiny_model("qwen2")
    spec = GateSpec.for_model(model, intermediate=8)
    gates = RetentionGates(spec, seed=2)
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for p in model.parameters():
        p.requires_grad_(False)
    with gated_attention(model, gates) as record:
        out = model(input_ids=ids, use_cache=False).logits
    assert set(record) == {0, 1} and record[0].shape == (2, 16, spec.kv_heads)
    out.logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gates.parameters())
    assert gates.first[0].weight.grad.abs().sum() > 0
    from evictlab.models.sites import find_attention_sites

    assert all(not s.module._forward_pre_hooks for s in find_attention_sites(model))
    with pytest.raises(RuntimeError, match="boom"), gated_attention(model, gates):
        raise RuntimeError("boom")
    assert all(not s.module._forward_pre_hooks for s in find_attention_sites(model))
    seen: list[tuple[int, tuple[int, ...]]] = []
    with recording_gates(model, gates, lambda l, lb: seen.append((l, tuple(lb.shape)))):
        model(input_ids=ids, use_cache=False)
    assert seen == [(0, (2, 16, spec.kv_heads)), (1, (2, 16, spec.kv_heads))]
    assert all(not s.module._forward_pre_hooks for s in find_attention_sites(model))


def test_gates_for_another_model_are_refused() -> None:
    model, _ = tiny_model("llama")
    wrong = RetentionGates(GateSpec(n_layers=3, hidden_size=64, kv_heads=2))
    with pytest.raises(InputError, match="3 layers x 2 KV heads.*model has 2 x 2"):
        with gated_attention(model, wrong):
            pass


# ---------------------------------------------------------------- the side table


def test_log_beta_table_follows_the_paged_store() -> None:
    """Random appends and keeps on a real paged store: the table always holds exactly the
    store's entries per cell, with the values recorded when they were appended."""
    from evictlab.kv.paged import PagedKVStore

    rng = np.random.default_rng(0)
    n_layers, b, hk, d = 2, 2, 3, 4
    store = PagedKVStore(n_layers, b, hk, d, capacity_blocks=400, block_size=4)
    table = LogBetaTable(n_layers)
    truth: dict[tuple[int, int, int, int], float] = {}  # (layer, b, h, position) -> log beta
    seen = 0
    for _ in range(12):
        q = int(rng.integers(1, 6))
        pos = torch.arange(seen, seen + q)
        for l in range(n_layers):
            lb = -torch.rand(b, q, hk, generator=torch.Generator().manual_seed(seen * 10 + l))
            held = store.layout_positions(l, torch.empty(0, dtype=torch.int64))
            table.record(l, held, pos, lb)
            store.append(l, torch.randn(b, hk, q, d), torch.randn(b, hk, q, d), pos)
            for i in range(b):
                for h in range(hk):
                    for k in range(q):
                        truth[(l, i, h, seen + k)] = float(lb[i, k, h])
        seen += q
        for l in range(n_layers):  # evict a random subset of every cell
            lens = store.lengths(l)
            keep = [[torch.from_numpy(np.sort(rng.choice(int(lens[i, h]), size=int(lens[i, h]) * 2 // 3,
                                                         replace=False))) for h in range(hk)] for i in range(b)]
            store.keep(l, keep)
        for l in range(n_layers):
            _, _, held = store.gather(l)
            for i in range(b):
                for h in range(hk):
                    p = held[i, h][held[i, h] >= 0]
                    got = table.lookup(l, p, (i, h))[0, 0]
                    assert torch.equal(got, torch.tensor([truth[(l, i, h, int(x))] for x in p]))
            assert table.next_position[l] == seen
    # After one more sync the table drops what the store evicted: its size is the store's.
    for l in range(n_layers):
        table.record(l, store.layout_positions(l, torch.empty(0, dtype=torch.int64)), torch.empty(0, dtype=torch.int64),
                     torch.empty(b, 0, hk))
    assert table.held_entries() == store.total_live()
    with pytest.raises(RuntimeError, match="no log beta was recorded"):
        table.lookup(0, torch.tensor([seen + 5]), (0, 0))

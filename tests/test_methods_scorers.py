"""Each scorer against a short explicit reference on seeded random tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from evictlab.errors import InputError
from evictlab.methods import REGISTRY, ScoreInputs, Scorer, make_scorer
from evictlab.methods.scorers import (
    H2O,
    Compactor,
    ExpectedAttention,
    KVzip,
    Oracle,
    SnapKV,
    StreamingLLM,
    rope_rotate,
)
from evictlab.methods.testing import scorers_on_tensors

B, HQ, HK, D = 2, 4, 2, 8
G = HQ // HK
SCALE = D ** -0.5


def make_inputs(s: int = 24, q: int = 6, m: int = 5, seed: int = 0, start: int = 0) -> ScoreInputs:
    """A layer holding keys at positions start..start+s-1; the chunk is the last q of them."""
    g = torch.Generator().manual_seed(seed)
    return ScoreInputs(
        layer=1,
        n_layers=3,
        keys=torch.randn(B, HK, s, D, generator=g),
        values=torch.randn(B, HK, s, D, generator=g),
        positions=torch.arange(start, start + s),
        queries=torch.randn(B, HQ, q, D, generator=g),
        q_positions=torch.arange(start + s - q, start + s),
        scaling=SCALE,
        extra_queries=torch.randn(B, HQ, m, D, generator=g),
    )


def ref_softmax_row(qv: np.ndarray, keys: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Attention of one query over one head's keys, the masked ones getting 0."""
    logits = np.where(visible, keys @ qv * SCALE, -np.inf)
    e = np.exp(logits - logits[visible].max())
    return e / e.sum()


def ref_attention(inp: ScoreInputs, queries: torch.Tensor, qpos: np.ndarray | None) -> np.ndarray:
    """(b, hq, q, s) by loops; query head h uses KV head h // G."""
    q, k = queries.double().numpy(), inp.keys.double().numpy()
    kpos = inp.positions.numpy()
    out = np.zeros((B, HQ, q.shape[2], k.shape[2]))
    for b in range(B):
        for h in range(HQ):
            for t in range(q.shape[2]):
                vis = np.ones(k.shape[2], bool) if qpos is None else kpos <= qpos[t]
                out[b, h, t] = ref_softmax_row(q[b, h, t], k[b, h // G], vis)
    return out


def group_mean(x: np.ndarray) -> np.ndarray:
    return np.stack([x[:, j * G:(j + 1) * G].mean(1) for j in range(HK)], axis=1)


def test_registry_complete_and_protocol() -> None:
    assert set(REGISTRY) == {"streaming_llm", "h2o", "snapkv", "expected_attention", "kvzip", "compactor", "oracle",
                             "oracle_labels", "trimkv"}
    # trimkv needs a model's gates, oracle_labels a task's labels
    assert scorers_on_tensors() == sorted(set(REGISTRY) - {"trimkv", "oracle_labels"})
    with pytest.raises(InputError, match="oracle_labels has no labels"):
        REGISTRY["oracle_labels"]().score(make_inputs())
    with pytest.raises(InputError, match="trimkv needs trained gates"):
        REGISTRY["trimkv"]()
    for name in scorers_on_tensors():
        sc = REGISTRY[name]()
        assert isinstance(sc, Scorer) and sc.name == name
        out = sc.score(make_inputs())
        assert out.shape == (B, HK, 24) and out.dtype == torch.float32
        assert torch.isfinite(out).all()
    assert REGISTRY["kvzip"]().needs == {"reconstruction"}
    assert REGISTRY["oracle"]().needs == {"future"}
    assert REGISTRY["snapkv"]().needs == frozenset()


def test_make_scorer_rejects_unknown() -> None:
    with pytest.raises(InputError, match="scorer: unknown scorer 'nope'"):
        make_scorer("nope")
    with pytest.raises(InputError, match="scorer_param: scorer snapkv has no parameter windw.*kernel, pooling, window"):
        make_scorer("snapkv", windw=3)


def test_streaming_llm_is_position() -> None:
    inp = make_inputs(start=10)
    out = StreamingLLM().score(inp)
    assert torch.equal(out[1, 0], torch.arange(10, 34, dtype=torch.float32))


def test_snapkv_matches_explicit_softmax_and_pooling() -> None:
    inp = make_inputs(s=24, q=8)
    window, kernel = 4, 3
    out = SnapKV(window=window, kernel=kernel).score(inp).double().numpy()
    qpos = inp.q_positions.numpy()[-window:]
    att = ref_attention(inp, inp.queries[:, :, -window:], qpos).mean(axis=2)  # (b, hq, s)
    n_past = 24 - window
    pooled = np.zeros((B, HQ, n_past))
    for i in range(n_past):  # zero-padded average, count_include_pad like F.avg_pool1d
        lo, hi = max(0, i - 1), min(n_past, i + 2)
        pooled[..., i] = att[..., lo:hi].sum(-1) / kernel
    ref = group_mean(pooled)
    np.testing.assert_allclose(out[..., :n_past], ref, rtol=1e-5, atol=1e-7)
    for b in range(B):  # window keys: the batch item's largest past score (items are independent)
        assert np.allclose(out[b, :, n_past:], ref[b].max())


def test_snapkv_pools_over_past_keys_in_held_order_whatever_the_positions() -> None:
    """Keys held out of position order (allowed by the contract): the keys before the window
    are pooled as the compacted sequence of them in held order, the others get the max."""
    inp = make_inputs(s=20, q=6, seed=3)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    inp.positions = inp.positions[perm]
    window, kernel = 6, 5
    out = SnapKV(window=window, kernel=kernel).score(inp).double().numpy()
    qpos = inp.q_positions.numpy()[-window:]
    att = ref_attention(inp, inp.queries[:, :, -window:], qpos).mean(axis=2)
    past = np.flatnonzero(inp.positions.numpy() < qpos.min())
    pooled = np.stack([att[..., past[max(0, i - 2):i + 3]].sum(-1) / kernel for i in range(len(past))], -1)
    ref = group_mean(pooled)
    np.testing.assert_allclose(out[..., past], ref, rtol=1e-5, atol=1e-7)
    rest = np.setdiff1d(np.arange(20), past)
    for b in range(B):
        assert np.allclose(out[b][:, rest], ref[b].max())


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv_score_cells_equals_one_call_per_cell(pooling: str) -> None:
    """The decode loop scores a layer's cells in one call (stacked on the batch axis, one
    positions row each): identical to scoring them one by one."""
    g = torch.Generator().manual_seed(7)
    s, q, d, rep = 30, 12, 8, 3
    qpos = torch.arange(100, 112)
    cells = []
    for c in range(4):
        pos = torch.sort(torch.randperm(100, generator=g)[:s - 8]).values
        pos = torch.cat([pos, torch.arange(104, 112)])  # the last 8 held keys are inside the window
        cells.append(ScoreInputs(layer=0, n_layers=1, keys=torch.randn(1, 1, s, d, generator=g),
                                 values=torch.randn(1, 1, s, d, generator=g), positions=pos,
                                 queries=torch.randn(1, rep, q, d, generator=g), q_positions=qpos, scaling=SCALE))
    sc = SnapKV(window=8, kernel=5, pooling=pooling)
    for one, many in zip([sc.score(c) for c in cells], sc.score_cells(cells)):
        torch.testing.assert_close(many, one, rtol=1e-6, atol=1e-7)


def test_snapkv_max_pool() -> None:
    inp = make_inputs(s=16, q=4)
    out = SnapKV(window=4, kernel=3, pooling="max").score(inp).double().numpy()
    att = ref_attention(inp, inp.queries, inp.q_positions.numpy()).mean(axis=2)[..., :12]
    pooled = np.stack([att[..., max(0, i - 1):i + 2].max(-1) for i in range(12)], -1)
    np.testing.assert_allclose(out[..., :12], group_mean(pooled), rtol=1e-5)


def test_snapkv_rejects_even_kernel() -> None:
    with pytest.raises(InputError, match="kernel"):
        SnapKV(kernel=4)


def test_h2o_two_chunks_equal_one_pass() -> None:
    full = make_inputs(s=20, q=20)
    one = H2O().score(full)
    ref = group_mean(ref_attention(full, full.queries, full.q_positions.numpy()).sum(axis=2))
    np.testing.assert_allclose(one.double().numpy(), ref, rtol=1e-5, atol=1e-7)
    # Same keys and queries in two chunks of 12 + 8, state carried by the caller.
    state: dict = {}
    h2o = H2O()
    first = ScoreInputs(1, 3, full.keys[:, :, :12], full.values[:, :, :12], full.positions[:12],
                        full.queries[:, :, :12], full.q_positions[:12], SCALE, state=state)
    h2o.score(first)
    second = ScoreInputs(1, 3, full.keys, full.values, full.positions, full.queries[:, :, 12:],
                         full.q_positions[12:], SCALE, state=state)
    two = h2o.score(second)
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-6)


def test_h2o_carries_scores_across_eviction_by_position() -> None:
    full = make_inputs(s=12, q=12)
    state: dict = {}
    h2o = H2O()
    first = h2o.score(ScoreInputs(0, 1, full.keys, full.values, full.positions, full.queries,
                                  full.q_positions, SCALE, state=state))
    kept = torch.tensor([0, 3, 7, 11])
    g = torch.Generator().manual_seed(5)
    new_k, new_v = torch.randn(B, HK, 2, D, generator=g), torch.randn(B, HK, 2, D, generator=g)
    keys = torch.cat([full.keys[:, :, kept], new_k], dim=2)
    pos = torch.cat([kept, torch.tensor([12, 13])])
    q = torch.randn(B, HQ, 2, D, generator=g)
    inp = ScoreInputs(0, 1, keys, torch.cat([full.values[:, :, kept], new_v], 2), pos, q,
                      torch.tensor([12, 13]), SCALE, state=state)
    second = h2o.score(inp)
    added = group_mean(ref_attention(inp, q, np.array([12, 13])).sum(axis=2))
    expect = np.concatenate([first[..., kept].double().numpy(), np.zeros((B, HK, 2))], -1) + added
    np.testing.assert_allclose(second.double().numpy(), expect, rtol=1e-5, atol=1e-7)


def test_oracle_is_explicit_future_attention() -> None:
    inp = make_inputs()
    out = Oracle().score(inp).double().numpy()
    ref = group_mean(ref_attention(inp, inp.extra_queries, None).mean(axis=2))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-7)


def test_kvzip_is_group_max_of_query_max() -> None:
    inp = make_inputs()
    out = KVzip().score(inp).double().numpy()
    att = ref_attention(inp, inp.extra_queries, None).max(axis=2)  # (b, hq, s)
    ref = np.stack([att[:, j * G:(j + 1) * G].max(1) for j in range(HK)], axis=1)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-7)


def test_needs_extra_queries_raise() -> None:
    inp = make_inputs()
    inp.extra_queries = None
    for sc in (KVzip(), Oracle()):
        with pytest.raises(InputError, match="extra_queries"):
            sc.score(inp)


def test_kvzip_reconstruction_ids() -> None:
    class Tok:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) % 50 for c in text]

    ctx = torch.tensor([[7, 8, 9], [1, 2, 3]])
    ids = KVzip().reconstruction_ids(ctx, Tok())
    assert ids.shape == (2, len(Tok().encode("\n\nRepeat the previous context exactly.")) + 3)
    assert torch.equal(ids[:, -3:], ctx)


def rope_matrix(pos: int, theta: float) -> np.ndarray:
    """Explicit (d, d) RoPE rotation (half-split pairing i <-> i + d/2)."""
    r = np.zeros((D, D))
    for i in range(D // 2):
        a = pos * theta ** (-2 * i / D)
        r[i, i], r[i, i + D // 2] = math.cos(a), -math.sin(a)
        r[i + D // 2, i], r[i + D // 2, i + D // 2] = math.sin(a), math.cos(a)
    return r


def test_rope_rotate_matches_matrix_and_inverts() -> None:
    x = torch.randn(3, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(3, 8)
    y = rope_rotate(x, pos, 500.0)
    for t in range(5):
        np.testing.assert_allclose(y[:, t].numpy(), x[:, t].numpy() @ rope_matrix(int(pos[t]), 500.0).T, atol=1e-12)
    torch.testing.assert_close(rope_rotate(y, -pos, 500.0), x)


def test_expected_attention_matches_explicit_formula() -> None:
    theta, n_future, n_sink = 300.0, 7, 2
    inp = make_inputs(s=20, q=10)
    # Build post-RoPE queries from known pre-RoPE ones, so the reference never undoes RoPE.
    pre = torch.randn(B, HQ, 10, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    inp.queries = rope_rotate(pre, inp.q_positions, theta).float()
    ea = ExpectedAttention(n_future=n_future, n_sink=n_sink, rope_theta=theta)
    out = ea.score(inp).double().numpy()
    last = int(inp.q_positions[-1])
    r_bar = np.mean([rope_matrix(last + t, theta) for t in range(1, n_future + 1)], axis=0)
    keys, vals = inp.keys.double().numpy(), inp.values.double().numpy()
    probs = np.zeros((B, HQ, 20))
    for b in range(B):
        for h in range(HQ):
            x = pre[b, h].numpy()  # positions 10..19, all >= n_sink
            mu = x.mean(0)
            cov = (x - mu).T @ (x - mu) / len(x)
            mu2, cov2 = r_bar @ mu, r_bar @ cov @ r_bar.T
            k = keys[b, h // G]
            logit = SCALE * k @ mu2 + 0.5 * SCALE**2 * np.einsum("si,ij,sj->s", k, cov2, k)
            probs[b, h] = np.exp(logit - logit.max()) / np.exp(logit - logit.max()).sum()
    ref = group_mean(probs) * np.linalg.norm(vals, axis=-1)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-8)


def test_expected_attention_point_mass_is_next_query_attention() -> None:
    """Identical queries, one future step, no covariance: the next query's true attention."""
    theta = 1000.0
    inp = make_inputs(s=16, q=6)
    pre = torch.randn(B, HQ, 1, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    inp.queries = rope_rotate(pre.expand(B, HQ, 6, D), inp.q_positions, theta).float()
    out = ExpectedAttention(n_future=1, n_sink=0, use_vnorm=False, rope_theta=theta).score(inp)
    nxt = rope_rotate(pre, torch.tensor([16]), theta).float()
    ref = group_mean(ref_attention(inp, nxt, None)[:, :, 0])
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=1e-5, atol=1e-7)


def zscore(x: np.ndarray) -> np.ndarray:
    flat = x.reshape(x.shape[0], -1)
    return (x - flat.mean(1)[:, None, None]) / flat.std(1, ddof=1)[:, None, None]


def test_compactor_matches_explicit_leverage_and_attention() -> None:
    theta = 200.0
    inp = make_inputs(s=20, q=6)
    out = Compactor(blend=0.5, rope_theta=theta).score(inp).double().numpy()
    keys = inp.keys.double().numpy()
    lev = np.zeros((B, HK, 20))
    for b in range(B):
        for h in range(HK):
            x = np.stack([rope_matrix(-t, theta) @ keys[b, h, t] for t in range(20)])
            x = x - x.mean(0)
            lev[b, h] = np.diag(x @ np.linalg.pinv(x.T @ x) @ x.T)
    att = group_mean(ref_attention(inp, inp.queries, None).sum(axis=2)) * np.linalg.norm(inp.values.double().numpy(), axis=-1)
    padded = np.pad(att, ((0, 0), (0, 0), (1, 1)))
    pooled = (padded[..., :-2] + padded[..., 1:-1] + padded[..., 2:]) / 3
    ref = 0.5 * zscore(lev) + zscore(pooled)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_compactor_sketch_is_deterministic_and_close() -> None:
    inp = make_inputs(s=40)
    a = Compactor(sketch_dim=6, seed=1).leverage(inp.keys, inp.positions)
    b = Compactor(sketch_dim=6, seed=1).leverage(inp.keys, inp.positions)
    exact = Compactor().leverage(inp.keys, inp.positions)
    assert torch.equal(a, b)
    # Leverage sums to the rank: min(s - 1, d) after centring (exact), sketch_dim (sketched).
    torch.testing.assert_close(exact.sum(-1), torch.full((B, HK), float(D), dtype=torch.float64), atol=1e-8, rtol=0)
    torch.testing.assert_close(a.sum(-1), torch.full((B, HK), 6.0, dtype=torch.float64), atol=1e-8, rtol=0)


@pytest.mark.parametrize("name", scorers_on_tensors())
def test_scorers_deterministic_and_batch_independent(name: str) -> None:
    inp = make_inputs(seed=7)
    a = REGISTRY[name]().score(make_inputs(seed=7))
    b = REGISTRY[name]().score(make_inputs(seed=7))
    assert torch.equal(a, b)
    single = ScoreInputs(inp.layer, inp.n_layers, inp.keys[:1], inp.values[:1], inp.positions,
                         inp.queries[:1], inp.q_positions, SCALE, inp.extra_queries[:1])
    torch.testing.assert_close(REGISTRY[name]().score(single), a[:1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", scorers_on_tensors())
@pytest.mark.parametrize(("hk", "g"), [(1, 1), (1, 3), (3, 2)])
def test_gqa_group_of_copies_equals_one_head(name: str, hk: int, g: int) -> None:
    """A group whose query heads are identical copies scores like a single head (MHA)."""
    gen = torch.Generator().manual_seed(11)
    s, q, m = 18, 5, 4
    keys, values = torch.randn(1, hk, s, D, generator=gen), torch.randn(1, hk, s, D, generator=gen)
    one_q, one_x = torch.randn(1, hk, q, D, generator=gen), torch.randn(1, hk, m, D, generator=gen)
    pos, qpos = torch.arange(s), torch.arange(s - q, s)
    mha = ScoreInputs(0, 1, keys, values, pos, one_q, qpos, SCALE, one_x)
    gqa = ScoreInputs(0, 1, keys, values, pos, one_q.repeat_interleave(g, dim=1), qpos, SCALE,
                      one_x.repeat_interleave(g, dim=1))
    a, b = REGISTRY[name]().score(mha), REGISTRY[name]().score(gqa)
    assert b.shape == (1, hk, s)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", scorers_on_tensors())
def test_scorers_and_select_keep_on_cuda_match_cpu(name: str) -> None:
    cpu = make_inputs(seed=12)
    dev = ScoreInputs(cpu.layer, cpu.n_layers, cpu.keys.cuda(), cpu.values.cuda(), cpu.positions.cuda(),
                      cpu.queries.cuda(), cpu.q_positions.cuda(), SCALE, cpu.extra_queries.cuda())
    a, b = REGISTRY[name]().score(cpu), REGISTRY[name]().score(dev)
    assert b.device.type == "cuda"
    torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5)
    from evictlab.methods import select_keep

    keep = select_keep(b, [10, 12], dev.positions, sinks=2, recent=3)
    assert keep[0][0].device.type == "cuda" and len(keep[1][1]) == 12

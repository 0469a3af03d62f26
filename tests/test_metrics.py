"""Decode metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from evictlab.decode.metrics import aggregate_exact_match, next_token_kl, perplexity, token_nll, top1_agreement
from evictlab.errors import InputError


def test_perplexity_uniform_is_vocab_size() -> None:
    logits = torch.zeros(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(0))
    assert perplexity(logits, targets) == pytest.approx(7.0)


def test_perplexity_hand_computed() -> None:
    # p(target) = 1/2 at position 0 and 1/4 at position 1 -> ppl = exp((ln 2 + ln 4) / 2) = sqrt(8)
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]]]))
    targets = torch.tensor([[0, 2]])
    np.testing.assert_allclose(token_nll(logits, targets).numpy(), [[math.log(2), math.log(4)]])
    assert perplexity(logits, targets) == pytest.approx(math.sqrt(8))
    assert perplexity(logits, targets, mask=torch.tensor([[False, True]])) == pytest.approx(4.0)


def test_token_nll_shape_error() -> None:
    with pytest.raises(InputError, match="targets"):
        token_nll(torch.zeros(1, 4, 3), torch.zeros(1, 5, dtype=torch.long))


def test_kl_identical_is_zero_and_known_case() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 11, generator=g)
    r = next_token_kl(x, x.clone())
    assert r.per_token.shape == (3, 4)
    assert r.mean == 0.0 and (r.per_token == 0).all()
    # Shifting all logits by a constant changes nothing.
    assert next_token_kl(x, x + 3.0).mean == pytest.approx(0.0, abs=1e-12)
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3).
    p = torch.log(torch.tensor([[0.5, 0.5]]))
    q = torch.log(torch.tensor([[0.25, 0.75]]))
    expect = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    assert next_token_kl(p, q).mean == pytest.approx(expect)
    # Asymmetric: KL(q || p) differs.
    assert next_token_kl(q, p).mean == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5))


def test_kl_matches_explicit_sum_and_mask() -> None:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 6, 9, generator=g), torch.randn(2, 6, 9, generator=g)
    p = torch.softmax(a.double(), -1).numpy()
    q = torch.softmax(b.double(), -1).numpy()
    ref = (p * np.log(p / q)).sum(-1)
    r = next_token_kl(a, b)
    np.testing.assert_allclose(r.per_token.numpy(), ref, rtol=1e-10)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, 2:] = True
    assert r.mean == pytest.approx(ref.mean())
    assert next_token_kl(a, b, mask).mean == pytest.approx(ref[1, 2:].mean())


def test_kl_handles_zero_probability_in_full() -> None:
    p = torch.tensor([[0.0, -float("inf")]])  # p = (1, 0)
    q = torch.log(torch.tensor([[0.5, 0.5]]))
    assert next_token_kl(p, q).mean == pytest.approx(math.log(2))


def test_top1_agreement() -> None:
    full = torch.tensor([[[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [1.0, 1.0, 5.0], [0.0, 0.0, 0.0]]])
    comp = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 1.0, 2.0], [0.0, 0.0, 9.0], [0.0, 0.0, 0.0]]])
    assert top1_agreement(full, comp) == pytest.approx(0.75)
    assert top1_agreement(full, full) == 1.0
    assert top1_agreement(full, comp, torch.tensor([[False, True, True, False]])) == pytest.approx(0.5)
    with pytest.raises(InputError, match="compressed_logits"):
        top1_agreement(full, comp[:, :2])


def test_aggregate_exact_match() -> None:
    df = aggregate_exact_match(["needle", "needle", "multi_key", "needle"], [1.0, 0.0, 1.0, 1.0])
    rows = {r["task"]: r for r in df.iter_rows(named=True)}
    assert rows["needle"]["n"] == 3 and rows["needle"]["exact_match"] == pytest.approx(2 / 3)
    assert rows["needle"]["stderr"] == pytest.approx(np.std([1, 0, 1], ddof=1) / math.sqrt(3))
    assert rows["multi_key"]["stderr"] == 0.0
    assert rows["all"]["n"] == 4 and rows["all"]["exact_match"] == pytest.approx(0.75)
    assert df.columns == ["task", "n", "exact_match", "stderr"]
    with pytest.raises(InputError, match="scores"):
        aggregate_exact_match(["needle"], [1.0, 0.0])

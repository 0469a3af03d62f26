"""The two protocols of the decode loop, checked on what the rankings saw.

query-agnostic: no compression's queries reach the question (every recorded query
position is inside the context); query-aware: every compression that fixes the kept set has
the question's queries in view, whatever the chunk size, and nothing is compressed before
that. Spies are scorers registered for the test that record the query positions they get.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from evictlab.capture.testing import tiny_model
from evictlab.decode.config import DecodeConfig
from evictlab.decode.loop import run_sequence
from evictlab.errors import InputError
from evictlab.kv.budget import Budget, kv_bytes
from evictlab.methods import registry, scorers
from evictlab.methods.base import ScoreInputs

N_CTX, N_Q, N_ANS = 200, 12, 3
CALLS: list[dict[str, int]] = []


@dataclass
class SpySnapKV(scorers.SnapKV):
    """SnapKV (the last ``window`` queries) that records the query positions of every call."""

    name: str = "spy_snapkv"

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        CALLS.append({"layer": inputs.layer, "q_min": int(inputs.q_positions.min()),
                      "q_max": int(inputs.q_positions.max()), "n_q": int(inputs.q_positions.numel()),
                      "cells": int(inputs.keys.shape[0])})
        return super().score(inputs)


@dataclass
class SpyH2O(scorers.H2O):
    """H2O (every query since its previous call) that records the query positions."""

    name: str = "spy_h2o"
    uses_all_queries: ClassVar[bool] = True

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        CALLS.append({"layer": inputs.layer, "q_min": int(inputs.q_positions.min()),
                      "q_max": int(inputs.q_positions.max()), "n_q": int(inputs.q_positions.numel()),
                      "cells": int(inputs.keys.shape[0])})
        return super().score(inputs)


@pytest.fixture(autouse=True)
def spies(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(registry.REGISTRY, "spy_snapkv", SpySnapKV)
    monkeypatch.setitem(registry.REGISTRY, "spy_h2o", SpyH2O)
    CALLS.clear()
    yield
    CALLS.clear()


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    model, _ = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(3, 256, (1, N_CTX), generator=g)
    q = torch.randint(3, 256, (1, N_Q), generator=g)
    q2 = torch.randint(3, 256, (1, N_Q), generator=g)
    a = torch.randint(3, 256, (1, N_ANS), generator=g)
    return model, ctx, q, q2, a


def _cfg(**kw) -> DecodeConfig:
    base = dict(mode="physical", budget=Budget("tokens_per_cell", 40), scorer="spy_snapkv", allocator="adakv",
                chunk_size=48, compress_every=8, block_size=8, sinks=2, recent=8, window=8)
    base.update(kw)
    return DecodeConfig(**base)


def _phases(out) -> list[str]:  # noqa: ANN001
    return [t.phase for t in out.trace]


@pytest.mark.parametrize("scorer", ["spy_snapkv", "spy_h2o"])
@pytest.mark.parametrize("chunk", [8, 48, 64, 199, 200, 205, 4096])
def test_query_aware_rankings_see_the_question_for_any_chunk(setup, scorer: str, chunk: int) -> None:
    model, ctx, q, _, a = setup
    out = run_sequence(model, ctx, q, _cfg(scorer=scorer, chunk_size=chunk, query_aware=True), answer_ids=a)
    assert CALLS, "no compression ran"
    # one compression, after the whole prefix was fed: every (layer, KV head) cell scored once
    # (SnapKV may stack a layer's cells into one call: count cells, not calls)
    assert out.compressions == 1 and sum(c["cells"] for c in CALLS) == 2 * 2
    assert {c["layer"] for c in CALLS} == {0, 1}
    for c in CALLS:
        assert c["q_max"] == N_CTX + N_Q - 2  # the question's last-but-one token: in view
        assert c["q_max"] >= N_CTX
    if scorer == "spy_h2o":  # every query since the start: context and question
        assert all(c["q_min"] == 0 and c["n_q"] == N_CTX + N_Q - 1 for c in CALLS)
    else:  # the observation window is the question's tail
        assert all(c["q_min"] >= N_CTX and c["n_q"] == 8 for c in CALLS)
    # nothing compressed before the question: the only "compress" precedes the last token
    phases = _phases(out)
    assert phases.count("compress") == 1
    assert phases.index("compress") < phases.index("question")
    assert "compress" not in phases[:phases.index("compress")]


@pytest.mark.parametrize("scorer", ["spy_snapkv", "spy_h2o"])
@pytest.mark.parametrize("chunk", [8, 48, 199, 4096])
def test_query_agnostic_rankings_never_see_the_question(setup, scorer: str, chunk: int) -> None:
    model, ctx, q, _, a = setup
    out = run_sequence(model, ctx, q, _cfg(scorer=scorer, chunk_size=chunk), answer_ids=a)
    assert CALLS and out.compressions >= 1
    assert all(c["q_max"] < N_CTX for c in CALLS), CALLS
    phases = _phases(out)
    assert max(i for i, p in enumerate(phases) if p == "compress") < phases.index("question")


def test_query_aware_kept_set_depends_on_the_question_and_not_on_the_chunk(setup) -> None:
    model, ctx, q, q2, a = setup
    kept = {}
    for chunk in (8, 48, 4096):
        for name, question in (("q", q), ("q2", q2)):
            for aware in (False, True):
                out = run_sequence(model, ctx, question, _cfg(chunk_size=chunk, query_aware=aware), answer_ids=a)
                kept[(chunk, name, aware)] = out.context_kept
    same = lambda x, y: all(torch.equal(u, v) for u, v in zip(x, y))  # noqa: E731
    for chunk in (8, 48, 4096):
        assert same(kept[(chunk, "q", False)], kept[(chunk, "q2", False)])  # agnostic: question-blind
        assert not same(kept[(chunk, "q", True)], kept[(chunk, "q2", True)])  # aware: it matters
    # Query-aware: one compression over the same prefix, so the chunk size does not matter.
    assert same(kept[(8, "q", True)], kept[(4096, "q", True)])
    assert same(kept[(48, "q", True)], kept[(4096, "q", True)])


def test_query_aware_holds_the_prefix_and_agnostic_the_budget_plus_a_chunk(setup) -> None:
    model, ctx, q, _, a = setup
    per_entry = kv_bytes(1, 16, torch.float32)
    cells = 2 * 2
    aware = run_sequence(model, ctx, q, _cfg(query_aware=True), answer_ids=a)
    agnostic = run_sequence(model, ctx, q, _cfg(), answer_ids=a)
    assert aware.peak("bytes_live") == (N_CTX + N_Q - 1) * cells * per_entry
    assert agnostic.peak("bytes_live") <= (40 + 48) * cells * per_entry
    # after its compression each holds the budget
    assert aware.after_compression("live_tokens") == agnostic.after_compression("live_tokens") == 40 * cells
    # masked and physical keep the same entries under query-aware too
    masked = run_sequence(model, ctx, q, _cfg(query_aware=True, mode="masked"), answer_ids=a)
    torch.testing.assert_close(masked.logits, aware.logits, rtol=1e-4, atol=1e-4)


def test_every_answer_logit_comes_from_the_compressed_cache(setup) -> None:
    """Query-aware: the first answer logit is computed after the compression (the last
    question token goes through the compressed cache), so it differs from the full cache's."""
    model, ctx, q, _, a = setup
    full = run_sequence(model, ctx, q, DecodeConfig(mode="full"), answer_ids=a)
    aware = run_sequence(model, ctx, q, _cfg(query_aware=True, budget=Budget("tokens_per_cell", 24)), answer_ids=a)
    assert not torch.allclose(full.logits[:, 0], aware.logits[:, 0], atol=1e-3)
    # and with a budget above everything, the protocol changes nothing
    big = run_sequence(model, ctx, q, _cfg(query_aware=True, budget=Budget("tokens_per_cell", 1000)), answer_ids=a)
    torch.testing.assert_close(big.logits, full.logits, rtol=1e-4, atol=1e-4)


def test_query_aware_refuses_a_one_token_question(setup) -> None:
    model, ctx, q, _, a = setup
    with pytest.raises(InputError, match="question"):
        run_sequence(model, ctx, q[:, :1], _cfg(query_aware=True), answer_ids=a)


def test_query_aware_on_sliding_layers_drops_only_the_window(setup) -> None:
    """Tiny Gemma 3 (layer 0 slides, window 8): before the question nothing is ranked, but
    out-of-window entries are dropped after each chunk; physical == masked."""
    torch.set_num_threads(1)
    model, _ = tiny_model("gemma3")
    _, ctx, q, _, a = setup
    phys = run_sequence(model, ctx, q, _cfg(scorer="snapkv", query_aware=True, chunk_size=32), answer_ids=a)
    masked = run_sequence(model, ctx, q, _cfg(scorer="snapkv", query_aware=True, chunk_size=32, mode="masked"),
                          answer_ids=a)
    torch.testing.assert_close(phys.logits, masked.logits, rtol=1e-4, atol=1e-4)
    phases = _phases(phys)
    assert phases.count("compress") == 1 and "window" in phases[:phases.index("compress")]

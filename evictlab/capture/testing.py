"""Tiny random-initialised models of each supported family, built locally (no downloads).

Used by tests (capture exactness on Qwen2, OLMo2, Gemma 3, Llama) and by other packages'
tests that need a real transformers model with eager attention. Each model has 2 layers,
GQA (4 query / 2 KV heads), head dim 16 and a 256-token vocabulary, so a forward pass over a
few hundred tokens takes milliseconds. ``initializer_range`` is raised above the usual 0.02
so attention is peaked rather than uniform (a uniform row would hide indexing bugs).

The Gemma 3 config makes layer 0 a sliding-window layer with a window of 8 tokens and sets
``query_pre_attn_scalar`` to something other than head_dim, so tests exercise both the
window bounds and the non-default logit scale.
"""

from __future__ import annotations

from typing import Any

FAMILIES = ("llama", "qwen2", "olmo2", "gemma3")
TINY_VOCAB = 256
TINY_SLIDING_WINDOW = 8


def tiny_config(family: str) -> Any:
    """The transformers config of the tiny model of ``family``."""
    from evictlab.errors import InputError

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        initializer_range=0.2, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if family == "qwen2":
        from transformers import Qwen2Config

        # Qwen2 projections carry biases; keep the family's default
        return Qwen2Config(**common)
    if family == "olmo2":
        from transformers import Olmo2Config

        return Olmo2Config(**common)
    if family == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            **common, sliding_window=TINY_SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
        )
    raise InputError("family", f"unknown family {family!r}", f"use one of: {', '.join(FAMILIES)}")


def tiny_model(family: str, seed: int = 0, attn_implementation: str = "eager") -> tuple[Any, None]:
    """``(model, None)``: a random-initialised causal LM of ``family`` in eval mode.

    ``attn_implementation``: ``"eager"`` (default), ``"sdpa"`` or a registered name (evictlab's
    ragged attention: ``evictlab.kv.cache.register_ragged_attention()``), as
    :func:`evictlab.models.loading.load_model`; the weights depend on
    ``seed`` only. There is no tokenizer (None): feed token ids in ``[0, 256)`` directly.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from evictlab.models.loading import check_attn_implementation

    impl = check_attn_implementation(attn_implementation)
    config = tiny_config(family)
    # from_config draws initial weights from torch's global RNG; fork it so the caller's
    # RNG state is unchanged and the same seed always gives the same model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32)
    model.eval()
    return model, None


def save_tiny_folder(folder: Any, family: str = "olmo2", seed: int = 0) -> None:
    """Save the tiny model of ``family`` with a small word-level tokenizer as a local
    Hugging Face folder (``config.json``, weights, tokenizer files), so the real command
    line can load it with ``--model FOLDER`` (no download). Words outside the tokenizer's
    15-word vocabulary map to ``[UNK]``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model, _ = tiny_model(family, seed=seed)
    model.save_pretrained(str(folder))
    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>", "The", "grass", "is", "green", ".",
                                         "sky", "blue", "special", "magic", "number", "for", ":"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(str(folder))


class ByteTokenizer:
    """A byte-level stand-in tokenizer for the tiny models (ids = UTF-8 bytes, BOS = 1).

    Implements the one call evictlab's prompt code makes on a Hugging Face tokenizer,
    ``tok(text, add_special_tokens=...)["input_ids"]``, plus ``decode``, so capture runs
    on tiny models go through the same prompt-building code as on real ones.
    """

    bos_token_id = 1

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = list(text.encode("utf-8"))
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i != self.bos_token_id).decode("utf-8", errors="replace")


def check_against_eager(model: Any, tokens: list[int], store: Any, layers: list[int]) -> tuple[float, float]:
    """Errors of a captured dataset against the model's own eager attention, independently.

    Runs ``model`` on ``tokens`` with ``output_attentions=True`` and its own o_proj
    pre-hooks (not :class:`~evictlab.capture.hooks.AttentionCapture`), then for every row of
    ``store`` (a :class:`~evictlab.rows.reader.RowStore` of that prompt) on ``layers``
    returns ``(max |p - attentions|, max |mu - o_proj input| / max(1, max|v|))``. Keys
    outside a row's range count too (their eager weight must be 0). mu's error is
    relative to the largest value magnitude: float32 rounding of the model's own
    ``p @ V`` grows with |v| (Gemma 3's first layer has |v| up to ~100).
    """
    import numpy as np
    import polars as pl
    import torch

    from evictlab.models.sites import find_attention_sites

    head_out: dict[int, torch.Tensor] = {}
    handles = []
    for site in find_attention_sites(model):
        def pre(mod: Any, args: tuple[Any, ...], layer: int = site.layer, h: int = site.n_q_heads,
                d: int = site.head_dim) -> None:
            x = args[0]
            head_out[layer] = x.view(x.shape[0], x.shape[1], h, d)[0].transpose(0, 1).double()
        handles.append(site.o_proj.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tokens], device=model.device), output_attentions=True,
                        use_cache=False)
    finally:
        for hd in handles:
            hd.remove()
    worst_p = worst_mu = 0.0
    for batch in store.iter_batches(max_rows=2048, filter=pl.col("layer").is_in(layers)):
        m = batch.meta
        for i in range(batch.n_rows):
            layer, h, t = (int(m[c][i]) for c in ("layer", "q_head", "position"))
            p, V = batch.row(i)
            keys = batch.key_index[batch.p_off[i]:batch.p_off[i + 1]]
            ref = out.attentions[layer][0, h, t].double().cpu().numpy()
            worst_p = max(worst_p, float(np.abs(p - ref[keys]).max()))
            rest = np.delete(ref, keys)
            worst_p = max(worst_p, float(rest.max()) if rest.size else 0.0)
            scale = max(1.0, float(np.abs(V).max()))
            mu_ref = head_out[layer][h, t].cpu().numpy()
            worst_mu = max(worst_mu, float(np.abs(p @ V - mu_ref).max()) / scale)
    return worst_p, worst_mu

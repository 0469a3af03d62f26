"""KV stores: a paged store that frees evicted entries (physical; its block pool in
:mod:`evictlab.kv.blocks`), a masked store that only hides them (the audit of others), byte
accounting, attention (over ragged heads, and the attention probabilities of the scorers),
and the transformers ``Cache`` glue. See docs/kv.md."""

from evictlab.kv.attention import forced_attention_reference, grouped_attention, ragged_attention
from evictlab.kv.base import KVStore
from evictlab.kv.budget import Budget, ByteReport, kv_bytes
from evictlab.kv.masked import MaskedKVStore
from evictlab.kv.paged import PagedKVStore

__all__ = [
    "Budget",
    "ByteReport",
    "KVStore",
    "MaskedKVStore",
    "PagedKVStore",
    "forced_attention_reference",
    "grouped_attention",
    "kv_bytes",
    "ragged_attention",
]
